"""The Gemma 4 assistant drafter over a Gemma 4 target: greedy equality, the sampled law, donor-K/V reuse, bad input.

Target: `tiny_gemma4_for_assistant` (KV sharing, per-layer embeddings, window 8 shorter than the prompts);
assistants: `tiny_gemma4_assistant` (centroid head: 128 of 512 ids are candidates each step) and
`tiny_gemma4_assistant_dense` (tied dense head), random weights from `tools/make_fixtures.py --only gemma4_assistant`.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafters import make_drafter
from specjax.models.contract import PagedKV
from conftest import assert_target_law

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
TARGET = os.path.join(FIXTURES, 'tiny_gemma4_for_assistant')
CENTROID = os.path.join(FIXTURES, 'tiny_gemma4_assistant')
DENSE = os.path.join(FIXTURES, 'tiny_gemma4_assistant_dense')
PROMPTS = [
    'the quick brown fox jumps over the lazy dog and then',
    'one two three',
    'a b c d e f g h i j k l m n o p',
]


@pytest.fixture(scope='module')
def target():
  return specjax.load(TARGET)


@pytest.fixture(scope='module')
def reference(target):
  results, _ = specjax.generate(target, PROMPTS, max_new_tokens=14, page_size=4)
  return [r.tokens for r in results]


def copy_assistant(target, path: str, mix: float = 0.05, spoil: tuple[int, ...] = ()):
  """The checkpoint at `path`, rewired to draft mostly its input token again.

  The random tiny target's greedy text repeats a token, so these drafts get accepted: `pre_projection`
  reads the token's embedding only, the layers' outputs are scaled by `mix` (they still attend to the
  donor K/V), and the head's rows are the normed projected embeddings, so the input token scores highest.
  The `spoil` tokens' rows are negated: after them it drafts something else, and is rejected.
  """
  from specjax.loading.gemma4_assistant import load_gemma4_assistant

  ckpt = load_gemma4_assistant(path)
  cfg = ckpt.config
  d = nnx.to_pure_dict(ckpt.params)
  v, e = cfg.vocab_size, cfg.backbone_hidden_size
  table = np.asarray(target.module().embed(jnp.arange(v)[None]))[0]  # [V, E] scaled
  m = np.random.default_rng(0).normal(size=(e, cfg.hidden_size)).astype(np.float32)
  d['pre_projection'] = np.concatenate([m, np.zeros_like(m)])
  for layer in d['layers'].values():
    layer['mixer']['o_proj'] = np.asarray(layer['mixer']['o_proj']) * mix
    layer['mlp']['down'] = np.asarray(layer['mlp']['down']) * mix
  d['layer_scalar'] = np.ones_like(d['layer_scalar'])
  d['norm']['scale'] = np.ones_like(d['norm']['scale'])
  rows = table @ m
  rows = rows / np.sqrt(np.mean(rows * rows, axis=-1, keepdims=True) + cfg.rms_norm_eps)
  rows[list(spoil)] *= -1
  d['embed_tokens'] = rows
  if cfg.use_ordered_embeddings:
    blocks = np.asarray(d['token_ordering']).reshape(cfg.num_centroids, -1)
    d['centroids'] = np.stack([rows[b].sum(0) for b in blocks], axis=1)
  state = jax.tree.map(lambda x: x, ckpt.params)
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, d))
  return dataclasses.replace(ckpt, params=state)


@pytest.mark.parametrize('assistant', [CENTROID, DENSE], ids=['centroid', 'dense'])
def test_greedy_equals_autoregressive_every_depth(target, reference, assistant):
  spoiled = copy_assistant(target, assistant, spoil=(reference[1][0],))  # the second prompt's drafts fail
  drafter = make_drafter('gemma4-assistant', target, draft_model=spoiled)
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=6)
  for k in (1, 3, 6):  # every depth: `test_speculative.py`
    results, _ = engine.generate(PROMPTS, max_new_tokens=14, num_draft=k)
    assert [r.tokens for r in results] == reference, k
    assert 5 <= sum(r.spec.accepted for r in results) < sum(r.spec.drafted for r in results), k  # 7-24 of 33-102


def test_default_depth_is_the_checkpoints_num_assistant_tokens(target):
  drafter = make_drafter('gemma4-assistant', target, draft_model=CENTROID)
  assert drafter.default_depth == 4
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=6)
  results, stats_ = engine.generate(PROMPTS[:1], max_new_tokens=6)
  assert engine.default_depth() == 4 and results[0].spec.drafted % 4 == 0


def test_sampled_steps_keep_the_target_law(target):
  """Drafts drawn from the centroid head's q (zero off its 128 candidates), verified with q: the first three tokens
  of 1000 requests have the target's exact law (`conftest.emitted_law_pvalue`); verifier mutants fail it. The
  target puts mass on ids the assistant gives q = 0: only residual draws reach them."""
  sampling = specjax.SamplingParams(temperature=1.0, seed=3)
  drafter = make_drafter('gemma4-assistant', target, draft_model=copy_assistant(target, CENTROID, mix=0.5))
  engine = specjax.Engine(target, page_size=8, drafter=drafter, max_draft=1)
  prompt = engine.encode(['the quick brown fox jumps over the lazy dog'])[0]
  mutants = ['residual-not-reduced', 'bonus-from-q']
  results, _ = assert_target_law(engine, target, prompt, sampling, n=1000, k=1, mutants=mutants)
  assert sum(r.spec.accepted for r in results) > 700  # of ~1100 drafts


def test_q_is_zero_off_the_centroid_candidates(target):
  drafter = make_drafter('gemma4-assistant', target, draft_model=CENTROID)
  prompt = specjax.Engine(target).encode([PROMPTS[0]])[0]
  q, drafts, _, _ = _propose(target, drafter, prompt, 3, specjax.SamplingParams(temperature=1.0, seed=0))
  assert q.shape == (1, 3, target.config.vocab_size)
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
  assert ((q > 0).sum(-1) <= 128).all()  # 4 centroids x 32 ids
  assert (np.take_along_axis(q, drafts[..., None], axis=-1) > 0).all()


_COMPILED = {}


def _propose(target, drafter, prompt, k, sampling, perturb=None):
  """Prefill `prompt` into a fresh cache, then one `propose`: (q, drafts, drafter state, cache)."""
  from specjax.cache.paged import KVCache, PageAllocator
  from specjax.drafters.base import BatchPlan, DraftContext
  from specjax.models.contract import StepInputs

  page = 4
  alloc = PageAllocator(32, page)
  alloc.allocate(0, 64)
  table = alloc.block_table([0], 16)
  model = target.module()
  cache = KVCache.create(target.kv_shapes, num_pages=32, page_size=page, block_tables=table)
  n = len(prompt) - 1  # the last prompt token is the pending one
  tokens = jnp.asarray([prompt[:n]])
  key = (id(target), drafter, n, k, sampling)  # the drafter held by the key, the target by the value
  if key not in _COMPILED:  # the three calls jitted once per setting, as the engine's step compiles them
    _COMPILED[key] = (
        target,
        jax.jit(lambda tokens, cache: model.forward(tokens, StepInputs.chain(cache, jnp.asarray([n]), n), cache)),
        jax.jit(
            lambda state, tokens, hidden: drafter.prefill(
                model, drafter.params(), state, tokens, jnp.asarray([n]), hidden
            )
        ),
        jax.jit(lambda state, cache, ctx: drafter.propose(model, drafter.params(), state, cache, ctx, k, sampling)),
    )
  _, forward, prefill, propose = _COMPILED[key]
  hidden, cache, _ = forward(tokens, cache)
  if perturb is not None:
    cache = perturb(cache)
  state = prefill(drafter.init_state(BatchPlan(1, 64, 32, page, table, k)), tokens, hidden)
  ctx = DraftContext(
      jnp.asarray([prompt + [0] * 8]),
      jnp.asarray([n]),
      jnp.asarray([prompt[-1]]),
      jnp.asarray([True]),
      jnp.asarray([0]),
  )
  out = propose(state, cache, ctx)
  q = None if out.q is None else np.asarray(out.q)
  return q, np.asarray(out.drafts), state, cache


def test_assistant_reads_the_targets_donor_pages_in_place(target):
  """No K/V of its own: the state is one hidden row; its drafts move with the donor pages and nothing else."""
  drafter = make_drafter('gemma4-assistant', target, draft_model=DENSE)
  module = target.module()
  donors = module.kv_donors()
  assert set(donors) == {'sliding_attention', 'full_attention'}
  prompt = specjax.Engine(target).encode([PROMPTS[0]])[0]
  greedy = specjax.SamplingParams()
  _, drafts, state, cache = _propose(target, drafter, prompt, 3, greedy)
  assert [x.shape for x in jax.tree.leaves(state)] == [(1, target.config.hidden_size)]

  # The first draft equals the assistant run on dense copies of the donor layers' committed K/V.
  from specjax.models.gemma4_assistant import DenseKV

  n = len(prompt) - 1
  page = cache.page_size
  slots = [(int(cache.block_tables[0, i // page]), i % page) for i in range(n)]
  dense = {}
  for kind, j in donors.items():
    gather = lambda pages: jnp.stack([pages[:, p, s] for p, s in slots], axis=0)[None]  # [1, S, K, H]
    dense[kind] = DenseKV(gather(cache.k_pages[j]), gather(cache.v_pages[j]), jnp.asarray([n]))
  assistant = nnx.merge(drafter.graphdef, drafter.params())
  embeds = module.embed(jnp.asarray([[prompt[-1]]]))
  paged = {
      kind: PagedKV(cache.k_pages[j], cache.v_pages[j], cache.block_tables, cache.lengths) for kind, j in donors.items()
  }
  h = state.hidden[:, None]
  out_paged, _ = assistant.forward(embeds, h, jnp.asarray([[n]]), paged)
  out_dense, _ = assistant.forward(embeds, h, jnp.asarray([[n]]), dense)
  np.testing.assert_allclose(out_paged, out_dense, atol=1e-5)
  assert int(jnp.argmax(assistant.logits(out_paged[0, 0]))) == drafts[0, 0]

  # Perturbing a donor's committed keys changes the drafts' logits; perturbing another layer's does not.
  others = [j for j in range(len(cache.k_pages)) if j not in donors.values()]
  assert others  # the target has layers whose pages the assistant never reads
  scale_layer = lambda j: lambda c: dataclasses.replace(
      c, k_pages=tuple(x * 3.0 if i == j else x for i, x in enumerate(c.k_pages))
  )
  base, _, _, _ = _propose(target, drafter, prompt, 2, specjax.SamplingParams(temperature=1.0, seed=1))
  moved, _, _, _ = _propose(
      target, drafter, prompt, 2, specjax.SamplingParams(temperature=1.0, seed=1), scale_layer(donors['full_attention'])
  )
  same, _, _, _ = _propose(
      target, drafter, prompt, 2, specjax.SamplingParams(temperature=1.0, seed=1), scale_layer(others[0])
  )
  assert np.abs(moved - base).max() > 1e-3
  np.testing.assert_array_equal(same, base)


def test_cli_run_and_mtp_model_autodetect(capsys):
  from specjax.cli import main

  for flags, k in ((['--drafter', 'gemma4-assistant', '--draft-model', CENTROID], 4), (['--mtp-model', DENSE], 5)):
    code = main(['run', '-m', TARGET, *flags, '--prompt', 'one two three', '--max-new-tokens', '8', '--json'])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out['spec']['drafter'] == 'gemma4-assistant' and out['spec']['k'] == k  # the checkpoint's K


def _assistant_copy(tmp_path, source, **changes):
  out = tmp_path / os.path.basename(source)
  shutil.copytree(source, out)
  with open(out / 'config.json') as f:
    hf = json.load(f)
  for key, value in changes.items():
    if key.startswith('text.'):
      hf['text_config'][key[5:]] = value
    else:
      hf[key] = value
  with open(out / 'config.json', 'w') as f:
    json.dump(hf, f)
  return str(out)


@pytest.mark.parametrize(
    'make, message',
    [
        (
            lambda tmp: [
                '-m',
                os.path.join(FIXTURES, 'tiny_gemma3'),
                '--drafter',
                'gemma4-assistant',
                '--draft-model',
                CENTROID,
            ],
            'Gemma 4 target',
        ),
        (lambda tmp: ['-m', TARGET, '--drafter', 'gemma4-assistant'], 'needs --draft-model'),
        (lambda tmp: ['-m', TARGET, '--drafter', 'gemma4-assistant', '--draft-model', str(tmp / 'nope')], 'not found'),
        (
            lambda tmp: ['-m', TARGET, '--mtp-model', _assistant_copy(tmp, CENTROID, backbone_hidden_size=64)],
            'backbone_hidden_size 64',
        ),
    ],
    ids=['gemma3-target', 'no-checkpoint', 'missing-path', 'hidden-size'],
)
def test_bad_input_is_one_error_line(capsys, tmp_path, make, message):
  from specjax.cli import main

  code = main(['run', *make(tmp_path), '--prompt', 'hi', '--max-new-tokens', '2'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code != 0 and len(err) == 1 and err[0].startswith('error:') and message in err[0], err


def test_sweep_over_depths(tmp_path):
  """Sweeps take the assistant as `drafter.draft_model`: one cell per K, equal greedy tokens."""
  from specjax.sweep import run_sweep

  prompts = tmp_path / 'questions.jsonl'
  prompts.write_text(json.dumps({'question_id': 1, 'category': 'free', 'turns': ['one two three']}) + '\n')
  overrides = [
      f'model={TARGET!r}',
      f'prompts.path={str(prompts)!r}',
      'prompts.categories=[]',
      'max_new_tokens=6',
      'page_size=4',
      'warmup=False',
      'drafter.kind="gemma4-assistant"',
      f'drafter.draft_model={CENTROID!r}',
      'grid.policy=[{"name":"fixed","k":2},{"name":"fixed","k":4}]',
  ]
  run_sweep(
      os.path.join(FIXTURES, '..', '..', 'configs', 'sweep_tiny.py'), str(tmp_path / 'out'), overrides, progress=False
  )
  rows = [json.loads(line) for line in open(tmp_path / 'out' / 'results.jsonl')]
  requests = [r for r in rows if r['type'] == 'request']
  assert len(requests) == 2 and requests[0]['tokens'] == requests[1]['tokens']
