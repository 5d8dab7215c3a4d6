"""Tree verification (`verify.verify_tree`) and the tree helpers (`specjax.trees`).

The statistical tests draft and verify many independent trees in two jitted
calls (one row per trial, independent keys through the sequence id): a toy
target and draft whose logits depend on the context (tables indexed by the
tokens so far), trees of depth 2 drawn with `trees.draw_children`, pruned,
compacted and verified. The first emitted token and the first two (the second
completed by a plain draw when only one was emitted) are tested against the
target's exact law by a chi-square goodness-of-fit test at significance ALPHA
(fixed seeds make the outcome deterministic). Broken verifiers, and pruning
that looks at the drafts' own scores, must fail the same test. Sampled dynamic
trees grown by `tree_search.grow` (depth 3, the first three tokens) are tested
so too, with mutants of the builder and of the verifier.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling as sampling_lib
from specjax import trees
from specjax import verify as verify_lib
from specjax.errors import SpecjaxError
from specjax.sampling import STREAM_SAMPLE, SamplingParams

ALPHA = 1e-3
V = 6
TRIALS = 20000
# Template of the drawn trees: the root has 3 children, each of them 2.
TEMPLATE = np.array([0, 0, 0, 0, 1, 1, 2, 2, 3, 3])
RANKS = np.array([0, 0, 1, 2, 0, 1, 0, 1, 0, 1])  # rank among siblings
POSITION = 7


def chi2_pvalue(samples, law):
  """Chi-square test of categories against an exact law (cells expecting < 5 pooled)."""
  observed = np.bincount(samples, minlength=len(law)).astype(np.float64)
  if observed[law <= 0].sum():
    return 0.0  # a category the law gives probability 0
  expected = law / law.sum() * len(samples)
  big = expected >= 5
  f_obs, f_exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
  keep = f_exp > 0
  if keep.sum() < 2:
    return 1.0
  return stats.chisquare(f_obs[keep], f_exp[keep] * f_obs[keep].sum() / f_exp[keep].sum()).pvalue


# --- tree helpers ---------------------------------------------------------------------------------------------


def brute_ancestors(parents):  # [N] -> [N, N]
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    mask[i, j] = True
    while j:
      j = parents[j]
      mask[i, j] = True
  return mask


def test_ancestor_mask_and_depths():
  rows = np.array(
      [
          [0, 0, 0, 1, 1, 2, 3, 3, 6, 8, 9, 10, 0],  # a deep branch, then a padding node
          [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],  # a chain
          [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # a star
      ]
  )
  mask = np.asarray(trees.ancestor_mask(jnp.asarray(rows)))
  for row, got in zip(rows, mask):
    np.testing.assert_array_equal(got, brute_ancestors(row))
  np.testing.assert_array_equal(trees.node_depths(jnp.asarray(rows)), mask.sum(-1) - 1)
  np.testing.assert_array_equal(trees.node_depths(jnp.asarray(rows[:1]))[0], [0, 1, 1, 2, 2, 2, 3, 3, 4, 5, 6, 7, 1])
  np.testing.assert_array_equal(trees.sibling_ranks(jnp.asarray(rows[:1]))[0], [0, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 2])
  assert trees.ancestor_mask(jnp.zeros((2, 1), jnp.int32)).tolist() == [[[True]], [[True]]]


def test_static_tree():
  np.testing.assert_array_equal(trees.static_tree([-1, 0, 0, 1, 2, 1]), [0, 0, 0, 1, 2, 1])
  assert trees.static_tree((0,)).dtype == np.int32
  assert trees.static_tree(np.array([0, 0, 1])).tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    'parents, message',
    [
        ([], 'non-empty'),
        ('001', 'non-empty'),
        ([0, 0.5], r'parents\[1\] must be an integer'),
        ([0, True], r'parents\[1\] must be an integer'),
        ([2, 0], r'parents\[0\] is the root'),
        ([0, 0, 2], r'parents\[2\] = 2 must be an earlier node'),
        ([0, -1], r'parents\[1\] = -1'),
        ([0, 0, 1, 0], 'node 3 \\(depth 1\\) comes after a node of depth 2'),
    ],
)
def test_static_tree_errors(parents, message):
  with pytest.raises(SpecjaxError, match=message):
    trees.static_tree(parents)


def test_draw_children_without_replacement_law():
  logq = jnp.log(jnp.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
  keys = jax.random.split(jax.random.key(3), TRIALS)
  tokens, q_cond, logq_child, valid = jax.jit(trees.draw_children, static_argnums=(1, 3))(
      jnp.broadcast_to(logq, (TRIALS, V)), 3, keys, False
  )
  tokens, q_cond, valid = np.asarray(tokens), np.asarray(q_cond), np.asarray(valid)
  q = np.exp(np.asarray(logq))
  assert valid.all() and (tokens[:, 0] != tokens[:, 1]).all() and (tokens[:, 1] != tokens[:, 2]).all()
  # P(c0 = a, c1 = b) = q(a) q(b) / (1 - q(a)), a != b.
  joint = q[:, None] * q[None, :] / (1 - q[:, None]) * (1 - np.eye(V))
  assert chi2_pvalue(tokens[:, 0] * V + tokens[:, 1], joint.ravel()) > ALPHA
  # q_cond: q without the earlier children, renormalised; logq_child under q.
  for row in range(20):
    for r in range(3):
      want = np.where(np.isin(np.arange(V), tokens[row, :r]), 0.0, q)
      np.testing.assert_allclose(q_cond[row, r], want / want.sum(), rtol=1e-5)
  np.testing.assert_allclose(logq_child, np.log(q)[tokens], rtol=1e-5)
  # Child 0 is the plain sampler's draw with the same key ("coupled" drafting).
  np.testing.assert_array_equal(tokens[:, 0], sampling_lib.gumbel_argmax(jnp.broadcast_to(logq, (TRIALS, V)), keys))


def test_draw_children_greedy_and_invalid():
  logq = jnp.array([[1.0, 3.0, 3.0, 0.0, -jnp.inf, 2.0], [0.0, -jnp.inf, 5.0, -jnp.inf, -jnp.inf, -jnp.inf]])
  draw = jax.jit(trees.draw_children, static_argnums=(1, 3))
  tokens, q_cond, logq_child, valid = draw(logq, 4, None, True)
  assert tokens.tolist() == [[1, 2, 5, 0], [2, 0, 0, 0]]  # ties: first index first
  assert valid.tolist() == [[True] * 4, [True, True, False, False]]
  q = np.asarray(jax.nn.softmax(logq))
  np.testing.assert_allclose(q_cond[0, 1], np.where(np.arange(V) == 1, 0, q[0]) / (1 - q[0, 1]), rtol=1e-5)
  np.testing.assert_allclose(q_cond[1, 1], np.eye(V)[0], atol=1e-6)
  assert (np.asarray(q_cond[1, 2:]) == 0).all() and (np.asarray(logq_child[1, 2:]) == -np.inf).all()
  # Sampled: a draft law with two tokens (top_k=2) and 4 children to draw.
  logq = log_probs(np.random.default_rng(0).normal(size=(500, V)).astype(np.float32), SamplingParams(1.0, top_k=2))
  tokens, q_cond, logq_child, valid = draw(logq, 4, jax.random.split(jax.random.key(1), 500), False)
  assert valid.tolist() == [[True, True, False, False]] * 500
  assert (np.asarray(logq)[np.arange(500)[:, None], np.asarray(tokens[:, :2])] > -np.inf).all()
  assert (np.asarray(q_cond[:, 2:]) == 0).all() and np.isfinite(q_cond).all()
  np.testing.assert_allclose(q_cond[:, 1].sum(-1), 1.0, rtol=1e-6)


# --- greedy on hand-made trees --------------------------------------------------------------------------------

# root -> 1 (token 3), 2 (5); 1 -> 3 (1); 2 -> 4 (2), 5 (2), 6 (4); 4 -> 7 (0)
HAND_PARENTS = [0, 0, 0, 1, 2, 2, 2, 4]
HAND_TOKENS = [9, 3, 5, 1, 2, 2, 4, 0]
HAND_ARGMAX = jnp.array([5, 1, 2, 6, 0, 3, 3, 7])  # target argmax at each node


@functools.partial(jax.jit, static_argnums=(2,))
def hand_verify(argmax_at, num_nodes, max_depth=3, tokens=HAND_TOKENS):
  b = num_nodes.shape[0]
  logits = jax.nn.one_hot(jnp.asarray(argmax_at), 10) * 4.0 + 0.1 * jnp.arange(10) / 10
  return verify_lib.verify_tree(
      jnp.broadcast_to(logits, (b, len(tokens), 10)),
      jnp.broadcast_to(jnp.asarray(tokens), (b, len(tokens))),
      jnp.broadcast_to(jnp.asarray(HAND_PARENTS), (b, len(tokens))),
      jnp.asarray(num_nodes),
      None,
      SamplingParams(),
      jnp.arange(b),
      jnp.zeros(b, jnp.int32),
      max_depth,
  )


def test_greedy_tree_hand_made():
  # Through the second child of the root, the first of its children (tokens tie), to depth 3.
  n, path, out = hand_verify(HAND_ARGMAX, jnp.array([8, 7, 3, 1]))
  assert n.tolist() == [3, 2, 1, 0]  # ragged rows: padding nodes are never entered
  assert path.tolist() == [[0, 2, 4, 7], [0, 2, 4, 0], [0, 2, 0, 0], [0, 0, 0, 0]]
  assert [row[: k + 1] for row, k in zip(out.tolist(), n.tolist())] == [[5, 2, 0, 7], [5, 2, 0], [5, 2], [5]]
  # No child matches at the root.
  n, path, out = hand_verify(jnp.array([7, 1, 2, 6, 0, 3, 3, 7]), jnp.array([8]))
  assert n.tolist() == [0] and path.tolist() == [[0] * 4] and out[0, 0] == 7
  # Nodes deeper than max_depth are never accepted.
  n, path, out = hand_verify(HAND_ARGMAX, jnp.array([8]), 2)
  assert n.tolist() == [2] and path.tolist() == [[0, 2, 4]] and out.tolist() == [[5, 2, 0]]
  # The second sibling with token 2 (node 5) is entered when the first one is a different token.
  n, path, out = hand_verify(HAND_ARGMAX, jnp.array([8]), 3, jnp.array([9, 3, 5, 1, 8, 2, 4, 0]))
  assert n.tolist() == [2] and path.tolist() == [[0, 2, 5, 0]] and out[0, :3].tolist() == [5, 2, 3]


# --- chain-shaped trees are the chain verifier ----------------------------------------------------------------

CHAIN_SETTINGS = {
    'greedy': SamplingParams(),
    'plain': SamplingParams(temperature=1.0, seed=4),
    'top-k-top-p-min-p': SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=5),
}


def chain_as_tree(sampling, logits, drafts, draft_lens, q, seq_ids, positions):
  """`verify` and `verify_tree` on the same chain: node i + 1 is draft i, child of node i."""
  b, k = drafts.shape
  chain = verify_lib.verify(logits, drafts, draft_lens, q, sampling, seq_ids, positions)
  tree = verify_lib.verify_tree(
      logits,
      jnp.pad(drafts, ((0, 0), (1, 0))),
      jnp.broadcast_to(jnp.maximum(jnp.arange(k + 1) - 1, 0), (b, k + 1)),
      draft_lens + 1,
      None if q is None else jnp.pad(q, ((0, 0), (1, 0), (0, 0))),
      sampling,
      seq_ids,
      positions,
      k,
  )
  return chain, tree


@pytest.mark.parametrize(
    'setting, with_q',
    [('greedy', True), ('plain', False), ('plain', True), ('top-k-top-p-min-p', False), ('top-k-top-p-min-p', True)],
)
def test_chain_shaped_tree_is_chain_verify(setting, with_q):
  sampling = CHAIN_SETTINGS[setting]
  b, k, v = 4000, 4, 8
  rng = np.random.default_rng(11)
  logits = 2.0 * rng.normal(size=(b, k + 1, v)).astype(np.float32)
  # Draft logits near the target's; every 8th row drafts with the target itself (always accepted).
  draft_logits = logits[:, :k] + rng.normal(size=(b, k, v)).astype(np.float32) * (np.arange(b) % 8 > 0)[:, None, None]
  q = np.exp(np.asarray(log_probs(draft_logits, SamplingParams(1.0) if sampling.is_greedy else sampling)))
  cdf = np.cumsum(q, axis=-1)
  drafts = np.minimum(np.sum(rng.random((b, k, 1)) * cdf[..., -1:] >= cdf, axis=-1), v - 1).astype(np.int32)
  draft_lens = np.where(np.arange(b) < b // 2, k, rng.integers(0, k + 1, b)).astype(np.int32)
  seq_ids, positions = np.arange(b) * 3, np.arange(b) % 17

  run = jax.jit(functools.partial(chain_as_tree, sampling))
  (n_chain, out_chain), (n_tree, path, out_tree) = run(
      logits, drafts, draft_lens, q if with_q else None, seq_ids, positions
  )
  n_chain, n_tree = np.asarray(n_chain), np.asarray(n_tree)
  np.testing.assert_array_equal(n_tree, n_chain)
  emitted = np.arange(k + 1)[None, :] <= n_chain[:, None]
  np.testing.assert_array_equal(np.where(emitted, out_tree, -1), np.where(emitted, out_chain, -1))
  np.testing.assert_array_equal(path, np.where(emitted, np.arange(k + 1), 0))
  assert len(np.unique(n_chain)) == k + 1  # every acceptance length occurs


def test_a_draft_the_target_excludes_is_never_accepted():
  """Even when the accept uniform is exactly 0 (as it is for this seed, sequence and position)."""
  sampling = SamplingParams(temperature=1.0, top_k=2, seed=1)
  seq_ids, positions = np.array([2511]), np.array([7])
  key = sampling_lib.row_keys(sampling.seed, seq_ids, positions, sampling_lib.STREAM_ACCEPT)
  assert jax.random.uniform(key[0]) == 0.0
  logits = np.array([[[3.0, 2.0, 0.0, 0.0], [0.0] * 4]], np.float32)  # p excludes tokens 2 and 3
  q = np.array([[[0.1, 0.1, 0.8, 0.0]]], np.float32)
  (n_chain, out_chain), (n_tree, _, out_tree) = jax.jit(functools.partial(chain_as_tree, sampling))(
      logits, np.array([[2]], np.int32), np.array([1]), q, seq_ids, positions
  )
  assert n_chain.tolist() == n_tree.tolist() == [0] and out_chain[0, 0] == out_tree[0, 0] and out_tree[0, 0] in (0, 1)


# --- sampled trees --------------------------------------------------------------------------------------------

DEPTHS = np.array([0, 1, 1, 1, 2, 2, 2, 2, 2, 2])
log_probs = jax.jit(lambda logits, sampling: jnp.log(sampling_lib.probs(logits, sampling)), static_argnums=1)


def logit_tables(seed, draft_noise, depth=2):
  """Target and draft logits by context: [V] at the root, [V, V] after x1, [V, V, V] after (x1, x2), .. to
  `depth` tokens."""
  rng = np.random.default_rng(seed)
  target = [rng.normal(size=(V,) * (d + 1)).astype(np.float32) * 1.5 for d in range(depth + 1)]
  draft = [(t + rng.normal(size=t.shape) * draft_noise).astype(np.float32) for t in target]
  return target, draft


@functools.partial(jax.jit, static_argnames='greedy')
def draw_trees(logq0, logq1, seed, seq_ids, greedy):
  """Each trial's full template tree from log q tables [V], [V, V], drafted with the plain sampler's keys.

  Returns (tokens [T, N], q_cond [T, N, V], cumulative log q [T, N], valid [T, N]); node 0 is the root.
  """
  t = seq_ids.shape[0]
  keys = lambda depth, width: sampling_lib.row_keys(
      seed, jnp.broadcast_to(seq_ids[:, None], (t, width)), POSITION + depth
  )
  tok1, q1, logq_1, valid1 = trees.draw_children(jnp.broadcast_to(logq0, (t, 1, V)), 3, keys(0, 1), greedy)
  tok2, q2, logq_2, valid2 = trees.draw_children(logq1[tok1[:, 0]], 2, keys(1, 3), greedy)  # [T, 3, 2]
  nodes = lambda root, x1, x2: jnp.concatenate(
      [root, x1.reshape((t, 3) + x1.shape[3:]), x2.reshape((t, 6) + x2.shape[3:])], 1
  )
  return (
      nodes(jnp.zeros((t, 1), jnp.int32), tok1, tok2),
      nodes(jnp.zeros((t, 1, V)), q1, q2),
      nodes(jnp.zeros((t, 1)), logq_1, logq_1[:, 0, :, None] + logq_2),
      nodes(jnp.ones((t, 1), bool), valid1, valid2 & valid1[:, 0, :, None]),
  )


def prune_mask(rule, scores):  # -> [T, N] bool: the nodes the drafter keeps
  if rule == 'none':
    return np.ones(scores.shape, bool)
  if rule == 'random':  # independent of the draws
    return np.random.default_rng(99).random(scores.shape) > 0.3
  if rule == 'second':  # every second sibling (and its subtree) dropped: the third is still tried
    return np.broadcast_to(RANKS != 1, scores.shape)
  if rule == 'top-score':  # EAGLE-2's rerank: the root and the 4 best cumulative log q (looks at the draws)
    return scores >= np.sort(scores, axis=-1)[:, -5:-4]
  raise ValueError(rule)


def compact(keep, *arrays):
  """Drops the nodes not kept (with their subtrees), keeping breadth-first order: (parents, num_nodes, *arrays)."""
  order = np.argsort(~keep, axis=-1, kind='stable')
  new_index = np.cumsum(keep, axis=-1) - 1
  parents = np.where(np.take_along_axis(keep, order, -1), np.take_along_axis(new_index, TEMPLATE[order], -1), 0)
  gather = lambda x: np.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
  return parents.astype(np.int32), keep.sum(-1).astype(np.int32), *map(gather, arrays)


def run_trees(
    target, draft, *, prune='random', draft_noise=1.0, greedy_draft=False, pass_q=True, unconditioned_q=False, seed=0
):
  """Drafts, prunes and verifies TRIALS trees; returns numpy arrays and the target's logit tables."""
  p_tables, q_tables = logit_tables(seed, draft_noise)
  target = SamplingParams(**{**target.__dict__, 'seed': 1 + seed})
  logq0, logq1 = (log_probs(jnp.asarray(table), draft) for table in q_tables[:2])
  seq_ids = np.arange(TRIALS)
  tokens, q, scores, valid = map(np.asarray, draw_trees(logq0, logq1, target.seed, seq_ids, greedy=greedy_draft))
  parent_tokens = tokens[:, TEMPLATE]
  if unconditioned_q:  # the bug: siblings tested against q as if drawn with replacement
    q = np.where(DEPTHS[:, None] == 1, np.exp(logq0), np.exp(logq1)[parent_tokens])
  p0, p1, p2 = p_tables
  logits = np.where(DEPTHS[:, None] == 0, p0, np.where(DEPTHS[:, None] == 1, p1[tokens], p2[parent_tokens, tokens]))
  keep = valid & (prune_mask(prune, scores) | (np.arange(len(TEMPLATE)) == 0))  # the root stays
  keep &= keep[:, TEMPLATE]  # and the subtrees of dropped nodes go (the depth-1 nodes' parent is the root)
  parents, num_nodes, tokens, q, logits = compact(keep, tokens, q, logits)
  verify = functools.partial(verify_lib.verify_tree, sampling=target, max_depth=2)
  n, path, out = jax.jit(verify)(  # a fresh trace: monkeypatches take effect
      logits, tokens, parents, num_nodes, q if pass_q else None, seq_ids=seq_ids, positions=np.full(TRIALS, POSITION)
  )
  n, path, out = np.asarray(n), np.asarray(path), np.asarray(out)
  # The second token: emitted by this step, or else drawn by the next one from the target given x1.
  cdf = np.cumsum(np.exp(np.asarray(log_probs(jnp.asarray(p1), target), np.float64)), axis=-1)[out[:, 0]]
  next_token = np.sum(np.random.default_rng(7).random((TRIALS, 1)) * cdf[:, -1:] >= cdf, axis=-1)
  x2 = np.where(n >= 1, out[:, 1], next_token)
  result = dict(n=n, path=path, out=out, x2=x2, tokens=tokens, parents=parents, num_nodes=num_nodes)
  return result, p_tables


