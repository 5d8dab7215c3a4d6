"""Speculative decoding on the tiny Gemma 3: greedy equality, rollback, bad input."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecjaxError
from specjax.cache.paged import KVCache, PageAllocator
from specjax.drafters import NgramDrafter, make_drafter
from specjax.depths import step_depth, verify_widths
from conftest import cache_step, drafter_options, TINY_SHARDED, perturbed_target

PROMPTS = [
    'def add(a, b):\n    return a + b\n\ndef add(a, b):\n',  # repetitive: n-gram drafts get accepted
    'The cat sat on the mat. The cat',
    'Hello',
]


@pytest.fixture(scope='module')
def draft_model():
  """A draft model that agrees with the target often, not always."""
  return perturbed_target(0.03)


@pytest.fixture(scope='module')
def greedy_reference(tiny_engine):
  results, _ = tiny_engine.generate(PROMPTS, max_new_tokens=40)
  return [r.tokens for r in results]


def make(kind, tiny_model, draft_model):
  return make_drafter(kind, tiny_model, **drafter_options(kind, draft_model=draft_model))


@pytest.mark.parametrize('kind', ['ngram', 'layer-skip', 'draft-model'])
def test_greedy_equals_autoregressive_every_depth(kind, tiny_model, draft_model, greedy_reference):
  """Every depth 1..8 for n-gram (the cheap family: no drafter to compile); K = 1, 3 and 8 for the others (every
  family's greedy test runs those). Drafts are accepted in every run."""
  # page_size 4: prompts and drafts cross page boundaries; the ragged batch is padded to 4 rows.
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make(kind, tiny_model, draft_model))
  taus = []
  for k in range(1, 9) if kind == 'ngram' else (1, 3, 8):
    results, _ = engine.generate(PROMPTS, max_new_tokens=40, num_draft=k)
    assert [r.tokens for r in results] == greedy_reference, (kind, k)
    taus.append(max(r.spec.tau for r in results))
    for r in results:
      assert r.spec.emitted == len(r.tokens) - 1  # the first token comes from prefill
      assert 0 <= r.spec.accepted <= r.spec.drafted
    assert sum(r.spec.accepted for r in results) >= 10, (kind, k)
  assert max(taus) > 1.2, taus  # drafts were really accepted somewhere


def test_self_drafting_reproduces_sampling(tiny_model, tiny_engine):
  """Coupled drafting: a draft model equal to the target emits exactly what plain sampling emits."""
  params = specjax.SamplingParams(temperature=0.9, top_p=0.9, seed=11)
  plain = tiny_engine.generate(PROMPTS, max_new_tokens=24, sampling=params)[0]
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make('draft-model', tiny_model, tiny_model))
  spec = engine.generate(PROMPTS, max_new_tokens=24, sampling=params, num_draft=4)[0]
  assert [r.tokens for r in spec] == [r.tokens for r in plain]
  assert all(r.spec.acceptance_rate == 1.0 for r in spec)


def test_ngram_sampling_is_token_identical(tiny_model, tiny_engine):
  """Sample-and-match uses the plain sampler's keys: same seed, same tokens."""
  params = specjax.SamplingParams(temperature=1.0, top_k=20, seed=5)
  plain = tiny_engine.generate(PROMPTS, max_new_tokens=30, sampling=params)[0]
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make('ngram', tiny_model, None))
  spec = engine.generate(PROMPTS, max_new_tokens=30, sampling=params, num_draft=3)[0]
  assert [r.tokens for r in spec] == [r.tokens for r in plain]


def test_ngram_drafts_ahead_equal_in_step_lookup(tiny_model):
  """Looking drafts up ahead (verify only as wide as needed) changes no token and no per-step count."""
  params = specjax.SamplingParams(temperature=1.0, top_p=0.9, seed=2)
  runs, compiled = [], []
  for ahead in (True, False):
    engine = specjax.Engine(tiny_model, page_size=4, drafter=NgramDrafter(drafts_ahead=ahead))
    results, _ = engine.generate(PROMPTS, max_new_tokens=30, sampling=params, num_draft=6)
    runs.append(
        ([r.tokens for r in results], [(r.spec.drafted, r.spec.accepted, r.spec.target_steps) for r in results])
    )
    compiled.append(sorted(static['k'] for name, static in engine.executables.names('spec')))
  assert runs[0] == runs[1]
  assert compiled == [[0, 1, 3, 6], [6]]  # one executable per verify width of K = 6, or K + 1 always


