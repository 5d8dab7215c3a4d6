"""Grammar-forced tokens first, another drafter's chain elsewhere.

`grammar+<family>` (for example `grammar+ngram`) drafts as `<family>` does,
and on constrained requests the host puts the grammar's forced continuation
(JSON keys, punctuation, schema constants: llguidance's fast-forward tokens)
in place of a row's drafts when the grammar allows only that continuation
and the drafter's chain doesn't start with it (`specjax.grammar.rows`). Such
drafts are drawn with probability 1 (q one-hot), so the target accepts them
whenever it agrees. `grammar` alone drafts forced tokens only.

The wrapped drafter keeps its state every step whichever drafts a row
verified, as under `ngram+<family>`. Chains only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.drafters.base import DraftContext, Drafter, Proposal
from specjax.drafters.registry import DrafterFamily
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class ForcedOnly(Drafter):
  """No drafts of its own: every row's drafts come from its grammar."""

  name: str = 'grammar'
  max_depth: int = 16

  def propose(self, target, params, state, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    b = ctx.last_tokens.shape[0]
    return Proposal(jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), jnp.int32), None, state, cache)

  def advance(self, target, params, state, cache, ctx, sampling):
    return state, cache


@dataclasses.dataclass(frozen=True, eq=False)
class GrammarFirstDrafter(Drafter):
  """`inner`'s drafts, with grammar-forced tokens substituted by the host (`forced_first`)."""

  inner: Drafter = None
  forced_first = True  # read by the engine: substitute forced drafts on constrained rows

  @property
  def name(self) -> str:
    return 'grammar' if self.forced_only else f'grammar+{self.inner.name}'

  @property
  def forced_only(self) -> bool:
    """`grammar` alone: the host sizes each step's verify to the rows' forced runs (0: a decode-width step)."""
    return isinstance(self.inner, ForcedOnly)

  taps = property(lambda self: self.inner.taps)
  provides_q = property(lambda self: self.inner.provides_q)
  drafts_ahead = property(lambda self: self.inner.drafts_ahead)
  reads_hidden = property(lambda self: self.inner.reads_hidden)
  max_depth = property(lambda self: self.inner.max_depth)
  default_depth = property(lambda self: self.inner.default_depth)
  prefix_key_lag = property(lambda self: self.inner.prefix_key_lag)
  tree_tokens = 0

  def __getattr__(self, name):  # family-specific attributes (`kind`, `draft_model`, ...)
    if name.startswith('__') or name == 'inner':
      raise AttributeError(name)
    return getattr(self.inner, name)

  def verify_width(self, k):
    return self.inner.verify_width(k)

  def lookahead(self, k):
    return self.inner.lookahead(k)

  def params(self):
    return self.inner.params()

  def init_state(self, plan):
    return self.inner.init_state(plan)

  def prefill(self, target, params, state, tokens, query_lens, hidden, taps=()):
    return self.inner.prefill(target, params, state, tokens, query_lens, hidden, taps)

  def propose(self, target, params, state, cache, ctx, k, sampling):
    return self.inner.propose(target, params, state, cache, ctx, k, sampling)

  def commit(self, params, state, ctx, n_emitted, taps, hidden=None):
    return self.inner.commit(params, state, ctx, n_emitted, taps, hidden)

  def advance(self, target, params, state, cache, ctx, sampling):
    return self.inner.advance(target, params, state, cache, ctx, sampling)

  def start(self, params, state, ctx):
    return self.inner.start(params, state, ctx)

  def pending_lens(self, state):
    return self.inner.pending_lens(state)


@dataclasses.dataclass(frozen=True)
class ForcedOnlyOptions:
  pass


FAMILY = DrafterFamily(
    name='grammar',
    options=ForcedOnlyOptions,
    build=lambda target, options: GrammarFirstDrafter(ForcedOnly()),
    depths=(4, 8, 16),
    default_depth=8,
    max_depth=lambda options: 16,
    help='constrained requests only: the tokens the grammar forces (JSON keys, punctuation, schema constants)',
)


def grammar_first_family(inner: DrafterFamily) -> DrafterFamily:
  """The family `grammar+<inner>`: `inner`'s options, drafts and checks, forced tokens substituted."""

  def check(target, options):
    if getattr(options, 'tree_tokens', 0) or getattr(options, 'tree_parents', None) is not None:
      raise SpecjaxError(f'--drafter grammar+{inner.name} drafts chains: drop the tree options')
    inner.check(target, options)

  return DrafterFamily(
      name=f'grammar+{inner.name}',
      options=inner.options,
      build=lambda target, options: GrammarFirstDrafter(inner.build(target, options)),
      check=check,
      depths=inner.depths,
      default_depth=inner.default_depth,
      max_depth=inner.max_depth,
      target_heads=inner.target_heads,
      label=lambda o: f'grammar+{inner.describe(o)}',
      help=f'grammar-forced tokens where the grammar allows one continuation, else {inner.name}',
  )
