"""Blocks shared by every model family: norms, rotary embeddings, attention, MLPs, MoE.

A family file holds its config, its wiring of these blocks and its weight
names; nothing here knows a family.

Einsum letters: B batch, T new tokens, S keys, D model dim, F MLP dim, E experts,
X top-k slots, N query heads, K key/value heads, G query heads per kv head,
H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.paged_attention import MASK_VALUE, paged_attention
from pallas_kernels.reductions import tree_sum
from specjax.cache.paged import write_kv
from specjax.models.contract import PagedKV, StepInputs
from specjax.parallel.attention import sharded_paged_attention
from specjax.quant import ops
from specjax.quant.formats import QMatrix

ACTIVATIONS = {
    'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'silu': jax.nn.silu,
}


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, *, fan_in: int | None = None) -> nnx.Param:
  """A weight drawn from N(0, 1 / fan_in) (fan_in: the first axis by default)."""
  fan_in = fan_in or shape[0]
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(fan_in**-0.5, dtype))


class Weight(nnx.Param):
  """A matrix (or a stack of expert matrices) the blocks read only through `specjax.quant.ops`, so it may hold a
  `QMatrix`.

  Metadata `out_axis`: its output axis (1 for a `[K, N]` projection, 0 for a
  `[V, D]` table; a stack `[E, ., .]`: each matrix's). `specjax.quant.quantize_params`
  quantizes these and nothing else; `keep_float=True` (MoE routers) keeps it float,
  multiplied on the quantized kernel (`specjax.quant.params.kernel_floats`).
  """


def weight(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    dtype,
    *,
    out_axis: int = 1,
    fan_in: int | None = None,
    keep_float: bool = False,
) -> Weight:
  """A quantizable matrix (`Weight`) drawn as `param` draws."""
  extra = {'keep_float': True} if keep_float else {}
  return Weight(param(rngs, shape, dtype, fan_in=fan_in)[...], out_axis=out_axis, **extra)


def softmax_rows(x: jax.Array) -> jax.Array:  # [..., E] -> float32 [..., E]
  """Softmax over the last axis whose sum is a fixed tree (`tree_sum`): a row's bits do not depend on the rows
  around it (a router's weights in a verify pass equal the decode step's)."""
  x = x.astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  return e / tree_sum(e)


class RMSNorm(nnx.Module):
  """RMS norm over the last axis, `x * rsqrt(mean(x^2) + eps) * (offset + w)`.

  `offset=1.0` is Gemma 3's and Qwen3.5's zero-centred form (w starts at 0);
  `offset=0.0` the plain weight of Llama, Qwen3 and Gemma 4 (w starts at 1).
  """

  def __init__(self, dim: int, *, eps: float, offset: float = 0.0, dtype=jnp.float32):
    self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    y = rms_normalize(x, self.eps)  # float32
    return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:  # [..., D] -> float32 [..., D]
  """`x * rsqrt(mean(x^2) + eps)` over the last axis in float32: an RMS norm without a weight.

  The sum of squares is a fixed tree of adds (`tree_sum`), not XLA's row reduction, whose order on CPU depends
  on how many rows there are: a verify pass of K + 1 positions normed a row to other bits than the decode step of
  the same position (experiments/width_numerics/).
  """
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(tree_sum(x32 * x32) / x.shape[-1] + eps)


# ---------------------------------------------------------------- rotary embeddings


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary embedding (NeoX halves: dim i pairs with i + rotary_dim / 2).

  kind:
    'default'       inverse frequencies base^(-2i / rotary_dim);
    'linear'        all divided by `factor` (Gemma 3 4B+ full layers);
    'llama3'        Llama 3.1's smooth split between low and high frequencies;
    'proportional'  Gemma 4 full layers: the first `rope_angles` frequencies are
                    base^(-2i / rotary_dim), the rest 0 (those dims pass), over
                    the whole head, divided by `factor`.
  `rotary_dim` < head dim rotates only the first `rotary_dim` features (Qwen3.5's
  partial rotary). `freq_factors` (GGUF `rope_freqs`) divide the frequencies.
  """

  base: float = 10_000.0
  rotary_dim: int = 0  # 0: the whole head
  kind: str = 'default'
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_angles: int = 0  # 'proportional': rotated frequency pairs
  freq_factors: tuple[float, ...] = ()

  def inv_freq(self, head_dim: int) -> np.ndarray:  # [rotary_dim / 2] float64
    dim = self.rotary_dim or head_dim
    inv = self.base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if self.kind == 'linear':
      inv = inv / self.factor
    elif self.kind == 'llama3':
      low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
      high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
      wavelen = 2 * math.pi / inv
      smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
          self.high_freq_factor - self.low_freq_factor
      )
      smoothed = (1 - smooth) * inv / self.factor + smooth * inv
      inv = np.where(wavelen > low_wavelen, inv / self.factor, np.where(wavelen < high_wavelen, inv, smoothed))
    elif self.kind == 'proportional':
      inv = np.where(np.arange(inv.size) < self.rope_angles, inv, 0.0) / self.factor
    elif self.kind != 'default':
      raise ValueError(f'unknown rope kind {self.kind!r}')
    if self.freq_factors:
      inv = inv / np.asarray(self.freq_factors, np.float64)
    return inv

  def __call__(
      self,
      x: jax.Array,  # [B, T, N, H]
      positions: jax.Array,  # [B, T]
  ) -> jax.Array:
    head_dim = x.shape[-1]
    dim = self.rotary_dim or head_dim
    half = dim // 2
    inv_freq = jnp.asarray(self.inv_freq(head_dim), jnp.float32)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, half]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:dim]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if dim == head_dim:
      return rotated
    return jnp.concatenate([rotated, x[..., dim:]], axis=-1)