def test_step_depth_rounds_up_to_a_verify_width():
  assert verify_widths(6) == (1, 2, 4, 7)
  assert [step_depth(6, n) for n in range(9)] == [0, 1, 3, 3, 6, 6, 6, 6, 6]
  assert [step_depth(2, n) for n in range(4)] == [0, 1, 2, 2]


def committed_kv(cache: KVCache, row: int, length: int, layer: int):
  """K and V of the first `length` positions of a row, `[Hkv, length, D]` each."""
  pages = np.asarray(cache.block_tables[row])
  k = np.asarray(cache.k_pages[layer])[:, pages].reshape(
      cache.k_pages[layer].shape[0], -1, cache.k_pages[layer].shape[-1]
  )
  v = np.asarray(cache.v_pages[layer])[:, pages].reshape(k.shape)
  return k[:, :length], v[:, :length]


def fresh_prefill(model, tokens, page_size=4):
  """A from-scratch cache of `tokens` (one row)."""
  pages = -(-len(tokens) // page_size) + 1
  alloc = PageAllocator(pages + 1, page_size)
  alloc.allocate(0, len(tokens))
  cache = KVCache.create(
      model.kv_shapes, num_pages=pages + 1, page_size=page_size, block_tables=alloc.block_table([0], pages)
  )
  _, _, cache = cache_step(model)(jnp.asarray([tokens]), cache, jnp.asarray([len(tokens)], jnp.int32))
  return cache


@pytest.mark.parametrize('kind', ['layer-skip', 'draft-model', 'ngram+draft-model'])
def test_rollback_equals_recompute(kind, tiny_model, draft_model):
  """After partial acceptance, target and drafter caches equal a fresh prefill of the accepted text.

  `ngram+draft-model` verifies the lookup's drafts in some steps and rows: the draft model's cache keeps
  only what it fed with the tokens the step emitted.
  """
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make(kind, tiny_model, draft_model))
  params = specjax.SamplingParams(temperature=1.0, seed=3)
  eos = jnp.asarray([-1], jnp.int32)
  ids = engine.encode(PROMPTS[:2])
  state = engine.prefill(ids, 40, params, eos)
  step = engine.step_fn(4, params, state, eos)
  partial = 0
  for _ in range(6):
    state, (tokens, emitted, accepted, drafted, active, _) = step(state)
    partial += int(np.sum((np.asarray(accepted) < np.asarray(drafted)) & (np.asarray(emitted) > 0)))
  assert partial > 0, 'no partial acceptance happened; the test would prove nothing'
  lengths = np.asarray(state.cache.lengths)
  buffer = np.asarray(state.tokens)
  for row in range(2):
    committed = buffer[row, : lengths[row]].tolist()  # every token but the newest
    fresh = fresh_prefill(tiny_model, committed)
    for layer in range(tiny_model.config.num_layers):
      got, want = committed_kv(state.cache, row, lengths[row], layer), committed_kv(fresh, 0, lengths[row], layer)
      np.testing.assert_allclose(got[0], want[0], atol=1e-5)
      np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    if kind.endswith('draft-model'):
      dcache = (state.drafter[1] if kind.startswith('ngram+') else state.drafter).cache
      dlen = int(dcache.lengths[row])
      assert dlen in (lengths[row], lengths[row] - 1) or (kind.startswith('ngram+') and dlen < lengths[row])
      dfresh = fresh_prefill(draft_model, committed[:dlen])
      for layer in range(draft_model.config.num_layers):
        got, want = committed_kv(dcache, row, dlen, layer), committed_kv(dfresh, 0, dlen, layer)
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)
        np.testing.assert_allclose(got[1], want[1], atol=1e-5)


def modified_checkpoint(tmp_path, edit_config=None, edit_tokenizer=None, vocab=None):
  path = tmp_path / 'draft'
  shutil.copytree(TINY_SHARDED, path)
  if vocab:
    from safetensors.numpy import load_file, save_file

    for f in os.listdir(path):
      if f.endswith('.safetensors'):
        t = load_file(path / f)
        if 'model.embed_tokens.weight' in t:
          t['model.embed_tokens.weight'] = t['model.embed_tokens.weight'][:vocab]
        save_file(t, path / f)
    cfg = json.load(open(path / 'config.json'))
    cfg['vocab_size'] = vocab
    json.dump(cfg, open(path / 'config.json', 'w'))
  if edit_tokenizer:
    tok = json.load(open(path / 'tokenizer.json'))
    edit_tokenizer(tok)
    json.dump(tok, open(path / 'tokenizer.json', 'w'))
  return str(path)


