"""EAGLE-3 training on the tiny target: draft vocabulary, the TTT unroll = serving positions (every norm variant),
loss falls, export round trip."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY
from test_train import config, make_data, same, train_lines


def test_draft_vocabulary():
  from specjax.train.data import Packed
  from specjax.train.eagle3 import draft_vocabulary

  tokens = np.asarray([[5, 5, 5, 2, 2, 9, 7, 7]], np.int32)
  mask = np.asarray([[1, 1, 1, 1, 1, 1, 0, 0]], bool)  # 7 is never learned
  data = Packed(tokens, np.zeros_like(tokens), np.ones_like(tokens), mask)
  d2t, t2d = draft_vocabulary(data, 12, 3)
  np.testing.assert_array_equal(np.arange(3) + d2t, [2, 5, 9])  # by count, sorted by id
  assert t2d.sum() == 3 and t2d[[2, 5, 9]].all()
  d2t, _ = draft_vocabulary(data, 12, 5)  # fewer seen tokens than asked: the lowest unseen ids fill in
  np.testing.assert_array_equal(np.arange(5) + d2t, [0, 1, 2, 5, 9])


def eagle3_config(data, **train):
  cfg = config(data, **train)
  cfg['drafter'] = {'kind': 'eagle3', 'draft_vocab_size': 128}
  return cfg


VARIANTS = {  # drafter.* overrides
    'speculators': [],
    'specforge': ['drafter.norm_before_residual=False'],
    'eagle3.1': ['drafter.fc_norm=True', 'drafter.norm_output=True', 'drafter.norm_before_fc=True'],
    'tap-scale': [],  # speculators' head trained on taps / s (drafter.tap_scale), served with s folded into fc
}


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_ttt_unroll_matches_serving_positions(tmp_path, variant):
  from flax import nnx

  import specjax
  from specjax.models.contract import StepInputs
  from specjax.train.config import resolve
  from specjax.train.losses import sequence_batch, target_features
  from specjax.train.trainers import make_trainer

  model = specjax.load(TINY)
  cfg = resolve(eagle3_config(make_data(tmp_path / 'd.jsonl', 6)), ['train.ttt_steps=3', *VARIANTS[variant]])
  trainer = make_trainer(cfg, model, None)
  assert trainer.cfg.norm_before_residual is (variant != 'specforge')
  assert trainer.cfg.fc_norm is trainer.cfg.norm_output is trainer.cfg.norm_before_fc is (variant == 'eagle3.1')
  params = trainer.init(jax.random.key(3))
  perturb = lambda path, x: x * (1 + 0.3 * jnp.sin(jnp.arange(x.size).reshape(x.shape))) if 'norm' in str(path) else x
  params = jax.tree.map_with_path(perturb, params)  # norm weights away from their initial ones
  if variant == 'tap-scale':
    e = len(trainer.taps) * model.config.hidden_size
    trainer = dataclasses.replace(
        trainer, tap_scale=np.exp(np.random.default_rng(1).normal(0, 2, e)).astype(np.float32)
    )
  target, head = model.module(), nnx.merge(trainer.graphdef, trainer.served(params))
  t_len = 12
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 500, (1, t_len)), jnp.int32)
  batch = sequence_batch(tokens)
  _, taps = jax.jit(lambda b: target_features(target, b, trainer.taps))(batch)
  outs = jax.jit(lambda p, b, x: trainer.unroll(p, target, b, x))(params, batch, taps)
  fused, emb = head.fuse(jnp.concatenate(taps, axis=-1)), target.lookup(tokens)
  serve = jax.jit(lambda e, h: head.forward(e, h, StepInputs.chain(None, jnp.asarray([e.shape[1]]), e.shape[1]), None))
  t = 5
  # Serving: pairs (fused taps at s, x_{s+1}) for s <= t, then the head's own output with the next token.
  embeds, hs = list(emb[0, 1 : t + 2]), list(fused[0, : t + 1])
  for i in range(3):
    out, _ = serve(jnp.stack(embeds)[None], jnp.stack(hs)[None])
    np.testing.assert_allclose(out[0, -1], outs[i][0, t], rtol=2e-4, atol=2e-5)
    embeds.append(emb[0, t + i + 2])
    hs.append(out[0, -1])


@pytest.mark.parametrize('tap_scale', [False, True])
def test_head_from_target_starts_with_the_targets_head(tmp_path, tap_scale):
  """drafter.head_from_target: the initial head is the target's logit lens on its last tap (draft vocabulary),
  as served also with drafter.tap_scale (fc starts as the scale, folded out at export)."""
  from flax import nnx

  import specjax
  from specjax.models.contract import StepInputs
  from specjax.train.config import resolve
  from specjax.train.trainers import make_trainer

  model = specjax.load(TINY)
  data = make_data(tmp_path / 'd.jsonl', 6)
  cfg = resolve(eagle3_config(data), ['drafter.head_from_target=True'])
  trainer = make_trainer(cfg, model, None)
  d = model.config.hidden_size
  if tap_scale:
    scale = np.exp(np.random.default_rng(1).normal(0, 2, len(trainer.taps) * d)).astype(np.float32)
    trainer = dataclasses.replace(trainer, tap_scale=scale)
  head, target = nnx.merge(trainer.graphdef, trainer.served(trainer.init(jax.random.key(0)))), model.module()
  taps = jax.random.normal(jax.random.key(1), (1, 4, len(trainer.taps) * d)) * 5.0  # residuals at 4 positions
  embeds = jax.random.normal(jax.random.key(2), (1, 4, d))
  want = target.logits(target.norm(taps[..., -d:]), trainer.draft_ids())  # the logit lens of the last tap
  out = head.forward(embeds, head.fuse(taps), StepInputs.chain(None, jnp.asarray([4]), 4), None)[0]
  np.testing.assert_allclose(head.logits(out), want, rtol=1e-5, atol=1e-5)
  cold = nnx.merge(trainer.graphdef, make_trainer(resolve(eagle3_config(data)), model, None).init(jax.random.key(0)))
  assert not np.allclose(cold.logits(out), want, atol=1e-2)


def test_eagle3_trains_and_exports(tmp_path):
  from specjax.loading.eagle3 import load_eagle3
  from specjax.train import run_training

  import specjax

  data = make_data(tmp_path / 'd.jsonl')
  out = str(tmp_path / 'e3')
  report = run_training(eagle3_config(data, steps=12, ttt_steps=3), out, progress=False)
  lines = [r for r in train_lines(out) if r['type'] == 'train']
  assert np.mean([r['loss'] for r in lines[-3:]]) < np.mean([r['loss'] for r in lines[:3]]) - 0.1
  assert all(len(r['agree']) == 3 for r in lines)
  ckpt = load_eagle3(os.path.join(out, 'export'), specjax.load(TINY), dtype='float32')
  assert same(jax.device_get(ckpt.params), jax.device_get(report['params']))
  assert ckpt.d2t.shape == (128,) and ckpt.t2d.sum() == 128
  assert ckpt.config.taps == (1, 2, 2)  # layers 1, L/2 - 1, L - 4 of the 6-layer target
  assert ckpt.config.norm_before_residual  # the config's default, exported in config.json
  variant = run_training(eagle3_config(data, steps=1, ttt_steps=2), str(tmp_path / 'e31'), VARIANTS['eagle3.1'])
  ckpt = load_eagle3(str(tmp_path / 'e31' / 'export'), specjax.load(TINY), dtype='float32')
  assert ckpt.config.fc_norm and ckpt.config.norm_output and ckpt.config.norm_before_fc
  assert same(jax.device_get(ckpt.params), jax.device_get(variant['params']))


def test_cached_target_features_train_the_same(tmp_path):
  """`train.cache_target`: the target runs once per row; the steps then match the in-step target's."""
  from specjax.train import run_training

  data = make_data(tmp_path / 'd.jsonl')
  cfg = eagle3_config(data, steps=3, ttt_steps=2)
  plain = run_training(cfg, str(tmp_path / 'plain'), progress=False)
  cached_out = str(tmp_path / 'cached')
  cached = run_training({**cfg, 'train': {**cfg['train'], 'cache_target': True}}, cached_out, progress=False)
  close = jax.tree.map(lambda x, y: np.allclose(x, y, rtol=1e-4, atol=1e-5), plain['params'], cached['params'])
  assert all(jax.tree.leaves(close))
  lines = [r for r in train_lines(cached_out) if r['type'] == 'train']
  plain_lines = [r for r in train_lines(str(tmp_path / 'plain')) if r['type'] == 'train']
  np.testing.assert_allclose(lines[-1]['agree'], plain_lines[-1]['agree'], atol=1e-6)
  features = os.path.join(cached_out, 'target_features', 'train')
  with open(os.path.join(features, 'meta.json')) as f:
    meta = json.load(f)
  hidden = np.load(os.path.join(features, 'hidden.npy'), mmap_mode='r')
  assert meta['done'] == meta['rows'] == hidden.shape[0] and meta['taps'] == [1, 2, 2]
  stamp = os.path.getmtime(os.path.join(features, 'hidden.npy'))
  run_training({**cfg, 'train': {**cfg['train'], 'cache_target': True}}, cached_out, progress=False)
  assert os.path.getmtime(os.path.join(features, 'hidden.npy')) == stamp  # a rerun reads them back


