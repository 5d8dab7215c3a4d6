"""Pure-JAX paged attention: the reference the Pallas kernels are tested against.

Also the implementation the models use on CPU, so it gathers only the pages a
sequence needs (only the window's pages on sliding-window layers) and groups
query heads over their KV head instead of repeating K/V.

Masking (bottom-right aligned): query row i of sequence b sits at absolute
position `lengths[b] - query_lens[b] + i` and sees key j iff `j <= pos`,
`j < lengths[b]` and, on sliding layers, `pos - j < sliding_window`. A tree
`mask [B, Q, Q]` replaces the causal rule among the new tokens (the last
`query_lens[b]` keys); the length and window rules still apply. A tree mask
is ancestor-or-self: row i sits at position `lengths[b] - query_lens[b] +
depth(i)`, its depth being `sum(mask[b, i]) - 1`, which the window rule uses
against the cached keys (trees shallower than the window). Padded query rows
(`i >= query_lens[b]`) and rows that see no key output zeros.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reductions import tree_sum

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_inputs(
    q: jax.Array,  # [B, Q, H, D]
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq]
    lengths: jax.Array,  # [B]
    query_lens: jax.Array | None = None,  # [B]
    mask: jax.Array | None = None,  # [B, Q, Q]
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
  """Static (trace-time) shape checks; raises ValueError naming the problem."""
  if q.ndim != 4:
    raise ValueError(f'q must be [B, Q, H, D], got shape {q.shape}')
  if k_pages.ndim != 4:
    raise ValueError(f'k_pages must be [Hkv, P, page_size, D], got shape {k_pages.shape}')
  if v_pages.shape != k_pages.shape:
    raise ValueError(f'v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}')
  b, n_q, n_heads, head_dim = q.shape
  n_kv_heads = k_pages.shape[0]
  if k_pages.shape[-1] != head_dim:
    raise ValueError(f'head dim mismatch: q has D={head_dim}, pages have D={k_pages.shape[-1]}')
  if n_kv_heads == 0 or n_heads % n_kv_heads:
    raise ValueError(f'query heads H={n_heads} must be a multiple of KV heads Hkv={n_kv_heads}')
  if block_tables.ndim != 2 or block_tables.shape[0] != b:
    raise ValueError(f'block_tables must be [B={b}, pages_per_seq], got shape {block_tables.shape}')
  if not jnp.issubdtype(block_tables.dtype, jnp.integer):
    raise ValueError(f'block_tables must be integer, got {block_tables.dtype}')
  if lengths.shape != (b,):
    raise ValueError(f'lengths must be [B={b}], got shape {lengths.shape}')
  if query_lens is not None and query_lens.shape != (b,):
    raise ValueError(f'query_lens must be [B={b}], got shape {query_lens.shape}')
  if mask is not None and mask.shape != (b, n_q, n_q):
    raise ValueError(f'mask must be [B, Q, Q]={(b, n_q, n_q)}, got shape {mask.shape}')
  if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1):
    raise ValueError(f'sliding_window must be a positive int or None, got {sliding_window}')
  if logit_softcap is not None and not logit_softcap > 0:
    raise ValueError(f'logit_softcap must be positive or None, got {logit_softcap}')


def tree_depths(mask: jax.Array) -> jax.Array:  # [B, Q, Q] -> [B, Q] int32
  """Depth of each node of an ancestor-or-self tree mask (a causal mask: the row index)."""
  return jnp.sum(mask.astype(jnp.int32), axis=-1) - 1


CHUNK_KEYS = 128  # keys per partial sum: a query's keys are summed chunk by chunk, then over chunks in order


def chunk_pages(page_size: int) -> int:
  """Pages per chunk of about `CHUNK_KEYS` keys (whole pages)."""
  return max(1, CHUNK_KEYS // page_size)


def _pages_to_gather(
    block_tables: jax.Array,  # [B, pages_per_seq]
    first_query_pos: jax.Array,  # [B]
    page_size: int,
    n_q: int,
    sliding_window: int | None,
    per_chunk: int,
) -> tuple[jax.Array, jax.Array]:
  """Returns page ids [B, Nc * per_chunk] (whole chunks of `per_chunk` pages, at multiples of a chunk from the
  table's start) and the first gathered page's index [B]. Columns past the table read page 0 (masked by length)."""
  b, pages_per_seq = block_tables.shape
  n_chunks = -(-pages_per_seq // per_chunk)
  table = jnp.pad(block_tables, ((0, 0), (0, n_chunks * per_chunk - pages_per_seq)))
  if sliding_window is not None:
    # Keys in [first_query_pos - W + 1, first_query_pos + Q) span at most this many chunks, whatever their
    # alignment.
    n_window = -(-(sliding_window - 1 + n_q) // (per_chunk * page_size)) + 1
    if n_window < n_chunks:
      first_key = jnp.maximum(first_query_pos - sliding_window + 1, 0)
      first_chunk = jnp.minimum(first_key // (per_chunk * page_size), n_chunks - n_window)
      cols = first_chunk[:, None] * per_chunk + jnp.arange(n_window * per_chunk, dtype=jnp.int32)
      return jnp.take_along_axis(table, cols, axis=1), first_chunk * per_chunk
  return table, jnp.zeros((b,), jnp.int32)


def ref_paged_attention(
    q: jax.Array,  # [B, Q, H, D]
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq] int32
    lengths: jax.Array,  # [B] keys per sequence, including the Q new ones
    *,
    query_lens: jax.Array | None = None,  # [B]; None = all Q rows are real
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    mask: jax.Array | None = None,  # [B, Q, Q] bool, among the new tokens
    width_invariant: bool | None = None,
) -> jax.Array:  # [B, Q, H, D]
  """Attention of Q new queries over a paged KV cache (one layer).

  `width_invariant` (default: on the CPU backend): a query's output has the same bits whatever Q, B and the
  block table's width are, so a verify pass gives each position what a decode step gives it (`_each_query`:
  keys in chunks of `CHUNK_KEYS` at fixed offsets from the table's start, only as many chunks as the longest
  row fills, each query its own loop step). Off, every query goes through one pair of dots (faster on a GPU,
  where launches per query cost more than the arithmetic).
  """
  check_inputs(q, k_pages, v_pages, block_tables, lengths, query_lens, mask, sliding_window, logit_softcap)
  b, n_q, n_heads, head_dim = q.shape
  n_kv_heads, _, page_size, _ = k_pages.shape
  group = n_heads // n_kv_heads
  if scale is None:
    scale = head_dim**-0.5
  out_dtype = q.dtype

  lengths = lengths.astype(jnp.int32)
  if query_lens is None:
    query_lens = jnp.full((b,), n_q, jnp.int32)
  query_lens = query_lens.astype(jnp.int32)
  first_query_pos = lengths - query_lens  # [B]

  if width_invariant is None:
    width_invariant = jax.default_backend() == 'cpu'
  per_chunk = chunk_pages(page_size) if width_invariant else 1  # one page a chunk: the gather of old
  page_ids, first_page = _pages_to_gather(
      block_tables.astype(jnp.int32), first_query_pos, page_size, n_q, sliding_window, per_chunk
  )
  n_keys = page_ids.shape[1] * page_size
  chunk = per_chunk * page_size
  n_chunks = n_keys // chunk

  row = jnp.arange(n_q, dtype=jnp.int32)[None, :, None]  # [1, Q, 1]
  depth = row if mask is None else tree_depths(mask)[:, :, None]
  query_pos = first_query_pos[:, None, None] + depth  # [B, Q, 1]
  key_pos = first_page[:, None, None] * page_size + jnp.arange(n_keys, dtype=jnp.int32)  # [B, 1, S]
  visible = (key_pos < lengths[:, None, None]) & (row < query_lens[:, None, None])
  if mask is None:
    visible &= key_pos <= query_pos
  else:
    new_index = key_pos - first_query_pos[:, None, None]  # [B, 1, S]
    tree = jnp.take_along_axis(
        mask.astype(bool), jnp.clip(new_index, 0, n_q - 1).repeat(n_q, 1), axis=2
    )  # [B, Q, S]: mask[b, i, new_index]
    visible &= jnp.where(new_index >= 0, tree, True)
  if sliding_window is not None:
    visible &= query_pos - key_pos < sliding_window

  q = (q.astype(jnp.float32) * scale).reshape(b, n_q, n_kv_heads, group, head_dim)
  if not width_invariant:
    k = k_pages[:, page_ids].reshape(n_kv_heads, b, n_keys, head_dim)
    v = v_pages[:, page_ids].reshape(n_kv_heads, b, n_keys, head_dim)
    out = _all_queries(q, k, v, visible, logit_softcap)
    return out.reshape(b, n_q, n_heads, head_dim).astype(out_dtype)
  # Chunks up to the last one any row has keys in; the rest are masked for every query.
  live = jnp.max(-(-(lengths - first_page * page_size) // chunk))
  out = _each_query(
      q,
      k_pages,
      v_pages,
      page_ids.reshape(b, n_chunks, per_chunk),
      visible.reshape(b, n_q, n_chunks, chunk),
      jnp.clip(live, 0, n_chunks),
      logit_softcap,
  )
  return out.reshape(b, n_q, n_heads, head_dim).astype(out_dtype)


def _each_query(
    q: jax.Array,  # [B, Q, Hkv, G, D] float32, scaled
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    chunk_ids: jax.Array,  # [B, Nc, pages per chunk]
    visible: jax.Array,  # [B, Q, Nc, C] bool
    live: jax.Array,  # chunks to visit
    logit_softcap: float | None,
) -> jax.Array:  # [B, Q, Hkv, G, D] float32
  """Width-invariant attention: chunk after chunk (only the first `live`), each query its own loop step.

  Per query the running (peak, denominator, output) are rescaled and added to in chunk order (online softmax).
  A chunk the query cannot see leaves them as they are bit for bit (its peak is MASK_VALUE, so the rescale is
  exp(0) = 1, and it adds zeros), so whichever chunks around its own a pass visits, the query gets the bits a
  one-query pass gives it.
  """
  b, n_q, n_kv_heads, group, head_dim = q.shape
  chunk = visible.shape[-1]
  k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)

  def one_chunk(c, carry):
    ids = jax.lax.dynamic_index_in_dim(chunk_ids, c, axis=1, keepdims=False)  # [B, pages per chunk]
    k = k_pages[:, ids].reshape(n_kv_heads, b, chunk, head_dim)
    v = v_pages[:, ids].reshape(n_kv_heads, b, chunk, head_dim).astype(jnp.float32)
    # Gathered (and K transposed to the dot's [D, C]) once a chunk: left to itself XLA fuses the gather into
    # each query's step, so a verify pass gathered the chunk K + 1 times.
    k_t, v = jax.lax.optimization_barrier((jnp.swapaxes(k, -1, -2), v))  # [Hkv, B, D, C], [Hkv, B, C, D]
    seen = jax.lax.dynamic_index_in_dim(visible, c, axis=2, keepdims=False).transpose(1, 0, 2)  # [Q, B, C]

    def one_query(args):  # q [B, Hkv, G, D], seen [B, C], running state [B, Hkv, G(, D)]
      q_i, seen_i, peak, denom, acc = args
      logits = jnp.einsum('bkgd,kbds->bkgs', q_i, k_t, preferred_element_type=jnp.float32)
      if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
      logits = jnp.where(seen_i[:, None, None], logits, MASK_VALUE)
      new_peak = jnp.maximum(peak, logits.max(-1))
      rescale = jnp.exp(peak - new_peak)
      weights = jnp.where(seen_i[:, None, None], jnp.exp(logits - new_peak[..., None]), 0.0)
      denom = denom * rescale + tree_sum(weights)[..., 0]
      acc = acc * rescale[..., None] + jnp.einsum('bkgs,kbsd->bkgd', weights, v, preferred_element_type=jnp.float32)
      return new_peak, denom, acc

    return jax.lax.map(one_query, (q_by_query, seen) + carry)

  q_by_query = q.transpose(1, 0, 2, 3, 4)  # [Q, B, Hkv, G, D]
  state = (
      jnp.full(q_by_query.shape[:-1], MASK_VALUE, jnp.float32),
      jnp.zeros(q_by_query.shape[:-1], jnp.float32),
      jnp.zeros(q_by_query.shape, jnp.float32),
  )
  _, denom, acc = jax.lax.fori_loop(0, live, one_chunk, state)
  out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
  return out.transpose(1, 0, 2, 3, 4)


def _all_queries(
    q: jax.Array,  # [B, Q, Hkv, G, D] float32, scaled
    k: jax.Array,  # [Hkv, B, S, D]
    v: jax.Array,  # [Hkv, B, S, D]
    visible: jax.Array,  # [B, Q, S] bool
    logit_softcap: float | None,
) -> jax.Array:  # [B, Q, Hkv, G, D] float32
  """Every query in one pair of dots (XLA tiles them by shape: not width-invariant; the GPU path)."""
  logits = jnp.einsum('bqkgd,kbsd->bkgqs', q, k, preferred_element_type=jnp.float32)
  if logit_softcap is not None:
    logits = logit_softcap * jnp.tanh(logits / logit_softcap)
  seen = visible[:, None, None]  # [B, 1, 1, Q, S]
  logits = jnp.where(seen, logits, MASK_VALUE)
  weights = jnp.where(seen, jnp.exp(logits - logits.max(-1, keepdims=True)), 0.0)
  denom = weights.sum(-1)  # [B, Hkv, G, Q]
  # Output [B, Hkv, G, Q, D] keeps V untransposed in XLA's dot; the transpose after is tiny.
  out = jnp.einsum('bkgqs,kbsd->bkgqd', weights, v.astype(jnp.float32), preferred_element_type=jnp.float32)
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  return out.transpose(0, 3, 1, 2, 4)
