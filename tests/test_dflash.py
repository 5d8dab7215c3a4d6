"""The DFlash drafter: z-lab parity, greedy equality (dense and hybrid), context rollback, bad input, CLI."""

import dataclasses
import json
import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
from specjax.cache.paged import KVCache
from specjax.drafters import make_drafter
from specjax.errors import SpecjaxError
from specjax.loading import dflash as dflash_loading
from specjax.loading.dflash import default_taps, load_dflash, save_dflash
from specjax.models.contract import StepInputs
from specjax.models.dflash import DFlashConfig, DFlashDraft, block_mask
from specjax.models.layers import Rope
from specjax.step import spec_step
from conftest import FIXTURES, RAGGED_PROMPTS, close, damped_target, shuffled_cache

TARGET = f'{FIXTURES}/tiny_qwen3'
HYBRID = f'{FIXTURES}/tiny_qwen3_5'
DRAFT = f'{FIXTURES}/tiny_dflash'
PROMPTS = RAGGED_PROMPTS


@pytest.fixture(scope='module')
def target():
  return specjax.load(TARGET)


@pytest.fixture(scope='module')
def ref():
  return np.load(f'{FIXTURES}/tiny_dflash_reference.npz')


@pytest.fixture(scope='module')
def ckpt(target):
  return load_dflash(DRAFT, target)


def test_config(ckpt, ref):
  cfg = ckpt.config
  assert cfg.taps == tuple(ref['tap_layers']) == (0,) and cfg.block_size == 6 and cfg.mask_token_id == 500
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_target_layers, cfg.windows) == (2, 64, 2, (None, None))
  assert default_taps(36, 5) == (1, 9, 17, 25, 33) and default_taps(32, 5) == (1, 8, 15, 22, 29)
  assert default_taps(64, 5) == (1, 16, 31, 46, 61) and default_taps(10, 1) == (5,)


@pytest.mark.parametrize('step', [0, 1])
def test_block_matches_upstream(target, ckpt, ref, step):
  """(a) Both prompts in one ragged batch: context = target taps of the committed text, then one block."""
  tgt, draft = target.module(), ckpt.module()
  starts = ref['start'][:, step]  # the last token's position = committed context length
  seqs = ref['sequence']
  b, t, n = 2, int(starts.max()), ckpt.config.block_size
  tokens = jnp.asarray(np.maximum(seqs[:, :t], 0))
  _, _, taps = tgt.forward(tokens, StepInputs.chain(None, jnp.asarray(starts), t), None, taps=ckpt.config.taps)
  if step == 0:
    for row in range(2):
      close(taps[0][row, : starts[row]], ref['taps'][row, : starts[row]])
  cache = shuffled_cache(draft.cache_layout().kv_shapes, b, t + n)
  ctx = draft.context(jnp.concatenate(taps, axis=-1))
  cache = draft.append_context(ctx, StepInputs.chain(cache, jnp.asarray(starts), t), cache)
  block = np.full((b, n), 500, np.int32)
  block[:, 0] = seqs[np.arange(2), starts]
  inputs = dataclasses.replace(StepInputs.chain(cache, jnp.full((b,), n), n), mask=block_mask(b, n))
  out, after = draft.block(tgt.embed(jnp.asarray(block)), inputs, cache)
  close(out, ref['hidden'][:, step])
  logits = tgt.logits(out[:, 1:])
  close(logits, ref['logits'][:, step])
  np.testing.assert_array_equal(np.argmax(logits, -1), ref['drafts'][:, step])
  assert list(np.asarray(after.lengths)) == list(starts)  # block rows are not committed


def test_engine_drafts_equal_upstream(target, ref):
  """(b) The drafter inside the engine: the first two steps' greedy drafts are z-lab's (K = block_size - 1)."""
  drafter = make_drafter('dflash', target, draft_model=DRAFT)
  assert drafter.max_depth == 5
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=5)
  prompts = [[int(x) for x in ref['input_ids'][i, : ref['input_lens'][i]]] for i in range(2)]
  results, _ = engine.generate(prompts, max_new_tokens=8, num_draft=5, trace=True)
  for row, r in enumerate(results):
    for step in range(2):
      assert r.trace[step]['drafts'] == ref['drafts'][row, step].tolist(), (row, step)
      assert r.trace[step]['accepted'] == ref['accepted'][row, step]


