"""Constrained decoding (`specjax.grammar`): llguidance grammars stay exact under speculation.

Greedy constrained speculation equals greedy constrained autoregressive decoding for each chain family, draft
trees (each node masked by its path's state) and the grammar-forced drafters; sample-and-match (n-gram) emits the constrained autoregressive sampler's tokens; a
drafter with q passes the chi^2 test against the constrained target's exact law, and verifiers with a mutation
(the residual not reduced, the ratio one position off; at the verifier, q not renormalised over the allowed
tokens and the cut position's draw reusing the drafter's noise) fail it. Every output of a JSON-schema request validates. Bad constraints are one error.
"""

import json

import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import pytest
from scipy import stats

import specjax
from specjax import sampling as sampling_lib
from specjax import verify as verify_lib
from specjax.drafters import make_drafter
from specjax.errors import SpecjaxError
from specjax.grammar import RowGrammars, compile_constraint, mask_law, mask_logits, new_matcher
from specjax.grammar.bitmask import tree_laws
from specjax.grammar.compile import tokenizer_for
from specjax.loading import build_model
from conftest import (
    FIXTURES,
    RAGGED_PROMPTS,
    TINY,
    assert_target_law,
    damped_target,
    drafter_options,
    forget_steps,
    perturbed_target,
)

REGEX = r'(ab|cd|[0-9]){2,6}-[a-k ]{1,12}\.'  # a constant '-' and '.', and sets that cut the target's top tokens
SCHEMA = {
    'type': 'object',
    'properties': {
        'id': {'type': 'integer', 'minimum': 0, 'maximum': 999},
        'kind': {'enum': ['cat', 'dog', 'bird']},
        'name': {'type': 'string', 'maxLength': 6},
        'ok': {'type': 'boolean'},
    },
    'required': ['id', 'kind', 'name', 'ok'],
    'additionalProperties': False,
    'x-guidance': {'whitespace_flexible': False},  # a random model would pad whitespace to the token budget
}


@pytest.fixture(scope='module')
def draft_model():
  return perturbed_target(0.03)


def allowed_after(model, grammar):
  """paths -> [F, V] bool: the grammar's mask after each path of emitted tokens (a fresh matcher per path)."""

  def allowed(paths):
    out = np.zeros((len(paths), model.config.vocab_size), bool)
    for i, path in enumerate(paths):
      matcher = new_matcher(model, grammar)
      assert matcher.consume_tokens(list(path)), path
      bitmask = np.zeros((1, (model.config.vocab_size + 31) // 32), np.int32)
      llg_numpy.fill_next_token_bitmask(matcher, bitmask)
      out[i] = np.unpackbits(bitmask.view(np.uint8), bitorder='little')[: model.config.vocab_size].astype(bool)
    return out

  return allowed


def test_bitmask_matches_llguidance():
  rng = np.random.default_rng(0)
  vocab = 70  # not a multiple of 32
  logits = rng.normal(size=(3, vocab)).astype(np.float32)
  bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, 3), dtype=np.int64).astype(np.int32)
  want = logits.copy()
  llg_numpy.apply_token_bitmask_inplace(want, bitmask)
  np.testing.assert_array_equal(np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(bitmask))), want)
  q = rng.dirichlet(np.ones(vocab), size=3).astype(np.float32)
  got = np.asarray(mask_law(jnp.asarray(q), jnp.asarray(bitmask)))
  kept = np.isfinite(want)
  np.testing.assert_allclose(got, np.where(kept, q, 0) / np.where(kept, q, 0).sum(-1, keepdims=True), rtol=1e-6)