def test_mismatched_vocabulary_is_refused(tmp_path, tiny_model):
  other = specjax.load(modified_checkpoint(tmp_path, vocab=256))
  with pytest.raises(SpecjaxError, match='vocabulary'):
    make_drafter('draft-model', tiny_model, draft_model=other)


def test_mismatched_tokenizer_is_refused(tmp_path, tiny_model):
  def swap_two_tokens(tok):
    vocab = tok['model']['vocab']
    a, b = sorted(vocab, key=vocab.get)[200:202]
    vocab[a], vocab[b] = vocab[b], vocab[a]

  other = specjax.load(modified_checkpoint(tmp_path, edit_tokenizer=swap_two_tokens))
  with pytest.raises(SpecjaxError, match='tokenizer'):
    make_drafter('draft-model', tiny_model, draft_model=other)


@pytest.mark.parametrize('k', [-1, 9])
def test_bad_depth(tiny_model, k):
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make('ngram', tiny_model, None), max_draft=8)
  with pytest.raises(SpecjaxError, match='draft depth'):
    engine.generate(['Hello'], max_new_tokens=4, num_draft=k)


def test_drafters_the_target_cannot_serve(tiny_model):
  with pytest.raises(SpecjaxError, match='layer-skip needs'):
    make_drafter('layer-skip', tiny_model, layers=6)
  with pytest.raises(SpecjaxError, match='needs --draft-model'):
    make_drafter('draft-model', tiny_model)
  with pytest.raises(SpecjaxError, match='unknown drafter'):
    make_drafter('medusa', tiny_model)
  with pytest.raises(SpecjaxError, match='needs a drafter'):
    specjax.Engine(tiny_model, page_size=4).generate(['Hi'], max_new_tokens=2, num_draft=2)


def test_profiled_step_reports_draft_and_verify_time(tiny_model, draft_model, greedy_reference):
  drafter = make('draft-model', tiny_model, draft_model)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=drafter, profile=True)
  results, _ = engine.generate(PROMPTS, max_new_tokens=40, num_draft=3)
  assert [r.tokens for r in results] == greedy_reference
  for r in results:
    assert r.spec.draft_s > 0 and r.spec.verify_s > 0
  params = specjax.SamplingParams(temperature=1.0, seed=2)
  fused = specjax.Engine(tiny_model, page_size=4, drafter=drafter).generate(
      PROMPTS, max_new_tokens=20, num_draft=3, sampling=params
  )[0]
  split = engine.generate(PROMPTS, max_new_tokens=20, num_draft=3, sampling=params)[0]
  assert [r.tokens for r in split] == [r.tokens for r in fused]


@pytest.mark.parametrize('kind', ['ngram', 'draft-model'])
def test_bench_calibration_compiles_once(kind, tiny_model, draft_model):
  """`bench.calibrate` times AOT executables cached on the engine, as the steps run."""
  from specjax.bench import calibrate

  engine = specjax.Engine(tiny_model, page_size=4, drafter=make(kind, tiny_model, draft_model))
  prompt = engine.encode([PROMPTS[0]])[0]
  costs = calibrate(engine, prompt, 3)
  assert set(costs) == {'decode_s', 'verify_s', 'draft_s'} and all(v > 0 for v in costs.values())
  compiled = engine.compile_s
  calibrate(engine, prompt, 3)
  assert engine.compile_s == compiled


def test_plain_decoding_skips_the_drafter(tiny_model, draft_model, greedy_reference):
  """num_draft=0 on an engine with a drafter neither compiles nor runs the drafter."""
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make('draft-model', tiny_model, draft_model))
  results, _ = engine.generate(PROMPTS, max_new_tokens=40, num_draft=0)
  assert [r.tokens for r in results] == greedy_reference
  assert not engine.executables.names('drafter')
  results, _ = engine.generate(PROMPTS, max_new_tokens=40, num_draft=3)
  assert [r.tokens for r in results] == greedy_reference
