"""DFlash training on the tiny Gemma 3 target: every training block = the serving block, the loss is the weighted
soft CE, loss falls, export round trip and serving, resume, cached features, bad configs."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY
from test_train import config, make_data, same, train_lines


def dflash_config(data, steps=12, **train):
  cfg = config(data, steps=steps, **train)
  cfg['drafter'] = {'kind': 'dflash', 'layers': 2, 'block_size': 4, 'anchors': 8}
  return cfg


@pytest.fixture(scope='module')
def model():
  import specjax

  return specjax.load(TINY)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  return make_data(tmp_path_factory.mktemp('data') / 'train.jsonl')


def packed_row():
  """One row of two sequences (10 and 12 tokens) and padding; positions restart per sequence."""
  tokens = np.random.default_rng(0).integers(5, 500, (1, 24)).astype(np.int32)
  segments = np.asarray([[1] * 10 + [2] * 12 + [0] * 2], np.int32)
  positions = np.asarray([list(range(10)) + list(range(12)) + [0, 0]], np.int32)
  mask = segments > 0
  return {
      k: jnp.asarray(v) for k, v in dict(tokens=tokens, positions=positions, segments=segments, loss_mask=mask).items()
  }


def trainer_for(model, data, **cfg_changes):
  from specjax.models.dflash import DFlashDraft
  from specjax.train.config import resolve
  from specjax.train.trainers import make_trainer

  trainer = make_trainer(resolve(dflash_config(data)), model, None)
  if cfg_changes:
    cfg = dataclasses.replace(trainer.cfg, **cfg_changes)
    graphdef = nnx.split(nnx.eval_shape(lambda: DFlashDraft(cfg, dtype=jnp.float32)))[0]
    trainer = dataclasses.replace(trainer, cfg=cfg, graphdef=graphdef)
  return trainer


def test_head_from_target_starts_the_final_norm_as_the_targets(model, data):
  from specjax.train.config import resolve
  from specjax.train.trainers import make_trainer

  trainer = make_trainer(resolve(dflash_config(data), ['drafter.head_from_target=True']), model, None)
  params, plain = trainer.init(jax.random.key(0)), trainer_for(model, data).init(jax.random.key(0))
  target = model.module()
  np.testing.assert_allclose(params['norm']['scale'][...], target.norm.offset + target.norm.scale[...], rtol=1e-6)
  del params['norm'], plain['norm']
  assert same(jax.device_get(params), jax.device_get(plain))  # nothing else changes


def serve_block(model, draft, tokens: np.ndarray, start: int) -> jax.Array:
  """What the drafter computes after committing tokens[:start]: norm(out) [B, D] of `[x_start, MASK...]`."""
  from specjax.cache.paged import KVCache
  from specjax.models.contract import StepInputs
  from specjax.models.dflash import block_mask

  target, cfg = model.module(), draft.cfg
  b = cfg.block_size
  pages = -(-(start + b) // 4)
  cache = KVCache.create(
      list(draft.cache_layout().kv_shapes),
      num_pages=pages + 1,
      page_size=4,
      block_tables=np.random.default_rng(1).permutation(np.arange(1, pages + 1)).astype(np.int32)[None],
  )

  @jax.jit  # one program per start (eager, each op would compile on its own)
  def run(prefix, block, cache):
    _, _, taps = target.forward(prefix, StepInputs.chain(None, jnp.asarray([start]), start), None, cfg.taps)
    ctx = draft.context(jnp.concatenate(taps, axis=-1))
    cache = draft.append_context(ctx, StepInputs.chain(cache, jnp.asarray([start]), start), cache)
    inputs = dataclasses.replace(StepInputs.chain(cache, jnp.asarray([b]), b), mask=block_mask(1, b))
    return draft.block(target.embed(block), inputs, cache)[0][0]

  block = jnp.asarray([[int(tokens[start])] + [cfg.mask_token_id] * (b - 1)], jnp.int32)
  return run(jnp.asarray(tokens[None, :start]), block, cache)


@pytest.mark.parametrize(
    'changes',
    [{}, {'windows': (5, 6), 'causal': (True, False)}],
    ids=['full', 'sliding-causal'],
)
def test_training_blocks_equal_serving_blocks(model, data, changes):
  """Anchors in both sequences of a packed row: each block's rows (and drafts) = the serving drafter's block."""
  trainer = trainer_for(model, data, **changes)
  params = trainer.init(jax.random.key(3))
  check_blocks(model, trainer, params, nnx.merge(trainer.graphdef, params))


def test_tap_scale_is_folded_into_the_export(model, data, tmp_path):
  """drafter.tap_scale: training reads taps / s through fc W; the export's fc is W / s and serves the same blocks."""
  trainer = trainer_for(model, data)
  e = len(trainer.taps) * model.config.hidden_size
  scale = np.exp(np.random.default_rng(0).normal(0, 2, e)).astype(np.float32)  # 0.02 .. 50
  trainer = dataclasses.replace(trainer, tap_scale=scale)
  params = trainer.init(jax.random.key(3))
  trainer.export(params, str(tmp_path))
  exported = trainer.load(str(tmp_path))
  np.testing.assert_allclose(exported['fc'][...], params['fc'][...] / scale[:, None], rtol=1e-6)
  check_blocks(model, trainer, params, nnx.merge(trainer.graphdef, exported))


