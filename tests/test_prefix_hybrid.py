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
from specjax.sampling import SamplingParams
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
  monkeypatch.setattr(PrefixIndex, 'upto_snapshot', lambda self, hit: list(hit))
  assert mutant_outputs(target, prompts) != want + want


# -- copy-on-write (dense target)


def chat(engine, prompts_after, prefix_cache=True, num_draft=0, sampling=None):
  """A prompt, then prompts continuing it (its answer, more text): returns (results, metrics, whether the cached
  pages kept their bytes)."""
  sampling = sampling or SamplingParams()
  with Scheduler(engine, max_slots=2, max_seq_len=160, num_draft=num_draft, prefix_cache=prefix_cache) as s:
    first = served(s, [Request(prompts_after[0], MAX_NEW, sampling)])[0]
    cached = {p: np.asarray(s.state.cache.k_pages[0][:, p]) for p in s.prefix._key_of} if prefix_cache else {}
    rest = served(s, [Request(p(first.tokens), MAX_NEW, sampling) for p in prompts_after[1:]])
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


# -- a hybrid chat's next turn: the leaver's state snapshotted where its committed positions end


def hybrid_chat_case(offset):
  """The tiny Qwen3.5 hybrid, a prompt ending `offset` tokens into a page, and its next turn (the prompt, the
  answer, more text). The leaver holds len(prompt) + MAX_NEW - 1 positions (its last token was never fed)."""
  target = specjax.load(f'{FIXTURES}/tiny_qwen3_5')
  tok = target.tokenizer
  first = tok.encode(SYSTEM + QUESTIONS[1])
  first = first[: len(first) // PAGE * PAGE + offset]
  return target, [first, lambda out: first + out + tok.encode(' Go on.')]


@pytest.mark.parametrize('kind', [None, 'ngram'])
@pytest.mark.parametrize('offset', [2, 1])  # the leaver's positions end inside a page (copied), on a page boundary
def test_a_hybrid_chats_next_turn_starts_past_the_answer(kind, offset):
  """A leaving hybrid row's recurrent state is snapshotted where its positions end (on its partly filled last
  page, or its last full page): the next turn restores it, copies that page, prefills only its new tokens, and
  gives the tokens of the cache off; the cached pages keep their bytes. The n-gram cases sample (T = 0.3, seeded:
  draws are keyed by seed, request and position, so a row restored from the leaver's state draws what a row
  recomputed from scratch draws) and verify the next turn's drafts by rejection sampling on the restored state
  (the tiny random model rejects them: residual draws)."""
  target, after = hybrid_chat_case(offset)
  engine = specjax.Engine(target, page_size=PAGE, drafter=make_drafter(kind, target) if kind else None, max_draft=3)
  options = dict(num_draft=3, sampling=SamplingParams(temperature=0.3, seed=6)) if kind else {}
  off, _, _ = chat(engine, after, prefix_cache=False, **options)
  on, metrics, kept = chat(engine, after, **options)
  assert [r.tokens for r in on] == [r.tokens for r in off]
  if kind:  # drafts verified on the restored turn
    assert on[1].stats.drafted > 0, on[1].stats
  assert len(on[0].tokens) == MAX_NEW  # no early EOS: the leaver's positions end where the case says
  history = len(after[0]) + MAX_NEW - 1
  assert metrics['prefix_hit_tokens'] == history and metrics['prefix_restored'] == 1, metrics
  assert metrics['prefix_copied_pages'] == (history % PAGE > 0) and kept, metrics
  assert metrics['free_pages'] == metrics['total_pages']


def test_a_leavers_state_not_snapshotted_is_caught(monkeypatch):
  """Power check: attaching the pool slot without copying the leaver's state into it (the next turn restores
  whatever the slot held) changes the outputs."""
  target, after = hybrid_chat_case(2)
  want, _, _ = chat(specjax.Engine(target, page_size=PAGE), after, prefix_cache=False)

  def attach_only(self, job, key):
    slot = self.prefix.new_snapshot()
    assert self.prefix.attach(key, slot)

  monkeypatch.setattr(Scheduler, '_leave_snapshot', attach_only)
  got, metrics, _ = chat(specjax.Engine(target, page_size=PAGE), after)
  assert metrics['prefix_restored'] == 1 and [r.tokens for r in got] != [r.tokens for r in want]


# -- the refcount model, with snapshots and partly filled pages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(['join', 'leave', 'evict']), st.integers(0, 10**6)), max_size=40))
def test_random_joins_leaves_and_evictions_keep_snapshots_sound(ops):
  """The hybrid scheduler's bookkeeping against a model: a join matches only up to a snapshot and takes new
  snapshots at page boundaries it prefills (held by it until its pages join the index); a leaver caches its
  pages, attaches its snapshots (or frees them), caches its partly filled last page and may snapshot its state
  there (or on its last full page), which a later join copies past; evictions free their
  snapshots. Each pool slot is in one place only (free, attached, or one live request's), references match the
  live requests, a held page's ancestors are held, and partly filled pages are never held."""
  ps, pool, num_snaps = 2, 24, 5
  index, alloc = PrefixIndex(page_size=ps, identity='m', snapshot_slots=num_snaps), PageAllocator(pool, ps)
  live: dict[int, tuple[list[int], list[int], dict[int, int]]] = {}  # seq -> (tokens, pages, pending snapshots)
  left: list[list[int]] = []  # leavers' tokens: a join may continue one (a chat's next turn)
  for n, (op, seed) in enumerate(ops):
    rng = random.Random(seed)
    if op == 'join':
      tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
      if left and rng.random() < 0.5:
        tokens = rng.choice(left) + tokens[:4]
      hit = index.match(tokens, (len(tokens) - 1) // ps, snapshots=True)
      assert not hit or index.snapshot(hit[-1][0]) >= 0
      full = index.match(tokens, (len(tokens) - 1) // ps)
      cow = index.partial(tokens, full, len(tokens) - 1 - len(full) * ps, snapshots=True)
      if cow[2]:  # a partly filled page with a snapshot after all its positions: copied, the row starts past it
        assert index.snapshot(cow[0]) >= 0 and cow[2] == index._by_key[cow[0]].valid
        hit = full
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
      left.append(tokens)
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
      last = keys[-1] if keys else None  # the leaver's state after its positions: on its last page, sometimes
      if len(tokens) % ps and full < len(pages):
        last = index.insert_partial(parent, pages[full], parent_page, tokens[full * ps :], len(tokens) % ps)
      if last is not None and rng.random() < 0.5 and (slot := index.new_snapshot()) >= 0:
        if not index.attach(last, slot):
          index.free_snapshot(slot)
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
