"""Gemma 4 assistant: parity with transformers' generator (paged and dense donors), windows, loader, bad input."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from specjax.cache.paged import KVCache, token_slots, write_kv
from specjax.errors import SpecjaxError
from specjax.loading.gemma4_assistant import check_against_target, load_gemma4_assistant, save_gemma4_assistant
from specjax.models.contract import PagedKV
from specjax.models.gemma4_assistant import FULL, SLIDING, DenseKV, Gemma4Assistant, donor_attention, hf_fill
from specjax.models.layers import Rope
from conftest import FIXTURES, close

CENTROID = f'{FIXTURES}/tiny_gemma4_assistant'
DENSE = f'{FIXTURES}/tiny_gemma4_assistant_dense'
TARGET = f'{FIXTURES}/tiny_gemma4_for_assistant'
PATHS = {'centroid': CENTROID, 'dense': DENSE}


@pytest.fixture(scope='module')
def ref():
  return np.load(f'{FIXTURES}/tiny_gemma4_assistant_reference.npz')


@pytest.fixture(scope='module')
def ckpts():
  return {name: load_gemma4_assistant(path, dtype='float32') for name, path in PATHS.items()}


def target_embed(tokens: np.ndarray) -> np.ndarray:
  """The target's scaled embedding (`embed * sqrt(E)`, in float32) of `tokens` [...]."""
  table = load_file(f'{TARGET}/model.safetensors')['model.embed_tokens.weight'].astype(np.float32)
  return table[tokens] * np.float32(table.shape[1] ** 0.5)


def dense_donors(ref) -> dict:
  lens = jnp.asarray(ref['input_lens'])
  return {
      kind: DenseKV(jnp.asarray(ref[f'k_{short}']), jnp.asarray(ref[f'v_{short}']), lens)
      for kind, short in ((SLIDING, 'sliding'), (FULL, 'full'))
  }