def test_tap_scale_measures_each_channel(model, data):
  """The scale is each tap channel's RMS over real tokens past a sequence's first; make_trainer sets it."""
  from specjax.train.config import resolve
  from specjax.train.data import Packed
  from specjax.train.losses import target_features
  from specjax.train.trainers import make_trainer

  batch = {k: np.asarray(v) for k, v in packed_row().items()}
  rows = Packed(batch['tokens'], batch['positions'], batch['segments'], batch['loss_mask'])
  trainer = make_trainer(resolve(dflash_config(data), ['drafter.tap_scale=True']), model, rows)
  _, taps = jax.jit(lambda b: target_features(model.module(), b, trainer.taps))(batch)
  keep = (batch['segments'] > 0) & (batch['positions'] > 0)
  scaled = np.concatenate(taps, axis=-1)[keep] / trainer.tap_scale
  np.testing.assert_allclose(np.sqrt(np.mean(scaled**2, axis=0)), 1.0, rtol=1e-4)
  with pytest.raises(__import__('specjax').errors.SpecjaxError, match='no'):
    make_trainer(resolve(dflash_config(data), ['drafter.tap_scale=True']), model, None)


def check_blocks(model, trainer, params, draft):
  """Training blocks from `params` = the serving blocks of `draft`, for anchors in both sequences of a packed row."""
  from specjax.train.losses import target_features

  target, batch = model.module(), packed_row()
  anchors = jnp.asarray([[7, 16, 12, 20]], jnp.int32)  # positions 7 | 6, 2, 10 of the second sequence
  _, taps = jax.jit(lambda b: target_features(target, b, trainer.taps))(batch)
  blocks = jax.jit(lambda p, b, x, a: trainer.blocks(p, target, b, x, a))(params, batch, taps, anchors)
  tokens, segments, positions = (np.asarray(batch[k][0]) for k in ('tokens', 'segments', 'positions'))
  drafts = jax.jit(lambda h: jnp.argmax(target.logits(h[1:]), axis=-1))
  for i, row in enumerate(np.asarray(anchors[0])):
    seq = tokens[segments == segments[row]]
    want = serve_block(model, draft, seq, int(positions[row]))
    got = blocks[0, i]
    np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()), rtol=0)
    np.testing.assert_array_equal(drafts(got), drafts(want))


