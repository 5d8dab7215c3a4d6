"""The prefix cache: the index's refcounts and eviction, and served outputs equal with and without it."""

import dataclasses
import random

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import specjax
from specjax import SpecjaxError
from specjax.cache.paged import PageAllocator
from specjax.cache.prefix import PrefixIndex
from specjax.drafters import make_drafter
from specjax.engine import slots
from specjax.engine.requests import Request
from specjax.engine.scheduler import Scheduler
from specjax.sampling import SamplingParams
from conftest import FIXTURES, perturbed_target
from test_scheduler import FAMILIES, served

SYSTEM = 'You are a careful assistant. Answer in one short sentence. '
QUESTIONS = ['What is two plus two?', 'Name a color.', 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n']

# -- the index


def test_match_walks_the_chain_and_stops_at_the_first_miss():
  index = PrefixIndex(page_size=2, identity='m')
  tokens = [1, 2, 3, 4, 5, 6, 7]
  keys = index.chain(tokens, 3)
  assert index.insert(keys[0], index.root, 10) and index.insert(keys[1], keys[0], 11, 10)
  assert not index.insert(keys[2], keys[1], 12, 99)  # its writer does not hold the parent page: refused
  assert [p for _, p in index.match(tokens, 3)] == [10, 11]
  assert [p for _, p in index.match([1, 2, 3, 9, 5], 3)] == [10]  # diverges inside page 1
  assert index.match([2, 2, 3, 4], 3) == []
  other = PrefixIndex(page_size=2, identity='another model')
  assert other.chain(tokens, 1) != keys[:1]  # the identity is in every key


def test_key_lag_puts_the_next_token_in_the_key():
  index = PrefixIndex(page_size=2, identity='m', key_lag=1)
  assert index.full_pages(4) == 1 and index.full_pages(5) == 2
  assert index.chain([1, 2, 3], 1) != index.chain([1, 2, 4], 1)


def test_eviction_takes_unreferenced_leaves_least_recent_first():
  index = PrefixIndex(page_size=1, identity='m')
  a, b = index.chain([1, 2], 2), index.chain([1, 3], 2)
  index.insert(a[0], index.root, 1)
  index.insert(a[1], a[0], 2, 1)
  index.acquire([b[0]])  # b[0] == a[0]: the second writer matched the first page
  index.insert(b[1], b[0], 3, 1)
  assert b[0] == a[0] and index.cached_pages == 3
  for page in (1, 2, 3):
    index.release(page)
  index.release(1)  # both writers held page 1
  index.acquire([a[0], a[1]])  # page 2's chain is used again: page 3 is now the least recent
  index.release(2)
  index.release(1)
  assert index.evict(1) == [3]
  assert index.evict(5) == [2, 1]  # the leaf before its parent
  assert index.cached_pages == 0 and index.evictions == 3


def test_a_referenced_page_is_never_evicted():
  index = PrefixIndex(page_size=1, identity='m')
  keys = index.chain([1, 2], 2)
  index.insert(keys[0], index.root, 1)
  index.insert(keys[1], keys[0], 2, 1)
  index.acquire(keys[:1])  # another request shares page 1
  index.release(1)
  index.release(2)  # the writer leaves
  assert index.evictable == 1 and index.evict(2) == [2]
  index.release(1)
  assert index.evictable == 1 and index.evict(2) == [1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(['join', 'leave', 'evict']), st.integers(0, 10**6)), max_size=40))
