"""EAGLE-3 head: parity with SafeAILab/EAGLE's cnets.py, both checkpoint layouts, norm variants, save round trip,
bad input."""

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
from specjax.errors import SpecjaxError
from specjax.loading import eagle3 as eagle3_loading
from specjax.loading.eagle3 import load_eagle3, save_eagle3
from specjax.models.contract import StepInputs
from specjax.models.eagle3 import Eagle3Config, Eagle3Head
from specjax.models.layers import Rope
from conftest import FIXTURES, TINY, close, shuffled_cache

LAYOUT1 = f'{FIXTURES}/tiny_eagle3'
SPECULATORS = f'{FIXTURES}/tiny_eagle3_speculators'


@pytest.fixture(scope='module')
def target():
  return specjax.load(f'{FIXTURES}/tiny_llama3')


@pytest.fixture(scope='module')
def ref():
  return np.load(f'{FIXTURES}/tiny_eagle3_reference.npz')


@pytest.fixture(scope='module')
def ckpt(target):
  return load_eagle3(LAYOUT1, target)


def target_taps(target, ckpt, ids, lens):
  """[B, T, 3H]: the target's taps (cache-free forward) of the ragged rows `ids` [B, T]."""
  tok = jnp.asarray(np.maximum(ids, 0))
  inputs = StepInputs.chain(None, jnp.asarray(lens), ids.shape[1])
  _, _, taps = target.module().forward(tok, inputs, None, taps=ckpt.config.taps)
  return jnp.concatenate(taps, axis=-1)


def test_config_and_vocab_map(ckpt, ref):
  cfg = ckpt.config
  assert cfg.taps == tuple(ref['tap_layers']) == (0, 1, 1)
  assert (cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size, cfg.target_hidden_size) == (64, 96, 512, 64)
  assert cfg.rope == Rope(base=500000.0) and cfg.max_position_embeddings == 512 and not cfg.has_embedding
  np.testing.assert_array_equal(ckpt.d2t, ref['d2t'])
  np.testing.assert_array_equal(ckpt.t2d, ref['t2d'])
  assert ckpt.d2t.dtype == np.int32 and ckpt.t2d.dtype == bool
  assert ckpt.module().cache_layout().kv_shapes == ((2, 16),)


def test_teacher_forced_logits_match_upstream(target, ckpt, ref):
  """(a) Cache-free, both rows in one ragged batch: pair t = (taps of position t, token t + 1) at position t."""
  head = ckpt.module()
  ids, n = ref['input_ids'], ref['input_lens'] - 1  # pairs per row
  t = ids.shape[1] - 1
  taps = target_taps(target, ckpt, ids[:, :t], n)
  for row in range(2):
    close(taps[row, : n[row]], ref['taps'][row, : n[row]])
  embeds = target.module().lookup(jnp.asarray(np.maximum(ids[:, 1:], 0)))
  out, cache = head.forward(embeds, head.fuse(taps), StepInputs.chain(None, jnp.asarray(n), t), None)
  assert cache is None
  logits = head.logits(out)
  for row in range(2):
    close(out[row, : n[row]], ref['tf_hidden'][row, : n[row]])
    close(logits[row, : n[row]], ref['tf_logits'][row, : n[row]])


def test_chain_matches_upstream(target, ckpt, ref):
  """(b) Paged cache: the prefix as one chain, then K single-token steps feeding the layer output back."""
  head, tgt = ckpt.module(), target.module()
  ids, n = ref['input_ids'], ref['input_lens'] - 1
  b, t = ids.shape[0], ids.shape[1] - 1
  k = ref['chain_draft_ids'].shape[1]
  taps = target_taps(target, ckpt, ids[:, :t], n)
  cache = shuffled_cache(head.cache_layout().kv_shapes, b, t + k)
  step = jax.jit(lambda e, h, inputs, c: head.forward(e, h, inputs, c))
  embeds = tgt.lookup(jnp.asarray(np.maximum(ids[:, 1:], 0)))
  out, cache = step(embeds, head.fuse(taps), StepInputs.chain(cache, jnp.asarray(n), t), cache)
  last = out[jnp.arange(b), jnp.asarray(n) - 1][:, None]  # [B, 1, D] at position n - 1
  drafts, targets, logits, hidden, positions = [], [], [], [], []
  for i in range(k):
    if i:
      inputs = StepInputs.chain(cache, jnp.ones((b,), jnp.int32), 1)
      positions.append(np.asarray(inputs.positions[:, 0]))
      last, cache = step(tgt.lookup(jnp.asarray(targets[-1])[:, None]), last, inputs, cache)
    step_logits = head.logits(last[:, 0])
    draft = np.asarray(jnp.argmax(step_logits, axis=-1))
    drafts.append(draft)
    targets.append(draft + ckpt.d2t[draft])
    logits.append(step_logits)
    hidden.append(last[:, 0])
  np.testing.assert_array_equal(np.stack(drafts, 1), ref['chain_draft_ids'])
  np.testing.assert_array_equal(np.stack(targets, 1), ref['chain_target_ids'])
  np.testing.assert_array_equal(np.stack(positions, 1), ref['chain_positions'][:, 1:])
  close(jnp.stack(logits, 1), ref['chain_logits'])
  close(jnp.stack(hidden, 1), ref['chain_hidden'])
  assert list(np.asarray(cache.lengths)) == list(n + k - 1)


