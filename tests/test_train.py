"""`specjax train` on the tiny target: loss falls, resume is bit-identical, data-parallel = one device, export
serves the same drafts, the training-time-test unroll is the serving computation, bad configs fail in one line."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, TINY
from specjax.errors import SpecjaxError

WORDS = 'the cat sat on a mat and the dog ran to the park while birds sang in trees'.split()


def make_data(path, n=48, seed=0):
  rng = np.random.default_rng(seed)
  say = lambda k: ' '.join(rng.choice(WORDS, k))
  with open(path, 'w', encoding='utf-8') as f:
    for i in range(n):
      q, a = say(rng.integers(3, 8)), say(rng.integers(5, 16))
      row = [
          {'conversations': [{'from': 'human', 'value': q}, {'from': 'gpt', 'value': a}]},
          {'prompt': q, 'response': a},
          {'text': f'{q} {a}'},
      ][i % 3]
      f.write(json.dumps(row) + '\n')
  return str(path)


def config(data, **train):
  return {
      'target': {'model': TINY},
      'data': {'path': data, 'max_len': 32},
      'train': {'steps': 12, 'batch_size': 4, 'lr': 3e-3, 'ttt_steps': 2, 'log_every': 1, 'save_every': 4, **train},
      'eval': {'every': 6, 'limit': 6},
  }


def train_lines(out):
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  return make_data(tmp_path_factory.mktemp('data') / 'train.jsonl')


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
  from specjax.train import run_training

  out = str(tmp_path_factory.mktemp('run') / 'a')
  return out, run_training(config(data), out, progress=False)


def test_loss_falls(trained):
  out, report = trained
  lines = [r for r in train_lines(out) if r['type'] == 'train']
  assert [r['step'] for r in lines] == list(range(1, 13))
  first, last = np.mean([r['loss'] for r in lines[:3]]), np.mean([r['loss'] for r in lines[-3:]])
  assert last < first - 0.1, (first, last)
  assert all(len(r['agree']) == 2 and r['lr'] > 0 for r in lines)
  evals = [r for r in train_lines(out) if r['type'] == 'eval']
  assert [r['step'] for r in evals] == [6, 12] and all(r['tau'] >= 1 for r in evals)
  assert report['tokens_per_s'] > 0
  manifest = json.load(open(os.path.join(out, 'manifest.json')))
  assert manifest['config_hash'] and manifest['versions']['optax'] and manifest['steps_done'] == 12
  assert os.path.isfile(os.path.join(out, 'curves.png'))
  assert sorted(os.listdir(os.path.join(out, 'export'))) == ['config.json', 'model.safetensors']


def test_expected_tau():
  from specjax.train import expected_tau

  assert expected_tau([5, 2], [10, 4]) == pytest.approx(1 + 0.5 + 0.25)
  assert expected_tau([0, 0], [0, 0]) == 1.0


def test_resume_after_kill_is_bit_identical(data, trained, tmp_path):
  from specjax.train import run_training

  out_a, report_a = trained
  out = str(tmp_path / 'b')
  killed = run_training(config(data), out, progress=False, stop_at=6)  # checkpoint at step 4; steps 5-6 lost
  assert killed['stopped_at'] == 6
  # A save cut short by the kill: orbax's temporary folder, never a checkpoint.
  partial = os.path.join(out, 'checkpoints', '8.orbax-checkpoint-tmp-1234567')
  os.makedirs(partial)
  open(os.path.join(partial, 'junk'), 'w').close()
  report = run_training(config(data), out, progress=False)
  assert report['start_step'] == 4
  assert same(jax.device_get(report['params']), jax.device_get(report_a['params']))
  strip = lambda rows: [{k: v for k, v in r.items() if k not in ('tokens_per_s',)} for r in rows]
  assert strip(train_lines(out)) == strip(train_lines(out_a))
  with pytest.raises(SpecjaxError, match='another config'):
    run_training(config(data, lr=1e-3), out, progress=False)


def test_stop_after_and_time_limit_end_an_invocation_that_resumes(data, trained, tmp_path, capsys):
  """train.stop_after / train.time_limit end a run early, scored, saved and exported; reruns finish it unchanged."""
  from specjax import cli
  from specjax.train import run_training

  out = str(tmp_path / 'cut')
  cfg = tmp_path / 'cfg.py'
  cfg.write_text(f'import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({config(data)!r})\n')
  assert cli.main(['train', str(cfg), '--out', out, 'train.stop_after=5']) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith('trained to step 5 of 12 (rerun to resume) (from step 0)')
  phases = [line for line in captured.err.splitlines() if line.startswith(('target:', 'data:', 'train: steps'))]
  assert phases == [  # one line per phase before the first step
      f'target: loading {TINY}',
      f'data: reading records from {data}',
      'data: 42 training and 6 eval records; formatting',
      phases[3],
      'train: steps 1..5 of 12, 4 rows of 32 tokens a step on 1 device(s); the first step compiles',
  ], phases
  assert re.fullmatch(r'data: \d+ packed rows of 32 tokens \([\d,]+ tokens\), \d+ eval rows', phases[3]), phases
  assert [r['step'] for r in train_lines(out) if r['type'] == 'eval'] == [5]
  assert os.path.exists(os.path.join(out, 'export', 'config.json'))
  with open(os.path.join(out, 'manifest.json')) as f:
    manifest = json.load(f)
  assert manifest['steps_done'] == 5 and 'stopped' in manifest and 'finished' not in manifest
  assert cli.main(['train', str(cfg), '--out', out, '--quiet', 'train.stop_after=5']) == 0  # already there: no step
  assert (
      capsys.readouterr().out
      == f'already at step 5 of 12 in {out} (train.stop_after); nothing to do until it is raised\n'
  )
  timed = run_training(config(data), out, ['train.time_limit=1e-9'], progress=False)  # one step, then past it
  assert (timed['start_step'], timed['step']) == (5, 6)
  report = run_training(config(data), out, progress=False)
  assert (report['start_step'], report['step']) == (6, 12)
  assert same(jax.device_get(report['params']), jax.device_get(trained[1]['params']))


def test_rerun_of_a_finished_run_says_so(data, trained, tmp_path, capsys):
  """A rerun of a finished run trains nothing and says so in one line, not `trained 12 steps; loss None`."""
  from specjax import cli

  out = str(tmp_path / 'again')
  shutil.copytree(trained[0], out)
  cfg = tmp_path / 'cfg.py'
  cfg.write_text(f'import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({config(data)!r})\n')
  assert cli.main(['train', str(cfg), '--out', out]) == 0
  captured = capsys.readouterr()
  assert captured.out == f'already trained: 12 of 12 steps in {out}; nothing to do (drafter in {out}/export/)\n'
  assert captured.err.splitlines()[-1] == f'train: {out} is at step 12 of 12 already; no step to run', captured.err


def test_export_serves_the_trained_drafter(trained):
  import specjax
  from specjax.drafters import make_drafter
  from specjax.drafters.mtp import MTPDrafter

  out, report = trained
  model = specjax.load(TINY)
  params = jax.device_get(report['params'])
  served = make_drafter('mtp', model, draft_model=os.path.join(out, 'export'))
  assert same(jax.device_get(served.head_params), params)
  direct = MTPDrafter(graphdef=served.graphdef, head_params=params, feature_size=model.config.hidden_size)
  prompts = ['the cat sat on the', 'birds sang in']
  runs = [
      specjax.Engine(model, drafter=d, max_draft=3, page_size=4).generate(
          prompts, max_new_tokens=12, num_draft=3, trace=True
      )[0]
      for d in (served, direct)
  ]
  assert [r.trace for r in runs[0]] == [r.trace for r in runs[1]]
  plain, _ = specjax.Engine(model, page_size=4).generate(prompts, max_new_tokens=12)
  assert [r.tokens for r in runs[0]] == [r.tokens for r in plain]  # speculative output stays exact
  with pytest.raises(SpecjaxError, match='trained for another target'):
    make_drafter('mtp', specjax.load(os.path.join(os.path.dirname(TINY), 'tiny_llama3')), draft_model=out + '/export')


def test_steps_zero_exports_the_initial_drafter(data, tmp_path):
  from specjax.train import run_training
  from specjax.train.config import resolve
  from specjax.train.trainers import make_trainer

  import specjax

  cfg = resolve(config(data), ['train.steps=0'])
  report = run_training(cfg, str(tmp_path / 'z'), progress=False)
  model = specjax.load(TINY)
  trainer = make_trainer(cfg, model, None)
  initial = trainer.init(jax.random.fold_in(jax.random.key(0), 0))
  assert same(jax.device_get(trainer.load(report['export'])), jax.device_get(initial))


KINDS = [  # drafter.kind and its drafter.* keys, sized for the tiny targets
    ('mtp', {}),
    ('eagle3', {'draft_vocab_size': 128}),
    ('dflash', {'layers': 2, 'block_size': 4, 'anchors': 8}),
]


@pytest.mark.parametrize('kind, drafter', KINDS)
def test_init_from_starts_at_the_checkpoint(data, tmp_path, kind, drafter):
  """drafter.init_from: a run starts at an exported drafter (EAGLE-3: with its vocabulary map), checked first."""
  from specjax.train import run_training
  from specjax.train.config import resolve
  from specjax.train.trainers import first_params, make_trainer

  import specjax

  cfg = {**config(data), 'drafter': {'kind': kind, **drafter}}
  export = run_training(cfg, str(tmp_path / 'a'), ['train.steps=2', 'eval.every=0'], progress=False)['export']
  model = specjax.load(TINY)
  tuned = resolve(cfg, ['train.seed=7', f'drafter.init_from={export!r}'])
  trainer = make_trainer(tuned, model, None)  # no data: EAGLE-3's vocabulary comes from the checkpoint
  assert same(jax.device_get(first_params(trainer, jax.random.key(7))), jax.device_get(trainer.load(export)))
  if kind == 'eagle3':
    from specjax.loading.eagle3 import load_eagle3

    np.testing.assert_array_equal(trainer.d2t, load_eagle3(export, model).d2t)
    with pytest.raises(SpecjaxError, match=r'differs from this config: draft_vocab_size 128 \(config: 64\)'):
      make_trainer(resolve(tuned, ['drafter.draft_vocab_size=64']), model, None)
    with pytest.raises(SpecjaxError, match=r'norm_before_residual True \(config: False\)'):
      make_trainer(resolve(tuned, ['drafter.norm_before_residual=False']), model, None)
    report = run_training(tuned, str(tmp_path / 'b'), ['train.steps=2', 'eval.every=0'], progress=False)
    assert np.isfinite(report['loss'])
  if kind == 'dflash':
    with pytest.raises(SpecjaxError, match=r'block_size 4 \(config: 8\)'):
      make_trainer(resolve(tuned, ['drafter.block_size=8']), model, None)


@pytest.mark.parametrize('kind, drafter', KINDS)
def test_gemma4_target_trains_and_exports(data, tmp_path, kind, drafter):
  """A Gemma 4 target (KV sharing, PLE, proportional RoPE) trains each kind, shaped by its `draft_layer_spec()`;
  the export reads back and builds the drafter."""
  from specjax.drafters import make_drafter
  from specjax.train import run_training
  from specjax.train.config import resolve
  from specjax.train.trainers import make_trainer

  import specjax

  target = f'{FIXTURES}/tiny_gemma4'
  cfg = {**config(data, steps=1, save_every=0), 'drafter': {'kind': kind, **drafter}, 'target': {'model': target}}
  cfg['eval'] = {'every': 0, 'limit': 0}
  report = run_training(cfg, str(tmp_path / kind), progress=False)
  assert np.isfinite(report['loss'])
  model = specjax.load(target)
  trainer = make_trainer(resolve(cfg, []), model, None)
  assert same(jax.device_get(trainer.load(report['export'])), jax.device_get(report['params']))
  make_drafter(kind, model, draft_model=report['export'])


def test_data_fraction_nests_and_keeps_the_eval_set(data, tiny_model):
  """data.fraction subsets the training records after the eval hold-out (smaller fractions nest); whether eval
  runs (eval.every, a run-only key) never changes the training rows."""
  from specjax.train.config import resolve
  from specjax.train.loop import load_data

  def rows(*overrides):
    train, evals = load_data(resolve(config(data), list(overrides)), tiny_model, progress=False)
    seqs = lambda p: {tuple(t[s == g]) for t, s in zip(p.tokens, p.segments) for g in set(s.tolist()) - {0}}
    return seqs(train), evals and seqs(evals)

  full, full_eval = rows()
  half, half_eval = rows('data.fraction=0.5')
  quarter, quarter_eval = rows('data.fraction=0.25')
  assert quarter < half < full and half_eval == quarter_eval == full_eval
  assert 0.4 < len(half) / len(full) < 0.6
  assert rows('eval.every=0') == (full, None)
  with pytest.raises(SpecjaxError, match=r"'data.fraction' must be in \(0, 1\]"):
    resolve(config(data), ['data.fraction=0'])


def test_ttt_unroll_matches_serving_positions(data):
  """Training-time-test step i at row t = the head fed its own outputs at positions t + 1 .. t + i, as it drafts."""
  from flax import nnx

  import specjax
  from specjax.models.contract import StepInputs
  from specjax.train.config import resolve
  from specjax.train.losses import sequence_batch, target_features
  from specjax.train.trainers import make_trainer

  model = specjax.load(TINY)
  trainer = make_trainer(resolve(config(data), ['train.ttt_steps=3']), model, None)
  params = trainer.init(jax.random.key(3))
  target, head = model.module(), nnx.merge(trainer.graphdef, params)
  t_len = 12
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 500, (1, t_len)), jnp.int32)
  batch = sequence_batch(tokens)
  hidden, _ = jax.jit(lambda b: target_features(target, b))(batch)
  outs = jax.jit(lambda p, b, h: trainer.unroll(p, target, b, h))(params, batch, hidden)
  emb = target.embed(tokens)
  t = 5
  # Serving: the true pairs (h_s, x_{s+1}) for s <= t, then the head's own output with the next token.
  embeds, hs = list(emb[0, 1 : t + 2]), list(hidden[0, : t + 1])
  serve = jax.jit(lambda e, h: head(e, h, None, StepInputs.chain(None, jnp.asarray([e.shape[1]]), e.shape[1])))
  for i in range(3):
    out, _ = serve(jnp.stack(embeds)[None], jnp.stack(hs)[None])
    np.testing.assert_allclose(out[0, -1], outs[i][0, t], rtol=2e-4, atol=2e-5)
    embeds.append(emb[0, t + i + 2])
    hs.append(out[0, -1])


def test_data_parallel_matches_one_device(data, tmp_path):
  """4 forced host devices, batch split over them = 1 device (a subprocess: the device count is fixed at start)."""
  from specjax.train import run_training

  script = (
      'import sys, json, numpy as np, jax; from specjax.train import run_training\n'
      'assert len(jax.devices()) == 4\n'
      'r = run_training(json.loads(sys.argv[1]), sys.argv[2], progress=False)\n'
      'np.savez(sys.argv[3], *[np.asarray(x) for x in jax.tree.leaves(jax.device_get(r["params"]))])\n'
  )
  cfg = config(data, steps=3, save_every=0)
  cfg['eval'] = {'every': 0}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4'
  env = {**os.environ, 'XLA_FLAGS': flags.strip(), 'JAX_PLATFORMS': 'cpu'}
  env['PYTHONPATH'] = root + os.pathsep + env.get('PYTHONPATH', '')
  npz = str(tmp_path / 'dp.npz')
  proc = subprocess.run(
      [sys.executable, '-c', script, json.dumps(cfg), str(tmp_path / 'dp'), npz],
      env=env,
      cwd=root,  # not the caller's working directory, which a test may have left in a removed temp folder
      capture_output=True,
      text=True,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  one = run_training(cfg, str(tmp_path / 'one'), progress=False)
  four = np.load(npz)
  leaves = jax.tree.leaves(jax.device_get(one['params']))
  assert len(leaves) == len(four.files)
  # Four devices sum the gradient in another order. Adam's step is g / sqrt(v): for a gradient near zero that
  # ratio is rounding-sensitive, so a rare weight moves by a fraction of lr (seen: 1 of 2048 off by 0.024 lr).
  # Every weight stays within Adam's bound (lr per step), and all but a few per mille agree to 1e-4.
  lr, steps = cfg['train']['lr'], cfg['train']['steps']
  off = total = 0
  for i, x in enumerate(leaves):
    diff = np.abs(four[f'arr_{i}'] - x)
    assert diff.max() <= lr * steps, (i, diff.max())
    off += int(np.sum(diff > 5e-6 + 1e-4 * np.abs(x)))
    total += x.size
  assert off <= 2e-3 * total, (off, total)
  dp = [r['loss'] for r in train_lines(str(tmp_path / 'dp'))]
  np.testing.assert_allclose(dp, [r['loss'] for r in train_lines(str(tmp_path / 'one'))], rtol=1e-5)


@pytest.mark.parametrize(
    'overrides, message',
    [
        (['train.stepz=3'], "unknown config key 'train.stepz'"),
        (['data.path=EMPTY'], 'not enough training data'),
        (['drafter.kind=eagle3', 'drafter.draft_vocab_size=100000'], 'draft_vocab_size=100000 must be in 1..512'),
        (['drafter.kind=dflash', 'drafter.target_layer_ids=[1,6]'], r'target_layer_ids \[1, 6\]: \[6\] outside'),
        (['data.path=MISSING'], 'does not exist'),
        (['drafter.head_from_target=True'], "'drafter.head_from_target' applies to eagle3 and dflash, not mtp"),
        (['drafter.init_from=MISSING'], 'not an exported MTP head'),
        (['train.time_limit=-1'], "'train.time_limit' must be minutes"),
        (['train.stop_after=-2'], "'train.stop_after' must be at least 0"),
        (['drafter.kind=eagle3', 'drafter.head_from_target=True', 'drafter.init_from=MISSING'], 'both set the first'),
        (['drafter.tap_scale=True'], "'drafter.tap_scale' applies to eagle3 and dflash, not mtp"),
        (['drafter.kind=eagle3', 'drafter.tap_scale=True', 'drafter.fc_norm=True'], 'drafter.fc_norm normalises'),
        (  # a 2-layer target: the default taps (1, L/2 - 1, L - 4) = (1, 0, -2), before any data is read
            ['target.model=LLAMA', 'drafter.kind=eagle3', 'drafter.draft_vocab_size=64', 'drafter.tap_scale=True'],
            r"the default taps \[1, 0, -2\] \(outputs of layers 1, L/2 - 1, L - 4\): \[-2\] outside the target's 2 "
            r'layers \(0..1\); set drafter.target_layer_ids',
        ),
    ],
)
def test_bad_config_is_one_error_line(data, tmp_path, capsys, overrides, message):
  from specjax import cli

  (tmp_path / 'empty.jsonl').write_text('')
  paths = {
      'EMPTY': str(tmp_path / 'empty.jsonl'),
      'MISSING': str(tmp_path / 'no.jsonl'),
      'LLAMA': f'{FIXTURES}/tiny_llama3',
  }
  for name, path in paths.items():
    overrides = [o.replace(name, path) for o in overrides]
  cfg = tmp_path / 'cfg.py'
  cfg.write_text(f'import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({config(data)!r})\n')
  rc = cli.main(['train', str(cfg), '--out', str(tmp_path / 'out'), '--quiet', *overrides])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and err[0].startswith('error: '), err
  assert __import__('re').search(message, err[0]), err[0]
  if 'target.model=' in ' '.join(overrides):  # refused before any data is read or written
    assert not (tmp_path / 'out').exists()


def test_hard_targets_mix_the_argmax_into_the_target():
  """train.hard_targets=h: the loss's target is (1 - h) p + h one_hot(argmax p), value and gradient."""
  from specjax.train.losses import soft_ce

  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
  head = lambda h: h @ w
  dh, th = (jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32) for _ in range(2))
  valid = jnp.ones((2, 7), bool)

  def plain(dh, h):
    p = jax.nn.softmax(head(th), axis=-1)
    p = (1 - h) * p + h * jax.nn.one_hot(jnp.argmax(p, -1), 50)
    return jnp.sum(-jnp.sum(p * jax.nn.log_softmax(head(dh), axis=-1), axis=-1))

  for h in (0.0, 0.5, 1.0):
    chunked = lambda dh: soft_ce(head, head, dh, th, valid, chunk=3, hard=h)[0]
    np.testing.assert_allclose(chunked(dh), plain(dh, h), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(chunked)(dh), jax.grad(lambda x: plain(x, h))(dh), rtol=1e-4, atol=1e-6)
  from specjax.train.config import resolve

  with pytest.raises(SpecjaxError, match='hard_targets'):
    resolve({'data': {'path': 'x.jsonl'}}, ['train.hard_targets=1.5'])


