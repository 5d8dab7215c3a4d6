"""The continuous-batching scheduler: exact under batching, preemption and cancels, for every drafter family."""

import random

import numpy as np
import pytest

import specjax
from specjax import SpecjaxError
from specjax.drafters import make_drafter
from specjax.engine.requests import Request
from specjax.engine.scheduler import Scheduler
from specjax.errors import OutOfPagesError
from specjax.policies import Load
from specjax.sampling import SamplingParams
from conftest import FIXTURES, TINY, assert_target_law, damped_target, emitted_law_pvalue, mutated_verifier
from conftest import perturbed_target

PROMPTS = [
    'def add(a, b):\n    return a + b\n\ndef add(a, b):\n',  # repetitive: n-gram drafts get accepted
    'The cat sat on the mat. The cat',
    'Hello',
]
OTHERS = ['Once upon a time', 'x = [1, 2, 3]\nx = [1, 2, 3]\n', 'a b c a b c a b', 'Q: why?\nA:']

# case -> (family, target fixture, drafter options): one tiny target per family, as the families' own tests use.
FAMILIES = {
    'ngram': ('ngram', 'tiny_gemma3', {}),
    'draft-model': ('draft-model', 'tiny_gemma3', {'draft_model': 'perturbed'}),
    'layer-skip': ('layer-skip', 'tiny_gemma3', {'layers': 2}),
    'eagle3': ('eagle3', 'tiny_llama3', {'draft_model': f'{FIXTURES}/tiny_eagle3'}),
    'eagle3-tree': (
        'eagle3',
        'tiny_llama3',
        {'draft_model': f'{FIXTURES}/tiny_eagle3', 'tree_topk': 2, 'tree_tokens': 6},
    ),
    'dflash': ('dflash', 'tiny_qwen3', {'draft_model': f'{FIXTURES}/tiny_dflash2'}),
    'mtp': ('mtp', 'tiny_qwen3_5', {}),
    'gemma4-assistant': (
        'gemma4-assistant',
        'tiny_gemma4_for_assistant',
        {'draft_model': f'{FIXTURES}/tiny_gemma4_assistant'},
    ),
}


def encode(model, text):
  return model.tokenizer.encode(text)


def served(scheduler, requests):
  """Submits every request at once and waits for all: [Result]."""
  handles = [scheduler.submit(r) for r in requests]
  return [h.result(timeout=600) for h in handles]


def mixed_requests(model, greedy_prompts, max_tokens, rng):
  """The greedy requests under test (speculation on, off, depth 2) among 13 others: other prompts, lengths,
  sampling settings and speculation settings; 16 in all."""
  depths = [None, 0, 2]
  mine = [Request(encode(model, p), max_tokens, num_draft=depths[i % 3]) for i, p in enumerate(greedy_prompts)]
  others = []
  while len(mine) + len(others) < 16:
    sampling = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 20]), seed=rng.randrange(9))
    others.append(
        Request(
            encode(model, rng.choice(OTHERS + PROMPTS)),
            rng.randrange(1, 30),
            sampling,
            num_draft=rng.choice([None, 0, 1, 3]),
            seq_id=rng.randrange(5),
        )
    )
  order = mine + others
  rng.shuffle(order)
  return order, mine


