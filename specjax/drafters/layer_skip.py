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
from specjax.drafters.registry import DrafterFamily, option
from specjax.errors import SpecjaxError
from specjax.models.contract import append


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(Drafter):
  num_layers: int = 1
  name: str = 'layer-skip'
  provides_q: bool = True

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    forward = lambda t, c, lens: append(target, t, c, lens, num_layers=self.num_layers)[:2]
    first_lens = ctx.active.astype(jnp.int32)
    drafts, q, drafted_cache = draft_loop(
        forward,
        target.logits,
        ctx.last_tokens[:, None],
        first_lens,
        cache,
        k,
        sampling,
        ctx.seq_ids,
        ctx.lengths + 1,
        need_q=not sampling.is_greedy,
    )
    cache = dataclasses.replace(drafted_cache, lengths=cache.lengths)  # draft positions are not committed
    return Proposal(drafts, jnp.where(ctx.active, k, 0), q, state, cache)

  def advance(self, target, params, state, cache, ctx: DraftContext, sampling):
    return state, cache  # drafting only writes scratch positions past the cache's lengths


@dataclasses.dataclass(frozen=True)
class LayerSkipOptions:
  layers: int | None = option(
      None, '--layers', help="layer-skip: the target's first N layers draft (default: a quarter of them)", type=int
  )

  def validate(self) -> None:
    if self.layers is not None and self.layers < 1:
      raise SpecjaxError(f'layer-skip layers must be at least 1, got {self.layers}')


def _check(target, options: LayerSkipOptions) -> None:
  if target.is_hybrid:
    raise SpecjaxError(
        f'layer-skip drafting is not supported on hybrid targets ({target.architecture}): '
        'its drafts would advance the recurrent state; use --mtp or --drafter ngram'
    )
  total = target.config.num_layers
  if options.layers is not None and not 1 <= options.layers < total:
    raise SpecjaxError(f"layer-skip needs 1 <= layers < {total} (the target's depth), got {options.layers}")


FAMILY = DrafterFamily(
    name='layer-skip',
    options=LayerSkipOptions,
    check=_check,
    help="the target's first layers, final norm and head",
    build=lambda target, o: LayerSkipDrafter(num_layers=o.layers or max(1, target.config.num_layers // 4)),
    label=lambda o: f'layer-skip({o.layers if o.layers is not None else "auto"})',
)
