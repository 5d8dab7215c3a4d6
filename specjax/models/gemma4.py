"""Gemma 4 text targets as a Flax NNX module (`gemma4_text`; `gemma4`, the multimodal wrapper, by its text_config).

Facts (HF `modeling_gemma4.py`, `configuration_gemma4.py`): plain-weight
RMSNorms (`x * w`, w starts at 1); Gemma 3's sandwich norms; attention scale 1
(the q/k norms carry it) and a weightless RMS norm on values; per layer type
its own head dim (`head_dim` sliding, `global_head_dim` full), kv heads
(`num_global_key_value_heads` on full layers, only with `attention_k_eq_v`) and
RoPE (`rope_parameters[type]`: sliding default θ 1e4, full `proportional`
θ 1e6 over a quarter of the head); sliding windows of W keys including the
token itself; embeddings times sqrt(D); a final logit softcap; each block's
output times its `layer_scalar`. transformers 5 writes the per-type head dims
and kv heads as `per_layer_config`; Hub configs as `global_head_dim` /
`num_global_key_value_heads`. Both are read.

Options of the larger and smaller models:
- Per-layer embeddings (PLE, E2B / E4B): `(norm(per_layer_model_projection(e) /
  sqrt(D)) + embed_tokens_per_layer(ids) * sqrt(P)) / sqrt(2)` (e the scaled
  embedding), `[B, T, L, P]`; after its MLP, layer i adds
  `post_norm(per_layer_projection(act(per_layer_input_gate(x)) * ple_i))`.
- KV sharing: layers at or past L - num_kv_shared_layers have no k/v
  projections and no cache pages; they attend to the keys and values of the
  last unshared layer of their type, the donor (`Gemma4.kv_donors`). With
  `use_double_wide_mlp` their MLP is twice as wide.
- `attention_k_eq_v` (26B-A4B, 31B): full layers have no v_proj; values are
  the key projection (before k_norm and RoPE), v-normed.
- MoE block (26B-A4B): the dense MLP (post-normed) plus routed experts (GeGLU)
  on the pre-MLP residual: router on `rms(x) * scale / sqrt(D)`, softmax, top-k
  renormalised, times `per_expert_scale`; experts read `pre_norm_2(x)`; both
  branches post-normed, summed, post-normed again.

Einsum letters: B batch, T tokens, D model, V vocab, E experts, X top-k slots,
L layers, P per-layer embedding dim, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache.paged import KVCache
from specjax.errors import SpecjaxError
from specjax.models.contract import CacheLayout, ChainAppend, DraftLayerSpec, StepInputs
from specjax.models.layers import (
    ACTIVATIONS,
    Attention,
    AttentionSpec,
    DecoderBlock,
    GatedMLP,
    RMSNorm,
    Rope,
    param,
    rms_normalize,
    routed_experts,
    softmax_rows,
    weight,
)
from pallas_kernels.reductions import tree_sum
from specjax.models.transformer import head_logits, mlp_params, run_layers
from specjax.models.weights import tensor_taker, unwrap_language_model
from specjax.quant import ops

SLIDING, FULL = 'sliding_attention', 'full_attention'
MODEL_TYPES = ('gemma4_text', 'gemma4')
TOWERS = ('model.vision_tower.', 'model.audio_tower.', 'model.embed_vision.', 'model.embed_audio.')
# transformers' Gemma4TextConfig defaults, used when a config leaves them out.
DEFAULT_ROPE = {
    SLIDING: {'rope_type': 'default', 'rope_theta': 10_000.0},
    FULL: {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1_000_000.0},
}


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  layer_types: tuple[str, ...]
  head_dims: tuple[int, ...]  # per layer
  kv_heads: tuple[int, ...]  # per layer
  ropes: tuple[Rope, ...]  # per layer
  sliding_window: int = 512
  rms_norm_eps: float = 1e-6
  final_logit_softcapping: float | None = None
  hidden_activation: str = 'gelu_pytorch_tanh'
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 131072
  num_kv_shared_layers: int = 0
  hidden_size_per_layer_input: int = 0  # 0: no per-layer embeddings
  vocab_size_per_layer_input: int = 0
  attention_k_eq_v: bool = False
  use_double_wide_mlp: bool = False
  num_experts: int = 0  # 0: no MoE block
  top_k_experts: int = 0
  moe_intermediate_size: int = 0

  @property
  def first_shared(self) -> int:
    """The first layer without k/v projections of its own (L when nothing is shared)."""
    return self.num_layers - self.num_kv_shared_layers

  @property
  def donors(self) -> dict[str, int]:
    """Layer type -> its last unshared layer, whose keys and values the shared layers of that type read."""
    return {t: i for i, t in enumerate(self.layer_types[: self.first_shared])}

  def mlp_width(self, i: int) -> int:
    return self.intermediate_size * (2 if self.use_double_wide_mlp and i >= self.first_shared else 1)

  def kv_projections(self, i: int) -> int:
    """Key/value projections of layer i: 2 (k, v), 1 (values are the keys: k_eq_v) or 0 (KV-shared)."""
    if i >= self.first_shared:
      return 0
    return 1 if self.attention_k_eq_v and self.layer_types[i] == FULL else 2

  def attention_spec(self, i: int) -> AttentionSpec:
    sliding = self.layer_types[i] == SLIDING
    return AttentionSpec(
        self.num_heads,
        self.kv_heads[i],
        self.head_dims[i],
        self.ropes[i],
        scale=1.0,
        eps=self.rms_norm_eps,
        qk_norm=True,
        window=self.sliding_window if sliding else None,
        kv=('shared', 'k=v', 'own')[self.kv_projections(i)],
        v_norm=True,
    )

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> Gemma4Config:
    """Reads an HF `Gemma4TextConfig` dict, or the `text_config` of a `Gemma4Config` (`gemma4`)."""
    model_type = hf.get('model_type')
    where = f'{model_type} config'
    try:
      outer, hf = hf, hf['text_config'] if model_type == 'gemma4' else hf
      if hf.get('attention_bias'):
        raise SpecjaxError(f'{where}: attention_bias=true is not supported')
      if hf.get('use_bidirectional_attention') == 'all':
        raise SpecjaxError(f'{where}: use_bidirectional_attention="all" (a non-causal model) is not supported')
      act = hf.get('hidden_activation') or hf.get('hidden_act') or 'gelu_pytorch_tanh'
      if act not in ACTIVATIONS:
        raise SpecjaxError(f'{where}: unsupported activation {act!r}')
      layers = int(hf['num_hidden_layers'])
      layer_types = list(hf.get('layer_types') or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
      unknown = sorted(set(layer_types) - {SLIDING, FULL})
      if unknown or len(layer_types) != layers:
        raise SpecjaxError(
            f'{where}: layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {unknown or len(layer_types)}'
        )
      layer_types[-1] = FULL  # as transformers forces it
      heads = int(hf['num_attention_heads'])
      k_eq_v = bool(hf.get('attention_k_eq_v', False))
      head_dims, kv_heads = _per_layer_shapes(hf, layer_types, k_eq_v, where)
      rope_params = hf.get('rope_parameters') or DEFAULT_ROPE
      ropes = tuple(rope_from_hf(rope_params, t, h, where) for t, h in zip(layer_types, head_dims))
      experts = int(hf.get('num_experts') or 0) if hf.get('enable_moe_block') else 0
      moe_width = int(hf.get('moe_intermediate_size') or hf.get('expert_intermediate_size') or 0)
      ple = int(hf.get('hidden_size_per_layer_input', 256) or 0)
      cfg = cls(
          vocab_size=int(hf.get('vocab_size', 262_144)),
          hidden_size=int(hf['hidden_size']),
          intermediate_size=int(hf['intermediate_size']),
          num_layers=layers,
          num_heads=heads,
          layer_types=tuple(layer_types),
          head_dims=head_dims,
          kv_heads=kv_heads,
          ropes=ropes,
          sliding_window=int(hf.get('sliding_window') or 512),
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
          final_logit_softcapping=hf.get('final_logit_softcapping'),
          hidden_activation=act,
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', outer.get('tie_word_embeddings', True))),
          max_position_embeddings=int(hf.get('max_position_embeddings', 131072)),
          num_kv_shared_layers=int(hf.get('num_kv_shared_layers') or 0),
          hidden_size_per_layer_input=ple,
          vocab_size_per_layer_input=int(hf.get('vocab_size_per_layer_input', 262_144)) if ple else 0,
          attention_k_eq_v=k_eq_v,
          use_double_wide_mlp=bool(hf.get('use_double_wide_mlp', False)),
          num_experts=experts,
          top_k_experts=int(hf.get('top_k_experts') or 0) if experts else 0,
          moe_intermediate_size=moe_width if experts else 0,
      )
    except KeyError as e:
      raise SpecjaxError(f'{where}: missing key {e.args[0]!r}') from None
    cfg.validate(where)
    return cfg

  def validate(self, where: str) -> None:
    if not 0 <= self.num_kv_shared_layers < self.num_layers:
      raise SpecjaxError(
          f'{where}: num_kv_shared_layers ({self.num_kv_shared_layers}) must leave layers with their own '
          f'keys and values (num_hidden_layers {self.num_layers})'
      )
    missing = sorted(set(self.layer_types) - set(self.donors))
    if missing:
      raise SpecjaxError(
          f'{where}: no layer before the KV-shared ones (from layer {self.first_shared}) is {missing[0]!r}, '
          'so its shared layers have no keys and values to read'
      )
    for i in range(self.num_layers):
      if self.num_heads % self.kv_heads[i]:
        raise SpecjaxError(
            f"{where}: num_attention_heads ({self.num_heads}) is not a multiple of layer {i}'s kv heads "
            f'({self.kv_heads[i]})'
        )
      donor = self.donors[self.layer_types[i]]
      if i >= self.first_shared and (self.kv_heads[i], self.head_dims[i]) != (
          self.kv_heads[donor],
          self.head_dims[donor],
      ):
        raise SpecjaxError(f'{where}: KV-shared layer {i} has other kv heads / head dim than its donor layer {donor}')
    if self.num_experts and not 1 <= self.top_k_experts <= self.num_experts:
      raise SpecjaxError(
          f'{where}: top_k_experts ({self.top_k_experts}) must be in 1..num_experts ({self.num_experts})'
      )
    if self.num_experts and self.moe_intermediate_size < 1:
      raise SpecjaxError(f'{where}: enable_moe_block needs a positive moe_intermediate_size')


def _per_layer_shapes(hf: dict, layer_types: list[str], k_eq_v: bool, where: str) -> tuple[tuple[int, ...], ...]:
  """(head dims, kv heads) per layer: `per_layer_config`, else `global_head_dim` / `num_global_key_value_heads`."""
  head_dim = int(hf.get('head_dim') or 256)
  kv = int(hf.get('num_key_value_heads') or 4)
  overrides = hf.get('per_layer_config')
  if overrides is None:  # transformers' rule: full layers take the global values
    full = {'head_dim': int(hf.get('global_head_dim') or 512)}
    if k_eq_v and hf.get('num_global_key_value_heads') is not None:
      full['num_key_value_heads'] = int(hf['num_global_key_value_heads'])
    overrides = {i: full for i, t in enumerate(layer_types) if t == FULL}
  layers = [{} for _ in layer_types]
  for i, values in overrides.items():
    if not 0 <= int(i) < len(layer_types):
      raise SpecjaxError(f'{where}: per_layer_config names layer {i} of {len(layer_types)}')
    extra = sorted(set(values) - {'head_dim', 'num_key_value_heads'})
    if extra:
      raise SpecjaxError(f'{where}: per_layer_config sets {extra[0]!r} (supported: head_dim, num_key_value_heads)')
    layers[int(i)] = values
  return (
      tuple(int(v.get('head_dim', head_dim)) for v in layers),
      tuple(int(v.get('num_key_value_heads', kv)) for v in layers),
  )


def rope_from_hf(rope: dict[str, Any], layer_type: str, head_dim: int, where: str) -> Rope:
  """One layer type's RoPE from `rope_parameters`: `default` or `proportional`.

  `default` ignores partial_rotary_factor, as upstream; `proportional` rotates
  int(partial_rotary_factor * head_dim // 2) pairs, as transformers. A missing
  theta is transformers' default for the layer type (1e4 sliding, 1e6 full).
  """
  params = rope.get(layer_type)
  if not isinstance(params, dict):
    raise SpecjaxError(f'{where}: rope_parameters has no entry for {layer_type!r}')
  kind = params.get('rope_type', 'default')
  base = float(params.get('rope_theta', DEFAULT_ROPE[layer_type]['rope_theta']))
  if kind == 'default':
    return Rope(base=base)
  if kind == 'proportional':
    angles = int(float(params.get('partial_rotary_factor', 1.0)) * head_dim // 2)
    return Rope(base=base, kind='proportional', rope_angles=angles, factor=float(params.get('factor', 1.0)))
  raise SpecjaxError(f'{where}: unsupported rope_type {kind!r} for {layer_type} (supported: default, proportional)')


class Gemma4MoE(nnx.Module):
  """Routed GeGLU experts on the pre-MLP residual, their output post-normed (26B-A4B)."""

  def __init__(self, cfg: Gemma4Config, *, dtype, rngs: nnx.Rngs):
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    norm = lambda: RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
    self.router_scale = nnx.Param(jnp.ones((d,), dtype))
    self.router = weight(rngs, (d, e), dtype, keep_float=True)
    self.per_expert_scale = nnx.Param(jnp.ones((e,), dtype))
    self.gate_up = weight(rngs, (e, d, 2 * f), dtype, fan_in=d)
    self.down = weight(rngs, (e, f, d), dtype, fan_in=f)
    self.pre_norm, self.post_norm = norm(), norm()
    self.top_k, self.eps, self.activation = cfg.top_k_experts, cfg.rms_norm_eps, cfg.hidden_activation

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
    d = x.shape[-1]
    routed = (rms_normalize(x, self.eps) * self.router_scale[...] * d**-0.5).astype(x.dtype)
    weights, experts = jax.lax.top_k(softmax_rows(ops.matmul(routed, self.router[...])), self.top_k)  # [B, T, X]
    weights = weights / tree_sum(weights) * self.per_expert_scale[...][experts]
    out = routed_experts(self.pre_norm(x), weights, experts, self.gate_up[...], self.down[...], self.activation)
    return self.post_norm(out)


def _block(cfg: Gemma4Config, i: int, *, attention_impl: str, dtype, rngs: nnx.Rngs) -> DecoderBlock:
  """Sandwich-normed attention and MLP (+ MoE), then the per-layer embedding branch, times `layer_scalar`."""
  d = cfg.hidden_size
  return DecoderBlock(
      d,
      Attention(d, cfg.attention_spec(i), impl=attention_impl, dtype=dtype, rngs=rngs),
      GatedMLP(d, cfg.mlp_width(i), activation=cfg.hidden_activation, dtype=dtype, rngs=rngs),
      eps=cfg.rms_norm_eps,
      offset=0.0,
      sandwich=True,
      moe=Gemma4MoE(cfg, dtype=dtype, rngs=rngs) if cfg.num_experts else None,
      per_layer_dim=cfg.hidden_size_per_layer_input,
      activation=cfg.hidden_activation,
      layer_scalar=True,
      dtype=dtype,
      rngs=rngs,
  )


class Gemma4(ChainAppend, nnx.Module):
  """Gemma 4 causal LM over the paged KV cache (`specjax.models.contract.CausalLM`).

  KV sharing: `cache_layout().kv_shapes` lists only the unshared layers (0 ..
  L - num_kv_shared_layers - 1, in order), so `cache.k_pages[j]` belongs to
  layer j; a shared layer reads the pages of its donor (`kv_layer(i)`,
  `kv_donors()`), written earlier in the same step. The donors keep every key
  (windows only mask), so an assistant drafter can read them too. The
  embedding is stored `[D, V]`, as in `DecoderLM`.
  """

  def __init__(
      self, cfg: Gemma4Config, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    d, p = cfg.hidden_size, cfg.hidden_size_per_layer_input
    self.cfg = cfg
    self.embed_tokens = weight(rngs, (d, cfg.vocab_size), dtype)
    if p:
      lp = cfg.num_layers * p
      self.embed_tokens_per_layer = param(rngs, (cfg.vocab_size_per_layer_input, lp), dtype, fan_in=p)
      self.per_layer_model_projection = param(rngs, (d, lp), dtype)
      self.per_layer_projection_norm = RMSNorm(p, eps=cfg.rms_norm_eps, dtype=dtype)
    self.layers = nnx.List(
        [_block(cfg, i, attention_impl=attention_impl, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
    )
    self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = weight(rngs, (d, cfg.vocab_size), dtype)

  @property
  def layer_types(self) -> tuple[str, ...]:
    return self.cfg.layer_types

  def kv_donors(self) -> dict[str, int]:
    """Layer type -> index into `cache.k_pages` of the last unshared layer of that type."""
    return self.cfg.donors

  def draft_layer_spec(self) -> DraftLayerSpec:
    """The last full layer's heads and head dim, a default RoPE at its base, the dense MLP width, sandwich norms."""
    c = self.cfg
    i = max((i for i, t in enumerate(c.layer_types) if t == FULL), default=c.num_layers - 1)
    return DraftLayerSpec(
        c.hidden_size,
        c.intermediate_size,
        c.attention_spec(i),
        activation=c.hidden_activation,
        norm_eps=c.rms_norm_eps,
        sandwich_norms=True,
    )

  def kv_layer(self, i: int) -> int:
    """Index into `cache.k_pages` of the keys and values layer i attends to (a shared layer's: its donor's)."""
    return i if i < self.cfg.first_shared else self.cfg.donors[self.cfg.layer_types[i]]

  def cache_layout(self) -> CacheLayout:
    """(kv heads, head dim) of each unshared layer: KV-shared layers own no pages."""
    c = self.cfg
    return CacheLayout(tuple((c.kv_heads[i], c.head_dims[i]) for i in range(c.first_shared)))

  def lookup(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    """Raw rows of the embedding table (no sqrt(D) scale)."""
    return jnp.moveaxis(ops.take(self.embed_tokens[...], tokens, axis=1, dtype=self.norm.scale.dtype), 0, -1)

  def embed(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    x = self.lookup(tokens)
    return x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)

  def per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array | None:  # [B, T], [B, T, D]
    """The per-layer embeddings `[B, T, L, P]` of `tokens` (scaled embeddings `x`), or None without PLE."""
    c = self.cfg
    p = c.hidden_size_per_layer_input
    if not p:
      return None
    b, t = tokens.shape
    proj = jnp.einsum('btd,de->bte', x, self.per_layer_model_projection[...]) * jnp.asarray(
        c.hidden_size**-0.5, x.dtype
    )
    proj = self.per_layer_projection_norm(proj.reshape(b, t, c.num_layers, p))
    table = self.embed_tokens_per_layer[...]
    ids = jnp.take(table, tokens, axis=0).reshape(b, t, c.num_layers, p) * jnp.asarray(p**0.5, table.dtype)
    return (proj + ids) * jnp.asarray(2**-0.5, x.dtype)

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

    Returns the final-normed hidden `[B, T, D]`, the cache (pages of layers
    past `num_layers` untouched; `None` without one) and the residual stream
    after each layer in `taps`. Any depth works: donors precede every shared
    layer. Without a cache a shared layer attends to its donor's keys and
    values of the given tokens.
    """
    num_layers = self.cfg.num_layers if num_layers is None else num_layers
    x = self.embed(tokens)
    pages = [self.kv_layer(i) for i in range(num_layers)]
    x, cache, tapped = run_layers(
        self.layers, x, inputs, cache, taps, pages, per_layer=self.per_layer_inputs(tokens, x)
    )
    return self.norm(x), cache, tapped

  def logits(self, hidden: jax.Array, ids: jax.Array | None = None) -> jax.Array:  # [..., D] -> [..., V]
    """Softcapped logits; with `ids` [V'] only those vocabulary columns ([..., V']: a training draft vocabulary)."""
    head = self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
    return head_logits(hidden, head, ids, self.cfg.final_logit_softcapping)


def build(cfg: Gemma4Config, **kwargs) -> Gemma4:
  return Gemma4(cfg, **kwargs)


# ---------------------------------------------------------------- checkpoint mapping


def _attention_params(cfg: Gemma4Config, take, tensors, i: int, p: str) -> dict:
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads[i], cfg.head_dims[i]
  kv = cfg.kv_projections(i)
  rows = [take(p + 'q_proj.weight', (n * h, d))]
  if kv:
    rows.append(take(p + 'k_proj.weight', (k * h, d)))
  if kv == 2:
    rows.append(take(p + 'v_proj.weight', (k * h, d)))
  params = {
      'qkv_proj': np.concatenate(rows).T,
      'o_proj': take(p + 'o_proj.weight', (d, n * h)).T,
      'q_norm': {'scale': take(p + 'q_norm.weight', (h,))},
  }
  if kv:
    params['k_norm'] = {'scale': take(p + 'k_norm.weight', (h,))}
  else:  # a checkpoint may still hold a shared layer's k/v weights; transformers ignores them too
    for name in ('k_proj', 'v_proj', 'k_norm', 'v_norm'):
      tensors.pop(p + name + '.weight', None)
  return params


def _block_params(cfg: Gemma4Config, take, tensors, i: int) -> dict:
  d, p = cfg.hidden_size, f'model.layers.{i}.'
  norm = lambda name, dim=d: {'scale': take(p + name + '.weight', (dim,))}
  params = {
      'mixer_norm': norm('input_layernorm'),
      'mixer': _attention_params(cfg, take, tensors, i, p + 'self_attn.'),
      'mixer_post_norm': norm('post_attention_layernorm'),
      'mlp_norm': norm('pre_feedforward_layernorm'),
      'mlp': mlp_params(take, p + 'mlp.', d, cfg.mlp_width(i)),
      'mlp_post_norm': norm('post_feedforward_layernorm'),
      'layer_scalar': take(p + 'layer_scalar', (1,)),
  }
  if cfg.num_experts:
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    params['dense_post_norm'] = norm('post_feedforward_layernorm_1')
    params['moe'] = {
        'router_scale': take(p + 'router.scale', (d,)),
        'router': take(p + 'router.proj.weight', (e, d)).T,
        'per_expert_scale': take(p + 'router.per_expert_scale', (e,)),
        'gate_up': take(p + 'experts.gate_up_proj', (e, 2 * f, d)).transpose(0, 2, 1),
        'down': take(p + 'experts.down_proj', (e, d, f)).transpose(0, 2, 1),
        'pre_norm': norm('pre_feedforward_layernorm_2'),
        'post_norm': norm('post_feedforward_layernorm_2'),
    }
  if q := cfg.hidden_size_per_layer_input:
    params['ple_gate'] = take(p + 'per_layer_input_gate.weight', (q, d)).T
    params['ple_proj'] = take(p + 'per_layer_projection.weight', (d, q)).T
    params['ple_norm'] = norm('post_per_layer_input_norm')
  return params


def params_from_hf(cfg: Gemma4Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps HF-named tensors (`Gemma4ForCausalLM`, or `Gemma4ForConditionalGeneration`'s
  `model.language_model.*`, its towers dropped) to the pure-dict state of `Gemma4`."""
  unwrap_language_model(tensors, TOWERS)
  take = tensor_taker(tensors)
  d, q = cfg.hidden_size, cfg.hidden_size_per_layer_input
  params = {
      'embed_tokens': take('model.embed_tokens.weight', (cfg.vocab_size, d)).T,
      'layers': {i: _block_params(cfg, take, tensors, i) for i in range(cfg.num_layers)},
      'norm': {'scale': take('model.norm.weight', (d,))},
  }
  if q:
    lq = cfg.num_layers * q
    params['embed_tokens_per_layer'] = take('model.embed_tokens_per_layer.weight', (cfg.vocab_size_per_layer_input, lq))
    params['per_layer_model_projection'] = take('model.per_layer_model_projection.weight', (lq, d)).T
    params['per_layer_projection_norm'] = {'scale': take('model.per_layer_projection_norm.weight', (q,))}
  if cfg.tie_word_embeddings:
    tensors.pop('lm_head.weight', None)
  else:
    params['lm_head'] = take('lm_head.weight', (cfg.vocab_size, d)).T
  return params
