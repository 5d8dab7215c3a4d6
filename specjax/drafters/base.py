"""The drafter interface every family implements.

A drafter is a static, hashable description (it is a static argument of the
jitted step); its weights and state are pytrees passed in explicitly:

  init_state(plan)                          -> state        (host, once per batch)
  prefill(target, params, state, tokens, query_lens, hidden, taps) -> state   (jitted, prompt chunks)
  propose(target, params, state, cache, ctx, k, sampling)
      -> Proposal(drafts [B, K], draft_lens [B], q [B, K, V] | None, state, cache, parents)
  commit(params, state, ctx, n_emitted, taps, hidden) -> state
  start(params, state, ctx) -> state        (jitted, once after the first token)
  advance(target, params, state, cache, ctx, sampling) -> (state, cache)
      what propose does to the state without drafting (a step that verifies
      other drafts: `ngram+<family>`)

`target` is the merged target module (layer-skip drafts with its first layers;
others ignore it). `cache` is the target's KV cache: a drafter may write draft
positions into it (the verify pass overwrites them). `taps` are the target
hidden states after the layers in `drafter.taps`, from the verify pass, for
drafters conditioned on them (EAGLE, DFlash); `hidden` is the target's
final-normed hidden state of the prompt chunk / verify block (`[B, T, D]`,
verify blocks padded to K + 1), for drafters with `reads_hidden` (MTP heads).
Prefill hands them the same for each prompt chunk: `hidden` and the `taps`
residuals of the chunk (each `[B, T, D]`), so drafters conditioned on target
features see the whole prompt's.

Tree drafters (`tree_tokens` > 0) return `tree_tokens` nodes in BFS order
with `parents`; K is then the tree's depth, the verify pass checks every node
(`specjax.trees`) and `commit` gets the taps / hidden states of the accepted
path, `[B, K + 1, D]`, as a chain drafter gets its accepted prefix.

Drafters whose drafts depend only on the committed tokens (n-gram) may look
them up ahead (`drafts_ahead`): `start` and `commit` compute the next step's
drafts for the deepest K, `propose` slices them, and `pending_lens(state)`
[B] tells the host, with the step's outputs, how many each row has, so the
engine runs a verify pass only as wide as the longest draft needs
(`ngram+<family>` too: its rows without a match count as K).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.cache.paged import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftContext:
  tokens: jax.Array  # [B, C] every token of each row (prompt + generated)
  lengths: jax.Array  # [B] position of each row's last token (= target cache length)
  last_tokens: jax.Array  # [B]
  active: jax.Array  # [B] bool
  seq_ids: jax.Array  # [B]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
  drafts: jax.Array  # [B, K] int32
  draft_lens: jax.Array  # [B] valid drafts per row
  q: jax.Array | None  # [B, K, V] the distributions drafts were drawn from, or None
  state: Any
  cache: KVCache  # the target cache, possibly with draft positions written
  parents: jax.Array | None = None  # [B, K] a tree: block index of each draft's parent (0 = the root); None = a chain


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """What a drafter needs to size its state for one batch."""

  batch: int
  capacity: int  # tokens per row (block table width x page size)
  num_pages: int
  page_size: int
  block_tables: Any  # np.ndarray [B, pages_per_seq]
  max_draft: int = 0  # the deepest K a step may draft


class Drafter:
  """Base class: no state, nothing to prefill or commit."""

  name: str = 'drafter'
  taps: tuple[int, ...] = ()
  provides_q: bool = False  # True when propose returns q at temperature > 0
  drafts_ahead: bool = False  # next drafts computed at commit; the host sizes the verify pass to them
  reads_hidden: bool = False  # prefill / commit get the target's final hidden states
  max_depth: int = 16
  tree_tokens: int = 0  # drafts per tree step (0: chains of K drafts)
  default_depth: int | None = None  # K its checkpoint asks for (e.g. num_assistant_tokens); None: the engine's
  # Tokens past a position its cache entry there depends on (1: heads that pair a position's feature with the
  # next token); a prefix-cache page's key covers them.
  prefix_key_lag: int = 0
  forced_first: bool = False  # `grammar+<family>`: constrained rows verify their grammar's forced tokens first
  forced_only: bool = False  # `grammar` alone: no drafts of its own

  def verify_width(self, k: int) -> int:
    """Positions one verify pass writes at depth K (the last token and the drafts)."""
    return (self.tree_tokens or k) + 1

  def lookahead(self, k: int) -> int:
    """Cache slots past a row's length a step at depth K may write (target or drafter pages)."""
    return self.verify_width(k)

  def params(self) -> Any:
    """The drafter's weights pytree (passed to every call)."""
    return ()

  def init_state(self, plan: BatchPlan) -> Any:
    return ()

  def prefill(self, target, params, state, tokens, query_lens, hidden, taps=()):
    return state

  def propose(self, target, params, state, cache: KVCache, ctx: DraftContext, k: int, sampling) -> Proposal:
    raise NotImplementedError

  def commit(
      self,
      params,
      state,
      ctx: DraftContext,
      n_emitted: jax.Array,
      taps: tuple[jax.Array, ...],
      hidden: jax.Array | None = None,
  ):
    return state

  def advance(self, target, params, state, cache: KVCache, ctx: DraftContext, sampling):
    """(state, cache) as `propose` leaves them, without the drafts: for steps that verify other drafts.

    `commit` then sees emitted tokens this drafter did not draft. Default: `propose` at depth 1.
    """
    prop = self.propose(target, params, state, cache, ctx, 1, sampling)
    return prop.state, prop.cache

  def start(self, params, state, ctx: DraftContext):
    """Called once after the first token is sampled (drafters that draft ahead look up here)."""
    return state

  def pending_lens(self, state) -> jax.Array:
    """[B] drafts each row has for the next step (`drafts_ahead` drafters only)."""
    raise NotImplementedError


def token_window(
    tokens: jax.Array,  # [B, C]
    start: jax.Array,  # [B]
    n: int,
) -> jax.Array:
  """tokens[b, start[b] : start[b] + n] for each row b, [B, n]; positions outside the buffer read its ends."""
  idx = jnp.clip(start[:, None] + jnp.arange(n)[None, :], 0, tokens.shape[1] - 1)
  return jnp.take_along_axis(tokens, idx, axis=1)


def chain_scan(draw, feed, h: jax.Array, carry, k: int):
  """K chained drafts from the drafter's output h [B, D]: (drafts [B, K], q [B, K, V] | None, carry).

  `draw(h, i)` -> (token [B], q [B, V] | None) draws draft i; `feed(token, h, carry)` -> (h, carry) runs the
  drafter over it. The K - 1 draw-and-feed steps are one `lax.scan` (the body compiles once, whatever K); the
  last draft is drawn after it and not fed.
  """

  def step(state, i):
    h, carry = state
    x, q = draw(h, i)
    return feed(x, h, carry), (x, q)

  (h, carry), (xs, qs) = jax.lax.scan(step, (h, carry), jnp.arange(k - 1))  # xs [K-1, B], qs [K-1, B, V]
  x, q = draw(h, k - 1)
  drafts = jnp.concatenate([xs.T, x[:, None]], axis=1)
  return drafts, None if q is None else jnp.concatenate([jnp.moveaxis(qs, 0, 1), q[:, None]], axis=1), carry
