"""Paged attention as a Pallas kernel lowered through Triton (any recent GPU).

One program per (sequence b, KV head h, key split s, row block r). Its rows
are the Q new queries times the G query heads sharing KV head h, packed
query-major (row = i * G + g) into one [rows, D] block: each page is gathered
once per KV head whatever Q and G are. The program walks its share of the
keys the sequence needs (from the window's first page, or page 0, to
`lengths[b]`), `pages_per_compute_block` pages at a time, with a float32
online softmax. Masks are per row (bottom-right causal, length, window, and
a tree mask as per-row bit words). With several key splits each program
writes unnormalised partials and an XLA reduction merges them (flash
decoding); with one it writes the output directly.

Semantics are `reference.ref_paged_attention`'s; runs on CPU with
`interpret=True`.
"""

import functools
import warnings

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels.paged_attention import block_sizes as block_sizes_lib
from pallas_kernels.paged_attention.reference import MASK_VALUE
from pallas_kernels.paged_attention.reference import tree_depths

# jax >= 0.11 deprecates the Pallas Triton backend: the module warns at import
# and every Triton pallas_call warns when it is lowered (inside the caller's
# jit), so the filter has to stay installed, for this one message only.
TRITON_DEPRECATION = 'The Pallas Triton backend is deprecated'
warnings.filterwarnings('ignore', message=TRITON_DEPRECATION, category=DeprecationWarning)
with warnings.catch_warnings():
  warnings.simplefilter('ignore', DeprecationWarning)
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top

BITS = 32  # Tree-mask columns per int32 word.


def unsupported_reason(head_dim: int, page_size: int) -> str | None:
  """Why the kernel cannot take these shapes (Triton tiles), or None."""
  if not block_sizes_lib.is_power_of_2(head_dim) or head_dim < 16:
    return f'head dim must be a power of two >= 16, got {head_dim}'
  if not block_sizes_lib.is_power_of_2(page_size):
    return f'page size must be a power of two, got {page_size}'
  return None


def _visible(
    key_pos: jax.Array,  # [K]
    row_pos: jax.Array,  # [R]; -1 marks padded rows
    tree_words: list[jax.Array],  # each [R]
    length: jax.Array,  # []
    first_pos: jax.Array,  # []
    sliding_window: int | None,
) -> jax.Array:  # [R, K] bool
  """Which keys each row sees (same rules as the reference)."""
  keys, rows = key_pos[None, :], row_pos[:, None]
  visible = (keys < length) & (rows >= 0)
  if tree_words:
    new_index = key_pos - first_pos  # [K]; < 0 for the cached keys
    word_of = new_index >> 5
    shift = (new_index & (BITS - 1))[None, :]
    in_tree = jnp.zeros(visible.shape, jnp.bool_)
    for w, word in enumerate(tree_words):
      bit = lax.shift_right_logical(word[:, None], shift) & 1
      in_tree |= (bit != 0) & (word_of == w)[None, :]
    visible &= (new_index < 0)[None, :] | in_tree
  else:
    visible &= keys <= rows
  if sliding_window is not None:
    visible &= rows - keys < sliding_window
  return visible