def test_soft_ce_value_and_gradient():
  """The chunked loss (gradient computed in its forward pass) = the plain formula, value and gradient."""
  from specjax.train.losses import soft_ce, target_distribution

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
  head = lambda h: jnp.tanh(h @ w / 3) * 3  # a softcapped head
  dh, th = (jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32) for _ in range(2))
  valid = jnp.asarray(rng.random((2, 7)) < 0.7)

  def plain(dh):
    p = jax.nn.softmax(head(th), axis=-1)
    ce = -jnp.sum(p * jax.nn.log_softmax(head(dh), axis=-1), axis=-1)
    return jnp.sum(ce * valid)

  chunked = lambda dh: soft_ce(head, head, dh, th, valid, chunk=3)[0]
  np.testing.assert_allclose(chunked(dh), plain(dh), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(chunked)(dh), jax.grad(plain)(dh), rtol=1e-4, atol=1e-6)
  _, agree, count, rows = soft_ce(head, head, th, th, valid, chunk=4)
  assert agree == count == rows == valid.sum()
  # A draft vocabulary: the target distribution restricted to it; rows whose target argmax is outside don't count.
  ids = jnp.asarray([1, 4, 7, 9, 20, 33])
  draft_head = lambda h: head(h)[..., ids] * 0.5

  def restricted(dh):
    full = head(th)
    hit = valid & jnp.isin(jnp.argmax(full, -1), ids)
    p = jax.nn.softmax(full[..., ids], axis=-1)
    return jnp.sum(-jnp.sum(p * jax.nn.log_softmax(draft_head(dh), -1), -1) * hit), hit.sum()

  ce, agree, count, rows = soft_ce(draft_head, head, dh, th, valid, chunk=5, draft_ids=ids)
  np.testing.assert_allclose(ce, restricted(dh)[0], rtol=1e-5)
  assert rows == restricted(dh)[1] and count == valid.sum()
  grad = jax.grad(lambda x: soft_ce(draft_head, head, x, th, valid, chunk=5, draft_ids=ids)[0])(dh)
  np.testing.assert_allclose(grad, jax.grad(lambda x: restricted(x)[0])(dh), rtol=1e-4, atol=1e-6)
  # The target side computed once (as EAGLE-3's training-time test does) gives the same.
  dist = target_distribution(head, th, chunk=4, draft_ids=ids)
  once = lambda x: soft_ce(draft_head, head, x, dist, valid, chunk=5, draft_ids=ids)
  for got, want in zip(once(dh), (ce, agree, count, rows)):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: once(x)[0])(dh), grad, rtol=1e-5, atol=1e-7)


