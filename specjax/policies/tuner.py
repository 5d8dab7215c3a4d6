"""`Tuner`: the candidate K with the most expected tokens per second."""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.depths import verified_width
from specjax.errors import SpecjaxError
from specjax.policies.acceptance import AcceptanceEstimator, AcceptanceState
from specjax.policies.base import Policy
from specjax.policies.costs import LIVE_BUCKETS, CostModel, Costs, CostState, live_bucket, step_pricer


def _read(part: str, name: str) -> property:
  return property(lambda self: getattr(getattr(self, part), name), doc=f'`{part}.{name}`')


@dataclasses.dataclass(frozen=True)
class TunerState:
  step: int  # steps observed
  current: int  # candidate index last chosen on merit (-1: none yet)
  acceptance: AcceptanceState  # per draft position 1 .. D
  cost: CostState  # per live bucket and verified width 1 .. D + 1
  drafted_steps: np.ndarray  # [C] steps with drafts each candidate ran
  tried_steps: np.ndarray  # [C] steps each candidate ran
  last_tried: np.ndarray  # [L, C] step at which each candidate last ran (-1: never)

  accept = _read('acceptance', 'accept')
  accept_n = _read('acceptance', 'accept_n')
  batch_n = _read('acceptance', 'batch_n')
  stale = _read('acceptance', 'stale')
  level = _read('cost', 'level')
  shape = _read('cost', 'shape')
  shape_n = _read('cost', 'shape_n')


