"""Draft trees: flattened layout, structure helpers, children drawn without replacement.

A row's tree is N nodes in breadth-first order (depth non-decreasing with the
index). Node 0 is the root, the last committed token; nodes 1..N-1 are drafts.
`parents[b, i]` is the parent of node i (`parents[b, 0] == 0`, `parents[b, i] <
i`), and the children of one node appear in the order they were drawn. Rows
with fewer nodes give `num_nodes [B]` (root included); later nodes are padding
(parent 0, never accepted). The verifier is `specjax.verify.verify_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax.errors import SpecjaxError


def ancestor_mask(parents: jax.Array) -> jax.Array:  # [B, N] int32 -> [B, N, N] bool
  """mask[b, i, j]: node j is node i or one of its ancestors.

  Pointer doubling: after s rounds mask holds the ancestors within distance
  2**s and `jump` the ancestor at distance 2**s (the root is its own parent, so
  walks stop there); ceil(log2 N) rounds cover any depth.
  """
  n = parents.shape[-1]
  gather_rows = jax.vmap(lambda rows, index: rows[index])  # [B, N, ...], [B, N] -> [B, N, ...]
  mask = jnp.broadcast_to(jnp.eye(n, dtype=bool), parents.shape + (n,))
  jump = parents
  span = 1
  while span < n:
    mask = mask | gather_rows(mask, jump)
    jump = gather_rows(jump, jump)
    span *= 2
  return mask


def node_depths(parents: jax.Array) -> jax.Array:  # [B, N] int32 -> [B, N] int32
  """Depth of each node (root 0; padding nodes, children of the root, 1)."""
  return (ancestor_mask(parents).sum(-1) - 1).astype(jnp.int32)


def sibling_ranks(parents: jax.Array) -> jax.Array:  # [B, N] int32 -> [B, N] int32
  """Rank of each node among its parent's children in index (draw) order; root 0."""
  n = parents.shape[-1]
  index = jnp.arange(n)
  earlier = (index[None, :] < index[:, None]) & (index[None, :] > 0)  # [N, N]: j < i, j not the root
  same_parent = parents[:, :, None] == parents[:, None, :]
  return jnp.sum(same_parent & earlier, axis=-1).astype(jnp.int32)


def static_tree(parents: Sequence[int]) -> np.ndarray:  # -> [N] int32
  """Checks a parent list from a config (entry i = parent of node i) and returns it as int32.

  Entry 0 is the root: 0 or -1. Every other entry names an earlier node, and
  depth must not decrease along the list (breadth-first order).
  """
  if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence | np.ndarray) or len(parents) == 0:
    raise SpecjaxError(f'tree parents must be a non-empty list of node indices, got {parents!r}')
  for i, parent in enumerate(parents):
    if not isinstance(parent, numbers.Integral) or isinstance(parent, bool):
      raise SpecjaxError(f'tree parents[{i}] must be an integer node index, got {parent!r}')
  if parents[0] not in (0, -1):
    raise SpecjaxError(f'tree parents[0] is the root and must be 0 or -1, got {parents[0]}')
  depths = [0]
  for i, parent in enumerate(parents[1:], start=1):
    if not 0 <= parent < i:
      raise SpecjaxError(f'tree parents[{i}] = {parent} must be an earlier node (0 <= parent < {i})')
    depths.append(depths[parent] + 1)
    if depths[i] < depths[i - 1]:
      raise SpecjaxError(
          f'tree node {i} (depth {depths[i]}) comes after a node of depth {depths[i - 1]}: list nodes breadth-first'
      )
  return np.array([0, *parents[1:]], dtype=np.int32)


def _top_first(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k largest of scores [..., V] in order, first index on ties: (tokens, valid) [..., k]."""
  vocab = scores.shape[-1]
  tokens, valid = [], []
  for _ in range(k):
    top = sampling_lib.argmax(scores)
    best = jnp.take_along_axis(scores, top[..., None], axis=-1)[..., 0]
    tokens.append(jnp.where(best > -jnp.inf, top, 0))
    valid.append(best > -jnp.inf)
    scores = jnp.where(jnp.arange(vocab) == top[..., None], -jnp.inf, scores)
  return jnp.stack(tokens, axis=-1), jnp.stack(valid, axis=-1)


def draw_children(
    logq: jax.Array,  # [..., V] log draft distribution after the sampling transform, -inf = excluded
    k: int,
    keys: jax.Array | None,  # [...] typed keys, one per frontier node (unused when greedy)
    greedy: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """k children of each frontier node, drawn without replacement from q = softmax(logq).

  Returns (tokens [..., k] int32, q_cond [..., k, V], logq_child [..., k],
  valid [..., k] bool). Sampled children are the Gumbel-top-k of logq (the
  noise `sampling.gumbel_argmax` adds, so child 0 is the plain sampler's draw
  with the same key); their order is the draw order of sequential sampling
  without replacement. Greedy children are the top-k of logq, first index on
  ties. q_cond[..., r, :] is the law child r is drawn from: q without children
  0..r-1, renormalised (the q `verify_tree` takes for node r). logq_child is
  log q(child) under the unconditioned q. A child past the tokens q gives mass
  is invalid: token 0, q_cond 0, logq_child -inf; leave it out of the tree.
  """
  logq = jax.nn.log_softmax(logq.astype(jnp.float32), axis=-1)
  vocab = logq.shape[-1]
  if greedy:
    tokens, valid = _top_first(logq, k)
  else:
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
      keys = jax.random.wrap_key_data(keys)
    if keys.shape != logq.shape[:-1]:
      raise ValueError(f'keys shape {keys.shape} != logq batch shape {logq.shape[:-1]}')

    def draw(row):  # One row at a time, as in sampling.gumbel_argmax.
      row_logq, key = row
      return _top_first(row_logq + jax.random.gumbel(key, (vocab,), jnp.float32), k)

    tokens, valid = jax.lax.map(draw, (logq.reshape(-1, vocab), keys.reshape(-1)))
    tokens, valid = tokens.reshape(logq.shape[:-1] + (k,)), valid.reshape(logq.shape[:-1] + (k,))
  picked = jax.nn.one_hot(tokens, vocab, dtype=bool) & valid[..., None]  # [..., k, V]
  removed = jnp.cumsum(picked, axis=-2) > picked  # children drawn before r
  q_cond = jax.nn.softmax(jnp.where(removed, -jnp.inf, logq[..., None, :]), axis=-1)
  q_cond = jnp.where(valid[..., None], q_cond, 0.0)
  logq_child = jnp.where(valid, jnp.take_along_axis(logq, tokens, axis=-1), -jnp.inf)
  return tokens.astype(jnp.int32), q_cond, logq_child, valid