@pytest.mark.parametrize('case', list(FAMILIES))
def test_greedy_among_16_concurrent_equals_alone(case):
  """Each family (and a draft tree): a greedy request gives the tokens of offline greedy decoding, served among 15
  others."""
  kind, path, options = FAMILIES[case]
  target = specjax.load(f'{FIXTURES}/{path}', **({'mtp': True} if kind == 'mtp' else {}))
  if options.get('draft_model') == 'perturbed':
    options = {'draft_model': perturbed_target(0.03)}
  drafter = make_drafter(kind, target, **options)
  want = [r.tokens for r in specjax.Engine(target, page_size=4).generate(PROMPTS, max_new_tokens=24)[0]]
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=3)
  order, mine = mixed_requests(target, PROMPTS, 24, random.Random(0))
  # Two row buckets (steps of 2 or 8 rows) keep the compile count down; the default buckets run in the tests below.
  with Scheduler(engine, max_slots=8, max_seq_len=128, num_draft=3, row_buckets=[2, 8]) as scheduler:
    results = dict(zip((r.id for r in order), served(scheduler, order)))
    metrics = scheduler.metrics()
  assert [results[r.id].tokens for r in mine] == want, kind
  assert metrics['spec_steps'] > 0 and metrics['free_pages'] == metrics['total_pages'], metrics
  assert results[mine[1].id].stats.spec_steps == 0  # speculation off for this request


def test_seeded_sample_equals_offline(tiny_model):
  """A seeded sampled request gives the tokens offline `generate` gives with that seed and request id."""
  sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
  engine = specjax.Engine(
      tiny_model, page_size=4, drafter=make_drafter('draft-model', tiny_model, draft_model=perturbed_target(0.03))
  )
  want = engine.generate(PROMPTS[1:2], max_new_tokens=20, sampling=sampling, request_ids=[3], num_draft=3)[0]
  order, _ = mixed_requests(tiny_model, [], 20, random.Random(1))
  mine = Request(encode(tiny_model, PROMPTS[1]), 20, sampling, seq_id=3)
  with Scheduler(engine, max_slots=8, max_seq_len=128, num_draft=3, row_buckets=[8]) as scheduler:  # 8 rows vs 1
    results = served(scheduler, order[:7] + [mine] + order[7:])
  assert results[7].tokens == want[0].tokens


def test_sampled_law_holds_under_the_server():
  """Sampled tokens served in batches of mixed requests follow the target's law; a mutant verifier fails."""
  target = damped_target(specjax.load(TINY), 0.3)
  engine = specjax.Engine(
      target, page_size=8, drafter=make_drafter('draft-model', target, draft_model=perturbed_target(0.03))
  )
  prompt, sampling = encode(target, 'The cat'), SamplingParams(temperature=1.0, seed=5)
  stop_ids = target.generation.eos_token_ids or target.tokenizer.eos_ids
  pvalues = {}
  # One row bucket: the law under mixed rows is what is tested here; the default buckets run in the tests below.
  with Scheduler(engine, max_slots=32, max_seq_len=64, num_draft=3, row_buckets=[32]) as scheduler:
    for name in ('real', 'residual-not-reduced'):
      requests = [Request(prompt, 4, sampling, seq_id=i) for i in range(1500)]
      if name == 'real':
        rows = [r.tokens for r in served(scheduler, requests)]
      else:
        with mutated_verifier(name, engine):
          rows = [r.tokens for r in served(scheduler, requests)]
      pvalues[name] = emitted_law_pvalue(target, prompt, sampling, rows, stop_ids)
  print('law p-values:', pvalues)
  assert pvalues['real'] > 1e-3 and pvalues['residual-not-reduced'] < 1e-6, pvalues


@pytest.mark.parametrize('kind', [None, 'ngram'])
def test_preemption_recomputes_the_same_tokens(tiny_model, kind):
  """A pool too small for every slot preempts the newest request; its output equals the unpreempted one."""
  drafter = make_drafter(kind, tiny_model) if kind else None
  engine = specjax.Engine(tiny_model, page_size=4, drafter=drafter)
  want = [r.tokens for r in engine.generate(PROMPTS, max_new_tokens=30, num_draft=0)[0]]
  with Scheduler(engine, max_slots=4, max_seq_len=128, num_pages=25) as scheduler:
    results = served(scheduler, [Request(encode(tiny_model, p), 30) for p in PROMPTS * 3])
    metrics = scheduler.metrics()
  assert [r.tokens for r in results] == want * 3
  assert metrics['preemptions'] > 0 and sum(r.stats.preemptions for r in results) == metrics['preemptions']
  assert metrics['free_pages'] == metrics['total_pages'] == 24


