"""The model contract: explicit positions, tree masks, cache-free forward, taps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.models.contract import CausalLM, StepInputs
from specjax.models.layers import AttentionSpec, Rope
from specjax.models.transformer import DecoderLM, DecoderSpec
from conftest import TINY, make_cache


def random_llama(window=None, seed=0):
  """A random Llama-shaped decoder (GQA, llama3 RoPE, optional window), initialised from nnx.Rngs."""
  rope = Rope(base=10_000.0, kind='llama3', factor=8.0, original_max_position_embeddings=16)
  layers = tuple(AttentionSpec(4, 2, 16, rope, scale=16**-0.5, window=w) for w in (window, None))
  spec = DecoderSpec(vocab_size=97, hidden_size=32, intermediate_size=64, layers=layers, tie_embeddings=False)
  return DecoderLM(spec, rngs=nnx.Rngs(seed))


@pytest.fixture(scope='module', params=['gemma3', 'llama-window', 'gemma4'])
def module(request):
  if request.param == 'gemma3':
    return specjax.load(TINY).module()
  if request.param == 'gemma4':  # KV-shared layers read their donors' pages
    from conftest import FIXTURES

    return specjax.load(f'{FIXTURES}/tiny_gemma4').module()
  return random_llama(window=6)


def jitted_forward(module):
  """`forward(tokens, inputs, cache, taps=())` of `module`, jitted (the graph split once)."""
  graphdef, state = nnx.split(module)
  run = jax.jit(
      lambda state, tokens, inputs, cache, taps: nnx.merge(graphdef, state).forward(tokens, inputs, cache, taps),
      static_argnums=4,
  )
  return lambda tokens, inputs, cache, taps=(): run(state, tokens, inputs, cache, taps)


class Shapes:
  """`make_cache` reads the cache layout off a Model; a bare module gives the same."""

  def __init__(self, module):
    layout = module.cache_layout()
    self.kv_shapes, self.state_shapes = list(layout.kv_shapes), list(layout.state_shapes)


def random_tree(rng, n):
  """Parents (node i's parent < i), depths and the ancestor-or-self mask of a random tree."""
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
  mask = np.zeros((n, n), bool)
  depths = np.zeros(n, np.int32)
  for i in range(n):
    node = i
    while node >= 0:
      mask[i, node] = True
      node = parents[node]
    depths[i] = mask[i].sum() - 1
  return parents, depths, mask


def path(parents, i):
  nodes = []
  while i >= 0:
    nodes.append(i)
    i = parents[i]
  return nodes[::-1]


def test_modules_implement_the_contract(module):
  assert isinstance(module, CausalLM)
  layer = module.draft_layer_spec()  # plain: no window, no gate, a RoPE a Llama config spells
  assert layer.attention.window is None and not layer.attention.output_gate and layer.attention.kv == 'own'
  assert layer.attention.rope.kind in ('default', 'linear', 'llama3') and not layer.attention.rope.rotary_dim
  donors = module.kv_donors()
  assert donors == ({'sliding_attention': 3, 'full_attention': 2} if 'Gemma4' in type(module).__name__ else {})


def test_tree_nodes_equal_chains_along_their_paths(module):
  """Node i at position prefix + depth(i), seeing its ancestors only: its logits are a chain forward's."""
  rng = np.random.default_rng(0)
  vocab = module.logits(jnp.zeros((1, module.embed(jnp.zeros((1, 1), jnp.int32)).shape[-1]))).shape[-1]
  b, prefix, n = 2, 13, 7  # prefix past the window of 6 / 8 on sliding layers
  prompt = rng.integers(0, vocab, (b, prefix)).astype(np.int32)
  nodes = rng.integers(0, vocab, (b, n)).astype(np.int32)
  trees = [random_tree(rng, n) for _ in range(b)]
  forward = jitted_forward(module)
  cache = make_cache(Shapes(module), b, prefix + n, page_size=4, shuffle_pages=True)
  _, cache, _ = forward(jnp.asarray(prompt), StepInputs.chain(cache, jnp.full((b,), prefix), prefix), cache)
  depths = jnp.asarray(np.stack([t[1] for t in trees]))
  mask = jnp.asarray(np.stack([t[2] for t in trees]))
  inputs = StepInputs.tree(cache, depths, mask, jnp.full((b,), n, jnp.int32))
  hidden, _, _ = forward(jnp.asarray(nodes), inputs, cache)
  tree_logits = np.asarray(module.logits(hidden))
  for i in range(n):  # each row's path to its node i, as one ragged chain block
    paths = [path(parents, i) for parents, _, _ in trees]
    chains = np.zeros((b, n), np.int32)
    for row, p in enumerate(paths):
      chains[row, : len(p)] = nodes[row, p]
    lens = jnp.asarray([len(p) for p in paths], jnp.int32)
    h, _, _ = forward(jnp.asarray(chains), StepInputs.chain(cache, lens, n), cache)
    for row, p in enumerate(paths):
      want = np.asarray(module.logits(h[row, len(p) - 1]))
      np.testing.assert_allclose(tree_logits[row, i], want, atol=2e-5 * np.abs(want).max(), rtol=0)


def test_cache_free_forward_equals_paged(module):
  rng = np.random.default_rng(1)
  b, t = 2, 12
  tokens = jnp.asarray(rng.integers(0, 50, (b, t)).astype(np.int32))
  lens = jnp.asarray([t, 9], jnp.int32)
  cache = make_cache(Shapes(module), b, t, page_size=4)
  forward = jitted_forward(module)
  paged, _, paged_taps = forward(tokens, StepInputs.chain(cache, lens, t), cache, (0,))
  free, none, free_taps = forward(tokens, StepInputs.chain(None, lens, t), None, (0,))
  assert none is None
  for got, want in ((free, paged), (free_taps[0], paged_taps[0])):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(got[1, :9], want[1, :9], atol=2e-5 * np.abs(want).max(), rtol=0)


def test_cache_free_tree_equals_chains(module):
  """Training's form: a tree over the given tokens alone (positions from `start`)."""
  rng = np.random.default_rng(2)
  n = 6
  parents, depths, mask = random_tree(rng, n)
  nodes = rng.integers(0, 50, (1, n)).astype(np.int32)
  start = jnp.asarray([5], jnp.int32)
  forward = jitted_forward(module)
  inputs = StepInputs.tree(None, jnp.asarray(depths[None]), jnp.asarray(mask[None]), jnp.asarray([n]), start=start)
  hidden, _, _ = forward(jnp.asarray(nodes), inputs, None)
  for i in range(n):
    p = path(parents, i)
    chain = np.zeros((1, n), np.int32)
    chain[0, : len(p)] = nodes[0, p]
    h, _, _ = forward(jnp.asarray(chain), StepInputs.chain(None, jnp.asarray([len(p)]), n, start=start), None)
    want = np.asarray(h)[0, len(p) - 1]
    np.testing.assert_allclose(np.asarray(hidden)[0, i], want, atol=2e-6 * np.abs(want).max(), rtol=0)


def test_random_init_from_rngs():
  a, b = random_llama(seed=0), random_llama(seed=1)
  wa, wb = nnx.state(a, nnx.Param), nnx.state(b, nnx.Param)
  assert not np.allclose(np.asarray(wa['embed_tokens'][...]), np.asarray(wb['embed_tokens'][...]))
  assert float(jnp.std(wa['layers'][0]['mixer']['qkv_proj'][...])) > 0.05
  np.testing.assert_array_equal(np.asarray(wa['norm']['scale'][...]), 1.0)  # plain-weight norms start at 1


def test_hybrid_refuses_tree_masks():
  from conftest import FIXTURES

  hybrid = specjax.load(f'{FIXTURES}/tiny_qwen3_5').module()
  mask = jnp.tril(jnp.ones((1, 3, 3), bool))
  with pytest.raises(ValueError, match='tree masks'):
    hybrid.forward(jnp.zeros((1, 3), jnp.int32), StepInputs(jnp.arange(3)[None], jnp.asarray([3]), mask), None)


def test_prefill_hands_the_whole_prompts_taps_to_the_drafter(tiny_model):
  """Chunked prefill: the drafter's prefill gets every chunk's taps, equal to one full forward's."""
  import dataclasses
  from specjax.drafters.base import Drafter

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass
  class Seen:
    taps: jax.Array  # [B, C, D] tap 0 of every prompt position, written chunk by chunk
    written: jax.Array  # [B]

  @dataclasses.dataclass(frozen=True)
  class TapRecorder(Drafter):
    name: str = 'tap-recorder'
    taps: tuple[int, ...] = (0, 2)

    def init_state(self, plan):
      return Seen(
          jnp.zeros((plan.batch, plan.capacity, tiny_model.config.hidden_size)), jnp.zeros((plan.batch,), jnp.int32)
      )

    def prefill(self, target, params, state, tokens, query_lens, hidden, taps=()):
      assert len(taps) == 2 and taps[0].shape == hidden.shape
      rows = jnp.arange(tokens.shape[0])[:, None]
      cols = state.written[:, None] + jnp.arange(tokens.shape[1])[None, :]
      cols = jnp.where(jnp.arange(tokens.shape[1])[None, :] < query_lens[:, None], cols, state.taps.shape[1])
      return Seen(state.taps.at[rows, cols].set(taps[0], mode='drop'), state.written + query_lens)

  engine = specjax.Engine(tiny_model, page_size=4, drafter=TapRecorder(), prefill_chunk=16)
  prompts = [list(range(5, 45)), list(range(7, 30))]  # 40 and 23 tokens: three and two chunks of 16
  eos = jnp.asarray([-1], jnp.int32)
  state = engine.prefill(prompts, 4, specjax.SamplingParams(), eos)
  module = tiny_model.module()
  first_tap = jax.jit(  # one program per prompt length
      lambda ids: module.forward(ids, StepInputs.chain(None, jnp.asarray([ids.shape[1]]), ids.shape[1]), None, (0, 2))
  )
  for row, p in enumerate(prompts):
    want = first_tap(jnp.asarray([p]))[2][0]
    got = np.asarray(state.drafter.taps[row, : len(p)])
    np.testing.assert_allclose(got, np.asarray(want[0]), atol=1e-5 * np.abs(want).max(), rtol=0)
    assert int(state.drafter.written[row]) == len(p)


def test_trace_records_each_step(tiny_model):
  from specjax.drafters import make_drafter

  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model), max_draft=4)
  prompt = 'The capital of France is Paris. The capital of France is'
  results, stats = engine.generate([prompt], max_new_tokens=16, num_draft=3, trace=True)
  r = results[0]
  assert len(r.trace) == stats.decode_steps
  assert [t for step in r.trace for t in step['emitted']] == r.tokens[1:]  # the first token comes from prefill
  for step in r.trace:
    assert step['k'] == 3 and len(step['drafts']) <= 3 and 0 <= step['accepted'] <= len(step['drafts'])
    assert step['drafts'][: step['accepted']] == step['emitted'][: step['accepted']]
  assert sum(s['accepted'] for s in r.trace) == r.spec.accepted
  plain, _ = engine.generate([prompt], max_new_tokens=16, num_draft=3)
  assert plain[0].trace is None and plain[0].tokens == r.tokens


