"""Sampling transforms vs numpy (HF-warper semantics), and seeded draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling
from specjax.errors import SpecjaxError
from specjax.sampling import SamplingParams

# numpy versions of HF transformers' warpers (float64, one row at a time).


def np_top_k(x, k):
  if k == 0 or k >= x.size:
    return x
  kth = np.sort(x)[::-1][k - 1]
  return np.where(x < kth, -np.inf, x)


def np_top_p(x, top_p):
  if top_p >= 1.0:
    return x
  order = np.argsort(x, kind='stable')  # Ascending.
  p = np.exp(x[order] - x.max())
  cum = np.cumsum(p / p.sum())
  remove = cum <= 1 - top_p
  remove[-1] = False
  out = x.copy()
  out[order[remove]] = -np.inf
  return out


def np_min_p(x, min_p):
  if min_p == 0.0:
    return x
  p = np.exp(x - x.max())
  p /= p.sum()
  return np.where(p < min_p * p.max(), -np.inf, x)


def np_transform(x, params):
  x = np.asarray(x, np.float64) / params.temperature
  x = np_top_k(x, params.top_k)
  x = np_top_p(x, params.top_p)
  return np_min_p(x, params.min_p)


def kept(x):
  return np.isfinite(np.asarray(x))


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=2.0, top_p=0.3),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.5, min_p=0.3),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.5, top_k=40, top_p=0.95),
]


@pytest.mark.parametrize('params', CASES, ids=str)
def test_transform_matches_numpy(params):
  rng = np.random.default_rng(0)
  logits = (rng.normal(size=(16, 97)) * 2.5).astype(np.float32)
  got = np.asarray(jax.jit(sampling.transform_logits, static_argnums=1)(logits, params))
  for row, got_row in zip(logits, got):
    want = np_transform(row, params)
    np.testing.assert_array_equal(kept(got_row), kept(want))
    np.testing.assert_allclose(got_row[kept(want)], want[kept(want)], rtol=1e-6)
  p = np.asarray(sampling.probs(logits, params))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  assert np.all(p[~kept(got)] == 0.0)


def test_top_k_keeps_ties():
  x = jnp.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
  got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_k=2))
  np.testing.assert_array_equal(kept(got), [[0, 1, 1, 1, 1, 0]])


def test_top_k_at_least_vocab_is_a_no_op():
  x = jnp.array([[1.0, -3.0, 2.0]])
  for k in (3, 10):
    got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_k=k))
    np.testing.assert_array_equal(got, x)


def test_top_p_keeps_ties_at_the_boundary():
  # Probabilities 0.4, 0.2, 0.2, 0.2: top_p 0.5 needs one of the tied 0.2s;
  # all tied tokens are kept.
  x = jnp.log(jnp.array([[0.2, 0.4, 0.2, 0.2]]))
  got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_p=0.5))
  np.testing.assert_array_equal(kept(got), [[1, 1, 1, 1]])
  got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_p=0.4))
  np.testing.assert_array_equal(kept(got), [[0, 1, 0, 0]])


@pytest.mark.parametrize(
    'params',
    [
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=0.999),
        SamplingParams(temperature=0.01, top_k=1, top_p=1e-3, min_p=0.99),
    ],
    ids=str,
)
def test_at_least_the_top_token_is_kept(params):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, 33)).astype(np.float32)
  got = np.asarray(sampling.transform_logits(x, params))
  np.testing.assert_array_equal(kept(got).sum(-1), 1)
  np.testing.assert_array_equal(kept(got).argmax(-1), x.argmax(-1))


def test_negative_zero_and_negative_logits():
  x = jnp.array([[-0.0, 0.0, -1.0, -2.0, -0.5]])
  got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_k=2))
  np.testing.assert_array_equal(kept(got), [[1, 1, 0, 0, 0]])
  got = sampling.transform_logits(x, SamplingParams(temperature=1.0, top_k=3))
  np.testing.assert_array_equal(kept(got), [[1, 1, 0, 0, 1]])


def test_greedy_is_one_hot_first_argmax():
  x = jnp.array([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 1.0, 3.0]])
  greedy = SamplingParams(top_k=3, top_p=0.5)  # Filters do not matter.
  np.testing.assert_array_equal(sampling.probs(x, greedy), [[0, 1, 0, 0], [1, 0, 0, 0]])
  np.testing.assert_array_equal(kept(sampling.transform_logits(x, greedy)), [[0, 1, 0, 0], [1, 0, 0, 0]])
  keys = sampling.row_keys(0, jnp.arange(2), jnp.zeros(2, jnp.int32))
  np.testing.assert_array_equal(sampling.sample(x, greedy, keys), [1, 0])
  assert greedy.is_greedy and not SamplingParams(temperature=0.1).is_greedy


def test_argmax_matches_jnp():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.integers(0, 5, size=(6, 3, 40)).astype(np.float32))
  np.testing.assert_array_equal(sampling.argmax(x), jnp.argmax(x, -1))
  assert sampling.argmax(x).dtype == jnp.int32


def draw(logits, params, seed, seq_ids, positions):
  keys = sampling.row_keys(seed, seq_ids, positions)
  return np.asarray(jax.jit(sampling.sample, static_argnums=1)(logits, params, keys))


def test_reproducible_and_seed_dependent():
  params = SamplingParams(temperature=1.0, top_k=50, seed=3)
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(64, 200)).astype(np.float32))
  ids, pos = jnp.arange(64), jnp.full((64,), 7)
  a = draw(logits, params, 3, ids, pos)
  np.testing.assert_array_equal(a, draw(logits, params, 3, ids, pos))
  assert (a != draw(logits, params, 4, ids, pos)).mean() > 0.5
  assert (a != draw(logits, params, 3, ids, pos + 1)).mean() > 0.5
  assert a.dtype == np.int32


def test_independent_of_batch_position_and_padding():
  params = SamplingParams(temperature=1.0)
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(5, 300)).astype(np.float32))
  seq_ids, positions = jnp.array([10, 11, 12, 13, 14]), jnp.array([3, 9, 27, 81, 243])
  batched = draw(logits, params, 0, seq_ids, positions)
  perm = np.array([3, 0, 4, 1, 2])
  pad = jnp.zeros((3, 300))
  shuffled = draw(
      jnp.concatenate([logits[perm], pad]),
      params,
      0,
      jnp.concatenate([seq_ids[perm], jnp.arange(3)]),
      jnp.concatenate([positions[perm], jnp.zeros(3, int)]),
  )
  np.testing.assert_array_equal(shuffled[:5], batched[perm])
  for i in range(5):
    alone = draw(logits[i : i + 1], params, 0, seq_ids[i : i + 1], positions[i : i + 1])
    assert alone[0] == batched[i]


def test_raw_key_data_and_batch_shapes():
  params = SamplingParams(temperature=1.0)
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(2, 3, 50)).astype(np.float32))
  keys = sampling.row_keys(1, jnp.arange(6), jnp.arange(6)).reshape(2, 3)
  typed = sampling.sample(logits, params, keys)
  raw = sampling.sample(logits, params, jax.random.key_data(keys))
  assert typed.shape == (2, 3)
  np.testing.assert_array_equal(typed, raw)
  with pytest.raises(ValueError, match='keys shape'):
    sampling.sample(logits, params, keys[0])


def test_row_keys_broadcast_and_per_row_seeds():
  ids, pos = jnp.array([[0], [1]]), jnp.array([[5, 6, 7]])
  keys = jax.random.key_data(sampling.row_keys(9, ids, pos))
  assert keys.shape == (2, 3, 2)
  one = jax.random.key_data(sampling.row_keys(9, jnp.array([1]), jnp.array([6])))
  np.testing.assert_array_equal(keys[1, 1], one[0])
  per_row = jax.random.key_data(sampling.row_keys(jnp.array([9, 4]), jnp.array([1, 1]), jnp.array([6, 6])))
  np.testing.assert_array_equal(per_row[0], one[0])
  assert not np.array_equal(per_row[1], one[0])


def test_row_keys_streams_differ():
  ids, pos = jnp.arange(4), jnp.zeros(4, jnp.int32)
  a = jax.random.key_data(sampling.row_keys(0, ids, pos, stream=0))
  b = jax.random.key_data(sampling.row_keys(0, ids, pos, stream=1))
  assert not np.any(np.all(np.asarray(a) == np.asarray(b), -1))


# Each case fails by chance with probability ALPHA (fixed seeds make the test
# deterministic; ALPHA bounds how unlucky the chosen seed could have been).
ALPHA = 1e-3


@pytest.mark.parametrize(
    'params',
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.4, min_p=0.08),
    ],
    ids=str,
)
def test_sampled_frequencies_match_probs(params):
  n = 20_000
  logits = jnp.array([1.0, 0.3, -0.5, 2.0, 0.0, 1.2, -2.0, 0.8, 1.1, -1.0])
  p = np.asarray(sampling.probs(logits, params), np.float64)
  tokens = draw(jnp.broadcast_to(logits, (n, 10)), params, 123, jnp.arange(n), jnp.full((n,), 5))
  counts = np.bincount(tokens, minlength=10)
  assert np.all(counts[p == 0] == 0)
  support = p > 0
  assert np.all(n * p[support] >= 5)  # Chi-square validity.
  _, p_value = stats.chisquare(counts[support], n * p[support] / p[support].sum())
  assert p_value > ALPHA, (counts, n * p)


@pytest.mark.parametrize(
    'kwargs,field',
    [
        (dict(temperature=-0.1), 'temperature'),
        (dict(temperature=float('nan')), 'temperature'),
        (dict(temperature=float('inf')), 'temperature'),
        (dict(temperature='1'), 'temperature'),
        (dict(top_k=-1), 'top_k'),
        (dict(top_k=2.5), 'top_k'),
        (dict(top_k=True), 'top_k'),
        (dict(top_p=0.0), 'top_p'),
        (dict(top_p=1.5), 'top_p'),
        (dict(top_p=float('nan')), 'top_p'),
        (dict(min_p=1.0), 'min_p'),
        (dict(min_p=-0.1), 'min_p'),
        (dict(seed=-1), 'seed'),
        (dict(seed=2**31), 'seed'),
    ],
)
def test_invalid_values_raise(kwargs, field):
  params = SamplingParams(**kwargs)
  with pytest.raises(SpecjaxError, match=f'sampling {field} must be'):
    params.validate()
  with pytest.raises(SpecjaxError):
    sampling.probs(jnp.zeros((1, 4)), params)


def test_params_are_static_jit_arguments():
  params = SamplingParams(temperature=0.5, top_k=3, seed=np.int64(2))
  assert params.validate() is params
  assert hash(params) == hash(SamplingParams(temperature=0.5, top_k=3, seed=2))
  f = jax.jit(functools.partial(sampling.probs), static_argnums=1)
  np.testing.assert_allclose(f(jnp.zeros((1, 4)), params).sum(), 1.0, rtol=1e-6)
