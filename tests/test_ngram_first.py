"""`ngram+<family>`: n-gram lookup where it matches, the learned drafter elsewhere; greedy equality, which
drafts each row gets, the sampled law, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters import get, make_drafter
from specjax.drafters.base import Drafter
from specjax.drafters.head import HeadDrafter
from specjax.step import propose_phase
from conftest import FIXTURES, RAGGED_PROMPTS, assert_target_law, damped_target

LLAMA = f'{FIXTURES}/tiny_llama3'
HEAD = f'{FIXTURES}/tiny_eagle3'
QWEN3 = f'{FIXTURES}/tiny_qwen3'
GREEDY = specjax.SamplingParams()


@pytest.fixture(scope='module')
def llama():
  return specjax.load(LLAMA)


@pytest.fixture(scope='module')
def accepted_fallback(tmp_path_factory):
  """family -> (a target, its drafter options): a fallback drafter that target accepts often, over a target near a
  bigram model (`conftest.damped_target`): the reader head of `test_eagle3`, the reader draft of `test_dflash`, the
  rewired MTP head of `test_hybrid_speculative`."""
  from test_dflash import reader_draft
  from test_eagle3 import reader_head
  from test_hybrid_speculative import mtp_reader

  built = {}

  def get(family):
    if family not in built:
      path = str(tmp_path_factory.mktemp(family))
      if family == 'eagle3':
        target = damped_target(specjax.load(LLAMA), 0.7)
        built[family] = target, {'draft_model': reader_head(target, path)}
      elif family == 'dflash':
        target = damped_target(specjax.load(QWEN3), 0.085)
        built[family] = target, {'draft_model': reader_draft(path, target)}
      else:
        built[family] = mtp_reader(specjax.load(f'{FIXTURES}/tiny_qwen3_5', mtp=True)), {}
    return built[family]

  return get


@pytest.mark.parametrize(
    'kind, options',
    [
        ('ngram+eagle3', {}),
        ('ngram+eagle3', {'ngram_min': 2}),
        ('ngram+eagle3', {'fallback_depth': 2}),
        ('ngram+dflash', {}),
        ('ngram+mtp', {}),  # recurrent state rolled back whichever drafts ran
    ],
    ids=['eagle3', 'eagle3-min2', 'eagle3-fallback2', 'dflash', 'mtp-hybrid-target'],
)
def test_greedy_equals_autoregressive(accepted_fallback, kind, options):
  """K = 1, 3 and 5 (every depth: `test_speculative.py`), fallbacks the target accepts: drafts accepted and
  rejected in every run."""
  target, fallback = accepted_fallback(kind.removeprefix('ngram+'))
  reference, _ = specjax.Engine(target, page_size=4).generate(RAGGED_PROMPTS, max_new_tokens=20)
  engine = specjax.Engine(target, page_size=4, drafter=make_drafter(kind, target, **fallback, **options), max_draft=5)
  for k in (1, 3, 5):
    results, _ = engine.generate(RAGGED_PROMPTS, max_new_tokens=20, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in reference], k
    assert 10 <= sum(r.spec.accepted for r in results) < sum(r.spec.drafted for r in results), k


def test_tuner_policy_keeps_greedy_output(llama):
  """Under the acceptance / step-time tuner the host sees each row's pending draft length (a row without a
  match counts as K) and picks depth and verify width from it; output is still the target's greedy output."""
  from specjax.policies import make_policy

  reference, _ = specjax.Engine(llama, page_size=4).generate(RAGGED_PROMPTS, max_new_tokens=24)
  drafter = make_drafter('ngram+eagle3', llama, draft_model=HEAD)
  engine = specjax.Engine(llama, page_size=4, drafter=drafter, max_draft=5)
  tuner = make_policy('tuner', family='eagle3', candidates=(1, 3, 5), explore_every=4)
  results, stats = engine.generate(RAGGED_PROMPTS, max_new_tokens=24, num_draft=tuner)
  assert [r.tokens for r in results] == [r.tokens for r in reference]
  assert len({k for k, _, _ in stats.steps}) > 1  # the tuner moved
  assert all(r.spec.pending_per_step for r in results)  # pending lengths reached the host


def first_drafts(target, drafter, prompts, k=4):
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=k)
  state = engine.prefill(engine.encode(prompts), 8, GREEDY, jnp.asarray([-1], jnp.int32))
  step = jax.jit(propose_phase, static_argnums=0, static_argnames=('drafter', 'k', 'sampling'))
  _, prop = step(target.graphdef, target.params, drafter.params(), state, drafter=drafter, k=k, sampling=GREEDY)
  return np.asarray(prop.drafts), np.asarray(prop.draft_lens)


def test_rows_with_a_match_get_the_lookup_others_the_head(llama):
  """Row 0's prompt holds token ids 100-499, its first token among them; row 1 ('Hi') has no
  match: row 0 drafts n-gram's continuation, row 1 the EAGLE-3 head's chain, each as that drafter alone."""
  prompts = [list(range(100, 500)), 'Hi']
  both = first_drafts(llama, make_drafter('ngram+eagle3', llama, draft_model=HEAD), prompts)
  lookup = first_drafts(llama, make_drafter('ngram', llama), prompts)
  head = first_drafts(llama, make_drafter('eagle3', llama, draft_model=HEAD), prompts)
  assert lookup[1][0] > 0 and lookup[1][1] == 0
  n = lookup[1][0]
  np.testing.assert_array_equal(both[0][0, :n], lookup[0][0, :n])
  np.testing.assert_array_equal(both[0][1], head[0][1])
  np.testing.assert_array_equal(both[1][:2], [n, 4])


