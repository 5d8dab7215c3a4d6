"""DFlash 2: upstream parity (convolutions, selector, q), greedy equality, exact sampling, bad input, CLI."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from scipy import stats

import specjax
from specjax.drafters import make_drafter
from specjax.errors import SpecjaxError
from specjax.loading import dflash as dflash_loading
from specjax.loading.dflash import load_dflash, save_dflash
from specjax.models.contract import StepInputs
from specjax.models.dflash import DFlashConfig, DFlashDraft, block_mask, greedy_choice, place
from specjax.models.layers import Rope
from specjax.step import propose_phase, spec_step
from conftest import FIXTURES, RAGGED_PROMPTS, assert_target_law, close, damped_target, shuffled_cache
from test_dflash import gather, reader_draft

TARGET = f'{FIXTURES}/tiny_qwen3'
HYBRID = f'{FIXTURES}/tiny_qwen3_5'
DRAFT = f'{FIXTURES}/tiny_dflash2'
PROMPTS = RAGGED_PROMPTS


@pytest.fixture(scope='module')
def target():
  return specjax.load(TARGET)


@pytest.fixture(scope='module')
def ref():
  return np.load(f'{FIXTURES}/tiny_dflash2_reference.npz')


@pytest.fixture(scope='module')
def ckpt(target):
  return load_dflash(DRAFT, target)


def test_config(ckpt):
  cfg = ckpt.config
  assert (cfg.block_size, cfg.mask_token_id, cfg.taps, cfg.windows, cfg.causal) == (
      6,
      500,
      (0,),
      (256, 256),
      (False, False),
  )
  assert (cfg.conv_taps, cfg.conv_group_size, cfg.conv_groups, cfg.selector_rank, cfg.selector_top_k) == (
      2,
      16,
      4,
      16,
      8,
  )
  assert (cfg.output_multiplier, cfg.logit_softcap, cfg.is_dflash2) == (0.125, 3.0, True)


def run_block(tgt, draft, ref, step, starts=None):
  """Both prompts in one ragged batch: the context = target taps of the committed text, then one block."""
  starts = ref['start'][:, step] if starts is None else starts
  seqs, n = ref['sequence'], draft.cfg.block_size
  b, t = 2, int(starts.max())
  tokens = jnp.asarray(np.maximum(seqs[:, :t], 0))
  _, _, taps = tgt.forward(tokens, StepInputs.chain(None, jnp.asarray(starts), t), None, taps=draft.cfg.taps)
  cache = shuffled_cache(draft.cache_layout().kv_shapes, b, t + n)
  ctx = draft.context(jnp.concatenate(taps, axis=-1))
  cache = draft.append_context(ctx, StepInputs.chain(cache, jnp.asarray(starts), t), cache)
  block = np.full((b, n), draft.cfg.mask_token_id, np.int32)
  block[:, 0] = seqs[np.arange(2), starts]
  inputs = dataclasses.replace(StepInputs.chain(cache, jnp.full((b,), n), n), mask=block_mask(b, n))
  out, after = draft.block(tgt.embed(jnp.asarray(block)), inputs, cache)
  assert list(np.asarray(after.lengths)) == list(starts)  # block rows are not committed
  return out, jnp.asarray(block[:, 0])


def by_id(values, ids):  # [..., K] candidate values in increasing token id order (upstream's top-k is unsorted)
  return np.take_along_axis(np.asarray(values), np.argsort(np.asarray(ids), -1), -1)


def placed(values, ids, vocab, fill):
  out = np.full((*ids.shape[:-1], vocab), fill, np.float32)
  np.put_along_axis(out, np.asarray(ids), np.asarray(values), axis=-1)
  return out


@pytest.mark.parametrize('step', [0, 1])
def test_block_and_selector_match_upstream(target, ckpt, ref, step):
  """Block output, unary logits, candidates, edge scores, the greedy path, and q of the sampled path."""
  tgt, draft = target.module(), ckpt.module()
  out, anchor = run_block(tgt, draft, ref, step)
  close(out, ref['hidden'][:, step])
  rows = out[:, 1:]
  logits = tgt.logits(rows)
  close(logits, ref['logits'][:, step])
  unary = draft.unary(logits)
  close(unary, ref['unary'][:, step])
  values, ids = draft.selector.candidates(unary)
  ref_ids = ref['candidates'][:, step]
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ref_ids, -1))

  path, scores = draft.selector.walk(rows, values, ids, anchor, greedy_choice)
  np.testing.assert_array_equal(path, ref['drafts'][:, step])
  v = target.config.vocab_size
  close(by_id(scores, ids), by_id(ref['greedy_edges'][:, step], ref_ids))
  previous = jnp.concatenate([anchor[:, None], path[:, :-1]], axis=1)
  np.testing.assert_array_equal(draft.selector.edges(rows, values, ids, previous), scores)

  sampled = jnp.asarray(ref['sampled'][:, step])
  previous = jnp.concatenate([anchor[:, None], sampled[:, :-1]], axis=1)
  edges = draft.selector.edges(rows, values, ids, previous)
  close(by_id(edges, ids), by_id(ref['sampled_edges'][:, step], ref_ids))
  sampling = specjax.SamplingParams(temperature=float(ref['temperature']))
  q = specjax.sampling.probs(place(edges, ids, v), sampling)
  np.testing.assert_allclose(q, placed(ref['q_rows'][:, step], ref_ids, v, 0.0), atol=2e-6, rtol=0)


@pytest.mark.parametrize('is_causal', [True, None], ids=['true', 'absent'])
def test_causal_block_matches_upstream(tmp_path, target, ref, is_causal):
  """`is_causal: true`, or no key (z-lab: sliding layers are causal): each block row sees the context and the
  rows before it (upstream's mask)."""
  path = broken(tmp_path, config={'is_causal': is_causal})
  causal = load_dflash(path, target)
  assert causal.config.causal == (True, True)
  out, _ = run_block(target.module(), causal.module(), ref, 0)
  close(out, ref['hidden_causal'])
  assert np.abs(np.asarray(out) - ref['hidden'][:, 0]).max() > 0.1


def test_engine_drafts_equal_upstream(target, ref):
  """The drafter inside the engine (greedy): the first two steps' selector paths are upstream's."""
  drafter = make_drafter('dflash', target, draft_model=DRAFT)
  assert drafter.max_depth == 5 and drafter.probabilistic and drafter.provides_q
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=5)
  prompts = [[int(x) for x in ref['input_ids'][i, : ref['input_lens'][i]]] for i in range(2)]
  results, _ = engine.generate(prompts, max_new_tokens=8, num_draft=5, trace=True)
  for row, r in enumerate(results):
    for step in range(2):
      assert r.trace[step]['drafts'] == ref['drafts'][row, step].tolist(), (row, step)
      assert r.trace[step]['accepted'] == ref['accepted'][row, step]


