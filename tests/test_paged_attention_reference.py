"""Paged attention reference vs an independent dense numpy oracle."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention import ref_paged_attention


def ref_dense_attention(q, k, v, q_positions, kv_len, *, scale, sliding_window=None, logit_softcap=None, new_mask=None):
  """One sequence, plain numpy loops.

  q [Q, H, D], k/v [Hkv, S, D], q_positions [Q]; new_mask [Q, Q] replaces the
  causal rule among the Q keys ending at kv_len.
  """
  n_q, n_heads, _ = q.shape
  group = n_heads // k.shape[0]
  out = np.zeros(q.shape, np.float64)
  first_new = kv_len - n_q
  for i in range(n_q):
    pos = q_positions[i]
    for h in range(n_heads):
      kh, vh = k[h // group], v[h // group]
      keys = []
      for j in range(kv_len):
        if new_mask is not None and j >= first_new:
          ok = new_mask[i, j - first_new]
        else:
          ok = j <= pos
        if sliding_window is not None:
          ok = ok and pos - j < sliding_window
        if ok:
          keys.append(j)
      if not keys:
        continue
      s = np.array([q[i, h] @ kh[j] for j in keys], np.float64) * scale
      if logit_softcap is not None:
        s = logit_softcap * np.tanh(s / logit_softcap)
      w = np.exp(s - s.max())
      w /= w.sum()
      out[i, h] = w @ vh[keys]
  return out


def make_case(rng, *, b, n_q, n_heads, n_kv_heads, head_dim, page_size, pages_per_seq, lengths, query_lens=None):
  """Random K/V for each sequence, scattered into shuffled pages."""
  n_pool = b * pages_per_seq + 3
  perm = rng.permutation(n_pool)[: b * pages_per_seq]
  block_tables = perm.reshape(b, pages_per_seq).astype(np.int32)
  k_pages = rng.normal(size=(n_kv_heads, n_pool, page_size, head_dim))
  v_pages = rng.normal(size=(n_kv_heads, n_pool, page_size, head_dim))
  k_pages, v_pages = k_pages.astype(np.float32), v_pages.astype(np.float32)
  q = rng.normal(size=(b, n_q, n_heads, head_dim)).astype(np.float32)
  contiguous = lambda pages, bi: pages[:, block_tables[bi]].reshape(n_kv_heads, pages_per_seq * page_size, head_dim)
  k = [contiguous(k_pages, bi) for bi in range(b)]
  v = [contiguous(v_pages, bi) for bi in range(b)]
  lengths = np.asarray(lengths, np.int32)
  if query_lens is None:
    query_lens = np.full((b,), n_q, np.int32)
  query_lens = np.asarray(query_lens, np.int32)
  return q, k_pages, v_pages, block_tables, lengths, query_lens, k, v


def dense_expected(q, k, v, lengths, query_lens, *, sliding_window=None, logit_softcap=None, mask=None):
  b, n_q, _, head_dim = q.shape
  out = np.zeros(q.shape, np.float64)
  for bi in range(b):
    ql, kv_len = int(query_lens[bi]), int(lengths[bi])
    new_mask = None if mask is None else mask[bi, :ql, :ql]
    # A tree node sits at the first new position plus its depth.
    offsets = np.arange(ql) if mask is None else new_mask.sum(-1) - 1
    positions = kv_len - ql + offsets
    out[bi, :ql] = ref_dense_attention(
        q[bi, :ql],
        k[bi],
        v[bi],
        positions,
        kv_len,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        new_mask=new_mask,
    )
  return out


@functools.partial(jax.jit, static_argnames=('sliding_window', 'logit_softcap'))
def jitted(q, k_pages, v_pages, block_tables, lengths, query_lens, mask=None, sliding_window=None, logit_softcap=None):
  return ref_paged_attention(
      q,
      k_pages,
      v_pages,
      block_tables,
      lengths,
      query_lens=query_lens,
      sliding_window=sliding_window,
      logit_softcap=logit_softcap,
      mask=mask,
  )


def check(q, k_pages, v_pages, block_tables, lengths, query_lens, k, v, **kw):
  got = jitted(q, k_pages, v_pages, block_tables, lengths, query_lens, **kw)
  want = dense_expected(q, k, v, lengths, query_lens, **kw)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('n_q', [1, 2, 5, 9])
@pytest.mark.parametrize('n_heads,n_kv_heads', [(2, 2), (4, 1), (8, 1), (8, 2)])
def test_matches_dense(n_q, n_heads, n_kv_heads):
  rng = np.random.default_rng(n_q * 100 + n_heads * 10 + n_kv_heads)
  # Lengths cross page boundaries and are not multiples of the page size.
  case = make_case(
      rng,
      b=3,
      n_q=n_q,
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=16,
      page_size=4,
      pages_per_seq=6,
      lengths=[n_q + 0, 13, 24],
  )
  check(*case)


@pytest.mark.parametrize('n_q', [1, 5, 9])
def test_ragged_query_lens_zero_padded_rows(n_q):
  rng = np.random.default_rng(7 + n_q)
  query_lens = [1, n_q, max(n_q - 2, 1), 0]
  case = make_case(
      rng,
      b=4,
      n_q=n_q,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      page_size=4,
      pages_per_seq=5,
      lengths=[7, 18, 11, 9],
      query_lens=query_lens,
  )
  check(*case)
  q, k_pages, v_pages, block_tables, lengths, query_lens = case[:6]
  got = np.asarray(jitted(q, k_pages, v_pages, block_tables, lengths, query_lens))
  for bi, ql in enumerate(query_lens):
    assert np.all(got[bi, ql:] == 0.0)


@pytest.mark.parametrize('sliding_window', [1, 3, 6, 13, 100])
@pytest.mark.parametrize('n_q', [1, 5])
def test_sliding_window(sliding_window, n_q):
  rng = np.random.default_rng(sliding_window + 31 * n_q)
  # pages_per_seq=12 lets small windows gather a sub-range of pages.
  case = make_case(
      rng,
      b=3,
      n_q=n_q,
      n_heads=4,
      n_kv_heads=1,
      head_dim=8,
      page_size=4,
      pages_per_seq=12,
      lengths=[n_q, 29, 47],
      query_lens=[n_q, n_q, max(n_q - 3, 1)],
  )
  check(*case, sliding_window=sliding_window)


@pytest.mark.parametrize('sliding_window', [None, 4])
def test_softcap(sliding_window):
  rng = np.random.default_rng(3)
  case = make_case(
      rng, b=2, n_q=3, n_heads=4, n_kv_heads=2, head_dim=16, page_size=4, pages_per_seq=4, lengths=[10, 16]
  )
  q = case[0] * 4.0  # Large logits, so the cap matters.
  check(q, *case[1:], logit_softcap=5.0, sliding_window=sliding_window)


def random_tree_mask(rng, b, n_q):
  """Ancestor masks of random trees: node i's parent is some node < i."""
  mask = np.zeros((b, n_q, n_q), bool)
  for bi in range(b):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n_q)]
    for i in range(n_q):
      node = i
      while node >= 0:
        mask[bi, i, node] = True
        node = parents[node]
  return mask


