"""Prompt lookup first, a learned drafter where the lookup finds nothing.

`ngram+<family>` (for example `ngram+eagle3`) drafts, per row and step, the
n-gram continuation when the row's last n tokens (n from `ngram_max` down to
`ngram_min`) occurred earlier, and the other family's chain otherwise: copied
spans go to the lookup, which is free and accepted far more often there, and
new text to the learned drafter. Both drafters keep their state every step
(the learned drafter reads every committed position, whichever drafts were
verified), so a row can switch at any step.

The lookups are made ahead, at commit (`Drafter.drafts_ahead`): the host
reads each row's pending draft length (a row without a match counts as the
full K) and verifies only as wide as the longest draft needs, as for n-gram
alone. The learned drafter drafts only in steps where some row has no match;
in the others it only catches up with what was committed (`advance`).
`fallback_depth` caps the learned drafter's chain below K (0: K): where a
verify of K + 1 tokens costs more steps of plain decoding than a weak head's
chain emits, rows without a match verify a shorter chain while looked-up rows
keep the full K.

Drafts from the lookup are deterministic: when the learned drafter gives q
for rejection sampling, a looked-up row's q is one-hot at its drafts, for
which rejection sampling is exactly sample-and-match. Chains only (a tree
drafter's options are refused).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.drafters.ngram import NgramDrafter, NgramOptions
from specjax.drafters.registry import DrafterFamily, option
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True, eq=False)
class NgramFirstDrafter(Drafter):
  """`lookup`'s drafts where it has a match, else `fallback`'s. State: (lookup's, fallback's); params: fallback's."""

  lookup: NgramDrafter = None
  fallback: Drafter = None
  fallback_depth: int = 0  # the learned drafter's chain length (0: the step's K)
  drafts_ahead: bool = True

  @property
  def name(self) -> str:
    return f'ngram+{self.fallback.name}'

  @property
  def taps(self) -> tuple[int, ...]:
    return self.fallback.taps

  @property
  def reads_hidden(self) -> bool:
    return self.fallback.reads_hidden

  @property
  def provides_q(self) -> bool:
    return self.fallback.provides_q

  @property
  def max_depth(self) -> int:
    return min(self.lookup.max_depth, self.fallback.max_depth)

  @property
  def default_depth(self) -> int | None:
    return self.fallback.default_depth

  def lookahead(self, k: int) -> int:
    return max(self.lookup.lookahead(k), self.fallback.lookahead(k))

  def params(self):
    return self.fallback.params()

  def init_state(self, plan: BatchPlan):
    return self.lookup.init_state(plan), self.fallback.init_state(plan)

  def prefill(self, target, params, state, tokens, query_lens, hidden, taps=()):
    return state[0], self.fallback.prefill(target, params, state[1], tokens, query_lens, hidden, taps)

  def start(self, params, state, ctx: DraftContext):
    return self.lookup.start((), state[0], ctx), self.fallback.start(params, state[1], ctx)

  def _fallback_k(self, k: int) -> int:
    return min(self.fallback_depth or k, k)

  def pending_lens(self, state) -> jax.Array:
    found = self.lookup.pending_lens(state[0])
    return jnp.where(found > 0, found, self._fallback_k(state[0].drafts.shape[1]))  # no match: the fallback's chain

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    found = self.lookup.propose(target, (), state[0], cache, ctx, k, sampling)
    use = found.draft_lens > 0  # [B]
    pad = k - self._fallback_k(k)

    def drafted():
      prop = self.fallback.propose(target, params, state[1], cache, ctx, k - pad, sampling)
      drafts = jnp.pad(prop.drafts, ((0, 0), (0, pad)))  # [B, K]
      q = None if prop.q is None else jnp.pad(prop.q, ((0, 0), (0, pad), (0, 0)))  # [B, K, V]
      return drafts, prop.draft_lens, q, prop.state, prop.cache

    def caught_up():  # every active row has a match: the fallback only takes in what was committed
      drafts, draft_lens, q, _, _ = jax.eval_shape(drafted)
      fallback_state, fallback_cache = self.fallback.advance(target, params, state[1], cache, ctx, sampling)
      zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)
      return zeros(drafts), zeros(draft_lens), zeros(q), fallback_state, fallback_cache

    learned, learned_lens, q, fallback_state, cache = jax.lax.cond(jnp.any(ctx.active & ~use), drafted, caught_up)
    drafts = jnp.where(use[:, None], found.drafts, learned)
    if q is not None:  # [B, K, V]: a looked-up draft was drawn with probability 1
      q = jnp.where(use[:, None, None], jax.nn.one_hot(found.drafts, q.shape[-1], dtype=q.dtype), q)
    draft_lens = jnp.where(use, found.draft_lens, learned_lens)
    return Proposal(drafts, draft_lens, q, (found.state, fallback_state), cache)

  def commit(self, params, state, ctx: DraftContext, n_emitted, taps, hidden=None):
    return (
        self.lookup.commit((), state[0], ctx, n_emitted, taps, hidden),
        self.fallback.commit(params, state[1], ctx, n_emitted, taps, hidden),
    )


@dataclasses.dataclass(frozen=True)
class FallbackOptions:
  fallback_depth: int = option(
      0,
      '--fallback-depth',
      type=int,
      help='ngram+<family>: the learned drafter drafts at most this many tokens where the lookup finds nothing '
      '(0: the step depth K)',
  )


def ngram_first_family(fallback: DrafterFamily) -> DrafterFamily:
  """The family `ngram+<fallback>`: the n-gram options and `--fallback-depth` beside the fallback's."""

  def validate(self) -> None:
    NgramOptions.validate(self)
    cap = min(NgramDrafter.max_depth, fallback.max_depth(self))
    if not 0 <= self.fallback_depth <= cap:
      raise SpecjaxError(f'--fallback-depth must be in 0..{cap} (0: the step depth), got {self.fallback_depth}')
    if hasattr(fallback.options, 'validate'):
      fallback.options.validate(self)
    if getattr(self, 'tree_tokens', 0) or getattr(self, 'tree_parents', None) is not None:
      raise SpecjaxError(f'--drafter ngram+{fallback.name} drafts chains: drop the tree options')

  options = dataclasses.make_dataclass(
      f'Ngram{fallback.options.__name__}',
      [
          (f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
          for f in dataclasses.fields(NgramOptions) + dataclasses.fields(FallbackOptions)
      ],
      bases=(fallback.options,),
      namespace={'validate': validate},
      frozen=True,
      eq=False,
  )

  def build(target, o) -> NgramFirstDrafter:
    lookup = NgramDrafter(n_min=o.ngram_min, n_max=o.ngram_max)
    return NgramFirstDrafter(lookup, fallback.build(target, o), fallback_depth=o.fallback_depth)

  return DrafterFamily(
      name=f'ngram+{fallback.name}',
      options=options,
      build=build,
      check=fallback.check,
      depths=fallback.depths,
      default_depth=fallback.default_depth,
      max_depth=lambda o: min(NgramDrafter.max_depth, fallback.max_depth(o)),
      target_heads=fallback.heads_for,
      label=lambda o: f'ngram({o.ngram_min}..{o.ngram_max})+{fallback.describe(o)}'
      + (f'(k<={o.fallback_depth})' if o.fallback_depth else ''),
      help=f'n-gram prompt lookup where the last n >= --ngram-min tokens occurred before, else {fallback.name}',
  )
