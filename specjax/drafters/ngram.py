"""N-gram prompt lookup: draft the continuation of the latest earlier match.

For n from `n_max` down to `n_min`, find the most recent earlier occurrence of
the row's last n tokens in everything it has seen (prompt and generated text)
and propose the K tokens that followed it. No weights, no state, no q (the
verifier uses sample-and-match, which is exact for deterministic drafts).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftContext, Drafter, Proposal
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  n_min: int = 1
  n_max: int = 3
  name: str = 'ngram'
  variable_length: bool = True

  def __post_init__(self):
    if not 1 <= self.n_min <= self.n_max:
      raise SpecjaxError(f'ngram sizes need 1 <= n_min <= n_max, got n_min={self.n_min} n_max={self.n_max}')

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    drafts, draft_lens = ngram_lookup(ctx.tokens, ctx.lengths + 1, k, self.n_min, self.n_max)
    draft_lens = jnp.where(ctx.active, draft_lens, 0)
    return Proposal(drafts, draft_lens, None, state, cache)


def ngram_lookup(
    tokens: jax.Array,  # [B, C]
    seq_lens: jax.Array,  # [B] tokens in each row
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[jax.Array, jax.Array]:
  """Returns (drafts [B, K], draft_lens [B]); draft_lens is 0 without a match."""
  b, c = tokens.shape
  rows = jnp.arange(b)[:, None]
  start = jnp.full((b,), -1, jnp.int32)  # where the continuation starts
  for n in range(n_max, n_min - 1, -1):
    suffix = tokens[rows, jnp.clip(seq_lens[:, None] - n + jnp.arange(n), 0, c - 1)]  # [B, n]
    windows = c - n  # a window at j covers j..j+n-1 and is followed by j+n
    match = jnp.ones((b, windows), bool)
    for i in range(n):
      match &= tokens[:, i:i + windows] == suffix[:, i:i + 1]
    j = jnp.arange(windows)
    match &= (j[None, :] + n < seq_lens[:, None]) & (seq_lens[:, None] >= n + 1)
    latest = jnp.max(jnp.where(match, j[None, :], -1), axis=1)
    start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
  found = start >= 0
  idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, c - 1)
  drafts = jnp.take_along_axis(tokens, idx, axis=1)
  draft_lens = jnp.where(found, jnp.clip(seq_lens - start, 0, k), 0)
  return drafts.astype(jnp.int32), draft_lens.astype(jnp.int32)
