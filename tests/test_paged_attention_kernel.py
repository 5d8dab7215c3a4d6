"""Triton paged attention kernel vs the reference.

`TestPagedAttentionKernel` compiles the kernel and runs only on a GPU;
`TestPagedAttentionKernelInterpret` runs the same cases in Pallas interpret
mode on CPU (jax tests/pallas/gpu_paged_attention_test.py pattern).
"""

import importlib.util
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import block_sizes as block_sizes_lib
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention import ref_paged_attention
from pallas_kernels.paged_attention import triton_kernel
from pallas_kernels.paged_attention.block_sizes import BlockSizes

ON_GPU = jax.default_backend() == 'gpu'
jitted_ref = jax.jit(ref_paged_attention, static_argnames=('sliding_window', 'logit_softcap'))


def make_case(
    rng,
    *,
    b,
    n_q,
    n_heads,
    n_kv_heads,
    head_dim=16,
    page_size=4,
    pages_per_seq=8,
    lengths,
    query_lens=None,
    dtype=np.float32,
):
  """Random q and pages; each sequence owns shuffled pages of one pool."""
  n_pool = b * pages_per_seq + 3
  tables = rng.permutation(n_pool)[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
  shape = (n_kv_heads, n_pool, page_size, head_dim)
  k_pages = rng.normal(size=shape).astype(dtype)
  v_pages = rng.normal(size=shape).astype(dtype)
  q = rng.normal(size=(b, n_q, n_heads, head_dim)).astype(dtype)
  if query_lens is None:
    query_lens = [n_q] * b
  return dict(
      q=q,
      k_pages=k_pages,
      v_pages=v_pages,
      block_tables=tables,
      lengths=np.asarray(lengths, np.int32),
      query_lens=np.asarray(query_lens, np.int32),
  )


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


def unpack(case):
  return (case['q'], case['k_pages'], case['v_pages'], case['block_tables'], case['lengths'])


class TestPagedAttentionKernel:
  """Compiled on a GPU; skipped elsewhere."""

  INTERPRET = False

  @pytest.fixture(autouse=True)
  def _platform(self):
    if not self.INTERPRET and not ON_GPU:
      pytest.skip('the compiled kernel needs a GPU; the Interpret subclass runs these cases on CPU')
    with warnings.catch_warnings():
      warnings.filterwarnings('ignore', category=DeprecationWarning, message=triton_kernel.TRITON_DEPRECATION)
      yield

  def check(self, case, *, block_sizes=None, atol=2e-5, **kw):
    args = unpack(case)
    got = triton_kernel.paged_attention(
        *args, query_lens=case['query_lens'], block_sizes=block_sizes, interpret=self.INTERPRET, **kw
    )
    with jax.default_matmul_precision('highest'):
      want = jitted_ref(*args, query_lens=case['query_lens'], **kw)
    assert got.dtype == want.dtype == case['q'].dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=atol)
    for bi, ql in enumerate(case['query_lens']):
      assert np.all(np.asarray(got)[bi, ql:] == 0)  # Padded query rows.
    return got

  @pytest.mark.parametrize('n_q', [1, 2, 5, 9])
  @pytest.mark.parametrize('n_heads,n_kv_heads', [(2, 2), (8, 2), (8, 1)])
  def test_matches_reference(self, n_q, n_heads, n_kv_heads):
    rng = np.random.default_rng(100 * n_q + 10 * n_heads + n_kv_heads)
    # Lengths not multiples of the page; ragged query_lens, one empty.
    case = make_case(
        rng,
        b=4,
        n_q=n_q,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        pages_per_seq=8,
        lengths=[n_q, 13, 30, 7],
        query_lens=[n_q, max(n_q - 1, 1), 1, 0],
    )
    self.check(case)

  @pytest.mark.parametrize('page_size,pages_per_seq', [(8, 6), (16, 4)])
  def test_page_sizes(self, page_size, pages_per_seq):
    rng = np.random.default_rng(page_size)
    case = make_case(
        rng,
        b=3,
        n_q=5,
        n_heads=4,
        n_kv_heads=1,
        head_dim=32,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        lengths=[5, 2 * page_size + 3, pages_per_seq * page_size - 1],
        query_lens=[5, 3, 5],
    )
    self.check(case)

  @pytest.mark.parametrize('sliding_window,n_q', [(1, 1), (3, 5), (6, 9), (13, 1), (13, 5), (100, 5)])
  def test_sliding_window(self, sliding_window, n_q):
    rng = np.random.default_rng(sliding_window + 31 * n_q)
    # 12 pages per sequence: small windows skip pages before the window.
    case = make_case(
        rng,
        b=3,
        n_q=n_q,
        n_heads=4,
        n_kv_heads=1,
        pages_per_seq=12,
        lengths=[n_q, 29, 47],
        query_lens=[n_q, n_q, max(n_q - 3, 1)],
    )
    self.check(case, sliding_window=sliding_window, block_sizes=BlockSizes(16, 4, 3))

  @pytest.mark.parametrize('sliding_window', [None, 4])
  def test_softcap(self, sliding_window):
    rng = np.random.default_rng(3)
    case = make_case(rng, b=2, n_q=3, n_heads=4, n_kv_heads=2, pages_per_seq=4, lengths=[10, 16])
    case['q'] *= 4.0  # Large logits, so the cap matters.
    got = self.check(case, logit_softcap=5.0, sliding_window=sliding_window)
    uncapped = triton_kernel.paged_attention(*unpack(case), sliding_window=sliding_window, interpret=self.INTERPRET)
    assert np.abs(np.asarray(got - uncapped)).max() > 1e-2

  @pytest.mark.parametrize('n_q,sliding_window', [(2, None), (5, 40), (9, None), (9, 7)])
  def test_tree_mask(self, n_q, sliding_window):
    rng = np.random.default_rng(11 * n_q)
    case = make_case(
        rng,
        b=3,
        n_q=n_q,
        n_heads=8,
        n_kv_heads=2,
        pages_per_seq=16,
        lengths=[n_q, 21, 60],
        query_lens=[n_q, n_q - 1, n_q],
    )
    self.check(case, mask=random_tree_mask(rng, 3, n_q), sliding_window=sliding_window)

  def test_tree_mask_over_32_queries(self):
    # 40 new tokens: the mask rows take two 32-bit words.
    rng = np.random.default_rng(40)
    case = make_case(
        rng, b=2, n_q=40, n_heads=2, n_kv_heads=1, page_size=8, pages_per_seq=8, lengths=[45, 64], query_lens=[40, 37]
    )
    self.check(case, mask=random_tree_mask(rng, 2, 40), block_sizes=BlockSizes(32, 2, 2))

  @pytest.mark.parametrize(
      'page_size,block_sizes',
      [
          (16, BlockSizes(16, 1, 1)),  # One page per step, one split.
          (4, BlockSizes(16, 4, 7)),  # More splits than sequences have steps.
          (4, BlockSizes(32, 4, 2)),  # Rows 72 -> 3 row blocks, the last partial.
      ],
  )
  def test_block_sizes(self, page_size, block_sizes):
    rng = np.random.default_rng(block_sizes.k_splits)
    case = make_case(
        rng,
        b=3,
        n_q=9,
        n_heads=8,
        n_kv_heads=1,
        page_size=page_size,
        pages_per_seq=48 // page_size,
        lengths=[9, 26, 48],
        query_lens=[9, 4, 9],
    )
    self.check(case, block_sizes=block_sizes)

  def test_bfloat16(self):
    rng = np.random.default_rng(16)
    case = make_case(
        rng, b=2, n_q=4, n_heads=4, n_kv_heads=1, head_dim=32, page_size=8, lengths=[20, 64], dtype=jnp.bfloat16
    )
    self.check(case, atol=3e-2)

  def test_dispatch(self):
    rng = np.random.default_rng(9)
    case = make_case(rng, b=2, n_q=3, n_heads=4, n_kv_heads=2, pages_per_seq=4, lengths=[5, 16])
    args = unpack(case)
    got = paged_attention(*args, query_lens=case['query_lens'], impl='pallas', interpret=self.INTERPRET)
    with jax.default_matmul_precision('highest'):
      want = jitted_ref(*args, query_lens=case['query_lens'])
    np.testing.assert_allclose(got, want, atol=1e-5)