def _kernel(
    seq_ref,  # [2]: lengths[b], first query position
    row_pos_ref,  # [R]
    *refs,
    group: int,
    block_rows: int,
    pages_per_block: int,
    k_splits: int,
    n_words: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
):
  tree_ref = None
  if n_words:
    tree_ref, *refs = refs  # [W, R]
  block_table_ref, q_ref, k_ref, v_ref, *out_refs = refs
  # block_table [pages_per_seq], q [R, D], k/v pages [P, page_size, D].
  split, row_block = pl.program_id(2), pl.program_id(3)
  n_pages, page_size, head_dim = k_ref.shape
  block_k = pages_per_block * page_size
  n_steps_max = block_table_ref.shape[0] // pages_per_block

  length, first_pos = seq_ref[0], seq_ref[1]
  key_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
  # Row blocks past this sequence's query rows read nothing.
  active = row_block * block_rows < (length - first_pos) * group
  key_hi = jnp.where(active, length, key_lo)
  lo = key_lo // block_k
  hi = jnp.where(key_hi > key_lo, jnp.minimum(pl.cdiv(key_hi, block_k), n_steps_max), lo)
  per_split = pl.cdiv(hi - lo, k_splits)
  start = lo + split * per_split
  end = jnp.minimum(start + per_split, hi)

  q = q_ref[...]
  row_pos = row_pos_ref[...]
  tree_words = [tree_ref[w, :] for w in range(n_words)]

  def step(j, carry):
    acc, m, l = carry
    pages = block_table_ref[pl.ds(j * pages_per_block, pages_per_block)]
    pages = jnp.clip(pages, 0, n_pages - 1)
    k = k_ref[pages].reshape(block_k, head_dim).astype(q.dtype)
    v = v_ref[pages].reshape(block_k, head_dim)
    # HIGHEST: float32 inputs multiply in IEEE f32, not TF32 (no-op for bf16).
    s = (
        lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        * scale
    )
    if logit_softcap is not None:
      s = logit_softcap * jnp.tanh(s / logit_softcap)
    key_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    visible = _visible(key_pos, row_pos, tree_words, length, first_pos, sliding_window)
    s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
    correction = jnp.exp(m - m_next)
    l = l * correction + p.sum(axis=-1)
    pv = lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return acc * correction[:, None] + pv, m_next, l

  acc = jnp.zeros((block_rows, head_dim), jnp.float32)
  m = jnp.full((block_rows,), MASK_VALUE, jnp.float32)
  l = jnp.zeros((block_rows,), jnp.float32)
  acc, m, l = lax.fori_loop(start, end, step, (acc, m, l))

  if k_splits == 1:
    (o_ref,) = out_refs
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
  else:
    o_ref, m_ref, l_ref = out_refs
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _tree_words(
    mask: jax.Array,  # [B, Q, Q] bool
    query_of_row: jax.Array,  # [rows_pad]
) -> jax.Array:  # [B, W, rows_pad] int32: bit j of word w = mask[., i, 32w + j]
  b, n_q, _ = mask.shape
  n_words = -(-n_q // BITS)
  cols = jnp.pad(mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, n_words * BITS - n_q)))
  cols = cols.reshape(b, n_q, n_words, BITS)
  words = (cols << jnp.arange(BITS, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)
  words = lax.bitcast_convert_type(words, jnp.int32)  # [B, Q, W]
  return words[:, query_of_row].transpose(0, 2, 1)


def paged_attention(
    q: jax.Array,  # [B, Q, H, D]
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq] int32
    lengths: jax.Array,  # [B]
    *,
    query_lens: jax.Array | None = None,  # [B]
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    mask: jax.Array | None = None,  # [B, Q, Q] bool
    block_sizes: block_sizes_lib.BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, Q, H, D]
  """The Triton kernel; inputs as checked by `reference.check_inputs`.

  block_sizes: the tiling; None picks it from `block_sizes.py`'s table.
  """
  static = lambda x, kind: None if x is None else kind(x)  # Hashable.
  return _paged_attention(
      q,
      k_pages,
      v_pages,
      block_tables,
      lengths,
      query_lens,
      mask,
      sliding_window=static(sliding_window, int),
      logit_softcap=static(logit_softcap, float),
      scale=static(scale, float),
      block_sizes=block_sizes,
      interpret=bool(interpret),
  )