def test_layouts_load_identical_params(target, ckpt):
  other = load_eagle3(SPECULATORS, target)
  assert other.config == ckpt.config
  np.testing.assert_array_equal(other.d2t, ckpt.d2t)
  np.testing.assert_array_equal(other.t2d, ckpt.t2d)
  same = jax.tree.map(np.array_equal, nnx.to_pure_dict(other.params), nnx.to_pure_dict(ckpt.params))
  assert all(jax.tree.leaves(same))


def test_vllm_spellings(tmp_path, target, ckpt):
  """vLLM's architecture name, and a top-level id list (vLLM's reading: id j = output of layer j - 1)."""
  config = {
      'architectures': ['Eagle3LlamaForCausalLM'],
      'eagle_config': None,
      'eagle_aux_hidden_state_layer_ids': [1, 2, 2],
  }
  assert_same(load_eagle3(broken(tmp_path, LAYOUT1, config=config), target), ckpt)


def assert_same(a, b):
  assert a.config == b.config
  np.testing.assert_array_equal(a.d2t, b.d2t)
  assert (a.t2d is None and b.t2d is None) or np.array_equal(a.t2d, b.t2d)
  pa, pb = nnx.to_pure_dict(a.params), nnx.to_pure_dict(b.params)
  assert jax.tree.structure(pa) == jax.tree.structure(pb)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    assert x.dtype == y.dtype and np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_save_round_trip(tmp_path, target, ckpt):
  save_eagle3(str(tmp_path / 'f32'), ckpt.config, ckpt.params, ckpt.d2t, ckpt.t2d)
  assert_same(load_eagle3(str(tmp_path / 'f32'), target), ckpt)
  hf = json.loads((tmp_path / 'f32' / 'config.json').read_text())
  assert hf['architectures'] == ['LlamaForCausalLMEagle3'] and hf['eagle_config'][
      'eagle_aux_hidden_state_layer_ids'
  ] == [0, 1, 1]
  assert hf['max_position_embeddings'] == 512 and hf['draft_vocab_size'] == 96 and hf['rope_theta'] == 500000.0
  half = load_eagle3(LAYOUT1, target, dtype='bfloat16')  # the fixture's weights are bf16: no rounding
  save_eagle3(str(tmp_path / 'bf16'), half.config, nnx.to_pure_dict(half.params), half.d2t, None)
  assert load_file(tmp_path / 'bf16' / 'model.safetensors')['fc.weight'].dtype.name == 'bfloat16'
  again = load_eagle3(str(tmp_path / 'bf16'), target, dtype='bfloat16')
  assert again.t2d is None
  assert_same(again, dataclasses.replace(half, t2d=None))


