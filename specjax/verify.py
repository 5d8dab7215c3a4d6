"""Lossless verification of drafts against one target pass: a chain or a tree.

Chain (`verify`): `logits[:, i]` is the target's prediction for the token after
`[x_0, .., x_i]`, so position i checks draft `drafts[:, i]` (i < K) and position
K yields the bonus token. `positions[b]` is the absolute position of the token
that `logits[b, 0]` predicts.

Three schemes, chosen by the sampling settings and whether the drafter gives q:
- greedy (temperature 0): accept while the draft equals argmax p.
- sample-and-match (no q: n-gram, any deterministic drafter): draw y_i ~ p_i
  with the key a plain sampler would use at that position, accept while
  x_i == y_i, emit y at the first mismatch. The output is token-for-token what
  autoregressive sampling with the same seed emits.
- rejection sampling (q given): accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a draw from
  norm(max(0, p_i - q_i)); after K acceptances the bonus token from p_K.
p and q both pass through `sampling.probs`, so the output law is exactly the
target's sampling distribution.

Tree (`verify_tree`, layout in `specjax.trees`): `logits[:, i]` predicts the
token after node i's path, at position `positions + depth(i)`. The walk starts
at the root and moves into at most one child per depth:
- greedy / sample-and-match: into the first child whose token equals the
  target's argmax / plain-sampler draw at the current node; emit that
  draw at the node where none matches.
- recursive rejection sampling (q given; SpecInfer's multi-draft scheme for
  siblings drawn without replacement, Jeon et al. 2024): with residual r = p at
  the current node, try its children in draw order, child c with q_c = the law
  it was drawn from given its earlier siblings: accept with probability
  min(1, r(c) / q_c(c)) and move into it (r = p there), else
  r <- norm(max(0, r - q_c)) and try the next; when all fail emit a draw from
  r. A chain-shaped tree gives exactly `verify`'s tokens and draws.
Dropping drawn children from a tree keeps this exact only if the choice does
not look at their own (or later) draws: keep the first n, prune by a fixed
shape, or by what came before; pruning by a child's own score is biased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax import trees
from specjax.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, SamplingParams

RESIDUAL_EPS = 1e-9


def leading_true(x: jax.Array) -> jax.Array:  # [B, K] bool -> [B] int32
  """Length of the all-true prefix of each row."""
  return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify(
    logits: jax.Array,  # [B, K + 1, V] target logits
    drafts: jax.Array,  # [B, K] int32
    draft_lens: jax.Array,  # [B] valid drafts per row (later ones never accepted)
    q: jax.Array | None,  # [B, K, V] draft distributions, or None
    sampling: SamplingParams,
    seq_ids: jax.Array,  # [B]
    positions: jax.Array,  # [B] absolute position predicted by logits[:, 0]
    fresh_last: jax.Array | None = None,  # [B] bool: a plain draw after the drafts takes its own stream
) -> tuple[jax.Array, jax.Array]:
  """Returns (n_accepted [B], tokens [B, K + 1]).

  The emitted tokens of row b are `tokens[b, :n_accepted[b] + 1]`: the accepted
  drafts, then the correction (or bonus) token. `fresh_last` marks rows whose
  drafts were cut at a position by the drafter's own draw there (a grammar
  cut): the plain draw from p at `draft_lens` then uses the residual stream,
  independent of that draw (rejection sampling only).
  """
  b, k = drafts.shape
  steps = jnp.arange(k + 1)
  valid = steps[None, :k] < draft_lens[:, None]  # [B, K]
  pos = positions[:, None] + steps[None, :]  # [B, K + 1]

  if sampling.is_greedy or q is None:
    keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], pos, STREAM_SAMPLE)
    target = sampling_lib.sample(logits, sampling, keys)  # [B, K + 1]
    n_accepted = leading_true((drafts == target[:, :k]) & valid)
    return n_accepted, target

  p = sampling_lib.probs(logits, sampling)  # [B, K + 1, V]
  p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
  q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  accept_keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], pos[:, :k], STREAM_ACCEPT)
  u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(accept_keys)  # [B, K]
  # Strict: u in [0, 1) can be 0, and a draft the target excludes (p = 0) must never pass.
  n_accepted = leading_true((u * q_draft < p_draft) & valid)

  # The token at n_accepted: a residual draw after a rejected valid draft,
  # otherwise (bonus, or no draft there) a plain draw from p.
  p_at = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  q_at = jnp.take_along_axis(q_pad, n_accepted[:, None, None], axis=1)[:, 0]
  rejected = n_accepted < draft_lens
  residual = jnp.maximum(p_at - q_at, 0.0)
  use_residual = rejected & (residual.sum(-1) > RESIDUAL_EPS)
  weights = jnp.where(use_residual[:, None], residual, p_at)
  at = positions + n_accepted
  key_data = lambda stream: jax.random.key_data(sampling_lib.row_keys(sampling.seed, seq_ids, at, stream))
  own_stream = use_residual if fresh_last is None else use_residual | (fresh_last & ~rejected)
  keys = jnp.where(own_stream[:, None], key_data(STREAM_RESIDUAL), key_data(STREAM_SAMPLE))  # [B, 2]
  last = sampling_lib.gumbel_argmax(jnp.log(weights), keys)  # [B]
  tokens = jnp.where(steps[None, :] < n_accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
  return n_accepted, tokens.astype(jnp.int32)


def rejection_residual(
    residual: jax.Array,  # [B, V] unnormalised residual target r
    mass: jax.Array,  # [B] its total mass
    q: jax.Array,  # [B, V] the rejected child's draft law
) -> jax.Array:  # [B, V]
  """norm(max(0, r / mass - q)) up to a positive factor: max(0, r - mass * q)."""
  return jnp.maximum(residual - mass[:, None] * q, 0.0)


def _accept_uniforms(sampling, seq_ids, positions, depths, ranks):  # [B], [B], [B, N], [B, N] -> [B, N]
  """u of node i: the chain's key at its position, folded with its sibling rank when > 0."""
  keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], positions[:, None] + depths - 1, STREAM_ACCEPT)
  keys, ranks = keys.reshape(-1), ranks.reshape(-1)  # one flat vmap compiles ~3x faster than two nested
  folded = jax.vmap(jax.random.fold_in)(keys, ranks)
  keys = jnp.where((ranks > 0)[:, None], jax.random.key_data(folded), jax.random.key_data(keys))
  return jax.vmap(jax.random.uniform)(jax.random.wrap_key_data(keys)).reshape(depths.shape)


