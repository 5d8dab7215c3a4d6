"""Draft trees through the engine: verify every node in one pass, commit the accepted path.

An oracle tree drafter knows the autoregressive continuation and hides it at
a varying sibling of a fixed tree (with distractors around it, and cut short
at varying depths), so accepted paths run through later siblings and end at
every depth. The speculative output must equal the autoregressive output
token for token: greedy, and sampling (sample-and-match: no q).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from specjax.drafters import Drafter, Proposal
from specjax.models.layers import AttentionSpec, Rope
from specjax.models.transformer import DecoderLM, DecoderSpec
from conftest import TINY

PROMPTS = ['def add(a, b):\n    return a + b\n', 'The cat sat on the mat. The cat', 'Hello']
BRANCHING = (3, 2, 2, 1, 1, 1)  # children per node at each depth


def tree_parents(depth: int) -> np.ndarray:
  """Node i + 1's parent (0: the root) of a tree with `BRANCHING` children per node, `depth` deep."""
  parents, level = [], [0]
  for width in BRANCHING[:depth]:
    nxt = []
    for p in level:
      for _ in range(width):
        parents.append(p)
        nxt.append(len(parents))
    level = nxt
  return np.array(parents, np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class OracleTree(Drafter):
  truth: jax.Array = None  # [B, C] each row's autoregressive text (prompt + continuation)
  vocab: int = 2
  name: str = 'oracle-tree'
  tree_tokens: int = len(tree_parents(len(BRANCHING)))

  def propose(self, target, params, state, cache, ctx, k, sampling):
    parents = tree_parents(k)
    n = len(parents)
    depth = np.zeros(n + 1, np.int32)
    rank = np.zeros(n + 1, np.int32)
    for i, p in enumerate(parents, start=1):
      depth[i] = depth[p] + 1
      rank[i] = sum(parents[: i - 1] == p)
    b = ctx.lengths.shape[0]
    pos = ctx.lengths[:, None] + jnp.asarray(depth[1:])[None, :]  # [B, N] the position each node claims
    true = jnp.take_along_axis(self.truth, jnp.minimum(pos, self.truth.shape[1] - 1), axis=1)
    width = jnp.asarray(np.array(BRANCHING)[np.maximum(depth[1:] - 1, 0)])
    hidden_at = (ctx.lengths[:, None] * 7 + jnp.asarray(depth[1:])[None, :]) % (width + 1)  # == width: no truth
    on_path = jnp.ones((b, n + 1), bool)  # the node is the truth so far
    tokens = jnp.zeros((b, n), jnp.int32)
    for i in range(1, n + 1):
      is_true = on_path[:, parents[i - 1]] & (hidden_at[:, i - 1] == rank[i])
      on_path = on_path.at[:, i].set(is_true)
      tokens = tokens.at[:, i - 1].set(jnp.where(is_true, true[:, i - 1], (true[:, i - 1] + 1 + rank[i]) % self.vocab))
    lens = jnp.where(ctx.active, n - ctx.seq_ids % 2, 0)  # ragged: odd rows drop their last node
    parents_b = jnp.broadcast_to(jnp.asarray(parents), (b, n))
    return Proposal(tokens, lens, None, state, cache, parents_b)


def autoregressive(model, sampling, new_tokens):
  engine = specjax.Engine(model, page_size=4)
  results, _ = engine.generate(PROMPTS, max_new_tokens=new_tokens, sampling=sampling)
  ids = engine.encode(PROMPTS)
  truth = np.zeros((4, 128), np.int32)
  for row, (prompt, r) in enumerate(zip(ids, results)):
    seq = prompt + r.tokens
    truth[row, : len(seq)] = seq
  return [r.tokens for r in results], jnp.asarray(truth)


@pytest.fixture(scope='module', params=['gemma3', 'llama-window'])
def target(request):
  if request.param == 'gemma3':
    return specjax.load(TINY)
  model = specjax.load(TINY)  # the tokenizer and config of the tiny Gemma, a random windowed Llama body
  rope = Rope(base=10_000.0, kind='llama3', factor=8.0, original_max_position_embeddings=16)
  layers = tuple(AttentionSpec(4, 2, 16, rope, scale=16**-0.5, window=w) for w in (6, None))
  spec = DecoderSpec(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64, layers=layers)
  module = DecoderLM(spec, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(module)
  kv_shapes = list(module.cache_layout().kv_shapes)
  return dataclasses.replace(model, graphdef=graphdef, params=params, kv_shapes=kv_shapes, architecture='llama')


@pytest.mark.parametrize('sampling', [specjax.SamplingParams(), specjax.SamplingParams(temperature=0.8, seed=3)])
def test_tree_speculation_equals_autoregressive_every_depth(target, sampling):
  reference, truth = autoregressive(target, sampling, 30)
  drafter = OracleTree(truth=truth, vocab=target.config.vocab_size)
  engine = specjax.Engine(target, page_size=4, drafter=drafter, max_draft=6)
  for k in range(1, 7):
    results, _ = engine.generate(PROMPTS, max_new_tokens=30, num_draft=k, sampling=sampling)
    assert [r.tokens for r in results] == reference, k
    spec = results[0].spec
    assert spec.to_json()['tree_nodes'] > k  # every node of the tree was verified
    if k >= 3:
      assert spec.to_json()['accepted_path'] > 1.0  # paths through later siblings were accepted


def test_trained_mtp_heads_draft_trees_too(tmp_path):
  """A (random) MTP head for a dense target, exported as `specjax train` does, drafts dynamic and static trees."""
  from specjax.drafters import make_drafter
  from specjax.loading.mtp_head import head_for, save_mtp_head

  model = specjax.load(TINY)
  _, params = nnx.split(head_for(model, rngs=nnx.Rngs(0)))
  save_mtp_head(str(tmp_path / 'head'), model, params)
  reference, _ = autoregressive(model, specjax.SamplingParams(), 16)
  for options in ({'tree_topk': 2, 'tree_tokens': 5}, {'tree_parents': '0,0,1,2'}):
    drafter = make_drafter('mtp', model, draft_model=str(tmp_path / 'head'), **options)
    engine = specjax.Engine(model, page_size=4, drafter=drafter, max_draft=3)
    for k in (1, 3):
      results, _ = engine.generate(PROMPTS, max_new_tokens=16, num_draft=k)
      assert [r.tokens for r in results] == reference, (options, k)
