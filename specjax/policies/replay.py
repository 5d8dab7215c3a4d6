"""Trace replay: run a policy over a `Trace` offline, the best fixed K and a policy's regret.

While a replay follows the recording it also replays the recorded draft
counts; off it, a row drafts up to the first NONE of its window, else K.
Replaying at depth K from position p accepts the leading ACCEPTs of the K
positions from p, emits min(accepted + 1, tokens left) tokens and moves p past
them, so replaying the recorded depths reproduces the recorded accepted
counts and tokens exactly. Biases: UNKNOWN counts as REJECT
(`censored='accept'` gives the other bound), which undercounts depths above
the recorded one; and acceptance belongs to the position, not to the draft's
depth in its step, so drafters that weaken with depth (MTP heads) replay too
well at large K.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from specjax.depths import verified_width
from specjax.errors import SpecjaxError
from specjax.policies.base import Fixed, Policy
from specjax.policies.costs import StepCosts
from specjax.policies.trace import ACCEPT, NONE, UNKNOWN, Trace


@dataclasses.dataclass
class SimResult:
  tokens: int  # emitted by decode steps (each sequence's first token, from prefill, not counted)
  seconds: float
  ks: list[int]  # K of each step
  live: list[int]  # live sequences at each step
  step_s: list[float]
  accepted: list[list[int]]  # per sequence, drafts accepted at each of its steps
  emitted: list[int]  # per sequence
  state: Any = dataclasses.field(default=None, compare=False)  # the policy's state after the last batch

  @property
  def steps(self) -> int:
    return len(self.ks)

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.seconds if self.seconds > 0 else 0.0

  @property
  def tau(self) -> float:
    """Tokens per sequence per step (the bonus / correction token counted)."""
    row_steps = sum(self.live)
    return self.tokens / row_steps if row_steps else 0.0


def _replay_step(outcomes: np.ndarray, pos: int, k: int, unknown_accepts: bool) -> tuple[int, int]:
  """(accepted, drafted) of a step at depth k from position pos."""
  window = np.full(k, UNKNOWN, np.int8)
  seen = outcomes[pos : pos + k]
  window[: len(seen)] = seen
  ok = (window == ACCEPT) | (unknown_accepts & (window == UNKNOWN))
  accepted = int(np.cumprod(ok).sum())
  return accepted, accepted if accepted < k and window[accepted] == NONE else k


def simulate(
    policy: Policy,
    trace: Trace,
    *,
    batch: int | None = None,
    cost: Callable[[int, int], float] | None = None,
    censored: str = 'reject',
    width_cost: Callable[[int, int], float] | None = None,
    state: Any = None,
) -> SimResult:
  """Replays `trace` under `policy`, no model involved.

  Sequences run in consecutive static batches of `batch` (default: all at
  once, like one `generate` call), each batch with a fresh policy state. Step
  seconds come from `cost(k, live)`, or else from the trace's recording: the
  recorded seconds while the replay follows the recording (same K and live at
  each step so far, all sequences in one batch), `StepCosts` after.
  `censored`: 'reject' or 'accept', how UNKNOWN positions replay.
  `width_cost(width, live)`, if given, prices a step by the positions its
  verify pass runs instead (variable-length drafters: a step without drafts
  costs a decode step, whatever K). For drafters that draft ahead (a
  `width_cost`, or a trace that recorded `pending` draft lengths) the policy
  is told each row's pending draft length before it chooses (the recorded
  one while on the recorded path, else the replayed draft at its deepest
  candidate) and every step's verified width. `state` continues a policy state (the
  first batch starts from it instead of a fresh one; see `SimResult.state`).
  """
  if censored not in ('reject', 'accept'):
    raise SpecjaxError(f"censored must be 'reject' or 'accept', got {censored!r}")
  n = len(trace.lengths)
  batch = n if batch is None else batch
  if batch < 1:
    raise SpecjaxError(f'batch must be at least 1, got {batch}')
  step_cost = cost or StepCosts(trace.steps)
  recorded = trace.steps if cost is None and batch >= n else []
  ahead = width_cost is not None or bool(trace.pending)  # drafts known before each step
  on_path = True
  out = SimResult(0, 0.0, [], [], [], [[] for _ in range(n)], [0] * n)
  for start in range(0, n, batch):
    rows = range(start, min(start + batch, n))
    pos = [0] * n
    state = policy.init() if state is None or start else state
    state = policy.begin(state, len(rows))
    while True:
      live_rows = [i for i in rows if pos[i] < trace.lengths[i]]
      if not live_rows:
        break
      live = len(live_rows)
      t = len(out.ks)
      on_path = on_path and t < len(recorded) and recorded[t][2] == live
      pending = None
      if on_path and trace.pending:
        pending = np.array([trace.pending[i][len(out.accepted[i])] for i in live_rows])
      elif ahead:  # drafts known ahead: the draft lengths at the deepest candidate
        deepest = max(policy.candidates)
        pending = np.array(
            [_replay_step(trace.outcomes[i], pos[i], deepest, censored == 'accept')[1] for i in live_rows]
        )
      k = policy.choose(state, live, pending)
      if k not in policy.candidates:
        raise SpecjaxError(f'policy {policy.name} chose K={k}, not among its candidates {policy.candidates}')
      replayed = [_replay_step(trace.outcomes[i], pos[i], k, censored == 'accept') for i in live_rows]
      accepted = np.array([a for a, _ in replayed])
      drafted = np.array([d for _, d in replayed])
      on_path = on_path and recorded[t][0] == k
      if on_path and trace.drafted:
        drafted = np.array([trace.drafted[i][len(out.accepted[i])] for i in live_rows])
      for i, a in zip(live_rows, accepted):
        emitted = min(int(a) + 1, trace.lengths[i] - pos[i])
        pos[i] += emitted
        out.emitted[i] += emitted
        out.accepted[i].append(int(a))
      width = verified_width(k, drafted) if ahead else None
      if width_cost is not None:
        step_s = width_cost(width, live)
      else:
        step_s = recorded[t][1] if on_path else step_cost(k, live)
      state = policy.observe(state, k, accepted, step_s, live, drafted, width, pending)
      out.ks.append(k)
      out.live.append(live)
      out.step_s.append(step_s)
  out.tokens = sum(out.emitted)
  out.seconds = float(sum(out.step_s))
  out.state = state
  return out


def oracle_best_fixed(
    trace: Trace,
    candidates: Sequence[int],
    *,
    batch: int | None = None,
    cost: Callable[[int, int], float] | None = None,
    censored: str = 'reject',
    width_cost: Callable[[int, int], float] | None = None,
) -> tuple[int, dict[int, float]]:
  """The fixed K with the most simulated tokens/s (ties: the smaller K), and tokens/s per K."""
  rates = {
      k: simulate(Fixed(k), trace, batch=batch, cost=cost, censored=censored, width_cost=width_cost).tokens_per_s
      for k in sorted(set(candidates))
  }
  return max(rates, key=lambda k: (rates[k], -k)), rates


def regret(policy_tokens_per_s: float, oracle_tokens_per_s: float) -> float:
  """Fraction of the oracle's throughput the policy loses (negative: it beat the oracle)."""
  if oracle_tokens_per_s <= 0:
    raise SpecjaxError(f'oracle throughput must be positive, got {oracle_tokens_per_s}')
  return 1.0 - policy_tokens_per_s / oracle_tokens_per_s
