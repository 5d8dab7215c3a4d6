"""Per-request and aggregate speculative metrics.

tau (mean acceptance length) = emitted tokens / target steps, counting the
bonus / correction token (1.0 for plain decoding). Acceptance rate = accepted /
drafted. Per draft position i: unconditional acceptance = P(draft i accepted)
per step; conditional = P(draft i accepted | draft i - 1 accepted). For draft
trees "drafted" counts depths (the positions a path can reach) and
`tree_nodes` the nodes verified per step; `accepted_path` is the mean accepted
depth (accepted drafts per step, for chains too).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpecMetrics:
  k: int = 0
  target_steps: int = 0
  drafted: int = 0
  accepted: int = 0
  emitted: int = 0
  accepted_at: np.ndarray = None  # [K] steps whose draft i was accepted
  drafted_at: np.ndarray = None  # [K] steps that had a valid draft i
  accepted_per_step: list[int] = dataclasses.field(default_factory=list)
  drafted_per_step: list[int] = dataclasses.field(default_factory=list)
  pending_per_step: list[int] = dataclasses.field(default_factory=list)  # drafts known ahead, before each step
  nodes: int = 0  # tokens the target verified besides the last one (drafts; tree nodes for trees)
  draft_s: float = 0.0
  verify_s: float = 0.0
  total_s: float = 0.0
  forced_drafted: int = 0  # grammar-forced drafts verified (`grammar+<family>`)
  forced_accepted: int = 0  # of which accepted

  def __post_init__(self):
    if self.accepted_at is None:
      self.accepted_at = np.zeros(self.k, np.int64)
      self.drafted_at = np.zeros(self.k, np.int64)

  def record(
      self, accepted: int, drafted: int, emitted: int, pending: int | None = None, nodes: int | None = None
  ) -> None:
    """One step: accepted drafts, drafted depth, emitted tokens, drafts known ahead, tree nodes (trees)."""
    self.target_steps += 1
    self.nodes += drafted if nodes is None else nodes
    self.accepted += accepted
    self.drafted += drafted
    self.emitted += emitted
    self.accepted_at[:accepted] += 1
    self.drafted_at[:drafted] += 1
    self.accepted_per_step.append(accepted)
    self.drafted_per_step.append(drafted)
    if pending is not None:
      self.pending_per_step.append(pending)

  def merge(self, other: SpecMetrics) -> SpecMetrics:
    out = SpecMetrics(k=max(self.k, other.k))
    for m in (self, other):
      out.target_steps += m.target_steps
      out.drafted += m.drafted
      out.accepted += m.accepted
      out.emitted += m.emitted
      out.nodes += m.nodes
      out.accepted_at[: m.k] += m.accepted_at
      out.drafted_at[: m.k] += m.drafted_at
      out.accepted_per_step += m.accepted_per_step
      out.drafted_per_step += m.drafted_per_step
      out.pending_per_step += m.pending_per_step
      out.draft_s += m.draft_s
      out.verify_s += m.verify_s
      out.total_s += m.total_s
      out.forced_drafted += m.forced_drafted
      out.forced_accepted += m.forced_accepted
    return out

  @property
  def tau(self) -> float:
    return self.emitted / self.target_steps if self.target_steps else 0.0

  @property
  def acceptance_rate(self) -> float:
    return self.accepted / self.drafted if self.drafted else 0.0

  @property
  def position_acceptance(self) -> list[float]:
    """Unconditional: P(draft i accepted) per step."""
    n = max(self.target_steps, 1)
    return [float(a) / n for a in self.accepted_at]

  @property
  def conditional_acceptance(self) -> list[float]:
    """P(draft i accepted | drafts before it accepted and draft i exists)."""
    reached = np.concatenate([[self.target_steps], self.accepted_at[:-1]]) if self.k else np.zeros(0)
    reached = np.minimum(reached, self.drafted_at)
    return [float(a) / r if r else 0.0 for a, r in zip(self.accepted_at, reached)]

  def to_json(self) -> dict:
    return {
        'k': self.k,
        'target_steps': self.target_steps,
        'drafted': self.drafted,
        'accepted': self.accepted,
        'emitted': self.emitted,
        'tau': self.tau,
        'acceptance_rate': self.acceptance_rate,
        'tree_nodes': self.nodes / self.target_steps if self.target_steps else 0.0,
        'accepted_path': self.accepted / self.target_steps if self.target_steps else 0.0,
        'position_acceptance': self.position_acceptance,
        'conditional_acceptance': self.conditional_acceptance,
        'draft_s': self.draft_s,
        'verify_s': self.verify_s,
        'total_s': self.total_s,
        'forced_drafted': self.forced_drafted,
        'forced_accepted': self.forced_accepted,
    }
