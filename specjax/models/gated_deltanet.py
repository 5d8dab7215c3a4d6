"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the pure math.

Per head, with q, k L2-normalised, q scaled by Dk^-0.5, state S [Dk, Dv]:

  S' = exp(g_t) * S_{t-1};  delta_t = beta_t * (v_t - S'^T k_t)
  S_t = S' + k_t delta_t^T;  o_t = S_t^T q_t

`recurrent_gated_delta_rule` scans token by token and keeps every state
(decode, speculative verify); `chunked_gated_delta_rule` is the equivalent
chunked (WY) form for prefill and keeps only the final state. Positions with
g = 0 and beta = 0 leave the state unchanged: the callers' padding.
`causal_conv1d` is the depthwise causal convolution + SiLU that feeds them.

Einsum letters: B batch, T tokens, N value heads, K key dim (Dk), V value dim
(Dv), M chunks, C / D positions inside a chunk; in the conv, W taps and C
channels.
All math is float32 at full matmul precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reductions import tree_sum

_HIGHEST = jax.lax.Precision.HIGHEST


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *operands, precision=_HIGHEST)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """`x * rsqrt(sum(x^2) + eps)` over the last axis; the sum is a fixed tree (`tree_sum`), so a row's bits do not
  depend on how many rows a pass holds (as `layers.rms_normalize`)."""
  return x * jax.lax.rsqrt(tree_sum(x * x) + eps)


def _prepare(q, k, v, g, beta):
  """Float32; q, k normalised (q also scaled) and repeated up to the value heads."""
  q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
  num_heads, num_qk_heads = v.shape[2], k.shape[2]
  if num_heads % num_qk_heads:
    raise ValueError(f'{num_heads} value heads are not a multiple of {num_qk_heads} key heads')
  if num_qk_heads != num_heads:  # each key head serves consecutive value heads
    q = jnp.repeat(q, num_heads // num_qk_heads, axis=2)
    k = jnp.repeat(k, num_heads // num_qk_heads, axis=2)
  q = l2_normalize(q) * q.shape[-1] ** -0.5
  return q, l2_normalize(k), v, g, beta


def recurrent_gated_delta_rule(
    q: jax.Array,  # [B, T, N, K] raw (normalised inside)
    k: jax.Array,  # [B, T, N, K] raw
    v: jax.Array,  # [B, T, N, V]
    g: jax.Array,  # [B, T, N] log decay (<= 0)
    beta: jax.Array,  # [B, T, N] in (0, 1)
    state: jax.Array,  # [B, N, K, V] the state before position 0
) -> tuple[jax.Array, jax.Array]:
  """Token-by-token scan; returns (out [B, T, N, V], states [B, T, N, K, V]).

  `states[:, t]` is the state after position t. q and k may have fewer heads
  than v (a divisor), each then serving consecutive value heads.
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta)

  def step(s, xs):  # s: [B, N, K, V]
    q_t, k_t, v_t, g_t, beta_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    delta = beta_t[..., None] * (v_t - _einsum('bnkv,bnk->bnv', s, k_t))
    s = s + _einsum('bnk,bnv->bnkv', k_t, delta)
    return s, (_einsum('bnkv,bnk->bnv', s, q_t), s)

  time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta))
  _, (out, states) = jax.lax.scan(step, state.astype(jnp.float32), time_major)
  return jnp.swapaxes(out, 0, 1), jnp.swapaxes(states, 0, 1)


def chunked_gated_delta_rule(
    q: jax.Array,  # [B, T, N, K] raw (normalised inside)
    k: jax.Array,  # [B, T, N, K] raw
    v: jax.Array,  # [B, T, N, V]
    g: jax.Array,  # [B, T, N] log decay (<= 0)
    beta: jax.Array,  # [B, T, N] in (0, 1)
    state: jax.Array,  # [B, N, K, V] the state before position 0
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
  """Chunked form; returns (out [B, T, N, V], final state [B, N, K, V]).

  Inside a chunk the delta-rule updates are folded into one unit lower
  triangular solve (the WY / UT transform); a scan carries the state across
  chunks. T is padded to a multiple of `chunk_size` with zeros (g = beta = 0:
  no effect on the state).
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta)
  batch, length, heads, _ = q.shape
  pad = -length % chunk_size
  num_chunks = (length + pad) // chunk_size

  def to_chunks(x):  # [B, T, N, ...] -> [B, N, M, C, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)

  q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
  k_beta = k * beta[..., None]
  v_beta = v * beta[..., None]
  cum = jnp.cumsum(g, axis=-1)  # [B, N, M, C] log decay from chunk start
  causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
  # decay[c, d] = exp(cum_c - cum_d): the decay from position d to c (d <= c).
  decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))

  # (I + strictly_lower(diag(beta) K K^T * decay)) [u | w] = [v_beta | k_beta * exp(cum)]
  system = _einsum('bnmck,bnmdk->bnmcd', k_beta, k) * decay
  system = jnp.tril(system, -1) + jnp.eye(chunk_size, dtype=jnp.float32)
  rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
  solved = _einsum('bnmcd,bnmde->bnmce', unit_lower_inverse(system), rhs)
  u, w = jnp.split(solved, [v.shape[-1]], axis=-1)  # [B, N, M, C, V], [B, N, M, C, K]

  intra = _einsum('bnmck,bnmdk->bnmcd', q, k) * decay  # within-chunk attention
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # decay to the chunk end
  chunk_decay = jnp.exp(cum[..., -1])  # [B, N, M]

  def step(s, xs):  # s: [B, N, K, V]
    u_m, w_m, q_m, k_m, intra_m, decay_m = xs
    v_new = u_m - _einsum('bnck,bnkv->bncv', w_m, s)  # what the old state does not predict
    out = _einsum('bnck,bnkv->bncv', q_m, s) + _einsum('bncd,bndv->bncv', intra_m, v_new)
    s = s * decay_m[..., None, None] + _einsum('bnck,bncv->bnkv', k_m, v_new)
    return s, out

  chunk_major = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_decayed, k_decayed, intra, chunk_decay))
  final, out = jax.lax.scan(step, state.astype(jnp.float32), chunk_major)  # out: [M, B, N, C, V]
  out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, num_chunks * chunk_size, -1)
  return jnp.swapaxes(out, 1, 2)[:, :length], final