def test_soak_with_cancels_and_preemption(tiny_model):
  """1,000 requests at concurrency 32, random lengths, 10% cancelled mid-stream, a pool that forces preemption:
  every completed greedy response equals its solo reference and every page comes back."""
  rng = random.Random(2)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model), max_draft=3)
  texts = PROMPTS + OTHERS
  solo = {t: r.tokens for t, r in zip(texts, engine.generate(texts, max_new_tokens=40, num_draft=0)[0])}
  # Two row buckets (a step runs 8 or 32 rows): the load moves between them. 110 pages preempt ~200 times here
  # (150 preempted 0-4 times, by timing: admission waits for a page of growth per busy slot).
  with Scheduler(
      engine, max_slots=32, max_seq_len=96, num_pages=110, num_draft=Load(3, 1, 8), row_buckets=[8, 32]
  ) as scheduler:
    pages = scheduler.metrics()['free_pages']
    handles, checked, cancelled = [], 0, 0
    for i in range(1000):
      text, cancel = rng.choice(texts), rng.random() < 0.1
      max_tokens = 39 if cancel else rng.randrange(1, 40)  # a request to cancel is still running when it lands
      request = Request(encode(tiny_model, text), max_tokens, num_draft=rng.choice([None, None, 0, 2]))
      handles.append((text, max_tokens, scheduler.submit(request), cancel))
      while len(handles) >= 32 or (i == 999 and handles):  # 32 in flight: wait for the oldest
        text, max_tokens, handle, cancel = handles.pop(0)
        if cancel:
          next(handle.events(600))
          handle.cancel()
          cancelled += handle.result(600).finish_reason == 'cancelled'
          continue
        assert handle.result(600).tokens == solo[text][:max_tokens], (text, max_tokens)
        checked += 1
    metrics = scheduler.metrics()
  assert metrics['free_pages'] == pages and metrics['live_slots'] == 0
  assert metrics['preemptions'] > 0 and cancelled > 50 and checked > 800, metrics


def test_bad_requests_fail_before_scheduling(tiny_model):
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model))
  scheduler = Scheduler(engine, max_slots=2, max_seq_len=64)  # never started: nothing may reach it
  ok = encode(tiny_model, 'Hello')
  bad = {
      'the prompt is empty': Request([]),
      'outside the vocabulary': Request([10**7]),
      'max_tokens must be at least 1': Request(ok, 0),
      'over the capacity of 64': Request(ok, 64),
      'sampling temperature must be >= 0': Request(ok, 4, SamplingParams(temperature=-1.0)),
      'num_draft must be in 0..8': Request(ok, 4, num_draft=9),
      'stop strings must be non-empty': Request(ok, 4, stop=('',)),
  }
  for message, request in bad.items():
    with pytest.raises(SpecjaxError, match=message):
      scheduler.submit(request)
  assert scheduler.metrics()['waiting'] == 0
  with pytest.raises(SpecjaxError, match='needs a drafter'):
    Scheduler(specjax.Engine(tiny_model, page_size=4), max_slots=2, max_seq_len=64).submit(Request(ok, 4, num_draft=2))
  with pytest.raises(OutOfPagesError):
    Scheduler(engine, max_slots=2, max_seq_len=64, num_pages=8).submit(Request(ok, 40))


def test_stop_strings_logprobs_and_cancel(tiny_model):
  engine = specjax.Engine(tiny_model, page_size=4)
  offline = engine.generate(PROMPTS[:1], max_new_tokens=24)[0][0]
  stop = offline.text[5:8]
  with Scheduler(engine, max_slots=2, max_seq_len=128) as scheduler:
    cut = scheduler.submit(Request(encode(tiny_model, PROMPTS[0]), 24, stop=(stop,), logprobs=True)).result(60)
    assert cut.finish_reason == 'stop' and cut.text == offline.text[: offline.text.find(stop)]
    assert len(cut.logprobs) == len(cut.tokens) and all(lp <= 0 for lp in cut.logprobs)
    handle = scheduler.submit(Request(encode(tiny_model, PROMPTS[1]), 100))
    next(handle.events(60))
    handle.cancel()
    assert handle.result(60).finish_reason == 'cancelled'
    metrics = scheduler.metrics()
    assert metrics['live_slots'] == 0 and metrics['free_pages'] == metrics['total_pages']


