"""The DFlash (block-diffusion) draft model as a Flax NNX module (z-lab/dflash, SpecForge).

Facts (z-lab `dflash/model.py`, SpecForge `modeling/draft/dflash.py`): the
target's residual stream after a few layers (the taps) is concatenated and
projected, `ctx = hidden_norm(fc(concat taps))` `[B, C, D]`, the draft's width
being the target's. Qwen3 decoder layers follow (q/k norms, SwiGLU, plain
`x * w` RMSNorms) whose keys and values are `k_norm(k_proj([ctx; x]))` and
`v_proj([ctx; x])`, rotated at the context's positions then the block's;
queries come from the block rows only and see every context key and every
block row (non-causal). The block is `[last token, MASK x (B - 1)]` embedded
with the target's embedding; `norm(out)` goes through the target's head.

Context keys and values depend only on the target features (the same `ctx` in
every layer), so they live in the draft's own paged cache, appended once per
committed position (`append_context`); `block` writes the block's keys and
values to scratch slots past the context and attends to both.

Sliding layers (`layer_types`): the paged kernel places every block row at the
block's last position for the window rule (an all-true block mask has depth
B - 1), so each row sees context keys within W - 1 positions of that one
position; upstream's windows differ by at most B - 1 keys past W.

Einsum letters: B batch, T tokens, E concatenated taps, D width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache.paged import KVCache, write_kv
from specjax.models.contract import CacheLayout, PagedKV, StepInputs
from specjax.models.layers import Attention, AttentionSpec, DecoderBlock, GatedMLP, RMSNorm, Rope, param
from specjax.models.transformer import block_params
from specjax.models.weights import tensor_taker


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
  hidden_size: int  # the target's
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  norm_eps: float
  rope: Rope
  num_layers: int
  block_size: int  # rows of one block: the last token and block_size - 1 masks
  mask_token_id: int
  taps: tuple[int, ...]  # target layers whose output residual feeds fc, 0-based (= upstream target_layer_ids)
  num_target_layers: int
  vocab_size: int  # the target's
  windows: tuple[int | None, ...] = ()  # per layer: sliding window or None (empty: all full)
  max_position_embeddings: int = 40960
  activation: str = 'silu'

  def __post_init__(self):
    object.__setattr__(self, 'taps', tuple(int(i) for i in self.taps))
    object.__setattr__(self, 'windows', tuple(self.windows) or (None,) * self.num_layers)

  def attention_spec(self, layer: int) -> AttentionSpec:
    return AttentionSpec(
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
        self.rope,
        scale=self.head_dim**-0.5,
        eps=self.norm_eps,
        qk_norm=True,
        window=self.windows[layer],
    )


class DFlashDraft(nnx.Module):
  """DFlash 1: `context` fuses the taps, `append_context` caches their K/V, `block` drafts one block."""

  def __init__(
      self, cfg: DFlashConfig, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    d = cfg.hidden_size
    norm = lambda: RMSNorm(d, eps=cfg.norm_eps, offset=0.0, dtype=dtype)
    self.cfg = cfg
    self.fc = param(rngs, (len(cfg.taps) * d, d), dtype)
    self.hidden_norm = norm()
    self.layers = nnx.List(
        [
            DecoderBlock(
                d,
                Attention(d, cfg.attention_spec(i), impl=attention_impl, dtype=dtype, rngs=rngs),
                GatedMLP(d, cfg.intermediate_size, activation=cfg.activation, dtype=dtype, rngs=rngs),
                eps=cfg.norm_eps,
                offset=0.0,
                dtype=dtype,
            )
            for i in range(cfg.num_layers)
        ]
    )
    self.norm = norm()

  def cache_layout(self) -> CacheLayout:
    return CacheLayout(((self.cfg.num_kv_heads, self.cfg.head_dim),) * self.cfg.num_layers)

  def context(self, taps: jax.Array) -> jax.Array:  # [B, T, E] (taps side by side, in cfg.taps order) -> [B, T, D]
    return self.hidden_norm(jnp.einsum('bte,ed->btd', taps, self.fc[...]))

  def append_context(self, ctx: jax.Array, inputs: StepInputs, cache: KVCache) -> KVCache:
    """Writes every layer's context keys (normed, rotated at `inputs.positions`) and values; lengths advance."""
    k_all, v_all = [], []
    for layer, k_pages, v_pages in zip(self.layers, cache.k_pages, cache.v_pages):
      key, value = layer.mixer.project_kv(ctx, inputs.positions)
      k_all.append(write_kv(k_pages, key, inputs.page_ids, inputs.page_slots))
      v_all.append(write_kv(v_pages, value, inputs.page_ids, inputs.page_slots))
    return dataclasses.replace(
        cache, k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=cache.lengths + inputs.query_lens
    )

  def block(self, embeds: jax.Array, inputs: StepInputs, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Block rows `embeds` [B, T, D] over the cached context and each other; returns (norm(out) [B, T, D], cache).

    `inputs` place the rows past the context (`StepInputs.chain(cache, ...)`)
    with an all-true mask; their keys and values land in the cache's pages but
    the returned cache keeps the context's lengths.
    """
    kv_lens = cache.lengths + inputs.query_lens
    x, k_all, v_all = embeds, [], []
    for layer, k_pages, v_pages in zip(self.layers, cache.k_pages, cache.v_pages):
      kv = PagedKV(k_pages, v_pages, cache.block_tables, kv_lens)
      x, kv = layer(x, lambda attn, y, kv=kv: attn(y, inputs, kv))
      k_all.append(kv.k_pages)
      v_all.append(kv.v_pages)
    return self.norm(x), dataclasses.replace(cache, k_pages=tuple(k_all), v_pages=tuple(v_all))


def block_mask(b: int, t: int) -> jax.Array:  # [B, T, T] all true: block rows see each other
  return jnp.ones((b, t, t), bool)


# ---------------------------------------------------------------- checkpoint mapping (z-lab / SpecForge layout)


def hf_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
  """The draft's tensors: name -> shape."""
  d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  shapes = {'fc.weight': (d, len(cfg.taps) * d), 'hidden_norm.weight': (d,), 'norm.weight': (d,)}
  for i in range(cfg.num_layers):
    p = f'layers.{i}.'
    shapes.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,)})
    shapes.update({p + 'self_attn.q_proj.weight': (n * h, d), p + 'self_attn.o_proj.weight': (d, n * h)})
    shapes.update({p + 'self_attn.k_proj.weight': (k * h, d), p + 'self_attn.v_proj.weight': (k * h, d)})
    shapes.update({p + 'self_attn.q_norm.weight': (h,), p + 'self_attn.k_norm.weight': (h,)})
    shapes.update({p + 'mlp.gate_proj.weight': (f, d), p + 'mlp.up_proj.weight': (f, d)})
    shapes[p + 'mlp.down_proj.weight'] = (d, f)
  return shapes