# ---------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Static options of one attention layer."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope: Rope
  scale: float  # multiplies q.k
  eps: float = 1e-6  # q/k norms (and the v norm)
  qk_norm: bool = False  # per-head RMSNorm of queries and keys
  norm_offset: float = 0.0  # of the q/k norms
  window: int | None = None  # sliding window: keys at most window - 1 positions back
  softcap: float | None = None  # cap * tanh(logits / cap)
  output_gate: bool = False  # out * sigmoid(gate), the gate packed per head after the query
  kv: str = 'own'  # 'own' k and v projections; 'k=v': values are the raw key projection; 'shared': none (a donor's)
  v_norm: bool = False  # a weightless RMS norm on the values (Gemma 4)


KV_PROJECTIONS = {'own': 2, 'k=v': 1, 'shared': 0}  # AttentionSpec.kv -> key/value projections of the layer


def token_mask(inputs: StepInputs, window: int | None = None) -> jax.Array:  # [B, T, T] bool
  """Which given token each given token sees without a cache.

  Token i sees token j iff j < query_lens, `mask[i, j]` (causal j <= i when no
  mask is given) and, with a window, `positions[i] - positions[j] < window`.
  """
  idx = jnp.arange(inputs.positions.shape[1])
  live = idx[None, :] < inputs.query_lens[:, None]  # [B, T]
  seen = inputs.mask if inputs.mask is not None else (idx[None, :, None] >= idx[None, None, :])
  seen = seen & live[:, None, :] & live[:, :, None]
  if window is not None:
    seen = seen & (inputs.positions[:, :, None] - inputs.positions[:, None, :] < window)
  return seen