def unit_lower_inverse(
    lower: jax.Array,  # [..., C, C] unit lower triangular
) -> jax.Array:  # [..., C, C]
  """The inverse of I + S, S strictly lower triangular (nilpotent: S^C = 0), by matmuls only:
  (I + S)^-1 = sum_j (-S)^j = (I - S)(I + S^2)(I + S^4)..., log2(C) squarings.

  Not `solve_triangular`: on CPU that is LAPACK's trsm custom call, which splits its batch over XLA's intra-op
  thread pool and waits inside a pool thread; with several devices in one process (a mesh over forced host
  devices) every pool thread ended up waiting so (a hybrid target's prefill over TP 4 never returned). Its
  error against a float64 solve is no larger (tests/test_gated_deltanet.py).
  """
  size = lower.shape[-1]
  eye = jnp.eye(size, dtype=lower.dtype)
  power = eye - lower  # -S
  inverse, terms = eye + power, 2  # the series up to (-S)^(terms - 1)
  while terms < size:
    power = _einsum('...cd,...de->...ce', power, power)
    inverse = inverse + _einsum('...cd,...de->...ce', inverse, power)
    terms *= 2
  return inverse


def causal_conv1d(
    x: jax.Array,  # [B, T, C] this call's inputs (positions >= query_lens are padding)
    conv_state: jax.Array,  # [B, W - 1, C] the last W - 1 inputs before position 0
    weight: jax.Array,  # [C, W] depthwise kernel
    query_lens: jax.Array,  # [B] real tokens per row
) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv + SiLU; returns (y [B, T, C], windows [B, T, W - 1, C]).

  `windows[:, t]` holds the W - 1 inputs ending at position t, clamped to the
  last real position (`conv_state` itself for an empty row): the next call's
  `conv_state` is `windows[b, query_lens[b] - 1]` and so is every later slot.
  """
  length, width = x.shape[1], weight.shape[1]
  xs = jnp.concatenate([conv_state, x], axis=1).astype(jnp.float32)  # [B, W - 1 + T, C]
  taps = jnp.stack([xs[:, j : j + length] for j in range(width)], axis=2)  # [B, T, W, C]
  y = jax.nn.silu(_einsum('btwc,cw->btc', taps, weight.astype(jnp.float32)))

  # The window ending at position e is xs[e + 1 : e + W]; e = min(t, len - 1) >= -1.
  last = jnp.minimum(jnp.arange(length)[None, :], query_lens[:, None] - 1)
  last = jnp.maximum(last, -1)  # [B, T]
  rows = last[..., None] + 1 + jnp.arange(width - 1)  # [B, T, W - 1]
  windows = jnp.take_along_axis(xs, rows.reshape(x.shape[0], -1, 1), axis=1)
  return y, windows.reshape(x.shape[0], length, width - 1, x.shape[2])