def test_bad_constraints_are_one_error(tiny_model, tiny_engine):
  cases = {
      'JSON schema is not valid JSON': specjax.SamplingParams(json_schema='{"type": '),
      'JSON schema: .*foo': specjax.SamplingParams(json_schema={'type': 'foo'}),
      '(?s)regex: .*unclosed character class': specjax.SamplingParams(regex='[a-z'),
      'grammar: ': specjax.SamplingParams(grammar='start: "a" (\n'),
      'JSON schema: Unimplemented keys: \\["not"\\]': specjax.SamplingParams(json_schema={'not': {'type': 'string'}}),
  }
  for message, sampling in cases.items():
    with pytest.raises(SpecjaxError, match=message):
      tiny_engine.generate(['Hi'], max_new_tokens=2, sampling=sampling)
  with pytest.raises(SpecjaxError, match='one constraint per request: got json_schema and regex'):
    tiny_engine.generate(['Hi'], max_new_tokens=2, sampling=specjax.SamplingParams(json_schema='{}', regex='a'))


@pytest.mark.parametrize('name', ['gemma3', 'llama3', 'qwen3'])
def test_tokenizer_bridge(name, tiny_model):
  """llguidance's tokenizer built from ours reads our ids back as our text, and a matcher fed our tokenization
  of a valid document accepts it."""
  if name == 'gemma3':
    tokenizer = tiny_model.tokenizer
  else:
    from test_real_tokenizers import package_file  # pylint: disable=g-import-not-at-top

    from specjax.loading.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

    tokenizer = Tokenizer.from_file(str(package_file(name).parent))
  llg = tokenizer_for(tokenizer, tokenizer.vocab_size, tokenizer.eos_ids or (0,))
  text = '{"name": "Ünïcødé 東京", "n": [1, 2.5e3], "ok": true}'
  ids = tokenizer.encode(text, add_bos=False)
  assert llg.decode_str(ids) == tokenizer.decode(ids)
  matcher = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_json_schema({'type': 'object'}))
  assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()


@pytest.mark.parametrize(
    'kind,k',
    [
        ('ngram', 3),
        ('grammar', 4),
        ('grammar+ngram', 3),
        ('draft-model', 1),
        ('draft-model', 3),
        ('grammar+draft-model', 3),
        ('layer-skip', 3),
    ],
)
def test_greedy_constrained_speculation_equals_constrained_autoregressive(
    kind, k, tiny_model, tiny_engine, draft_model
):
  prompts = RAGGED_PROMPTS + ['The cat sat on the mat. The cat']
  accepted = 0
  for sampling in (specjax.SamplingParams(regex=REGEX), specjax.SamplingParams(json_schema=SCHEMA)):
    want, _ = tiny_engine.generate(prompts, max_new_tokens=24, sampling=sampling)
    drafter = make_drafter(kind, tiny_model, **drafter_options(kind.removeprefix('grammar+'), draft_model=draft_model))
    got, _ = specjax.Engine(tiny_model, page_size=4, drafter=drafter).generate(
        prompts, max_new_tokens=24, sampling=sampling, num_draft=k
    )
    assert [r.tokens for r in got] == [r.tokens for r in want], (kind, k, sampling.constraint[0])
    if kind.startswith('grammar'):
      assert sum(r.spec.forced_drafted for r in got) > 0  # the grammar's constants were drafted
    accepted += sum(r.spec.accepted for r in got)
  if kind != 'grammar':
    assert accepted >= 3, kind  # the drafter's own drafts pass the grammar and the target


@pytest.mark.parametrize(
    'target,kind,draft',
    [
        ('tiny_llama3', 'grammar+eagle3', 'tiny_eagle3'),
        ('tiny_qwen3', 'dflash', 'tiny_dflash'),
        ('tiny_qwen3_5', 'grammar+mtp', None),
        ('tiny_gemma4_for_assistant', 'gemma4-assistant', 'tiny_gemma4_assistant'),
    ],
)
def test_greedy_constrained_checkpoint_drafters(target, kind, draft):
  """The checkpoint-backed families (EAGLE-3, DFlash, a hybrid target's MTP head, the Gemma 4 assistant) keep
  greedy constrained output; their tiny random heads rarely agree with the target, so their drafts are cut and
  rejected (and grammar-forced drafts verified) far more than accepted."""
  model = specjax.load(f'{FIXTURES}/{target}', mtp=kind.endswith('mtp'))
  options = {'draft_model': f'{FIXTURES}/{draft}'} if draft else {}
  # grammar+: a schema with constants to force; the others: a loose regex their random drafts pass at times
  sampling = specjax.SamplingParams(**{'json_schema': SCHEMA} if kind.startswith('grammar') else {'regex': '[^e]*'})
  want, _ = specjax.Engine(model, page_size=4).generate(RAGGED_PROMPTS, max_new_tokens=20, sampling=sampling)
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter(kind, model, **options), max_draft=3)
  got, _ = engine.generate(RAGGED_PROMPTS, max_new_tokens=20, sampling=sampling, num_draft=3)
  assert [r.tokens for r in got] == [r.tokens for r in want]
  assert sum(r.spec.drafted for r in got) > 0