def target_laws(p_tables, target):
  """Exact law of the first token [V] and of the first two [V * V]."""
  p0, p1 = (np.exp(np.asarray(log_probs(jnp.asarray(table), target), np.float64)) for table in p_tables[:2])
  return p0, (p0[:, None] * p1).ravel()


def law_pvalues(result, p_tables, target):
  first, first_two = target_laws(p_tables, target)
  x1 = result['out'][:, 0]
  return chi2_pvalue(x1, first), chi2_pvalue(x1 * V + result['x2'], first_two)


TREE_SETTINGS = {
    # name: (target sampling, draft sampling, pruning)
    'plain': (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), 'random'),
    'top-k': (SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=0.8, top_k=3), 'second'),
    'top-p': (SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.8), 'random'),
    'min-p': (SamplingParams(temperature=1.2, min_p=0.15), SamplingParams(temperature=1.2, min_p=0.15), 'none'),
    # q of 2 tokens: the root's third child is invalid (left out).
    'q-top-2': (SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=2), 'none'),
}


@pytest.mark.parametrize('setting', list(TREE_SETTINGS))
def test_sampled_trees_emit_the_target_law(setting):
  target, draft, prune = TREE_SETTINGS[setting]
  result, p_tables = run_trees(target, draft, prune=prune)
  assert 0.1 < (result['n'] >= 1).mean() and (result['n'] == 2).mean() > 0.05  # drafts do get accepted
  if setting == 'q-top-2':
    assert (result['num_nodes'] == 7).all()
  p_first, p_first_two = law_pvalues(result, p_tables, target)
  assert p_first > ALPHA and p_first_two > ALPHA, (p_first, p_first_two)


