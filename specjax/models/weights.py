"""Reading HF-named checkpoint tensors into a family's params."""

from __future__ import annotations

from typing import Callable

import numpy as np

from specjax.errors import SpecjaxError


def tensor_taker(tensors: dict[str, np.ndarray]) -> Callable[[str, tuple[int, ...]], np.ndarray]:
  """`take(name, shape)`: pops an HF tensor, with clear errors for a missing one or a wrong shape."""

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = tensors.pop(name, None)
    if w is None:
      raise SpecjaxError(f'checkpoint is missing weight {name!r}')
    if w.shape != shape:
      raise SpecjaxError(f'weight {name!r} has shape {tuple(w.shape)}, config expects {shape}')
    return w

  return take