def test_steady_state_compiles_nothing(tiny_model):
  """A second wave of the same kinds of requests runs on the executables the first compiled (without the prefix
  cache: with it the second wave's prompts are cached, and its prefill chunks are other buckets of the set)."""
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model))
  with Scheduler(engine, max_slots=4, max_seq_len=128, num_draft=3, prefix_cache=False) as scheduler:
    wave = lambda: served(scheduler, [Request(encode(tiny_model, p), 16) for p in PROMPTS * 2])
    first = wave()
    compiled = len(engine.executables)
    assert [r.tokens for r in wave()] == [r.tokens for r in first]
    assert len(engine.executables) == compiled
    assert all(
        name.split('[')[0] in {'admit', 'deactivate', 'tables', 'decode', 'spec', 'prefill', 'start'}
        for name, _ in engine.executables.names()
    )


def test_row_buckets_bound_the_step_executables(tiny_model, capsys):
  """`row_buckets` picks the sub-batch sizes steps compile for (default: powers of two); bad ones fail first."""
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model))
  rows = lambda s: sorted({n.split('[rows=')[1].split(',')[0] for n in s.executable_set() if n.startswith('spec')})
  assert rows(Scheduler(engine, max_slots=6, max_seq_len=64, num_draft=3)) == ['1', '2', '4', '8']
  one = Scheduler(engine, max_slots=6, max_seq_len=64, num_draft=3, row_buckets=[6, 2])
  assert rows(one) == ['2', '6'] and one.row_buckets() == [2, 6]
  assert any(n.startswith('prefill[rows=1,') for n in one.executable_set())  # prefill runs one row a call
  for bad in ([4], [0, 6], [6, 8], []):
    with pytest.raises(SpecjaxError, match=r'row_buckets must be positive sub-batch sizes, the largest max_slots'):
      Scheduler(engine, max_slots=6, max_seq_len=64, row_buckets=bad)
  from specjax import cli

  assert cli.main(['serve', '-m', TINY, '--max-slots', '8', '--row-buckets', '2', '4']) == 2
  assert 'the largest max_slots (8), got [2, 4]' in capsys.readouterr().err


def test_plain_steps_keep_lookahead_drafts_current(tiny_model):
  """A plain decode step looks up a drafts-ahead drafter's next drafts too: when a policy turns speculation back
  on, the first step drafts what the context then holds (stale drafts would be exact but rejected, and would hide
  the drafts the tuner prices)."""
  from specjax.drafters.ngram import ngram_lookup

  drafter = make_drafter('ngram', tiny_model)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=drafter)
  code = encode(tiny_model, 'def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a,')
  with Scheduler(engine, max_slots=2, max_seq_len=128, num_draft=Load(full=4, reduced=0, threshold=1)) as scheduler:
    _, long = served(scheduler, [Request(encode(tiny_model, 'Hello'), 6), Request(code, 24, trace=True)])
  trace = long.stats.trace  # its draft-verify steps: it ran alone, after the other request left
  before = len(long.tokens) - sum(len(step['emitted']) for step in trace)
  assert trace and before > 2, (before, trace)  # plain steps (two live) came first
  context = np.array([code + long.tokens[:before]], np.int32)
  drafts, lens = ngram_lookup(context, np.array([context.shape[1]]), 4, drafter.n_min, drafter.n_max)
  assert int(lens[0]) > 0 and trace[0]['drafts'] == np.asarray(drafts)[0, : int(lens[0])].tolist()