# ---------------------------------------------------------------- equality with autoregressive decoding


@pytest.fixture(scope='module')
def damped(target):
  """The target near a bigram model (`conftest.damped_target`), whose next token `reader2` predicts often."""
  return damped_target(target, 0.085)


@pytest.fixture(scope='module')
def reader2(damped, tmp_path_factory):
  """A DFlash 2 draft that reads the last token (`test_dflash.reader_draft`): a selector over 16 candidates."""
  return load_dflash(reader_draft(str(tmp_path_factory.mktemp('reader2')), damped, dflash2=True), damped)


def test_greedy_equals_autoregressive(damped, reader2):
  """Greedy steps draft the selector's greedy path whatever --draft-sampling says; K = 1, 3 and the block's 5
  (every depth: `test_speculative.py`), drafts accepted and rejected in every run."""
  assert reader2.config.is_dflash2
  reference, _ = specjax.Engine(damped, page_size=4).generate(PROMPTS, max_new_tokens=20)
  drafter = make_drafter('dflash', damped, draft_model=reader2)
  engine = specjax.Engine(damped, page_size=4, drafter=drafter, max_draft=5)
  for k in (1, 3, 5):
    results, _ = engine.generate(PROMPTS, max_new_tokens=20, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in reference], k
    assert 20 <= sum(r.spec.accepted for r in results) < sum(r.spec.drafted for r in results), k


def test_sampled_greedy_drafts_equal_autoregressive(damped, reader2):
  """--draft-sampling greedy: selector paths verified by sample-and-match, the tokens of plain sampling; drafts
  are accepted and rejected."""
  sampling = specjax.SamplingParams(temperature=0.9, seed=3)
  plain, _ = specjax.Engine(damped, page_size=4).generate(PROMPTS, max_new_tokens=12, sampling=sampling)
  drafter = make_drafter('dflash', damped, draft_model=reader2, draft_sampling='greedy')
  assert not drafter.probabilistic and not drafter.provides_q
  spec, _ = specjax.Engine(damped, page_size=4, drafter=drafter).generate(
      PROMPTS, max_new_tokens=12, sampling=sampling, num_draft=3
  )
  assert [r.tokens for r in spec] == [r.tokens for r in plain]
  assert 5 <= sum(r.spec.accepted for r in spec) < sum(r.spec.drafted for r in spec)