@pytest.fixture(scope='module')
def damped_and_reader(tmp_path_factory):
  """`test_eagle3`'s reader head over the damped tiny Llama 3: a tree drafter whose drafts are often accepted."""
  from test_eagle3 import reader_head  # pylint: disable=g-import-not-at-top

  damped = damped_target(specjax.load(f'{FIXTURES}/tiny_llama3'), 0.7)
  return damped, reader_head(damped, str(tmp_path_factory.mktemp('reader_head')))


def root_mask_only():
  """A mutant of the tree masks: only the root's state masks the target; its nodes' masks allow every token."""
  real = RowGrammars.tree_step

  def tree_step(self, *args):
    inputs = real(self, *args)
    inputs.bitmask[:, 1:] = -1
    return inputs

  return pytest.MonkeyPatch.context(), tree_step


@pytest.mark.parametrize(
    'options', [{'tree_topk': 2, 'tree_tokens': 6}, {'tree_parents': '0,0,1,1,2,3'}], ids=['dynamic', 'static']
)
def test_greedy_constrained_trees_equal_constrained_autoregressive(damped_and_reader, options):
  """Draft trees under a grammar (each node masked by the state after its path, refused nodes cut): greedy output
  equals constrained AR at K = 3, trees are accepted and cut; with the nodes' masks left out it does not."""
  damped, reader = damped_and_reader
  engine = specjax.Engine(damped, page_size=4, drafter=make_drafter('eagle3', damped, draft_model=reader, **options))
  # regexes whose masks change along a path and that the reader's drafts often pass (REGEX and SCHEMA cut them)
  for regex in ('[^e]*e[^a]*a[^o]*', '([a-m ]+[n-z ]+)+'):
    sampling = specjax.SamplingParams(regex=regex)
    want, _ = specjax.Engine(damped, page_size=4).generate(RAGGED_PROMPTS, max_new_tokens=24, sampling=sampling)
    got, _ = engine.generate(RAGGED_PROMPTS, max_new_tokens=24, sampling=sampling, num_draft=3)
    assert [r.tokens for r in got] == [r.tokens for r in want], regex
    assert 10 <= sum(r.spec.accepted for r in got) < sum(r.spec.drafted for r in got), regex
  sampling = specjax.SamplingParams(regex='[^e]*')
  want, _ = specjax.Engine(damped, page_size=4).generate(RAGGED_PROMPTS, max_new_tokens=24, sampling=sampling)
  patch, tree_step = root_mask_only()
  with patch as p:
    p.setattr(RowGrammars, 'tree_step', tree_step)
    forget_steps(engine)
    try:
      mutant, _ = engine.generate(RAGGED_PROMPTS, max_new_tokens=24, sampling=sampling, num_draft=3)
      assert [r.tokens for r in mutant] != [r.tokens for r in want]
    except SpecjaxError as e:  # or a row emits what its grammar refuses
      assert 'grammar refuses' in str(e)


