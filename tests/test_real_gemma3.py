"""The real Gemma 3 270M (GGUF Q4_K_M, float32): greedy ids and logits equal transformers'."""

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, cache_step

pytestmark = pytest.mark.slow
REFERENCE = json.load(open(f'{FIXTURES}/gemma3_270m_reference.json'))


@pytest.fixture(scope='module')
def real_engine():
  import specjax

  return specjax.Engine(specjax.load('gemma-3-270m'))


def test_greedy_continuations_equal_reference(real_engine):
  rows = REFERENCE['greedy']
  results, _ = real_engine.generate([r['prompt'] for r in rows], max_new_tokens=32)
  for row, result in zip(rows, results):
    assert real_engine.encode([row['prompt']])[0] == row['prompt_ids']
    assert result.tokens == row['new_ids'], row['prompt']


def test_last_logits_close_to_reference(real_engine):
  import jax.numpy as jnp
  from specjax.cache.paged import KVCache, PageAllocator

  model = real_engine.model
  step = cache_step(model)
  for row in REFERENCE['logits']:
    ids = row['prompt_ids']
    alloc = PageAllocator(9, 16)
    alloc.allocate(0, len(ids))
    cache = KVCache.create(model.kv_shapes, num_pages=9, page_size=16, block_tables=alloc.block_table([0], 8))
    logits = np.asarray(step(jnp.asarray([ids]), cache, jnp.asarray([len(ids)]))[0][0, -1])
    top = np.array(row['last_logits_top'])
    assert int(np.argmax(logits)) == int(top[0, 0])
    np.testing.assert_allclose(logits[top[:, 0].astype(int)], top[:, 1], atol=2e-3 * np.abs(top[:, 1]).max())


def test_cli_json_on_real_model():
  proc = subprocess.run(
      [
          sys.executable,
          '-m',
          'specjax.cli',
          'generate',
          '-m',
          'gemma-3-270m',
          '--prompt',
          'The capital of France is',
          '--max-new-tokens',
          '8',
          '--json',
      ],
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert out['text'].startswith(' the capital of the country of France')
  assert out['prompt_tokens'] == 6 and len(out['tokens']) == 8


@pytest.mark.parametrize('kind,k', [('ngram', 4), ('layer-skip', 3)])
def test_speculative_greedy_equals_reference(real_engine, kind, k):
  import specjax
  from specjax.drafters import make_drafter

  rows = REFERENCE['greedy'][:3]
  drafter = make_drafter(kind, real_engine.model, **({'layers': 6} if kind == 'layer-skip' else {}))
  engine = specjax.Engine(real_engine.model, drafter=drafter, max_draft=k)
  results, _ = engine.generate([r['prompt'] for r in rows], max_new_tokens=32, num_draft=k)
  for row, result in zip(rows, results):
    assert result.tokens == row['new_ids'], (kind, row['prompt'])
  assert sum(r.spec.accepted for r in results) > 0
