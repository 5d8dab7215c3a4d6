"""Each row's grammar matcher, on the host: a step's masks, draft cuts and forced drafts, then the commit.

A constrained speculative step runs in two executables with this in between:

  propose (jit)  -> drafts [B, K], draft_lens [B]
  `RowGrammars.step` (host):
    - grammar-forced drafts (`grammar+<family>`): where the grammar allows one
      continuation (`compute_ff_tokens`), those tokens replace the drafter's
      unless the drafter's already start with them; drawn with probability 1.
    - the cut: `validate_tokens` keeps drafts up to the first one the grammar
      refuses. A matcher never consumes an unverified draft.
    - the K + 1 masks of the states after each kept draft, in one
      `fill_next_token_bitmask_par_with_draft_tokens` call for the batch.
  verify (jit, `GrammarInputs`) -> the emitted tokens
  `RowGrammars.commit` (host): each matcher consumes what its row emitted.

Why the law of the constrained target p' = normalize(p m) stays exact:
drafts kept before the cut are valid, so their law given the step is
q' = normalize(q m); verification compares p' with q', the residual and the
bonus use p'. The cut depends on the drafter's own draw at the cut position,
and drafters draw with the Gumbel noise a plain sampler would use there
(`sampling.STREAM_SAMPLE`), so a cut row draws its token at that position
with a fresh stream (`GrammarInputs.fresh`). Forced drafts do not depend on
any draw. Greedy and sample-and-match rows emit exactly the constrained
autoregressive tokens.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from specjax.errors import SpecjaxError
from specjax.grammar.bitmask import GrammarInputs
from specjax.grammar.compile import new_matcher, require_llguidance

try:
  from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens
except ImportError:  # pragma: no cover (`require_llguidance` names the missing package)
  pass

_EXECUTOR = None


def _executor():
  global _EXECUTOR
  if _EXECUTOR is None:
    _EXECUTOR = require_llguidance().LLExecutor()
  return _EXECUTOR


@dataclasses.dataclass
class ForcedCounts:
  drafted: int = 0  # grammar-forced drafts verified
  accepted: int = 0  # of which the target accepted


class RowGrammars:
  """One llguidance matcher per row (None: the row is unconstrained)."""

  def __init__(self, model, matchers: list, batch: int | None = None):
    """Rows over `matchers` (llguidance matchers, None: unconstrained), padded to `batch` rows."""
    self.vocab = model.config.vocab_size
    self.words = (self.vocab + 31) // 32
    self.eos = frozenset(model.generation.eos_token_ids or model.tokenizer.eos_ids)
    self.matchers = list(matchers) + [None] * ((batch or len(matchers)) - len(matchers))
    batch = len(self.matchers)
    self.forced = [ForcedCounts() for _ in self.matchers]
    self._forced_lens = np.zeros(batch, np.int32)
    self.active = np.zeros(batch, bool)  # the engine's view of which rows still generate
    self.host_s = 0.0  # seconds spent in the matchers (masks, cuts, commits)

  @classmethod
  def compile(cls, model, grammars: list[str | None], batch: int) -> RowGrammars:
    """A fresh matcher per row of compiled grammars (`compile_constraint`; None: unconstrained)."""
    return cls(model, [new_matcher(model, g) if g is not None else None for g in grammars], batch)

  def bitmask(self, active: np.ndarray) -> np.ndarray:  # -> [B, W] int32
    """The mask of each row's current state (all allowed for unconstrained and finished rows)."""
    start = time.perf_counter()
    out = np.full((len(self.matchers), self.words), -1, np.int32)
    jobs = [(m, row) for row, m in enumerate(self.matchers) if m is not None and active[row]]
    if jobs:
      fill_next_token_bitmask_par(_executor(), jobs, out)
    self.host_s += time.perf_counter() - start
    return out

  def forced_lens(self, k: int, active: np.ndarray | None = None) -> np.ndarray:  # -> [B] int32
    """How many grammar-forced tokens (at most k) each active (default: `self.active`) constrained row has next."""
    start = time.perf_counter()
    active = self.active if active is None else active
    out = np.zeros(len(self.matchers), np.int32)
    for row, matcher in enumerate(self.matchers):
      if matcher is not None and active[row]:
        out[row] = min(len(matcher.compute_ff_tokens()), k)
    self.host_s += time.perf_counter() - start
    return out

  def step(
      self,
      drafts: np.ndarray,  # [B, K] the drafter's
      draft_lens: np.ndarray,  # [B]
      active: np.ndarray,  # [B] bool
      *,
      forced_first: bool = False,
  ) -> GrammarInputs:
    """Forced drafts, cuts and the K + 1 masks of one speculative step (host arrays)."""
    start = time.perf_counter()
    b, k = drafts.shape
    bitmask = np.full((b, k + 1, self.words), -1, np.int32)
    drafts, draft_lens = np.array(drafts, np.int32), np.array(draft_lens, np.int32)
    forced, fresh = np.zeros(b, bool), np.zeros(b, bool)
    self._forced_lens[:] = 0
    jobs = []
    for row, matcher in enumerate(self.matchers):
      if matcher is None or not active[row]:
        continue
      own = drafts[row, : draft_lens[row]].tolist()
      if forced_first:
        ff = matcher.compute_ff_tokens()[:k]
        if ff and own[: len(ff)] != ff:
          own, forced[row] = ff, True
          drafts[row] = 0
          drafts[row, : len(ff)] = ff
          self._forced_lens[row] = len(ff)
      valid = matcher.validate_tokens(own)
      fresh[row] = valid < len(own) and not forced[row]
      draft_lens[row] = valid
      jobs.append((matcher, row * (k + 1), own[:valid]))
    flat = bitmask.reshape(b * (k + 1), self.words)
    with_drafts = [job for job in jobs if job[2]]
    if with_drafts:
      fill_next_token_bitmask_par_with_draft_tokens(_executor(), with_drafts, flat)
    if len(with_drafts) < len(jobs):
      fill_next_token_bitmask_par(_executor(), [job[:2] for job in jobs if not job[2]], flat)
    for matcher, _, _ in jobs:
      if matcher.is_error():  # e.g. a resource limit of the parser (ParserTooComplex)
        raise SpecjaxError(f'grammar: {matcher.get_error().splitlines()[0]}')
    self.host_s += time.perf_counter() - start
    return GrammarInputs(bitmask, drafts, draft_lens, forced, fresh)

  def commit(self, tokens: np.ndarray, emitted: np.ndarray, accepted: np.ndarray | None = None) -> None:
    """Each constrained row's matcher consumes the row's emitted tokens ([B, T], [B])."""
    start = time.perf_counter()
    for row, matcher in enumerate(self.matchers):
      if matcher is None or not emitted[row]:
        continue
      if accepted is not None and self._forced_lens[row]:
        self.forced[row].drafted += int(self._forced_lens[row])
        self.forced[row].accepted += int(min(accepted[row], self._forced_lens[row]))
      for token in tokens[row, : emitted[row]].tolist():
        if token in self.eos and matcher.is_accepting():
          break  # the row ends here (a stopped matcher may refuse EOS as a token)
        if not matcher.consume_token(token):
          raise SpecjaxError(f'internal error: row {row} emitted a token its grammar refuses ({matcher.get_error()})')
    self.host_s += time.perf_counter() - start