def verify_tree(
    logits: jax.Array,  # [B, N, V] target logits at each node
    tokens: jax.Array,  # [B, N] int32 node tokens (the root's unused)
    parents: jax.Array,  # [B, N] int32, breadth-first (see `specjax.trees`)
    num_nodes: jax.Array,  # [B] valid nodes, root included (later ones never accepted)
    q: jax.Array | None,  # [B, N, V] law node i was drawn from given its earlier siblings (q_cond), or None
    sampling: SamplingParams,
    seq_ids: jax.Array,  # [B]
    positions: jax.Array,  # [B] absolute position predicted by logits[:, 0]
    max_depth: int,  # static: depth of the deepest node (deeper nodes are never accepted)
    node_ok: jax.Array | None = None,  # [B, N] bool: nodes that may be accepted (a grammar's cut), root included
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (n_accepted [B], path [B, max_depth + 1], tokens [B, max_depth + 1]).

  path[b, j] is the accepted node at depth j (path[:, 0] = 0; 0 past
  n_accepted). The emitted tokens of row b are `tokens[b, :n_accepted[b] + 1]`:
  the accepted drafts along the path, then the correction (or bonus) token.
  """
  b, n = tokens.shape
  depths = trees.node_depths(parents)  # [B, N]
  live = (jnp.arange(n)[None, :] < num_nodes[:, None]) & (depths <= max_depth)
  live = live if node_ok is None else live & node_ok
  nodes = (jnp.arange(1, n), parents.T[1:], live.T[1:])  # scanned over nodes 1..N-1, in index order

  if sampling.is_greedy or q is None:
    keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], positions[:, None] + depths, STREAM_SAMPLE)
    target = sampling_lib.sample(logits, sampling, keys)  # [B, N]
    matches = tokens == jnp.take_along_axis(target, parents, axis=1)  # node i's token is its parent's draw

    def enter(cur, node):  # cur [B]: the deepest accepted node so far
      i, parent, ok = node
      return jnp.where(ok & (parent == cur), i, cur), None

    cur, _ = jax.lax.scan(enter, jnp.zeros(b, jnp.int32), nodes[:2] + ((live & matches).T[1:],))
    last = jnp.take_along_axis(target, cur[:, None], axis=1)[:, 0]
  else:
    p = sampling_lib.probs(logits, sampling)  # [B, N, V]
    u = _accept_uniforms(sampling, seq_ids, positions, depths, trees.sibling_ranks(parents))  # [B, N]
    take = lambda x, index: jnp.take_along_axis(x, index[:, None], axis=1)[:, 0]

    def visit(state, node):
      # cur: deepest accepted node; residual (mass): unnormalised target left at
      # cur after its rejected children; from_residual: whether one was.
      cur, residual, mass, from_residual = state
      i, parent, ok, token, u_i, p_i, q_i = node
      reached = ok & (parent == cur)
      accept = reached & (u_i * take(q_i, token) * mass < take(residual, token))  # as in `verify`
      left = rejection_residual(residual, mass, q_i)
      left_mass = left.sum(-1)
      use_left = reached & ~accept & (left_mass > RESIDUAL_EPS * mass)  # else keep r (mass underflow)
      residual = jnp.where(accept[:, None], p_i, jnp.where(use_left[:, None], left, residual))
      mass = jnp.where(accept, 1.0, jnp.where(use_left, left_mass, mass))
      return (jnp.where(accept, i, cur), residual, mass, ~accept & (from_residual | use_left)), None

    state = (jnp.zeros(b, jnp.int32), p[:, 0], jnp.ones(b, jnp.float32), jnp.zeros(b, bool))
    per_node = (tokens.T[1:], u.T[1:], jnp.moveaxis(p, 1, 0)[1:], jnp.moveaxis(q, 1, 0)[1:])
    (cur, residual, _, from_residual), _ = jax.lax.scan(visit, state, nodes + per_node)
    at = positions + jnp.take_along_axis(depths, cur[:, None], axis=1)[:, 0]
    key_data = lambda stream: jax.random.key_data(sampling_lib.row_keys(sampling.seed, seq_ids, at, stream))
    keys = jnp.where(from_residual[:, None], key_data(STREAM_RESIDUAL), key_data(STREAM_SAMPLE))  # [B, 2]
    last = sampling_lib.gumbel_argmax(jnp.log(residual), keys)  # [B]

  # The accepted path: the ancestors of the last accepted node, by depth.
  on_path = jnp.take_along_axis(trees.ancestor_mask(parents), cur[:, None, None], axis=1)[:, 0]  # [B, N]
  steps = jnp.arange(max_depth + 1)
  at_depth = on_path[:, None, :] & (depths[:, None, :] == steps[None, :, None])  # [B, D + 1, N]
  path = jnp.sum(jnp.where(at_depth, jnp.arange(n), 0), axis=-1).astype(jnp.int32)
  n_accepted = jnp.take_along_axis(depths, cur[:, None], axis=1)[:, 0]
  path_tokens = jnp.take_along_axis(tokens, jnp.pad(path[:, 1:], ((0, 0), (0, 1))), axis=1)
  out = jnp.where(steps[None, :] < n_accepted[:, None], path_tokens, last[:, None])
  return n_accepted, path, out.astype(jnp.int32)
