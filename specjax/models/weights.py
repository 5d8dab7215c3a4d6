"""Reading HF-named checkpoint tensors into a family's params."""

from __future__ import annotations

from typing import Callable

import numpy as np

from specjax.errors import SpecjaxError


def tensor_taker(tensors: dict[str, np.ndarray]) -> Callable[[str, tuple[int, ...]], np.ndarray]:
  """`take(name, shape)`: pops an HF tensor, with clear errors for a missing one or a wrong shape."""

  def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(tensors, _IdTensors):
      return tensors.ids(name, shape)
    w = tensors.pop(name, None)
    if w is None:
      raise SpecjaxError(f'checkpoint is missing weight {name!r}')
    if w.shape != shape:
      raise SpecjaxError(f'weight {name!r} has shape {tuple(w.shape)}, config expects {shape}')
    return w

  return take


def unwrap_language_model(tensors: dict[str, np.ndarray], towers: tuple[str, ...]) -> None:
  """Text-model names for a multimodal wrapper's `model.language_model.*`; drops the tensors under `towers`."""
  for name in list(tensors):
    if name.startswith('model.language_model.'):
      tensors['model.' + name[len('model.language_model.') :]] = tensors.pop(name)
    elif name.startswith(towers):
      del tensors[name]


class _IdTensors(dict):
  """Stands in for a checkpoint's tensors: `take` hands out arrays of unique element ids."""

  def __init__(self):
    super().__init__()
    self.taken: dict[str, tuple[int, tuple[int, ...]]] = {}  # name -> (first id, shape)
    self.size = 0

  def ids(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    self.taken[name] = (self.size, tuple(shape))
    self.size += n
    return np.arange(self.size - n, self.size, dtype=np.int64).reshape(shape)


def _leaves(tree, prefix=()) -> dict[tuple, np.ndarray]:
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, prefix + (str(key),)).items()}
  return {prefix: tree}


def hf_shapes(mapping: Callable[[dict], dict]) -> dict[str, tuple[int, ...]]:
  """The HF tensor names and shapes a `params_from_hf`-style mapping reads (it runs on element-id arrays)."""
  tensors = _IdTensors()
  mapping(tensors)
  return {name: shape for name, (_, shape) in tensors.taken.items()}


def hf_from_params(mapping: Callable[[dict], dict], params: dict) -> dict[str, np.ndarray]:
  """The inverse of a `params_from_hf`-style mapping: the HF-named float32 tensors it turns into `params`.

  `mapping(tensors)` reads tensors through `tensor_taker` (and may transpose,
  split and concatenate them); it runs once on arrays of element ids, which
  says where each param element comes from.
  """
  tensors = _IdTensors()
  ids, values = _leaves(mapping(tensors)), _leaves(params)
  if ids.keys() != values.keys():
    raise ValueError(f'params do not match the mapping: {sorted(ids.keys() ^ values.keys())[:5]}')
  out = np.zeros(tensors.size, np.float32)
  for path, idx in ids.items():
    out[np.asarray(idx).reshape(-1)] = np.asarray(values[path], np.float32).reshape(-1)
  return {
      name: out[first : first + int(np.prod(shape))].reshape(shape) for name, (first, shape) in tensors.taken.items()
  }