def test_chi2_rejects_a_residual_that_does_not_subtract_q(monkeypatch):
  target, draft, _ = TREE_SETTINGS['plain']
  monkeypatch.setattr(verify_lib, 'rejection_residual', lambda residual, mass, q: residual)
  result, p_tables = run_trees(target, draft, prune='none')
  assert max(law_pvalues(result, p_tables, target)) < 1e-20


def test_chi2_rejects_siblings_tested_against_the_unconditioned_q():
  target, draft, _ = TREE_SETTINGS['plain']
  result, p_tables = run_trees(target, draft, prune='none', unconditioned_q=True)
  assert max(law_pvalues(result, p_tables, target)) < 1e-20


def test_pruning_by_the_drafts_own_scores_is_biased():
  """EAGLE-2's rerank keeps nodes by their own draws: their law is no longer q_cond, and the output drifts."""
  target, draft, _ = TREE_SETTINGS['plain']
  result, p_tables = run_trees(target, draft, prune='top-score')
  assert min(law_pvalues(result, p_tables, target)) < 1e-20


@functools.partial(jax.jit, static_argnums=1)
def autoregressive(p_tables, target, seq_ids):
  """Tokens 1..3 of plain autoregressive sampling with the verifier's keys: [T, 3]."""
  keys = lambda depth: sampling_lib.row_keys(target.seed, seq_ids, POSITION + depth, STREAM_SAMPLE)
  x1 = sampling_lib.sample(jnp.broadcast_to(jnp.asarray(p_tables[0]), (len(seq_ids), V)), target, keys(0))
  x2 = sampling_lib.sample(jnp.asarray(p_tables[1])[x1], target, keys(1))
  x3 = sampling_lib.sample(jnp.asarray(p_tables[2])[x1, x2], target, keys(2))
  return jnp.stack([x1, x2, x3], axis=1)