def test_save_is_atomic_with_the_umask_modes(tmp_path, ckpt, monkeypatch):
  """An export's files get 0666 less the umask (safetensors alone writes 0600), its directory 0777 less it; a write
  cut short leaves an earlier export as it was, and no partial one or temporary folder."""
  import safetensors.numpy

  path = tmp_path / 'export'
  save = lambda where: save_eagle3(str(where), ckpt.config, ckpt.params, ckpt.d2t, ckpt.t2d)
  umask = os.umask(0o027)
  try:
    save(path)
  finally:
    os.umask(umask)
  modes = {name: stat.S_IMODE(os.stat(path / name).st_mode) for name in os.listdir(path)}
  assert modes == {'config.json': 0o640, 'model.safetensors': 0o640} and stat.S_IMODE(os.stat(path).st_mode) == 0o750
  save(path)  # rewritten in place (as at every training checkpoint): the umask's modes again
  assert stat.S_IMODE(os.stat(path / 'model.safetensors').st_mode) == 0o666 & ~umask
  before = {name: (path / name).read_bytes() for name in os.listdir(path)}

  def cut_short(tensors, filename, metadata=None):
    with open(filename, 'wb') as f:
      f.write(b'partial')
    raise OSError('disk full')

  monkeypatch.setattr(safetensors.numpy, 'save_file', cut_short)
  for where in (path, tmp_path / 'new'):
    with pytest.raises(OSError, match='disk full'):
      save(where)
  assert os.listdir(tmp_path) == ['export']
  assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before
  monkeypatch.undo()
  (path / 'model.safetensors').unlink()
  (path / 'notes.txt').write_text('mine')  # a folder with other files: they stay, ours are renamed in
  save(path)
  assert sorted(os.listdir(path)) == ['config.json', 'model.safetensors', 'notes.txt']
  assert (path / 'notes.txt').read_text() == 'mine' and os.listdir(tmp_path) == ['export']
  assert (path / 'model.safetensors').read_bytes() == before['model.safetensors']


def test_norm_variants(tmp_path, target, ckpt):
  """norm_before_fc, fc_norm (EAGLE 3.1) and norm_output, read from a checkpoint, against the plain head.

  The taps go through `input_norm` (one RMS norm over all of them), then one RMS norm per tap, then `fc`; with
  `norm_output` a step's output is the final-normed residual stream, and `logits` does not norm it again.
  """
  rng = np.random.default_rng(4)
  norms = {'input_norm.weight': rng.uniform(0.5, 1.5, 192).astype(np.float32)}
  norms.update({f'fc_norm.{i}.weight': rng.uniform(0.5, 1.5, 64).astype(np.float32) for i in range(3)})
  flags = {'eagle_config.norm_before_fc': True, 'fc_norm': True, 'norm_output': True}  # vLLM reads both places
  variant = load_eagle3(broken(tmp_path, LAYOUT1, config=flags, tensors=norms), target, dtype='float32')
  assert variant.config == dataclasses.replace(ckpt.config, norm_before_fc=True, fc_norm=True, norm_output=True)
  plain, head = load_eagle3(LAYOUT1, target, dtype='float32').module(), variant.module()
  taps = np.asarray(jax.random.normal(jax.random.key(0), (2, 5, 192))) * np.repeat([3.0, 40.0, 900.0], 64)
  rms = lambda x: np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + 1e-5)
  x = taps / rms(taps) * norms['input_norm.weight']
  x = np.concatenate([c / rms(c) * norms[f'fc_norm.{i}.weight'] for i, c in enumerate(np.split(x, 3, -1))], -1)
  want = plain.fuse(jnp.asarray(x, jnp.float32))
  fused = head.fuse(jnp.asarray(taps, jnp.float32))
  close(fused, want)
  embeds = target.module().lookup(jnp.asarray([[5, 9, 11, 2, 7], [3, 3, 8, 1, 0]]))
  inputs = StepInputs.chain(None, jnp.asarray([5, 4]), 5)
  residual, _ = plain.forward(embeds, fused, inputs, None)
  out, _ = head.forward(embeds, fused, inputs, None)
  close(out, plain.norm(residual))  # what the next step reads
  close(head.logits(out), plain.logits(residual))
  save_eagle3(str(tmp_path / 'saved'), variant.config, variant.params, variant.d2t, variant.t2d)
  hf = json.loads((tmp_path / 'saved' / 'config.json').read_text())
  assert (hf['norm_before_fc'], hf['fc_norm'], hf['norm_output']) == (True, True, True)
  assert set(norms) <= set(load_file(tmp_path / 'saved' / 'model.safetensors'))
  assert_same(load_eagle3(str(tmp_path / 'saved'), target, dtype='float32'), variant)


def tiny_config(**kw) -> Eagle3Config:
  base = dict(
      hidden_size=64,
      intermediate_size=48,
      num_heads=4,
      num_kv_heads=2,
      head_dim=24,  # heads x head_dim = 96 != 64
      norm_eps=1e-5,
      rope=Rope(base=10000.0, kind='llama3', factor=8.0, original_max_position_embeddings=64),
      vocab_size=512,
      draft_vocab_size=40,
      taps=(1, 0),
      max_position_embeddings=4096,
  )
  return Eagle3Config(**{**base, **kw})