@pytest.mark.parametrize('n_q', [2, 5, 9])
@pytest.mark.parametrize('sliding_window', [None, 40])
def test_tree_mask(n_q, sliding_window):
  rng = np.random.default_rng(11 * n_q)
  case = make_case(
      rng,
      b=3,
      n_q=n_q,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      page_size=4,
      pages_per_seq=16,
      lengths=[n_q, 21, 60],
      query_lens=[n_q, n_q - 1, n_q],
  )
  mask = random_tree_mask(rng, 3, n_q)
  check(*case, mask=mask, sliding_window=sliding_window)


def test_causal_tree_mask_equals_no_mask():
  rng = np.random.default_rng(5)
  case = make_case(rng, b=2, n_q=5, n_heads=4, n_kv_heads=1, head_dim=8, page_size=4, pages_per_seq=4, lengths=[9, 16])
  causal = np.broadcast_to(np.tril(np.ones((5, 5), bool)), (2, 5, 5))
  args = case[:6]
  np.testing.assert_allclose(jitted(*args, mask=causal), jitted(*args), atol=1e-6)


def test_dispatch_matches_reference():
  rng = np.random.default_rng(9)
  case = make_case(rng, b=2, n_q=3, n_heads=4, n_kv_heads=2, head_dim=8, page_size=4, pages_per_seq=4, lengths=[5, 16])
  q, k_pages, v_pages, block_tables, lengths, query_lens = case[:6]
  want = jitted(*case[:6])
  for impl in ('auto', 'xla'):
    got = paged_attention(q, k_pages, v_pages, block_tables, lengths, query_lens=query_lens, impl=impl)
    np.testing.assert_allclose(got, want, atol=1e-6)
  if jax.default_backend() != 'gpu':
    with pytest.raises(ValueError, match='needs a GPU'):
      paged_attention(q, k_pages, v_pages, block_tables, lengths, impl='pallas')
  with pytest.raises(ValueError, match='unknown paged attention impl'):
    paged_attention(q, k_pages, v_pages, block_tables, lengths, impl='cuda')