@pytest.mark.parametrize(
    'target', [SamplingParams(), SamplingParams(temperature=1.0, top_k=4, min_p=0.05)], ids=['greedy', 'match']
)
def test_deterministic_trees_give_the_autoregressive_tokens(target):
  """Greedy, and sample-and-match (no q): token for token the plain sampler's output with the same keys."""
  result, p_tables = run_trees(target, SamplingParams(temperature=1.0), greedy_draft=True, pass_q=False)
  want = np.asarray(autoregressive(p_tables, SamplingParams(**{**target.__dict__, 'seed': 1}), jnp.arange(TRIALS)))
  n, out = result['n'], result['out']
  emitted = np.arange(3)[None, :] <= n[:, None]
  np.testing.assert_array_equal(np.where(emitted, out, -1), np.where(emitted, want, -1))
  # n is maximal: no child of the last accepted node carries the next token.
  last = np.take_along_axis(result['path'], n[:, None], axis=1)[:, 0]
  live = np.arange(result['tokens'].shape[1])[None, :] < result['num_nodes'][:, None]
  child_tokens = np.where(live & (result['parents'] == last[:, None]), result['tokens'], -1)
  child_tokens[:, 0] = -1
  assert not (child_tokens == np.take_along_axis(want, n[:, None], axis=1)).any()
  assert (n == 2).mean() > 0.05 and (n == 0).mean() > 0.01