def paged_donors(ref, page_size: int = 4) -> dict:
  """The donor K/V written into a paged cache (shuffled pages) as the target's prefill would leave them."""
  k_s, k_f = ref['k_sliding'], ref['k_full']
  b, s = k_s.shape[:2]
  per_row = -(-s // page_size)
  pages = np.random.default_rng(1).permutation(np.arange(1, b * per_row + 1)).astype(np.int32)
  cache = KVCache.create(
      [k_s.shape[2:], k_f.shape[2:]], num_pages=b * per_row + 1, page_size=page_size, block_tables=pages.reshape(b, -1)
  )
  lens = jnp.asarray(ref['input_lens'])
  positions = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  page_ids, slots = token_slots(cache.block_tables, positions, positions < lens[:, None], page_size)
  donors = {}
  for i, (kind, short) in enumerate(((SLIDING, 'sliding'), (FULL, 'full'))):
    k = write_kv(cache.k_pages[i], jnp.asarray(ref[f'k_{short}']), page_ids, slots)
    v = write_kv(cache.v_pages[i], jnp.asarray(ref[f'v_{short}']), page_ids, slots)
    donors[kind] = PagedKV(k, v, cache.block_tables, lens)
  return donors


def draft(model: Gemma4Assistant, ref, donors: dict, k: int) -> dict:
  """K greedy steps as the generator takes them: position L held, hidden fed back, target embedding of each token."""
  step = jax.jit(lambda e, h, p, d: model.forward(e, h, p, d))
  logits_of = jax.jit(model.logits)
  tokens = ref['first_token']
  hidden = jnp.asarray(ref['target_hidden'])[:, None]
  positions = jnp.asarray(ref['input_lens'])[:, None]
  rec = {key: [] for key in ('embeds', 'out', 'next_hidden', 'logits', 'drafts')}
  for _ in range(k):
    embeds = target_embed(tokens)
    out, hidden = step(jnp.asarray(embeds)[:, None], hidden, positions, donors)
    logits = logits_of(out[:, 0])
    tokens = np.asarray(jnp.argmax(logits, axis=-1))
    for key, value in (('embeds', embeds), ('out', out[:, 0]), ('next_hidden', hidden[:, 0])):
      rec[key].append(np.asarray(value))
    rec['logits'].append(np.asarray(logits))
    rec['drafts'].append(tokens)
  return {key: np.stack(value, axis=1) for key, value in rec.items()}


# ---------------------------------------------------------------- parity


def test_configs(ckpts, ref):
  for name, ckpt in ckpts.items():
    cfg = ckpt.config
    assert cfg.num_assistant_tokens == int(ref[f'{name}_num_assistant_tokens'])
    assert (cfg.vocab_size, cfg.hidden_size, cfg.backbone_hidden_size, cfg.num_layers) == (512, 32, 48, 4)
    assert cfg.layer_types == (SLIDING,) * 3 + (FULL,)
    assert cfg.kv_shape(SLIDING) == (2, 16) and cfg.kv_shape(FULL) == (2, 32)  # Hub global_head_dim / per_layer_config
    assert cfg.sliding_window == int(ref['window']) and cfg.sliding_keys == int(ref['sliding_keys']) == 9
    assert cfg.rope_sliding == Rope(base=1e4)
    assert cfg.rope_full == Rope(base=1e6, kind='proportional', rope_angles=4)
    assert cfg.use_ordered_embeddings == (name == 'centroid') and cfg.tie_word_embeddings
  assert (ckpts['centroid'].config.num_centroids, ckpts['centroid'].config.centroid_intermediate_top_k) == (16, 4)
  assert ckpts['centroid'].module().token_ordering[...].dtype == jnp.int32


def test_step_inputs_are_the_targets(ref):
  """The generator feeds the target's scaled embedding of the token and its final-normed hidden."""
  close(target_embed(ref['first_token']), ref['centroid_embeds'][:, 0], tol=0)
  close(ref['centroid_hidden_in'][:, 0], ref['target_hidden'], tol=0)
  assert bool(ref['hidden_is_post_norm']) and float(ref['hidden_vs_prenorm_max_diff']) > 1.0


@pytest.mark.parametrize('paged', [False, True], ids=['dense_kv', 'paged_kv'])
@pytest.mark.parametrize('name', ['centroid', 'dense'])
def test_draft_steps_match_transformers(ckpts, ref, name, paged):
  """Both rows (L = 20 and 13) in one ragged batch, K steps: outputs, drafts and per-step logits."""
  ckpt = ckpts[name]
  donors = paged_donors(ref) if paged else dense_donors(ref)
  got = draft(ckpt.module(), ref, donors, ckpt.config.num_assistant_tokens)
  close(got['embeds'], ref[f'{name}_embeds'], tol=0)
  close(got['out'], ref[f'{name}_out'])
  close(got['next_hidden'], ref[f'{name}_next_hidden'])
  np.testing.assert_array_equal(got['drafts'], ref[f'{name}_drafts'])
  want = ref[f'{name}_logits']
  if name == 'dense':
    close(got['logits'], want)
    return
  candidates = ref['centroid_candidates']  # [B, K, M] target ids
  finite = np.isfinite(got['logits'])
  expected = np.zeros_like(finite)
  np.put_along_axis(expected, candidates, True, axis=-1)
  np.testing.assert_array_equal(finite, expected)  # -inf exactly off the candidates: q = 0 there
  close(np.take_along_axis(got['logits'], candidates, -1), np.take_along_axis(want, candidates, -1))
  for b in range(2):  # transformers fills min - 1 per call (one row, one step)
    for s in range(want.shape[1]):
      close(hf_fill(jnp.asarray(got['logits'][b, s])), want[b, s])


def test_candidates_are_token_ordering_blocks(ckpts, ref):
  """`candidates` returns target ids: whole blocks of token_ordering viewed [C, V/C], logits against embed_tokens."""
  model = ckpts['centroid'].module()
  out = jnp.asarray(ref['centroid_out'])  # [B, K, D]
  ids, logits = model.candidates(out)
  assert ids.shape == logits.shape == (2, 4, 128) and ids.dtype == jnp.int32
  np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), ref['centroid_candidates'])
  blocks = np.asarray(model.token_ordering[...]).reshape(16, 32)
  for row in np.asarray(ids).reshape(-1, 4, 32):
    assert all(any((blk == b).all() for b in blocks) for blk in row)
  close(logits, np.einsum('bkmd,bkd->bkm', np.asarray(model.embed_tokens[...])[np.asarray(ids)], np.asarray(out)))
  with pytest.raises(ValueError, match='dense head'):
    ckpts['dense'].module().candidates(out)


# ---------------------------------------------------------------- donor attention and windows


