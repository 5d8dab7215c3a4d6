"""The policy interface and the static policies `Fixed` and `Load`.

A policy is a static description plus an explicit state (host-side, plain
Python/numpy), so the trace-replay simulator can drive it without a model:

  state = policy.init()
  state = policy.begin(state, rows)                 # a new batch of `rows` sequences starts
  k = policy.choose(state, live, pending)           # live: sequences still decoding
  state = policy.observe(state, k, accepted, step_s, live, drafted, width, pending)

`pending` holds each live sequence's draft length when the drafter drafted
ahead (`Drafter.drafts_ahead`: the host knows it before the step; else None),
`accepted` the drafts each accepted in the step, `drafted` how many it
drafted (fewer than K when an n-gram match runs short; None: K) and `width`
the positions the verify pass ran (`depths.step_depth`; None: K + 1). Every K a
policy may return is in `policy.candidates`, so each is compiled once. K = 0
(a candidate of `Load(reduced=0)` and of a tuner given 0) turns speculation
off for the step: the scheduler runs its plain decode step (width 1, no
drafts) and the policy observes it as such.
`observe` returns a new state; it never changes its input.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.errors import SpecjaxError


class Policy:
  """Chooses the draft depth K of each step from `candidates` (see the module docstring)."""

  name: str = 'policy'
  candidates: tuple[int, ...] = ()

  def init(self) -> Any:
    return ()

  def begin(self, state: Any, rows: int) -> Any:
    """A new batch of `rows` sequences starts (its text may differ from the last one's)."""
    return state

  def choose(self, state: Any, live: int, pending: np.ndarray | None = None) -> int:
    raise NotImplementedError

  def observe(
      self,
      state: Any,
      k: int,
      accepted: np.ndarray,
      step_s: float,
      live: int,
      drafted: np.ndarray | None = None,
      width: int | None = None,
      pending: np.ndarray | None = None,
  ) -> Any:
    return state


@dataclasses.dataclass(frozen=True)
class Fixed(Policy):
  """Always K."""

  k: int = 4
  name: str = 'fixed'

  def __post_init__(self):
    if self.k < 1:
      raise SpecjaxError(f'fixed policy needs K >= 1, got {self.k}')

  @property
  def candidates(self) -> tuple[int, ...]:
    return (self.k,)

  def choose(self, state, live: int, pending=None) -> int:
    return self.k


@dataclasses.dataclass(frozen=True)
class Load(Policy):
  """`full` drafts while at most `threshold` sequences are live, min(reduced, full) above (0: plain decoding)."""

  full: int = 8
  reduced: int = 3
  threshold: int = 8
  name: str = 'load'

  def __post_init__(self):
    if self.full < 1 or self.reduced < 0 or self.threshold < 1:
      raise SpecjaxError(
          f'load policy needs full >= 1, reduced >= 0 (0: speculation off) and threshold >= 1, got '
          f'full={self.full} reduced={self.reduced} threshold={self.threshold}'
      )

  @property
  def candidates(self) -> tuple[int, ...]:
    return tuple(sorted({min(self.reduced, self.full), self.full}))

  def choose(self, state, live: int, pending=None) -> int:
    return self.full if live <= self.threshold else min(self.reduced, self.full)