def test_sampled_constrained_trees_keep_the_constrained_law(damped_and_reader):
  """A static tree (3 children of the root, 2 + 1 below) of the reader head's q under `[^e]*`: children the
  grammar refuses are cut, the kept ones verified with q' = normalize(q m) from their parent's state. The first
  three tokens have the constrained target's exact law; the verifier mutants fail it (the head's q is sharp, so
  leaving it unmasked is caught by the test below, where q puts half its mass on a refused token)."""
  damped, reader = damped_and_reader
  regex = '[^aeo]*'
  grammar = compile_constraint(damped, ('regex', regex))
  sampling = specjax.SamplingParams(temperature=1.0, seed=6, regex=regex)
  drafter = make_drafter('eagle3', damped, draft_model=reader, tree_parents='0,0,0,1,1,2')
  engine = specjax.Engine(damped, page_size=8, drafter=drafter)
  prompt = engine.encode(['The capital of France is'])[0]

  results, _ = assert_target_law(
      engine,
      damped,
      prompt,
      sampling,
      n=500,
      k=2,
      mutants=('residual-not-reduced', 'ratio-off-by-one'),
      allowed=allowed_after(damped, grammar),
  )
  assert sum(r.spec.accepted for r in results) > 300


def test_sample_and_match_is_the_constrained_sampler(tiny_model, tiny_engine):
  """n-gram drafts are deterministic: constrained speculation emits the constrained sampler's tokens."""
  sampling = specjax.SamplingParams(temperature=1.0, seed=3, regex=REGEX)
  prompts = ['ab12ab12ab12-abc abc abc. ab12ab12'] * 6 + RAGGED_PROMPTS
  want, _ = tiny_engine.generate(prompts, max_new_tokens=20, sampling=sampling)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('grammar+ngram', tiny_model))
  got, _ = engine.generate(prompts, max_new_tokens=20, sampling=sampling, num_draft=4)
  assert [r.tokens for r in got] == [r.tokens for r in want]


def sharpened_target(model_path: str, scale: float):
  """The model with its logits times `scale` (Gemma's final norm multiplies by 1 + w): a draft model whose q is
  sharper than the target's p, accepted often where they agree."""
  ckpt = specjax.load_checkpoint(model_path)
  w = ckpt.tensors['model.norm.weight']
  ckpt.tensors['model.norm.weight'] = (scale * (1 + w) - 1).astype(np.float32)
  return build_model(ckpt)


def test_sampled_constrained_speculation_keeps_the_constrained_law(tiny_model):
  """A draft model with q sharper than p (logits x 2.5) under a grammar that refuses every token with an "e"
  (about half the target's mass, and some of its top 10 tokens; drafts with one are cut), against the exact law
  of the first three tokens of the constrained target, 1000 requests at K = 2. Verifier mutants (the residual not
  reduced by q, the acceptance ratio one position off) fail it. The masking of q and the cut's fresh stream
  have their own test below, where their effect is large by construction."""
  regex = '[^e]*'
  grammar = compile_constraint(tiny_model, ('regex', regex))
  sampling = specjax.SamplingParams(temperature=1.0, seed=4, regex=regex)
  drafter = make_drafter('draft-model', tiny_model, draft_model=sharpened_target(TINY, 2.5))
  engine = specjax.Engine(tiny_model, page_size=8, drafter=drafter, max_draft=2)
  prompt = tiny_model.tokenizer.encode('Hi')
  results, _ = assert_target_law(
      engine,
      tiny_model,
      prompt,
      sampling,
      n=1000,
      k=2,
      mutants=('residual-not-reduced', 'ratio-off-by-one'),
      allowed=allowed_after(tiny_model, grammar),
  )
  assert sum(r.spec.accepted for r in results) > 600