def params_from_hf(cfg: DFlashConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Pops the draft's tensors (PyTorch layout) into the pure-dict state of `DFlashDraft`."""
  take = tensor_taker(tensors)
  d = cfg.hidden_size
  return {
      'fc': take('fc.weight', (d, len(cfg.taps) * d)).T,
      'hidden_norm': {'scale': take('hidden_norm.weight', (d,))},
      'layers': {
          i: block_params(take, f'layers.{i}.', cfg.attention_spec(i), d, cfg.intermediate_size, sandwich=False)
          for i in range(cfg.num_layers)
      },
      'norm': {'scale': take('norm.weight', (d,))},
  }


def params_to_hf(cfg: DFlashConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`."""
  n, k, h, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  arr = np.asarray
  tensors = {
      'fc.weight': arr(params['fc']).T,
      'hidden_norm.weight': arr(params['hidden_norm']['scale']),
      'norm.weight': arr(params['norm']['scale']),
  }
  for i in range(cfg.num_layers):
    layer, p = params['layers'][i], f'layers.{i}.'
    attn, mlp = layer['mixer'], layer['mlp']
    q, key, value = np.split(arr(attn['qkv_proj']).T, [n * h, (n + k) * h])
    gate, up = np.split(arr(mlp['gate_up']).T, [f])
    tensors.update(
        {
            p + 'input_layernorm.weight': arr(layer['mixer_norm']['scale']),
            p + 'post_attention_layernorm.weight': arr(layer['mlp_norm']['scale']),
            p + 'self_attn.q_proj.weight': q,
            p + 'self_attn.k_proj.weight': key,
            p + 'self_attn.v_proj.weight': value,
            p + 'self_attn.o_proj.weight': arr(attn['o_proj']).T,
            p + 'self_attn.q_norm.weight': arr(attn['q_norm']['scale']),
            p + 'self_attn.k_norm.weight': arr(attn['k_norm']['scale']),
            p + 'mlp.gate_proj.weight': gate,
            p + 'mlp.up_proj.weight': up,
            p + 'mlp.down_proj.weight': arr(mlp['down']).T,
        }
    )
  return {name: np.ascontiguousarray(w) for name, w in tensors.items()}
