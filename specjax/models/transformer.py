"""A decoder-only transformer of attention layers, configured per family.

Gemma 3, Llama 3, Mistral and Qwen3 differ only in options of the shared blocks
(`specjax.models.layers`): norm offset and sandwich norms, embedding scale, q/k
norms, windows and RoPE per layer, softcaps, activation, tied head. A family
file turns its HF config into a `DecoderSpec` and its weight names into params.

Einsum letters: B batch, T tokens, D model, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache.paged import KVCache
from specjax.models.contract import CacheLayout, ChainAppend, DraftLayerSpec, PagedKV, StepInputs
from specjax.models.layers import AttentionSpec, Attention, DecoderBlock, GatedMLP, RMSNorm, param, weight
from specjax.quant import ops


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
  """The fields a family config (Gemma 3, Llama, Qwen3.5) starts from, keyword-only."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  layer_types: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  layers: tuple[AttentionSpec, ...]
  activation: str = 'silu'
  norm_eps: float = 1e-6
  norm_offset: float = 0.0  # 1.0: Gemma's (1 + w) norms
  sandwich_norms: bool = False  # Gemma: post-norms on the attention and MLP outputs
  embed_scale: bool = False  # Gemma: embeddings times sqrt(D)
  tie_embeddings: bool = True
  final_softcap: float | None = None


