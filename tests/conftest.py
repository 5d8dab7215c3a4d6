import contextlib
import functools
import os

import pytest

# Tiny-model tests spend most of their time compiling, in XLA:CPU's LLVM passes, programs that then run a few
# steps. The suite compiles them unoptimised, which halves its wall time, and with XLA:CPU's older elemental
# emitters instead of its fusion emitters (a fifth less compile time). Set before any backend starts; flags
# already given win, and subprocesses inherit them.
_FLAGS = os.environ.get('XLA_FLAGS', '')
_QUICK_COMPILE = (
    '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true',
    '--xla_cpu_use_fusion_emitters=false',
)
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


def damped_target(model, mix: float):
  """`model` with every layer's output projections (attention / mixer `o_proj`, `out_proj`, MLP `down`) scaled by
  `mix`: its next token depends mostly on the last token's own embedding (near a bigram model), so a drafter that
  reads the last token (MTP's embedding input, a DFlash block's first row) gets accepted often."""
  import dataclasses

  import jax
  from flax import nnx

  def scale(path, x):
    names = [getattr(k, 'key', None) for k in path]
    return x * mix if names[0] == 'layers' and names[-1] in ('o_proj', 'out_proj', 'down') else x

  state = jax.tree.map(lambda x: x, model.params)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(scale, nnx.to_pure_dict(model.params)))
  return dataclasses.replace(model, params=state)


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


# ---------------------------------------------------------------- exact sampled laws and verifier mutants

# Mutants of `specjax/verify.py`: each is the module's source with these (old, new) lines swapped, one edit of the
# chain verifier (`verify`) and one of the tree verifier (`verify_tree`) or its `rejection_residual`. Every site
# must occur exactly once, so a change to verify.py that moves one fails loudly instead of testing nothing.
# Greedy: every valid draft (tree: every live node on the path) is accepted, matching the target's argmax or not
# (not a sampled-law mutant).
GREEDY_MUTANTS = {
    'greedy-accepts-all': (
        (
            'n_accepted = leading_true((drafts == target[:, :k]) & valid)',
            'n_accepted = leading_true(valid)',
        ),
        ('nodes[:2] + ((live & matches).T[1:],)', 'nodes[:2] + (live.T[1:],)'),
    ),
}
VERIFIER_MUTANTS = {
    # At a rejection, draw from p instead of norm(max(0, p - q)) (the tree: r is never reduced by q).
    'residual-not-reduced': (
        ('residual = jnp.maximum(p_at - q_at, 0.0)', 'residual = p_at'),
        ('return jnp.maximum(residual - mass[:, None] * q, 0.0)', 'return residual'),
    ),
    # After the accepted drafts, the token a plain draw gives (the bonus) comes from the last accepted draft's q
    # instead of the target's p there.
    'bonus-from-q': (
        (
            'weights = jnp.where(use_residual[:, None], residual, p_at)',
            'q_last = jnp.take_along_axis(q, jnp.maximum(n_accepted - 1, 0)[:, None, None], axis=1)[:, 0]\n'
            '  bonus = jnp.where((n_accepted > 0)[:, None], q_last, p_at)\n'
            '  weights = jnp.where(use_residual[:, None], residual, bonus)',
        ),
        (
            'last = sampling_lib.gumbel_argmax(jnp.log(residual), keys)',
            'q_cur = jnp.take_along_axis(q, cur[:, None, None], axis=1)[:, 0]\n'
            '    plain = ~from_residual & (cur > 0)\n'
            '    last = sampling_lib.gumbel_argmax(jnp.log(jnp.where(plain[:, None], q_cur, residual)), keys)',
        ),
    ),
    # Draft i accepted with probability min(1, p_{i+1}(x_i) / q_i(x_i)): the target's law one position on (the
    # tree: the law at the child instead of the residual at its parent).
    'ratio-off-by-one': (
        (
            'p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]',
            'p_draft = jnp.take_along_axis(p[:, 1:], drafts[..., None], axis=-1)[..., 0]',
        ),
        (
            'accept = reached & (u_i * take(q_i, token) * mass < take(residual, token))',
            'accept = reached & (u_i * take(q_i, token) < take(p_i, token))',
        ),
    ),
}


def mutant_verifier(name: str):
  """A module with `verify` and `verify_tree` as `specjax/verify.py` with the mutant `name`'s edits."""
  import inspect
  import types

  from specjax import verify as verify_lib

  source = inspect.getsource(verify_lib)
  for old, new in {**VERIFIER_MUTANTS, **GREEDY_MUTANTS}[name]:
    assert source.count(old) == 1, f'mutant {name}: {old!r} is not in specjax/verify.py once; update VERIFIER_MUTANTS'
    source = source.replace(old, new)
  module = types.ModuleType(f'verify_mutant_{name.replace("-", "_")}')
  exec(compile(source, f'<specjax/verify.py, mutant {name}>', 'exec'), module.__dict__)
  return module