def test_scale_argument():
  rng = np.random.default_rng(4)
  case = make_case(rng, b=1, n_q=2, n_heads=2, n_kv_heads=2, head_dim=8, page_size=4, pages_per_seq=2, lengths=[7])
  q = case[0]
  a = ref_paged_attention(q, *case[1:5], scale=0.5)
  b = ref_paged_attention(q * (0.5 / 8**-0.5), *case[1:5])
  np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    'change,match',
    [
        (dict(q=(1, 2, 3, 8)), 'multiple of KV heads'),
        (dict(q=(1, 2, 4, 16)), 'head dim mismatch'),
        (dict(q=(2, 4, 8)), r'q must be \[B, Q, H, D\]'),
        (dict(k_pages=(2, 6, 4)), 'k_pages must be'),
        (dict(v_pages=(2, 6, 4, 4)), 'v_pages shape'),
        (dict(block_tables=(2, 3)), 'block_tables must be'),
        (dict(lengths=(2,)), 'lengths must be'),
        (dict(query_lens=(3,)), 'query_lens must be'),
        (dict(mask=(1, 2, 3)), 'mask must be'),
    ],
)
def test_bad_shapes_raise(change, match):
  shapes = dict(
      q=(1, 2, 4, 8),
      k_pages=(2, 6, 4, 8),
      v_pages=(2, 6, 4, 8),
      block_tables=(1, 3),
      lengths=(1,),
      query_lens=(1,),
      mask=(1, 2, 2),
  )
  shapes.update(change)
  arr = lambda name, dtype=jnp.float32: jnp.zeros(shapes[name], dtype)
  with pytest.raises(ValueError, match=match):
    paged_attention(
        arr('q'),
        arr('k_pages'),
        arr('v_pages'),
        arr('block_tables', jnp.int32),
        arr('lengths', jnp.int32),
        query_lens=arr('query_lens', jnp.int32),
        mask=arr('mask', bool),
    )


def test_bad_options_raise():
  q = jnp.zeros((1, 1, 2, 8))
  pages = jnp.zeros((1, 4, 4, 8))
  tables, lengths = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match='sliding_window'):
    paged_attention(q, pages, pages, tables, lengths, sliding_window=0)
  with pytest.raises(ValueError, match='logit_softcap'):
    paged_attention(q, pages, pages, tables, lengths, logit_softcap=-1.0)
  with pytest.raises(ValueError, match='block_tables must be integer'):
    paged_attention(q, pages, pages, tables.astype(jnp.float32), lengths)
