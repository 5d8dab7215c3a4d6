"""Prefix cache: full KV pages shared read-only between requests, found by a hash chain over their tokens.

A page's key hashes its parent page's key with the tokens it holds, so a key
names the whole prefix up to the page's end; the root key names everything
else that changes what a page holds (the model and its weights, dtype, page
size, the drafter whose caches share the page ids). `key_lag` tokens after
the page enter its key too: a drafter that pairs each position with the next
token (EAGLE-3, MTP heads) has written the page's last entry from the first
token of the next page.

Entries are refcounted: every request whose block table holds a page holds a
reference. A page is only ever read through the index: requests write past
their shared prefix into pages of their own, and a page joins the index only
once it lies wholly below what its request has committed (speculative writes
and rollback touch positions at or past a request's length). Unreferenced
pages stay cached until the pool runs short; then the least recently used
leaves (pages no cached page extends) are evicted first.

Copy-on-write: every entry keeps the tokens its key covers, so a request that
diverges inside a cached page, or whose prompt continues into a cached partly
filled page (a leaver's last page, cached with the positions its caches hold
there), finds it among its parent's children (`partial`) and copies it into a
page of its own: the copy's first positions are its prefix, the rest it
overwrites. A partly filled page is never held, only copied.

Hybrid targets: an entry may carry a snapshot of the recurrent state after its
page, or after a partly filled page's held positions (a slot of a device pool
the scheduler owns, `snapshot_slots` of them). A hybrid row starts only where
its match ends on a snapshot: a full page's (`match(..., snapshots=True)`), or
a partly filled page's whose every held position it repeats (`partial(...,
snapshots=True)`: a chat's next turn, past the last answer). A snapshot is read
once, at admission, so none is ever held: when the pool is full the least
recently used entry's snapshot is dropped, and an evicted entry frees its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class _Entry:
  page: int
  parent: bytes | None
  refs: int = 0
  children: int = 0
  tick: int = 0
  tokens: np.ndarray | None = None  # the tokens its key covers (the page's, then the key lag's)
  valid: int = 0  # positions of the page its caches hold (a full page: page_size)
  snap: int = -1  # its recurrent-state snapshot's slot in the pool (-1: none)


class PrefixIndex:
  """Host-side index from prefix keys to cached page ids."""

  def __init__(self, page_size: int, identity: str, key_lag: int = 0, snapshot_slots: int = 0):
    self.page_size = page_size
    self.key_lag = key_lag
    self.root = hashlib.sha256(f'specjax-prefix|{identity}|page={page_size}|lag={key_lag}'.encode()).digest()
    self._by_key: dict[bytes, _Entry] = {}
    self._key_of: dict[int, bytes] = {}  # page id -> key
    self._tick = 0
    self._unheld = 0  # entries with no reference
    self._kids: dict[bytes, set[bytes]] = {}  # parent key (the root for first pages) -> child keys
    self._free_snaps = list(range(snapshot_slots - 1, -1, -1))
    self.snapshot_slots = snapshot_slots
    self.evictions = 0

  # -- keys

  def full_pages(self, num_tokens: int) -> int:
    """Pages of a `num_tokens`-token sequence that can have a key (the lag's tokens must exist)."""
    return max(num_tokens - self.key_lag, 0) // self.page_size

  def chain(self, tokens: Sequence[int], num_pages: int) -> list[bytes]:
    """Keys of the first `num_pages` pages of `tokens`."""
    keys, parent, ps = [], self.root, self.page_size
    arr = np.asarray(tokens, np.int32)
    for i in range(num_pages):
      parent = hashlib.sha256(parent + arr[i * ps : (i + 1) * ps + self.key_lag].tobytes()).digest()
      keys.append(parent)
    return keys

  # -- lookup and references

  def match(self, tokens: Sequence[int], max_pages: int, snapshots: bool = False) -> list[tuple[bytes, int]]:
    """(key, page) of the longest cached prefix of `tokens`, at most `max_pages` pages; takes no reference.

    `snapshots=True` (hybrid targets): the longest that ends on a page with a recurrent-state snapshot."""
    out = []
    for key in self.chain(tokens, min(max_pages, self.full_pages(len(tokens)))):
      entry = self._by_key.get(key)
      if entry is None:
        break
      out.append((key, entry.page))
    return self.upto_snapshot(out) if snapshots else out

  def upto_snapshot(self, hit: Sequence[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
    """The longest start of a match `hit` that ends on a page with a recurrent-state snapshot."""
    n = len(hit)
    while n and self._by_key[hit[n - 1][0]].snap < 0:
      n -= 1
    return list(hit[:n])

  def partial(
      self, tokens: Sequence[int], hit: Sequence[tuple[bytes, int]], limit: int, snapshots: bool = False
  ) -> tuple[bytes, int, int]:
    """(key, page, n): the cached page after `hit` whose first n positions `tokens` repeats, n <= `limit`, the
    longest (n = 0: none). The caller copies the page (copy-on-write): it is never shared as it is.

    `snapshots=True` (hybrid targets): only a page with a snapshot, all of whose held positions `tokens` repeats
    (the recurrent state exists there alone)."""
    start = len(hit) * self.page_size
    want = np.asarray(tokens[start : start + self.page_size + self.key_lag], np.int32)
    best = (b'', 0, 0)
    for key in self._kids.get(hit[-1][0] if hit else self.root, ()):
      entry = self._by_key[key]
      m = min(len(want), len(entry.tokens))
      same = int(np.argmin(np.append(want[:m] == entry.tokens[:m], False)))  # common prefix
      n = min(same - self.key_lag, entry.valid, limit)
      if snapshots and (entry.snap < 0 or n < entry.valid):
        continue
      if n > best[2]:
        best = (key, entry.page, n)
    return best

  def acquire(self, keys: Sequence[bytes]) -> None:
    self._tick += 1
    for key in keys:
      entry = self._by_key[key]
      self._unheld -= entry.refs == 0
      entry.refs += 1
      entry.tick = self._tick

  def page_of(self, key: bytes) -> int | None:
    entry = self._by_key.get(key)
    return None if entry is None else entry.page

  def holds(self, page: int) -> bool:
    return page in self._key_of

  def release(self, page: int) -> None:
    entry = self._by_key[self._key_of[page]]
    if entry.refs <= 0:
      raise AssertionError(f'page {page} released more often than acquired')
    entry.refs -= 1
    self._unheld += entry.refs == 0

  def insert(
      self, key: bytes, parent: bytes, page: int, parent_page: int | None = None, tokens=None, valid: int = 0
  ) -> bool:
    """Caches `page` under `key` with one reference (its writer's, which holds `parent_page`, the page before it).

    False when the key is cached already (the writer keeps its own copy), or the parent key is not cached as
    `parent_page`: so every cached page's ancestors are pages its holders hold too, and the pages no request
    holds are whole subtrees, all of them evictable. `tokens`: those the key covers (`valid` positions of the
    page are held; default a full page), for copy-on-write lookups.
    """
    if key in self._by_key or page in self._key_of:
      return False
    if parent != self.root and (parent not in self._by_key or self._by_key[parent].page != parent_page):
      return False
    self._tick += 1
    tokens = None if tokens is None else np.asarray(tokens, np.int32)
    entry = _Entry(page, parent if parent != self.root else None, refs=1, tick=self._tick, tokens=tokens)
    entry.valid = valid or self.page_size
    self._by_key[key] = entry
    self._key_of[page] = key
    if parent in self._by_key:
      self._by_key[parent].children += 1
    if tokens is not None:
      self._kids.setdefault(parent, set()).add(key)
    return True

  def insert_partial(self, parent: bytes, page: int, parent_page: int | None, tokens, valid: int) -> bytes | None:
    """Caches a partly filled last page (`valid` positions held; `tokens` from the page's start, the key lag's
    included) with its writer's one reference; it is only ever copied, never held. Returns its key (None: not
    cached)."""
    tokens = np.asarray(tokens, np.int32)
    key = hashlib.sha256(parent + b'|partial|' + tokens.tobytes() + bytes([valid % 256])).digest()
    cached = 0 < valid < self.page_size and self.insert(key, parent, page, parent_page, tokens, valid)
    return key if cached else None

  # -- recurrent-state snapshots

  def snapshot(self, key: bytes) -> int:
    """The pool slot of the snapshot after `key`'s page (-1: none)."""
    entry = self._by_key.get(key)
    return -1 if entry is None else entry.snap

  def new_snapshot(self) -> int:
    """A free pool slot (dropping the least recently used entry's snapshot when none is free; -1: no pool)."""
    if not self._free_snaps:
      owners = [(e.tick, k) for k, e in self._by_key.items() if e.snap >= 0]
      if not owners:
        return -1
      self.drop_snapshot(self._by_key[min(owners)[1]])
    return self._free_snaps.pop()

  def attach(self, key: bytes, slot: int) -> bool:
    """Gives `key`'s entry (a full page, or a partly filled one: the state after its held positions) the snapshot
    in `slot`; False (the caller frees the slot) when it is not cached or has one."""
    entry = self._by_key.get(key)
    if entry is None or entry.snap >= 0:
      return False
    entry.snap = slot
    return True

  def free_snapshot(self, slot: int) -> None:
    self._free_snaps.append(slot)

  def drop_snapshot(self, entry: _Entry) -> None:
    if entry.snap >= 0:
      self._free_snaps.append(entry.snap)
      entry.snap = -1

  @property
  def snapshots(self) -> int:
    return sum(e.snap >= 0 for e in self._by_key.values())

  # -- eviction

  @property
  def cached_pages(self) -> int:
    return len(self._by_key)

  @property
  def evictable(self) -> int:
    """Pages no request holds (they can all go, leaves first)."""
    return self._unheld

  def evict(self, n: int) -> list[int]:
    """Frees up to `n` unreferenced pages, least recently used leaves first; returns their ids."""
    freed = []
    while len(freed) < n:
      leaves = [(e.tick, k) for k, e in self._by_key.items() if e.refs == 0 and e.children == 0]
      if not leaves:
        break
      _, key = min(leaves)
      entry = self._by_key.pop(key)
      del self._key_of[entry.page]
      if entry.parent is not None:
        self._by_key[entry.parent].children -= 1
      self._kids.get(entry.parent or self.root, set()).discard(key)
      self.drop_snapshot(entry)
      freed.append(entry.page)
      self._unheld -= 1
      self.evictions += 1
    return freed

  def check(self) -> None:
    """Invariants (tests): refs and child counts consistent, pages unique."""
    assert len(self._key_of) == len(self._by_key)
    children = {k: 0 for k in self._by_key}
    for key, e in self._by_key.items():
      assert e.refs >= 0 and self._key_of[e.page] == key
      if e.parent is not None:
        children[e.parent] += 1
    assert all(self._by_key[k].children == c for k, c in children.items())
    assert self._unheld == sum(e.refs == 0 for e in self._by_key.values())
    kids = [k for ks in self._kids.values() for k in ks]
    assert len(kids) == len(set(kids)) and set(kids) <= set(self._by_key)
    snaps = [e.snap for e in self._by_key.values() if e.snap >= 0]
    assert len(snaps) == len(set(snaps)) and not set(snaps) & set(self._free_snaps)
    assert all(e.refs == 0 for e in self._by_key.values() if e.valid < self.page_size)  # partly filled: copied