# --- sampled dynamic trees: drawn by `tree_search.grow`, verified with q --------------------------------------

GROW_DEPTH, GROW_WIDTH, GROW_TOKENS = 3, 3, 10  # levels keep (3, 5, 2) nodes: 3 of the 5 at depth 2 expanded
# Mutants of `specjax/drafters/tree_search.py` (each site must occur once): the kept children chosen by their own
# draws (EAGLE-2's rerank within a level's share), and q_cond with the earlier siblings removed, not renormalised.
GROW_MUTANTS = {
    'kept-by-own-draw': ('key = parent_score[..., None] + jax.lax.top_k(log_q, width)[0]', 'key = score'),
    'q-not-renormalised': ('return q / jnp.where(total > 0, total, 1.0)', 'return q'),
}


def mutant_grow(mutant):
  """`tree_search.grow` with `GROW_MUTANTS[mutant]`'s edit (of it or of `node_distributions`, which it calls)."""
  import inspect

  from specjax.drafters import tree_search

  old, new = GROW_MUTANTS[mutant]
  source = inspect.getsource(tree_search.grow) + inspect.getsource(tree_search.node_distributions)
  assert source.count(old) == 1, f'{mutant}: {old!r} is not in tree_search.grow / node_distributions once'
  namespace = dict(vars(tree_search))
  exec(compile(source.replace(old, new), f'<tree_search.py, mutant {mutant}>', 'exec'), namespace)
  return namespace['grow']


