"""The contract every model family implements, and the inputs of one forward pass.

  embed(tokens [B, T])                              -> [B, T, D]
  lookup(tokens [B, T])                             -> [B, T, D] raw table rows (no embedding scale)
  forward(tokens, inputs, cache | None, taps=())    -> (hidden [B, T, D], cache, taps)
  logits(hidden [..., D], ids=None)                 -> [..., V] (or [..., V'] at vocabulary ids [V'])
  cache_layout()                                    -> CacheLayout
  draft_layer_spec()                                -> DraftLayerSpec: the layer a drafter built for it copies
  kv_donors()                                       -> {layer type: index into cache.k_pages} ({}: no donors)

`StepInputs` says where each new token sits: its RoPE / mask position, which
tokens of the block it sees (`mask`, for trees) and where its key and value go
in the page pool. A chain (prefill, decode, verify of a linear draft) is
`StepInputs.chain(cache, query_lens, T)`; a tree places node i at position
`prefix + depth(i)` and writes it to cache slot `prefix + i`
(`StepInputs.tree`). With `cache=None` the model attends among the given
tokens only, with the mask: training and reference computations use this.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax.cache.paged import KVCache, token_slots

if TYPE_CHECKING:
  from specjax.models.layers import AttentionSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
  positions: jax.Array  # [B, T] int32 position of each new token (RoPE, window)
  query_lens: jax.Array  # [B] int32 real tokens per row (left-aligned; the rest is padding)
  mask: jax.Array | None = None  # [B, T, T] bool: new token i sees new token j (None: causal)
  page_ids: jax.Array | None = None  # [B, T] int32 page of each token's key/value (None: no cache)
  page_slots: jax.Array | None = None  # [B, T] int32 slot in that page

  @classmethod
  def chain(cls, cache: KVCache | None, query_lens: jax.Array, t: int, start: jax.Array | None = None) -> StepInputs:
    """T consecutive tokens appended after `cache.lengths` (or from `start` [B], default 0, without a cache)."""
    base = cache.lengths if cache is not None else (jnp.zeros_like(query_lens) if start is None else start)
    positions = base[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return cls._place(cache, positions, query_lens, None)

  @classmethod
  def tree(
      cls,
      cache: KVCache | None,
      depths: jax.Array,  # [B, T] depth of each node (root 0)
      mask: jax.Array,  # [B, T, T] bool ancestor-or-self
      query_lens: jax.Array,  # [B]
      start: jax.Array | None = None,  # [B] position of the root without a cache
  ) -> StepInputs:
    """A flattened tree: node i at position prefix + depth(i), written to cache slot prefix + i."""
    base = cache.lengths if cache is not None else (jnp.zeros_like(query_lens) if start is None else start)
    inputs = cls._place(cache, base[:, None] + jnp.arange(depths.shape[1], dtype=jnp.int32)[None, :], query_lens, mask)
    return dataclasses.replace(inputs, positions=(base[:, None] + depths).astype(jnp.int32))

  @classmethod
  def _place(cls, cache, slots_at, query_lens, mask) -> StepInputs:
    query_lens = query_lens.astype(jnp.int32)
    if cache is None:
      return cls(slots_at.astype(jnp.int32), query_lens, mask)
    valid = jnp.arange(slots_at.shape[1])[None, :] < query_lens[:, None]
    page_ids, page_slots = token_slots(cache.block_tables, slots_at, valid, cache.page_size)
    return cls(slots_at.astype(jnp.int32), query_lens, mask, page_ids, page_slots)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
  """One attention layer's view of the paged cache during a forward pass."""

  k_pages: jax.Array  # [K, P, page, H]
  v_pages: jax.Array  # [K, P, page, H]
  block_tables: jax.Array  # [B, pages_per_seq]
  lengths: jax.Array  # [B] keys after this step's writes


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """What a model keeps between steps, per layer kind."""

  kv_shapes: tuple[tuple[int, int], ...]  # per attention layer (kv heads, head dim)
  state_shapes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()  # per recurrent layer (ssm, conv) per row


@dataclasses.dataclass(frozen=True)
class DraftLayerSpec:
  """The decoder layer a drafter trained for a target copies (EAGLE-3, DFlash, MTP heads).

  The target's last full-attention layer, made plain here: no window, no
  output gate, its own k and v projections, RoPE over the whole head and of a
  kind a Llama config spells (an EAGLE-3 / DFlash export carries it): Gemma 4's
  proportional RoPE becomes a default one at its base.
  """

  hidden_size: int
  intermediate_size: int
  attention: AttentionSpec
  activation: str = 'silu'
  norm_eps: float = 1e-6
  norm_offset: float = 0.0  # 1.0: (1 + w) norms
  sandwich_norms: bool = False  # Gemma's post-norms on the attention and MLP outputs

  def __post_init__(self):
    a = self.attention
    rope = dataclasses.replace(a.rope, rotary_dim=0)
    if rope.kind == 'proportional':  # Gemma 4's full layers: no Llama spelling; a default RoPE at its base
      rope = dataclasses.replace(rope, kind='default', rope_angles=0, factor=1.0)
    plain = dataclasses.replace(a, window=None, output_gate=False, kv='own', rope=rope)
    object.__setattr__(self, 'attention', plain)


@runtime_checkable
class CausalLM(Protocol):
  """What the engine, drafters and training need of a target model."""

  def embed(self, tokens: jax.Array) -> jax.Array:
    ...

  def lookup(self, tokens: jax.Array) -> jax.Array:
    """Raw embedding-table rows, without a family's scale (Gemma's sqrt(D)): EAGLE-3 heads read these."""
    ...

  def forward(
      self, tokens: jax.Array, inputs: StepInputs, cache: KVCache | None, taps: tuple[int, ...] = ()
  ) -> tuple[jax.Array, KVCache | None, tuple[jax.Array, ...]]:
    ...

  def logits(self, hidden: jax.Array, ids: jax.Array | None = None) -> jax.Array:
    ...

  def cache_layout(self) -> CacheLayout:
    ...

  def draft_layer_spec(self) -> DraftLayerSpec:
    ...

  def kv_donors(self) -> dict[str, int]:
    """Layer type -> index into `cache.k_pages` of the layer whose keys and values later layers share (Gemma 4)."""
    ...


class ChainAppend:
  """What every family shares: `model(tokens, cache, query_lens) -> (hidden, cache)` appends a chain of tokens
  `[B, T]` to the cache; no KV donors."""

  def kv_donors(self) -> dict[str, int]:
    return {}

  def __call__(self, tokens: jax.Array, cache: KVCache, query_lens: jax.Array) -> tuple[jax.Array, KVCache]:
    hidden, cache, _ = self.forward(tokens, StepInputs.chain(cache, query_lens, tokens.shape[1]), cache)
    return hidden, cache


def append(model: Any, tokens: jax.Array, cache: KVCache, query_lens: jax.Array, **kwargs):
  """Appends a chain of tokens `[B, T]` to the cache: `model.forward` with `StepInputs.chain`."""
  return model.forward(tokens, StepInputs.chain(cache, query_lens, tokens.shape[1]), cache, **kwargs)
