"""Acceptance traces: what each draft position of a recorded or synthetic run would do.

A `Trace` holds, per sequence, one outcome per generated position (the tokens
of decode steps): ACCEPT, a draft there would be accepted given the earlier
ones were; REJECT, it would not (the target emits its correction there);
UNKNOWN, never drafted (the bonus token of a step that accepted every draft);
NONE, the drafter had no draft there (an n-gram match ran out). A recorded
step at depth K_rec that drafted d and accepted a drafts contributes a ACCEPTs
then REJECT (a < d), NONE (a = d < K_rec) or UNKNOWN (a = d = K_rec); the next
step starts after them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from specjax.errors import SpecjaxError

ACCEPT, REJECT, UNKNOWN, NONE = 1, 0, -1, -2


@dataclasses.dataclass
class Trace:
  """Per-position acceptance outcomes of a set of sequences (see the module docstring)."""

  outcomes: list[np.ndarray]  # per sequence [P] int8: ACCEPT / REJECT / UNKNOWN / NONE; past the end: UNKNOWN
  lengths: list[int]  # tokens each sequence emits in decode steps
  steps: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)  # recorded (K, seconds, live)
  drafted: list[list[int]] = dataclasses.field(default_factory=list)  # recorded drafts per sequence and step
  pending: list[list[int]] = dataclasses.field(default_factory=list)  # recorded drafts known ahead, likewise

  def __post_init__(self):
    if len(self.outcomes) != len(self.lengths):
      raise SpecjaxError(f'trace has {len(self.outcomes)} outcome rows for {len(self.lengths)} lengths')
    if any(n < 0 for n in self.lengths):
      raise SpecjaxError('trace lengths must be >= 0')
    self.outcomes = [np.asarray(o, np.int8) for o in self.outcomes]


def bernoulli_trace(p, *, rows: int, length: int, seed: int = 0) -> Trace:
  """A synthetic trace: each position ACCEPT with probability p (a float or [length] per position)."""
  p = np.broadcast_to(np.asarray(p, np.float64), (length,))
  draws = np.random.default_rng(seed).random((rows, length)) < p[None, :]
  return Trace([row.astype(np.int8) for row in draws], [length] * rows)


def trace_from_stats(results: Sequence[Any], stats: Any) -> Trace:
  """The trace of one speculative `Engine.generate` call (results, stats)."""
  ks = [k for k, _, _ in stats.steps]
  if any(k < 1 for k in ks):
    raise SpecjaxError('the recording has autoregressive steps (K = 0); record with a drafter and K >= 1')
  outcomes, lengths = [], []
  for i, r in enumerate(results):
    if r.spec is None:
      raise SpecjaxError(f'result {i} has no speculative metrics; record with a drafter')
    accepted, drafted = r.spec.accepted_per_step, r.spec.drafted_per_step
    if len(accepted) > len(ks):
      raise SpecjaxError(f'result {i} has {len(accepted)} steps, the stats {len(ks)}: not from one generate call')
    row = []
    for a, d, k in zip(accepted, drafted, ks):
      row += [ACCEPT] * a + [REJECT if a < d else NONE if d < k else UNKNOWN]
    length = max(len(r.tokens) - 1, 0)  # the first token comes from prefill
    if accepted and not len(row) - accepted[-1] - 1 < length <= len(row):
      raise SpecjaxError(f'result {i}: {length} decode tokens do not match its accepted counts')
    outcomes.append(np.asarray(row, np.int8))
    lengths.append(length)
  pending = [list(r.spec.pending_per_step) for r in results]
  return Trace(
      outcomes,
      lengths,
      list(stats.steps),
      [list(r.spec.drafted_per_step) for r in results],
      pending if any(pending) else [],
  )
