"""Qwen3.5 / Qwen3-Next hybrids as Flax NNX modules: Gated DeltaNet + gated attention.

Facts (HF `modeling_qwen3_5.py`, `modeling_qwen3_5_moe.py`, `modeling_qwen3_next.py`):
layer i is full attention or Gated DeltaNet (`layer_types`, by default every
4th is attention); (1 + w) RMSNorms except the GDN output norm (plain w, gated
by silu(z)); attention with q/k norms, RoPE on the first 25% of each head
(NeoX halves), an output gate `sigmoid(gate)` packed per head after the query
in `q_proj`; SwiGLU MLPs, or a mixture of experts (softmax router, top-k,
renormalised weights, a shared expert scaled by `sigmoid(shared_expert_gate)`);
no embedding scale; untied head unless `tie_word_embeddings`. Checkpoints may
carry a multi-token-prediction head (`mtp.*`): `mtp_head` builds it (`specjax.models.mtp.MTPHead`), a
drafter module with its own params (`mtp_params_from_hf`), built when asked for.

Decode and verify steps (T <= the cache's state slots) run the recurrent GDN
form and keep the state after every position; longer prefill chunks run the
chunked form and keep only the last state (see `specjax.cache.paged`).

Einsum letters: B batch, T tokens, D model, F MLP dim, E experts, X top-k
slots, N query heads, K kv heads, H head dim, V vocab; in GDN: C conv channels,
G value heads, S state slots.
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
from specjax.models import gated_deltanet as gdn
from specjax.models.contract import CacheLayout, ChainAppend, DraftLayerSpec, StepInputs
from specjax.models.layers import Attention, AttentionSpec, DecoderBlock, GatedMLP, MoE, RMSNorm, Rope, param, weight
from specjax.models.mtp import MTPHead
from specjax.models.transformer import DecoderShape, mlp_params, run_layers
from specjax.models.weights import tensor_taker, unwrap_language_model
from specjax.quant import ops

LINEAR, FULL = 'linear_attention', 'full_attention'
MOE_TYPES = ('qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_next')
MODEL_TYPES = ('qwen3_5', 'qwen3_5_text') + MOE_TYPES


@dataclasses.dataclass(frozen=True)
class Qwen35Config(DecoderShape):
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int = 4
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10_000_000.0
  partial_rotary_factor: float = 0.25
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE block instead of a dense MLP
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  shared_expert_intermediate_size: int = 0
  norm_topk_prob: bool = True
  fused_gdn_proj: bool = False  # Qwen3-Next packs in_proj_qkvz / in_proj_ba per key-head group
  chunk_size: int = 64

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> Qwen35Config:
    """Reads an HF Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config (or its `text_config`)."""
    model_type = hf.get('model_type')
    outer, hf = hf, hf.get('text_config', hf)
    try:
      if hf.get('attn_output_gate', True) is False:
        raise SpecjaxError(f'{model_type} config: attention without the output gate is not supported')
      layers = int(hf['num_hidden_layers'])
      layer_types = hf.get('layer_types')
      if layer_types is None:
        interval = int(hf.get('full_attention_interval', 4))
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
      unknown = sorted(set(layer_types) - {LINEAR, FULL})
      if unknown:
        raise SpecjaxError(f'{model_type} config: unknown layer types {unknown} (known: {LINEAR!r}, {FULL!r})')
      if len(layer_types) != layers:
        raise SpecjaxError(f'{model_type} config: {len(layer_types)} layer_types for {layers} layers')
      rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
      if rope.get('rope_type', rope.get('type', 'default')) not in ('default', 'mrope'):
        raise SpecjaxError(f'{model_type} config: unsupported rope {rope}')
      heads = int(hf['num_attention_heads'])
      moe = model_type in MOE_TYPES
      experts = int(hf.get('num_experts', 0)) if moe else 0
      sparse_step = int(hf.get('decoder_sparse_step', 1))
      mlp_only = set(hf.get('mlp_only_layers') or [])
      moe_layers = tuple(experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(layers))
      cfg = cls(
          vocab_size=int(hf['vocab_size']),
          hidden_size=int(hf['hidden_size']),
          intermediate_size=int(hf.get('intermediate_size') or 0),
          num_layers=layers,
          num_heads=heads,
          num_kv_heads=int(hf.get('num_key_value_heads', heads)),
          head_dim=int(hf.get('head_dim') or hf['hidden_size'] // heads),
          layer_types=tuple(layer_types),
          linear_num_key_heads=int(hf['linear_num_key_heads']),
          linear_num_value_heads=int(hf['linear_num_value_heads']),
          linear_key_head_dim=int(hf['linear_key_head_dim']),
          linear_value_head_dim=int(hf['linear_value_head_dim']),
          linear_conv_kernel_dim=int(hf.get('linear_conv_kernel_dim', 4)),
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
          rope_theta=float(rope.get('rope_theta') or hf.get('rope_theta') or 10_000.0),
          partial_rotary_factor=float(rope.get('partial_rotary_factor') or hf.get('partial_rotary_factor') or 0.25),
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', outer.get('tie_word_embeddings', False))),
          max_position_embeddings=int(hf.get('max_position_embeddings', 32768)),
          moe_layers=moe_layers,
          num_experts=experts,
          num_experts_per_tok=int(hf.get('num_experts_per_tok', 0)) if moe else 0,
          moe_intermediate_size=int(hf.get('moe_intermediate_size', 0)) if moe else 0,
          shared_expert_intermediate_size=int(hf.get('shared_expert_intermediate_size', 0)) if moe else 0,
          norm_topk_prob=bool(hf.get('norm_topk_prob', True)) if model_type == 'qwen3_next' else True,
          fused_gdn_proj=model_type == 'qwen3_next',
      )
    except KeyError as e:
      raise SpecjaxError(f'{model_type} config: missing key {e.args[0]!r}') from None
    cfg.validate(model_type)
    return cfg

  def validate(self, model_type: str) -> None:
    where = f'{model_type} config'
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise SpecjaxError(
          f'{where}: linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of '
          f'linear_num_key_heads ({self.linear_num_key_heads})'
      )
    if self.num_heads % self.num_kv_heads:
      raise SpecjaxError(
          f'{where}: num_attention_heads ({self.num_heads}) is not a multiple of '
          f'num_key_value_heads ({self.num_kv_heads})'
      )
    if model_type in MOE_TYPES:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise SpecjaxError(
            f'{where}: num_experts_per_tok ({self.num_experts_per_tok}) must be in '
            f'1..num_experts ({self.num_experts})'
        )
      if self.moe_intermediate_size < 1:
        raise SpecjaxError(f'{where}: moe_intermediate_size must be positive, got {self.moe_intermediate_size}')
    if any(not m for m in self.moe_layers) and self.intermediate_size < 1:
      raise SpecjaxError(f'{where}: dense layers need intermediate_size, got {self.intermediate_size}')

  def attention_spec(self) -> AttentionSpec:
    return AttentionSpec(
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
        Rope(base=self.rope_theta, rotary_dim=self.rotary_dim),
        scale=self.head_dim**-0.5,
        eps=self.rms_norm_eps,
        qk_norm=True,
        norm_offset=1.0,
        output_gate=True,
    )


class GatedDeltaNet(nnx.Module):
  """Linear attention with a delta-rule state, fed by a causal depthwise conv."""

  def __init__(self, cfg: Qwen35Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    self.dims = (nk, nv, dk, dv)
    self.conv_dim = 2 * nk * dk + nv * dv
    # One matrix for q | k | v (the conv channels), z, b, a.
    self.in_proj = weight(rngs, (cfg.hidden_size, self.conv_dim + nv * dv + 2 * nv), dtype)
    self.conv_weight = param(rngs, (self.conv_dim, cfg.linear_conv_kernel_dim), dtype)
    self.dt_bias = nnx.Param(jnp.ones((nv,), dtype))
    self.A_log = nnx.Param(jnp.zeros((nv,), dtype))
    self.norm = RMSNorm(dv, eps=cfg.rms_norm_eps, offset=0.0, dtype=dtype)
    self.out_proj = weight(rngs, (nv * dv, cfg.hidden_size), dtype)
    self.chunk_size = cfg.chunk_size

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      ssm: jax.Array,  # [B, S, G, Dk, Dv] state slots
      conv: jax.Array,  # [B, S, W - 1, C] conv-state slots
      state_slot: jax.Array,  # [B] current slot
      query_lens: jax.Array,  # [B]
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, _ = x.shape
    nk, nv, dk, dv = self.dims
    proj = ops.matmul(x, self.in_proj[...])  # [B, T, E]
    mixed, z, beta, a = jnp.split(proj, np.cumsum([self.conv_dim, nv * dv, nv]), axis=-1)
    pick = lambda slots: jnp.take_along_axis(slots, state_slot.reshape((b,) + (1,) * (slots.ndim - 1)), axis=1)[:, 0]
    mixed, windows = gdn.causal_conv1d(mixed, pick(conv), self.conv_weight[...], query_lens)
    q, k, v = jnp.split(mixed, [nk * dk, 2 * nk * dk], axis=-1)
    q, k, v = q.reshape(b, t, nk, dk), k.reshape(b, t, nk, dk), v.reshape(b, t, nv, dv)
    valid = (jnp.arange(t)[None, :] < query_lens[:, None])[..., None]  # [B, T, 1]
    beta = jnp.where(valid, jax.nn.sigmoid(beta), 0.0)  # padding: beta = g = 0 keeps the state
    g = jnp.where(valid, -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...]), 0.0)
    if t <= ssm.shape[1]:  # decode / verify: keep the state after every position
      out, states = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, pick(ssm))
      ssm = ssm.at[:, :t].set(states)
      conv = conv.at[:, :t].set(windows.astype(conv.dtype))
    else:  # prefill chunk: only the last state
      state = pick(ssm)
      out, final = gdn.chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=self.chunk_size)
      last = jnp.maximum(query_lens - 1, 0)[:, None, None, None]
      ssm = ssm.at[:, 0].set(jnp.where((query_lens > 0)[:, None, None, None], final, state))
      conv = conv.at[:, 0].set(jnp.take_along_axis(windows, last, axis=1)[:, 0].astype(conv.dtype))
    out = self.norm(out.astype(x.dtype)) * jax.nn.silu(z.reshape(b, t, nv, dv))
    return ops.matmul(out.reshape(b, t, nv * dv), self.out_proj[...]), ssm, conv


def _block(cfg: Qwen35Config, layer_type: str, moe: bool, attention_impl: str, dtype, rngs) -> DecoderBlock:
  d = cfg.hidden_size
  if layer_type == FULL:
    mixer = Attention(d, cfg.attention_spec(), impl=attention_impl, dtype=dtype, rngs=rngs)
  else:
    mixer = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
  if moe:
    mlp = MoE(
        d,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        hidden=cfg.moe_intermediate_size,
        shared_hidden=cfg.shared_expert_intermediate_size,
        renormalize=cfg.norm_topk_prob,
        dtype=dtype,
        rngs=rngs,
    )
  else:
    mlp = GatedMLP(d, cfg.intermediate_size, activation='silu', dtype=dtype, rngs=rngs)
  return DecoderBlock(d, mixer, mlp, eps=cfg.rms_norm_eps, offset=1.0, dtype=dtype)


def mtp_head(cfg: Qwen35Config, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None):
  """The checkpoint's multi-token-prediction head (`mtp.*`): an `MTPHead` over one full-attention block."""
  rngs = rngs or nnx.Rngs(0)
  layer = _block(cfg, FULL, cfg.num_experts > 0, attention_impl, dtype, rngs)
  return MTPHead(cfg.hidden_size, layer, eps=cfg.rms_norm_eps, offset=1.0, dtype=dtype, rngs=rngs)