def test_mtp_export_is_qwen_layout(tmp_path):
  """A Qwen3.5 checkpoint's own MTP head, exported, gives back exactly its `mtp.*` tensors (hybrid targets)."""
  from safetensors.numpy import load_file

  import specjax
  from specjax.loading.mtp_head import load_mtp_head, save_mtp_head

  path = os.path.join(os.path.dirname(TINY), 'tiny_qwen3_5')
  model = specjax.load(path, mtp=True)
  save_mtp_head(str(tmp_path), model, model.heads['mtp'][1])
  original = {k: v for k, v in load_file(os.path.join(path, 'model.safetensors')).items() if k.startswith('mtp.')}
  exported = load_file(str(tmp_path / 'model.safetensors'))
  assert sorted(exported) == sorted(original)
  for name, w in original.items():
    np.testing.assert_array_equal(exported[name], w.astype(np.float32), err_msg=name)
  assert same(jax.device_get(load_mtp_head(str(tmp_path), model)[1]), jax.device_get(model.heads['mtp'][1]))


def test_regenerate_caches_the_targets_answers(tmp_path, monkeypatch):
  import specjax
  from specjax.train.regenerate import regenerate

  model = specjax.load(TINY)
  prompts = [model.tokenizer.encode(p) for p in ('the cat', 'birds sang in', 'a dog')]
  kwargs = dict(max_new_tokens=4, batch_size=2, cache_dir=str(tmp_path), progress=False)
  first = regenerate(model, prompts, **kwargs)
  plain, _ = specjax.Engine(model).generate(prompts, max_new_tokens=4)
  assert [e.ids for e in first] == [p + r.tokens for p, r in zip(prompts, plain)]
  assert [sum(e.mask) for e in first] == [len(r.tokens) for r in plain]
  (cached,) = os.listdir(tmp_path)
  with open(tmp_path / cached, 'a') as f:
    f.write('{"cut sho')  # a torn last line is dropped
  monkeypatch.setattr(specjax, 'Engine', None)  # from the cache: no engine
  again = regenerate(model, prompts, **kwargs)
  assert [e.ids for e in again] == [e.ids for e in first]