def random_draft2(tmp_path, target_model, taps, window=None) -> str:
  """A random DFlash 2 draft (non-zero kernels and codebooks) for `target_model`, saved and read back."""
  t = target_model.config
  cfg = DFlashConfig(
      hidden_size=t.hidden_size,
      intermediate_size=48,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      norm_eps=1e-6,
      rope=Rope(base=1e6),
      num_layers=2,
      block_size=4,
      mask_token_id=5,
      taps=taps,
      num_target_layers=t.num_layers,
      vocab_size=t.vocab_size,
      windows=(window, None),
      conv_taps=2,
      conv_group_size=t.hidden_size // 4,
      selector_rank=8,
      selector_top_k=4,
      output_multiplier=0.5,
      logit_softcap=10.0,
  )
  draft = DFlashDraft(cfg, rngs=nnx.Rngs(4))
  params = nnx.to_pure_dict(nnx.state(draft, nnx.Param))
  rng = np.random.default_rng(0)
  for layer in params['layers'].values():
    for conv in ('attention_conv', 'mlp_conv'):
      layer[conv]['kernel_projection'] = rng.normal(0, 0.1, layer[conv]['kernel_projection'].shape)
  params['selector']['successor_codebook'] = rng.normal(0, 1, params['selector']['successor_codebook'].shape)
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  path = str(tmp_path / 'draft2')
  save_dflash(path, cfg, params)
  return path


def test_hybrid_greedy_equals_autoregressive(tmp_path):
  """Qwen3.5 hybrid: block rows (convolved) never touch the recurrent state; two taps; a sliding layer."""
  hybrid = specjax.load(HYBRID)
  back = load_dflash(random_draft2(tmp_path, hybrid, (0, 2), window=8), hybrid)
  assert back.config.taps == (0, 2) and back.config.windows == (8, None) and back.config.is_dflash2
  plain, _ = specjax.Engine(hybrid, page_size=4).generate(PROMPTS, max_new_tokens=16)
  engine = specjax.Engine(hybrid, page_size=4, drafter=make_drafter('dflash', hybrid, draft_model=back))
  assert engine.max_draft == 3
  for k in range(1, 4):
    results, _ = engine.generate(PROMPTS, max_new_tokens=16, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in plain], k


# ---------------------------------------------------------------- exact sampling


def proposals(target, drafter, sampling, n, k):
  """n rows of one prompt (distinct sequence ids), all with row 0's first token: one proposal of depth k."""
  engine = specjax.Engine(target, page_size=8, drafter=drafter, max_draft=k)
  prompt = engine.encode(['The capital of France is'])[0]
  state = engine.prefill([prompt] * n, 8, sampling, jnp.asarray([-1], jnp.int32))
  state = dataclasses.replace(state, last_tokens=jnp.full_like(state.last_tokens, state.last_tokens[0]))
  step = jax.jit(propose_phase, static_argnums=0, static_argnames=('drafter', 'k', 'sampling'))
  _, prop = step(target.graphdef, target.params, drafter.params(), state, drafter=drafter, k=k, sampling=sampling)
  return jax.device_get(prop), np.asarray(state.last_tokens)[:n]


def test_sampled_drafts_follow_their_q(target):
  """Each slot's draft is a draw from the q returned for it, conditional on the previous slot's draw.

  4000 rows of one context (prompt and first token): the first slot's q is the same in every row; the second
  slot's q depends on the row's first draft only. Slot 1 against q_1 and slot 2 given its most frequent first draft against that q_2,
  by chi^2 over the candidates; q is zero off the candidates and sums to 1.
  """
  sampling = specjax.SamplingParams(temperature=1.3, top_p=0.95, seed=2)
  drafter = make_drafter('dflash', target, draft_model=DRAFT, draft_sampling='probabilistic')
  n = 4000
  prop, _ = proposals(target, drafter, sampling, n, 2)
  drafts, q = prop.drafts[:n], prop.q[:n]
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
  assert np.all(np.take_along_axis(q, drafts[..., None], -1) > 0)
  assert (q[:, 0] > 0).sum(-1).max() <= 8  # the selector's top-k candidates only
  np.testing.assert_array_equal(q[:, 0], np.broadcast_to(q[:1, 0], q[:, 0].shape))

  def check(tokens, law):
    support = np.flatnonzero(law)
    observed = np.array([(tokens == s).sum() for s in support])
    assert observed.sum() == len(tokens)
    expected = law[support].astype(np.float64)  # q is float32: it sums to 1 within 1e-5, scipy asks 1.5e-8
    expected *= len(tokens) / expected.sum()
    assert stats.chisquare(observed, expected).pvalue > 1e-3, (observed, law[support])

  check(drafts[:, 0], q[0, 0].astype(np.float64))
  first = np.bincount(drafts[:, 0]).argmax()
  rows = np.flatnonzero(drafts[:, 0] == first)
  assert len(rows) > 500
  law = q[rows[0], 1].astype(np.float64)
  np.testing.assert_array_equal(q[rows, 1], np.broadcast_to(q[rows[0], 1], (len(rows), q.shape[-1])))
  check(drafts[rows, 1], law / law.sum())
  others = np.flatnonzero(drafts[:, 0] != first)
  assert np.abs(q[others, 1] - q[rows[0], 1]).max() > 0.05  # q_2 does depend on the first draw


