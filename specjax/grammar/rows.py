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

Draft trees (`RowGrammars.tree_step`): each root-to-leaf path is validated,
a node under a refused token is cut (`GrammarInputs.valid`), and node i's
mask is the state's after the path to it: it masks the target at i and the
law its children were drawn from. Children are drawn without replacement from
q (on `STREAM_TREE`, apart from the verifier's streams); those the grammar
allows, in order, are draws without replacement from q' = normalize(q m),
which the verifier renormalises after each rejected one, as for plain trees.

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
      parents: np.ndarray | None = None,  # [B, K] a draft tree's (`tree_step`), None: chains
  ) -> GrammarInputs:
    """Forced drafts, cuts and the K + 1 masks of one speculative step (host arrays)."""
    if parents is not None:
      return self.tree_step(drafts, parents, draft_lens, active)
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
    self._check([job[0] for job in jobs])
    self.host_s += time.perf_counter() - start
    valid = np.arange(k)[None, :] < draft_lens[:, None]
    return GrammarInputs(bitmask, drafts, draft_lens, forced, fresh, valid)

  def tree_step(
      self,
      drafts: np.ndarray,  # [B, N] node tokens, breadth-first
      parents: np.ndarray,  # [B, N] each node's parent in the verify block (0: the root, node i is i + 1)
      num_nodes: np.ndarray,  # [B] the row's nodes (the rest is padding)
      active: np.ndarray,  # [B] bool
  ) -> GrammarInputs:
    """Cuts and the N + 1 node masks of one draft-tree step: one `validate_tokens` and one masks call per
    root-to-leaf path (a matcher is in one job per parallel call: the paths of a row go in rounds)."""
    start = time.perf_counter()
    b, n = drafts.shape
    bitmask = np.full((b, n + 1, self.words), -1, np.int32)
    valid = np.ones((b, n), bool)
    rounds: list[list] = []  # rounds[r]: (matcher, row, block indices of the path's kept nodes, their tokens)
    for row, matcher in enumerate(self.matchers):
      if matcher is None or not active[row]:
        continue
      count = int(num_nodes[row])
      par = parents[row, :count].astype(np.int64)
      valid[row] = False
      inner = np.zeros(count + 1, bool)
      inner[par] = True
      leaves = [i for i in range(1, count + 1) if not inner[i]] or [0]
      for r, leaf in enumerate(leaves):
        path = []
        while leaf:
          path.append(leaf)
          leaf = par[leaf - 1]
        path.reverse()
        tokens = drafts[row, np.array(path, np.int64) - 1].tolist() if path else []
        kept = matcher.validate_tokens(tokens)
        valid[row, np.array(path[:kept], np.int64) - 1] = True
        if r == len(rounds):
          rounds.append([])
        rounds[r].append((matcher, row, [0, *path[:kept]], tokens[:kept]))
    for jobs in rounds:
      scratch = np.full((sum(len(nodes) for _, _, nodes, _ in jobs), self.words), -1, np.int32)
      offsets = np.cumsum([0] + [len(nodes) for _, _, nodes, _ in jobs])
      with_drafts = [(m, int(o), t) for (m, _, _, t), o in zip(jobs, offsets) if t]
      if with_drafts:
        fill_next_token_bitmask_par_with_draft_tokens(_executor(), with_drafts, scratch)
      if len(with_drafts) < len(jobs):
        fill_next_token_bitmask_par(
            _executor(), [(m, int(o)) for (m, _, _, t), o in zip(jobs, offsets) if not t], scratch
        )
      for (_, row, nodes, _), o in zip(jobs, offsets):
        bitmask[row, nodes] = scratch[o : o + len(nodes)]
    self._check([job[0] for jobs in rounds for job in jobs])
    self._forced_lens[:] = 0
    self.host_s += time.perf_counter() - start
    none = np.zeros(b, bool)
    return GrammarInputs(bitmask, np.array(drafts, np.int32), np.array(num_nodes, np.int32), none, none, valid)

  @staticmethod
  def _check(matchers) -> None:
    for matcher in matchers:
      if matcher.is_error():  # e.g. a resource limit of the parser (ParserTooComplex)
        raise SpecjaxError(f'grammar: {matcher.get_error().splitlines()[0]}')

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
