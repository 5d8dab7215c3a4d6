"""The loader-neutral form of a checkpoint.

Every loader (HF directory, hub id, GGUF file, demo package) returns a
`Checkpoint`: an HF-layout config dict, tensors under their HF names in PyTorch
layout (`Linear.weight` is `[out, in]`), the tokenizer, and generation settings.
The model families turn that into NNX params (`specjax.models.<family>`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import numpy as np

from specjax.models.base import GenerationDefaults
from specjax.models.weights import tensor_taker  # noqa: F401 (re-exported)


@dataclasses.dataclass
class Checkpoint:
  config: dict[str, Any]  # HF `config.json` layout, with GGUF defaults filled in
  tensors: dict[str, np.ndarray]  # HF names, PyTorch layout, float32
  tokenizer: Any  # specjax.loading.tokenizer.Tokenizer
  generation: GenerationDefaults
  source: str  # where it came from, for manifests and messages


@functools.cache
def _libc():
  try:
    return ctypes.CDLL('libc.so.6')
  except OSError:
    return None


def release_host_memory() -> None:
  """Gives freed heap pages back to the OS (glibc's `malloc_trim`; elsewhere nothing). Loading frees many small
  Python objects (a 262k-entry vocabulary's lists) and host copies of weights, whose pages glibc would otherwise
  keep: without it the process holds ~200 MB more (Gemma 3 270M) and the next big buffer lands on top."""
  libc = _libc()
  if libc is not None and hasattr(libc, 'malloc_trim'):
    libc.malloc_trim(0)
