"""The loader-neutral form of a checkpoint.

Every loader (HF directory, hub id, GGUF file, demo package) returns a
`Checkpoint`: an HF-layout config dict, tensors under their HF names in PyTorch
layout (`Linear.weight` is `[out, in]`), the tokenizer, and generation settings.
The model families turn that into NNX params (`specjax.models.<family>`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from specjax.errors import SpecjaxError


@dataclasses.dataclass
class GenerationDefaults:
  """What `generation_config.json` (or GGUF metadata) says about decoding."""

  eos_token_ids: tuple[int, ...] = ()
  bos_token_id: int | None = None
  pad_token_id: int | None = None
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  min_p: float | None = None


@dataclasses.dataclass
class Checkpoint:
  config: dict[str, Any]  # HF `config.json` layout, with GGUF defaults filled in
  tensors: dict[str, np.ndarray]  # HF names, PyTorch layout, float32
  tokenizer: Any  # specjax.loading.tokenizer.Tokenizer
  generation: GenerationDefaults
  source: str  # where it came from, for manifests and messages


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
