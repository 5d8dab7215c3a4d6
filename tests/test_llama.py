"""Llama 3 / Mistral / Qwen3 dense targets: parity with transformers, greedy tokens, GGUF, CLI."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.loading import build_model
from specjax.loading.checkpoint import Checkpoint
from specjax.models.contract import StepInputs
from conftest import FIXTURES, make_cache

FAMILIES = ['tiny_llama3', 'tiny_mistral', 'tiny_qwen3']


@pytest.fixture(scope='module', params=FAMILIES)
def family(request):
  return specjax.load(f'{FIXTURES}/{request.param}'), np.load(f'{FIXTURES}/{request.param}_reference.npz')


def forward_logits(model, ids, lens, chunks=None, page_size=4):
  """Logits [B, T, V] of ragged rows `ids` [B, T], fed in `chunks` (default: one block) through the paged cache."""
  b, t = ids.shape
  graphdef, params = model.graphdef, model.params
  run = jax.jit(
      lambda p, tok, inputs, cache: (lambda m: (lambda h, c: (m.logits(h), c))(*m.forward(tok, inputs, cache)[:2]))(
          nnx.merge(graphdef, p)
      )
  )
  cache = make_cache(model, b, t, page_size=page_size, shuffle_pages=True)
  out, start = [], 0
  for n in chunks or [t]:
    q = np.clip(lens - start, 0, n).astype(np.int32)
    tok = np.where(ids[:, start : start + n] < 0, 0, ids[:, start : start + n])
    logits, cache = run(params, jnp.asarray(tok), StepInputs.chain(cache, jnp.asarray(q), n), cache)
    out.append(np.asarray(logits))
    start += n
  return np.concatenate(out, axis=1)


def test_logits_match_transformers(family):
  model, ref = family
  lens = ref['input_lens']
  logits = forward_logits(model, ref['input_ids'], lens)
  scale = np.abs(ref['logits']).max()
  for i, n in enumerate(lens):
    np.testing.assert_allclose(logits[i, :n], ref['logits'][i, :n], atol=2e-5 * scale, rtol=0)


def test_incremental_equals_full(family):
  model, ref = family
  lens = ref['input_lens']
  full = forward_logits(model, ref['input_ids'], lens)
  t = ref['input_ids'].shape[1]
  stepped = forward_logits(model, ref['input_ids'], lens, chunks=[7, 5] + [1] * (t - 12))  # crosses the window
  for i, n in enumerate(lens):
    np.testing.assert_allclose(stepped[i, :n], full[i, :n], atol=2e-5 * np.abs(full).max(), rtol=0)


def test_greedy_24_tokens_match_transformers(family):
  model, ref = family
  prompts = [list(map(int, row[:n])) for row, n in zip(ref['input_ids'], ref['input_lens'])]
  results, _ = specjax.Engine(model, page_size=4).generate(prompts, max_new_tokens=24)
  assert [r.tokens for r in results] == ref['greedy_new_ids'].tolist()


def test_family_facts():
  llama = specjax.load(f'{FIXTURES}/tiny_llama3')
  rope = llama.config.rope
  assert rope.kind == 'llama3' and rope.factor == 8.0 and rope.original_max_position_embeddings == 64
  ref = np.load(f'{FIXTURES}/tiny_llama3_reference.npz')
  np.testing.assert_allclose(rope.inv_freq(llama.config.head_dim), ref['rope_inv_freq'], rtol=1e-6)
  mistral = specjax.load(f'{FIXTURES}/tiny_mistral')
  assert mistral.config.sliding_window == 8 and mistral.config.head_dim == 16  # hidden / heads
  qwen3 = specjax.load(f'{FIXTURES}/tiny_qwen3')
  assert qwen3.config.qk_norm and qwen3.config.tie_word_embeddings and qwen3.config.head_dim == 32
  assert 'lm_head' not in qwen3.params
  assert qwen3.tokenizer.encode('Hello')[0] != qwen3.generation.bos_token_id  # Qwen3 adds no BOS
  assert llama.tokenizer.encode('Hello')[0] == llama.generation.bos_token_id


def test_mistral_without_window(tmp_path):
  """The same weights with `sliding_window: null` match transformers' window-free logits."""
  d = tmp_path / 'mistral'
  shutil.copytree(f'{FIXTURES}/tiny_mistral', d)
  config = json.loads((d / 'config.json').read_text())
  config['sliding_window'] = None
  (d / 'config.json').write_text(json.dumps(config))
  ref = np.load(f'{FIXTURES}/tiny_mistral_nowindow_reference.npz')
  model = specjax.load(str(d))
  logits = forward_logits(model, ref['input_ids'], ref['input_lens'])
  np.testing.assert_allclose(logits, ref['logits'], atol=2e-5 * np.abs(ref['logits']).max(), rtol=0)
  results, _ = specjax.Engine(model, page_size=4).generate([ref['input_ids'][0].tolist()], max_new_tokens=24)
  assert results[0].tokens == ref['greedy_new_ids'][0].tolist()


