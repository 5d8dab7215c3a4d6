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


class PrefixIndex:
  """Host-side index from prefix keys to cached page ids."""

  def __init__(self, page_size: int, identity: str, key_lag: int = 0):
    self.page_size = page_size
    self.key_lag = key_lag
    self.root = hashlib.sha256(f'specjax-prefix|{identity}|page={page_size}|lag={key_lag}'.encode()).digest()
    self._by_key: dict[bytes, _Entry] = {}
    self._key_of: dict[int, bytes] = {}  # page id -> key
    self._tick = 0
    self._unheld = 0  # entries with no reference
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

  def match(self, tokens: Sequence[int], max_pages: int) -> list[tuple[bytes, int]]:
    """(key, page) of the longest cached prefix of `tokens`, at most `max_pages` pages; takes no reference."""
    out = []
    for key in self.chain(tokens, min(max_pages, self.full_pages(len(tokens)))):
      entry = self._by_key.get(key)
      if entry is None:
        break
      out.append((key, entry.page))
    return out

  def acquire(self, keys: Sequence[bytes]) -> None:
    self._tick += 1
    for key in keys:
      entry = self._by_key[key]
      self._unheld -= entry.refs == 0
      entry.refs += 1
      entry.tick = self._tick

  def holds(self, page: int) -> bool:
    return page in self._key_of

  def release(self, page: int) -> None:
    entry = self._by_key[self._key_of[page]]
    if entry.refs <= 0:
      raise AssertionError(f'page {page} released more often than acquired')
    entry.refs -= 1
    self._unheld += entry.refs == 0

  def insert(self, key: bytes, parent: bytes, page: int, parent_page: int | None = None) -> bool:
    """Caches `page` under `key` with one reference (its writer's, which holds `parent_page`, the page before it).

    False when the key is cached already (the writer keeps its own copy), or the parent key is not cached as
    `parent_page`: so every cached page's ancestors are pages its holders hold too, and the pages no request
    holds are whole subtrees, all of them evictable.
    """
    if key in self._by_key or page in self._key_of:
      return False
    if parent != self.root and (parent not in self._by_key or self._by_key[parent].page != parent_page):
      return False
    self._tick += 1
    self._by_key[key] = _Entry(page, parent if parent != self.root else None, refs=1, tick=self._tick)
    self._key_of[page] = key
    if parent in self._by_key:
      self._by_key[parent].children += 1
    return True

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
