"""Draft-depth policies: choose K for the next step from a fixed candidate set.

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
the positions the verify pass ran (`step.step_depth`; None: K + 1). Every K a
policy may return is in `policy.candidates`, so each is compiled once.
`observe` returns a new state; it never changes its input.

  Fixed(k)                         always K.
  Tuner(candidates)                the K with the most expected tokens per second.
  Load(full, reduced, threshold)   `full` up to `threshold` live sequences, at most `reduced` above.

`make_policy(name, family=...)` builds one over the drafter family's
candidates (`candidates_for`). The environment variable SPECJAX_POLICY forces
a policy, whatever the caller asked for:

  SPECJAX_POLICY=fixed:4        Fixed(4); plain `fixed`: the caller's K, else the deepest candidate
  SPECJAX_POLICY=tuner          Tuner over the family's candidates
  SPECJAX_POLICY=tuner:2,4,6    Tuner over these candidates
  SPECJAX_POLICY=load           Load with the caller's K, else the deepest candidate, as full depth
  SPECJAX_POLICY=load:6         Load with full depth 6

Options the caller passed that the forced policy does not have are dropped.

Trace replay (`simulate`) compares policies offline. A `Trace` holds, per
sequence, one outcome per generated position (the tokens of decode steps):
ACCEPT, a draft there would be accepted given the earlier ones were; REJECT,
it would not (the target emits its correction there); UNKNOWN, never drafted
(the bonus token of a step that accepted every draft); NONE, the drafter had
no draft there (an n-gram match ran out). A recorded step at depth K_rec that
drafted d and accepted a drafts contributes a ACCEPTs then REJECT (a < d),
NONE (a = d < K_rec) or UNKNOWN (a = d = K_rec); the next step starts after
them. While a replay follows the recording it also replays the recorded draft
counts; off it, a row drafts up to the first NONE of its window, else K. Replaying at
depth K from position p accepts the leading ACCEPTs of the K positions from p,
emits min(accepted + 1, tokens left) tokens and moves p past them, so
replaying the recorded depths reproduces the recorded accepted counts and
tokens exactly. Biases: UNKNOWN counts as REJECT (`censored='accept'` gives the
other bound), which undercounts depths above the recorded one; and acceptance
belongs to the position, not to the draft's depth in its step, so drafters
that weaken with depth (MTP heads) replay too well at large K.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import numpy as np

from specjax.depths import verified_width
from specjax.errors import SpecjaxError

ENV = 'SPECJAX_POLICY'
POLICIES = ('fixed', 'tuner', 'load')
FAMILY_CANDIDATES = {
    'mtp': (2, 3, 4, 6),  # built-in heads
    'gemma4-assistant': (2, 3, 4, 6),  # capped by num_assistant_tokens
    'dflash': (3, 5, 7),  # capped by block_size - 1
    'ngram': (2, 4, 6, 8),
    'draft-model': (2, 4, 6, 8),
    'layer-skip': (2, 4, 6, 8),
}
LIVE_BUCKETS = 16
ACCEPT, REJECT, UNKNOWN, NONE = 1, 0, -1, -2


class Policy:
  name: str = 'policy'
  candidates: tuple[int, ...] = ()

  def init(self) -> Any:
    return ()

  def begin(self, state: Any, rows: int) -> Any:
    """A new batch of `rows` sequences starts (its text may differ from the last one's)."""
    return state

  def choose(self, state: Any, live: int, pending: np.ndarray | None = None) -> int:
    raise NotImplementedError

  def observe(self, state: Any, k: int, accepted: np.ndarray, step_s: float, live: int,
              drafted: np.ndarray | None = None, width: int | None = None,
              pending: np.ndarray | None = None) -> Any:
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

  def choose(self, state, live: int, pending=None) -> int:
    return self.k


@dataclasses.dataclass(frozen=True)
class Load(Policy):
  """`full` drafts while at most `threshold` sequences are live, min(reduced, full) above."""
  full: int = 8
  reduced: int = 3
  threshold: int = 8
  name: str = 'load'

  def __post_init__(self):
    if self.full < 1 or self.reduced < 1 or self.threshold < 1:
      raise SpecjaxError(f'load policy needs full, reduced and threshold >= 1, got '
                         f'full={self.full} reduced={self.reduced} threshold={self.threshold}')

  @property
  def candidates(self) -> tuple[int, ...]:
    return tuple(sorted({min(self.reduced, self.full), self.full}))

  def choose(self, state, live: int, pending=None) -> int:
    return self.full if live <= self.threshold else min(self.reduced, self.full)


# ---------------------------------------------------------------- tuner


def live_bucket(live: int) -> int:
  """Power-of-two buckets of the live batch: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
  return min(max(live - 1, 0).bit_length(), LIVE_BUCKETS - 1)


def _linear(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
  """Piecewise linear through (xp, fp), xp ascending; the end segments extrapolate."""
  if len(xp) == 1:
    return np.full(x.shape, float(fp[0]))
  y = np.interp(x, xp, fp)
  lo, hi = x < xp[0], x > xp[-1]
  y[lo] = fp[0] + (x[lo] - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
  y[hi] = fp[-1] + (x[hi] - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
  return y


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
  drafts known ahead the width `step.step_depth(K, max p) + 1` (a step
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
    shape = _linear(widths, measured, state.shape[ref][seen[ref]])
    shape = np.maximum(shape, 0.1 * state.shape[ref][seen[ref]].min())
    own = seen[lev] & seen[ref]
    if lev != ref and own.any():  # the reference bucket's curve, through this bucket's own points
      all_widths = np.arange(1, seen.shape[1] + 1, dtype=np.float64)
      shape *= np.mean(state.shape[lev][own] / _linear(all_widths[own], measured, state.shape[ref][seen[ref]]))
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


# ---------------------------------------------------------------- construction


def check_candidates(candidates: Sequence[int], max_depth: int) -> tuple[int, ...]:
  """Sorted unique candidates, each within the drafter's limits 1..max_depth."""
  out = tuple(sorted({int(k) for k in candidates}))
  bad = [k for k in out if not 1 <= k <= max_depth]
  if not out or bad:
    raise SpecjaxError(f'candidate depths {tuple(candidates)} are outside the drafter\'s limits 1..{max_depth}')
  return out


def candidates_for(family: str, *, block_size: int | None = None, num_assistant_tokens: int | None = None,
                   max_depth: int = 8) -> tuple[int, ...]:
  """The depths a drafter family's tuner chooses from, each capped by the family's limit.

  mtp (2, 3, 4, 6); gemma4-assistant the same, capped by num_assistant_tokens
  (6 if None); dflash (3, 5, 7) capped by min(block_size - 1, 7); ngram,
  draft-model, layer-skip (2, 4, 6, 8). All capped by max_depth; a candidate
  above the cap becomes the cap.
  """
  if family not in FAMILY_CANDIDATES:
    raise SpecjaxError(f'unknown drafter family {family!r} (known: {", ".join(FAMILY_CANDIDATES)})')
  if max_depth < 1:
    raise SpecjaxError(f'max_depth must be at least 1, got {max_depth}')
  cap = max_depth
  if family == 'dflash':
    if block_size is not None and block_size < 2:
      raise SpecjaxError(f'a DFlash block_size must be at least 2, got {block_size}')
    cap = min(cap, 7, block_size - 1 if block_size is not None else 7)
  elif family == 'gemma4-assistant':
    n = 6 if num_assistant_tokens is None else num_assistant_tokens
    if n < 1:
      raise SpecjaxError(f'num_assistant_tokens must be at least 1, got {n}')
    cap = min(cap, n)
  return tuple(sorted({min(k, cap) for k in FAMILY_CANDIDATES[family]}))


def _from_env(value: str) -> tuple[str, int | None, tuple[int, ...] | None]:
  """SPECJAX_POLICY -> (name, K, candidates)."""
  usage = f'{ENV}={value!r}: expected fixed[:K], tuner[:K1,K2,...] or load[:K]'
  name, _, arg = value.partition(':')
  name = name.strip().lower()
  if name not in POLICIES:
    raise SpecjaxError(f'{usage} (unknown policy {name!r})')
  if not arg.strip():
    return name, None, None
  try:
    depths = tuple(int(x) for x in arg.split(','))
  except ValueError:
    raise SpecjaxError(f'{usage} (depths must be integers)') from None
  if name == 'tuner':
    return name, None, depths
  if len(depths) != 1:
    raise SpecjaxError(f'{usage} ({name} takes one depth)')
  return name, depths[0], None


def make_policy(name: str, *, family: str, candidates: Sequence[int] | None = None, k: int | None = None,
                max_depth: int = 8, block_size: int | None = None, num_assistant_tokens: int | None = None,
                **kw) -> Policy:
  """Builds 'fixed' (depth k), 'tuner' or 'load' (full depth k) for a drafter family.

  Candidates default to `candidates_for(family, ...)`; k defaults to the
  deepest candidate. `kw` are the policy's options (tuner: alpha, level_alpha, shape_alpha,
  explore_every, margin, prior; load: reduced, threshold). SPECJAX_POLICY, when
  set, overrides name (and k / candidates when it gives them).
  """
  forced = os.environ.get(ENV, '').strip()
  if forced:
    name, env_k, env_candidates = _from_env(forced)
    k = env_k if env_k is not None else k
    candidates = env_candidates if env_candidates is not None else candidates
  if name not in POLICIES:
    raise SpecjaxError(f'unknown policy {name!r} (choose from {", ".join(POLICIES)})')
  cls = {'fixed': Fixed, 'tuner': Tuner, 'load': Load}[name]
  options = {f.name for f in dataclasses.fields(cls)} - {'name', 'k', 'full', 'candidates'}
  if forced:
    kw = {key: v for key, v in kw.items() if key in options}
  unknown = sorted(set(kw) - options)
  if unknown:
    raise SpecjaxError(f'policy {name!r} has no option {", ".join(unknown)} (options: {", ".join(sorted(options))})')

  def depths() -> tuple[int, ...]:
    if candidates is not None:
      return check_candidates(candidates, max_depth)
    return candidates_for(family, block_size=block_size, num_assistant_tokens=num_assistant_tokens,
                          max_depth=max_depth)

  if name == 'tuner':
    return Tuner(depths(), **kw)
  if k is None:
    k = depths()[-1]
  check_candidates([k], max_depth)
  return Fixed(k) if name == 'fixed' else Load(full=k, **kw)


# ---------------------------------------------------------------- trace replay


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
  return Trace(outcomes, lengths, list(stats.steps), [list(r.spec.drafted_per_step) for r in results],
               pending if any(pending) else [])


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
    t = _linear(np.array([k], np.float64), np.asarray(self.ks, np.float64), np.asarray(at_live))[0]
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
  seen = outcomes[pos:pos + k]
  window[:len(seen)] = seen
  ok = (window == ACCEPT) | (unknown_accepts & (window == UNKNOWN))
  accepted = int(np.cumprod(ok).sum())
  return accepted, accepted if accepted < k and window[accepted] == NONE else k


def simulate(policy: Policy, trace: Trace, *, batch: int | None = None,
             cost: Callable[[int, int], float] | None = None, censored: str = 'reject',
             width_cost: Callable[[int, int], float] | None = None, state: Any = None) -> SimResult:
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
        pending = np.array([_replay_step(trace.outcomes[i], pos[i], deepest, censored == 'accept')[1]
                            for i in live_rows])
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


def oracle_best_fixed(trace: Trace, candidates: Sequence[int], *, batch: int | None = None,
                      cost: Callable[[int, int], float] | None = None, censored: str = 'reject',
                      width_cost: Callable[[int, int], float] | None = None) -> tuple[int, dict[int, float]]:
  """The fixed K with the most simulated tokens/s (ties: the smaller K), and tokens/s per K."""
  rates = {k: simulate(Fixed(k), trace, batch=batch, cost=cost, censored=censored,
                       width_cost=width_cost).tokens_per_s for k in sorted(set(candidates))}
  return max(rates, key=lambda k: (rates[k], -k)), rates


def regret(policy_tokens_per_s: float, oracle_tokens_per_s: float) -> float:
  """Fraction of the oracle's throughput the policy loses (negative: it beat the oracle)."""
  if oracle_tokens_per_s <= 0:
    raise SpecjaxError(f'oracle throughput must be positive, got {oracle_tokens_per_s}')
  return 1.0 - policy_tokens_per_s / oracle_tokens_per_s
