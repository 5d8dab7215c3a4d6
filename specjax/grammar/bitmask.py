"""Grammar masks inside the jitted step: packed bitmasks, masked logits and draft laws.

A bitmask row is llguidance's layout, int32 [W] with W = ceil(V / 32): token
v is allowed iff bit v % 32 of word v // 32 is set. The host sends one
`[B, K + 1, W]` bitmask per speculative step (`GrammarInputs`), so every
verified position has the mask of the grammar state after the drafts before
it, and the step applies them with no per-position sync.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GrammarInputs:
  """What the host's matchers decided for one constrained speculative step."""

  bitmask: jax.Array  # [B, K + 1, W] int32: allowed tokens at each verified position (a tree's: at each node)
  drafts: jax.Array  # [B, K] int32: the drafts to verify (grammar-forced tokens substituted)
  draft_lens: jax.Array  # [B] cut before the first draft the grammar refuses
  forced: jax.Array  # [B] bool: the row's drafts are grammar-forced (drawn with probability 1)
  fresh: jax.Array  # [B] bool: cut at a drafter's own draw; the token drawn there takes a fresh stream
  valid: jax.Array  # [B, K] bool: drafts the grammar allows after their path (a tree's nodes; a chain's before the cut)


def allowed(
    bitmask: jax.Array,  # [..., W] int32
    vocab: int,
) -> jax.Array:  # [..., V] bool
  token = jnp.arange(vocab, dtype=jnp.int32)
  words = jnp.take(bitmask, token >> 5, axis=-1)  # [..., V] each token's word: one fused gather, no [.., W, 32]
  return ((words >> (token & 31)) & 1).astype(bool)


def mask_logits(
    logits: jax.Array,  # [..., V]
    bitmask: jax.Array,  # [..., W] int32
) -> jax.Array:  # [..., V], refused tokens -inf
  """The constrained target: p' = normalize(p * m) is softmax of these (before temperature and top-k/p)."""
  return jnp.where(allowed(bitmask, logits.shape[-1]), logits, -jnp.inf)


def mask_law(
    q: jax.Array,  # [..., V] a draft distribution
    bitmask: jax.Array,  # [..., W] int32
) -> jax.Array:  # [..., V]
  """q' = normalize(q * m): the law of a draft drawn from q, given that the grammar allows it."""
  q = jnp.where(allowed(bitmask, q.shape[-1]), q, 0.0)
  return q / jnp.maximum(q.sum(-1, keepdims=True), jnp.finfo(q.dtype).tiny)


def tree_laws(
    q: jax.Array,  # [B, N, V] the law node i was drawn from given its earlier siblings
    parents: jax.Array,  # [B, N] int32 each node's parent in the block (0: the root)
    bitmask: jax.Array,  # [B, N + 1, W] int32 the mask at each block node
) -> jax.Array:  # [B, N, V]
  """q' of each tree node: its law masked by its parent's state (the grammar after the path to the parent)."""
  return mask_law(q, jnp.take_along_axis(bitmask, parents[:, :, None].astype(jnp.int32), axis=1))
