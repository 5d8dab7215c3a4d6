"""`Tuner`: the candidate K with the most expected tokens per second."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.depths import verified_width
from specjax.errors import SpecjaxError
from specjax.policies.base import Policy
from specjax.policies.costs import LIVE_BUCKETS, linear, live_bucket


@dataclasses.dataclass(frozen=True)
class TunerState:
  step: int  # steps observed
  current: int  # candidate index last chosen on merit (-1: none yet)
  accept: np.ndarray  # [D] EMA of P(draft j accepted | drafts before it accepted)
  accept_n: np.ndarray  # [D] rows that reached each position
  batch_n: np.ndarray  # [D] rows that reached each position since the batch began
  stale: np.ndarray  # [D] rows whose step ended next to each position without observing it, since one did
  level: np.ndarray  # [L] EMA of the cost level per live bucket (seconds), moved by every step
  shape: np.ndarray  # [L, D + 1] step seconds / level per verified width 1 .. D + 1
  shape_n: np.ndarray  # [L, D + 1] steps measured
  drafted_steps: np.ndarray  # [C] steps with drafts each candidate ran
  last_tried: np.ndarray  # [L, C] step at which each candidate last ran (-1: never)


@dataclasses.dataclass(frozen=True)
class Tuner(Policy):
  """Picks the candidate K with the most expected tokens per second.

  Tokens: an EMA (`alpha`) of the conditional acceptance a_j = P(draft j
  accepted | drafts before it accepted) per draft position. A step at depth k
  informs positions 1..k (position j is reached by the rows that accepted
  j - 1 drafts); each reaching row is one EMA observation. A missing draft
  counts as not accepted, except where the drafter drafts ahead: the pending
  lengths say where drafts end, so a_j is conditional on draft j existing.
  Do not mix the two kinds of drafter in one state. Positions never reached
  copy the deepest one that was.
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
  length p (`choose(..., pending=)`), the sum stops at min(K, p).

  Time: a step costs what its verify pass costs, by width: K + 1, or for
  drafts known ahead the width `depths.step_depth(K, max p) + 1` (a step
  without drafts is a decode step whatever K). The tuner keeps, per live
  bucket (powers of two), a cost level that every step moves (`level_alpha`:
  the context grows, prompts change) and each width's cost relative to it
  (`shape_alpha`), so a width not run for a while follows the level instead
  of keeping a stale time. A width never measured is linear in the width
  through the measured ones (with fewer than two in a bucket, the nearest
  bucket's shape).

  Choice: argmax E(K) / T(K, live), staying on the current K unless another is
  better by more than `margin`. Warm-up runs each candidate, deepest first,
  until it has run one step with drafts (at most `warmup_tries` steps each);
  then every `explore_every`-th step runs the candidate least recently tried
  at the current live bucket. No randomness: replays repeat exactly. The state
  can be carried across requests (`Engine.generate(policy_state=...)`).
  """
  candidates: tuple[int, ...] = (2, 4, 6, 8)
  alpha: float = 0.1
  level_alpha: float = 0.3
  shape_alpha: float = 0.1
  explore_every: int = 32  # 0: never explore after warm-up
  warmup_tries: int = 3
  margin: float = 0.02
  stale_rate: float = 0.1
  carry: float = 4.0  # observations the estimates carried into a new batch count as
  prior: float = 0.5  # acceptance assumed before any observation
  name: str = 'tuner'

  def __post_init__(self):
    candidates = tuple(sorted({int(k) for k in self.candidates}))
    if not candidates or candidates[0] < 1:
      raise SpecjaxError(f'tuner needs candidate depths >= 1, got {tuple(self.candidates)}')
    object.__setattr__(self, 'candidates', candidates)
    rates = (self.alpha, self.level_alpha, self.shape_alpha)
    if not (all(0 < r <= 1 for r in rates) and 0 <= self.prior <= 1 and 0 <= self.stale_rate < 1
            and self.carry >= 0):
      raise SpecjaxError(f'tuner needs 0 < alpha, level_alpha, shape_alpha <= 1, 0 <= stale_rate < 1, '
                         f'carry >= 0 and 0 <= prior <= 1, got alpha={self.alpha} level_alpha={self.level_alpha} '
                         f'shape_alpha={self.shape_alpha} stale_rate={self.stale_rate} carry={self.carry} '
                         f'prior={self.prior}')
    if self.explore_every < 0 or self.explore_every == 1 or self.margin < 0 or self.warmup_tries < 1:
      raise SpecjaxError(f'tuner needs explore_every = 0 or >= 2, margin >= 0 and warmup_tries >= 1, got '
                         f'explore_every={self.explore_every} margin={self.margin} '
                         f'warmup_tries={self.warmup_tries}')

  def init(self) -> TunerState:
    c, d = len(self.candidates), self.candidates[-1]
    return TunerState(
        step=0,
        current=-1,
        accept=np.full(d, self.prior),
        accept_n=np.zeros(d, np.int64),
        batch_n=np.zeros(d, np.int64),
        stale=np.zeros(d, np.int64),
        level=np.zeros(LIVE_BUCKETS),
        shape=np.zeros((LIVE_BUCKETS, d + 1)),
        shape_n=np.zeros((LIVE_BUCKETS, d + 1), np.int64),
        drafted_steps=np.zeros(c, np.int64),
        last_tried=np.full((LIVE_BUCKETS, c), -1, np.int64),
    )

  def begin(self, state: TunerState, rows: int) -> TunerState:
    return dataclasses.replace(state, batch_n=np.zeros_like(state.batch_n))

  def acceptance(self, state: TunerState) -> np.ndarray:  # [D]
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

  def expected_tokens(self, state: TunerState, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """E(K) per candidate: tokens a row emits in a step of depth K (mean over rows with `pending` drafts)."""
    gain = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance(state)))])  # [D + 1]
    ks = np.asarray(self.candidates)
    if pending is None:
      return gain[ks]
    return gain[np.minimum(ks[:, None], np.asarray(pending).reshape(1, -1))].mean(1)

  def widths(self, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """Positions the verify pass of each candidate runs (`step_depth` of the longest pending draft)."""
    if pending is None or not np.size(pending):
      return np.asarray(self.candidates) + 1
    longest = int(np.max(pending))
    return np.array([verified_width(k, np.array([longest])) for k in self.candidates])

  def step_times(self, state: TunerState, live: int, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """Expected seconds of a step per candidate at this live batch size."""
    widths = self.widths(pending).astype(np.float64)
    seen = state.shape_n > 0  # [L, W]
    if not seen.any():
      return widths  # nothing measured yet: cost grows with the verified block
    b = live_bucket(live)
    near = sorted(range(LIVE_BUCKETS), key=lambda x: (abs(x - b), x))
    ref = next((x for x in near if seen[x].sum() >= 2), None)
    if ref is None:
      ref = next(x for x in near if seen[x].any())
    lev = next(x for x in near if seen[x].any())
    measured = np.arange(1, seen.shape[1] + 1, dtype=np.float64)[seen[ref]]
    shape = linear(widths, measured, state.shape[ref][seen[ref]])
    shape = np.maximum(shape, 0.1 * state.shape[ref][seen[ref]].min())
    own = seen[lev] & seen[ref]
    if lev != ref and own.any():  # the reference bucket's curve, through this bucket's own points
      all_widths = np.arange(1, seen.shape[1] + 1, dtype=np.float64)
      shape *= np.mean(state.shape[lev][own] / linear(all_widths[own], measured, state.shape[ref][seen[ref]]))
    return state.level[lev] * shape

  def _forced(self, state: TunerState, live: int) -> int | None:
    """The candidate index a warm-up or exploration step runs, else None."""
    tries = (state.last_tried >= 0).sum(0)
    warming = np.flatnonzero((state.drafted_steps == 0) & (tries < self.warmup_tries))
    if warming.size:
      return int(warming[-1])
    if self.explore_every and (state.step + 1) % self.explore_every == 0:
      return int(np.argmin(state.last_tried[live_bucket(live)]))
    return None

  def choose(self, state: TunerState, live: int, pending: np.ndarray | None = None) -> int:
    forced = self._forced(state, live)
    if forced is not None:
      return self.candidates[forced]
    rate = self.expected_tokens(state, pending) / self.step_times(state, live, pending)
    best, current = int(np.argmax(rate)), state.current
    if current >= 0 and rate[best] <= rate[current] * (1 + self.margin):
      best = current
    return self.candidates[best]

  def observe(self, state: TunerState, k: int, accepted: np.ndarray, step_s: float, live: int,
              drafted: np.ndarray | None = None, width: int | None = None,
              pending: np.ndarray | None = None) -> TunerState:
    """One step's outcome: accepted [rows], drafted [rows] (None: every row drafted K), the positions
    its verify pass ran (None: K + 1), and the pending draft lengths `choose` was told (None: not known
    ahead; a row without a draft at a position then counts as a rejection there)."""
    if k not in self.candidates:
      raise SpecjaxError(f'K={k} is not a candidate of this tuner {self.candidates}')
    i, b = self.candidates.index(k), live_bucket(live)
    accepted = np.asarray(accepted).reshape(-1)  # [rows]
    drafted = np.full_like(accepted, k) if drafted is None else np.asarray(drafted).reshape(-1)
    width = k + 1 if width is None else int(width)
    if not 1 <= width <= k + 1:
      raise SpecjaxError(f'a depth-{k} step verifies 1..{k + 1} positions, got width {width}')
    depth = np.arange(1, k + 1)[:, None]  # [k, 1]
    reached = accepted[None, :] >= depth - 1  # [k, rows]
    if pending is not None:  # drafts known ahead: only rows with a draft at j observe a_j
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
    level, shape, shape_n = state.level.copy(), state.shape.copy(), state.shape_n.copy()
    w_i = width - 1
    if not shape_n[b].any():  # a new live bucket: normalised like the nearest bucket that ran this width
      known = [x for x in sorted(range(LIVE_BUCKETS), key=lambda x: (abs(x - b), x)) if shape_n[x, w_i]]
      shape[b, w_i] = shape[known[0], w_i] if known else 1.0
      level[b] = step_s / shape[b, w_i]
    elif not shape_n[b, w_i]:
      shape[b, w_i] = step_s / level[b]
    else:
      level[b] += self.level_alpha * (step_s / shape[b, w_i] - level[b])
      shape[b, w_i] += self.shape_alpha * (step_s / level[b] - shape[b, w_i])
    shape_n[b, w_i] += 1
    drafted_steps = state.drafted_steps.copy()
    drafted_steps[i] += bool(drafted.any())
    last_tried = state.last_tried.copy()
    last_tried[b, i] = state.step
    current = state.current if self._forced(state, live) is not None else i
    return TunerState(state.step + 1, current, accept, accept_n, batch_n, stale, level, shape, shape_n,
                      drafted_steps, last_tried)
