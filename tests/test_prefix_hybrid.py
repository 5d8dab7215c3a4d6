"""The prefix cache on a hybrid target (recurrent-state snapshots) and copy-on-write of partly shared pages."""

import random

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import specjax
from specjax.cache.paged import PageAllocator
from specjax.cache.prefix import PrefixIndex
from specjax.drafters import make_drafter
from specjax.engine import slots
from specjax.engine.requests import Request
from specjax.engine.scheduler import Scheduler
from conftest import FIXTURES
from test_prefix_cache import QUESTIONS, SYSTEM
from test_scheduler import served

PAGE, EVERY = 4, 2  # pages of 4 tokens, a snapshot every 2 pages: boundaries every 8 tokens
MAX_NEW = 12


@pytest.fixture(scope='module')
def hybrid():
  """The tiny Qwen3.5 (MTP head loaded), prompts diverging at, before and after a snapshot boundary and inside
  a page, and their offline greedy outputs."""
  target = specjax.load(f'{FIXTURES}/tiny_qwen3_5', mtp=True)
  tok = target.tokenizer
  first = tok.encode(SYSTEM + SYSTEM + QUESTIONS[2])
  b = len(tok.encode(SYSTEM)) // 8 * 8 + 8  # a boundary inside the shared part
  prompts = [first] + [tok.encode(SYSTEM + SYSTEM + q) for q in QUESTIONS[:2]]
  prompts += [first[:cut] + tok.encode(' And why?') for cut in (b - 1, b, b + 1, b + 2, b + 4)]
  want = [r.tokens for r in specjax.Engine(target, page_size=PAGE).generate(prompts, max_new_tokens=MAX_NEW)[0]]
  return target, prompts, want


def serve_twice(engine, prompts, num_draft=0):
  """The first prompt alone (it fills the cache), the rest at once, then all again: (results per wave, metrics)."""
  with Scheduler(engine, max_slots=4, max_seq_len=128, num_draft=num_draft, prefix_snapshot_every=EVERY) as s:
    first = served(s, [Request(prompts[0], MAX_NEW)])
    first += served(s, [Request(p, MAX_NEW) for p in prompts[1:]])
    again = served(s, [Request(p, MAX_NEW) for p in prompts])
    return first, again, s.metrics()


@pytest.mark.parametrize('kind', [None, 'mtp', 'ngram'])
def test_hybrid_outputs_equal_with_the_cache(hybrid, kind):
  """AR, the MTP head and n-gram on the hybrid: rows started from restored snapshots (and rolled back after
  rejected drafts) give the offline greedy tokens, in the wave that fills the cache and in the repeat."""
  target, prompts, want = hybrid
  drafter = make_drafter(kind, target) if kind else None
  engine = specjax.Engine(target, page_size=PAGE, drafter=drafter, max_draft=3)
  first, again, metrics = serve_twice(engine, prompts, 3 if kind else 0)
  assert metrics['prefix_cache'].startswith('on')
  assert [r.tokens for r in first] == want and [r.tokens for r in again] == want
  assert metrics['prefix_restored'] >= len(prompts) + 3 and metrics['prefix_snapshots'] > 0, metrics
  assert metrics['prefix_hit_tokens'] > 0.6 * metrics['prefix_lookup_tokens'], metrics
  assert metrics['free_pages'] == metrics['total_pages']
  if kind:  # drafts rejected on restored rows (the tiny random model accepts few): rollback from a restored state
    assert sum(r.stats.drafted - r.stats.accepted for r in again) > 0


def mutant_outputs(target, prompts):
  engine = specjax.Engine(target, page_size=PAGE)  # a fresh engine: its executables compile the mutant
  first, again, _ = serve_twice(engine, prompts)
  return [r.tokens for r in first + again]


def test_a_wrong_snapshot_is_caught(hybrid, monkeypatch):
  """Power check: restoring the pool's next slot instead of the matched page's snapshot changes the outputs."""
  target, prompts, want = hybrid
  restore = slots.restore_snapshots
  shifted = lambda cache, pool, snaps: restore(cache, pool, jnp.where(snaps >= 0, (snaps + 1) % 8, -1))
  monkeypatch.setattr(slots, 'restore_snapshots', shifted)
  assert mutant_outputs(target, prompts) != want + want


def test_starting_past_pages_without_their_state_is_caught(hybrid, monkeypatch):
  """Power check: a hybrid row that starts at its longest page match, not at the last snapshot at or before it
  (skipping the recurrent update of the tokens between), changes the outputs."""
  target, prompts, want = hybrid
  match = PrefixIndex.match
  monkeypatch.setattr(PrefixIndex, 'match', lambda self, tokens, n, snapshots=False: match(self, tokens, n))
  assert mutant_outputs(target, prompts) != want + want


# -- copy-on-write (dense target)


def chat(engine, prompts_after, prefix_cache=True):
  """A prompt, then prompts continuing it (its answer, more text): returns (results, metrics, index pages)."""
  with Scheduler(engine, max_slots=2, max_seq_len=160, num_draft=0, prefix_cache=prefix_cache) as s:
    first = served(s, [Request(prompts_after[0], MAX_NEW)])[0]
    cached = {p: np.asarray(s.state.cache.k_pages[0][:, p]) for p in s.prefix._key_of} if prefix_cache else {}
    rest = served(s, [Request(p(first.tokens), MAX_NEW) for p in prompts_after[1:]])
    valid = {p: s.prefix._by_key[k].valid for p, k in s.prefix._key_of.items()} if prefix_cache else {}
    kept = all(
        np.array_equal(np.asarray(s.state.cache.k_pages[0][:, p, : valid[p]]), x[:, : valid[p]])
        for p, x in cached.items()
        if p in valid
    )
    return [first] + rest, s.metrics(), kept