@dataclasses.dataclass(frozen=True)
class Tuner(Policy):
  """Picks the candidate K with the most expected tokens per second.

  Tokens: `AcceptanceEstimator` (`alpha`, `stale_rate`, `carry`, `prior`): an
  EMA of the conditional acceptance per draft position, conditional on the
  draft existing when the drafter drafts ahead (`choose(..., pending=)`),
  stale positions blending into the one before, a new batch (`begin`)
  weighing its own observations more; E(K) = 1 + sum_{i <= K} prod_{j <= i} a_j,
  the sum stopping at a row's pending draft length when known.

  Time: `CostModel` (`level_alpha`, `shape_alpha`): a step costs what its
  verify pass costs, by width: K + 1, or for drafts known ahead the width
  `depths.step_depth(K, max p) + 1` (a step without drafts is a decode step
  whatever K); per live bucket a cost level that every step moves times each
  width's cost relative to it. `costs` injects step costs instead of the
  measured ones: a mapping verified width -> seconds (`CostTable`: linear in
  the width between the listed ones, whatever the live batch) or a callable
  (width, live) -> seconds; `observe` then prices each step by it and ignores
  the `step_s` it is given, so the choices do not depend on the machine's
  speed (tests; the engine still records the measured times).

  Candidate 0 is speculation off: a plain decode step, E(0) = 1 at width 1, so
  under load (a verify pass costs more than its accepted tokens bring) the
  tuner turns drafting off, and probes the drafting candidates every
  `explore_every` steps to turn it back on.

  Choice: argmax E(K) / T(K, live), staying on the current K unless another is
  better by more than `margin`. Warm-up runs each candidate, deepest first,
  until it has run one step with drafts (at most `warmup_tries` steps each; 0
  one step);
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
  costs: Costs | None = None  # injected step costs in place of the measured ones (None: measured)
  name: str = 'tuner'

  def __post_init__(self):
    candidates = tuple(sorted({int(k) for k in self.candidates}))
    if not candidates or candidates[0] < 0 or candidates[-1] < 1:
      raise SpecjaxError(
          f'tuner needs candidate depths >= 0 (0: speculation off) with one >= 1, got {tuple(self.candidates)}'
      )
    object.__setattr__(self, 'candidates', candidates)
    rates = (self.alpha, self.level_alpha, self.shape_alpha)
    if not (all(0 < r <= 1 for r in rates) and 0 <= self.prior <= 1 and 0 <= self.stale_rate < 1 and self.carry >= 0):
      raise SpecjaxError(
          f'tuner needs 0 < alpha, level_alpha, shape_alpha <= 1, 0 <= stale_rate < 1, '
          f'carry >= 0 and 0 <= prior <= 1, got alpha={self.alpha} level_alpha={self.level_alpha} '
          f'shape_alpha={self.shape_alpha} stale_rate={self.stale_rate} carry={self.carry} '
          f'prior={self.prior}'
      )
    if self.explore_every < 0 or self.explore_every == 1 or self.margin < 0 or self.warmup_tries < 1:
      raise SpecjaxError(
          f'tuner needs explore_every = 0 or >= 2, margin >= 0 and warmup_tries >= 1, got '
          f'explore_every={self.explore_every} margin={self.margin} '
          f'warmup_tries={self.warmup_tries}'
      )
    object.__setattr__(self, 'costs', step_pricer(self.costs))
    d = candidates[-1]
    object.__setattr__(self, 'estimator', AcceptanceEstimator(d, self.alpha, self.stale_rate, self.carry, self.prior))
    object.__setattr__(self, 'cost_model', CostModel(d + 1, self.level_alpha, self.shape_alpha))

  def init(self) -> TunerState:
    c = len(self.candidates)
    return TunerState(
        step=0,
        current=-1,
        acceptance=self.estimator.init(),
        cost=self.cost_model.init(),
        drafted_steps=np.zeros(c, np.int64),
        tried_steps=np.zeros(c, np.int64),
        last_tried=np.full((LIVE_BUCKETS, c), -1, np.int64),
    )

  def begin(self, state: TunerState, rows: int) -> TunerState:
    return dataclasses.replace(state, acceptance=self.estimator.begin(state.acceptance))

  def acceptance(self, state: TunerState) -> np.ndarray:  # [D]
    """Conditional acceptance per draft position (`AcceptanceEstimator.acceptance`)."""
    return self.estimator.acceptance(state.acceptance)

  def expected_tokens(self, state: TunerState, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """E(K) per candidate: tokens a row emits in a step of depth K (mean over rows with `pending` drafts)."""
    return self.estimator.expected_tokens(state.acceptance, self.candidates, pending)

  def widths(self, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """Positions the verify pass of each candidate runs (`step_depth` of the longest pending draft)."""
    if pending is None or not np.size(pending):
      return np.asarray(self.candidates) + 1
    longest = int(np.max(pending))
    return np.array([verified_width(k, np.array([longest])) if k else 1 for k in self.candidates])

  def step_times(self, state: TunerState, live: int, pending: np.ndarray | None = None) -> np.ndarray:  # [C]
    """Expected seconds of a step per candidate at this live batch size."""
    return self.cost_model.step_times(state.cost, self.widths(pending), live)

  def _forced(self, state: TunerState, live: int) -> int | None:
    """The candidate index a warm-up or exploration step runs, else None."""
    off = np.asarray(self.candidates) == 0  # warm after one step: it never drafts
    warming = np.flatnonzero((state.drafted_steps == 0) & (state.tried_steps < np.where(off, 1, self.warmup_tries)))
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

  def observe(
      self,
      state: TunerState,
      k: int,
      accepted: np.ndarray,
      step_s: float,
      live: int,
      drafted: np.ndarray | None = None,
      width: int | None = None,
      pending: np.ndarray | None = None,
  ) -> TunerState:
    """One step's outcome: accepted [rows], step_s (replaced by `costs(width, live)` when costs are
    injected), drafted [rows] (None: every row drafted K), the positions its verify pass ran (None: K + 1),
    and the pending draft lengths `choose` was told (None: not known ahead; a row without a draft at a
    position then counts as a rejection there)."""
    if k not in self.candidates:
      raise SpecjaxError(f'K={k} is not a candidate of this tuner {self.candidates}')
    i = self.candidates.index(k)
    accepted = np.asarray(accepted).reshape(-1)  # [rows]
    drafted = np.full_like(accepted, k) if drafted is None else np.asarray(drafted).reshape(-1)
    width = k + 1 if width is None else int(width)
    if not 1 <= width <= k + 1:
      raise SpecjaxError(f'a depth-{k} step verifies 1..{k + 1} positions, got width {width}')
    if self.costs is not None:
      step_s = float(self.costs(width, live))
      if not step_s > 0:
        raise SpecjaxError(f'injected costs must be positive, got {step_s} for width {width} at {live} live')
    acceptance = self.estimator.observe(state.acceptance, k, accepted, drafted, ahead=pending is not None)
    cost = self.cost_model.observe(state.cost, width, step_s, live)
    drafted_steps = state.drafted_steps.copy()
    drafted_steps[i] += bool(drafted.any())
    tried_steps = state.tried_steps.copy()
    tried_steps[i] += 1
    last_tried = state.last_tried.copy()
    last_tried[live_bucket(live), i] = state.step
    current = state.current if self._forced(state, live) is not None else i
    return TunerState(state.step + 1, current, acceptance, cost, drafted_steps, tried_steps, last_tried)