@functools.partial(jax.jit, static_argnames=('grow', 'draft'))
def grow_trees(q_tables, seed, seq_ids, grow, draft):
  """Each trial's sampled dynamic tree over the draft tables (q after `draft`'s transform): the tree, its q
  [T, N, V] and each node's path of tokens [T, N, depth] (0 past its depth)."""
  t = seq_ids.shape[0]
  paths = []  # per expanded level: the path of each of its candidates [T, C, d]

  def law(front):  # [T, F, d] paths -> (log q, q) [T, F, V] of the token after each
    logits = q_tables[front.shape[-1]][tuple(front[..., i] for i in range(front.shape[-1]))]
    probs = sampling_lib.probs(jnp.broadcast_to(logits, front.shape[:-1] + (V,)), draft)
    return jnp.log(probs), probs

  def expand(level, top):
    prefix = jnp.take_along_axis(paths[-1], level.parent[..., None], axis=1) if paths else level.ids[..., None][..., :0]
    paths.append(jnp.concatenate([prefix, level.ids[..., None]], axis=-1))
    return law(jnp.take_along_axis(paths[-1], top[..., None], axis=1))

  level_keys = lambda depth: sampling_lib.row_keys(seed, seq_ids, POSITION + depth, sampling_lib.STREAM_TREE)
  tree, q = grow(
      law(jnp.zeros((t, 1, 0), jnp.int32)), expand, level_keys, GROW_DEPTH, GROW_WIDTH, GROW_TOKENS, None, True
  )
  parents = jnp.pad(tree.parents, ((0, 0), (1, 0)))  # block indices: node 0 the root
  on_path = trees.ancestor_mask(parents)[:, 1:, 1:]  # [T, N, N]
  depths = trees.node_depths(parents)[:, 1:]
  tokens = jnp.where(on_path, tree.ids[:, None, :], 0)  # each node's ancestors' tokens, in BFS (= depth) order
  order = jnp.argsort(~on_path, axis=-1, stable=True)[..., :GROW_DEPTH]
  return tree, q, jnp.take_along_axis(tokens, order, axis=-1), depths