def test_fallback_depth_caps_the_head_chain_only(llama):
  """`fallback_depth=2`: the row without a match drafts the head's first 2 tokens and reports 2 pending
  (the host verifies 3 positions when no row has a match), the looked-up row its full continuation."""
  prompts = [list(range(100, 500)), 'Hi']
  drafter = make_drafter('ngram+eagle3', llama, draft_model=HEAD, fallback_depth=2)
  both = first_drafts(llama, drafter, prompts)
  head = first_drafts(llama, make_drafter('eagle3', llama, draft_model=HEAD), prompts)
  lookup = first_drafts(llama, make_drafter('ngram', llama), prompts)
  np.testing.assert_array_equal(both[1], [lookup[1][0], 2])
  np.testing.assert_array_equal(both[0][1, :2], head[0][1, :2])
  engine = specjax.Engine(llama, page_size=4, drafter=drafter, max_draft=4)
  state = engine.prefill(engine.encode(prompts), 8, GREEDY, jnp.asarray([-1], jnp.int32), drafting=True)
  np.testing.assert_array_equal(drafter.pending_lens(state.drafter), [lookup[1][0], 2])
  family = get('ngram+eagle3')
  assert family.describe(family.options(draft_model=HEAD, fallback_depth=2)).endswith('(k<=2)')


def test_head_after_skipped_steps_drafts_as_if_it_had_drafted(llama, monkeypatch):
  """A step whose rows all have a match skips the head's chain; the head only takes in what was committed
  (`HeadDrafter.advance`). Its later drafts equal those of a run where it drafted in those steps (the base
  class's `advance`: a depth-1 proposal)."""
  prompt = RAGGED_PROMPTS[0]

  def run():
    engine = specjax.Engine(llama, page_size=4, drafter=make_drafter('ngram+eagle3', llama, draft_model=HEAD))
    results, _ = engine.generate([prompt], max_new_tokens=40, num_draft=4, trace=True)
    return engine.encode([prompt])[0], results[0]

  ids, skipping = run()
  monkeypatch.setattr(HeadDrafter, 'advance', Drafter.advance)
  _, drafting = run()
  assert skipping.trace == drafting.trace
  tokens, kinds = list(ids) + skipping.tokens[:1], []
  for step in skipping.trace:  # n_min 1: a match when the last token occurred before
    kinds.append('lookup' if tokens[-1] in tokens[:-1] else 'head')
    tokens += step['emitted']
  assert 'lookup head' in ' '.join(kinds), kinds  # the head drafted after a skipped step


@pytest.mark.parametrize(
    'fallback_depth, mutants', [(0, ['residual-not-reduced', 'ratio-off-by-one']), (1, [])], ids=['head-k2', 'head-k1']
)
def test_sampled_keeps_the_target_law(accepted_fallback, fallback_depth, mutants):
  """Looked-up rows verify with a one-hot q, head rows with the head's q (of 2 drafts, or 1 padded to the
  lookup's 2 by `fallback_depth=1`): the first three tokens of 1000 requests have the target's exact law
  (`conftest.emitted_law_pvalue`); verifier mutants fail it.

  The prompt: the even ids below 100, then the target's greedy continuation (it ends in a loop); after a first
  token in the prompt the lookup drafts (what followed it there, often accepted), after any other the reader
  head (accepted often too).
  """
  target, fallback = accepted_fallback('eagle3')
  greedy, _ = specjax.Engine(target, page_size=8).generate([list(range(0, 100, 2))], max_new_tokens=16)
  prompt = list(range(0, 100, 2)) + greedy[0].tokens
  sampling = specjax.SamplingParams(temperature=1.0, seed=7)
  drafter = make_drafter('ngram+eagle3', target, fallback_depth=fallback_depth, **fallback)
  engine = specjax.Engine(target, page_size=8, drafter=drafter, max_draft=2)
  results, _ = assert_target_law(engine, target, prompt, sampling, n=1000, k=2, mutants=mutants)
  seen = np.isin([r.tokens[0] for r in results], prompt)
  accepted = np.array([r.spec.accepted for r in results])
  assert 0.1 < seen.mean() < 0.9 and accepted[seen].sum() > 100 and accepted[~seen].sum() > 300  # both drafters


@pytest.mark.parametrize(
    'argv, message',
    [
        (['--drafter', 'ngram+eagle3', '--draft-model', HEAD, '--tree-tokens', '4', '--tree-topk', '2'], 'chains'),
        (['--drafter', 'ngram+eagle3'], 'needs --draft-model'),
        (['--drafter', 'ngram+eagle3', '--draft-model', HEAD, '--ngram-min', '4'], 'ngram_min <= ngram_max'),
        (['--drafter', 'ngram+dflash', '--draft-model', HEAD], 'error'),
        (['--drafter', 'ngram+eagle3', '--draft-model', HEAD, '--fallback-depth', '17'], '--fallback-depth must'),
        (['--drafter', 'eagle3', '--draft-model', HEAD, '--fallback-depth', '2'], 'of --drafter ngram+<family>'),
    ],
)
def test_bad_input_is_one_error_line(capsys, argv, message):
  from specjax.cli import main

  code = main(['run', '-m', LLAMA, '--prompt', 'Hi', '--max-new-tokens', '2'] + argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert code != 0 and len(err) == 1 and err[0].startswith('error:') and message in err[0], err


def test_cli_run(capsys):
  from specjax.cli import main

  prompt = 'def add(a, b):\n    return a + b\n\ndef sub(a, b):\n'
  argv = ['run', '-m', LLAMA, '--drafter', 'ngram+eagle3', '--draft-model', HEAD, '--prompt', prompt]
  assert main(argv + ['--max-new-tokens', '8', '--n-predict', '3']) == 0
  assert 'error' not in capsys.readouterr().err
