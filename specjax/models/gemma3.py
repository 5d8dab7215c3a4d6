"""Gemma 3 text model as Flax NNX modules over a paged KV cache.

Facts (HF `modeling_gemma3.py`): embeddings scaled by sqrt(D); (1 + w)
RMSNorms; sandwich norms around attention and MLP; per-head q/k norms; NeoX
RoPE with base 1e6 on full layers and 1e4 on sliding ones; sliding windows that
hold W keys including the token itself; GeGLU MLP; tied head; optional final
logit softcap.

Einsum letters: B batch, T tokens, D model, N query heads, K kv heads, H head
dim, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.paged_attention import paged_attention
from specjax.cache.paged import KVCache, step_layout, write_kv
from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import tensor_taker
from specjax.models.layers import ACTIVATIONS, GatedMLP, RMSNorm, apply_rope

SLIDING, FULL = 'sliding_attention', 'full_attention'


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  layer_types: tuple[str, ...]
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  rope_local_base_freq: float = 10_000.0
  rope_scaling_factor: float = 1.0  # linear scaling of full-attention layers (4B+)
  sliding_window: int = 512
  query_pre_attn_scalar: float = 256.0
  final_logit_softcapping: float | None = None
  attn_logit_softcapping: float | None = None
  hidden_activation: str = 'gelu_pytorch_tanh'
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = True

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> Gemma3Config:
    """Reads an HF `Gemma3TextConfig` dict (or the `text_config` of a Gemma 3)."""
    hf = hf.get('text_config', hf)
    try:
      layers = int(hf['num_hidden_layers'])
      layer_types = hf.get('layer_types')
      if layer_types is None:
        pattern = int(hf.get('sliding_window_pattern', 6))
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
      unknown = sorted(set(layer_types) - {SLIDING, FULL})
      if unknown or len(layer_types) != layers:
        raise SpecjaxError(f'gemma3 config: layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {unknown or len(layer_types)}')
      scaling = hf.get('rope_scaling') or {}
      if scaling and scaling.get('rope_type', scaling.get('type')) not in ('linear', 'default'):
        raise SpecjaxError(f'gemma3 config: unsupported rope_scaling {scaling}')
      act = hf.get('hidden_activation') or hf.get('hidden_act') or 'gelu_pytorch_tanh'
      if act not in ACTIVATIONS:
        raise SpecjaxError(f'gemma3 config: unsupported activation {act!r}')
      heads = int(hf['num_attention_heads'])
      return cls(
          vocab_size=int(hf['vocab_size']),
          hidden_size=int(hf['hidden_size']),
          intermediate_size=int(hf['intermediate_size']),
          num_layers=layers,
          num_heads=heads,
          num_kv_heads=int(hf.get('num_key_value_heads', heads)),
          head_dim=int(hf.get('head_dim') or hf['hidden_size'] // heads),
          layer_types=tuple(layer_types),
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
          rope_theta=float(hf.get('rope_theta', 1e6)),
          rope_local_base_freq=float(hf.get('rope_local_base_freq', 1e4)),
          rope_scaling_factor=float(scaling.get('factor', 1.0)),
          sliding_window=int(hf.get('sliding_window') or 512),
          query_pre_attn_scalar=float(hf.get('query_pre_attn_scalar') or hf.get('head_dim') or 256),
          final_logit_softcapping=hf.get('final_logit_softcapping'),
          attn_logit_softcapping=hf.get('attn_logit_softcapping'),
          hidden_activation=act,
          max_position_embeddings=int(hf.get('max_position_embeddings', 32768)),
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', True)),
      )
    except KeyError as e:
      raise SpecjaxError(f'gemma3 config: missing key {e.args[0]!r}') from None


class Attention(nnx.Module):

  def __init__(self, cfg: Gemma3Config, layer_type: str, attention_impl: str):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # q, k and v in one [D, (N + 2K) * H] matrix: one pass over the weights.
    self.qkv_proj = nnx.Param(jnp.zeros((d, (n + 2 * k) * h)))
    self.o_proj = nnx.Param(jnp.zeros((n * h, d)))
    self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
    self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, offset=1.0)
    self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, offset=1.0)
    sliding = layer_type == SLIDING
    self.window = cfg.sliding_window if sliding else None
    self.rope_base = cfg.rope_local_base_freq if sliding else cfg.rope_theta
    self.rope_scale = 1.0 if sliding else cfg.rope_scaling_factor
    self.scale = cfg.query_pre_attn_scalar**-0.5
    self.softcap = cfg.attn_logit_softcapping
    self.impl = attention_impl

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      positions: jax.Array,  # [B, T]
      k_pages: jax.Array,  # [K, P, page, H]
      v_pages: jax.Array,  # [K, P, page, H]
      slots: tuple[jax.Array, jax.Array],  # page ids, in-page slots, each [B, T]
      block_tables: jax.Array,  # [B, pages_per_seq]
      kv_lens: jax.Array,  # [B] keys after this write
      query_lens: jax.Array,  # [B]
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, _ = x.shape
    n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
    qkv = jnp.einsum('btd,de->bte', x, self.qkv_proj[...]).reshape(b, t, n + 2 * k, h)
    q = self.q_norm(qkv[:, :, :n])
    k, v = self.k_norm(qkv[:, :, n:n + k]), qkv[:, :, n + k:]
    rope_positions = positions / self.rope_scale if self.rope_scale != 1.0 else positions
    q = apply_rope(q, rope_positions, base=self.rope_base)
    k = apply_rope(k, rope_positions, base=self.rope_base)
    k_pages = write_kv(k_pages, k, *slots)
    v_pages = write_kv(v_pages, v, *slots)
    out = paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, query_lens=query_lens,
        sliding_window=self.window, logit_softcap=self.softcap, scale=self.scale, impl=self.impl)
    return jnp.einsum('bte,ed->btd', out.reshape(b, t, n * h), self.o_proj[...]), k_pages, v_pages


class Block(nnx.Module):

  def __init__(self, cfg: Gemma3Config, layer_type: str, attention_impl: str):
    norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=1.0)
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, layer_type, attention_impl)
    self.post_attention_layernorm = norm()
    self.pre_feedforward_layernorm = norm()
    self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, activation=cfg.hidden_activation)
    self.post_feedforward_layernorm = norm()

  def __call__(self, x, positions, k_pages, v_pages, slots, block_tables, kv_lens, query_lens):
    attn, k_pages, v_pages = self.self_attn(
        self.input_layernorm(x), positions, k_pages, v_pages, slots, block_tables, kv_lens, query_lens)
    x = x + self.post_attention_layernorm(attn)
    x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
    return x, k_pages, v_pages


class Gemma3(nnx.Module):
  """Gemma 3 causal LM. Build with `nnx.eval_shape` and fill from a checkpoint."""

  def __init__(self, cfg: Gemma3Config, *, attention_impl: str = 'auto'):
    self.cfg = cfg
    # Stored [D, V]: the tied head is then a plain `x @ W`, which XLA:CPU runs
    # near memory bandwidth (the [V, D] form is ~1.6x slower at one token);
    # the embedding lookup gathers columns.
    self.embed_tokens = nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size)))
    self.layers = nnx.List([Block(cfg, t, attention_impl) for t in cfg.layer_types])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=1.0)
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size)))

  def kv_layer_shapes(self) -> list[tuple[int, int]]:
    return [(self.cfg.num_kv_heads, self.cfg.head_dim)] * self.cfg.num_layers

  def __call__(
      self,
      tokens: jax.Array,  # [B, T]
      cache: KVCache,
      query_lens: jax.Array,  # [B] real tokens per row (rows are left-aligned)
  ) -> tuple[jax.Array, KVCache]:
    """Appends `tokens` to the cache; returns final-normed hidden `[B, T, D]`."""
    hidden, cache, _ = self.forward(tokens, cache, query_lens)
    return hidden, cache

  def forward(
      self,
      tokens: jax.Array,  # [B, T]
      cache: KVCache,
      query_lens: jax.Array,  # [B]
      *,
      num_layers: int | None = None,
      taps: tuple[int, ...] = (),
  ) -> tuple[jax.Array, KVCache, tuple[jax.Array, ...]]:
    """Runs the first `num_layers` layers (all by default), then the final norm.

    Returns the final-normed hidden `[B, T, D]`, the cache (layers past
    `num_layers` untouched) and the residual stream after each layer in `taps`
    (each `[B, T, D]`), for drafters that read target hidden states.
    """
    t = tokens.shape[1]
    num_layers = self.cfg.num_layers if num_layers is None else num_layers
    positions, slots, kv_lens = step_layout(cache, query_lens, t)
    embed = self.embed_tokens[...]
    x = jnp.take(embed, tokens, axis=1)  # [D, B, T]
    x = jnp.moveaxis(x, 0, -1) * jnp.asarray(self.cfg.hidden_size**0.5, embed.dtype)
    k_all, v_all, tapped = list(cache.k_pages), list(cache.v_pages), {}
    for i in range(num_layers):
      x, k_all[i], v_all[i] = self.layers[i](
          x, positions, k_all[i], v_all[i], slots, cache.block_tables, kv_lens, query_lens)
      if i in taps:
        tapped[i] = x
    new_cache = dataclasses.replace(cache, k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=kv_lens)
    return self.norm(x), new_cache, tuple(tapped[i] for i in taps)

  def logits(self, hidden: jax.Array) -> jax.Array:  # [..., D] -> [..., V]
    head = self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
    logits = jnp.einsum('...d,dv->...v', hidden, head)
    cap = self.cfg.final_logit_softcapping
    if cap:
      logits = jnp.tanh(logits / cap) * cap
    return logits


def params_from_hf(cfg: Gemma3Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps HF-named tensors (PyTorch layout) to the pure-dict state of `Gemma3`."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  take = tensor_taker(tensors)

  def norm(name, dim):
    return {'scale': take(name, (dim,))}

  layers = {}
  for i in range(cfg.num_layers):
    p = f'model.layers.{i}.'
    layers[i] = {
        'input_layernorm': norm(p + 'input_layernorm.weight', d),
        'self_attn': {
            'qkv_proj': np.concatenate([
                take(p + 'self_attn.q_proj.weight', (n * h, d)),
                take(p + 'self_attn.k_proj.weight', (k * h, d)),
                take(p + 'self_attn.v_proj.weight', (k * h, d))]).T,
            'o_proj': take(p + 'self_attn.o_proj.weight', (d, n * h)).T,
            'q_norm': norm(p + 'self_attn.q_norm.weight', h),
            'k_norm': norm(p + 'self_attn.k_norm.weight', h),
        },
        'post_attention_layernorm': norm(p + 'post_attention_layernorm.weight', d),
        'pre_feedforward_layernorm': norm(p + 'pre_feedforward_layernorm.weight', d),
        'mlp': {
            'gate_up': np.concatenate([
                take(p + 'mlp.gate_proj.weight', (cfg.intermediate_size, d)),
                take(p + 'mlp.up_proj.weight', (cfg.intermediate_size, d))]).T,
            'down': take(p + 'mlp.down_proj.weight', (d, cfg.intermediate_size)).T,
        },
        'post_feedforward_layernorm': norm(p + 'post_feedforward_layernorm.weight', d),
    }
  params = {
      'embed_tokens': take('model.embed_tokens.weight', (cfg.vocab_size, d)).T,
      'layers': layers,
      'norm': norm('model.norm.weight', d),
  }
  if cfg.tie_word_embeddings:
    tensors.pop('lm_head.weight', None)
  else:
    params['lm_head'] = take('lm_head.weight', (cfg.vocab_size, d)).T
  return params