def test_cut_drafts_verify_with_the_masked_law_and_a_fresh_stream():
  """The verifier alone, one draft per row over V = 3 (tokens 0 and 1 allowed, 2 refused): the drafter draws
  x ~ q with the plain sampler's noise (coupled), a refused draft is cut (no draft, `fresh_last`), a kept one is
  verified with q' = normalize(q m). The emitted token follows p' = normalize(p m). Mutants: verifying with q as
  drawn (not renormalised over the allowed tokens); the cut row's draw reusing the drafter's noise."""
  rows, position = 20_000, 7
  sampling = specjax.SamplingParams(temperature=1.0, seed=1)
  p = np.array([0.3, 0.3, 0.4])
  q = np.array([0.45, 0.05, 0.5])
  bitmask = jnp.full((rows, 2, 1), 0b011, jnp.int32)
  seq_ids = jnp.arange(rows, dtype=jnp.int32)
  positions = jnp.full((rows,), position, jnp.int32)
  keys = sampling_lib.row_keys(sampling.seed, seq_ids, positions, sampling_lib.STREAM_SAMPLE)
  drafts = sampling_lib.gumbel_argmax(jnp.log(jnp.tile(jnp.asarray(q, jnp.float32), (rows, 1))), keys)[:, None]
  kept = drafts[:, 0] != 2
  logits = mask_logits(jnp.log(jnp.tile(jnp.asarray(p, jnp.float32), (rows, 2, 1))), bitmask)
  q_drawn = jnp.tile(jnp.asarray(q, jnp.float32), (rows, 1, 1))
  want = np.array([0.5, 0.5, 0.0])

  def pvalue(q_verified, fresh_last):
    _, tokens = verify_lib.verify(
        logits, drafts, kept.astype(jnp.int32), q_verified, sampling, seq_ids, positions, fresh_last=fresh_last
    )
    counts = np.bincount(np.asarray(tokens[:, 0]), minlength=3)
    assert counts[2] == 0
    return stats.chisquare(counts[:2], want[:2] * rows).pvalue

  pvalues = {
      'real': pvalue(mask_law(q_drawn, bitmask[:, :1]), ~kept),
      'q-not-renormalised': pvalue(q_drawn, ~kept),
      'cut-reuses-noise': pvalue(mask_law(q_drawn, bitmask[:, :1]), None),
  }
  print('p-values:', pvalues)
  assert pvalues['real'] > 1e-3 and max(pvalues['q-not-renormalised'], pvalues['cut-reuses-noise']) < 1e-6, pvalues


def test_tree_children_verify_with_their_masked_laws():
  """The tree verifier alone over V = 4 (tokens 0-2 allowed, 3 refused): two children of the root drawn without
  replacement from q (Gumbel top-2), a refused one cut (`node_ok`), the kept ones verified with their laws masked
  by the root's state (`tree_laws`). The first token follows p' = normalize(p m); verifying with q as drawn does
  not (q puts half its mass on the refused token)."""
  rows = 20_000
  sampling = specjax.SamplingParams(temperature=1.0, seed=2)
  p = np.array([0.3, 0.2, 0.2, 0.3])
  q = np.array([0.3, 0.05, 0.15, 0.5])
  rng = np.random.default_rng(0)
  first, second = np.argsort(-(np.log(q) - np.log(-np.log(rng.random((rows, 4))))), axis=1)[:, :2].T
  q_second = np.tile(q, (rows, 1))
  q_second[np.arange(rows), first] = 0.0
  q_drawn = np.stack([np.zeros((rows, 4)), np.tile(q, (rows, 1)), q_second / q_second.sum(1, keepdims=True)], 1)
  tokens = jnp.asarray(np.stack([np.zeros(rows), first, second], 1), jnp.int32)
  parents = jnp.zeros((rows, 3), jnp.int32)
  bitmask = jnp.full((rows, 3, 1), 0b0111, jnp.int32)
  logits = mask_logits(jnp.log(jnp.tile(jnp.asarray(p, jnp.float32), (rows, 3, 1))), bitmask)
  node_ok = tokens != 3
  seq_ids = jnp.arange(rows, dtype=jnp.int32)
  want = np.array([0.3, 0.2, 0.2]) / 0.7

  def pvalue(q_verified):
    _, _, out = verify_lib.verify_tree(
        logits,
        tokens,
        parents,
        jnp.full((rows,), 3),
        jnp.asarray(q_verified, jnp.float32),
        sampling,
        seq_ids,
        jnp.full((rows,), 5),
        max_depth=1,
        node_ok=node_ok,
    )
    counts = np.bincount(np.asarray(out[:, 0]), minlength=4)
    assert counts[3] == 0
    return stats.chisquare(counts[:3], want * rows).pvalue

  masked = tree_laws(jnp.asarray(q_drawn[:, 1:], jnp.float32), parents[:, 1:], bitmask)
  pvalues = {'real': pvalue(jnp.concatenate([jnp.zeros((rows, 1, 4)), masked], 1)), 'q-not-masked': pvalue(q_drawn)}
  print('p-values:', pvalues)
  assert pvalues['real'] > 1e-3 and pvalues['q-not-masked'] < 1e-6, pvalues