class TestPagedAttentionKernelInterpret(TestPagedAttentionKernel):
  INTERPRET = True


def small_args(n_heads=4, n_kv_heads=2, head_dim=16, page_size=4, pages_per_seq=3, lengths=(5, 12)):
  q = jnp.zeros((len(lengths), 2, n_heads, head_dim))
  pages = jnp.zeros((n_kv_heads, 8, page_size, head_dim))
  tables = jnp.arange(len(lengths) * pages_per_seq, dtype=jnp.int32) % 8
  return (q, pages, pages, tables.reshape(len(lengths), pages_per_seq), jnp.asarray(lengths, jnp.int32))


def test_pallas_on_cpu_needs_interpret():
  if ON_GPU:
    pytest.skip('checks the CPU error')
  with pytest.raises(ValueError, match='needs a GPU.*interpret=True'):
    paged_attention(*small_args(), impl='pallas')


def test_auto_is_xla_off_gpu():
  if ON_GPU:
    pytest.skip('checks the CPU choice')
  from pallas_kernels.paged_attention import select_impl

  assert select_impl('auto', 16, 4) == 'xla'
  assert select_impl('auto', 16, 4, interpret=True) == 'xla'
  assert select_impl('pallas', 16, 4, interpret=True) == 'pallas'


def test_auto_on_gpu(monkeypatch):
  import pallas_kernels.paged_attention as pa
  from pallas_kernels.paged_attention import select_impl

  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  # Until the kernel has run on a GPU, "auto" keeps XLA there too.
  assert select_impl('auto', 256, 16) == ('pallas' if pa.AUTO_PICKS_PALLAS else 'xla')
  monkeypatch.setattr(pa, 'AUTO_PICKS_PALLAS', True)
  assert select_impl('auto', 256, 16) == 'pallas'
  assert select_impl('auto', 80, 16) == 'xla'  # Not a Triton tile.
  assert select_impl('xla', 256, 16) == 'xla'
  with pytest.raises(ValueError, match='head dim must be a power of two'):
    select_impl('pallas', 80, 16)