def test_dtype_setting(tmp_path):
  bf16 = specjax.load(TINY, dtype='bfloat16')
  assert bf16.dtype == jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(bf16.params)} == {jnp.dtype('bfloat16')}
  results, _ = specjax.Engine(bf16, page_size=4).generate(['The capital of France is'], max_new_tokens=4)
  assert len(results[0].tokens) == 4
  assert specjax.load(TINY).dtype == jnp.float32  # the CPU default
  with pytest.raises(specjax.SpecjaxError, match='unknown dtype'):
    specjax.load(TINY, dtype='int8')


def test_hybrid_cache_free_forward_equals_paged():
  """Without a cache the Gated DeltaNet layers start from zero state: the same hidden states as the paged forward."""
  from conftest import FIXTURES

  model = specjax.load(f'{FIXTURES}/tiny_qwen3_5')
  forward = jitted_forward(model.module())
  b, t = 2, 10
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 100, (b, t)).astype(np.int32))
  lens = jnp.asarray([t, 7], jnp.int32)
  cache = make_cache(model, b, t)
  paged, _, _ = forward(tokens, StepInputs.chain(cache, lens, t), cache)
  free, _, _ = forward(tokens, StepInputs.chain(None, lens, t), None)
  np.testing.assert_allclose(np.asarray(free)[0], np.asarray(paged)[0], atol=1e-5)
  np.testing.assert_allclose(np.asarray(free)[1, :7], np.asarray(paged)[1, :7], atol=1e-5)
