"""Draft-depth policies: choose K for the next step from a fixed candidate set.

A policy is a static description plus an explicit state (host-side, plain
Python/numpy), so the trace-replay simulator can drive it without a model:

  state = policy.init()
  k = policy.choose(state, live)                    # live: sequences still decoding
  state = policy.observe(state, k, accepted, step_s, live)

`accepted` holds the drafts each live sequence accepted in the step. Every K a
policy may return is in `policy.candidates`, so each is compiled once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.errors import SpecjaxError


class Policy:
  name: str = 'policy'
  candidates: tuple[int, ...] = ()

  def init(self) -> Any:
    return ()

  def choose(self, state: Any, live: int) -> int:
    raise NotImplementedError

  def observe(self, state: Any, k: int, accepted: np.ndarray, step_s: float, live: int) -> Any:
    return state


@dataclasses.dataclass(frozen=True)
class Fixed(Policy):
  k: int = 4
  name: str = 'fixed'

  def __post_init__(self):
    if self.k < 1:
      raise SpecjaxError(f'fixed policy needs K >= 1, got {self.k}')

  @property
  def candidates(self) -> tuple[int, ...]:
    return (self.k,)

  def choose(self, state, live: int) -> int:
    return self.k