def cow_case():
  target = specjax.load(f'{FIXTURES}/tiny_gemma3')
  tok = target.tokenizer
  first = tok.encode(SYSTEM + QUESTIONS[0])
  first = first[: len(first) // PAGE * PAGE + 2]  # ends 2 tokens into a page: its last page is partly filled
  after = [
      first,
      lambda out: first + out + tok.encode(' Go on.'),  # continues into the leaver's partly filled last page
      lambda out: first[:-5] + tok.encode(' Or not?'),  # diverges inside a full cached page
  ]
  prompts = [first, after[1]([]), after[2]([])]
  return target, after, prompts


def test_copy_on_write_of_partly_shared_pages():
  """A prompt continuing into a leaver's partly filled last page, and one diverging inside a full page, copy that
  page and write their own: outputs equal the cache off, and the cached pages keep their bytes."""
  target, after, _ = cow_case()
  engine = specjax.Engine(target, page_size=PAGE)
  off, _, _ = chat(engine, after, prefix_cache=False)
  on, metrics, kept = chat(engine, after)
  assert [r.tokens for r in on] == [r.tokens for r in off]
  assert metrics['prefix_copied_pages'] == 2 and kept, metrics
  assert metrics['free_pages'] == metrics['total_pages']


def test_a_page_shared_without_its_copy_is_caught(monkeypatch):
  """Power check: skipping the copy (the row's own page is not the cached page's bytes) changes the outputs."""
  target, after, _ = cow_case()
  want, _, _ = chat(specjax.Engine(target, page_size=PAGE), after, prefix_cache=False)
  monkeypatch.setattr(slots, 'copy_pages', lambda state, copies: state)
  got, metrics, _ = chat(specjax.Engine(target, page_size=PAGE), after)
  assert metrics['prefix_copied_pages'] == 2 and [r.tokens for r in got] != [r.tokens for r in want]


# -- the refcount model, with snapshots and partly filled pages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(['join', 'leave', 'evict']), st.integers(0, 10**6)), max_size=40))
def test_random_joins_leaves_and_evictions_keep_snapshots_sound(ops):
  """The hybrid scheduler's bookkeeping against a model: a join matches only up to a snapshot and takes new
  snapshots at page boundaries it prefills (held by it until its pages join the index); a leaver caches its
  pages, attaches its snapshots (or frees them) and caches its partly filled last page; evictions free their
  snapshots. Each pool slot is in one place only (free, attached, or one live request's), references match the
  live requests, a held page's ancestors are held, and partly filled pages are never held."""
  ps, pool, num_snaps = 2, 24, 5
  index, alloc = PrefixIndex(page_size=ps, identity='m', snapshot_slots=num_snaps), PageAllocator(pool, ps)
  live: dict[int, tuple[list[int], list[int], dict[int, int]]] = {}  # seq -> (tokens, pages, pending snapshots)
  for n, (op, seed) in enumerate(ops):
    rng = random.Random(seed)
    if op == 'join':
      tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
      hit = index.match(tokens, (len(tokens) - 1) // ps, snapshots=True)
      assert not hit or index.snapshot(hit[-1][0]) >= 0
      need = alloc.pages_for(len(tokens)) - len(hit)
      index.acquire([k for k, _ in hit])
      if need > alloc.free_pages:
        alloc.give(index.evict(need - alloc.free_pages))
      if need > alloc.free_pages:
        for _, page in hit:
          index.release(page)
        continue
      pages = alloc.allocate(n, len(tokens), shared=[p for _, p in hit])
      snaps = {}
      for boundary in range(len(hit) + 1, len(tokens) // ps + 1):  # pages it prefills past its match
        if rng.random() < 0.5 and (slot := index.new_snapshot()) >= 0:
          snaps[boundary] = slot
      live[n] = (tokens, pages, snaps)
    elif op == 'leave' and live:
      seq = rng.choice(sorted(live))
      tokens, pages, snaps = live.pop(seq)
      alloc.drop(seq)
      parent, parent_page = index.root, None
      full = index.full_pages(len(tokens))
      keys = index.chain(tokens, full)
      for i, (key, page) in enumerate(zip(keys, pages)):
        if not index.holds(page) and not index.insert(key, parent, page, parent_page, tokens[i * ps : (i + 1) * ps]):
          page = index.page_of(key)  # cached as another page: its later pages hang under that one
        parent, parent_page = key, page
      for boundary, slot in snaps.items():
        if not index.attach(keys[boundary - 1], slot):
          index.free_snapshot(slot)
      if len(tokens) % ps and full < len(pages):
        index.insert_partial(parent, pages[full], parent_page, tokens[full * ps :], len(tokens) % ps)
      for page in [p for p in pages if index.holds(p)]:
        index.release(page)
      alloc.give([p for p in pages if not index.holds(p)])
    elif op == 'evict':
      alloc.give(index.evict(seed % 4))
    index.check()
    held = [p for _, pages, _ in live.values() for p in pages]
    for page in set(held):
      if index.holds(page):
        assert index._by_key[index._key_of[page]].refs == held.count(page)
      else:
        assert held.count(page) == 1
    cached = set(index._key_of)
    assert alloc.free_pages + len(cached | set(held)) == pool - 1
    for entry in index._by_key.values():  # a held page's ancestors are held: what no request holds can all go
      up = entry
      while entry.refs and up.parent is not None:
        up = index._by_key[up.parent]
        assert up.refs > 0
    pending = [s for _, _, snaps in live.values() for s in snaps.values()]
    attached = [e.snap for e in index._by_key.values() if e.snap >= 0]
    assert sorted(pending + attached + index._free_snaps) == list(range(num_snaps))
