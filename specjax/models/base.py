"""A loaded model: the NNX graph split once, its params pytree, and its tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np
from flax import nnx


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
class Model:
  graphdef: nnx.GraphDef  # static structure, hashable
  params: Any  # nnx.State of weights; never mutated
  config: Any  # the family's config dataclass
  tokenizer: Any  # specjax.loading.tokenizer.Tokenizer
  generation: GenerationDefaults
  source: str
  architecture: str
  kv_shapes: list[tuple[int, int]]  # (kv heads, head dim) of each attention layer
  state_shapes: list = dataclasses.field(default_factory=list)  # per recurrent layer (ssm, conv) shapes per row
  dtype: Any = None  # params and compute dtype (jnp.float32 / jnp.bfloat16)
  heads: dict[str, Any] = dataclasses.field(default_factory=dict)  # built-in drafter heads, apart from params
  quant: str | None = None  # how the weights are quantized ('int8', 'int4-g32', 'auto: Q8_0 x10, ...'), None: float
  mesh: Any = None  # the jax Mesh the params are placed on (`specjax.parallel`), None: one device

  @property
  def is_hybrid(self) -> bool:
    """Has recurrent (Gated DeltaNet) layers, whose state rolls back by slots."""
    return bool(self.state_shapes)

  def module(self) -> nnx.Module:
    """The merged module (for use inside jitted functions)."""
    return nnx.merge(self.graphdef, self.params)

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))

  def weights_fingerprint(self) -> str:
    """A hash of every weight's path, shape, dtype and bytes: equal iff the params are (computed once)."""
    if not hasattr(self, '_weights_fingerprint'):
      h = hashlib.blake2b(digest_size=12)
      h.update(f'quant:{self.quant}:{jax.tree.structure(self.params)}'.encode())
      for path, x in jax.tree_util.tree_flatten_with_path(self.params)[0]:
        x = np.ascontiguousarray(jax.device_get(x))
        h.update(f'{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}'.encode())
        h.update(x.view(np.uint8).reshape(-1))
      self._weights_fingerprint = h.hexdigest()
    return self._weights_fingerprint

  @property
  def param_bytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))