@pytest.mark.parametrize(
    'change,match',
    [
        (dict(n_heads=3), 'multiple of KV heads'),
        (dict(head_dim=24), 'head dim must be a power of two'),
        (dict(page_size=6), 'page size must be a power of two'),
        (dict(lengths=(5, 13)), r'lengths\[1\]=13 does not fit its block table'),
    ],
)
def test_bad_shapes_raise(change, match):
  with pytest.raises(ValueError, match=match):
    paged_attention(*small_args(**change), impl='pallas', interpret=True)


def test_bad_values_raise():
  args = small_args()
  with pytest.raises(ValueError, match=r'query_lens\[0\]=3 must be in'):
    paged_attention(*args, query_lens=jnp.array([3, 1]), impl='pallas', interpret=True)
  with pytest.raises(ValueError, match=r'query_lens\[0\]=2 must be in'):
    paged_attention(*args[:4], jnp.array([1, 5]), query_lens=jnp.array([2, 2]), impl='pallas', interpret=True)
  tables = args[3].at[1, 2].set(8)
  with pytest.raises(ValueError, match=r'block_tables\[1, 2\]=8 is not a page'):
    paged_attention(*args[:3], tables, args[4], impl='pallas', interpret=True)


@pytest.mark.parametrize(
    'n_q,n_heads,n_kv_heads,head_dim,dtype,kw',
    [
        (1, 4, 1, 256, jnp.bfloat16, {}),  # Gemma 3 270M decode.
        (9, 32, 4, 128, jnp.float16, dict(tree=True, sliding_window=1024, logit_softcap=50.0)),
        (4, 8, 8, 64, jnp.float32, {}),
    ],
)
def test_lowers_to_triton_for_cuda(n_q, n_heads, n_kv_heads, head_dim, dtype, kw):
  """The Pallas -> Triton lowering runs (on CPU, lowering for CUDA)."""
  kw = dict(kw)
  b, page_size, pages_per_seq = 2, 16, 64
  spec = jax.ShapeDtypeStruct
  pages = spec((n_kv_heads, 256, page_size, head_dim), dtype)
  args = [
      spec((b, n_q, n_heads, head_dim), dtype),
      pages,
      pages,
      spec((b, pages_per_seq), jnp.int32),
      spec((b,), jnp.int32),
  ]
  mask = spec((b, n_q, n_q), jnp.bool_) if kw.pop('tree', False) else None

  def fn(q, k_pages, v_pages, tables, lengths, mask):
    return triton_kernel.paged_attention(q, k_pages, v_pages, tables, lengths, mask=mask, **kw)

  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', category=DeprecationWarning, message=triton_kernel.TRITON_DEPRECATION)
    lowered = jax.jit(fn).trace(*args, mask).lower(lowering_platforms=('cuda',))
  assert '__gpu$xla.gpu.triton' in lowered.as_text()