def test_target_features_resume_and_refresh(tmp_path, capsys):
  """An interrupted feature pass resumes at its last written row (and says so); other rows start over."""
  import specjax
  from specjax.train.data import Packed
  from specjax.train.features import target_features

  target = specjax.load(TINY)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 100, (5, 16)).astype(np.int32)
  rows = Packed(tokens, np.tile(np.arange(16, dtype=np.int32), (5, 1)), np.ones_like(tokens), np.ones((5, 16), bool))
  path = str(tmp_path / 'f')
  full = target_features(path, target, rows, (1, 2), batch_size=2, progress=False)
  want = {k: np.array(v) for k, v in full.take(np.arange(5)).items()}
  assert want['target_taps'].shape == (5, 16, 2 * target.config.hidden_size)
  with open(os.path.join(path, 'meta.json')) as f:
    meta = json.load(f)
  with open(os.path.join(path, 'meta.json'), 'w') as f:
    json.dump({**meta, 'done': 3}, f)
  mm = np.load(os.path.join(path, 'hidden.npy'), mmap_mode='r+')
  mm[3:] = 0  # rows 3.. lost to a kill
  mm.flush()
  capsys.readouterr()
  again = target_features(path, target, rows, (1, 2), batch_size=2, progress=True)
  for k, v in again.take(np.arange(5)).items():
    np.testing.assert_array_equal(v, want[k])
  assert capsys.readouterr().err.splitlines() == [
      f'target features: the target runs over 2 of 5 rows (3 cached) into {path}',
      'target features: 5/5 rows',
  ]
  target_features(path, target, rows, (1, 2), batch_size=2, progress=True)
  assert capsys.readouterr().err == f'target features: all 5 rows cached in {path}\n'
  other = Packed(tokens[::-1].copy(), rows.positions, rows.segments, rows.loss_mask)
  flipped = target_features(path, target, other, (1, 2), batch_size=2, progress=False)
  np.testing.assert_allclose(flipped.take([0])['target_hidden'], want['target_hidden'][4:5], atol=1e-5)