class Qwen35(ChainAppend, nnx.Module):
  """Qwen3.5 / Qwen3-Next causal LM (`specjax.models.contract.CausalLM`)."""

  def __init__(
      self, cfg: Qwen35Config, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    self.cfg = cfg
    self.embed_tokens = weight(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, out_axis=0, fan_in=cfg.hidden_size)
    self.layers = nnx.List(
        [
            _block(cfg, t, m, attention_impl, dtype, rngs)
            for t, m in zip(cfg.layer_types, cfg.moe_layers or (False,) * cfg.num_layers)
        ]
    )
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, offset=1.0, dtype=dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = weight(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

  def cache_layout(self) -> CacheLayout:
    """(kv heads, head dim) of each attention layer; per-row (ssm, conv) shapes of each Gated DeltaNet layer."""
    c = self.cfg
    ssm = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    conv = (
        c.linear_conv_kernel_dim - 1,
        2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim,
    )
    return CacheLayout(
        ((c.num_kv_heads, c.head_dim),) * c.layer_types.count(FULL), ((ssm, conv),) * c.layer_types.count(LINEAR)
    )

  def draft_layer_spec(self) -> DraftLayerSpec:
    """The attention layers' shape without the output gate, the dense MLP width, (1 + w) norms."""
    c = self.cfg
    return DraftLayerSpec(
        c.hidden_size, c.intermediate_size, c.attention_spec(), norm_eps=c.rms_norm_eps, norm_offset=1.0
    )

  def lookup(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    """Raw rows of the embedding table; the same as `embed` here (no embedding scale)."""
    return ops.take(self.embed_tokens[...], tokens, axis=0, dtype=self.norm.scale.dtype)

  def embed(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    return self.lookup(tokens)

  def forward(
      self,
      tokens: jax.Array,  # [B, T]
      inputs: StepInputs,
      cache: KVCache | None,
      taps: tuple[int, ...] = (),
      *,
      num_layers: int | None = None,
  ) -> tuple[jax.Array, KVCache | None, tuple[jax.Array, ...]]:
    """Runs the layers; returns the final-normed hidden `[B, T, D]`, the cache and tapped residuals.

    Without a cache the Gated DeltaNet layers start from a zero state and run
    the chunked form over the whole block; trees (`inputs.mask`) are refused,
    since a recurrent state has one history.
    """
    if inputs.mask is not None:
      raise ValueError('tree masks need attention-only models: recurrent (Gated DeltaNet) layers have one history')
    b, t = tokens.shape
    num_layers = self.cfg.num_layers if num_layers is None else num_layers
    if cache is None:
      ssm_all = [jnp.zeros((b, 1, *s), jnp.float32) for s, _ in self.cache_layout().state_shapes]
      conv_all = [jnp.zeros((b, 1, *c), self.norm.scale.dtype) for _, c in self.cache_layout().state_shapes]
      state_slot = jnp.zeros((b,), jnp.int32)
    else:
      ssm_all, conv_all, state_slot = list(cache.ssm), list(cache.conv), cache.state_slot
    types = self.cfg.layer_types[:num_layers]
    pages = [types[:i].count(FULL) if kind == FULL else None for i, kind in enumerate(types)]
    x, cache, tapped = run_layers(
        self.layers, self.embed(tokens), inputs, cache, taps, pages, state=(ssm_all, conv_all, state_slot)
    )
    if cache is not None:
      recurrent = t <= cache.num_slots
      slot = jnp.maximum(inputs.query_lens - 1, 0) if recurrent else jnp.zeros_like(inputs.query_lens)
      cache = dataclasses.replace(cache, ssm=tuple(ssm_all), conv=tuple(conv_all), state_slot=slot.astype(jnp.int32))
    return self.norm(x), cache, tapped

  def logits(self, hidden: jax.Array, ids: jax.Array | None = None) -> jax.Array:  # [..., D] -> [..., V]
    """Final logits; with `ids` [V'] only those vocabulary columns ([..., V']: a training draft vocabulary)."""
    if self.cfg.tie_word_embeddings:
      table = self.embed_tokens[...] if ids is None else ops.take_outputs(self.embed_tokens[...], ids, 0)
      return ops.matmul_t(hidden, table)
    head = self.lm_head[...] if ids is None else ops.take_outputs(self.lm_head[...], ids, 1)
    return ops.matmul(hidden, head)


# ---------------------------------------------------------------- checkpoint mapping


def _gdn_params(cfg: Qwen35Config, take, p: str) -> dict:
  d = cfg.hidden_size
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  conv_dim = 2 * nk * dk + nv * dv
  if cfg.fused_gdn_proj:  # rows grouped per key head: [q, k, v (r heads), z (r heads)] and [b (r), a (r)]
    r = nv // nk
    qkvz = take(p + 'in_proj_qkvz.weight', (2 * nk * dk + 2 * nv * dv, d)).reshape(nk, 2 * dk + 2 * r * dv, d)
    q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, r * dv]), axis=1)
    ba = take(p + 'in_proj_ba.weight', (2 * nv, d)).reshape(nk, 2 * r, d)
    rows = [q, k, v, z, ba[:, :r], ba[:, r:]]
    rows = [x.reshape(-1, d) for x in rows]
  else:
    rows = [
        take(p + 'in_proj_qkv.weight', (conv_dim, d)),
        take(p + 'in_proj_z.weight', (nv * dv, d)),
        take(p + 'in_proj_b.weight', (nv, d)),
        take(p + 'in_proj_a.weight', (nv, d)),
    ]
  return {
      'in_proj': np.concatenate(rows).T,
      'conv_weight': take(p + 'conv1d.weight', (conv_dim, 1, cfg.linear_conv_kernel_dim))[:, 0],
      'dt_bias': take(p + 'dt_bias', (nv,)),
      'A_log': take(p + 'A_log', (nv,)),
      'norm': {'scale': take(p + 'norm.weight', (dv,))},
      'out_proj': take(p + 'out_proj.weight', (d, nv * dv)).T,
  }


def _attention_params(cfg: Qwen35Config, take, p: str) -> dict:
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  query_gate = take(p + 'q_proj.weight', (2 * n * h, d)).reshape(n, 2, h, d)  # per head: query rows, gate rows
  return {
      'qkv_proj': np.concatenate(
          [
              query_gate[:, 0].reshape(n * h, d),
              take(p + 'k_proj.weight', (k * h, d)),
              take(p + 'v_proj.weight', (k * h, d)),
              query_gate[:, 1].reshape(n * h, d),
          ]
      ).T,
      'o_proj': take(p + 'o_proj.weight', (d, n * h)).T,
      'q_norm': {'scale': take(p + 'q_norm.weight', (h,))},
      'k_norm': {'scale': take(p + 'k_norm.weight', (h,))},
  }


def _moe_params(cfg: Qwen35Config, take, tensors, p: str) -> dict:
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  if p + 'experts.gate_up_proj' in tensors:  # fused layout: [E, 2F, D] (gate rows first), [E, D, F]
    gate_up = take(p + 'experts.gate_up_proj', (e, 2 * f, d)).transpose(0, 2, 1)
    down = take(p + 'experts.down_proj', (e, d, f)).transpose(0, 2, 1)
  else:  # hub layout: one Linear per expert
    experts = [mlp_params(take, f'{p}experts.{i}.', d, f) for i in range(e)]
    gate_up = np.stack([x['gate_up'] for x in experts])
    down = np.stack([x['down'] for x in experts])
    extra = sorted(n for n in tensors if n.startswith(p + 'experts.'))
    if extra:
      raise SpecjaxError(f'checkpoint has weights of experts beyond num_experts={e}, e.g. {extra[0]!r}')
  params = {'router': take(p + 'gate.weight', (e, d)).T, 'gate_up': gate_up, 'down': down}
  if cfg.shared_expert_intermediate_size:
    params['shared_expert'] = mlp_params(take, p + 'shared_expert.', d, cfg.shared_expert_intermediate_size)
    params['shared_gate'] = take(p + 'shared_expert_gate.weight', (1, d)).T
  return params


def _block_params(cfg: Qwen35Config, take, tensors, p: str, layer_type: str, moe: bool) -> dict:
  d = cfg.hidden_size
  return {
      'mixer_norm': {'scale': take(p + 'input_layernorm.weight', (d,))},
      'mixer': (
          _attention_params(cfg, take, p + 'self_attn.')
          if layer_type == FULL
          else _gdn_params(cfg, take, p + 'linear_attn.')
      ),
      'mlp_norm': {'scale': take(p + 'post_attention_layernorm.weight', (d,))},
      'mlp': (
          _moe_params(cfg, take, tensors, p + 'mlp.') if moe else mlp_params(take, p + 'mlp.', d, cfg.intermediate_size)
      ),
  }


def params_from_hf(cfg: Qwen35Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps HF-named tensors (text-only or multimodal-wrapper names) to the pure-dict state of `Qwen35`."""
  unwrap_language_model(tensors, ('model.visual.', 'visual.'))  # the vision tower is not used
  take = tensor_taker(tensors)
  d = cfg.hidden_size
  moe_layers = cfg.moe_layers or (False,) * cfg.num_layers
  params = {
      'embed_tokens': take('model.embed_tokens.weight', (cfg.vocab_size, d)),
      'layers': {
          i: _block_params(cfg, take, tensors, f'model.layers.{i}.', t, m)
          for i, (t, m) in enumerate(zip(cfg.layer_types, moe_layers))
      },
      'norm': {'scale': take('model.norm.weight', (d,))},
  }
  if cfg.tie_word_embeddings:
    tensors.pop('lm_head.weight', None)
  else:
    params['lm_head'] = take('lm_head.weight', (cfg.vocab_size, d)).T
  return params


def mtp_params_from_hf(cfg: Qwen35Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps the checkpoint's `mtp.*` tensors to the pure-dict state of an `MTPHead`."""
  take = tensor_taker(tensors)
  d = cfg.hidden_size
  return {
      'pre_fc_norm_embedding': {'scale': take('mtp.pre_fc_norm_embedding.weight', (d,))},
      'pre_fc_norm_hidden': {'scale': take('mtp.pre_fc_norm_hidden.weight', (d,))},
      'fc': take('mtp.fc.weight', (d, 2 * d)).T,
      'layer': _block_params(cfg, take, tensors, 'mtp.layers.0.', FULL, cfg.num_experts > 0),
      'norm': {'scale': take('mtp.norm.weight', (d,))},
  }
