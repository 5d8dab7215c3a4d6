"""N-gram prompt lookup: draft the continuation of the latest earlier match.

For n from `n_max` down to `n_min`, find the most recent earlier occurrence of
the row's last n tokens in everything it has seen (prompt and generated text)
and propose the K tokens that followed it. No weights, no q (the verifier uses
sample-and-match, which is exact for deterministic drafts).

Drafts depend only on the committed tokens, so by default they are looked up
ahead: at the end of each step (and once after the first token) for the
deepest K the engine allows, and kept in `NgramState`. A step at depth K takes
the first K. The host reads the pending draft lengths with the step's outputs
and runs the verify executable only as wide as the longest draft needs
(`Drafter.drafts_ahead`), so a step without any match costs a decode step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal, token_window
from specjax.drafters.registry import DrafterFamily, option
from specjax.errors import SpecjaxError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NgramState:
  drafts: jax.Array  # [B, max_draft] the next step's drafts, looked up ahead
  draft_lens: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Prompt lookup; `drafts_ahead=False` looks up inside the step and always verifies K + 1 positions."""

  n_min: int = 1
  n_max: int = 3
  name: str = 'ngram'
  drafts_ahead: bool = True

  def __post_init__(self):
    if not 1 <= self.n_min <= self.n_max:
      raise SpecjaxError(f'ngram sizes need 1 <= n_min <= n_max, got n_min={self.n_min} n_max={self.n_max}')

  def _lookup(self, ctx: DraftContext, k: int) -> tuple[jax.Array, jax.Array]:
    drafts, draft_lens = ngram_lookup(ctx.tokens, ctx.lengths + 1, k, self.n_min, self.n_max)
    return drafts, jnp.where(ctx.active, draft_lens, 0)

  def init_state(self, plan: BatchPlan):
    if not self.drafts_ahead:
      return ()
    return NgramState(jnp.zeros((plan.batch, plan.max_draft), jnp.int32), jnp.zeros((plan.batch,), jnp.int32))

  def start(self, params, state, ctx: DraftContext):
    return NgramState(*self._lookup(ctx, state.drafts.shape[1])) if self.drafts_ahead else state

  def pending_lens(self, state) -> jax.Array:
    return state.draft_lens

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    if self.drafts_ahead:
      drafts, draft_lens = state.drafts[:, :k], jnp.minimum(state.draft_lens, k)
    else:
      drafts, draft_lens = self._lookup(ctx, k)
    return Proposal(drafts, draft_lens, None, state, cache)

  def commit(self, params, state, ctx: DraftContext, n_emitted, taps, hidden=None):
    return self.start(params, state, ctx)


def ngram_lookup(
    tokens: jax.Array,  # [B, C]
    seq_lens: jax.Array,  # [B] tokens in each row
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[jax.Array, jax.Array]:
  """Returns (drafts [B, K], draft_lens [B]); draft_lens is 0 without a match."""
  b, c = tokens.shape
  start = jnp.full((b,), -1, jnp.int32)  # where the continuation starts
  for n in range(n_max, n_min - 1, -1):
    suffix = token_window(tokens, seq_lens - n, n)  # [B, n]
    windows = c - n  # a window at j covers j..j+n-1 and is followed by j+n
    match = jnp.ones((b, windows), bool)
    for i in range(n):
      match &= tokens[:, i : i + windows] == suffix[:, i : i + 1]
    j = jnp.arange(windows)
    match &= (j[None, :] + n < seq_lens[:, None]) & (seq_lens[:, None] >= n + 1)
    latest = jnp.max(jnp.where(match, j[None, :], -1), axis=1)
    start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
  found = start >= 0
  drafts = token_window(tokens, start, k)
  draft_lens = jnp.where(found, jnp.clip(seq_lens - start, 0, k), 0)
  return drafts.astype(jnp.int32), draft_lens.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NgramOptions:
  ngram_min: int = option(1, '--ngram-min', help='shortest suffix n-gram to match', type=int)
  ngram_max: int = option(3, '--ngram-max', help='longest suffix n-gram to match (tried first)', type=int)

  def validate(self) -> None:
    if not 1 <= self.ngram_min <= self.ngram_max:
      raise SpecjaxError(f'ngram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}')


FAMILY = DrafterFamily(
    name='ngram',
    options=NgramOptions,
    help='prompt lookup: the continuation of the latest earlier n-gram match',
    build=lambda target, o: NgramDrafter(n_min=o.ngram_min, n_max=o.ngram_max),
    label=lambda o: f'ngram({o.ngram_min}..{o.ngram_max})',
)
