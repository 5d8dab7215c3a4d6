"""Step costs: live-batch buckets, piecewise-linear interpolation and the recorded step-cost tables.

`StepCosts` (per K) and `WidthCosts` (per verified width) price the steps of a
trace replay (`simulate`) from a recording.
"""

from __future__ import annotations

from typing import Sequence

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
