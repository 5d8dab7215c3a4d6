"""The tuner's acceptance estimator: per-position conditional acceptance and the expected tokens of a step."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AcceptanceState:
  accept: np.ndarray  # [D] EMA of P(draft j accepted | drafts before it accepted)
  accept_n: np.ndarray  # [D] rows that reached each position
  batch_n: np.ndarray  # [D] rows that reached each position since the batch began
  stale: np.ndarray  # [D] rows whose step ended next to each position without observing it, since one did


@dataclasses.dataclass(frozen=True)
class AcceptanceEstimator:
  """EMA (`alpha`) of the conditional acceptance a_j = P(draft j accepted | drafts before it accepted) per position.

  A step at depth k informs positions 1..k (position j is reached by the rows
  that accepted j - 1 drafts); each reaching row is one EMA observation. A
  missing draft counts as not accepted, except where the drafter drafts ahead:
  the pending lengths say where drafts end, so a_j is conditional on draft j
  existing. Do not mix the two kinds of drafter in one state. Positions never
  reached copy the deepest one that was.
  A position goes stale each time a row's step ends without observing it:
  drafted but not reached (an earlier draft was rejected) or not drafted
  because every draft of a shallower step was accepted. After n such rows
  since one observed it, it reads as a blend with the position before, weight
  (1 - stale_rate)^n on its own estimate, and the next observation outweighs
  it by the same factor (`acceptance`, `observe`): deep estimates follow the
  shallow ones when acceptance falls, and when it rises while K is small.
  Acceptance belongs to the text, so a new batch (`begin`) weighs its own
  observations more: the estimates carried in count as `carry` observations,
  and the n-th observation of a position in the batch moves it by
  max(alpha, 1 / (carry + n)).
  Expected tokens of a row: E(K) = 1 + sum_{i <= K} prod_{j <= i} a_j; when
  the drafter drafted ahead and the host knows each row's pending draft
  length p, the sum stops at min(K, p).
  """

  positions: int  # D, the draft positions estimated (the deepest candidate)
  alpha: float = 0.1
  stale_rate: float = 0.1
  carry: float = 4.0
  prior: float = 0.5  # acceptance assumed before any observation

  def init(self) -> AcceptanceState:
    d = self.positions
    return AcceptanceState(
        accept=np.full(d, self.prior),
        accept_n=np.zeros(d, np.int64),
        batch_n=np.zeros(d, np.int64),
        stale=np.zeros(d, np.int64),
    )

  def begin(self, state: AcceptanceState) -> AcceptanceState:
    return dataclasses.replace(state, batch_n=np.zeros_like(state.batch_n))

  def acceptance(self, state: AcceptanceState) -> np.ndarray:  # [D]
    """Conditional acceptance per draft position.

    A position never reached copies the one before. A position that n rows'
    steps ended next to without observing it (drafted but an earlier draft
    rejected, or not drafted after a shallower step accepted every draft)
    blends its estimate with the one before by (1 - stale_rate)^n, so deep
    positions follow the shallow ones instead of keeping a value from other
    text. Misses (no draft at all) do not age anything.
    """
    a = state.accept.copy()
    for j in range(len(a)):
      if not state.accept_n[j]:
        a[j] = a[j - 1] if j else self.prior
      elif j:
        w = (1.0 - self.stale_rate) ** state.stale[j]
        a[j] = w * a[j] + (1.0 - w) * a[j - 1]
    return a

  def expected_tokens(
      self, state: AcceptanceState, ks: np.ndarray, pending: np.ndarray | None = None
  ) -> np.ndarray:  # [len(ks)]
    """E(K) per depth in `ks`: tokens a row emits in a step of depth K (mean over rows with `pending` drafts)."""
    gain = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance(state)))])  # [D + 1]
    ks = np.asarray(ks)
    if pending is None:
      return gain[ks]
    return gain[np.minimum(ks[:, None], np.asarray(pending).reshape(1, -1))].mean(1)

  def observe(
      self, state: AcceptanceState, k: int, accepted: np.ndarray, drafted: np.ndarray, ahead: bool
  ) -> AcceptanceState:
    """A depth-k step: accepted [rows], drafted [rows]; `ahead`: drafts were known before the step (a row
    without a draft at a position then does not observe it; else it counts as a rejection there)."""
    depth = np.arange(1, k + 1)[:, None]  # [k, 1]
    reached = accepted[None, :] >= depth - 1  # [k, rows]
    if ahead:  # drafts known ahead: only rows with a draft at j observe a_j
      reached &= drafted[None, :] >= depth
    reached = reached.sum(1)  # [k]
    hits = (accepted[None, :] >= depth).sum(1)
    accept, accept_n = state.accept.copy(), state.accept_n.copy()
    fresh = (1.0 - self.stale_rate) ** state.stale  # [D] how current each estimate is
    for j in np.flatnonzero(reached):
      one = max(self.alpha, 1.0 / (self.carry + state.batch_n[j] + 1.0))  # a new batch's first ones weigh more
      w = 1.0 - (1.0 - one) ** reached[j] if accept_n[j] else 1.0
      w = w / (w + (1.0 - w) * fresh[j])  # a stale estimate gives way to new observations
      accept[j] += w * (hits[j] / reached[j] - accept[j])
    accept_n[:k] += reached
    batch_n = state.batch_n.copy()
    batch_n[:k] += reached
    skipped = ((drafted[None, :] > depth - 1) & (accepted[None, :] < depth - 1)).sum(1)  # [k] drafted, not reached
    stale = state.stale.copy()
    stale[:k] = np.where(reached > 0, 0, stale[:k] + skipped)
    stale[k:] += int(((accepted == k) & (drafted == k)).sum())  # every draft accepted: deeper ones unknown
    return AcceptanceState(accept, accept_n, batch_n, stale)
