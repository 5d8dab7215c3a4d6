"""Paged KV cache: a page pool per attention layer, block tables per sequence.

Device side (`KVCache`, a pytree donated to every step):
  k_pages, v_pages: per layer `[K, P, page_size, H]` (K kv heads, P pages).
  block_tables: `[B, pages_per_seq]` int32, page ids of each sequence in order.
  lengths: `[B]` int32, tokens already in the cache for each sequence.

Page 0 is the null page: never handed out, it absorbs the writes of padded
query rows, so padding never touches a live page. Rollback is by length: a
verify step that rejects drafts just does not advance `lengths`; the stale
slots are masked out by length and overwritten later.

Hybrid models (Gated DeltaNet layers) also carry recurrent state, which cannot
be truncated. Each such layer keeps S = max draft + 1 state slots per row:
  ssm: per layer `[B, S, N, Dk, Dv]` float32, conv: per layer `[B, S, W - 1, C]`,
  state_slot: `[B]` int32, the slot that holds each row's current state.
A step over T <= S positions writes the state after position t into slot t;
committing the first `a` positions is `state_slot = a - 1` (rollback is slot
selection, no copy). A longer prefill chunk writes only its final state, into
slot 0. The slots cost S times one state: see `state_bytes`.

Host side (`PageAllocator`): a free list of page ids with allocate / extend /
free and a clear error when the pool runs out.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import OutOfPagesError

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k_pages: tuple[jax.Array, ...]  # per layer [K, P, page_size, H]
  v_pages: tuple[jax.Array, ...]  # per layer [K, P, page_size, H]
  block_tables: jax.Array  # [B, pages_per_seq] int32
  lengths: jax.Array  # [B] int32
  ssm: tuple[jax.Array, ...] = ()  # per recurrent layer [B, S, N, Dk, Dv]
  conv: tuple[jax.Array, ...] = ()  # per recurrent layer [B, S, W - 1, C]
  state_slot: jax.Array | None = None  # [B] int32, or None without recurrent layers

  @property
  def num_slots(self) -> int:
    return self.ssm[0].shape[1] if self.ssm else 0

  def commit(self, lengths: jax.Array, fed: jax.Array) -> KVCache:
    """Keeps the first `fed` [B] positions of the last step: new lengths, state slot."""
    if self.state_slot is None:
      return dataclasses.replace(self, lengths=lengths)
    return dataclasses.replace(self, lengths=lengths, state_slot=jnp.maximum(fed - 1, 0).astype(jnp.int32))

  def commit_path(self, start: jax.Array, path: jax.Array, count: jax.Array) -> KVCache:
    """Keeps an accepted tree path: moves slot `start + path[:, j]` to `start + j` for j < `count`.

    start [B]: the cache length before the tree step (the root's slot);
    path [B, D + 1]: the accepted nodes' block indices (`path[:, 0]` = 0, the
    root); count [B]: how many path entries to keep. The moved keys were
    rotated at position `start + j` already (a node at depth j sits there), so
    the move is a copy. Lengths become `start + count`.
    """
    if self.state_slot is not None:
      raise ValueError('tree paths cannot be committed on recurrent-state caches')
    d = path.shape[1]
    keep = jnp.arange(d)[None, :] < count[:, None]
    src = token_slots(self.block_tables, start[:, None] + path, keep, self.page_size)
    dst = token_slots(self.block_tables, start[:, None] + jnp.arange(d)[None, :], keep, self.page_size)
    move = lambda pages: pages.at[:, dst[0], dst[1]].set(pages[:, src[0], src[1]])
    return dataclasses.replace(
        self,
        k_pages=tuple(map(move, self.k_pages)),
        v_pages=tuple(map(move, self.v_pages)),
        lengths=(start + count).astype(jnp.int32),
    )

  @property
  def page_size(self) -> int:
    return self.k_pages[0].shape[2]

  @property
  def capacity(self) -> int:
    """Tokens one sequence can hold with its block table width."""
    return self.block_tables.shape[1] * self.page_size

  @classmethod
  def create(
      cls,
      layer_shapes: list[tuple[int, int]],  # per layer (kv heads, head dim)
      *,
      num_pages: int,
      page_size: int,
      block_tables: np.ndarray,  # [B, pages_per_seq]
      dtype=jnp.float32,
      state_shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = (),  # per recurrent layer (ssm, conv) per row
      num_slots: int = 1,
  ) -> KVCache:
    k = tuple(jnp.zeros((kv, num_pages, page_size, h), dtype) for kv, h in layer_shapes)
    v = tuple(jnp.zeros((kv, num_pages, page_size, h), dtype) for kv, h in layer_shapes)
    bt = jnp.asarray(block_tables, jnp.int32)
    b = bt.shape[0]
    ssm = tuple(jnp.zeros((b, num_slots, *s), jnp.float32) for s, _ in state_shapes)
    conv = tuple(jnp.zeros((b, num_slots, *c), dtype) for _, c in state_shapes)
    slot = jnp.zeros((b,), jnp.int32) if state_shapes else None
    return cls(k, v, bt, jnp.zeros((b,), jnp.int32), ssm, conv, slot)


def state_bytes(cache: KVCache) -> int:
  """Bytes of the recurrent state slots (all layers, rows and slots)."""
  return sum(x.size * x.dtype.itemsize for x in cache.ssm + cache.conv)


def step_layout(
    cache: KVCache, query_lens: jax.Array, t: int  # query_lens [B]
) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
  """Positions [B, T], page slots of a T-token step, and key counts [B] after it."""
  positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
  valid = jnp.arange(t)[None, :] < query_lens[:, None]
  slots = token_slots(cache.block_tables, positions, valid, cache.page_size)
  return positions, slots, cache.lengths + query_lens


def token_slots(
    block_tables: jax.Array,  # [B, pages_per_seq]
    positions: jax.Array,  # [B, T] absolute positions
    valid: jax.Array,  # [B, T] bool
    page_size: int,
) -> tuple[jax.Array, jax.Array]:
  """Page id and in-page slot of each token; invalid tokens go to the null page."""
  page_idx = jnp.clip(positions // page_size, 0, block_tables.shape[1] - 1)
  pages = jnp.take_along_axis(block_tables, page_idx, axis=1)
  pages = jnp.where(valid, pages, NULL_PAGE)
  return pages, positions % page_size


def write_kv(
    pages: jax.Array,  # [K, P, page_size, H]
    new: jax.Array,  # [B, T, K, H]
    page_ids: jax.Array,  # [B, T]
    slots: jax.Array,  # [B, T]
) -> jax.Array:
  """Scatters T new keys (or values) per sequence into the page pool."""
  return pages.at[:, page_ids, slots].set(jnp.moveaxis(new, 2, 0).astype(pages.dtype))


class PageAllocator:
  """Host-side free list of page ids (page 0 is reserved as the null page)."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2:
      raise OutOfPagesError(f'a KV cache needs at least 2 pages (one is the null page), got {num_pages}')
    self.num_pages = num_pages
    self.page_size = page_size
    self._free = list(range(num_pages - 1, 0, -1))
    self._owned: dict[int, list[int]] = {}

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def pages_for(self, num_tokens: int) -> int:
    return math.ceil(num_tokens / self.page_size)

  def allocate(self, seq_id: int, num_tokens: int, shared: list[int] = ()) -> list[int]:
    """Reserves pages for `num_tokens` tokens of a new sequence whose first pages are `shared` (pages the
    prefix cache holds, not taken from the free list)."""
    if seq_id in self._owned:
      raise ValueError(f'sequence {seq_id} already holds pages')
    self._owned[seq_id] = list(shared)
    return self.extend(seq_id, num_tokens)

  def extend(self, seq_id: int, num_tokens: int) -> list[int]:
    """Grows a sequence's pages to hold `num_tokens` tokens in all."""
    owned = self._owned[seq_id]
    need = self.pages_for(num_tokens) - len(owned)
    if need > len(self._free):
      raise OutOfPagesError(
          f'KV cache out of pages: sequence {seq_id} needs {need} more pages of {self.page_size} tokens '
          f'for {num_tokens} tokens, {len(self._free)} of {self.num_pages - 1} are free '
          '(raise num_pages or lower the batch / max_new_tokens)'
      )
    for _ in range(max(need, 0)):
      owned.append(self._free.pop())
    return list(owned)

  def free(self, seq_id: int) -> None:
    self.give(self.drop(seq_id))

  def drop(self, seq_id: int) -> list[int]:
    """Forgets a sequence and returns its pages, freeing none (the caller frees or caches each: `give`)."""
    return self._owned.pop(seq_id)

  def swap(self, seq_id: int, index: int, page: int) -> int:
    """Puts `page` (held elsewhere, e.g. a cached copy of the same positions) at `index` of a sequence's pages;
    returns the page it replaces, which the caller frees or caches."""
    owned = self._owned[seq_id]
    old, owned[index] = owned[index], page
    return old

  def give(self, pages: list[int]) -> None:
    """Returns pages to the free list."""
    self._free.extend(reversed(pages))

  def block_table(self, seq_ids: list[int], pages_per_seq: int) -> np.ndarray:
    """`[len(seq_ids), pages_per_seq]` int32 block table, padded with the null page."""
    table = np.full((len(seq_ids), pages_per_seq), NULL_PAGE, np.int32)
    for row, seq_id in enumerate(seq_ids):
      owned = self._owned.get(seq_id, [])
      if len(owned) > pages_per_seq:
        raise ValueError(f'sequence {seq_id} holds {len(owned)} pages, more than {pages_per_seq}')
      table[row, : len(owned)] = owned
    return table