def dense_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    seen: jax.Array,  # [B, T, S] bool: query t sees key s
    *,
    scale: float,
    softcap: float | None = None,
    row_kv: tuple[tuple[jax.Array, jax.Array], ...] = (),  # (keys, values) [B, T, K, H]: query t sees row t of each
) -> jax.Array:  # [B, T, N, H]
  """Masked attention over keys given as arrays: the cache-free forward, references, training.

  `row_kv` adds keys that each query sees at its own row only (the training-time
  test's later steps). Queries that see nothing give zeros, as in the paged kernel.
  """
  b, t, n, h = q.shape
  s, kv = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kv, n // kv, h)
  logits = jnp.einsum('btkgh,bskh->bkgts', qg, k, preferred_element_type=jnp.float32) * scale
  if row_kv:
    own_row = [
        jnp.einsum('btkgh,btkh->bkgt', qg, kj, preferred_element_type=jnp.float32)[..., None] for kj, _ in row_kv
    ]
    logits = jnp.concatenate([logits] + [x * scale for x in own_row], axis=-1)  # [B, K, G, T, S + rows]
    seen = jnp.concatenate([seen, jnp.ones((b, t, len(row_kv)), bool)], axis=-1)
  if softcap:
    logits = jnp.tanh(logits / softcap) * softcap
  logits = jnp.where(seen[:, None, None], logits, MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(jnp.any(seen, axis=-1)[:, None, None, :, None], probs, 0.0).astype(v.dtype)
  out = jnp.einsum('bkgts,bskh->btkgh', probs[..., :s], v)
  for j, (_, vj) in enumerate(row_kv):
    out = out + jnp.einsum('bkgt,btkh->btkgh', probs[..., s + j], vj)
  return out.reshape(b, t, n, h)


class Attention(nnx.Module):
  """GQA attention over the paged KV cache (or over the given tokens alone).

  Options (`AttentionSpec`): q/k norms, a weightless v norm, RoPE variants,
  sliding window, logit softcap, sigmoid output gate, and where keys and values
  come from (`kv`): own projections, values that are the raw key projection
  (`k=v`), or none (`shared`: a donor layer's, read and never written). q, k, v
  (and gate) come from one fused `[D_in, (N + 2K (+ N)) * H]` matrix: one pass
  over the weights. The input width `in_dim` defaults to the output width `dim`
  (EAGLE-3's layer reads 2D: embedding and hidden state side by side).
  """

  def __init__(
      self,
      dim: int,
      spec: AttentionSpec,
      *,
      in_dim: int | None = None,
      impl: str = 'auto',
      dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    n, k, h = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q_cols = 2 * n if spec.output_gate else n
    cols = (q_cols + KV_PROJECTIONS[spec.kv] * k) * h
    self.qkv_proj = weight(rngs, (in_dim or dim, cols), dtype)  # query | key (| value) (| gate)
    self.o_proj = weight(rngs, (n * h, dim), dtype)
    if spec.qk_norm:
      self.q_norm = RMSNorm(h, eps=spec.eps, offset=spec.norm_offset, dtype=dtype)
      if spec.kv != 'shared':
        self.k_norm = RMSNorm(h, eps=spec.eps, offset=spec.norm_offset, dtype=dtype)
    self.spec = spec
    self.impl = impl
    self.shards = 1  # tensor-parallel column blocks of `qkv_proj` (`split_heads`)
    self.mesh = None  # a sharded target's mesh: the Pallas kernel then runs per shard

  def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:  # x [B, T, D_in]
    """Queries [B, T, N, H], keys and values [B, T, K, H] (normed, rotated; None when shared), the gate (or None)."""
    s = self.spec
    q, key, value, gate = self.split_heads(ops.matmul(x, self.qkv_proj[...]))
    q = self.q_norm(q) if s.qk_norm else q
    key, value = self.keys_values(key, value, positions) if key is not None else (None, None)
    return s.rope(q, positions), key, value, gate

  def split_heads(self, y: jax.Array) -> tuple[jax.Array | None, ...]:  # [B, T, C] fused outputs
    """The fused outputs as query, key, value and gate heads [B, T, heads, H] (None where the layer has none).

    With `shards` S > 1 the columns are in S blocks, one per tensor-parallel
    shard, each `[its query | key (| value) (| gate) heads]`
    (`specjax.parallel.rules.shard_major`): each shard splits its own block.
    """
    s = self.spec
    b, t, _ = y.shape
    n, k, h, g = s.num_heads, s.num_kv_heads, s.head_dim, self.shards
    sizes = [n // g] + [k // g] * KV_PROJECTIONS[s.kv] + ([n // g] if s.output_gate else [])
    y = y.reshape(b, t, g, -1, h)
    parts = jnp.split(y, np.cumsum(sizes)[:-1], axis=3)
    parts = [x.reshape(b, t, -1, h) for x in parts]
    q, kv, gate = parts[0], parts[1 : 1 + KV_PROJECTIONS[s.kv]], parts[-1] if s.output_gate else None
    key = kv[0] if kv else None
    value = kv[1] if len(kv) > 1 else key  # k=v: the raw key projection
    return q, key, value, gate

  def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:  # x [B, T, D_in]
    """Keys (normed, rotated) and values [B, T, K, H] only: DFlash's context rows have no queries."""
    s = self.spec
    if self.shards > 1:
      return self.project(x, positions)[1:3]
    b, t, _ = x.shape
    n, k, h = s.num_heads, s.num_kv_heads, s.head_dim
    m = KV_PROJECTIONS[s.kv] * k
    w = ops.take_outputs(self.qkv_proj[...], slice(n * h, (n + m) * h), 1)  # query | key (| value) (| gate)
    kv = ops.matmul(x, w).reshape(b, t, m, h)
    return self.keys_values(kv[:, :, :k], kv[:, :, k:] if s.kv == 'own' else kv, positions)

  def keys_values(self, key: jax.Array, value: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key and value projections [B, T, K, H] -> keys (normed, rotated) and values (v-normed)."""
    s = self.spec
    if s.qk_norm:
      key = self.k_norm(key)
    if s.v_norm:
      value = rms_normalize(value, s.eps).astype(value.dtype)
    return s.rope(key, positions), value

  def output(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """Attention output [B, T, N, H] (gated) through `o_proj` -> [B, T, D]."""
    b, t, n, h = out.shape
    if gate is not None:
      out = out * jax.nn.sigmoid(gate)
    return ops.matmul(out.reshape(b, t, n * h), self.o_proj[...])

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      inputs: StepInputs,
      kv: PagedKV | tuple[jax.Array, jax.Array] | None,
  ) -> tuple[jax.Array, PagedKV | tuple[jax.Array, jax.Array]]:
    """The output [B, T, D] and what it attended to.

    `kv`: the layer's pages (a shared layer: its donor's), returned with this
    step's keys and values written (a shared layer writes none); without a
    cache None, or for a shared layer the donor's (keys, values) [B, T, K, H] of
    the same tokens, and the (keys, values) attended to are returned.
    """
    s = self.spec
    q, key, value, gate = self.project(x, inputs.positions)
    if not isinstance(kv, PagedKV):
      key, value = kv if key is None else (key, value)
      out = dense_attention(q, key, value, token_mask(inputs, s.window), scale=s.scale, softcap=s.softcap)
      return self.output(out, gate), (key, value)
    if key is not None:
      kv = dataclasses.replace(
          kv,
          k_pages=write_kv(kv.k_pages, key, inputs.page_ids, inputs.page_slots),
          v_pages=write_kv(kv.v_pages, value, inputs.page_ids, inputs.page_slots),
      )
    attend = paged_attention if self.mesh is None else functools.partial(sharded_paged_attention, self.mesh)
    out = attend(
        q,
        kv.k_pages,
        kv.v_pages,
        kv.block_tables,
        kv.lengths,
        query_lens=inputs.query_lens,
        mask=inputs.mask,
        sliding_window=s.window,
        logit_softcap=s.softcap,
        scale=s.scale,
        impl=self.impl,
    )
    return self.output(out, gate), kv


# ---------------------------------------------------------------- feed-forward


class GatedMLP(nnx.Module):
  """`down(act(gate(x)) * up(x))`: GeGLU (Gemma) or SwiGLU (Llama, Qwen)."""

  def __init__(self, dim: int, hidden: int, *, activation: str, dtype=jnp.float32, rngs: nnx.Rngs):
    self.gate_up = weight(rngs, (dim, 2 * hidden), dtype)  # gate and up side by side: one pass over the weights
    self.down = weight(rngs, (hidden, dim), dtype)
    self.activation = activation
    self.shards = 1  # tensor-parallel column blocks of `gate_up`, each [its gate | its up]

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D]
    y = ops.matmul(x, self.gate_up[...])
    y = y.reshape(*y.shape[:-1], self.shards, 2, -1)
    gate, up = (z.reshape(*y.shape[:-3], -1) for z in (y[..., 0, :], y[..., 1, :]))
    return ops.matmul(ACTIVATIONS[self.activation](gate) * up, self.down[...])


def routed_experts(
    x: jax.Array,  # [B, T, D]
    weights: jax.Array,  # [B, T, X] weights of the chosen experts
    experts: jax.Array,  # [B, T, X] int chosen experts
    gate_up,  # [E, D, 2F] gate and up side by side (float or a stacked QMatrix)
    down,  # [E, F, D]
    activation: str,
    gather: bool | None = None,
) -> jax.Array:  # [B, T, D]
  """Sum over the chosen experts of `weight * down(act(gate(x)) * up(x))`.

  Float experts, `gather`: read only the chosen experts (default: when tokens x
  top-k < experts, as in decode and verify); else every expert runs on every
  token, weighted (prefill). Quantized experts: each (token, slot) row through
  its expert (`ops.expert_matmul`), the slots summed in order: a token's output
  does not depend on the other tokens of the pass.
  """
  b, t, x_slots = experts.shape
  act = ACTIVATIONS[activation]
  weights = weights.astype(x.dtype)
  if isinstance(gate_up, QMatrix):
    ids = experts.reshape(-1)
    rows = jnp.broadcast_to(x[:, :, None, :], (b, t, x_slots, x.shape[-1])).reshape(ids.shape[0], -1)
    gate, up = jnp.split(ops.expert_matmul(rows, gate_up, ids), 2, axis=-1)
    y = ops.expert_matmul(act(gate) * up, down, ids).reshape(b, t, x_slots, -1)  # [B, T, X, D]
    out = y[:, :, 0] * weights[:, :, 0, None]
    for i in range(1, x_slots):
      out = out + y[:, :, i] * weights[:, :, i, None]
    return out
  e = gate_up.shape[0]
  if b * t * x_slots < e if gather is None else gather:
    gate, up = jnp.split(jnp.einsum('btd,btxdf->btxf', x, gate_up[experts]), 2, axis=-1)
    y = jnp.einsum('btxf,btxfd->btxd', act(gate) * up, down[experts])
    return jnp.einsum('btxd,btx->btd', y, weights)
  combine = jnp.einsum('btxe,btx->bte', jax.nn.one_hot(experts, e, dtype=x.dtype), weights)
  gate, up = jnp.split(jnp.einsum('btd,edf->btef', x, gate_up), 2, axis=-1)
  y = jnp.einsum('btef,efd->bted', act(gate) * up, down)
  return jnp.einsum('bted,bte->btd', y, combine)


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts (softmax router), optionally plus a sigmoid-gated shared expert."""

  def __init__(
      self,
      dim: int,
      *,
      num_experts: int,
      top_k: int,
      hidden: int,
      shared_hidden: int = 0,
      renormalize: bool = True,
      dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.router = weight(rngs, (dim, num_experts), dtype, keep_float=True)
    self.gate_up = weight(rngs, (num_experts, dim, 2 * hidden), dtype, fan_in=dim)
    self.down = weight(rngs, (num_experts, hidden, dim), dtype, fan_in=hidden)
    self.has_shared = shared_hidden > 0
    if self.has_shared:
      self.shared_expert = GatedMLP(dim, shared_hidden, activation='silu', dtype=dtype, rngs=rngs)
      self.shared_gate = weight(rngs, (dim, 1), dtype, keep_float=True)
    self.top_k, self.renormalize = top_k, renormalize

  def __call__(self, x: jax.Array, gather: bool | None = None) -> jax.Array:  # [B, T, D]
    """`gather`: read only the chosen experts (default: when tokens x top-k < experts)."""
    probs = softmax_rows(ops.matmul(x, self.router[...]))
    weights, experts = jax.lax.top_k(probs, self.top_k)  # [B, T, X]
    if self.renormalize:
      weights = weights / tree_sum(weights)
    out = routed_experts(x, weights, experts, self.gate_up[...], self.down[...], 'silu', gather)
    if self.has_shared:
      out = out + jax.nn.sigmoid(ops.matmul(x, self.shared_gate[...])) * self.shared_expert(x)
    return out


# ---------------------------------------------------------------- decoder block


class DecoderBlock(nnx.Module):
  """Pre-norm residual block around a token mixer and an MLP.

  `sandwich=True` adds Gemma's post-norms on both branch outputs. Gemma 4's
  options: `moe`, a second branch on the pre-MLP residual (the dense MLP's
  output is then post-normed by `dense_post_norm` and the sum by
  `mlp_post_norm`); `per_layer_dim` P, a per-layer embedding input `[B, T, P]`
  added after the MLP as `ple_norm(ple_proj(act(ple_gate(x)) * input))`; and
  `layer_scalar`, the block's output times a learned scalar.
  """

  def __init__(
      self,
      dim: int,
      mixer: nnx.Module,
      mlp: nnx.Module,
      *,
      eps: float,
      offset: float,
      sandwich: bool = False,
      moe: nnx.Module | None = None,
      per_layer_dim: int = 0,
      activation: str = 'silu',  # of the per-layer embedding gate
      layer_scalar: bool = False,
      dtype=jnp.float32,
      rngs: nnx.Rngs | None = None,  # for the per-layer embedding projections
  ):
    norm = lambda: RMSNorm(dim, eps=eps, offset=offset, dtype=dtype)
    self.mixer_norm = norm()
    self.mixer = mixer
    self.mlp_norm = norm()
    self.mlp = mlp
    self.sandwich = sandwich
    if sandwich:
      self.mixer_post_norm = norm()
      self.mlp_post_norm = norm()
    self.has_moe = moe is not None
    if moe is not None:
      self.dense_post_norm = norm()
      self.moe = moe
    if per_layer_dim:
      self.ple_gate = param(rngs, (dim, per_layer_dim), dtype)
      self.ple_proj = param(rngs, (per_layer_dim, dim), dtype)
      self.ple_norm = norm()
    self.activation = activation
    self.has_layer_scalar = layer_scalar
    if layer_scalar:
      self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))

  def __call__(
      self,
      x: jax.Array,  # [B, T, D]
      mix: Callable,  # (mixer, normed x) -> (out, cache part)
      per_layer_input: jax.Array | None = None,  # [B, T, P]
  ) -> tuple[jax.Array, object]:
    """Runs the token mixer through `mix`, then the MLP (and the options); returns (x, cache part)."""
    out, part = mix(self.mixer, self.mixer_norm(x))
    x = x + (self.mixer_post_norm(out) if self.sandwich else out)
    out = self.mlp(self.mlp_norm(x))
    if self.has_moe:
      out = self.dense_post_norm(out) + self.moe(x)
    x = x + (self.mlp_post_norm(out) if self.sandwich else out)
    if per_layer_input is not None:
      gate = ACTIVATIONS[self.activation](jnp.einsum('btd,dp->btp', x, self.ple_gate[...])) * per_layer_input
      x = x + self.ple_norm(jnp.einsum('btp,pd->btd', gate, self.ple_proj[...]))
    if self.has_layer_scalar:
      x = x * self.layer_scalar[...]
    return x, part