def forget_steps(engine) -> None:
  """Drops the engine's compiled speculative steps (the verifier is traced into them), keeps prefill and decode."""
  cache = engine.executables._cache
  for key in [key for key in cache if key[0] in ('spec', 'verify', 'verify_grammar')]:
    del cache[key]


@contextlib.contextmanager
def mutated_verifier(name: str, *engines):
  """The speculative step verifies with the mutant `name` inside the block (`engines` recompile theirs)."""
  from specjax import step

  module = mutant_verifier(name)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(step, 'verify', module.verify)
    patch.setattr(step, 'verify_tree', module.verify_tree)
    for engine in engines:
      forget_steps(engine)
    try:
      yield
    finally:
      for engine in engines:
        forget_steps(engine)


@functools.cache
def _next_token_probs():
  """The jitted [F, T] ids -> [F, V] sampling law of the next token (graphdef and sampling static)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from specjax.models.contract import StepInputs
  from specjax.sampling import probs

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def fn(graphdef, params, ids, sampling):
    model = nnx.merge(graphdef, params)
    f, t = ids.shape
    hidden, _, _ = model.forward(ids, StepInputs.chain(None, jnp.full((f,), t), t), None)
    return probs(model.logits(hidden[:, -1]).astype(jnp.float32), sampling)

  return fn


def next_token_probs(target, prompt: list[int], paths: list[tuple[int, ...]], sampling):
  """[F, V] float64: the target's sampling law of the token after `prompt + path`, for paths of one length."""
  import numpy as np

  ids = np.array([list(prompt) + list(s) for s in paths], np.int32)
  pad = -(-len(ids) // 64) * 64  # batch sizes in steps of 64: few shapes to compile
  ids = np.concatenate([ids, np.repeat(ids[:1], pad - len(ids), axis=0)])
  p = np.asarray(_next_token_probs()(target.graphdef, target.params, ids, sampling), np.float64)
  p = p[: len(paths)]
  return p / p.sum(-1, keepdims=True)


def emitted_law_pvalue(
    target, prompt: list[int], sampling, rows, stop_ids=(), min_count: float = 5, allowed=None
) -> float:
  """chi^2 p-value of `rows` (each request's first emitted tokens, one prompt) against the target's exact law.

  The law of the first D tokens (D = the longest row; a row is shorter only when it stopped at one of
  `stop_ids`) is p(x1) p(x2 | x1) .. under `sampling`. Cells: every token path whose expected count is at least
  `min_count`, refined into its next token while shorter than D (the next tokens below `min_count` pooled into
  one cell per path); every cell still below `min_count` goes into one tail. A row with a token its path gives
  probability 0 fails outright (p = 0). `allowed(paths)` -> [F, V] bool: a constraint's masks after each path;
  the law is then the constrained target's, normalize(p * mask).
  """
  import numpy as np
  from scipy import stats

  rows = [tuple(int(x) for x in r) for r in rows]
  n, depth, stop = len(rows), max(len(r) for r in rows), {int(s) for s in stop_ids}
  children = {}  # expanded path -> [V] expected counts of its one-token extensions
  frontier, count = [()], {(): float(n)}
  for _ in range(depth):
    grown = []
    laws = next_token_probs(target, prompt, frontier, sampling) if frontier else []
    if allowed is not None and frontier:
      laws = laws * allowed(frontier)
      laws = laws / laws.sum(-1, keepdims=True)
    for path, p in zip(frontier, laws):
      children[path] = count[path] * p
      for x in np.flatnonzero(children[path] >= min_count):
        count[path + (int(x),)] = children[path][x]
        if len(path) + 1 < depth and int(x) not in stop:
          grown.append(path + (int(x),))
    frontier = grown
  cells = {}
  for path, counts in children.items():
    big = counts >= min_count
    cells.update({path + (int(x),): counts[x] for x in np.flatnonzero(big) if path + (int(x),) not in children})
    cells[path, 'rest'] = counts[~big].sum()
  observed = dict.fromkeys(cells, 0)
  for row in rows:
    path = ()
    for x in row:
      if children[path][x] == 0:
        return 0.0  # a token the target excludes
      if children[path][x] < min_count:
        cell = path, 'rest'
        break
      path += (x,)
      if path not in children:
        assert len(path) == len(row), (row, 'continues past a stop id or is longer than the others')
        cell = path
        break
    else:
      raise AssertionError(f'{row} is shorter than {depth} tokens and does not end at a stop id')
    observed[cell] += 1
  f_exp, f_obs = np.array(list(cells.values())), np.array([observed[c] for c in cells], np.float64)
  small = f_exp < min_count
  f_exp, f_obs = np.append(f_exp[~small], f_exp[small].sum()), np.append(f_obs[~small], f_obs[small].sum())
  keep = f_exp > 0
  return stats.chisquare(f_obs[keep], f_exp[keep] * n / f_exp[keep].sum()).pvalue


def assert_target_law(
    engine, target, prompt, sampling, *, n: int, k: int, depth: int = 3, mutants=(), allowed=None, patches=None
):
  """`n` requests of `prompt` (`depth` tokens each, draft depth `k`) on `engine` (over `target`): their tokens pass
  `emitted_law_pvalue` (p > 1e-3), and with each verifier mutant of `mutants` fail it (p < 1e-6).

  `allowed`: the constraint's masks (`emitted_law_pvalue`); `patches`: {name: context manager factory} of more
  mutants, each one must fail too.
  Returns (the real run's results, {'real' or mutant: p-value}).
  """
  stop_ids = target.generation.eos_token_ids or target.tokenizer.eos_ids  # where the engine stops a row
  pvalues = {}

  def run(name):
    results, _ = engine.generate([prompt] * n, max_new_tokens=depth, sampling=sampling, num_draft=k)
    pvalues[name] = emitted_law_pvalue(target, prompt, sampling, [r.tokens for r in results], stop_ids, allowed=allowed)
    return results

  results = run('real')
  for name in mutants:
    with mutated_verifier(name, engine):
      run(name)
  for name, patch in (patches or {}).items():
    with patch():
      forget_steps(engine)
      run(name)
    forget_steps(engine)
  print('law p-values:', pvalues)
  assert pvalues['real'] > 1e-3, pvalues
  assert all(pvalues[name] < 1e-6 for name in [*mutants, *(patches or {})]), pvalues
  return results, pvalues


# -- the extended tier

# Cases CI leaves out because a sibling case in CI carries the same proof (the same property through the same
# mechanism: another drafter of the same kind, another sampling setting, another size of one grid). Marked
# `extended`; `python -m pytest -q -n auto --maxprocesses 4 -m extended` runs them (README "## Tests").
_INTERPRET = 'test_paged_attention_kernel.py::TestPagedAttentionKernelInterpret::'
EXTENDED = {  # test: its cases in the tier (None: the test itself)
    # CI trains an MTP head on the bigram target (the shared loop, training-time test and soft CE, served); EAGLE-3
    # (taps, fc, draft vocabulary: test_train_eagle3.py in CI) and DFlash learn here.
    'test_learnability.py::test_trained_drafter_learns_and_serves': [
        'bigram-eagle3-250-drafter0',
        'copy-eagle3-300-drafter1',
        'copy-dflash-300-drafter3',
    ],
    # The training loop's resume and feature cache, shared by every kind: CI runs them for EAGLE-3.
    'test_train_dflash.py::test_resume_after_kill_matches': None,
    'test_train_dflash.py::test_cached_target_features_train_the_same': None,
    # CI: n-gram (a chain without state), EAGLE-3 trees (a head and its cache) and MTP (a hybrid target's
    # recurrent state) among 16 concurrent requests.
    'test_scheduler.py::test_greedy_among_16_concurrent_equals_alone': [
        'draft-model',
        'layer-skip',
        'eagle3',
        'dflash',
        'gemma4-assistant',
    ],
    # CI: n-gram (its drafts are accepted; `test_a_cached_prefix_not_skipped_is_caught` is its power check) and
    # EAGLE-3 trees (a head's cache over the cached prefix).
    'test_prefix_cache.py::test_outputs_and_acceptance_equal_with_and_without_the_prefix_cache': [
        'draft-model',
        'layer-skip',
        'eagle3',
        'dflash',
        'gemma4-assistant',
    ],
    'test_prefix_cache.py::test_multi_turn_reuses_generated_pages_exactly': ['eagle3', 'dflash'],
    # CI: a lookup drafter and grammar-first over a draft model.
    'test_grammar.py::test_greedy_constrained_speculation_equals_constrained_autoregressive': [
        'grammar-4',
        'grammar+ngram-3',
        'draft-model-1',
        'draft-model-3',
        'layer-skip-3',
    ],
    # CI: sampled trees on Gemma 3, greedy trees over a sliding window.
    'test_tree_speculative.py::test_tree_speculation_equals_autoregressive_every_depth': [
        'gemma3-sampling0',
        'llama-window-sampling1',
    ],
    # CI: each drafter once, each sampling setting at least once.
    'test_speculative_sampling.py::test_speculative_matches_plain_sampling': [
        'draft-model-plain',
        'ngram-top-k-top-p',
        'layer-skip-top-k-top-p',
    ],
    'test_speculative_sampling.py::test_accepted_drafts_keep_the_exact_law_mutants_break_it': ['layer-skip'],
    # The hybrid MTP config file: sweeps from config files and MTP on hybrid targets are in CI
    # (test_sweep_writes_every_artifact, test_hybrid_speculative.py), every config resolves (test_configs.py).
    'test_sweep.py::test_hybrid_mtp_config': None,
    # CI: MTP sampled on Qwen3.5 and greedy on both hybrid targets; n-gram over a hybrid target's rollback in
    # test_ngram_first.py (ngram+mtp).
    'test_hybrid_speculative.py::test_mtp_sampling_keeps_the_target_law': ['tiny_qwen3_next'],
    'test_hybrid_speculative.py::test_greedy_equals_autoregressive': ['tiny_qwen3_next-ngram', 'tiny_qwen3_5-ngram'],
    # CI: the head-k2 case with its mutants; default n-gram bounds and fallback.
    'test_ngram_first.py::test_sampled_keeps_the_target_law': ['head-k1'],
    'test_ngram_first.py::test_greedy_equals_autoregressive': ['eagle3-min2', 'eagle3-fallback2'],
    # CI: n-gram with a draft model behind it rolls the draft model's cache back too.
    'test_speculative.py::test_rollback_equals_recompute': ['draft-model'],
    # CI: the tree case (the head's cache after a rejected tree) of a fresh prefill.
    'test_eagle3.py::test_later_rounds_draft_as_a_fresh_prefill': ['chain'],
    # CI: chains and the 2x6 dynamic tree greedy; the static tree sampled.
    'test_eagle3.py::test_greedy_equals_autoregressive': ['tree-4x16', 'static'],
    # CI: Gemma 3 (sliding window, vocab-parallel tied head), Llama 3 (with the gate|up mutant) and Qwen3.5 (hybrid)
    # sharded; Qwen3 adds q/k norms only, replicated like every norm.
    'test_sharding.py::test_sharded_greedy_equals_one_device': ['tiny_qwen3'],
    # CI: layer-skip on the real model (its drafts accepted through the same verify pass).
    'test_real_gemma3.py::test_speculative_greedy_equals_reference': ['ngram-4'],
    # CI: AR across a page boundary (a full page's snapshot) and n-gram inside a page (a partly filled page's,
    # copied, after rolled-back drafts).
    'test_prefix_hybrid.py::test_a_hybrid_chats_next_turn_starts_past_the_answer': ['2-None', '1-ngram'],
    # CI: int8 on the kernel path in test_every_family_greedy_equals_quantized_autoregressive (every family).
    'test_quant.py::test_greedy_speculative_equals_quantized_autoregressive': ['int8-auto'],
    # The Pallas kernel in interpret mode: a representative subset in CI, the grid here and compiled on a GPU
    # (`benchmarks/gpu_checks.sh`).
    _INTERPRET
    + 'test_matches_reference': ['2-2-2', '2-2-5', '2-2-9', '8-2-1', '8-2-2', '8-2-9', '8-1-1', '8-1-2', '8-1-5'],
    _INTERPRET + 'test_page_sizes': ['8-6'],
    _INTERPRET + 'test_sliding_window': ['1-1', '6-9', '13-5', '100-5'],
    _INTERPRET + 'test_softcap': ['None'],
    _INTERPRET + 'test_tree_mask': ['2-None', '5-40', '9-None'],
    _INTERPRET + 'test_block_sizes': ['16-block_sizes0', '4-block_sizes2'],
}


def pytest_collection_modifyitems(config, items):
  """Marks the `EXTENDED` cases; a listed case that no longer exists is an error, so the list cannot go stale."""
  wanted = {
      test if cases is None else f'{test}[{case}]' for test, cases in EXTENDED.items() for case in cases or [None]
  }
  tests_dir = os.path.dirname(__file__)
  seen = set()
  files = set()
  for item in items:
    nodeid = os.path.relpath(str(item.path), tests_dir) + '::' + item.nodeid.split('::', 1)[1]
    files.add(nodeid.split('::')[0])
    if nodeid in wanted:
      item.add_marker(pytest.mark.extended)
      seen.add(nodeid)
  if config.getoption('keyword') or config.getoption('deselect') or any('::' in a for a in config.args):
    return  # a selection within files: the cases left out are not stale
  stale = sorted(n for n in wanted - seen if n.split('::')[0] in files)  # only files this run collected
  if stale:
    raise pytest.UsageError(f'tests/conftest.py EXTENDED names cases that do not exist: {stale}')