@pytest.fixture(scope='module')
def damped(target):
  """The target with its layers' outputs scaled by 0.085 (`conftest.damped_target`): near a bigram model, whose
  next token the reader draft (`reader_draft`) predicts often, not always."""
  return damped_target(target, 0.085)


@pytest.fixture(scope='module')
def reader(damped, tmp_path_factory):
  return reader_draft(str(tmp_path_factory.mktemp('reader')), damped)


def test_greedy_equals_autoregressive(damped, reader):
  """K = 1, 3 and the block's 5 (every depth: `test_speculative.py`); drafts accepted and rejected in every run."""
  reference, _ = specjax.Engine(damped, page_size=4).generate(PROMPTS, max_new_tokens=20)
  engine = specjax.Engine(damped, page_size=4, drafter=make_drafter('dflash', damped, draft_model=reader), max_draft=5)
  for k in (1, 3, 5):
    results, _ = engine.generate(PROMPTS, max_new_tokens=20, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in reference], k
    assert 20 <= sum(r.spec.accepted for r in results) < sum(r.spec.drafted for r in results), k


def test_sampled_equals_autoregressive(damped, reader):
  """Greedy drafts verified by sample-and-match: the same tokens as plain sampling with the same seed; drafts are
  accepted (sampled tokens equal to the drafts) and rejected."""
  sampling = specjax.SamplingParams(temperature=0.9, seed=3)
  plain, _ = specjax.Engine(damped, page_size=4).generate(PROMPTS, max_new_tokens=12, sampling=sampling)
  engine = specjax.Engine(damped, page_size=4, drafter=make_drafter('dflash', damped, draft_model=reader))
  spec, _ = engine.generate(PROMPTS, max_new_tokens=12, sampling=sampling, num_draft=3)
  assert [r.tokens for r in spec] == [r.tokens for r in plain]
  assert 5 <= sum(r.spec.accepted for r in spec) < sum(r.spec.drafted for r in spec)


@pytest.mark.parametrize('gate', [False, True])
def test_project_kv_is_projects_keys_and_values(gate):
  from specjax.models.layers import Attention, AttentionSpec

  spec = AttentionSpec(4, 2, 8, Rope(base=1e4, rotary_dim=4), scale=0.3, qk_norm=True, output_gate=gate)
  attn = Attention(16, spec, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 3, 16))
  positions = jnp.asarray([[4, 5, 6], [0, 1, 2]])
  _, key, value, _ = attn.project(x, positions)
  got_key, got_value = attn.project_kv(x, positions)
  np.testing.assert_array_equal(got_key, key)
  np.testing.assert_array_equal(got_value, value)


def random_draft(tmp_path, target_model, taps, block_size=4, window=None) -> str:
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
      block_size=block_size,
      mask_token_id=5,
      taps=taps,
      num_target_layers=t.num_layers,
      vocab_size=t.vocab_size,
      windows=(window, None),
  )
  draft = DFlashDraft(cfg, rngs=nnx.Rngs(4))
  path = str(tmp_path / 'draft')
  save_dflash(path, cfg, nnx.state(draft, nnx.Param))
  return path


def reader_draft(path: str, target_model, dflash2: bool = False) -> str:
  """A DFlash (2) draft whose every row drafts the target's read of the last token alone, saved at `path`.

  No queries or keys (every attention score 0), context values 0 (`fc` 0) and a value map that drops the mask
  token's direction: each block row's attention adds a large multiple of the first row's (the last token's)
  normed embedding; the MLP adds nothing (DFlash 2: identity convolutions, no transitions, plain unary logits
  over 16 candidates) and the final norm is the target's. Over `damped_target` (whose next token depends mostly
  on the last one) its drafts get accepted often.
  """
  t = target_model.config
  d = t.hidden_size
  extra = dict(conv_taps=2, conv_group_size=16, selector_rank=8, selector_top_k=16) if dflash2 else {}
  cfg = DFlashConfig(
      hidden_size=d,
      intermediate_size=32,
      num_heads=4,
      num_kv_heads=4,
      head_dim=d // 4,
      norm_eps=1e-6,
      rope=Rope(base=1e6),
      num_layers=1,
      block_size=6,
      mask_token_id=500,
      taps=(0,),
      num_target_layers=t.num_layers,
      vocab_size=t.vocab_size,
      windows=(None,),
      **extra,
  )
  params = nnx.to_pure_dict(nnx.state(DFlashDraft(cfg, rngs=nnx.Rngs(4)), nnx.Param))
  mask = np.asarray(target_model.module().embed(jnp.asarray([[cfg.mask_token_id]])))[0, 0].astype(np.float64)
  mask /= np.linalg.norm(mask)
  layer = params['layers'][0]
  layer['mixer']['qkv_proj'] = np.concatenate([np.zeros((d, 2 * d)), np.eye(d) - np.outer(mask, mask)], axis=1)
  layer['mixer']['o_proj'] = np.eye(d) * 1e3
  layer['mlp']['down'] = np.zeros_like(layer['mlp']['down'])
  params['fc'] = np.zeros_like(params['fc'])
  params['norm']['scale'] = np.asarray(nnx.to_pure_dict(target_model.params)['norm']['scale'])
  save_dflash(path, cfg, jax.tree.map(lambda x: np.asarray(x, np.float32), params))
  return path