def test_random_init_own_embedding_round_trip(tmp_path, target):
  """A randomly initialised head with its own embedding, two taps and llama3 RoPE: save and load back."""
  cfg = tiny_config(has_embedding=True, norm_before_residual=True)
  a, b = Eagle3Head(cfg, rngs=nnx.Rngs(1)), Eagle3Head(cfg, rngs=nnx.Rngs(2))
  assert not np.array_equal(a.fc[...], b.fc[...])
  d2t = np.arange(40, dtype=np.int64) * 12 - np.arange(40)  # target ids 0, 12, ..., 468
  save_eagle3(str(tmp_path), cfg, nnx.state(a, nnx.Param), d2t)
  back = load_eagle3(str(tmp_path), target)
  assert back.config == cfg and back.t2d is None
  np.testing.assert_array_equal(back.d2t, d2t)
  head = back.module()
  tokens = jnp.asarray([[3, 500, 7]])
  np.testing.assert_array_equal(head.embed(tokens), a.embed(tokens))
  with pytest.raises(ValueError, match='no embedding of its own'):
    Eagle3Head(tiny_config(), rngs=nnx.Rngs(0)).embed(tokens)


def test_cache_free_masked_forward_equals_paged():
  """Any [B, T, T] mask (here training's "causal OR diagonal" over two unrolled steps) equals the paged kernel."""
  cfg = tiny_config()
  head = Eagle3Head(cfg, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(0)
  b, t = 2, 6  # step 0: tokens 0..5 at positions 0..5; step 1: tokens 0..5 again at positions 1..6
  causal = np.tril(np.ones((t, t), bool))
  mask = np.block([[causal, np.zeros((t, t), bool)], [causal, np.eye(t, dtype=bool)]])
  mask = jnp.asarray(np.broadcast_to(mask, (b, 2 * t, 2 * t)))
  positions = jnp.asarray(np.broadcast_to(np.concatenate([np.arange(t), np.arange(t) + 1]), (b, 2 * t)))
  lens = jnp.asarray([2 * t, 2 * t], jnp.int32)
  embeds = jnp.asarray(rng.normal(size=(b, 2 * t, 64)), jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(b, 2 * t, 64)), jnp.float32)
  free, _ = head.forward(embeds, hidden, StepInputs(positions, lens, mask), None)
  cache = shuffled_cache(head.cache_layout().kv_shapes, b, 2 * t)
  paged, cache = head.forward(embeds, hidden, StepInputs.tree(cache, positions, mask, lens), cache)
  close(free, paged)
  # A causal chain: cache-free (no mask) == paged in two chunks.
  lens = jnp.asarray([t, 4], jnp.int32)
  chain, _ = head.forward(embeds[:, :t], hidden[:, :t], StepInputs.chain(None, lens, t), None)
  cache = shuffled_cache(head.cache_layout().kv_shapes, b, t)
  first, cache = head.forward(embeds[:, :3], hidden[:, :3], StepInputs.chain(cache, jnp.asarray([3, 3]), 3), cache)
  second, _ = head.forward(embeds[:, 3:t], hidden[:, 3:t], StepInputs.chain(cache, lens - 3, 3), cache)
  got = np.concatenate([first, second], axis=1)
  close(got[0], chain[0])
  close(got[1, :4], chain[1, :4])


def test_lookup_is_the_raw_table():
  gemma = specjax.load(TINY).module()  # Gemma scales its embeddings by sqrt(D); lookup does not
  tokens = jnp.asarray([[2, 7, 300]])
  close(gemma.lookup(tokens) * gemma.spec.hidden_size**0.5, gemma.embed(tokens), 1e-6)
  np.testing.assert_array_equal(gemma.lookup(tokens)[0, 1], gemma.embed_tokens[...][:, 7])
  qwen = specjax.load(f'{FIXTURES}/tiny_qwen3_5').module()
  np.testing.assert_array_equal(qwen.lookup(tokens), qwen.embed(tokens))


# ---------------------------------------------------------------- bad input


