"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrids: parity with transformers, chunked == recurrent, MTP head."""

import json
import shutil

import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest

import specjax
from specjax.models.contract import StepInputs
from specjax import SpecjaxError
from specjax.cache.paged import KVCache
from conftest import FIXTURES, cache_step, close, make_cache

QWEN = ['tiny_qwen3_5', 'tiny_qwen3_5_moe', 'tiny_qwen3_next']


def run_model(model, ids, chunks, num_slots=1, **kw):
  """Feeds `ids` [B, T] in chunks; returns (logits [B, T, V], hidden [B, T, D], cache)."""
  b, t = ids.shape
  cache = make_cache(model, b, t, num_slots=num_slots, **kw)
  step = cache_step(model)
  logits, hiddens, start = [], [], 0
  for n in chunks:
    chunk_logits, hidden, cache = step(jnp.asarray(ids[:, start : start + n]), cache, jnp.full((b,), n, jnp.int32))
    logits.append(np.asarray(chunk_logits))
    hiddens.append(np.asarray(hidden))
    start += n
  assert start == t
  return np.concatenate(logits, axis=1), np.concatenate(hiddens, axis=1), cache


@pytest.fixture(scope='module', params=QWEN)
def qwen(request):
  ref = np.load(f'{FIXTURES}/{request.param}_reference.npz')
  return specjax.load(f'{FIXTURES}/{request.param}', mtp=True), ref


def test_prefill_logits_match_transformers(qwen):
  model, ref = qwen
  logits, hidden, _ = run_model(model, ref['input_ids'], [12])  # 12 > 1 slot: chunked GDN form
  close(logits, ref['logits'])
  close(hidden, ref['hidden'])


def test_step_by_step_matches_transformers(qwen):
  model, ref = qwen
  logits, _, _ = run_model(model, ref['input_ids'], [1] * 12)  # recurrent GDN form
  close(logits, ref['step_logits'])
  close(logits, ref['logits'])


def test_chunks_and_verify_blocks_agree(qwen):
  model, ref = qwen
  full, _, _ = run_model(model, ref['input_ids'], [12])
  # Chunked prefill (5 > 4 slots), then 4-token recurrent blocks, 2 single steps, shuffled pages.
  mixed, _, cache = run_model(model, ref['input_ids'], [5, 1, 4, 2], num_slots=4, shuffle_pages=True)
  close(mixed, full)
  assert cache.num_slots == 4 and list(np.asarray(cache.state_slot)) == [1, 1]


def test_mtp_head_matches_reference(qwen):
  model, ref = qwen
  ids = ref['input_ids']
  b, t = ids.shape
  module = model.module()
  mtp_cache = KVCache.create(
      model.kv_shapes[:1],
      num_pages=b * 4 + 1,
      page_size=4,
      block_tables=np.arange(1, b * 4 + 1, dtype=np.int32).reshape(b, 4),
  )
  embeds = module.embed(jnp.asarray(ids[:, 1:]))
  head = nnx.merge(*model.heads['mtp'])
  lens = jnp.full((b,), t - 1, jnp.int32)
  out, _ = head(embeds, jnp.asarray(ref['hidden'][:, :-1]), mtp_cache, StepInputs.chain(mtp_cache, lens, t - 1))
  close(np.asarray(module.logits(out)), ref['mtp_logits'])


def test_mtp_weights_load_only_when_asked():
  path = f'{FIXTURES}/tiny_qwen3_5'
  plain = specjax.load(path)
  assert 'mtp' not in plain.params
  with_mtp = specjax.load(path, mtp=True)
  assert 'mtp' in with_mtp.heads and 'mtp' not in plain.heads
  assert with_mtp.num_params == plain.num_params  # the head's weights are its own pytree, not the target's


def test_config_errors(tmp_path):
  src = f'{FIXTURES}/tiny_qwen3_next'
  for key, value, match in [
      ('layer_types', ['linear_attention', 'mamba', 'linear_attention', 'full_attention'], 'unknown layer types'),
      ('num_experts_per_tok', 8, 'num_experts_per_tok'),
      ('linear_num_value_heads', 3, 'not a multiple'),
  ]:
    d = tmp_path / key
    shutil.copytree(src, d)
    cfg = json.loads((d / 'config.json').read_text())
    cfg[key] = value
    (d / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(SpecjaxError, match=match):
      specjax.load(str(d))


def test_mtp_bad_input(tmp_path):
  # A checkpoint without mtp.* weights: the error comes before any weight is read.
  from safetensors.numpy import load_file, save_file

  d = tmp_path / 'no_mtp'
  shutil.copytree(f'{FIXTURES}/tiny_qwen3_5', d)
  tensors = {k: v for k, v in load_file(d / 'model.safetensors').items() if not k.startswith('mtp.')}
  save_file(tensors, d / 'model.safetensors')
  specjax.load(str(d))  # fine without --mtp
  with pytest.raises(SpecjaxError, match='no built-in MTP weights'):
    specjax.load(str(d), mtp=True)
  with pytest.raises(SpecjaxError, match='no built-in MTP head'):
    specjax.load(f'{FIXTURES}/tiny_gemma3', mtp=True)
  with pytest.raises(SpecjaxError, match='not supported from GGUF'):
    specjax.load('gemma-3-270m', mtp=True)


def test_moe_gathered_experts_equal_dense():
  model = specjax.load(f'{FIXTURES}/tiny_qwen3_5_moe')
  moe = model.module().layers[0].mlp
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, model.config.hidden_size)), jnp.float32)
  np.testing.assert_allclose(np.asarray(moe(x, gather=True)), np.asarray(moe(x, gather=False)), atol=1e-5, rtol=0)


def test_multimodal_wrapper_names(tmp_path):
  """Hub Qwen3.5 checkpoints: config under text_config, weights under model.language_model.*, a vision tower."""
  from safetensors.numpy import load_file, save_file

  d = tmp_path / 'wrapped'
  shutil.copytree(f'{FIXTURES}/tiny_qwen3_5', d)
  text = json.loads((d / 'config.json').read_text())
  (d / 'config.json').write_text(
      json.dumps(
          {
              'model_type': 'qwen3_5',
              'architectures': ['Qwen3_5ForConditionalGeneration'],
              'text_config': text,
              'vision_config': {'depth': 1},
          }
      )
  )
  tensors = load_file(d / 'model.safetensors')
  tensors = {
      ('model.language_model.' + k[len('model.') :] if k.startswith('model.') else k): v for k, v in tensors.items()
  }
  tensors['model.visual.patch_embed.weight'] = np.zeros((2, 2), np.float32)
  save_file(tensors, d / 'model.safetensors')
  ref = np.load(f'{FIXTURES}/tiny_qwen3_5_reference.npz')
  logits, _, _ = run_model(specjax.load(str(d)), ref['input_ids'], [12])
  close(logits, ref['logits'])