def test_loss_is_the_weighted_soft_ce(model, data):
  """The loss = Σ_k w_k CE_k / Σ_k w_k n_k (rows k >= 1, labels inside the anchor's sequence), w_k = exp(-(k-1)/γ)."""
  from specjax.train.dflash import sample_anchors
  from specjax.train.losses import target_features

  trainer = trainer_for(model, data)
  params, target, batch = trainer.init(jax.random.key(1)), model.module(), packed_row()
  batch['loss_mask'] = batch['loss_mask'].at[0, 3:6].set(False)
  key = jax.random.key(5)
  loss, metrics = jax.jit(lambda p, b: trainer.loss(p, target, b, key))(params, batch)
  hidden, taps = jax.jit(lambda b: target_features(target, b, trainer.taps))(batch)
  anchors, keep = sample_anchors(key, batch, trainer.anchors)
  a, keep = np.asarray(anchors[0]), np.asarray(keep[0])
  seg, lm = np.asarray(batch['segments'][0]), np.asarray(batch['loss_mask'][0])
  ok = (seg[:-1] > 0) & (seg[1:] == seg[:-1]) & lm[1:]
  assert keep.all() and len(set(a)) == 8 and ok[a].all()  # 8 distinct anchors whose next token is learned
  again, _ = sample_anchors(key, batch, 64)
  assert sorted(np.asarray(again[0])[np.asarray(_[0])]) == list(np.flatnonzero(ok))  # all of them when asked for more
  out = jax.jit(lambda p, b, x, a: trainer.blocks(p, target, b, x, a))(params, batch, taps, anchors)[0]
  logits = jax.jit(target.logits)
  num = den = 0.0
  for k in range(1, 4):
    at = a + k
    valid = (at < 24) & (seg[np.minimum(at, 23)] == seg[a]) & lm[np.minimum(at, 23)]
    q = jax.nn.log_softmax(logits(out[:, k]), -1)
    p = jax.nn.softmax(logits(hidden[0, np.minimum(at, 23) - 1]), -1)
    ce = -np.sum(np.asarray(p * q), -1)
    num, den = num + np.exp(-(k - 1) / 7) * np.sum(ce * valid), den + np.exp(-(k - 1) / 7) * valid.sum()
    assert metrics['count'][k - 1] == valid.sum()
    assert metrics['agree'][k - 1] == np.sum(valid & (np.argmax(q, -1) == np.argmax(p, -1)))
  np.testing.assert_allclose(loss, num / den, rtol=1e-5)


def test_context_dropout_blinds_training_blocks_only(model, data):
  """A blind block's rows do not depend on the context; with a step key some blocks go blind (p = 0.5), and the
  eval (key None) scores every block with its context, as without the option."""
  from specjax.train.dflash import sample_anchors
  from specjax.train.losses import target_features

  plain = trainer_for(model, data)
  dropping = dataclasses.replace(plain, context_dropout=0.5)
  params, target, batch = plain.init(jax.random.key(1)), model.module(), packed_row()
  _, taps = jax.jit(lambda b: target_features(target, b, plain.taps))(batch)
  anchors, _ = sample_anchors(jax.random.key(5), batch, plain.anchors)
  blind = jnp.ones(anchors.shape, bool)
  other = tuple(jax.random.normal(jax.random.key(i), t.shape) for i, t in enumerate(taps))
  blocks = jax.jit(lambda x, mask: plain.blocks(params, target, batch, x, anchors, mask))
  seeing = blocks(taps, None)
  np.testing.assert_array_equal(blocks(taps, blind), blocks(other, blind))
  assert not np.allclose(blocks(taps, blind), seeing)
  loss = lambda trainer, key: jax.jit(lambda p, b: trainer.loss(p, target, b, key))(params, batch)[0]
  assert loss(dropping, None) == loss(plain, None)
  assert loss(dropping, jax.random.key(5)) != loss(plain, jax.random.key(5))


@pytest.fixture(scope='module')
def trained(data, tmp_path_factory):
  from specjax.train import run_training

  out = str(tmp_path_factory.mktemp('run') / 'df')
  return out, run_training(dflash_config(data), out, progress=False)