def test_hybrid_greedy_equals_autoregressive(tmp_path):
  """Qwen3.5 hybrid: block rows never touch the recurrent state; two taps; a sliding layer."""
  hybrid = specjax.load(HYBRID)
  path = random_draft(tmp_path, hybrid, (0, 2), block_size=4, window=8)
  back = load_dflash(path, hybrid)
  assert back.config.taps == (0, 2) and back.config.windows == (8, None)
  plain, _ = specjax.Engine(hybrid, page_size=4).generate(PROMPTS, max_new_tokens=16)
  engine = specjax.Engine(hybrid, page_size=4, drafter=make_drafter('dflash', hybrid, draft_model=back))
  assert engine.max_draft == 3
  for k in range(1, 4):
    results, _ = engine.generate(PROMPTS, max_new_tokens=16, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in plain], k


@pytest.mark.parametrize('name', ['tiny_llama3', 'tiny_gemma3'])
def test_other_targets_greedy_equal_autoregressive(tmp_path, name):
  """Llama 3 and Gemma 3 (its embedding scale, GeGLU target; taps from the default spacing) targets."""
  model = specjax.load(f'{FIXTURES}/{name}')
  taps = (0,) if model.config.num_layers < 4 else default_taps(model.config.num_layers, 2)
  drafter = make_drafter('dflash', model, draft_model=random_draft(tmp_path, model, taps))
  plain, _ = specjax.Engine(model, page_size=4).generate(PROMPTS, max_new_tokens=12)
  engine = specjax.Engine(model, page_size=4, drafter=drafter)
  for k in (1, 3):
    results, _ = engine.generate(PROMPTS, max_new_tokens=12, num_draft=k)
    assert [r.tokens for r in results] == [r.tokens for r in plain], k


def test_save_round_trip(tmp_path, target, ckpt):
  save_dflash(str(tmp_path / 'f32'), ckpt.config, ckpt.params)
  back = load_dflash(str(tmp_path / 'f32'), target)
  assert back.config == ckpt.config
  same = jax.tree.map(np.array_equal, nnx.to_pure_dict(back.params), nnx.to_pure_dict(ckpt.params))
  assert all(jax.tree.leaves(same))
  hf = json.loads((tmp_path / 'f32' / 'config.json').read_text())
  assert hf['architectures'] == ['DFlashDraftModel'] and hf['dflash_config'] == {
      'mask_token_id': 500,
      'target_layer_ids': [0],
  }
  assert hf['block_size'] == 6 and hf['num_target_layers'] == 2 and hf['rope_theta'] == 1e6
  original = load_file(f'{DRAFT}/model.safetensors')
  saved = load_file(tmp_path / 'f32' / 'model.safetensors')
  assert sorted(saved) == sorted(original)
  for name, w in original.items():
    np.testing.assert_array_equal(saved[name], w.astype(np.float32), err_msg=name)


def test_save_is_atomic_with_the_umask_modes(tmp_path, ckpt, monkeypatch):
  """Files 0666 less the umask, written into a temporary folder renamed into place: a failed write leaves nothing."""
  import safetensors.numpy

  umask = os.umask(0o022)
  os.umask(umask)
  save_dflash(str(tmp_path / 'export'), ckpt.config, ckpt.params)
  for name in ('config.json', 'model.safetensors'):
    assert stat.S_IMODE(os.stat(tmp_path / 'export' / name).st_mode) == 0o666 & ~umask, name
  assert stat.S_IMODE(os.stat(tmp_path / 'export').st_mode) == 0o777 & ~umask
  monkeypatch.setattr(safetensors.numpy, 'save_file', lambda *a, **k: (_ for _ in ()).throw(OSError('disk full')))
  with pytest.raises(OSError, match='disk full'):
    save_dflash(str(tmp_path / 'other'), ckpt.config, ckpt.params)
  assert os.listdir(tmp_path) == ['export']


