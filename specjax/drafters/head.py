"""Drafters built on a small head fed (target feature at t, token t + 1): MTP heads and EAGLE-3.

The head's attention layer has its own paged KV cache (the target's block
tables, its own page pool) holding the pair at position t for every committed
t. A family says what its feature is (the target's final hidden state for MTP,
`fc` of the tapped residuals for EAGLE-3), how the head runs and what its
logits are (over the target vocab, or a draft vocab mapped to target ids).

State between steps: the head's cache (pairs up to its length m) and the
features not yet paired (`pending`, positions m .. m + n - 1; their next tokens
are in the token buffer). `propose` feeds the pending pairs as one ragged
block; its last output drafts x_{L+1}. Deeper drafts feed the head's own output
as the next feature with the token just drafted:
- a chain of K drafts, sampled with the step's sampling settings (q = the
  head's distribution under the same transform as the target's);
- or a tree (`tree_search`), level by level: the frontier nodes are fed in
  one block under the tree mask and each gets its children.
  - EAGLE-2 dynamic trees (`tree_topk`, `tree_tokens`): the frontier is the
    `tree_topk` best nodes of a level (cumulative log-probability), each gets
    its `tree_topk` most probable children, and the best `tree_tokens` nodes
    of all levels are kept with their ancestry. Sampled steps draw the
    children without replacement from q instead, keep per level as many of
    each node's draws as its parent's scores allot (`tree_search.grow`), and
    verify with q; `tree_verify='one-hot'` keeps the deterministic top
    children there and verifies by sample-and-match (q = None).
  - Static trees (`tree_parents`): when sampling, children are drawn without
    replacement from q and every node of the shape is kept, so the verifier
    runs recursive rejection sampling with each node's q. (Keeping sampled
    children by their scores, as EAGLE-2 re-ranks, would bias the output:
    `tests/test_tree_verify.py` shows it.)
Draft positions in the head's cache are scratch: `commit` keeps the verify
pass's features of the emitted positions (the accepted path, for trees) as the
new pending pairs, and the next `propose` writes their true pairs there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling as sampling_lib
from specjax import trees
from specjax.cache.paged import KVCache
from specjax.drafters import tree_search
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal, chain_scan, token_window
from specjax.drafters.registry import option
from specjax.errors import SpecjaxError
from specjax.models.contract import StepInputs
from specjax.sampling import STREAM_SAMPLE, STREAM_TREE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HeadState:
  cache: KVCache  # the head's cache; lengths = pairs committed (m)
  pending: jax.Array  # [B, S, D] features of positions m .. m + n - 1
  num_pending: jax.Array  # [B] n


@dataclasses.dataclass(frozen=True, eq=False)
class HeadDrafter(Drafter):
  """A drafter around a one-layer head; families implement the four hooks below."""

  feature_size: int = 1
  tree_tokens: int = 0  # nodes per tree step (0: chains)
  tree_topk: int = 0  # children per expanded node of a dynamic tree
  tree_parents: tuple[int, ...] = ()  # a static tree: the parent of node i + 1 (0: the root)
  tree_verify: str = 'q'  # sampled dynamic trees: 'q' (drawn from q, verified with it) or 'one-hot' (top children)
  provides_q: bool = True
  prefix_key_lag = 1  # the head's entry at a position pairs its feature with the next token

  # -- family hooks

  def features(self, params, hidden, taps) -> jax.Array:
    """[B, T, D] features of target positions from the final hidden state / the tapped residuals."""
    raise NotImplementedError

  def run(self, params, target, tokens, features, cache: KVCache, inputs: StepInputs) -> tuple[jax.Array, KVCache]:
    """The head over pairs (tokens [B, T] at t + 1, features [B, T, D] at t); its outputs [B, T, D]."""
    raise NotImplementedError

  def draft_logits(self, params, target, out) -> jax.Array:
    """[..., D] -> [..., Vd] logits over the draft vocab."""
    raise NotImplementedError

  def head_layout(self, params):
    raise NotImplementedError

  def to_target(self, ids: jax.Array) -> jax.Array:
    """Draft-vocab ids -> target ids (the identity when the head predicts the target vocab)."""
    return ids

  def place(self, probs: jax.Array) -> jax.Array:
    """[..., Vd] draft-vocab probabilities -> [..., V] at target ids (zero elsewhere)."""
    return probs

  # -- the drafter interface

  def lookahead(self, k: int) -> int:
    if not self.tree_tokens:
      fed = k
    else:  # the frontier nodes fed at the last depth
      fed = len(self.tree_parents) if self.tree_parents else self.tree_topk * max(k - 1, 0)
    return max(self.verify_width(k), fed)

  def init_state(self, plan: BatchPlan) -> HeadState:
    dtype = jax.tree.leaves(self.params())[0].dtype
    cache = KVCache.create(
        list(self.head_layout(self.params()).kv_shapes),
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        block_tables=plan.block_tables,
        dtype=dtype,
    )
    pending = jnp.zeros((plan.batch, plan.max_draft + 1, self.feature_size), dtype)
    return HeadState(cache, pending, jnp.zeros((plan.batch,), jnp.int32))

  def _chain(self, params, target, tokens, features, cache, query_lens):
    return self.run(params, target, tokens, features, cache, StepInputs.chain(cache, query_lens, tokens.shape[1]))

  def prefill(self, target, params, state: HeadState, tokens, query_lens, hidden, taps=()) -> HeadState:
    # tokens [B, T]. Pair j of this chunk: (combined[j + 1 - n], tokens[j + 1 - n]), combined = [carried
    # feature, chunk features]; q - 1 + n pairs; the chunk's last feature is carried.
    feats = self.features(params, hidden, taps).astype(state.pending.dtype)  # [B, T, D]
    t = tokens.shape[1]
    carried = state.num_pending
    combined = jnp.concatenate([state.pending[:, :1], feats], axis=1)
    idx = jnp.arange(t)[None, :] + 1 - carried[:, None]  # [B, T]
    pair_feats = jnp.take_along_axis(combined, idx[..., None], axis=1)
    pair_tokens = jnp.take_along_axis(tokens, jnp.minimum(idx, t - 1), axis=1)
    count = jnp.where(query_lens > 0, query_lens - 1 + carried, 0).astype(jnp.int32)
    _, cache = self._chain(params, target, pair_tokens, pair_feats, state.cache, count)
    last = jnp.take_along_axis(feats, jnp.maximum(query_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    has_new = query_lens > 0
    pending = state.pending.at[:, 0].set(jnp.where(has_new[:, None], last, state.pending[:, 0]))
    return HeadState(cache, pending, jnp.where(has_new, 1, carried).astype(jnp.int32))

  def _feed_pending(self, params, target, state: HeadState, ctx: DraftContext):
    """Appends the pending pairs; returns (the head's output at the last one [B, D], cache)."""
    s = state.pending.shape[1]
    m = state.cache.lengths
    count = jnp.where(ctx.active, state.num_pending, 0).astype(jnp.int32)
    next_tokens = token_window(ctx.tokens, m + 1, s)  # [B, S] x_{t+1} of each pending pair
    out, cache = self._chain(params, target, next_tokens, state.pending, state.cache, count)
    h = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    return h, cache

  def _fed(self, state: HeadState, head_cache: KVCache, ctx: DraftContext) -> HeadState:
    """The state once the pending pairs are in `head_cache`."""
    return HeadState(head_cache, state.pending, jnp.where(ctx.active, 0, state.num_pending).astype(jnp.int32))

  def propose(self, target, params, state: HeadState, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    h, head_cache = self._feed_pending(params, target, state, ctx)
    committed = head_cache.lengths
    if self.tree_tokens:
      drafts, parents, draft_lens, q = self._tree(params, target, h, head_cache, ctx, k, sampling)
    else:
      drafts, q = self._chain_drafts(params, target, h, head_cache, ctx, k, sampling)
      parents, draft_lens = None, jnp.full_like(ctx.lengths, k)
    head_cache = dataclasses.replace(head_cache, lengths=committed)  # draft pairs are not committed
    state = self._fed(state, head_cache, ctx)
    return Proposal(drafts, jnp.where(ctx.active, draft_lens, 0), q, state, cache, parents)

  def advance(self, target, params, state: HeadState, cache, ctx: DraftContext, sampling):
    _, head_cache = self._feed_pending(params, target, state, ctx)
    return self._fed(state, head_cache, ctx), cache

  def _chain_drafts(self, params, target, h, head_cache, ctx, k, sampling):
    """K chained drafts from the head's output h [B, D]: (drafts [B, K], q [B, K, V] | None).

    The K - 1 draft-and-feed steps run as one `lax.scan` (`chain_scan`).
    """
    step_lens = ctx.active.astype(jnp.int32)
    need_q = not sampling.is_greedy

    def draw(h, i):  # h [B, D] -> target id [B], q [B, V] | None
      logits = self.draft_logits(params, target, h).astype(jnp.float32)  # [B, Vd]
      keys = sampling_lib.row_keys(sampling.seed, ctx.seq_ids, ctx.lengths + 1 + i, STREAM_SAMPLE)
      x = self.to_target(sampling_lib.sample(logits, sampling, keys))
      return x, self.place(sampling_lib.probs(logits, sampling)) if need_q else None

    def feed(x, h, head_cache):  # the drafted target id x [B] with its parent output h
      out, head_cache = self._chain(params, target, x[:, None], h[:, None], head_cache, step_lens)
      return out[:, 0], head_cache

    drafts, q, _ = chain_scan(draw, feed, h, head_cache, k)
    return drafts, q

  def _log_q(self, params, target, out, sampling):
    """[..., D] -> (log-probabilities [..., Vd] that score and draw children, probabilities | None)."""
    logits = self.draft_logits(params, target, out).astype(jnp.float32)
    if sampling.is_greedy:  # scores of the raw distribution; children are its top ones
      return jax.nn.log_softmax(logits, axis=-1), None
    probs = sampling_lib.probs(logits, sampling)
    return jnp.log(probs), probs

  def _tree(self, params, target, h_root, head_cache, ctx, k, sampling):
    """A draft tree of depth k: (drafts [B, N], parents [B, N], valid nodes [B], q [B, N, V] | None).

    Dynamic (EAGLE-2) by default; the fixed shape of `tree_parents` when given.
    """
    static = tree_search.StaticShape.build(np.asarray(self.tree_parents), k) if self.tree_parents else None
    width = static.children if static else self.tree_topk  # children drawn per expanded node
    # Sampled steps draw children from q and verify with q (`tree_search.grow` keeps that exact), except for
    # dynamic trees with tree_verify 'one-hot': their top children are deterministic, verified by matching.
    sampled = not sampling.is_greedy and (static is not None or self.tree_verify == 'q')
    fed = tree_search.Fed()  # the frontier nodes of every level so far, fed again as one block
    outs = [h_root[:, None]]  # the last expanded level's outputs [B, F, D]

    def expand(level, top):
      fed.add(level, top, outs[-1], width)
      outs.append(self._feed_tree(params, target, fed, head_cache, ctx))
      return self._log_q(params, target, outs[-1], sampling)

    tree, q = tree_search.grow(
        self._log_q(params, target, outs[0], sampling),
        expand,
        lambda depth: sampling_lib.row_keys(sampling.seed, ctx.seq_ids, ctx.lengths + depth, STREAM_TREE),
        k,
        width,
        self.tree_tokens,
        static,
        sampled,
    )
    return self.to_target(tree.ids), tree.parents, tree.num_nodes, None if q is None else self.place(q)

  def _feed_tree(self, params, target, fed, head_cache, ctx):
    """Runs every fed node (tree mask, scratch slots past the cache); the newest level's outputs [B, topk, D]."""
    tokens = self.to_target(jnp.concatenate(fed.ids, axis=1))  # [B, T]
    feats = jnp.concatenate(fed.feats, axis=1)  # [B, T, D]: each node's parent output
    inputs = StepInputs.tree(head_cache, fed.depths(), fed.mask(), jnp.where(ctx.active, tokens.shape[1], 0))
    out, _ = self.run(params, target, tokens, feats, head_cache, inputs)
    return out[:, -fed.ids[-1].shape[1] :]

  def commit(self, params, state: HeadState, ctx: DraftContext, n_emitted, taps, hidden=None) -> HeadState:
    # The verify block's (a tree's accepted path's) features [B, K + 1, D]; the first n_emitted are committed.
    feats = self.features(params, hidden, taps).astype(state.pending.dtype)
    pad = state.pending.shape[1] - feats.shape[1]
    pending = jnp.pad(feats, ((0, 0), (0, pad), (0, 0)))
    return HeadState(state.cache, pending, jnp.where(n_emitted > 0, n_emitted, state.num_pending).astype(jnp.int32))


TREE_VERIFY = ('q', 'one-hot')  # how sampled requests verify an EAGLE-2 tree


@dataclasses.dataclass(frozen=True, eq=False)
class TreeOptions:
  """The tree settings of head drafters (`eagle3`, `mtp`): chains by default."""

  tree_topk: int | None = option(
      None, '--tree-topk', type=int, help='eagle3 / mtp: children per expanded node of an EAGLE-2 tree (default 4)'
  )
  tree_tokens: int = option(
      0,
      '--tree-tokens',
      type=int,
      help='eagle3 / mtp: draft-tree nodes verified per step (0: a chain of --n-predict drafts); the tree is '
      '--n-predict deep',
  )
  tree_parents: Any = option(
      None,
      '--tree-parents',
      type=str,
      help='eagle3 / mtp: a static draft tree, the parent of each node as a comma-separated list (0: the root, '
      'node i is i); nodes deeper than --n-predict are dropped',
  )
  tree_verify: str = option(
      'q',
      '--tree-verify',
      type=str,
      help='eagle3 / mtp: how sampled requests draft and verify an EAGLE-2 tree: q (children drawn without '
      'replacement from q, kept by a per-level budget, verified with q; the default) or one-hot (the top children, '
      'as greedy, verified by sample-and-match)',
  )

  def validate(self) -> None:
    if self.tree_parents is not None and (self.tree_tokens or self.tree_topk is not None):
      raise SpecjaxError('--tree-parents gives a static tree; it cannot be combined with --tree-tokens / --tree-topk')
    self.parents()
    if self.tree_tokens < 0:
      raise SpecjaxError(f'--tree-tokens must be >= 0 (0: chains), got {self.tree_tokens}')
    if self.tree_topk is not None and not self.tree_tokens:
      raise SpecjaxError('--tree-topk shapes a draft tree: give --tree-tokens too')
    if self.tree_topk is not None and self.tree_topk < 1:
      raise SpecjaxError(f'--tree-topk must be at least 1, got {self.tree_topk}')
    if self.tree_verify not in TREE_VERIFY:
      raise SpecjaxError(f'--tree-verify must be one of {", ".join(TREE_VERIFY)}, got {self.tree_verify!r}')
    if self.tree_verify != 'q' and not self.tree_tokens:
      raise SpecjaxError('--tree-verify one-hot applies to EAGLE-2 trees: give --tree-tokens (static trees use q)')

  def parents(self) -> tuple[int, ...]:
    """The static tree's parent list (node i + 1's parent; 0: the root), or ()."""
    if self.tree_parents is None:
      return ()
    entries = self.tree_parents
    if isinstance(entries, str):
      try:
        entries = [int(x) for x in entries.replace(' ', '').split(',') if x]
      except ValueError:
        raise SpecjaxError(f'--tree-parents must be comma-separated integers, got {self.tree_parents!r}') from None
    return tuple(int(p) for p in trees.static_tree([0, *entries])[1:])

  @property
  def is_tree(self) -> bool:
    return bool(self.tree_tokens or self.tree_parents is not None)

  def tree_shape(self) -> dict:
    """`HeadDrafter` fields for these settings."""
    parents = self.parents()
    topk = (self.tree_topk or 4) if self.tree_tokens else 0
    return {
        'tree_topk': topk,
        'tree_tokens': len(parents) or self.tree_tokens,
        'tree_parents': parents,
        'tree_verify': self.tree_verify,
    }

  def tree_label(self, name: str) -> str:
    if self.tree_parents is not None:
      return f'{name}-tree(static {len(self.parents())})'
    one_hot = ', one-hot' if self.tree_verify == 'one-hot' else ''
    return f'{name}-tree({self.tree_shape()["tree_topk"]}x{self.tree_tokens}{one_hot})' if self.tree_tokens else name


def check_tree_target(target, options: TreeOptions) -> None:
  if options.is_tree and target.is_hybrid:
    raise SpecjaxError(
        f'{target.source}: draft trees need a target whose cache rolls back by position; this hybrid '
        '(recurrent-state) target verifies chains only (drop the tree options)'
    )
