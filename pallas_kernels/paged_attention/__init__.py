"""Paged attention: one entry point over the reference and the Pallas kernels."""

import jax
import numpy as np

from pallas_kernels.paged_attention.reference import check_inputs
from pallas_kernels.paged_attention.reference import MASK_VALUE
from pallas_kernels.paged_attention.reference import ref_paged_attention

IMPLS = ('auto', 'xla', 'pallas')

__all__ = [
    'IMPLS',
    'MASK_VALUE',
    'check_inputs',
    'check_lengths',
    'paged_attention',
    'ref_paged_attention',
    'select_impl',
]


def _concrete(x: jax.Array | None) -> np.ndarray | None:
  """x on the host, or None when x is None or traced."""
  if x is None:
    return None
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def check_lengths(
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq]
    lengths: jax.Array,  # [B]
    query_lens: jax.Array | None,  # [B]
    n_q: int,
) -> None:
  """Value checks, done only on concrete (non-traced) arrays."""
  lengths_np = _concrete(lengths)
  if lengths_np is None:
    return
  _, n_pages, page_size, _ = k_pages.shape
  capacity = block_tables.shape[1] * page_size
  if (lengths_np < 0).any() or (lengths_np > capacity).any():
    b = int(np.argmax((lengths_np < 0) | (lengths_np > capacity)))
    raise ValueError(
        f'lengths[{b}]={int(lengths_np[b])} does not fit its block table: '
        f'{block_tables.shape[1]} pages of {page_size} hold {capacity} keys'
    )
  query_lens_np = _concrete(query_lens)
  if query_lens_np is not None:
    bad = (query_lens_np < 0) | (query_lens_np > n_q) | (query_lens_np > lengths_np)
    if bad.any():
      b = int(np.argmax(bad))
      raise ValueError(
          f'query_lens[{b}]={int(query_lens_np[b])} must be in [0, min(Q={n_q}, lengths[{b}]={int(lengths_np[b])})]'
      )
  tables_np = _concrete(block_tables)
  if tables_np is not None:
    used = np.arange(tables_np.shape[1]) < -(-lengths_np[:, None] // page_size)
    bad = used & ((tables_np < 0) | (tables_np >= n_pages))
    if bad.any():
      b, col = map(int, np.argwhere(bad)[0])
      raise ValueError(f'block_tables[{b}, {col}]={int(tables_np[b, col])} is not a page id in [0, {n_pages})')


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f'unknown paged attention impl {impl!r}; expected one of {IMPLS}')


# The Triton kernel matches the reference on an H200 (compiled; the engine gives
# the XLA path's tokens), but "auto" keeps XLA for now: float32 with head dim
# 256 overflows shared memory with the current block table, and at batch 1 with
# long contexts the kernel is slower than XLA (benchmarks/README.md). Opt in
# with impl="pallas".
AUTO_PICKS_PALLAS = False


def select_impl(impl: str, head_dim: int, page_size: int, interpret: bool = False) -> str:
  """ "xla" or "pallas" for a requested impl; raises if "pallas" can't run."""
  check_impl(impl)
  if impl == 'xla':
    return 'xla'
  on_gpu = jax.default_backend() == 'gpu'
  if impl == 'auto' and not (on_gpu and AUTO_PICKS_PALLAS):
    return 'xla'
  from pallas_kernels.paged_attention import triton_kernel  # pylint: disable=g-import-not-at-top

  reason = triton_kernel.unsupported_reason(head_dim, page_size)
  if impl == 'auto':
    return 'xla' if reason else 'pallas'
  if not (on_gpu or interpret):
    raise ValueError(
        f"impl='pallas' needs a GPU (the default backend is "
        f'{jax.default_backend()!r}); pass interpret=True to run the kernel '
        f"in Pallas interpret mode, or use impl='xla' or 'auto'"
    )
  if reason:
    raise ValueError(f"impl='pallas': the Triton kernel can't take these shapes: {reason}; use impl='xla' or 'auto'")
  return 'pallas'


def paged_attention(
    q: jax.Array,  # [B, Q, H, D]
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq] int32
    lengths: jax.Array,  # [B] keys per sequence, including the Q new ones
    *,
    query_lens: jax.Array | None = None,  # [B]
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    mask: jax.Array | None = None,  # [B, Q, Q] bool
    impl: str = 'auto',
    interpret: bool = False,
) -> jax.Array:  # [B, Q, H, D]
  """Paged attention; semantics in `reference.py`.

  impl: "xla" (the pure-JAX reference), "pallas" (the Triton-lowered Pallas
  kernel; on CPU only with `interpret=True`) or "auto" (the kernel on GPU
  when it takes the shapes, else "xla"). `interpret` runs the kernel in
  Pallas interpret mode; it does not make "auto" pick the kernel.
  """
  check_impl(impl)
  check_inputs(q, k_pages, v_pages, block_tables, lengths, query_lens, mask, sliding_window, logit_softcap)
  impl = select_impl(impl, q.shape[-1], k_pages.shape[2], interpret)
  check_lengths(k_pages, block_tables, lengths, query_lens, q.shape[1])
  kwargs = dict(
      query_lens=query_lens, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale, mask=mask
  )
  if impl == 'pallas':
    from pallas_kernels.paged_attention import triton_kernel  # pylint: disable=g-import-not-at-top

    return triton_kernel.paged_attention(q, k_pages, v_pages, block_tables, lengths, interpret=interpret, **kwargs)
  return ref_paged_attention(q, k_pages, v_pages, block_tables, lengths, **kwargs)