def run_grown_trees(target, draft, mutant=None, seed=0):
  """Grows TRIALS sampled dynamic trees, verifies them with q; returns (result, the target's tables)."""
  p_tables, q_tables = logit_tables(seed, 1.0, GROW_DEPTH)
  target = SamplingParams(**{**target.__dict__, 'seed': 1 + seed})
  seq_ids = jnp.arange(TRIALS)
  from specjax.drafters import tree_search

  grow = mutant_grow(mutant) if mutant in GROW_MUTANTS else tree_search.grow
  tree, q, paths, depths = grow_trees(tuple(map(jnp.asarray, q_tables[:GROW_DEPTH])), target.seed, seq_ids, grow, draft)
  paths, depths = np.asarray(paths), np.asarray(depths)
  logits = np.select(
      [depths[..., None] == d for d in (1, 2, 3)],
      [p_tables[d][tuple(paths[..., i] for i in range(d))] for d in (1, 2, 3)],
  )  # [T, N, V] the target's logits after each node
  logits = np.concatenate([np.broadcast_to(p_tables[0], (TRIALS, 1, V)), logits], axis=1)
  verify = functools.partial(verify_lib.verify_tree, sampling=target, max_depth=GROW_DEPTH)
  n, _, out = jax.jit(verify)(  # a fresh trace: monkeypatches take effect
      logits,
      jnp.pad(tree.ids, ((0, 0), (1, 0))),
      jnp.pad(tree.parents, ((0, 0), (1, 0))),
      tree.num_nodes + 1,
      jnp.pad(q, ((0, 0), (1, 0), (0, 0))),
      seq_ids=seq_ids,
      positions=jnp.full(TRIALS, POSITION),
  )
  n, out = np.asarray(n), np.asarray(out)
  # Tokens past the emitted ones: the next steps' plain draws from the target given the tokens before.
  rng = np.random.default_rng(7)
  x = out[:, :GROW_DEPTH].copy()
  for d in range(1, GROW_DEPTH):
    p = np.exp(np.asarray(log_probs(jnp.asarray(p_tables[d][tuple(x[:, i] for i in range(d))]), target), np.float64))
    cdf = np.cumsum(p, axis=-1)
    x[:, d] = np.where(n >= d, x[:, d], np.sum(rng.random((TRIALS, 1)) * cdf[:, -1:] >= cdf, axis=-1))
  law = 1.0
  for d in range(GROW_DEPTH):
    p = np.exp(np.asarray(log_probs(jnp.asarray(p_tables[d]), target), np.float64))
    law = law[..., None] * p if d else p  # [V] * d: p(x1) p(x2 | x1) ..
  depths = np.where(np.arange(GROW_TOKENS) < np.asarray(tree.num_nodes)[:, None], depths, 0)  # padding: 0
  return dict(n=n, x=x, depths=depths), chi2_pvalue(np.ravel_multi_index(tuple(x.T), (V,) * GROW_DEPTH), law.ravel())