def test_sliding_layers_see_window_plus_one_keys(ckpts, ref):
  """Perturbing the value of key L - W - 1 changes the step, key L - W - 2 does not (both donor forms)."""
  model = ckpts['centroid'].module()
  n, w = int(ref['input_lens'][0]), int(ref['window'])
  embeds = jnp.asarray(target_embed(ref['first_token']))[:, None]
  hidden = jnp.asarray(ref['target_hidden'])[:, None]
  positions = jnp.asarray(ref['input_lens'])[:, None]
  step = jax.jit(lambda donors: model.forward(embeds, hidden, positions, donors)[0][0])
  for make in (dense_donors, paged_donors):
    base = step(make(ref))
    changed = []
    for j in (n - w - 2, n - w - 1, n - 1):
      perturbed = dict(ref)
      perturbed['v_sliding'] = ref['v_sliding'].copy()
      perturbed['v_sliding'][0, j] += 3.0
      out = step(make(perturbed))
      changed.append(bool(np.abs(np.asarray(out - base)).max() > 0))
    assert changed == [False, True, True], (make.__name__, changed)


@pytest.mark.parametrize('page_size', [1, 4, 5])
@pytest.mark.parametrize('window', [None, 3, 30])
def test_paged_equals_dense_for_many_queries(page_size, window):
  """T queries per row, each its own L ([B, T] lengths; 0 gives zeros): paged (folded into the batch) = dense."""
  rng = np.random.default_rng(page_size)
  b, t, s, n, k, h = 2, 3, 11, 4, 2, 8
  keys, values = (rng.normal(size=(b, s, k, h)).astype(np.float32) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(b, t, n, h)).astype(np.float32))
  lengths = np.array([[11, 5, 1], [0, 7, 3]], np.int32)
  dense = donor_attention(q, DenseKV(jnp.asarray(keys), jnp.asarray(values), jnp.asarray(lengths)), window=window)
  per_row = -(-s // page_size)
  tables = np.random.default_rng(0).permutation(np.arange(1, b * per_row + 1)).astype(np.int32).reshape(b, -1)
  cache = KVCache.create([(k, h)], num_pages=b * per_row + 1, page_size=page_size, block_tables=tables)
  pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  ids, slots = token_slots(cache.block_tables, pos, jnp.ones((b, s), bool), page_size)
  kv = PagedKV(
      write_kv(cache.k_pages[0], jnp.asarray(keys), ids, slots),
      write_kv(cache.v_pages[0], jnp.asarray(values), ids, slots),
      cache.block_tables,
      jnp.asarray(lengths),
  )
  paged = donor_attention(q, kv, window=window, impl='xla')
  close(paged, dense, tol=1e-5)
  # The dense form against a plain softmax over the visible keys.
  for bi in range(b):
    for ti in range(t):
      lo, hi = max(0, lengths[bi, ti] - (window or s)), lengths[bi, ti]
      if hi == 0:
        np.testing.assert_array_equal(np.asarray(dense[bi, ti]), 0.0)
        continue
      kk = np.repeat(keys[bi, lo:hi], n // k, axis=1)  # [S', N, H]
      vv = np.repeat(values[bi, lo:hi], n // k, axis=1)
      p = np.einsum('nh,snh->ns', np.asarray(q[bi, ti]), kk)
      p = np.exp(p - p.max(-1, keepdims=True))
      close(dense[bi, ti], np.einsum('ns,snh->nh', p / p.sum(-1, keepdims=True), vv), tol=1e-5)


def test_missing_donor_type(ckpts, ref):
  donors = dense_donors(ref)
  del donors[FULL]
  with pytest.raises(ValueError, match="no donor K/V for layer type 'full_attention'"):
    ckpts['dense'].module().forward(
        jnp.zeros((2, 1, 48)), jnp.zeros((2, 1, 48)), jnp.asarray(ref['input_lens'])[:, None], donors
    )


# ---------------------------------------------------------------- loading and saving


def params_equal(a, b):
  la, lb = nnx.to_pure_dict(a), nnx.to_pure_dict(b)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), la, lb)


@pytest.mark.parametrize('name', ['centroid', 'dense'])
def test_save_load_round_trip(ckpts, name, tmp_path):
  ckpt = ckpts[name]
  save_gemma4_assistant(str(tmp_path), ckpt.config, ckpt.params)
  again = load_gemma4_assistant(str(tmp_path), dtype='float32')
  assert again.config == ckpt.config
  params_equal(again.params, ckpt.params)
  tensors = load_file(f'{tmp_path}/model.safetensors')
  assert tensors.keys() == load_file(f'{PATHS[name]}/model.safetensors').keys()
  if name == 'centroid':
    assert tensors['masked_embedding.token_ordering'].dtype == np.int64
  assert json.load(open(f'{tmp_path}/generation_config.json')) == {
      'num_assistant_tokens': ckpt.config.num_assistant_tokens
  }


def test_bfloat16_round_trip(tmp_path):
  ckpt = load_gemma4_assistant(CENTROID, dtype='bfloat16')
  assert ckpt.module().embed_tokens[...].dtype == jnp.bfloat16 and ckpt.module().token_ordering[...].dtype == jnp.int32
  save_gemma4_assistant(str(tmp_path), ckpt.config, ckpt.params)
  saved, original = load_file(f'{tmp_path}/model.safetensors'), load_file(f'{CENTROID}/model.safetensors')
  for key, value in original.items():  # the fixture is bfloat16: bit for bit
    assert saved[key].dtype == value.dtype, key
    np.testing.assert_array_equal(saved[key], value)


def test_untied_head_round_trip(ckpts, ref, tmp_path):
  ckpt = ckpts['dense']
  cfg = dataclasses.replace(ckpt.config, tie_word_embeddings=False, num_assistant_tokens=None)
  model = Gemma4Assistant(cfg, rngs=nnx.Rngs(3))
  save_gemma4_assistant(str(tmp_path), cfg, nnx.state(model))
  assert 'lm_head.weight' in load_file(f'{tmp_path}/model.safetensors')
  assert not os.path.exists(f'{tmp_path}/generation_config.json')
  again = load_gemma4_assistant(str(tmp_path), dtype='float32')
  assert again.config == cfg
  out = jnp.asarray(ref['dense_out'])
  close(again.module().logits(out), np.einsum('bkd,vd->bkv', np.asarray(out), np.asarray(model.lm_head[...])))


def copy_fixture(tmp_path, src=CENTROID) -> str:
  dst = str(tmp_path / 'ckpt')
  shutil.copytree(src, dst)
  return dst


def edit_config(path: str, text: dict | None = None, **top):
  cfg = json.load(open(f'{path}/config.json'))
  cfg.update(top)
  cfg['text_config'].update(text or {})
  json.dump(cfg, open(f'{path}/config.json', 'w'))


def edit_tensors(path: str, fn):
  tensors = load_file(f'{path}/model.safetensors')
  fn(tensors)
  save_file(tensors, f'{path}/model.safetensors')


def _dup(t):
  t['masked_embedding.token_ordering'][1] = t['masked_embedding.token_ordering'][0]


BAD = {
    'wrong model_type': (lambda p: edit_config(p, model_type='gemma4_text'), 'is not a Gemma 4 assistant'),
    'no text_config': (
        lambda p: json.dump({'model_type': 'gemma4_assistant'}, open(f'{p}/config.json', 'w')),
        'text_config',
    ),
    'PLE': (lambda p: edit_config(p, {'hidden_size_per_layer_input': 256}), 'no PLE, MoE'),
    'MoE': (lambda p: edit_config(p, {'enable_moe_block': True}), 'no PLE, MoE'),
    'partly shared': (lambda p: edit_config(p, {'num_kv_shared_layers': 2}), 'every assistant layer'),
    'layer types': (lambda p: edit_config(p, {'layer_types': ['sliding_attention'] * 3}), 'layer_types must list 4'),
    'rope type': (
        lambda p: edit_config(
            p, {'rope_parameters': {'sliding_attention': {}, 'full_attention': {'rope_type': 'yarn'}}}
        ),
        "unsupported rope_type 'yarn' for full_attention",
    ),
    'centroids': (lambda p: edit_config(p, num_centroids=15), 'num_centroids 15 does not divide vocab_size 512'),
    'top k': (lambda p: edit_config(p, centroid_intermediate_top_k=17), 'centroid_intermediate_top_k 17'),
    'heads': (lambda p: edit_config(p, {'num_key_value_heads': 3}), 'not a multiple'),
    'K': (
        lambda p: json.dump({'num_assistant_tokens': 0}, open(f'{p}/generation_config.json', 'w')),
        'num_assistant_tokens must be a positive int',
    ),
    'missing tensor': (
        lambda p: edit_tensors(p, lambda t: t.pop('post_projection.weight')),
        "missing tensors ['post_projection.weight']",
    ),
    'k/v projections': (
        lambda p: edit_tensors(
            p, lambda t: t.update({'model.layers.0.self_attn.k_proj.weight': np.zeros((32, 32), np.float32)})
        ),
        "model.layers.0.self_attn.k_proj.weight present (1 k/v tensors); assistant layers must all read the target's K/V",
    ),
    'shape': (
        lambda p: edit_tensors(p, lambda t: t.update({'pre_projection.weight': np.zeros((32, 64), np.float32)})),
        "tensor 'pre_projection.weight' has shape [32, 64], the config implies [32, 96]",
    ),
    'unexpected': (
        lambda p: edit_tensors(p, lambda t: t.update({'extra.weight': np.zeros(2, np.float32)})),
        "1 unexpected tensors, e.g. ['extra.weight']",
    ),
    'ordering': (lambda p: edit_tensors(p, _dup), 'token_ordering is not a permutation of the 512 token ids'),
    'no config': (lambda p: os.remove(f'{p}/config.json'), 'has no config.json'),
    'no weights': (lambda p: os.remove(f'{p}/model.safetensors'), 'no safetensors weights'),
    'truncated': (lambda p: open(f'{p}/model.safetensors', 'r+b').truncate(1000), 'is truncated'),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_checkpoints(tmp_path, case):
  mutate, message = BAD[case]
  path = copy_fixture(tmp_path)
  mutate(path)
  with pytest.raises(SpecjaxError) as e:
    load_gemma4_assistant(path, dtype='float32')
  assert message in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_bad_paths(tmp_path):
  with pytest.raises(SpecjaxError, match='not found'):
    load_gemma4_assistant(str(tmp_path / 'nope'))
  with pytest.raises(SpecjaxError, match='is not a directory'):
    load_gemma4_assistant(f'{CENTROID}/model.safetensors')
  cfg = load_gemma4_assistant(CENTROID, dtype='float32').config
  state = nnx.to_pure_dict(nnx.state(Gemma4Assistant(cfg)))
  (tmp_path / 'file').write_text('')
  with pytest.raises(SpecjaxError, match='exists and is not a directory'):
    save_gemma4_assistant(str(tmp_path / 'file'), cfg, state)
  state['token_ordering'] = np.zeros(512, np.int32)
  with pytest.raises(SpecjaxError, match='token_ordering is not a permutation'):
    save_gemma4_assistant(str(tmp_path / 'out'), cfg, state)


# ---------------------------------------------------------------- against a target


def target_shape() -> dict:
  """The fixture target's hidden size, vocabulary and donor (kv heads, head dim) per layer type, from config.json."""
  t = json.load(open(f'{TARGET}/config.json'))
  kv = t['num_key_value_heads']
  return {
      'hidden_size': t['hidden_size'],
      'vocab_size': t['vocab_size'],
      'kv_shapes': {SLIDING: (kv, t['head_dim']), FULL: (kv, t['global_head_dim'])},
  }


def test_check_against_target(ckpts):
  cfg = ckpts['centroid'].config
  check_against_target(cfg, **target_shape())
  for change, message in (
      ({'hidden_size': 64}, "backbone_hidden_size 48 != the target's hidden size 64"),
      ({'vocab_size': 1024}, "vocab_size 512 != the target's 1024"),
      ({'kv_shapes': {SLIDING: (2, 16)}}, 'the target has no full_attention layer to lend its K/V'),
      (
          {'kv_shapes': {SLIDING: (1, 16), FULL: (2, 32)}},
          "sliding_attention layers read (kv heads, head dim) (2, 16), the target's donor holds (1, 16)",
      ),
      ({'kv_shapes': {SLIDING: (2, 16), FULL: (2, 64)}}, 'full_attention layers read (kv heads, head dim) (2, 32)'),
  ):
    with pytest.raises(SpecjaxError) as e:
      check_against_target(cfg, **{**target_shape(), **change})
    assert message in str(e.value) and '\n' not in str(e.value), str(e.value)