def test_json_schema_outputs_validate(tiny_model):
  sampling = specjax.SamplingParams(temperature=1.0, seed=7, json_schema=SCHEMA)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('grammar+ngram', tiny_model))
  results, _ = engine.generate(['Describe a pet as JSON:'] * 200, max_new_tokens=48, sampling=sampling, num_draft=4)
  finished = [r for r in results if r.finish_reason == 'eos']
  assert len(finished) >= 190
  for r in finished:
    text = tiny_model.tokenizer.decode(r.tokens)
    jsonschema.validate(json.loads(text), SCHEMA)
  for r in results:  # cut by the budget: valid so far
    matcher = new_matcher(tiny_model, compile_constraint(tiny_model, ('json_schema', json.dumps(SCHEMA))))
    eos = tiny_model.generation.eos_token_ids or tiny_model.tokenizer.eos_ids
    assert matcher.consume_tokens([t for t in r.tokens if t not in eos])
  assert sum(r.spec.forced_accepted for r in results) > 0


def test_matcher_follows_emitted_tokens_only(tiny_model):
  """A step's cuts and masks leave each matcher where it was; the commit moves it by what the row emitted."""
  grammar = compile_constraint(tiny_model, ('regex', REGEX))
  rows = RowGrammars.compile(tiny_model, [grammar, grammar], 2)
  good = tiny_model.tokenizer.encode('ab12-ab.', add_bos=False)
  before = rows.bitmask(np.array([True, True]))
  drafts = np.array([good[:3] + [0], [good[0], 500, good[1], good[2]]], np.int32)  # row 1: refused at 1
  inputs = rows.step(drafts, np.array([4, 4]), np.array([True, True]))
  assert inputs.draft_lens.tolist() == [3, 1] and inputs.fresh.tolist() == [True, True]
  np.testing.assert_array_equal(rows.bitmask(np.array([True, True])), before)
  np.testing.assert_array_equal(inputs.bitmask[:, 0], before)
  rows.commit(np.array([good[:2], good[:2]]), np.array([2, 1]))
  for row, n in enumerate([2, 1]):
    fresh = RowGrammars.compile(tiny_model, [grammar], 1)
    fresh.commit(np.array([good[:n]]), np.array([n]))
    np.testing.assert_array_equal(rows.bitmask(np.array([True, True]))[row], fresh.bitmask(np.array([True]))[0])


def test_scheduler_mixes_constrained_and_plain_requests(tiny_model, tiny_engine, draft_model):
  """`specjax serve`'s scheduler: constrained (regex, JSON Schema) and plain greedy requests in one batch, each
  equal to `Engine.generate`'s output for its own constraint; the constrained ones accept drafts."""
  from specjax.engine.requests import Request  # pylint: disable=g-import-not-at-top
  from specjax.engine.scheduler import Scheduler  # pylint: disable=g-import-not-at-top

  drafter = make_drafter('draft-model', tiny_model, draft_model=draft_model)
  engine = specjax.Engine(tiny_model, page_size=4, drafter=drafter, max_draft=3)
  samplings = [
      specjax.SamplingParams(regex=REGEX),
      specjax.SamplingParams(json_schema=SCHEMA),
      specjax.SamplingParams(),
      specjax.SamplingParams(regex=REGEX),
  ]
  prompts = ['The cat sat on the mat. The cat', *RAGGED_PROMPTS]
  ids = engine.encode(prompts)
  with Scheduler(engine, max_slots=4, max_seq_len=96).start() as scheduler:
    handles = [scheduler.submit(Request(p, 24, sampling=s, num_draft=3)) for p, s in zip(ids, samplings)]
    results = [h.result(timeout=300) for h in handles]
  reference = tiny_engine
  for prompt, sampling, result in zip(prompts, samplings, results):
    want, _ = reference.generate([prompt], max_new_tokens=24, sampling=sampling)
    assert result.tokens == want[0].tokens, sampling.constraint
  assert sum(r.stats.accepted for r, s in zip(results, samplings) if s.constraint) > 0


