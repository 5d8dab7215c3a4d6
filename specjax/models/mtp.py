"""A multi-token-prediction head (Qwen3.5 / Qwen3-Next `mtp.*`, DeepSeek-V3's MTP), for any target.

  x = fc(concat(norm_e(embed(x_{t+1})), norm_h(h_t)))  ->  one decoder block  ->  norm

`h_t` is the target's final-normed hidden state at position t (or the head's
own output, drafting deeper); the result goes through the target's LM head and
predicts x_{t+2}. The block has its own paged KV cache; the target's
embedding and head are shared (passed in, not owned). `draft_mtp_head` builds
one shaped as a target's `draft_layer_spec()`; `specjax.loading.mtp_head.head_for`
picks it or Qwen's own layout (gated attention) for a loaded target.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.cache.paged import KVCache
from specjax.models.contract import CacheLayout, DraftLayerSpec, PagedKV, StepInputs
from specjax.models.layers import Attention, DecoderBlock, GatedMLP, RMSNorm, param
from specjax.models.transformer import block_params
from specjax.models.weights import tensor_taker


class MTPHead(nnx.Module):
  """`fc` over [norm(embedding), norm(hidden)], one decoder block (`layer`), a final norm."""

  def __init__(self, dim: int, layer: DecoderBlock, *, eps: float, offset: float, dtype, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(dim, eps=eps, offset=offset, dtype=dtype)
    self.pre_fc_norm_embedding = norm()
    self.pre_fc_norm_hidden = norm()
    self.fc = param(rngs, (2 * dim, dim), dtype)
    self.layer = layer
    self.norm = norm()

  def cache_layout(self) -> CacheLayout:
    spec = self.layer.mixer.spec
    return CacheLayout(((spec.num_kv_heads, spec.head_dim),))

  def fuse(self, embeds: jax.Array, hidden: jax.Array) -> jax.Array:  # [B, T, D] x 2 -> [B, T, D]
    x = jnp.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
    return jnp.einsum('bte,ed->btd', x, self.fc[...])

  def __call__(
      self,
      embeds: jax.Array,  # [B, T, D] embeddings of the next tokens
      hidden: jax.Array,  # [B, T, D] target (or previous MTP) final hidden states
      cache: KVCache | None,  # one attention layer
      inputs: StepInputs,
  ) -> tuple[jax.Array, KVCache | None]:
    x = self.fuse(embeds, hidden)
    kv = None
    if cache is not None:
      kv = PagedKV(cache.k_pages[0], cache.v_pages[0], cache.block_tables, cache.lengths + inputs.query_lens)
    x, kv = self.layer(x, lambda attn, y: attn(y, inputs, kv))
    if cache is not None:
      cache = dataclasses.replace(cache, k_pages=(kv.k_pages,), v_pages=(kv.v_pages,), lengths=kv.lengths)
    return self.norm(x), cache


def draft_mtp_head(layer: DraftLayerSpec, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs=None) -> MTPHead:
  """An MTP head whose block is `layer` (a target's `draft_layer_spec()`)."""
  rngs = rngs or nnx.Rngs(0)
  d = layer.hidden_size
  block = DecoderBlock(
      d,
      Attention(d, layer.attention, impl=attention_impl, dtype=dtype, rngs=rngs),
      GatedMLP(d, layer.intermediate_size, activation=layer.activation, dtype=dtype, rngs=rngs),
      eps=layer.norm_eps,
      offset=layer.norm_offset,
      sandwich=layer.sandwich_norms,
      dtype=dtype,
  )
  return MTPHead(d, block, eps=layer.norm_eps, offset=layer.norm_offset, dtype=dtype, rngs=rngs)


def draft_params_from_hf(layer: DraftLayerSpec, tensors: dict) -> dict:
  """HF-named `mtp.*` tensors (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.0.*`, `mtp.norm`) as the pure-dict
  state of `draft_mtp_head(layer)`."""
  take = tensor_taker(tensors)
  d = layer.hidden_size
  block = block_params(
      take, 'mtp.layers.0.', layer.attention, d, layer.intermediate_size, sandwich=layer.sandwich_norms
  )
  return {
      'pre_fc_norm_embedding': {'scale': take('mtp.pre_fc_norm_embedding.weight', (d,))},
      'pre_fc_norm_hidden': {'scale': take('mtp.pre_fc_norm_hidden.weight', (d,))},
      'fc': take('mtp.fc.weight', (d, 2 * d)).T,
      'layer': block,
      'norm': {'scale': take('mtp.norm.weight', (d,))},
  }
