"""Draft trees in static shapes: levels of candidates, the kept nodes, their q.

Level e holds the depth-e candidates: `children` drawn for each node of the
level above's frontier (level 1: the root's). Candidate c of a level is child
`c % children` of frontier node `c // children`. A candidate's score is its
path's cumulative log-probability under the drafter (-inf: no probability).

- EAGLE-2 dynamic trees: `children` = topk, the frontier is the `topk` best
  of each level, and the kept tree is the `tokens` best candidates of all
  levels. A parent scores at least as well as its children and comes first on
  ties, so ancestry is kept.
- Static trees (a parent list, `StaticShape`): fixed frontiers and kept nodes.
- Sampled dynamic trees verified with q (`grow(..., sampled=True)` without a
  static shape): children are drawn without replacement (Gumbel-top-k), and
  how many of a node's children are kept is fixed before they are drawn, from
  their parents alone, so each kept child's law given its earlier siblings is
  q_cond (the verifier's recursive rejection sampling stays exact). Level by
  level: the `tokens` nodes are shared out over the levels in proportion to
  K, K - 1, .., 1 (deeper nodes are reached less often; a level's unused
  share moves down); a candidate's key is its parent's score plus the
  r-th largest log q of the parent for child rank r, and a level keeps its
  best keys, a prefix of each parent's draws. The frontier is the `topk` best
  kept nodes by their own score: a node's own draw may decide whether it is
  expanded, never whether it is kept.

Nodes are returned in BFS order with each node's children in draw order
(what `verify.verify_tree` expects); candidates with no probability come last
and are not counted as nodes.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import trees


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Level:
  ids: jax.Array  # [B, n] draft-vocab ids
  score: jax.Array  # [B, n] cumulative log-probability (-inf: not a candidate)
  parent: jax.Array  # [B, n] index of the parent in the previous level (level 1: 0, the root)


@dataclasses.dataclass
class Fed:
  """The frontier nodes fed to the drafter so far, level by level."""

  ids: list = dataclasses.field(default_factory=list)  # per level [B, F]
  parents: list = dataclasses.field(default_factory=list)  # per level [B, F] fed index of the parent, -1: root
  feats: list = dataclasses.field(default_factory=list)  # per level [B, F, D] the parent's output

  def add(self, level: Level, top: jax.Array, parent_out: jax.Array, children: int) -> None:
    """Adds a level's frontier `top` [B, F]; `parent_out` [B, F', D]: the previous frontier's outputs."""
    above = top // children  # each node's parent, as a position in the previous frontier
    offset = sum(x.shape[1] for x in self.ids[:-1])  # fed index of the previous frontier's first node
    self.parents.append(jnp.full_like(top, -1) if not self.ids else offset + above)
    self.ids.append(jnp.take_along_axis(level.ids, top, axis=1))
    self.feats.append(jnp.take_along_axis(parent_out, above[..., None], axis=1))

  def depths(self) -> jax.Array:  # [B, T] each node's depth - 1 (its pair's offset past the cache)
    return jnp.concatenate([jnp.full_like(p, e) for e, p in enumerate(self.parents)], axis=1)

  def mask(self) -> jax.Array:  # [B, T, T] ancestor-or-self among the fed nodes
    parents = jnp.concatenate(self.parents, axis=1) + 1  # a virtual root at 0
    parents = jnp.concatenate([jnp.zeros_like(parents[:, :1]), parents], axis=1)
    return trees.ancestor_mask(parents)[:, 1:, 1:]