def test_scheduler_serves_constrained_trees(damped_and_reader):
  """The scheduler with a tree drafter: constrained and plain requests in one batch, each equal to constrained
  (or plain) AR, the constrained ones accepting tree nodes."""
  from specjax.engine.requests import Request  # pylint: disable=g-import-not-at-top
  from specjax.engine.scheduler import Scheduler  # pylint: disable=g-import-not-at-top

  damped, reader = damped_and_reader
  drafter = make_drafter('eagle3', damped, draft_model=reader, tree_topk=2, tree_tokens=6)
  engine = specjax.Engine(damped, page_size=4, drafter=drafter, max_draft=3)
  samplings = [specjax.SamplingParams(regex='[^e]*'), specjax.SamplingParams(), specjax.SamplingParams(regex='[^ao]*')]
  ids = engine.encode(RAGGED_PROMPTS)
  with Scheduler(engine, max_slots=4, max_seq_len=96).start() as scheduler:
    handles = [scheduler.submit(Request(p, 24, sampling=s, num_draft=3)) for p, s in zip(ids, samplings)]
    results = [h.result(timeout=300) for h in handles]
  reference = specjax.Engine(damped, page_size=4)
  for prompt, sampling, result in zip(RAGGED_PROMPTS, samplings, results):
    want, _ = reference.generate([prompt], max_new_tokens=24, sampling=sampling)
    assert result.tokens == want[0].tokens, sampling.constraint
  assert sum(r.stats.accepted for r, s in zip(results, samplings) if s.constraint) > 0


def test_cli_constraints(capsys, tmp_path):
  from specjax import cli  # pylint: disable=g-import-not-at-top

  schema = tmp_path / 'schema.json'
  schema.write_text(json.dumps(SCHEMA))
  code = cli.main(
      [
          'run',
          '-m',
          TINY,
          '--drafter',
          'grammar+ngram',
          '--prompt',
          'Hi',
          '--json-schema',
          str(schema),
          '--max-new-tokens',
          '48',
          '--temperature',
          '1',
          '--seed',
          '2',
          '--page-size',
          '4',
          '--json',
      ]
  )
  out, err = capsys.readouterr()
  assert code == 0, err
  row = json.loads(out)
  jsonschema.validate(json.loads(row['text']), SCHEMA)
  assert row['spec']['forced_drafted'] > 0
  code = cli.main(['generate', '-m', TINY, '--prompt', 'Hi', '--regex', '[a-z'])
  out, err = capsys.readouterr()
  assert code == 2 and out == '' and err.startswith('error: regex: ') and 'unclosed character class' in err


def test_scheduler_forced_only_drafter(tiny_model, tiny_engine):
  """`grammar` alone in the scheduler: each step verifies as wide as the rows' forced runs; outputs equal
  `Engine.generate`'s; forced drafts are counted per request and in the scheduler's metrics."""
  from specjax.engine.requests import Request  # pylint: disable=g-import-not-at-top
  from specjax.engine.scheduler import Scheduler  # pylint: disable=g-import-not-at-top

  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('grammar', tiny_model), max_draft=4)
  sampling = specjax.SamplingParams(json_schema=SCHEMA)
  ids = engine.encode(RAGGED_PROMPTS)
  with Scheduler(engine, max_slots=4, max_seq_len=96).start() as scheduler:
    handles = [scheduler.submit(Request(p, 24, sampling=sampling, num_draft=4)) for p in ids]
    results = [h.result(timeout=300) for h in handles]
    metrics = scheduler.metrics()
  want, _ = tiny_engine.generate(RAGGED_PROMPTS, max_new_tokens=24, sampling=sampling)
  assert [r.tokens for r in results] == [w.tokens for w in want]
  assert sum(r.stats.forced_drafted for r in results) == metrics['forced_drafted'] > 0
  assert metrics['forced_accepted'] == sum(r.stats.forced_accepted for r in results)
