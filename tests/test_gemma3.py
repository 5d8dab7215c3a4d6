"""Gemma 3 forward: parity with transformers, incremental equals full."""

import numpy as np
import pytest
import jax.numpy as jnp

import specjax
from conftest import TINY, TINY_SHARDED, FIXTURES, cache_step, make_cache


def run_model(model, ids, chunks, page_size=4, shuffle_pages=False):
  """Feeds `ids` [B, T] in the given chunk lengths; returns logits [B, T, V]."""
  b, t = ids.shape
  cache = make_cache(model, b, t, page_size=page_size, shuffle_pages=shuffle_pages)
  step = cache_step(model)
  out, start = [], 0
  for n in chunks:
    logits, _, cache = step(jnp.asarray(ids[:, start : start + n]), cache, jnp.full((b,), n, jnp.int32))
    out.append(np.asarray(logits))
    start += n
  assert start == t
  return np.concatenate(out, axis=1)


@pytest.mark.parametrize(
    'path,ref', [(TINY, 'tiny_gemma3_reference.npz'), (TINY_SHARDED, 'tiny_gemma3_sharded_reference.npz')]
)
def test_logits_match_transformers(path, ref):
  ref = np.load(f'{FIXTURES}/{ref}')
  model = specjax.load(path)
  logits = run_model(model, ref['input_ids'], [ref['input_ids'].shape[1]])
  scale = np.abs(ref['logits']).max()
  np.testing.assert_allclose(logits, ref['logits'], atol=1e-5 * scale, rtol=0)


def test_incremental_equals_full(tiny_model):
  ref = np.load(f'{FIXTURES}/tiny_gemma3_reference.npz')
  ids = ref['input_ids']
  full = run_model(tiny_model, ids, [40])
  # Chunks crossing page boundaries and the sliding window (8), then decode one by one.
  stepped = run_model(tiny_model, ids, [7, 13, 5] + [1] * 15, shuffle_pages=True)
  np.testing.assert_allclose(stepped, full, atol=2e-5 * np.abs(full).max(), rtol=0)


def test_softcap_config_is_read():
  model = specjax.load(TINY_SHARDED)
  assert model.config.final_logit_softcapping == 30.0
  assert model.config.layer_types[-1] == 'full_attention'