def broken(tmp_path, src, *, config=None, drop=(), tensors=None, remove=()):
  """A copy of `src` with config keys replaced (None deletes), tensors dropped or replaced, files removed."""
  d = tmp_path / 'head'
  shutil.copytree(src, d)
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
  for name in remove:
    (d / name).unlink()
  return str(d)


def bad_d2t():
  d2t = load_file(f'{LAYOUT1}/model.safetensors')['d2t'].copy()
  d2t[-1] = 512 - 95  # draft id 95 -> target id 512
  return {'d2t': d2t}


BAD = {
    'no config': (LAYOUT1, dict(remove=['config.json']), 'has no config.json'),
    'no weights': (LAYOUT1, dict(remove=['model.safetensors']), 'no safetensors weights'),
    'unknown architecture': (LAYOUT1, dict(config={'architectures': ['LlamaForCausalLM']}), 'not an EAGLE-3 head'),
    'other speculator': (SPECULATORS, dict(config={'speculators_model_type': 'dflash'}), 'not an EAGLE-3 head'),
    'tap width': (LAYOUT1, dict(config={'target_hidden_size': 32}), r'taps of width 32 \(target_hidden_size\)'),
    'vocab': (SPECULATORS, dict(config={'transformer_layer_config.vocab_size': 500}), r'vocab_size 500 != the target'),
    'draft vocab': (LAYOUT1, dict(config={'draft_vocab_size': 600}), r'draft_vocab_size 600 must be in 1..vocab_size'),
    'tap ids': (LAYOUT1, dict(config={'eagle_config.eagle_aux_hidden_state_layer_ids': [0, 1, 2]}), 'outside the'),
    'embedding tap id': (SPECULATORS, dict(config={'eagle_aux_hidden_state_layer_ids': [0, 1, 2]}), r'\[-1, 0, 1\]'),
    'default taps': (LAYOUT1, dict(config={'eagle_config': None}), 'default taps'),
    'layers': (LAYOUT1, dict(config={'num_hidden_layers': 2}), 'one-layer heads'),
    'variant tensors': (SPECULATORS, dict(config={'fc_norm': True}), r'missing tensors.*fc_norm\.0\.weight'),
    'variant flag': (LAYOUT1, dict(config={'norm_output': 'yes'}), "norm_output must be true or false, got 'yes'"),
    'missing tensors': (LAYOUT1, dict(drop=['midlayer.hidden_norm.weight', 'norm.weight']), 'missing tensors'),
    'missing speculators tensor': (SPECULATORS, dict(drop=['layers.0.mlp.up_proj.weight']), 'layers.0.mlp.up_proj'),
    'shape': (LAYOUT1, dict(config={'intermediate_size': 80}), r"'midlayer.mlp.gate_proj.weight' has shape \[96, 64\]"),
    'unexpected': (LAYOUT1, dict(tensors={'fc_norm.0.weight': np.ones(64, np.float32)}), 'unexpected tensors'),
    'no d2t': (LAYOUT1, dict(drop=['d2t']), 'no d2t tensor'),
    'd2t range': (LAYOUT1, dict(tensors='bad_d2t'), r'maps draft id 95 to target id 512'),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_input_one_line_error(case, tmp_path, target, monkeypatch):
  src, edits, match = BAD[case]
  if edits.get('tensors') == 'bad_d2t':
    edits = dict(edits, tensors=bad_d2t())
  path = broken(tmp_path, src, **edits)
  if 'd2t' not in case:  # every check but d2t's values runs on the config and the headers alone
    monkeypatch.setattr(eagle3_loading, 'read_safetensors', lambda *a, **k: pytest.fail('weights were read'))
  with pytest.raises(SpecjaxError, match=match) as e:
    load_eagle3(path, target)
  assert '\n' not in str(e.value)


def test_bad_paths_and_targets(tmp_path, target):
  with pytest.raises(SpecjaxError, match='not found'):
    load_eagle3(str(tmp_path / 'nowhere'), target)
  (tmp_path / 'file').write_text('x')
  with pytest.raises(SpecjaxError, match='is not a directory'):
    load_eagle3(str(tmp_path / 'file'), target)
  with pytest.raises(SpecjaxError, match=r'has hidden size 32'):  # Gemma's 32-wide taps
    load_eagle3(LAYOUT1, specjax.load(TINY))
  with pytest.raises(SpecjaxError, match='unknown dtype'):
    load_eagle3(LAYOUT1, target, dtype='int8')