def test_dflash_trains_exports_and_serves(model, trained):
  from specjax.drafters import make_drafter
  from specjax.loading.dflash import load_dflash

  import specjax

  out, report = trained
  lines = [r for r in train_lines(out) if r['type'] == 'train']
  first, last = np.mean([r['loss'] for r in lines[:3]]), np.mean([r['loss'] for r in lines[-3:]])
  assert last < first - 0.1, (first, last)
  assert all(len(r['agree']) == 3 for r in lines) and report['tokens_per_s'] > 0
  assert [r['step'] for r in train_lines(out) if r['type'] == 'eval'] == [6, 12]
  export = os.path.join(out, 'export')
  ckpt = load_dflash(export, model, dtype='float32')
  assert same(jax.device_get(ckpt.params), jax.device_get(report['params']))
  cfg = ckpt.config
  assert (cfg.block_size, cfg.mask_token_id, cfg.taps, cfg.num_target_layers) == (4, 4, (1, 3), 6)  # 4: <mask>
  prompts = ['the cat sat on the', 'birds sang in']
  plain, _ = specjax.Engine(model, page_size=4).generate(prompts, max_new_tokens=10)
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter('dflash', model, draft_model=export))
  spec, _ = engine.generate(prompts, max_new_tokens=10, num_draft=3)
  assert [r.tokens for r in spec] == [r.tokens for r in plain]


def test_resume_after_kill_matches(data, trained, tmp_path):
  from specjax.train import run_training

  out_a, report_a = trained
  out = str(tmp_path / 'b')
  assert run_training(dflash_config(data), out, progress=False, stop_at=6)['stopped_at'] == 6  # checkpoint at 4
  report = run_training(dflash_config(data), out, progress=False)
  assert report['start_step'] == 4
  assert same(jax.device_get(report['params']), jax.device_get(report_a['params']))
  strip = lambda rows: [{k: v for k, v in r.items() if k != 'tokens_per_s'} for r in rows]
  assert strip(train_lines(out)) == strip(train_lines(out_a))


def test_cached_target_features_train_the_same(data, tmp_path):
  from specjax.train import run_training

  cfg = dflash_config(data, steps=3)
  cfg['eval'] = {'every': 0}
  plain = run_training(cfg, str(tmp_path / 'plain'), progress=False)
  cached = run_training({**cfg, 'train': {**cfg['train'], 'cache_target': True}}, str(tmp_path / 'c'), progress=False)
  close = jax.tree.map(lambda x, y: np.allclose(x, y, rtol=1e-4, atol=1e-5), plain['params'], cached['params'])
  assert all(jax.tree.leaves(close))
  a, b = (train_lines(str(tmp_path / name)) for name in ('plain', 'c'))
  np.testing.assert_allclose([r['loss'] for r in a], [r['loss'] for r in b], rtol=1e-5)
  assert [r['agree'] for r in a] == [r['agree'] for r in b]


@pytest.mark.parametrize(
    'overrides, message',
    [
        (['drafter.block_size=1'], "'drafter.block_size' must be at least 2"),
        (['drafter.anchors=0'], "'drafter.anchors' must be at least 1"),
        (['train.dflash_gamma=0'], "'train.dflash_gamma' must be positive"),
        (
            ['drafter.mask_token_id=512'],
            r'mask_token_id=512 must be a token id inside the target vocabulary \(0..511\)',
        ),
        (['drafter.target_layer_ids=[1,5]'], r'target_layer_ids \[1, 5\] must be in 0..4'),
        (['drafter.tap_scale=True', "drafter.init_from='x'"], 'cannot rescale a drafter.init_from'),
        (['drafter.context_dropout=1.0'], r'context_dropout\' must be in \[0, 1\)'),
    ],
)
def test_bad_config_is_one_error_line(data, tmp_path, capsys, overrides, message):
  from specjax import cli

  cfg = tmp_path / 'cfg.py'
  cfg.write_text(
      f'import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({dflash_config(data)!r})\n'
  )
  rc = cli.main(['train', str(cfg), '--out', str(tmp_path / 'out'), '--quiet', *overrides])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and err[0].startswith('error: '), err
  assert __import__('re').search(message, err[0]), err[0]