def test_probabilistic_drafting_keeps_the_target_law(damped, reader2):
  """Drafts drawn from the selector's q (zero off its 16 candidates), verified with q: the first three tokens have
  the target's exact law (`conftest.emitted_law_pvalue`), 1000 requests of one prompt; verifier mutants fail it."""
  sampling = specjax.SamplingParams(temperature=1.0, seed=5)
  drafter = make_drafter('dflash', damped, draft_model=reader2)
  assert drafter.probabilistic and drafter.provides_q
  engine = specjax.Engine(damped, page_size=8, drafter=drafter, max_draft=1)
  prompt = engine.encode(['The capital of France is'])[0]
  mutants = ['residual-not-reduced', 'bonus-from-q']
  results, _ = assert_target_law(engine, damped, prompt, sampling, n=1000, k=1, mutants=mutants)
  assert sum(r.spec.accepted for r in results) > 500  # of ~1300 drafts


# ---------------------------------------------------------------- checkpoint round trip, rollback


def test_save_round_trip(tmp_path, target, ckpt):
  save_dflash(str(tmp_path / 'f32'), ckpt.config, ckpt.params)
  back = load_dflash(str(tmp_path / 'f32'), target)
  assert back.config == ckpt.config
  same = jax.tree.map(np.array_equal, nnx.to_pure_dict(back.params), nnx.to_pure_dict(ckpt.params))
  assert all(jax.tree.leaves(same))
  hf = json.loads((tmp_path / 'f32' / 'config.json').read_text())
  original = json.loads(open(f'{DRAFT}/config.json').read())
  assert hf['architectures'] == ['DFlash2DraftModel'] and hf['dflash_config'] == original['dflash_config']
  assert hf['is_causal'] is False and 'block_size' not in hf
  weights = load_file(f'{DRAFT}/model.safetensors')
  saved = load_file(tmp_path / 'f32' / 'model.safetensors')
  assert sorted(saved) == sorted(weights)
  for name, w in weights.items():
    np.testing.assert_array_equal(saved[name], w.astype(np.float32), err_msg=name)


def test_context_cache_after_rejection_equals_fresh_prefill(target):
  """Sampled steps with q: after rejections, the draft's context cache is a fresh prefill's."""
  drafter = make_drafter('dflash', target, draft_model=DRAFT)
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=5)
  prompts = engine.encode(PROMPTS[:2])
  eos = jnp.asarray([-1], jnp.int32)
  sampling = specjax.SamplingParams(temperature=1.0, seed=1)
  state = engine.prefill(prompts, 16, sampling, eos)
  step = jax.jit(spec_step, static_argnums=0, static_argnames=('drafter', 'k', 'sampling'))
  for _ in range(2):
    state, (_, emitted, accepted, *_) = step(
        target.graphdef, target.params, drafter.params(), state, eos, drafter=drafter, k=5, sampling=sampling
    )
  assert np.all(np.asarray(accepted)[:2] < 5)  # some drafts were rejected
  lengths = np.asarray(state.cache.lengths)
  np.testing.assert_array_equal(np.asarray(state.drafter.cache.lengths), lengths)
  committed = [np.asarray(state.tokens)[i, : lengths[i]].tolist() for i in range(2)]
  fresh = engine.prefill(committed, 16, sampling, eos)
  for row in range(2):
    close(gather(state.drafter.cache, row, lengths[row]), gather(fresh.drafter.cache, row, lengths[row]), 1e-5)


# ---------------------------------------------------------------- bad input


def broken(tmp_path, *, config=None, drop=(), tensors=None):
  d = tmp_path / 'draft'
  shutil.copytree(DRAFT, d)
  if config:
    hf = json.loads((d / 'config.json').read_text())
    for key, value in config.items():
      *parents, last = key.split('.')
      where = hf
      for part in parents:
        where = where.setdefault(part, {})
      if value is None:
        where.pop(last, None)
      else:
        where[last] = value
    (d / 'config.json').write_text(json.dumps(hf))
  if drop or tensors:
    weights = {k: v for k, v in load_file(d / 'model.safetensors').items() if k not in drop}
    weights.update(tensors or {})
    save_file(weights, d / 'model.safetensors')
  return str(d)


