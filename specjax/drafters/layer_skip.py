"""Layer-skip self-drafting: the target's first N layers, final norm and head.

It shares the target's weights and its KV cache: the first N layers of a
committed token have the same keys and values in the truncated and the full
model, so drafts read the target cache directly and write their own positions
into it, which the verify pass then overwrites. No state of its own.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import DraftContext, Drafter, Proposal
from specjax.drafters.draft_model import draft_loop


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(Drafter):
  num_layers: int = 1
  name: str = 'layer-skip'
  provides_q: bool = True

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    forward = lambda t, c, lens: target.forward(t, c, lens, num_layers=self.num_layers)[:2]
    first_lens = ctx.active.astype(jnp.int32)
    drafts, q, drafted_cache = draft_loop(
        forward, target.logits, ctx.last_tokens[:, None], first_lens, cache, k, sampling, ctx.seq_ids,
        ctx.lengths + 1, need_q=not sampling.is_greedy)
    cache = dataclasses.replace(drafted_cache, lengths=cache.lengths)  # draft positions are not committed
    return Proposal(drafts, jnp.where(ctx.active, k, 0), q, state, cache)
