"""The engine with the Pallas kernel on a GPU: same tokens as the XLA path.

Runs only where jax's default backend is a GPU (see benchmarks/gpu_checks.sh);
on CPU the kernel is covered in interpret mode by test_paged_attention_kernel.
"""

import jax
import pytest

import specjax
from specjax.drafters import make_drafter
from specjax import SamplingParams
from conftest import TINY

pytestmark = pytest.mark.skipif(jax.default_backend() != 'gpu', reason='needs a GPU')


@pytest.fixture(autouse=True)
def ieee_float32():
  """Full float32 dots on both paths: XLA's default GPU precision for float32 rounds dots to TF32 while the kernel
  computes IEEE dots, and on a tiny random model with near-tied logits that alone flips a greedy token (seen on an
  H200, 2026-12-04: the XLA path's second token differed from the CPU's, the kernel's did not)."""
  with jax.default_matmul_precision('float32'):
    yield


PROMPTS = ['The capital of France is Paris. The capital of', 'def add(a, b):\n    return', 'Hello world']


@pytest.fixture(scope='module')
def engines():
  out = {}
  for impl in ('xla', 'pallas'):
    model = specjax.load(TINY, attention_impl=impl)
    out[impl] = model
  return out


@pytest.mark.parametrize('drafter', [None, 'ngram', 'layer-skip'])
def test_pallas_engine_matches_xla_greedy(engines, drafter):
  tokens = {}
  for impl, model in engines.items():
    d = make_drafter(drafter, model) if drafter else None
    engine = specjax.Engine(model, page_size=16, drafter=d, max_draft=4)
    results, _ = engine.generate(PROMPTS, max_new_tokens=24)
    tokens[impl] = [r.tokens for r in results]
  assert tokens['pallas'] == tokens['xla']


def test_pallas_engine_sampling_matches_xla(engines):
  params = SamplingParams(temperature=0.8, top_k=40, seed=3)
  tokens = {}
  for impl, model in engines.items():
    engine = specjax.Engine(model, page_size=16, drafter=make_drafter('ngram', model), max_draft=4)
    tokens[impl] = [r.tokens for r in engine.generate(PROMPTS, max_new_tokens=24, sampling=params)[0]]
  assert tokens['pallas'] == tokens['xla']
