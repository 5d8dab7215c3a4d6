"""Generation: greedy parity, batching, reproducible sampling, streaming, no recompiles."""

import jax
import numpy as np
import pytest

import specjax
from specjax import SamplingParams, SpecjaxError, OutOfPagesError
from conftest import FIXTURES


def reference_prompts():
  ref = np.load(f'{FIXTURES}/tiny_gemma3_reference.npz')
  prompts = [list(map(int, ref['greedy_prompt_ids'][i][: ref['greedy_prompt_lens'][i]])) for i in range(2)]
  return prompts, [list(map(int, row)) for row in ref['greedy_new_ids']]


def test_greedy_matches_transformers_batched(tiny_engine):
  prompts, want = reference_prompts()
  results, stats = tiny_engine.generate(prompts, max_new_tokens=20)
  assert [r.tokens for r in results] == want
  # Ragged batch: each row alone gives the same tokens.
  for p, w in zip(prompts, want):
    assert tiny_engine.generate([p], max_new_tokens=20)[0][0].tokens == w


def test_long_prompt_is_chunked(tiny_model):
  prompts, _ = reference_prompts()
  long_prompt = (prompts[0] * 8)[:100]
  whole = specjax.Engine(tiny_model, page_size=4).generate([long_prompt], max_new_tokens=8)[0][0].tokens
  chunked = specjax.Engine(tiny_model, page_size=4, prefill_chunk=16).generate([long_prompt], max_new_tokens=8)
  assert chunked[0][0].tokens == whole


def test_sampling_reproducible_and_batch_independent(tiny_engine):
  params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7)
  a = tiny_engine.generate(['Hello world', 'def f(x):'], max_new_tokens=12, sampling=params)[0]
  b = tiny_engine.generate(['Hello world', 'def f(x):'], max_new_tokens=12, sampling=params)[0]
  assert [r.tokens for r in a] == [r.tokens for r in b]
  alone = tiny_engine.generate(['def f(x):'], max_new_tokens=12, sampling=params, request_ids=[1])[0]
  assert alone[0].tokens == a[1].tokens
  other_seed = tiny_engine.generate(
      ['Hello world', 'def f(x):'], max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=8)
  )[0]
  assert [r.tokens for r in other_seed] != [r.tokens for r in a]


def test_streaming_concatenates_to_text(tiny_engine):
  pieces = {0: [], 1: []}
  results, _ = tiny_engine.generate(
      ['Hello world', 'The cat'], max_new_tokens=15, stream=lambda row, text: pieces[row].append(text)
  )
  for row, r in enumerate(results):
    assert ''.join(pieces[row]) == r.text


def test_stops_on_eos(tiny_model):
  prompts, want = reference_prompts()
  model = specjax.models.base.Model(**{**tiny_model.__dict__})
  model.generation = specjax.loading.GenerationDefaults(eos_token_ids=(want[0][5],))
  results, stats = specjax.Engine(model, page_size=4).generate(prompts[:1], max_new_tokens=20)
  assert results[0].tokens == want[0][:6]
  assert results[0].finish_reason == 'eos'


def test_no_recompilation_in_steady_state(tiny_engine):
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if 'backend_compile' in event else None
  tiny_engine.generate([list(range(5, 15))], max_new_tokens=30)  # compiles the buckets
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    results, stats = tiny_engine.generate([list(range(20, 32))], max_new_tokens=30)  # same buckets
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert stats.decode_steps > 10
  assert compiles == []
  assert stats.compile_s == 0.0


@pytest.mark.parametrize(
    'kwargs,match',
    [
        (dict(max_new_tokens=0), 'max_new_tokens'),
        (dict(max_new_tokens=600), 'capacity'),
        (dict(sampling=SamplingParams(temperature=-1.0)), 'temperature'),
        (dict(sampling=SamplingParams(temperature=1.0, top_p=1.5)), 'top_p'),
    ],
)
def test_bad_generation_inputs(tiny_engine, kwargs, match):
  with pytest.raises(SpecjaxError, match=match):
    tiny_engine.generate(['Hello'], **{'max_new_tokens': 4, **kwargs})


def test_out_of_pages(tiny_model):
  engine = specjax.Engine(tiny_model, page_size=4, num_pages=4)
  with pytest.raises(OutOfPagesError, match='out of pages'):
    engine.generate(['Hello world, this is long enough'], max_new_tokens=20)


def test_bad_token_ids(tiny_engine):
  with pytest.raises(SpecjaxError, match='outside the vocabulary'):
    tiny_engine.generate([[1, 2, 99999]], max_new_tokens=2)
  with pytest.raises(SpecjaxError, match='empty'):
    tiny_engine.generate([[]], max_new_tokens=2)


def test_generate_is_one_offline_scheduler_run(tiny_model):
  """`generate` runs the scheduler's executables (a prefill per row and chunk, one step bucket: the batch), every
  prompt prefilled before the first step, compiles off the clocks; traces and metrics add up to the tokens."""
  from specjax.drafters import make_drafter

  drafter = make_drafter('ngram', tiny_model)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=drafter, prefill_chunk=16)
  prompts = [list(range(5, 45)), [30, 31, 32, 30, 31, 32, 30, 31], [9, 10]]  # the first is prefilled in 3 chunks
  results, stats = engine.generate(prompts, max_new_tokens=12, num_draft=3, trace=True)
  names = engine.executables.names()
  assert {'admit', 'prefill', 'spec'} <= {n for n, _ in names}
  assert stats.steps[0][2] == 3  # prefill first: no step ran before the long prompt's last chunk
  assert all(live <= 3 for _, _, live in stats.steps) and len(stats.steps) == stats.decode_steps
  assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.compile_s > 0
  for r in results:
    assert len(r.tokens) == 12 and r.finish_reason == 'length'
    assert sum(len(t['emitted']) for t in r.trace) == len(r.tokens) - 1  # the first token comes from prefill
    assert r.spec.target_steps == len(r.trace) and r.spec.emitted == len(r.tokens) - 1
  _, stats = engine.generate(prompts, max_new_tokens=12, num_draft=3)  # rows past cached prefixes: other buckets
  assert stats.cached_tokens >= 36 + 4 and stats.steps[0][2] == 3  # full pages; at least one token prefilled
  again = len(engine.executables)
  _, stats = engine.generate(prompts, max_new_tokens=12, num_draft=3)
  assert len(engine.executables) == again and stats.compile_s == 0.0  # steady state: nothing new