@pytest.mark.parametrize(
    'n_rows,head_dim,page_size,pages_per_seq,batch',
    [
        (4, 256, 16, 2048, 1),
        (36, 128, 16, 512, 8),
        (72, 64, 32, 64, 64),
        (1, 128, 256, 8, 2),
    ],
)
def test_block_size_table(n_rows, head_dim, page_size, pages_per_seq, batch):
  sizes = block_sizes_lib.pick_block_sizes(
      n_rows=n_rows,
      n_q=1,
      page_size=page_size,
      head_dim=head_dim,
      pages_per_seq=pages_per_seq,
      batch=batch,
      n_kv_heads=2,
  )
  assert block_sizes_lib.is_power_of_2(sizes.block_rows)
  assert 16 <= sizes.block_rows <= max(16, block_sizes_lib.next_power_of_2(n_rows))
  assert block_sizes_lib.is_power_of_2(sizes.pages_per_compute_block)
  assert sizes.pages_per_compute_block * page_size >= 16
  steps = -(-pages_per_seq // sizes.pages_per_compute_block)
  assert 1 <= sizes.k_splits <= max(1, steps // 2)
  assert sizes.k_splits <= block_sizes_lib.MAX_SPLITS


def test_benchmark_script_runs(capsys, tmp_path):
  path = pathlib.Path(__file__).parents[1] / 'benchmarks' / 'paged_attention.py'
  spec = importlib.util.spec_from_file_location('paged_attention_bench', path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out_json = tmp_path / 'out.json'
  # float32 and IEEE matmuls in the XLA reference: a tight check on a GPU too
  # (the GPU default is bfloat16, and XLA's float32 default there is TF32).
  with jax.default_matmul_precision('highest'):
    # head dim 64: float32 at 256 overflows the H200's shared memory with the
    # bf16-sized block table (measured; see benchmarks/README.md).
    bench.main(
        [
            '--batch',
            '1',
            '--context',
            '20',
            '--queries',
            '2',
            '--dtype',
            'float32',
            '--head-dim',
            '64',
            '--json',
            str(out_json),
        ]
    )
  printed = capsys.readouterr().out
  assert 'largest absolute difference' in printed
  if not ON_GPU:
    assert 'GPU figures pending' in printed
  (row,) = json.loads(out_json.read_text())['rows']
  assert row['kernel_max_abs_err'] < 1e-4
  # jax's kernel multiplies float32 in TF32 on a GPU.
  assert row['jax1q_max_abs_err'] < (5e-3 if ON_GPU else 1e-4)


def test_bad_block_sizes_raise():
  with pytest.raises(ValueError, match='block_rows must be a power of two'):
    BlockSizes(24, 1, 1)
  with pytest.raises(ValueError, match='pages_per_compute_block must be'):
    BlockSizes(16, 3, 1)
  args = small_args()
  with pytest.raises(ValueError, match='fewer than 16 keys'):
    triton_kernel.paged_attention(*args, block_sizes=BlockSizes(16, 2, 1), interpret=True)
