"""The loader-neutral form of a checkpoint.

Every loader (HF directory, hub id, GGUF file, demo package) returns a
`Checkpoint`: an HF-layout config dict, tensors under their HF names in PyTorch
layout (`Linear.weight` is `[out, in]`), the tokenizer, and generation settings.
The model families turn that into NNX params (`specjax.models.<family>`).
"""

from __future__ import annotations

import dataclasses
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