def test_random_joins_leaves_and_evictions_keep_refcounts_and_pages_sound(ops):
  """The scheduler's bookkeeping (match, acquire, allocate the rest, cache a leaver's full pages, release, evict
  when short) against a model: each cached page's references are the live requests holding it, a page is in one
  place only (free, cached, or one request's own), and no live request's page is ever evicted."""
  ps, pool = 2, 24
  index, alloc = PrefixIndex(page_size=ps, identity='m'), PageAllocator(pool, ps)
  live: dict[int, tuple[list[int], list[int]]] = {}  # seq -> (tokens, pages)
  for n, (op, seed) in enumerate(ops):
    rng = random.Random(seed)
    if op == 'join':
      tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]  # a 3-letter alphabet: prefixes repeat
      hit = index.match(tokens, (len(tokens) - 1) // ps)
      need = alloc.pages_for(len(tokens)) - len(hit)
      index.acquire([k for k, _ in hit])
      if need > alloc.free_pages:
        alloc.give(index.evict(need - alloc.free_pages))
      if need > alloc.free_pages:  # the model's pool is full of live pages: the join waits (here: is dropped)
        for _, page in hit:
          index.release(page)
        continue
      live[n] = (tokens, alloc.allocate(n, len(tokens), shared=[p for _, p in hit]))
    elif op == 'leave' and live:
      seq = rng.choice(sorted(live))
      tokens, pages = live.pop(seq)
      alloc.drop(seq)
      parent, parent_page = index.root, None
      for key, page in zip(index.chain(tokens, index.full_pages(len(tokens))), pages):
        if not index.holds(page):
          index.insert(key, parent, page, parent_page)
        parent, parent_page = key, page
      for page in [p for p in pages if index.holds(p)]:
        index.release(page)
      alloc.give([p for p in pages if not index.holds(p)])
    elif op == 'evict':
      alloc.give(index.evict(seed % 4))
    index.check()
    held = [p for _, pages in live.values() for p in pages]
    for page in set(held):
      if index.holds(page):
        assert index._by_key[index._key_of[page]].refs == held.count(page)
      else:
        assert held.count(page) == 1  # a request's own page is its alone
    cached = set(index._key_of)
    assert alloc.free_pages + len(cached | set(held)) == pool - 1  # nothing leaked, nothing in two places
    assert not set(alloc._free) & (cached | set(held))


# -- served outputs


def family_engine(case: str):
  kind, path, options = FAMILIES[case]
  target = specjax.load(f'{FIXTURES}/{path}', **({'mtp': True} if kind == 'mtp' else {}))
  if options.get('draft_model') == 'perturbed':
    options = {'draft_model': perturbed_target(0.03)}
  return target, specjax.Engine(target, page_size=4, drafter=make_drafter(kind, target, **options), max_draft=3)


def shared_prompts(model) -> list[list[int]]:
  """Prompts sharing a system prefix, diverging at offsets on and off page boundaries (pages of 4)."""
  system = model.tokenizer.encode(SYSTEM)
  out = [system + model.tokenizer.encode(q) for q in QUESTIONS]
  for cut in (4, 5, 7, 8):  # a prompt cut from the first: a page-aligned and a mid-page divergence
    out.append(out[0][: len(system) + cut] + model.tokenizer.encode(' And why?'))
  return out


def run_served(engine, prompts, prefix_cache, max_tokens=16, row_buckets=None, sampled=()):
  """The first prompt alone (it fills the cache), then the rest at once: (results, metrics). The prompts at the
  indices `sampled` are sampled (T = 1.5, seeded by index), the others greedy."""
  options = dict(num_draft=3, prefix_cache=prefix_cache, row_buckets=row_buckets)
  sampling = lambda i: SamplingParams(temperature=1.5, seed=i) if i in sampled else SamplingParams()
  with Scheduler(engine, max_slots=4, max_seq_len=128, **options) as scheduler:
    results = served(scheduler, [Request(prompts[0], max_tokens, sampling(0))])
    results += served(scheduler, [Request(p, max_tokens, sampling(i)) for i, p in enumerate(prompts) if i])
    return results, scheduler.metrics()


@pytest.mark.parametrize('case', [c for c in FAMILIES if c != 'mtp'])
def test_outputs_and_acceptance_equal_with_and_without_the_prefix_cache(case):
  """Every drafter family on a dense target: the same tokens with and without the cache, greedy rows equal to
  offline decoding, sampled rows (two of the seven, mid-page divergences among them) equal between the two (draws
  are keyed by seed, request and position: equal tokens are the law kept), and the same drafts accepted (the
  drafter's cached state is its from-scratch state)."""
  target, engine = family_engine(case)
  prompts = shared_prompts(target)
  sampled = (2, 5)
  want = [r.tokens for r in specjax.Engine(target, page_size=4).generate(prompts, max_new_tokens=16)[0]]
  off, _ = run_served(engine, prompts, False, sampled=sampled)
  on, metrics = run_served(engine, prompts, True, sampled=sampled)
  assert [r.tokens for r in on] == [r.tokens for r in off]
  assert all(r.tokens == w for i, (r, w) in enumerate(zip(on, want)) if i not in sampled)
  assert any(on[i].tokens != want[i] for i in sampled)  # the sampled rows did sample
  assert metrics['prefix_hit_tokens'] >= len(target.tokenizer.encode(SYSTEM)) * (len(prompts) - 1) // 2, metrics
  assert [r.stats.accepted for r in on] == [r.stats.accepted for r in off]
  if case in ('ngram', 'draft-model', 'layer-skip'):  # the others' tiny random drafters accept nothing here
    assert sum(r.stats.accepted for r in on) > 0
  assert metrics['free_pages'] == metrics['total_pages'] and metrics['prefix_cached_pages'] > 0


def test_a_cached_prefix_not_skipped_is_caught(monkeypatch):
  """Power check: a row that shares cached pages but does not start past them (its caches' lengths left at 0)
  prefills over the shared pages, and the outputs change."""
  target, engine = family_engine('ngram')
  prompts = shared_prompts(target)
  want, _ = run_served(engine, prompts, False, row_buckets=[4])  # one row bucket: fewer executables to compile
  admit = slots.admit
  monkeypatch.setattr(slots, 'admit', lambda graphdef, params, *args: admit(graphdef, params, *args[:-1], 0 * args[-1]))
  _, engine = family_engine('ngram')  # a fresh engine: the executables are compiled from the mutant
  got, _ = run_served(engine, prompts, True, row_buckets=[4])
  assert [r.tokens for r in got] != [r.tokens for r in want]


def multi_turn(engine, prefix_cache: bool, turns: int = 3):
  """A chat: each turn's prompt is the last prompt, its answer and a new question, served one after another, so
  the cached pages cover the generated tokens too (and the drafter's entries over them)."""
  tok = engine.model.tokenizer
  prompt, out = tok.encode(SYSTEM + QUESTIONS[2]), []
  with Scheduler(engine, max_slots=2, max_seq_len=160, num_draft=3, prefix_cache=prefix_cache) as scheduler:
    for turn in range(turns):
      result = served(scheduler, [Request(prompt, 16)])[0]
      out.append(result)
      prompt = prompt + result.tokens + tok.encode(f' Question {turn}: and then?')
    return out, scheduler.metrics()


@pytest.mark.parametrize('case', ['draft-model', 'eagle3', 'dflash'])
def test_multi_turn_reuses_generated_pages_exactly(case):
  target, engine = family_engine(case)
  off, _ = multi_turn(engine, False)
  on, metrics = multi_turn(engine, True)
  assert [r.tokens for r in on] == [r.tokens for r in off]
  assert [r.stats.accepted for r in on] == [r.stats.accepted for r in off]
  assert metrics['prefix_hit_tokens'] > 0.5 * metrics['prefix_lookup_tokens'] - len(target.tokenizer.encode(SYSTEM))


def test_shared_pages_are_never_written_while_others_speculate():
  """Pages cached by one request keep their bytes (target and drafter pools) while requests that share them
  draft, verify and roll back past them."""
  target, engine = family_engine('eagle3')
  prompts = shared_prompts(target)
  with Scheduler(engine, max_slots=4, max_seq_len=128, num_draft=3) as scheduler:
    served(scheduler, [Request(prompts[0], 16)])
    pages = sorted(scheduler.prefix._key_of)
    pools = lambda: [
        np.asarray(x[:, pages]) for x in scheduler.state.cache.k_pages + scheduler.state.drafter.cache.k_pages
    ]
    before = pools()
    results = served(scheduler, [Request(p, 16) for p in prompts[1:]])
    after = pools()
  assert sum(r.stats.spec_steps for r in results) > 0 and len(pages) >= 4
  assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_hybrid_targets_cache_with_snapshots():
  target = specjax.load(f'{FIXTURES}/tiny_qwen3_5')
  engine = specjax.Engine(target, page_size=4)
  assert Scheduler(engine, max_slots=1, prefix_snapshot_every=3).prefix_note.endswith('every 3 pages)')
  with pytest.raises(SpecjaxError, match='prefix_snapshot_every'):
    Scheduler(engine, max_slots=1, prefix_snapshot_every=0)


def test_eviction_under_pressure_keeps_every_output_exact():
  """A pool of 60 pages (3 long requests' worth), many distinct and shared prompts, cancels and sampled requests:
  cached pages are evicted (and requests preempted) and every greedy output equals its solo reference."""
  target, engine = family_engine('ngram')
  rng = random.Random(1)
  base = shared_prompts(target)
  prompts = [p[: rng.randrange(6, len(p) + 1)] + [rng.randrange(5, 400)] for p in base for _ in range(4)]
  want = [r.tokens for r in specjax.Engine(target, page_size=4).generate(prompts, max_new_tokens=12)[0]]
  with Scheduler(engine, max_slots=6, max_seq_len=80, num_pages=61, num_draft=3) as scheduler:
    handles, noise = [], []
    for p in prompts:
      handles.append(scheduler.submit(Request(p, 12)))
      sampled = SamplingParams(temperature=0.8, seed=rng.randrange(9))
      noise.append(scheduler.submit(Request(rng.choice(prompts), rng.randrange(1, 20), sampled)))
      if rng.random() < 0.3:
        noise[-1].cancel()
    got = [h.result(timeout=600).tokens for h in handles]
    for h in noise:
      h.result(timeout=600)
    metrics = scheduler.metrics()
  assert got == want
  assert metrics['prefix_evictions'] > 0 and metrics['prefix_hit_tokens'] > 0, metrics
  assert metrics['free_pages'] == metrics['total_pages'], metrics


@pytest.mark.parametrize('case', ['ngram', 'hybrid'])
def test_generate_shares_prefixes_within_and_across_calls(case):
  """`Engine.generate` keeps its batch scheduler: rows of one call wait for a row prefilling their prefix and
  start past its pages, a later call (another depth, sampled) starts past the earlier call's pages; the tokens
  equal a cache-off engine's, every prompt is still prefilled before the first step, and new weights objects
  start a fresh cache."""
  path = 'tiny_qwen3_5' if case == 'hybrid' else FAMILIES['ngram'][1]
  target = specjax.load(f'{FIXTURES}/{path}')
  prompts = shared_prompts(target)[:4]  # 3 share the system prompt, one diverges inside a page
  system = len(target.tokenizer.encode(SYSTEM))
  drafter = lambda: make_drafter('ngram', target)
  options = dict(page_size=4, max_draft=3, prefill_chunk=16)
  off = specjax.Engine(target, drafter=drafter(), prefix_cache=False, **options)
  on = specjax.Engine(target, drafter=drafter(), **options)
  if case == 'hybrid':  # snapshots where a prefill chunk ends (16 tokens = 4 pages) and at each prompt's end
    on = specjax.Engine(target, drafter=None, **options)
    off = specjax.Engine(target, drafter=None, prefix_cache=False, **options)
  sampled = SamplingParams(temperature=0.8, seed=3)
  for k, sampling in ((3, SamplingParams()), (2, sampled), (3, sampled)):
    k = k if on.drafter else 0
    want, _ = off.generate(prompts, max_new_tokens=10, num_draft=k, sampling=sampling)
    got, stats = on.generate(prompts, max_new_tokens=10, num_draft=k, sampling=sampling)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert stats.steps[0][2] == len(prompts)  # prefill first: every row is live at the first step
    if sampling is not sampled:  # the first call: rows 2-4 wait for row 1's system prompt
      assert stats.cached_tokens >= (system // 4 * 4 if case != 'hybrid' else 4) * (len(prompts) - 1) // 2, stats
    else:  # later calls: every prompt's pages, from the earlier calls
      assert stats.cached_tokens >= stats.prompt_tokens - 8 * len(prompts), stats
  on.model = dataclasses.replace(target, params=jax.tree.map(lambda x: x, target.params))  # new weights objects
  _, stats = on.generate(prompts[:1], max_new_tokens=4, num_draft=0)
  assert stats.cached_tokens == 0


def test_pages_decoded_without_drafts_are_not_cached_for_the_drafter():
  """A turn decoded by plain steps (speculation off) leaves the draft model's cache without its positions: those
  pages are not cached for it, so the next turn, drafting over that answer, accepts what a cache-off run does."""
  target, engine = family_engine('draft-model')
  tok = target.tokenizer
  prompt = tok.encode(SYSTEM + QUESTIONS[2])

  def chat(prefix_cache: bool):
    with Scheduler(engine, max_slots=2, max_seq_len=160, num_draft=3, prefix_cache=prefix_cache) as scheduler:
      first = served(scheduler, [Request(prompt, 24, num_draft=0)])[0]
      second = served(scheduler, [Request(prompt + first.tokens + tok.encode(' And then?'), 16)])[0]
      return second, scheduler.metrics()

  (off, _), (on, metrics) = chat(False), chat(True)
  assert on.tokens == off.tokens and on.stats.accepted == off.stats.accepted > 0
  # The prompt's pages (prefilled: the drafter's entries are whole), none of the answer's (85 tokens otherwise).
  assert len(prompt) // 4 * 4 - 4 <= metrics['prefix_hit_tokens'] <= len(prompt), metrics