@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_gguf_file_runs_as_its_hf_weights(tmp_path, arch):
  """A GGUF written as convert_hf_to_gguf does gives the logits of the HF weights it came from."""
  from test_gguf_dense import write_dense_gguf
  from specjax.loading.gguf import load_gguf

  path = tmp_path / f'{arch}.gguf'
  expected = write_dense_gguf(
      path, arch, tied=arch == 'qwen3', rope=(8.0, 1.0, 4.0) if arch == 'llama' else None, types={}
  )
  gguf_ckpt = load_gguf(str(path))
  hf_ckpt = Checkpoint(
      dict(gguf_ckpt.config),
      {k: np.asarray(v) for k, v in expected.items()},
      gguf_ckpt.tokenizer,
      gguf_ckpt.generation,
      'hf',
  )
  from_gguf, from_hf = build_model(gguf_ckpt), build_model(hf_ckpt)
  ids = np.array([[1, 5, 9, 2, 7, 3, 4, 8]], np.int32)
  lens = np.array([8])
  np.testing.assert_allclose(forward_logits(from_gguf, ids, lens), forward_logits(from_hf, ids, lens), atol=1e-4)


def test_generate_cli_on_a_tiny_llama_dir():
  out = subprocess.run(
      [
          sys.executable,
          '-m',
          'specjax.cli',
          'generate',
          '-m',
          f'{FIXTURES}/tiny_llama3',
          '--prompt',
          'The capital of France is',
          '--max-new-tokens',
          '8',
          '--json',
      ],
      capture_output=True,
      text=True,
      check=True,
  )
  row = json.loads(out.stdout)
  assert len(row['tokens']) == 8 and row['model'].endswith('tiny_llama3')


def test_dense_config_errors(tmp_path):
  d = tmp_path / 'llama'
  shutil.copytree(f'{FIXTURES}/tiny_llama3', d)
  config = json.loads((d / 'config.json').read_text())
  for change, message in [
      ({'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0}}, 'unsupported rope scaling'),
      ({'attention_bias': True}, 'attention_bias'),
      ({'num_key_value_heads': 3}, 'multiple of'),
  ]:
    (d / 'config.json').write_text(json.dumps(config | change))
    with pytest.raises(specjax.SpecjaxError, match=message):
      specjax.load(str(d))


@pytest.mark.parametrize('name', FAMILIES)
def test_speculative_greedy_equals_autoregressive(name):
  """The dense families under the draft-verify step: n-gram and layer-skip drafts, greedy output unchanged."""
  from specjax.drafters import make_drafter

  model = specjax.load(f'{FIXTURES}/{name}')
  ref = np.load(f'{FIXTURES}/{name}_reference.npz')
  prompts = [list(map(int, row[:n])) for row, n in zip(ref['input_ids'], ref['input_lens'])]
  for kind, options in (('ngram', {}), ('layer-skip', {'layers': 1})):
    engine = specjax.Engine(model, page_size=4, drafter=make_drafter(kind, model, **options), max_draft=4)
    results, _ = engine.generate(prompts, max_new_tokens=24, num_draft=3)
    assert [r.tokens for r in results] == ref['greedy_new_ids'].tolist(), kind