GROW_SETTINGS = {
    'plain': (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)),
    # q of 2 tokens: a node keeps at most 2 children, the unused share moves to the next level.
    'q-top-2': (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=2)),
}


@pytest.mark.parametrize('setting', list(GROW_SETTINGS))
def test_sampled_dynamic_trees_emit_the_target_law(setting):
  """The first three tokens of `tree_search.grow`'s sampled dynamic trees, verified with q, have the target's law."""
  target, draft = GROW_SETTINGS[setting]
  result, pvalue = run_grown_trees(target, draft)
  per_level = [(result['depths'] == d).sum(-1) for d in (1, 2, 3)]
  # Shares as 3, 2, 1: ceil(2 * 10 / 4) at depth 1 (3 candidates, 2 when q has 2 tokens), ceil(2 * rest / 3) at
  # depth 2 (4 candidates when q has 2 tokens), the rest at depth 3.
  want = (3, 5, 2) if setting == 'plain' else (2, 4, 4)
  assert all((count == n).all() for count, n in zip(per_level, want))
  assert (result['n'] >= 1).mean() > 0.3 and (result['n'] == 3).mean() > 0.03  # drafts do get accepted
  assert pvalue > ALPHA, pvalue


@pytest.mark.parametrize('mutant', [*GROW_MUTANTS, 'residual-not-reduced'])
def test_chi2_rejects_broken_sampled_dynamic_trees(mutant, monkeypatch):
  """Kept children chosen by their own draws, q_cond not renormalised, a residual not reduced by q: p < 1e-6."""
  if mutant == 'residual-not-reduced':
    monkeypatch.setattr(verify_lib, 'rejection_residual', lambda residual, mass, q: residual)
  target, draft = GROW_SETTINGS['plain']
  _, pvalue = run_grown_trees(target, draft, mutant)
  assert pvalue < 1e-6, pvalue