class DecoderLM(ChainAppend, nnx.Module):
  """Causal LM over the paged KV cache (`specjax.models.contract.CausalLM`).

  The embedding is stored `[D, V]`: the tied head is then a plain `x @ W`,
  which XLA:CPU runs near memory bandwidth (the `[V, D]` form is ~1.6x slower
  at one token); the lookup gathers columns.
  """

  def __init__(
      self, spec: DecoderSpec, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    d = spec.hidden_size
    self.spec = spec
    self.embed_tokens = weight(rngs, (d, spec.vocab_size), dtype)
    self.layers = nnx.List(
        [
            DecoderBlock(
                d,
                Attention(d, a, impl=attention_impl, dtype=dtype, rngs=rngs),
                GatedMLP(d, spec.intermediate_size, activation=spec.activation, dtype=dtype, rngs=rngs),
                eps=spec.norm_eps,
                offset=spec.norm_offset,
                sandwich=spec.sandwich_norms,
                dtype=dtype,
            )
            for a in spec.layers
        ]
    )
    self.norm = RMSNorm(d, eps=spec.norm_eps, offset=spec.norm_offset, dtype=dtype)
    if not spec.tie_embeddings:
      self.lm_head = weight(rngs, (d, spec.vocab_size), dtype)

  def cache_layout(self) -> CacheLayout:
    return CacheLayout(tuple((a.num_kv_heads, a.head_dim) for a in self.spec.layers))

  def draft_layer_spec(self) -> DraftLayerSpec:
    """The last full-attention layer (the last layer if every one has a window), its MLP and norms."""
    s = self.spec
    full = [a for a in s.layers if a.window is None]
    return DraftLayerSpec(
        s.hidden_size,
        s.intermediate_size,
        full[-1] if full else s.layers[-1],
        activation=s.activation,
        norm_eps=s.norm_eps,
        norm_offset=s.norm_offset,
        sandwich_norms=s.sandwich_norms,
    )

  def lookup(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    """Raw rows of the embedding table (no Gemma sqrt(D) scale): what EAGLE-style drafters read."""
    return jnp.moveaxis(ops.take(self.embed_tokens[...], tokens, axis=1, dtype=self.norm.scale.dtype), 0, -1)

  def embed(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    x = self.lookup(tokens)
    if self.spec.embed_scale:
      x = x * jnp.asarray(self.spec.hidden_size**0.5, x.dtype)
    return x

  def forward(
      self,
      tokens: jax.Array,  # [B, T]
      inputs: StepInputs,
      cache: KVCache | None,
      taps: tuple[int, ...] = (),
      *,
      num_layers: int | None = None,
  ) -> tuple[jax.Array, KVCache | None, tuple[jax.Array, ...]]:
    """Runs the first `num_layers` layers (all by default), then the final norm.

    Returns the final-normed hidden `[B, T, D]`, the cache (layers past
    `num_layers` untouched; `None` without one) and the residual stream after
    each layer in `taps` (each `[B, T, D]`).
    """
    num_layers = len(self.spec.layers) if num_layers is None else num_layers
    x, cache, tapped = run_layers(self.layers, self.embed(tokens), inputs, cache, taps, range(num_layers))
    return self.norm(x), cache, tapped

  def logits(self, hidden: jax.Array, ids: jax.Array | None = None) -> jax.Array:  # [..., D] -> [..., V]
    """Final logits; with `ids` [V'] only those vocabulary columns ([..., V']: a training draft vocabulary)."""
    head = self.embed_tokens[...] if self.spec.tie_embeddings else self.lm_head[...]
    return head_logits(hidden, head, ids, self.spec.final_softcap)


def run_layers(
    blocks,  # the `DecoderBlock`s
    x: jax.Array,  # [B, T, D] the embedded tokens
    inputs: StepInputs,
    cache: KVCache | None,
    taps: tuple[int, ...],
    pages,  # per layer to run: index into cache.k_pages of the keys and values it attends to; None: recurrent
    *,
    per_layer: jax.Array | None = None,  # [B, T, L, P] per-layer embedding inputs (Gemma 4)
    state: tuple[list, list, jax.Array] | None = None,  # recurrent layers' (ssm, conv) slots, updated in place; slot
) -> tuple[jax.Array, KVCache | None, tuple[jax.Array, ...]]:
  """The layer loop of every family: the residual after the last layer, the cache and the residual after each tap.

  An attention layer reads (and, unless KV-shared, writes) the pages `pages[i]`;
  several layers naming one index share it (Gemma 4's KV sharing: a donor's
  pages, written earlier in the step). Without a cache they share the donor's
  keys and values of the given tokens. A recurrent layer (`pages[i]` None)
  takes the next pair of `state`. The returned cache's lengths include this
  step; pages no layer ran on are as they were.
  """
  kv_lens = None if cache is None else cache.lengths + inputs.query_lens
  k_all, v_all = (None, None) if cache is None else (list(cache.k_pages), list(cache.v_pages))
  dense, tapped, r = {}, {}, 0  # dense: page index -> (keys, values) without a cache
  for i, j in enumerate(pages):
    if j is None:
      ssm, conv, slot = state

      def recurrent(net, y, r=r):
        out, ssm_r, conv_r = net(y, ssm[r], conv[r], slot, inputs.query_lens)
        return out, (ssm_r, conv_r)

      x, (ssm[r], conv[r]) = blocks[i](x, recurrent)
      r += 1
    else:
      kv = dense.get(j) if cache is None else PagedKV(k_all[j], v_all[j], cache.block_tables, kv_lens)
      ple = None if per_layer is None else per_layer[:, :, i]
      x, kv = blocks[i](x, lambda attn, y, kv=kv: attn(y, inputs, kv), ple)
      if cache is None:
        dense[j] = kv
      else:
        k_all[j], v_all[j] = kv.k_pages, kv.v_pages
    if i in taps:
      tapped[i] = x
  if cache is not None:
    cache = dataclasses.replace(cache, k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=kv_lens)
  return x, cache, tuple(tapped[i] for i in taps)


def head_logits(
    hidden: jax.Array,  # [..., D]
    head,  # [D, V]: an array or a QMatrix
    ids: jax.Array | None = None,  # [V'] only these columns
    cap: float | None = None,  # final softcap
) -> jax.Array:  # [..., V] (or [..., V'])
  """`hidden @ head` (the `[D, V]` head of `DecoderLM` and Gemma 4), over `ids` only if given, softcapped."""
  if ids is not None:
    head = ops.take_outputs(head, ids, 1)
  logits = ops.matmul(hidden, head)
  if cap:
    logits = jnp.tanh(logits / cap) * cap
  return logits


def block_params(take, p: str, spec: AttentionSpec, d: int, f: int, *, sandwich: bool) -> dict:
  """HF weights of one decoder layer (prefix `p`, e.g. 'model.layers.3.') as `DecoderBlock` params."""
  n, k, h = spec.num_heads, spec.num_kv_heads, spec.head_dim
  norm = lambda name, dim: {'scale': take(p + name + '.weight', (dim,))}
  attn = {
      'qkv_proj': np.concatenate(
          [
              take(p + 'self_attn.q_proj.weight', (n * h, d)),
              take(p + 'self_attn.k_proj.weight', (k * h, d)),
              take(p + 'self_attn.v_proj.weight', (k * h, d)),
          ]
      ).T,
      'o_proj': take(p + 'self_attn.o_proj.weight', (d, n * h)).T,
  }
  if spec.qk_norm:
    attn['q_norm'] = norm('self_attn.q_norm', h)
    attn['k_norm'] = norm('self_attn.k_norm', h)
  # HF names of the (pre-attention, pre-MLP[, post-attention, post-MLP]) norms.
  names = (
      ('input_layernorm', 'pre_feedforward_layernorm', 'post_attention_layernorm', 'post_feedforward_layernorm')
      if sandwich
      else ('input_layernorm', 'post_attention_layernorm')
  )
  params = {
      'mixer_norm': norm(names[0], d),
      'mixer': attn,
      'mlp_norm': norm(names[1], d),
      'mlp': mlp_params(take, p + 'mlp.', d, f),
  }
  if sandwich:
    params['mixer_post_norm'] = norm(names[2], d)
    params['mlp_post_norm'] = norm(names[3], d)
  return params


def mlp_params(take, p: str, d: int, f: int) -> dict:
  """HF `gate_proj` / `up_proj` / `down_proj` (prefix `p`) as `GatedMLP` params."""
  return {
      'gate_up': np.concatenate([take(p + 'gate_proj.weight', (f, d)), take(p + 'up_proj.weight', (f, d))]).T,
      'down': take(p + 'down_proj.weight', (d, f)).T,
  }


def decoder_params(spec: DecoderSpec, take, tensors: dict) -> dict:
  """HF weights (`model.embed_tokens`, `model.layers.*`, `model.norm`, `lm_head`) as `DecoderLM` params."""
  d = spec.hidden_size
  params = {
      'embed_tokens': take('model.embed_tokens.weight', (spec.vocab_size, d)).T,
      'layers': {
          i: block_params(take, f'model.layers.{i}.', a, d, spec.intermediate_size, sandwich=spec.sandwich_norms)
          for i, a in enumerate(spec.layers)
      },
      'norm': {'scale': take('model.norm.weight', (d,))},
  }
  if spec.tie_embeddings:
    tensors.pop('lm_head.weight', None)
  else:
    params['lm_head'] = take('lm_head.weight', (spec.vocab_size, d)).T
  return params
