"""Statistical test: speculative sampling emits the target's sampling distribution.

Each batch row is an independent sample (per-row keys). For the first tokens
emitted by speculative steps we compare speculative samples with plain samples
drawn with another seed, by a chi-square two-sample test over the categories
(pooling categories with few counts). The exact marginal of the second
generated token (the first one a speculative step emits) is also computed from
the model and tested against directly. Each test has a false-alarm rate of
1e-3 (fixed seeds make the outcome deterministic). With drafts the target
accepts often, the exact law of the first three tokens (`conftest.emitted_law_pvalue`)
holds, and each mutated verifier (`conftest.VERIFIER_MUTANTS`) fails it.
"""

import numpy as np
import pytest
import jax.numpy as jnp
from scipy import stats

import specjax
from specjax import sampling as sampling_lib
from specjax.cache.paged import KVCache, PageAllocator
from specjax.drafters import make_drafter
from conftest import VERIFIER_MUTANTS, assert_target_law, cache_step, drafter_options, perturbed_target

ROWS = 1024
ALPHA = 1e-3
PROMPT = 'The cat sat on the mat. The cat'
SETTINGS = {
    'plain': specjax.SamplingParams(temperature=1.0),
    'top-k-top-p': specjax.SamplingParams(temperature=1.5, top_k=40, top_p=0.9),
}


def samples(engine, params, seed, **kw):
  params = specjax.SamplingParams(**{**params.__dict__, 'seed': seed})
  results, _ = engine.generate([PROMPT] * ROWS, max_new_tokens=4, sampling=params, **kw)
  return np.array([r.tokens for r in results])  # [ROWS, 4]


def two_sample_pvalue(a, b):
  """Chi-square homogeneity test of two samples of categories (rare ones pooled)."""
  cats, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
  counts = np.zeros((2, len(cats)))
  np.add.at(counts[0], inv[: len(a)], 1)
  np.add.at(counts[1], inv[len(a) :], 1)
  order = np.argsort(-counts.sum(0))
  counts = counts[:, order]
  keep = counts.sum(0) >= 10
  pooled = np.concatenate([counts[:, keep], counts[:, ~keep].sum(1, keepdims=True)], axis=1)
  pooled = pooled[:, pooled.sum(0) > 0]
  if pooled.shape[1] < 2:
    return 1.0
  return stats.chi2_contingency(pooled)[1]


def second_token_law(model, params):
  """Exact P(second generated token) = sum_x1 p(x1) p(x2 | x1) under the sampling transform."""
  ids = model.tokenizer.encode(PROMPT)
  step = cache_step(model)

  def run(batch_ids):
    b, t = batch_ids.shape
    pages = -(-t // 4)
    alloc = PageAllocator(b * pages + 1, 4)
    for i in range(b):
      alloc.allocate(i, t)
    cache = KVCache.create(
        model.kv_shapes,
        num_pages=b * pages + 1,
        page_size=4,
        block_tables=alloc.block_table(list(range(b)), pages),
        state_shapes=model.state_shapes,
    )
    logits, _, _ = step(jnp.asarray(batch_ids), cache, jnp.full((b,), t, jnp.int32))
    return np.asarray(sampling_lib.probs(logits[:, -1], params))

  p1 = run(np.array([ids]))[0]
  support = np.flatnonzero(p1 > 0)
  batch = np.array([ids + [int(x)] for x in support])
  p2 = run(batch)
  return (p1[support, None] * p2).sum(0)


def goodness_of_fit_pvalue(tokens, law):
  """Chi-square test of observed tokens against an exact law (cells with < 5 expected pooled)."""
  observed = np.bincount(tokens, minlength=len(law)).astype(np.float64)
  expected = law.astype(np.float64) / law.sum() * len(tokens)
  big = expected >= 5
  f_obs = np.append(observed[big], observed[~big].sum())
  f_exp = np.append(expected[big], expected[~big].sum())
  keep = f_exp > 0
  if observed[expected == 0].sum():
    return 0.0  # a token the law gives probability 0
  if keep.sum() < 2:
    return 1.0
  return stats.chisquare(f_obs[keep], f_exp[keep] * f_obs[keep].sum() / f_exp[keep].sum()).pvalue


@pytest.fixture(scope='module')
def plain_engine(tiny_model):
  return specjax.Engine(tiny_model, page_size=4)


@pytest.mark.parametrize('setting', list(SETTINGS))
@pytest.mark.parametrize('kind', ['draft-model', 'ngram', 'layer-skip'])
def test_speculative_matches_plain_sampling(kind, setting, tiny_model, plain_engine):
  params = SETTINGS[setting]
  draft = perturbed_target(0.015) if kind == 'draft-model' else None  # q overlaps p partly
  engine = specjax.Engine(
      tiny_model, page_size=4, drafter=make_drafter(kind, tiny_model, **drafter_options(kind, draft_model=draft))
  )
  spec = samples(engine, params, seed=1, num_draft=3)
  plain = samples(plain_engine, params, seed=2)
  for position in range(1, 4):  # position 0 comes from prefill in both
    p = two_sample_pvalue(spec[:, position], plain[:, position])
    assert p > ALPHA, (kind, setting, position, p)
  # Joint law of the first two speculative tokens.
  joint = lambda x: x[:, 1] * 1000 + x[:, 2]
  assert two_sample_pvalue(joint(spec), joint(plain)) > ALPHA
  # Exact marginal of the first speculative token.
  assert goodness_of_fit_pvalue(spec[:, 1], second_token_law(tiny_model, params)) > ALPHA


def test_the_test_has_power(tiny_model, plain_engine):
  """A biased sampler (temperature 0.7 instead of 1.0) is detected."""
  law = second_token_law(tiny_model, SETTINGS['plain'])
  biased = samples(plain_engine, specjax.SamplingParams(temperature=0.7), seed=3)
  assert goodness_of_fit_pvalue(biased[:, 1], law) < ALPHA


@pytest.mark.parametrize('kind', ['draft-model', 'layer-skip'])
def test_accepted_drafts_keep_the_exact_law_mutants_break_it(kind, tiny_model):
  """q close to p (a copy of the target with weight noise 0.01; the target's first 2 layers), one draft a step:
  token 2 is an accepted draft or a residual draw, token 3 the bonus or the next step's; 1000 requests. Every
  verifier mutant fails the test."""
  options = {'draft_model': perturbed_target(0.01)} if kind == 'draft-model' else {'layers': 2}
  engine = specjax.Engine(tiny_model, page_size=8, drafter=make_drafter(kind, tiny_model, **options), max_draft=1)
  prompt = engine.encode([PROMPT])[0]
  sampling = specjax.SamplingParams(temperature=1.0, seed=4)
  results, _ = assert_target_law(engine, tiny_model, prompt, sampling, n=1000, k=1, mutants=list(VERIFIER_MUTANTS))
  assert sum(r.spec.accepted for r in results) > {'draft-model': 600, 'layer-skip': 300}[kind]  # of ~1400-1800