def test_regenerated_answers_are_keyed_by_the_weights(tmp_path):
  """Weights rewritten at the same path (same architecture and size) are a new target: its own answers, not the
  cached ones of the model that was there before (a drafter trained on those learns another model)."""
  from specjax.train.regenerate import cache_path
  from specjax.train.synthetic import make_synthetic_target

  import specjax

  path = str(tmp_path / 'target')
  make_synthetic_target(path, 'confident', tokenizer_from=TINY, layers=1, scale=1.0)
  before = specjax.load(path)
  make_synthetic_target(path, 'confident', tokenizer_from=TINY, layers=1, scale=8.0)  # same shapes, new head
  after = specjax.load(path)
  assert before.num_params == after.num_params and before.weights_fingerprint() != after.weights_fingerprint()
  assert cache_path(before, {}, str(tmp_path)) != cache_path(after, {}, str(tmp_path))
  assert cache_path(after, {}, str(tmp_path)) == cache_path(specjax.load(path), {}, str(tmp_path))


def test_hybrid_target_trains_one_sequence_per_row(data, tmp_path):
  from specjax.train import run_training

  cfg = config(data, steps=2, ttt_steps=2, save_every=0)
  cfg['target'] = {'model': os.path.join(os.path.dirname(TINY), 'tiny_qwen3_5')}
  cfg['eval'] = {'every': 0, 'limit': 0}  # nothing held out
  report = run_training(cfg, str(tmp_path / 'h'), progress=False)
  assert np.isfinite(report['loss'])
  manifest = json.load(open(tmp_path / 'h' / 'manifest.json'))
  assert manifest['data']['rows'] == 48  # packing is off for recurrent targets: one record per row


def test_regenerated_answers_serve_any_subset(tmp_path, monkeypatch, capsys):
  """The cache is per prompt: a subset, or a superset's known part, needs no engine (and says it is cached)."""
  import specjax
  from specjax.train.regenerate import regenerate

  model = specjax.load(TINY)
  prompts = [model.tokenizer.encode(p) for p in ('the cat', 'birds sang in', 'a dog')]
  kwargs = dict(max_new_tokens=3, batch_size=2, cache_dir=str(tmp_path), progress=False)
  full = regenerate(model, prompts, **kwargs)
  monkeypatch.setattr(specjax, 'Engine', None)
  capsys.readouterr()
  part = regenerate(model, prompts[2:0:-1], **{**kwargs, 'progress': True})
  assert [e.ids for e in part] == [full[2].ids, full[1].ids]
  (cache,) = os.listdir(tmp_path)
  assert capsys.readouterr().err == f'regenerate: all 2 answers cached in {tmp_path / cache}\n'