def gather(cache: KVCache, row: int, n: int):
  """[layers, 2, n, K, H]: the keys and values of positions 0..n-1 of one row."""
  pos = np.arange(n)
  pages = np.asarray(cache.block_tables)[row, pos // cache.page_size]
  slots = pos % cache.page_size
  return np.stack(
      [
          np.stack([np.asarray(k[:, pages, slots]), np.asarray(v[:, pages, slots])])
          for k, v in zip(cache.k_pages, cache.v_pages)
      ]
  )


def test_context_cache_after_rejection_equals_fresh_prefill(target):
  drafter = make_drafter('dflash', target, draft_model=DRAFT)
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=5)
  prompts = engine.encode(PROMPTS[:2])
  eos = jnp.asarray([-1], jnp.int32)
  greedy = specjax.SamplingParams()
  state = engine.prefill(prompts, 16, greedy, eos)
  step = jax.jit(spec_step, static_argnums=0, static_argnames=('drafter', 'k', 'sampling'))
  for _ in range(2):
    state, (_, emitted, accepted, *_) = step(
        target.graphdef, target.params, drafter.params(), state, eos, drafter=drafter, k=5, sampling=greedy
    )
  assert np.all(np.asarray(accepted)[:2] < 5)  # some drafts were rejected
  lengths = np.asarray(state.cache.lengths)
  np.testing.assert_array_equal(np.asarray(state.drafter.cache.lengths), lengths)
  committed = [np.asarray(state.tokens)[i, : lengths[i]].tolist() for i in range(2)]
  fresh = engine.prefill(committed, 16, greedy, eos)
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
    'architecture': (dict(config={'architectures': ['Qwen3ForCausalLM'], 'dflash_config': None}), 'not a DFlash'),
    'hidden size': (dict(config={'hidden_size': 32}), r"hidden size 32 != the target's 64"),
    'vocab': (dict(config={'vocab_size': 600}), r"vocab_size 600 != the target's vocabulary \(512\)"),
    'target layers': (dict(config={'num_target_layers': 36}), r"num_target_layers 36 != the target's 2 layers"),
    'tap ids': (dict(config={'dflash_config.target_layer_ids': [0, 1]}), r'must be in 0..0'),
    'default taps': (dict(config={'dflash_config.target_layer_ids': None}), 'the default target_layer_ids'),
    'mask token': (dict(config={'dflash_config.mask_token_id': 512}), r'mask_token_id 512 must be a token id'),
    'no mask token': (dict(config={'dflash_config.mask_token_id': None}), r'mask_token_id None'),
    'block size': (dict(config={'block_size': 1}), 'drafts nothing'),
    'dflash2 tensors': (
        dict(tensors={'layers.0.attention_conv.kernel_projection.weight': np.zeros((4, 64), np.float32)}),
        r'DFlash 2 tensors \(layers.0.attention_conv.kernel_projection.weight, ...\) but architectures',
    ),
    'dflash2 architecture': (
        dict(config={'architectures': ['DFlash2DraftModel']}),
        'DFlash2DraftModel needs dflash_config.conv_kernel_size',
    ),
    'missing tensor': (dict(drop=['layers.1.self_attn.k_norm.weight']), 'missing tensors'),
    'shape': (dict(config={'intermediate_size': 40}), r"'layers.0.mlp.gate_proj.weight' has shape \[32, 64\]"),
    'variant': (dict(config={'dflash_config.projector_type': 'mlp'}), 'projector_type'),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_input_one_line_error(case, tmp_path, target, monkeypatch):
  edits, match = BAD[case]
  path = broken(tmp_path, **edits)
  monkeypatch.setattr(dflash_loading, 'read_safetensors', lambda *a, **k: pytest.fail('weights were read'))
  with pytest.raises(SpecjaxError, match=match) as e:
    load_dflash(path, target)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize(
    'argv, message',
    [
        (['--drafter', 'dflash'], 'needs --draft-model'),
        (['--drafter', 'dflash', '--draft-model', DRAFT, '--draft-sampling', 'probabilistic'], 'candidate selector'),
        (['--drafter', 'dflash', '--draft-model', DRAFT, '--mtp-draft-sampling', 'top'], 'must be one of'),
        (['--drafter', 'dflash', '--draft-model', DRAFT, '--n-predict', '6'], 'depth'),
    ],
)
def test_cli_bad_input_is_one_error_line(capsys, argv, message):
  from specjax.cli import main

  code = main(['run', '-m', TARGET, '--prompt', 'Hi', '--max-new-tokens', '2'] + argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert code != 0 and len(err) == 1 and err[0].startswith('error:') and message in err[0], err


def test_cli_mtp_model_selects_dflash(capsys):
  from specjax.cli import main

  code = main(['run', '-m', TARGET, '--mtp-model', DRAFT, '--prompt', 'Hello', '--max-new-tokens', '6', '--json'])
  out = json.loads(capsys.readouterr().out)
  assert code == 0 and out['spec']['drafter'] == 'dflash' and out['spec']['k'] == 5  # min(block_size - 1, 7)
  assert set(out['step_depths']) == {5}


def test_default_depth_is_the_same_from_the_cli_and_the_engine(tmp_path, capsys, target):
  """Without a depth, `Engine.generate` and `specjax run` both draft min(block_size - 1, 7): 7 under a block of 16."""
  from specjax.cli import main

  path = broken(tmp_path, config={'block_size': 16})
  drafter = make_drafter('dflash', target, draft_model=path)
  assert specjax.Engine(target, drafter=drafter).default_depth() == 7  # not max_draft (8)
  assert specjax.Engine(target, drafter=drafter, max_draft=5).default_depth() == 5
  assert specjax.Engine(target, drafter=make_drafter('ngram+dflash', target, draft_model=path)).default_depth() == 7
  argv = ['run', '-m', TARGET, '--drafter', 'dflash', '--draft-model', path, '--prompt', 'Hello world']
  assert main(argv + ['--max-new-tokens', '3', '--json']) == 0
  assert set(json.loads(capsys.readouterr().out)['step_depths']) == {7}


def test_cli_mtp_model_selects_eagle3(capsys):
  from specjax.cli import main

  code = main(
      ['run', '-m', f'{FIXTURES}/tiny_llama3', '--mtp-model', f'{FIXTURES}/tiny_eagle3', '--prompt', 'Hi']
      + ['--max-new-tokens', '4', '--json']
  )
  out = json.loads(capsys.readouterr().out)
  assert code == 0 and out['spec']['drafter'] == 'eagle3'


def test_cli_bench_caps_the_family_depths(tmp_path, capsys):
  """bench's default depths, 3 5 7, become 3 5 under a block of 6."""
  from specjax.cli import main

  prompts = tmp_path / 'questions.jsonl'
  prompts.write_text(json.dumps({'question_id': 1, 'category': 'free', 'turns': ['Hello world']}) + '\n')
  code = main(
      ['bench', '-m', TARGET, '--drafter', 'dflash', '--draft-model', DRAFT, '--prompts', str(prompts)]
      + ['--max-new-tokens', '4', '--page-size', '4', '--json', '--quiet']
  )
  out = json.loads(capsys.readouterr().out)
  assert code == 0 and out['greedy_outputs_equal']
  assert sorted({k for key in out['calibration'] for k in [int(key.split('K=')[1])]}) == [3, 5]


def test_sweep_over_depths(tmp_path):
  """Sweeps take the dflash options as keys: two fixed depths, equal greedy tokens."""
  from specjax.sweep import run_sweep

  prompts = tmp_path / 'questions.jsonl'
  prompts.write_text(json.dumps({'question_id': 1, 'category': 'free', 'turns': ['Hello world']}) + '\n')
  overrides = [
      f'model={TARGET!r}',
      f'prompts.path={str(prompts)!r}',
      'prompts.categories=[]',
      'max_new_tokens=6',
      'page_size=4',
      'warmup=False',
      'drafter.kind="dflash"',
      f'drafter.draft_model={DRAFT!r}',
      'drafter.draft_sampling="greedy"',
      'grid.policy=[{"name":"fixed","k":2},{"name":"fixed","k":5}]',
  ]
  run_sweep(f'{FIXTURES}/../../configs/sweep_tiny.py', str(tmp_path / 'out'), overrides, progress=False)
  rows = [json.loads(line) for line in open(tmp_path / 'out' / 'results.jsonl')]
  requests = [r for r in rows if r['type'] == 'request']
  assert len(requests) == 2 and requests[0]['tokens'] == requests[1]['tokens']
