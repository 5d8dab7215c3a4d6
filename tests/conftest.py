import os

import pytest

# Tiny-model tests spend most of their time compiling, in XLA:CPU's LLVM passes, programs that then run a few
# steps. The suite compiles them unoptimised, which halves its wall time. Set before any backend starts; flags
# already given win, and subprocesses inherit them.
_FLAGS = os.environ.get('XLA_FLAGS', '')
_QUICK_COMPILE = ('--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true')
os.environ['XLA_FLAGS'] = ' '.join([_FLAGS] + [f for f in _QUICK_COMPILE if f.split('=')[0] not in _FLAGS]).strip()

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
TINY = os.path.join(FIXTURES, 'tiny_gemma3')
TINY_SHARDED = os.path.join(FIXTURES, 'tiny_gemma3_sharded')
# Ragged prompts for the drafter families' end-to-end tests: a code prompt that repeats itself, prose, two tokens.
RAGGED_PROMPTS = ['def add(a, b):\n    return a + b\n\ndef sub(a, b):\n', 'The capital of France is', 'Hi']


@pytest.fixture(scope='session')
def tiny_model():
  import specjax

  return specjax.load(TINY)


@pytest.fixture(scope='session')
def tiny_engine(tiny_model):
  import specjax

  return specjax.Engine(tiny_model, page_size=4)


def perturbed_target(scale: float):
  """The tiny target with noisy weights: a draft model that agrees with it partly."""
  import numpy as np
  import specjax
  from specjax.loading import build_model

  ckpt = specjax.load_checkpoint(TINY)
  rng = np.random.default_rng(0)
  for name, w in ckpt.tensors.items():
    ckpt.tensors[name] = w + rng.normal(0, scale, w.shape).astype(np.float32)
  return build_model(ckpt)


def cache_step(model):
  """The model's cache step, jitted (one compile per chunk length): (tokens [B, T], cache, lens [B]) ->
  (logits [B, T, V], hidden [B, T, D], cache)."""
  import jax
  from flax import nnx

  @jax.jit
  def step(params, tokens, cache, lens):
    module = nnx.merge(model.graphdef, params)
    hidden, cache = module(tokens, cache, lens)
    return module.logits(hidden), hidden, cache

  return lambda tokens, cache, lens: step(model.params, tokens, cache, lens)


def make_cache(model, b, t, page_size=4, num_slots=1, shuffle_pages=False):
  """A KV cache (and recurrent state slots, for hybrids) for `b` rows of up to `t` tokens."""
  import numpy as np
  from specjax.cache.paged import KVCache, PageAllocator

  pages_per_seq = -(-t // page_size)
  alloc = PageAllocator(b * pages_per_seq + 1, page_size)
  if shuffle_pages:
    np.random.default_rng(0).shuffle(alloc._free)
  for i in range(b):
    alloc.allocate(i, t)
  return KVCache.create(
      model.kv_shapes,
      num_pages=b * pages_per_seq + 1,
      page_size=page_size,
      block_tables=alloc.block_table(list(range(b)), pages_per_seq),
      state_shapes=model.state_shapes,
      num_slots=num_slots,
  )


def close(got, want, tol=2e-5):
  """`got` equals `want` to `tol` of the largest |want| (a parity check that ignores where the mass is)."""
  import numpy as np

  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)


def shuffled_cache(kv_shapes, b: int, t: int, page_size: int = 4):
  """A paged KV cache for `b` rows of `t` tokens over `kv_shapes` (a drafter's own layers), pages shuffled."""
  import numpy as np
  from specjax.cache.paged import KVCache

  per_row = -(-t // page_size)
  pages = np.random.default_rng(0).permutation(np.arange(1, b * per_row + 1)).astype(np.int32)
  return KVCache.create(
      list(kv_shapes), num_pages=b * per_row + 1, page_size=page_size, block_tables=pages.reshape(b, per_row)
  )


def drafter_options(kind: str, *, draft_model=None, layers: int = 2) -> dict:
  """The options of each drafter family used by the tests (each family takes only its own)."""
  options = {'draft-model': {'draft_model': draft_model}, 'layer-skip': {'layers': layers}}
  return options.get(kind.removeprefix('ngram+'), {})


@pytest.fixture(scope='session')
def spec_bench():
  """Spec-Bench question.jsonl from a local source (tests never download it), else the test skips."""
  from specjax.datasets import spec_bench_path
  from specjax.errors import SpecjaxError

  try:
    return spec_bench_path(download=False)
  except SpecjaxError as e:
    pytest.skip(f'needs the Spec-Bench data (set SPECJAX_SPEC_BENCH or run `specjax bench` once to cache it): {e}')


def second_token_pvalue(target, prompt: list[int], sampling, second, stop_ids=()) -> float:
  """chi^2 p-value of sampled second tokens `second` [N] against the target's exact law after `prompt`.

  The law of token 2 is sum over x1 of p(x1) p(x2 | x1), x1 outside `stop_ids` (rows that drew one stopped and
  have no token 2), compared in 12 bins (token id mod 12).
  """
  import jax.numpy as jnp
  import numpy as np
  from scipy import stats
  from specjax.models.contract import StepInputs
  from specjax.sampling import probs

  model = target.module()
  v = target.config.vocab_size
  ids = jnp.asarray([prompt])
  hidden, _, _ = model.forward(ids, StepInputs.chain(None, jnp.asarray([len(prompt)]), len(prompt)), None)
  p1 = np.array(probs(model.logits(hidden[:, -1]), sampling))[0]  # [V]
  p1[list(stop_ids)] = 0
  both = jnp.concatenate([jnp.tile(ids, (v, 1)), jnp.arange(v)[:, None]], axis=1)
  hidden, _, _ = model.forward(both, StepInputs.chain(None, jnp.full((v,), both.shape[1]), both.shape[1]), None)
  p2 = np.asarray(probs(model.logits(hidden[:, -1]), sampling))  # [V, V]
  law = p1.astype(np.float64) @ p2.astype(np.float64)
  law /= law.sum()
  bins = np.arange(v) % 12
  expected = np.bincount(bins, weights=law, minlength=12) * len(second)
  observed = np.bincount(bins[np.asarray(second)], minlength=12)
  return stats.chisquare(observed, expected).pvalue
