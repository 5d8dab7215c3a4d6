"""Gated DeltaNet math against naive numpy loops, and its forms against each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import gated_deltanet
from specjax.models.gated_deltanet import l2_normalize

# Jitted once per shape: far faster than op-by-op dispatch.
recurrent_gated_delta_rule = jax.jit(gated_deltanet.recurrent_gated_delta_rule)
chunked_gated_delta_rule = jax.jit(gated_deltanet.chunked_gated_delta_rule, static_argnames='chunk_size')
causal_conv1d = jax.jit(gated_deltanet.causal_conv1d)


def _inputs(seed, batch=2, length=11, heads=3, dk=8, dv=6, qk_heads=None):
  rng = np.random.default_rng(seed)
  qk_heads = qk_heads or heads
  q = rng.normal(size=(batch, length, qk_heads, dk)).astype(np.float32)
  k = rng.normal(size=(batch, length, qk_heads, dk)).astype(np.float32)
  v = rng.normal(size=(batch, length, heads, dv)).astype(np.float32)
  g = -rng.uniform(0.0, 1.0, size=(batch, length, heads)).astype(np.float32)
  beta = rng.uniform(0.05, 0.95, size=(batch, length, heads)).astype(np.float32)
  state = rng.normal(size=(batch, heads, dk, dv)).astype(np.float32)
  return q, k, v, g, beta, state


def _numpy_delta_rule(q, k, v, g, beta, state):
  """Per-token, per-head loop in float64, straight from the recurrence."""
  q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
  batch, length, heads, dk = q.shape[0], q.shape[1], v.shape[2], q.shape[3]
  rep = heads // q.shape[2]
  s = s.copy()
  out = np.zeros(v.shape)
  states = np.zeros((batch, length) + s.shape[1:])
  for b in range(batch):
    for t in range(length):
      for n in range(heads):
        qn, kn = q[b, t, n // rep], k[b, t, n // rep]
        qn = qn / np.sqrt(qn @ qn + 1e-6) / np.sqrt(dk)
        kn = kn / np.sqrt(kn @ kn + 1e-6)
        s[b, n] *= np.exp(g[b, t, n])
        delta = beta[b, t, n] * (v[b, t, n] - s[b, n].T @ kn)
        s[b, n] += np.outer(kn, delta)
        out[b, t, n] = s[b, n].T @ qn
      states[b, t] = s[b]
  return out, states


def _numpy_conv(x, conv_state, weight, query_lens):
  batch, length, channels = x.shape
  width = weight.shape[1]
  xs = np.concatenate([conv_state, x], axis=1).astype(np.float64)
  y = np.zeros(x.shape)
  windows = np.zeros((batch, length, width - 1, channels))
  for b in range(batch):
    for t in range(length):
      a = sum(weight[:, j] * xs[b, t + j] for j in range(width))
      y[b, t] = a / (1 + np.exp(-a))
      e = min(t, query_lens[b] - 1)  # -1: the window is conv_state
      windows[b, t] = xs[b, e + 1 : e + width]
  return y, windows


def test_l2_normalize():
  x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
  want = x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(l2_normalize(x), want, rtol=1e-6)


@pytest.mark.parametrize('qk_heads', [None, 1])
def test_recurrent_matches_numpy(qk_heads):
  args = _inputs(0, qk_heads=qk_heads)
  out, states = recurrent_gated_delta_rule(*args)
  want_out, want_states = _numpy_delta_rule(*args)
  assert out.shape == want_out.shape and states.shape == want_states.shape
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(states, want_states, atol=1e-5)


@pytest.mark.parametrize('chunk_size,length', [(4, 11), (8, 11), (64, 11), (8, 24), (4, 1)])
def test_chunked_matches_recurrent(chunk_size, length):
  args = _inputs(1, length=length)
  out, final = chunked_gated_delta_rule(*args, chunk_size=chunk_size)
  want_out, want_states = recurrent_gated_delta_rule(*args)
  assert out.shape == want_out.shape and final.shape == want_states.shape[:1] + want_states.shape[2:]
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(final, want_states[:, -1], atol=1e-5)


def test_chunked_grouped_heads_and_strong_decay():
  q, k, v, g, beta, state = _inputs(2, length=19, heads=4, qk_heads=2)
  g = g * 30  # decays down to exp(-30) per token: no overflow in the pairwise decays
  out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8)
  want_out, want_states = _numpy_delta_rule(q, k, v, g, beta, state)
  np.testing.assert_allclose(out, want_out, atol=1e-5)
  np.testing.assert_allclose(final, want_states[:, -1], atol=1e-5)


def test_padded_positions_keep_the_state():
  q, k, v, g, beta, state = _inputs(3, length=9)
  query_lens = np.array([5, 0])
  pad = np.arange(9)[None, :] >= query_lens[:, None]  # [B, T]
  g, beta = np.where(pad[..., None], 0, g), np.where(pad[..., None], 0, beta)
  _, states = recurrent_gated_delta_rule(q, k, v, g, beta, state)
  states = np.asarray(states)
  for t in range(5, 9):
    np.testing.assert_array_equal(states[0, t], states[0, 4])
    np.testing.assert_array_equal(states[1, t], state[1])
  _, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=4)
  np.testing.assert_allclose(final[0], states[0, 4], atol=1e-5)
  np.testing.assert_allclose(final[1], state[1], atol=1e-5)


def test_recurrent_chaining():
  args = _inputs(4, length=10)
  out, states = recurrent_gated_delta_rule(*args)
  first = [x[:, :6] for x in args[:5]]
  second = [x[:, 6:] for x in args[:5]]
  out_a, states_a = recurrent_gated_delta_rule(*first, args[5])
  out_b, states_b = recurrent_gated_delta_rule(*second, states_a[:, -1])
  np.testing.assert_allclose(np.concatenate([out_a, out_b], 1), out, atol=1e-6)
  np.testing.assert_allclose(np.concatenate([states_a, states_b], 1), states, atol=1e-6)


def test_chunked_prefill_then_recurrent_decode():
  args = _inputs(5, length=21)
  want_out, want_states = recurrent_gated_delta_rule(*args)
  prefill = [x[:, :17] for x in args[:5]]
  decode = [x[:, 17:] for x in args[:5]]
  out_a, state = chunked_gated_delta_rule(*prefill, args[5], chunk_size=8)
  out_b, states_b = recurrent_gated_delta_rule(*decode, state)
  np.testing.assert_allclose(np.concatenate([out_a, out_b], 1), want_out, atol=1e-5)
  np.testing.assert_allclose(states_b, want_states[:, 17:], atol=1e-5)


def test_delta_rules_eager():
  args = _inputs(6, length=7)
  out, states = gated_deltanet.recurrent_gated_delta_rule(*args)
  np.testing.assert_allclose(out, recurrent_gated_delta_rule(*args)[0], atol=1e-6)
  final = gated_deltanet.chunked_gated_delta_rule(*args, chunk_size=4)[1]
  np.testing.assert_allclose(final, states[:, -1], atol=1e-5)


def _conv_inputs(seed, batch=4, length=6, channels=5, width=4):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, length, channels)).astype(np.float32)
  conv_state = rng.normal(size=(batch, width - 1, channels)).astype(np.float32)
  weight = rng.normal(size=(channels, width)).astype(np.float32)
  return x, conv_state, weight


@pytest.mark.parametrize('size', [1, 5, 64])
def test_unit_lower_inverse_matches_a_float64_solve(size):
  """The chunked rule's matmul-only inverse of its (I + strictly lower) system, against numpy in float64, with
  the rule's own kind of entries (l2-normalised keys, beta in (0, 1), decays): no worse than `solve_triangular`."""
  rng = np.random.default_rng(size)
  k = rng.normal(size=(3, size, 16))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  cum = -np.cumsum(rng.uniform(0, 0.3, (3, size)), -1)
  decay = np.exp(np.minimum(cum[:, :, None] - cum[:, None, :], 0))  # kept below the diagonal only
  system = np.tril(rng.uniform(0, 1, (3, size, 1)) * k @ np.swapaxes(k, 1, 2) * decay, -1) + np.eye(size)
  want = np.linalg.inv(system)
  system = jnp.asarray(system, jnp.float32)
  got = np.asarray(jax.jit(gated_deltanet.unit_lower_inverse)(system))
  eye = jnp.broadcast_to(jnp.eye(size), system.shape)
  trsm = np.asarray(jax.scipy.linalg.solve_triangular(system, eye, lower=True, unit_diagonal=True))
  assert np.abs(got - want).max() <= max(2 * np.abs(trsm - want).max(), 1e-6)