BAD = {
    'no conv size': (dict(config={'dflash_config.conv_kernel_size': None}), r'needs dflash_config.conv_kernel_size'),
    'no selector rank': (dict(config={'dflash_config.selector_rank': None}), r'needs dflash_config.selector_rank'),
    'bad top-k': (dict(config={'dflash_config.selector_top_k': 0}), r'selector_top_k must be a positive integer'),
    'top-k past vocab': (dict(config={'dflash_config.selector_top_k': 600}), r'selector_top_k 600 exceeds'),
    'group size': (dict(config={'dflash_config.conv_group_size': 24}), r'conv_group_size 24 does not divide'),
    'conv taps': (dict(config={'dflash_config.conv_kernel_size': 7}), r'conv_kernel_size 7 exceeds block_size 6'),
    'multiplier': (dict(config={'dflash_config.output_multiplier': 0}), r'output_multiplier must be a positive'),
    'softcap': (dict(config={'dflash_config.final_logit_softcapping': -1}), r'final_logit_softcapping must be'),
    'is_causal': (dict(config={'is_causal': 'yes'}), r'is_causal must be true or false'),
    'no block size': (dict(config={'dflash_config.block_size': None}), r"missing key 'block_size'"),
    'missing kernel': (dict(drop=['layers.1.mlp_conv.base_kernel']), r'missing tensors.*mlp_conv.base_kernel'),
    'missing codebook': (
        dict(drop=['candidate_selector.successor_codebook']),
        r'missing tensors.*successor_codebook',
    ),
    'kernel shape': (
        dict(tensors={'layers.0.attention_conv.kernel_projection.weight': np.zeros((8, 64), np.float32)}),
        r"'layers.0.attention_conv.kernel_projection.weight' has shape \[8, 64\], the config implies \[16, 64\]",
    ),
    'codebook shape': (
        dict(tensors={'candidate_selector.predecessor_codebook': np.zeros((512, 8), np.float32)}),
        r"'candidate_selector.predecessor_codebook' has shape \[512, 8\], the config implies \[512, 16\]",
    ),
    'projection shape': (
        dict(tensors={'candidate_selector.hidden_projection.weight': np.zeros((64, 16), np.float32)}),
        r"hidden_projection.weight' has shape \[64, 16\], the config implies \[16, 64\]",
    ),
    'v1 architecture': (
        dict(config={'architectures': ['DFlashDraftModel'], 'block_size': 6}),
        r'DFlash 2 tensors .* do not name DFlash2DraftModel',
    ),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_input_one_line_error(case, tmp_path, target, monkeypatch):
  edits, match = BAD[case]
  path = broken(tmp_path, **edits)
  monkeypatch.setattr(dflash_loading, 'read_safetensors', lambda *a, **k: pytest.fail('weights were read'))
  with pytest.raises(SpecjaxError, match=match) as e:
    load_dflash(path, target)
  assert '\n' not in str(e.value)


def test_probabilistic_needs_a_selector(target):
  with pytest.raises(SpecjaxError, match='needs a DFlash 2 candidate selector') as e:
    make_drafter('dflash', target, draft_model=f'{FIXTURES}/tiny_dflash', draft_sampling='probabilistic')
  assert '\n' not in str(e.value)
  assert not make_drafter('dflash', target, draft_model=f'{FIXTURES}/tiny_dflash').probabilistic  # auto


# ---------------------------------------------------------------- CLI


def test_cli_run_probabilistic(capsys):
  from specjax.cli import main

  code = main(
      ['run', '-m', TARGET, '--drafter', 'dflash', '--draft-model', DRAFT, '--draft-sampling', 'probabilistic']
      + ['--prompt', 'Hello', '--max-new-tokens', '6', '--temperature', '0.8', '--json']
  )
  out = json.loads(capsys.readouterr().out)
  assert code == 0 and out['spec']['drafter'] == 'dflash' and out['spec']['k'] == 5


def test_cli_mtp_model_selects_dflash(capsys):
  from specjax.cli import main

  code = main(['run', '-m', TARGET, '--mtp-model', DRAFT, '--prompt', 'Hello', '--max-new-tokens', '6', '--json'])
  out = json.loads(capsys.readouterr().out)
  assert code == 0 and out['spec']['drafter'] == 'dflash' and out['spec']['k'] == 5  # min(block_size - 1, 7)
  assert set(out['step_depths']) == {5}