@functools.partial(jax.jit, static_argnames=('sliding_window', 'logit_softcap', 'scale', 'block_sizes', 'interpret'))
def _paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    query_lens,
    mask,
    *,
    sliding_window,
    logit_softcap,
    scale,
    block_sizes,
    interpret,
):
  b, n_q, n_heads, head_dim = q.shape
  n_kv_heads, _, page_size, _ = k_pages.shape
  group = n_heads // n_kv_heads
  n_rows = n_q * group
  pages_per_seq = block_tables.shape[1]
  if scale is None:
    scale = head_dim**-0.5
  if block_sizes is None:
    device = jax.devices()[0]
    block_sizes = block_sizes_lib.pick_block_sizes(
        n_rows=n_rows,
        n_q=n_q,
        page_size=page_size,
        head_dim=head_dim,
        pages_per_seq=pages_per_seq,
        batch=b,
        n_kv_heads=n_kv_heads,
        sliding_window=sliding_window,
        num_cores=getattr(device, 'core_count', None) or block_sizes_lib.DEFAULT_NUM_CORES,
    )
  block_rows = block_sizes.block_rows
  pages_per_block = block_sizes.pages_per_compute_block
  if pages_per_block * page_size < block_sizes_lib.MIN_KEYS:
    raise ValueError(
        f'{pages_per_block} pages of {page_size} per step is fewer than '
        f"{block_sizes_lib.MIN_KEYS} keys, Triton's smallest dot"
    )
  k_splits = block_sizes.k_splits
  row_blocks = -(-n_rows // block_rows)
  rows_pad = row_blocks * block_rows

  lengths = lengths.astype(jnp.int32)
  if query_lens is None:
    query_lens = jnp.full((b,), n_q, jnp.int32)
  first_pos = lengths - query_lens.astype(jnp.int32)
  seq_info = jnp.stack([lengths, first_pos], axis=-1)  # [B, 2]

  # Rows (i, g) query-major; the rows past Q * G are padding.
  q_rows = (
      q.reshape(b, n_q, n_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4).reshape(b, n_kv_heads, n_rows, head_dim)
  )
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_pad - n_rows), (0, 0)))
  query_of_row = jnp.minimum(jnp.arange(rows_pad, dtype=jnp.int32) // group, n_q)  # n_q marks padding
  row_real = query_of_row[None, :] < query_lens[:, None]
  row_offset = query_of_row[None, :]
  if mask is not None:  # a tree node sits at first_pos + its depth (see reference.tree_depths)
    row_offset = jnp.take_along_axis(tree_depths(mask), jnp.minimum(row_offset, n_q - 1).repeat(b, 0), axis=1)
  row_pos = jnp.where(row_real, first_pos[:, None] + row_offset, -1)

  tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, -pages_per_seq % pages_per_block)))

  inputs = [seq_info, row_pos]
  in_specs = [
      pl.BlockSpec((None, 2), lambda b_, h, s, r: (b_, 0)),
      pl.BlockSpec((None, block_rows), lambda b_, h, s, r: (b_, r)),
  ]
  n_words = 0
  if mask is not None:
    words = _tree_words(mask, jnp.minimum(query_of_row, n_q - 1))
    n_words = words.shape[1]
    inputs.append(words)
    in_specs.append(pl.BlockSpec((None, n_words, block_rows), lambda b_, h, s, r: (b_, 0, r)))
  page_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda b_, h, s, r: (h, 0, 0, 0))
  inputs += [tables, q_rows, k_pages, v_pages]
  in_specs += [
      pl.BlockSpec((None, tables.shape[1]), lambda b_, h, s, r: (b_, 0)),
      pl.BlockSpec((None, None, block_rows, head_dim), lambda b_, h, s, r: (b_, h, r, 0)),
      page_spec,
      page_spec,
  ]

  if k_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((b, n_kv_heads, rows_pad, head_dim), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_rows, head_dim), lambda b_, h, s, r: (b_, h, r, 0))]
  else:
    split_rows = (b, n_kv_heads, k_splits, rows_pad)
    stat_spec = pl.BlockSpec((None, None, None, block_rows), lambda b_, h, s, r: (b_, h, s, r))
    out_shape = [
        jax.ShapeDtypeStruct((*split_rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct(split_rows, jnp.float32),
        jax.ShapeDtypeStruct(split_rows, jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block_rows, head_dim), lambda b_, h, s, r: (b_, h, s, r, 0)),
        stat_spec,
        stat_spec,
    ]

  kernel = functools.partial(
      _kernel,
      group=group,
      block_rows=block_rows,
      pages_per_block=pages_per_block,
      k_splits=k_splits,
      n_words=n_words,
      scale=float(scale),
      sliding_window=sliding_window,
      logit_softcap=logit_softcap,
  )
  outs = pl.pallas_call(
      kernel,
      grid=(b, n_kv_heads, k_splits, row_blocks),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages),
      interpret=interpret,
      name=f'paged_attention_rows{block_rows}_pages{pages_per_block}',
  )(*inputs)

  if k_splits == 1:
    out = outs[0]
  else:
    out_splits, m, l = outs  # [B, Hkv, S, rows_pad, (D)]
    m_max = m.max(axis=2, keepdims=True)
    correction = jnp.exp(m - m_max)
    l_sum = (l * correction).sum(axis=2)
    out = (out_splits * correction[..., None]).sum(axis=2)
    out = (out / jnp.where(l_sum > 0, l_sum, 1.0)[..., None]).astype(q.dtype)
  out = out[:, :, :n_rows].reshape(b, n_kv_heads, n_q, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(b, n_q, n_heads, head_dim)