def test_causal_conv1d_matches_numpy():
  x, conv_state, weight = _conv_inputs(7)
  query_lens = np.array([6, 3, 0, 1])
  y, windows = causal_conv1d(x, conv_state, weight, jnp.asarray(query_lens))
  want_y, want_windows = _numpy_conv(x, conv_state, weight, query_lens)
  np.testing.assert_allclose(y, want_y, atol=1e-5)
  np.testing.assert_array_equal(windows, want_windows.astype(np.float32))
  np.testing.assert_array_equal(windows[2], np.broadcast_to(conv_state[2], windows[2].shape))


def test_causal_conv1d_matches_padded_conv():
  """A zero conv_state is the Conv1d with W - 1 left padding (the prefill path)."""
  x, _, weight = _conv_inputs(8, length=9)
  y, _ = causal_conv1d(x, np.zeros((4, 3, 5), np.float32), weight, jnp.full((4,), 9))
  padded = np.pad(x, [(0, 0), (3, 0), (0, 0)])
  a = sum(weight[:, j] * padded[:, j : j + 9] for j in range(4))
  np.testing.assert_allclose(y, a / (1 + np.exp(-a)), atol=1e-5)


def test_causal_conv1d_chaining():
  x, conv_state, weight = _conv_inputs(9, length=7)
  full = jnp.full((4,), 7)
  y, windows = causal_conv1d(x, conv_state, weight, full)
  y_a, windows_a = causal_conv1d(x[:, :4], conv_state, weight, jnp.full((4,), 4))
  y_b, windows_b = causal_conv1d(x[:, 4:], windows_a[:, -1], weight, jnp.full((4,), 3))
  np.testing.assert_allclose(np.concatenate([y_a, y_b], 1), y, atol=1e-6)
  np.testing.assert_array_equal(np.concatenate([windows_a, windows_b], 1), windows)
