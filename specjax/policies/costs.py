"""Step costs: the tuner's cost model and the recorded step-cost tables.

`CostModel` learns, online, what a step costs by the width its verify pass
runs and the live batch; `CostTable` is a fixed price per width that can
stand in for the measured times (`Tuner(costs=...)`). `StepCosts` (per K) and
`WidthCosts` (per verified width) price the steps of a trace replay
(`simulate`) from a recording.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from specjax.errors import SpecjaxError

LIVE_BUCKETS = 16


def live_bucket(live: int) -> int:
  """Power-of-two buckets of the live batch: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
  return min(max(live - 1, 0).bit_length(), LIVE_BUCKETS - 1)


def linear(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
  """Piecewise linear through (xp, fp), xp ascending; the end segments extrapolate."""
  if len(xp) == 1:
    return np.full(x.shape, float(fp[0]))
  y = np.interp(x, xp, fp)
  lo, hi = x < xp[0], x > xp[-1]
  y[lo] = fp[0] + (x[lo] - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
  y[hi] = fp[-1] + (x[hi] - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
  return y


def _nearest(bucket: int) -> list[int]:
  """Live buckets by distance from `bucket` (ties: the smaller)."""
  return sorted(range(LIVE_BUCKETS), key=lambda x: (abs(x - bucket), x))


@dataclasses.dataclass(frozen=True)
class CostState:
  level: np.ndarray  # [L] EMA of the cost level per live bucket (seconds), moved by every step
  shape: np.ndarray  # [L, W] step seconds / level per verified width 1 .. W
  shape_n: np.ndarray  # [L, W] steps measured


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Step seconds by verified width and live batch, learned from the steps run.

  Per live bucket (powers of two, `live_bucket`), a cost level that every step
  moves (`level_alpha`: the context grows, prompts change) and each width's
  cost relative to it (`shape_alpha`), so a width not run for a while follows
  the level instead of keeping a stale time. A width never measured is linear
  in the width through the measured ones (with fewer than two in a bucket, the
  nearest bucket's shape); before any step, the cost is the width itself.
  """

  max_width: int  # W, the widest verify pass priced
  level_alpha: float = 0.3
  shape_alpha: float = 0.1

  def init(self) -> CostState:
    w = self.max_width
    return CostState(
        level=np.zeros(LIVE_BUCKETS), shape=np.zeros((LIVE_BUCKETS, w)), shape_n=np.zeros((LIVE_BUCKETS, w), np.int64)
    )

  def step_times(self, state: CostState, widths: np.ndarray, live: int) -> np.ndarray:  # [len(widths)]
    """Expected seconds of a step of each verified width at this live batch size."""
    widths = np.asarray(widths).astype(np.float64)
    seen = state.shape_n > 0  # [L, W]
    if not seen.any():
      return widths  # nothing measured yet: cost grows with the verified block
    near = _nearest(live_bucket(live))
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

  def observe(self, state: CostState, width: int, seconds: float, live: int) -> CostState:
    """A step of this verified width took `seconds` with `live` sequences."""
    b, w_i = live_bucket(live), width - 1
    level, shape, shape_n = state.level.copy(), state.shape.copy(), state.shape_n.copy()
    if not shape_n[b].any():  # a new live bucket: normalised like the nearest bucket that ran this width
      known = [x for x in _nearest(b) if shape_n[x, w_i]]
      shape[b, w_i] = shape[known[0], w_i] if known else 1.0
      level[b] = seconds / shape[b, w_i]
    elif not shape_n[b, w_i]:
      shape[b, w_i] = seconds / level[b]
    else:
      level[b] += self.level_alpha * (seconds / shape[b, w_i] - level[b])
      shape[b, w_i] += self.shape_alpha * (seconds / level[b] - shape[b, w_i])
    shape_n[b, w_i] += 1
    return CostState(level, shape, shape_n)


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Seconds of a step by verified width, whatever the live batch; callable as (width, live) -> seconds.

  Between the listed widths linear in the width, past them the end segments
  extrapolated (one width: the same seconds for all), never below a tenth of
  the cheapest listed step.
  """

  seconds: tuple[tuple[int, float], ...]  # (width, seconds), widths ascending

  def __post_init__(self):
    table = tuple(sorted((int(w), float(s)) for w, s in self.seconds))
    if not table or any(w < 1 or s <= 0 for w, s in table) or len({w for w, _ in table}) < len(table):
      raise SpecjaxError(f'a cost table needs distinct widths >= 1 with seconds > 0, got {dict(self.seconds)}')
    object.__setattr__(self, 'seconds', table)

  def __call__(self, width: int, live: int) -> float:
    widths, seconds = (np.asarray(x, np.float64) for x in zip(*self.seconds))
    return float(max(linear(np.array([width], np.float64), widths, seconds)[0], 0.1 * seconds.min()))


Costs = Mapping[int, float] | Callable[[int, int], float]  # width -> seconds, or (width, live) -> seconds


def step_pricer(costs: Costs | None) -> Callable[[int, int], float] | None:
  """`costs` as (width, live) -> seconds: a mapping width -> seconds becomes a `CostTable`; None stays None."""
  if costs is None or callable(costs):
    return costs
  if isinstance(costs, Mapping):
    return CostTable(tuple(costs.items()))
  raise SpecjaxError(
      f'costs must be a mapping width -> seconds or a callable (width, live) -> seconds, got {type(costs).__name__}'
  )


class StepCosts:
  """Step seconds from recorded (K, seconds, live): the mean per (K, live).

  Elsewhere: per recorded K linear in live between recorded lives (constant
  past them), then linear in K between recorded Ks (extrapolated from the end
  segments).
  """

  def __init__(self, steps: Sequence[tuple[int, float, int]]):
    sums: dict[tuple[int, int], list[float]] = {}
    for k, s, live in steps:
      sums.setdefault((int(k), int(live)), []).append(float(s))
    self.table = {key: float(np.mean(v)) for key, v in sums.items()}
    self.ks = sorted({k for k, _ in self.table})

  def __call__(self, k: int, live: int) -> float:
    if (k, live) in self.table:
      return self.table[k, live]
    if not self.table:
      raise SpecjaxError('the trace has no recorded step times; pass cost=(k, live) -> seconds')
    at_live = []
    for kk in self.ks:
      lives = sorted(l for kj, l in self.table if kj == kk)
      at_live.append(np.interp(live, lives, [self.table[kk, l] for l in lives]))
    if k in self.ks:
      return float(at_live[self.ks.index(k)])
    if len(self.ks) < 2:
      raise SpecjaxError(f'the trace records step times for K={self.ks[0]} only; pass cost= to simulate K={k}')
    t = linear(np.array([k], np.float64), np.asarray(self.ks, np.float64), np.asarray(at_live))[0]
    return float(max(t, 0.1 * min(at_live)))


class WidthCosts:
  """Step seconds by verified width from recorded (width, seconds, live): the median per (width, live).

  Elsewhere: linear in the width between recorded widths at the nearest recorded
  live (constant past the ends), scaled by live / that live beyond it.
  """

  def __init__(self, steps: Sequence[tuple[int, float, int]]):
    groups: dict[tuple[int, int], list[float]] = {}
    for width, seconds, live in steps:
      groups.setdefault((int(width), int(live)), []).append(float(seconds))
    if not groups:
      raise SpecjaxError('no recorded steps to price widths from')
    self.table = {key: float(np.median(v)) for key, v in groups.items()}
    self.lives = sorted({live for _, live in self.table})

  def __call__(self, width: int, live: int) -> float:
    if (width, live) in self.table:
      return self.table[width, live]
    near = min(self.lives, key=lambda x: (abs(x - live), x))
    widths = sorted(w for w, l in self.table if l == near)
    t = float(np.interp(width, widths, [self.table[w, near] for w in widths]))
    return t * (live / near if live > near else 1.0)
