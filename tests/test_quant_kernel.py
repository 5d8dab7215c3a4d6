"""The CPU quantized-matmul kernel (specjax/quant/cpu_kernel.py): against a float64 numpy product of the same
dequantized weight, for every format it takes, and bit for bit independent of M and of the other rows."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.quant import cpu_kernel

# CI builds the extension through `pip install -e .`; elsewhere a machine without a compiler skips.
if not cpu_kernel.available():
  if os.environ.get('CI'):
    raise RuntimeError(f'the CPU kernel must be built in CI: {cpu_kernel.reason()}')
  pytest.skip(f'the CPU kernel is unavailable: {cpu_kernel.reason()}', allow_module_level=True)


def quantized(rng, n: int, k: int, *, bits: int, group: int, offset: int, mins: bool):
  """Random values, scales and mins in the kernel's format, and the float64 weight they mean: [N, K]."""
  if bits == 32:
    w = rng.standard_normal((n, k)).astype(np.float32)
    return (w, None, None), w.astype(np.float64)
  if bits == 8:
    values = rng.integers(-128, 128, (n, k), dtype=np.int8)
    v = values.astype(np.float64)
  else:
    values = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    halves = values.reshape(n, k // group, group // 2)
    v = np.concatenate([halves & 15, halves >> 4], axis=-1).reshape(n, k).astype(np.float64) - offset
  scales = rng.uniform(0.005, 0.02, (n, k // group)).astype(np.float32)
  w = np.repeat(scales.astype(np.float64), group, axis=1) * v
  lows = None
  if mins:
    lows = rng.uniform(0.0, 0.1, (n, k // group)).astype(np.float32)
    w -= np.repeat(lows.astype(np.float64), group, axis=1)
  return (values, scales, lows), w


def check(rng, *, m: int, k: int, n: int, bits: int, group: int, offset: int = 0, mins: bool = False, lead=()):
  (values, scales, lows), w = quantized(rng, n, k, bits=bits, group=group, offset=offset, mins=mins)
  x = rng.standard_normal((*lead, m, k)).astype(np.float32)  # [..., M, K]
  f = jax.jit(lambda x: cpu_kernel.qmatmul(x, values, scales, lows, bits=bits, group=group, offset=offset))
  y = np.asarray(f(x))  # [..., M, N]
  want = x.astype(np.float64) @ w.T
  assert y.shape == want.shape and y.dtype == np.float32
  bound = 1e-5 * np.abs(x).astype(np.float64) @ np.abs(w).T + 1e-6  # float32 summation error, with room
  np.testing.assert_array_less(np.abs(y - want), bound)
  return x, f, y


@pytest.mark.parametrize('bits', [8, 4])
@pytest.mark.parametrize('group', [16, 32, 64, 'K'])
@pytest.mark.parametrize('mins', [False, True])
def test_against_numpy(bits, group, mins):
  rng = np.random.default_rng(bits * 100 + (0 if group == 'K' else group) + mins)
  k = 192
  group = k if group == 'K' else group
  for offset in (0, 8) if bits == 4 else (0,):
    for m in range(1, 10):
      check(rng, m=m, k=k, n=45, bits=bits, group=group, offset=offset, mins=mins)


@pytest.mark.parametrize('bits', [8, 4, 32])
def test_ragged_widths_and_leading_shape(bits):
  """Groups that are no multiple of the SIMD width (tails), a per-channel group, and a [B, T, K] input."""
  rng = np.random.default_rng(bits)
  check(rng, m=3, k=44, n=13, bits=bits, group=22, offset=8 if bits == 4 else 0, mins=bits != 32, lead=(2,))
  check(rng, m=7, k=18, n=250, bits=bits, group=18, lead=(2, 3))
  check(rng, m=1, k=640, n=1, bits=bits, group=32)


@pytest.mark.parametrize('bits', [8, 4, 32])
def test_rows_bitwise_independent_of_m(bits):
  """Each row's output has the same bits alone (decode, M = 1), among 4 or 9 (verify) or under other rows, with
  enough channels that the work is split over threads."""
  rng = np.random.default_rng(7)
  x, f, y = check(rng, m=9, k=256, n=2000, bits=bits, group=32, offset=8 if bits == 4 else 0, mins=bits == 4)
  for i in range(9):
    np.testing.assert_array_equal(np.asarray(f(x[i : i + 1])), y[i : i + 1])
  np.testing.assert_array_equal(np.asarray(f(x[2:6])), y[2:6])
  other = np.concatenate([rng.standard_normal((3, 256)).astype(np.float32), x[4:5]])
  np.testing.assert_array_equal(np.asarray(f(other))[3], y[4])


def test_bad_shapes():
  x = jnp.zeros((2, 64), jnp.float32)
  values, scales = jnp.zeros((8, 64), jnp.int8), jnp.ones((8, 2), jnp.float32)
  cpu_kernel.qmatmul(x, values, scales, bits=8, group=32)
  with pytest.raises(SpecjaxError, match='divide the input width'):
    cpu_kernel.qmatmul(x, values, jnp.ones((8, 3), jnp.float32), bits=8, group=24)
  with pytest.raises(SpecjaxError, match=r'scales must be \[N, K // G\]'):
    cpu_kernel.qmatmul(x, values, jnp.ones((8, 4), jnp.float32), bits=8, group=32)
  with pytest.raises(SpecjaxError, match=r'values must be \[N, 32\]'):
    cpu_kernel.qmatmul(x, values.view(jnp.uint8), scales, bits=4, group=32)
  with pytest.raises(SpecjaxError, match='must be int8'):
    cpu_kernel.qmatmul(x, values.astype(jnp.float32), scales, bits=8, group=32)


@pytest.mark.parametrize(
    'bits,act_bits,mins', [(8, 32, False), (4, 32, True), (8, 8, False), (4, 8, True), (32, 32, False)]
)
def test_expert_rows_equal_one_row_products(bits, act_bits, mins):
  """`qmatmul_rows` (routed experts): each row through its expert has the bits of a one-row product with that
  expert's matrix alone, whichever rows share the call (experts repeated, one unused, rows in any order)."""
  rng = np.random.default_rng(bits + act_bits)
  k, n, group, offset = 128, 200, 32, 8 if bits == 4 else 0
  parts = [quantized(rng, n, k, bits=bits, group=group, offset=offset, mins=mins)[0] for _ in range(4)]
  stack = [None if parts[0][i] is None else np.stack([p[i] for p in parts]) for i in range(3)]
  kw = dict(bits=bits, group=group, offset=offset, act_bits=act_bits)
  rows = jax.jit(lambda x, ids: cpu_kernel.qmatmul_rows(x, *stack, ids, **kw))
  x = rng.standard_normal((9, k)).astype(np.float32)
  ids = np.array([2, 0, 2, 2, 1, 0, 2, 1, 0], np.int32)  # expert 3 unused
  y = np.asarray(rows(x, ids))
  for m in range(9):
    alone = cpu_kernel.qmatmul(x[m : m + 1], *parts[ids[m]], **kw)
    assert bits_equal(alone, y[m : m + 1]), m
  perm = rng.permutation(9)
  assert bits_equal(rows(x[perm], ids[perm]), y[perm])
  assert bits_equal(rows(x[4:5], ids[4:5]), y[4:5])


# ---------------------------------------------------------------- act int8: activations quantized per block
# (bits, G, K): every VNNI tile shape (int8 with B 16 / 32, int4 G 32 / 64 / 128) and the generic ones (int8 G 22
# and 48 -> B 22 and 16 with a group of 3 blocks, int4 G 16 and 48), K no multiple of 64 where G allows.
ACT8_CASES = [
    (8, 16, 208),
    (8, 32, 352),
    (8, 48, 336),
    (8, 64, 448),
    (8, 352, 352),
    (8, 22, 66),
    (4, 16, 208),
    (4, 32, 352),
    (4, 48, 336),
    (4, 64, 448),
    (4, 128, 384),
]


def act8(x, values, scales, lows, *, bits, group, offset, mutant=0):
  return np.asarray(
      cpu_kernel.qmatmul(x, values, scales, lows, bits=bits, group=group, offset=offset, act_bits=8, _mutant=mutant)
  )


def bits_equal(a, b) -> bool:
  return a.shape == b.shape and np.array_equal(np.asarray(a, np.float32).view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize('bits,group,k', ACT8_CASES, ids=lambda v: str(v))
def test_act8_equals_the_numpy_reference_bit_for_bit(bits, group, k):
  """Every bits / group / offset / mins, M = 1, 2, 5, 8, an odd N (VNNI tiles of 16 and a tail): the kernel's bits
  are `qmatmul_act8_reference`'s; and close to the float64 product of the same weight."""
  rng = np.random.default_rng(bits * 1000 + group)
  for offset in (0, 8) if bits == 4 else (0,):
    for mins in (False, True):
      (values, scales, lows), w = quantized(rng, 45, k, bits=bits, group=group, offset=offset, mins=mins)
      for m in (1, 2, 5, 8):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :16] *= 20.0  # a large block next to ordinary ones
        y = act8(x, values, scales, lows, bits=bits, group=group, offset=offset)
        want = cpu_kernel.qmatmul_act8_reference(x, values, scales, lows, bits=bits, group=group, offset=offset)
        assert bits_equal(y, want), (offset, mins, m, np.abs(y - want).max())
        exact = x.astype(np.float64) @ w.T  # act int8 rounds x to 8 bits a block: within 1% of the product's scale
        assert np.abs(y - exact).max() <= 0.01 * (np.abs(x) @ np.abs(w).T).max()


@pytest.mark.parametrize('bits,group', [(8, 32), (8, 256), (8, 16), (4, 32), (4, 64), (4, 16)])
def test_act8_rows_bitwise_independent_of_m(bits, group):
  """Act int8 as float activations: a row's bits alone (M = 1), among 4 or 9, or under other rows, with enough
  channels to split the work over threads."""
  rng = np.random.default_rng(group)
  kw = dict(bits=bits, group=group, offset=8 if bits == 4 else 0)
  (values, scales, lows), _ = quantized(rng, 2000, 256, mins=bits == 4, **kw)
  x = rng.standard_normal((9, 256)).astype(np.float32)
  f = jax.jit(lambda x: cpu_kernel.qmatmul(x, values, scales, lows, **kw, act_bits=8))
  y = np.asarray(f(x))
  for i in range(9):
    assert bits_equal(f(x[i : i + 1]), y[i : i + 1]), i
  assert bits_equal(f(x[2:6]), y[2:6])
  other = np.concatenate([100.0 * rng.standard_normal((3, 256)).astype(np.float32), x[4:5]])
  assert bits_equal(np.asarray(f(other))[3], y[4])


def test_act8_mutant_row_scale_shared_across_rows_is_caught():
  """The checks above fail on a kernel whose block scale is shared by all rows (`_mutant=1`: a row's bits then
  depend on M and on the other rows): it leaves the numpy reference and changes a row's bits with M."""
  rng = np.random.default_rng(3)
  kw = dict(bits=4, group=32, offset=8)
  (values, scales, lows), _ = quantized(rng, 45, 352, mins=False, **kw)
  x = rng.standard_normal((5, 352)).astype(np.float32)
  x[0] *= 10.0
  good, bad = act8(x, values, scales, lows, **kw), act8(x, values, scales, lows, **kw, mutant=1)
  assert bits_equal(good, cpu_kernel.qmatmul_act8_reference(x, values, scales, lows, **kw))
  assert not bits_equal(bad, good)
  assert bits_equal(act8(x[3:4], values, scales, lows, **kw, mutant=1), good[3:4])  # alone it is the same
  assert not bits_equal(bad[3:4], act8(x[3:4], values, scales, lows, **kw, mutant=1))


def test_act8_arguments():
  x = jnp.zeros((2, 64), jnp.float32)
  with pytest.raises(SpecjaxError, match='act_bits must be 32, or 8'):
    cpu_kernel.qmatmul(x, jnp.zeros((8, 64), jnp.float32), bits=32, act_bits=8)
  with pytest.raises(SpecjaxError, match='act_bits must be 32, or 8'):
    cpu_kernel.qmatmul(x, jnp.zeros((8, 64), jnp.int8), jnp.ones((8, 2)), bits=8, group=32, act_bits=16)
  assert [cpu_kernel.act_block(g) for g in (16, 32, 64, 640, 48, 22, 2048)] == [16, 32, 32, 32, 16, 22, 32]