@dataclasses.dataclass(frozen=True)
class StaticShape:
  """A fixed tree (a parent list) laid out as levels of candidates.

  Every expanded node draws `children` children (the most any node has); node
  i of the tree is candidate `frontier position of its parent * children +
  its rank among its siblings` of its level.
  """

  children: int
  frontiers: tuple[np.ndarray, ...]  # per level 1..K-1: candidate indices of the nodes with children
  chosen: np.ndarray  # [N] candidate index (levels concatenated) of every node

  @classmethod
  def build(cls, parents: np.ndarray, depth: int) -> StaticShape:
    """`parents` [N]: the parent of node i + 1 (0: the root); nodes deeper than `depth` are dropped."""
    full = np.concatenate([[0], np.asarray(parents)])
    depths = np.zeros(len(full), np.int64)
    for i in range(1, len(full)):
      depths[i] = depths[full[i]] + 1
    keep = [i for i in range(1, len(full)) if depths[i] <= depth]
    rank = {}
    counts = np.zeros(len(full), np.int64)
    for i in keep:
      rank[i] = counts[full[i]]
      counts[full[i]] += 1
    children = int(counts.max())
    local = {0: 0}
    frontiers, offsets, chosen, total = [], [], [], 0
    frontier_pos = {0: 0}
    for d in range(1, depth + 1):
      nodes = [i for i in keep if depths[i] == d]
      if not nodes:
        break
      offsets.append(total)
      for i in nodes:
        local[i] = frontier_pos[full[i]] * children + rank[i]
        chosen.append(total + local[i])
      expanded = sorted((i for i in nodes if counts[i]), key=local.get)
      frontier_pos = {i: j for j, i in enumerate(expanded)}
      total += (1 if d == 1 else len(frontiers[-1])) * children
      if expanded and d < depth:
        frontiers.append(np.array([local[i] for i in expanded], np.int32))
      else:
        break
    return cls(children, tuple(frontiers), np.sort(np.array(chosen, np.int32)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
  ids: jax.Array  # [B, N] draft-vocab ids of the kept nodes
  parents: jax.Array  # [B, N] block index of each node's parent (0: the root; node i is block i + 1)
  num_nodes: jax.Array  # [B] kept nodes with probability
  chosen: jax.Array  # [B, N] index of each node among all candidates (levels concatenated)


def num_candidates(depth: int, topk: int) -> int:
  """Candidates of a depth-`depth` tree: `topk` at depth 1, `topk**2` below."""
  return topk + (depth - 1) * topk * topk


def _offsets(levels: list[Level]) -> list[int]:
  out, total = [], 0
  for level in levels:
    out.append(total)
    total += level.ids.shape[1]
  return out


def select(levels: list[Level], tokens: int, chosen: np.ndarray | None = None) -> Tree:
  """Keeps the `tokens` best candidates of all levels (or the static `chosen` ones), in BFS order."""
  offsets = _offsets(levels)
  ids = jnp.concatenate([lv.ids for lv in levels], axis=1)  # [B, C]
  score = jnp.concatenate([lv.score for lv in levels], axis=1)
  parent = jnp.concatenate(
      [jnp.full_like(lv.parent, -1) if e == 0 else lv.parent + offsets[e - 1] for e, lv in enumerate(levels)], axis=1
  )  # [B, C] candidate index of the parent, -1: the root
  c = ids.shape[1]
  if tokens > c:
    raise ValueError(f'a tree of {tokens} nodes needs more candidates than {c}')
  if chosen is None:
    best_score, best = jax.lax.top_k(score, tokens)  # ties: the lower index (a parent before its child)
  else:
    best = jnp.broadcast_to(jnp.asarray(chosen), (ids.shape[0], len(chosen)))
    best_score = jnp.take_along_axis(score, best, axis=1)
    tokens = len(chosen)
  valid = best_score > -jnp.inf
  chosen = jnp.sort(jnp.where(valid, best, best + c), axis=1) % c  # BFS: candidates are ordered by level
  valid = jnp.sort(~valid, axis=1) == 0  # the valid ones now lead
  b = ids.shape[0]
  block = (
      jnp.zeros((b, c), jnp.int32)
      .at[jnp.arange(b)[:, None], chosen]
      .set(jnp.where(valid, jnp.arange(1, tokens + 1)[None, :], 0))
  )  # [B, C] block index of each kept candidate
  chosen_parent = jnp.take_along_axis(parent, chosen, axis=1)
  parents = jnp.where(
      valid & (chosen_parent >= 0), jnp.take_along_axis(block, jnp.maximum(chosen_parent, 0), axis=1), 0
  )
  return Tree(
      jnp.take_along_axis(ids, chosen, axis=1),
      parents.astype(jnp.int32),
      jnp.sum(valid, axis=1).astype(jnp.int32),
      chosen,
  )


def node_distributions(tree: Tree, levels: list[Level], dists: list[jax.Array], children: int) -> jax.Array:
  """[B, N, Vd] the distribution each kept node was drawn from, given its earlier-drawn siblings.

  `dists[e]` [B, F, Vd]: the distributions of the nodes expanded into level e
  (the root for level 0, the frontier after). Child r of a node was drawn from
  that node's distribution with its r earlier children removed.
  """
  offsets = _offsets(levels)
  row_offsets, rows = [], 0
  for d in dists:
    row_offsets.append(rows)
    rows += d.shape[1]
  level_of = jnp.concatenate([jnp.full((lv.ids.shape[1],), e, jnp.int32) for e, lv in enumerate(levels)])
  local = tree.chosen - jnp.asarray(offsets, jnp.int32)[level_of[tree.chosen]]  # [B, N] index in its level
  row = jnp.asarray(row_offsets, jnp.int32)[level_of[tree.chosen]] + local // children
  rank = local % children
  q = jnp.take_along_axis(jnp.concatenate(dists, axis=1), row[..., None], axis=1)  # [B, N, Vd]
  ids = jnp.concatenate([lv.ids for lv in levels], axis=1)
  b, n = row.shape
  for j in range(children - 1):  # zero the siblings drawn before each node
    earlier = jnp.take_along_axis(ids, jnp.maximum(tree.chosen - rank + j, 0), axis=1)  # [B, N]
    keep = jnp.where(j < rank, 0.0, 1.0).astype(q.dtype)
    q = q.at[jnp.arange(b)[:, None], jnp.arange(n)[None, :], earlier].multiply(keep)
  total = jnp.sum(q, axis=-1, keepdims=True)
  return q / jnp.where(total > 0, total, 1.0)


def keep_best(key: jax.Array, count: jax.Array) -> jax.Array:  # [B, C], [B] -> [B, C] bool
  """The `count` candidates of the largest keys (the lower index first on ties), none of key -inf."""
  rank = jnp.argsort(jnp.argsort(-key, axis=1, stable=True), axis=1)
  return (rank < count[:, None]) & (key > -jnp.inf)


def grow(
    root: tuple[jax.Array, jax.Array | None],  # the root's (log q [B, 1, Vd], probabilities [B, 1, Vd] | None)
    expand: Callable,  # (level, top [B, F]) -> (log q, probabilities | None) [B, F, Vd] of the frontier `top`
    level_keys: Callable,  # depth -> [B] typed keys of the children drawn at that depth
    depth: int,
    width: int,
    tokens: int,
    static: StaticShape | None = None,
    sampled: bool = False,
) -> tuple[Tree, jax.Array | None]:
  """A tree of `depth` levels, `width` children drawn per expanded node: (tree, q [B, N, Vd] | None).

  `log q` scores and draws children (the sampling transform's when `sampled`,
  the raw distribution's otherwise); greedy children are its top ones, sampled
  ones its Gumbel-top-`width` (child j of frontier node f with `level_keys`
  folded with f). Dynamic trees keep `tokens` nodes (EAGLE-2's, or budgeted
  by level when `sampled`: the module docstring); static ones `static`'s.
  q: the law each kept node was drawn from given its earlier siblings (only
  when `sampled`, for `verify.verify_tree`).
  """
  log_q, probs = root
  b = log_q.shape[0]
  budgeted = sampled and static is None
  total = len(static.chosen) if static else min(tokens, num_candidates(depth, width))
  remaining = jnp.full((b,), total, jnp.int32)

  def children(log_q, d):  # [B, F, Vd] -> ids, scores [B, F, width] of the children drawn at depth d
    keys = jax.vmap(lambda key: jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(log_q.shape[1])))
    ids, _, log_q_child, valid = trees.draw_children(log_q, width, keys(level_keys(d)), not sampled)
    return ids, jnp.where(valid, log_q_child, -jnp.inf)

  def budget(score, parent_score, log_q, d):  # level d's scores [B, F, width], its kept ones' only
    nonlocal remaining
    key = parent_score[..., None] + jax.lax.top_k(log_q, width)[0]  # child rank r: its parent's r-th best
    keep = keep_best(key.reshape(b, -1), -(-2 * remaining // (depth - d + 2)))  # shares as depth - d + 1 .. 1
    remaining = remaining - keep.sum(1)
    return jnp.where(keep, score.reshape(b, -1), -jnp.inf)

  ids, score = children(log_q, 1)
  score = budget(score, jnp.zeros((b, 1)), log_q, 1) if budgeted else score[:, 0]
  levels = [Level(ids[:, 0], score, jnp.zeros((b, width), jnp.int32))]
  dists = [probs]  # per level: the distributions its nodes were drawn from, one row per expanded node
  for d in range(2, 2 + (len(static.frontiers) if static else depth - 1)):  # expand level d - 1's frontier
    level = levels[-1]
    if static:
      top = jnp.broadcast_to(jnp.asarray(static.frontiers[d - 2]), (b, len(static.frontiers[d - 2])))
    else:
      top = jnp.argsort(-level.score, axis=1, stable=True)[:, :width]  # [B, F] indices into the level
    log_q, probs = expand(level, top)
    ids, child_score = children(log_q, d)
    parent_score = jnp.take_along_axis(level.score, top, axis=1)  # [B, F]
    score = parent_score[..., None] + child_score  # [B, F, width]
    if budgeted:
      score = budget(score, parent_score, log_q, d)
    parent = jnp.broadcast_to(top[..., None], ids.shape)
    levels.append(Level(ids.reshape(b, -1), score.reshape(b, -1), parent.reshape(b, -1)))
    dists.append(probs)
  tree = select(levels, total, static.chosen if static else None)
  return tree, node_distributions(tree, levels, dists, width) if sampled else None
