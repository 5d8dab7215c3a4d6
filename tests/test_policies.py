"""Draft-depth policies: fixed, load, tuner, the env override and the trace-replay simulator."""

import collections
import copy
import dataclasses

import numpy as np
import pytest

from specjax import SpecjaxError
from specjax.drafters import NgramDrafter
from specjax.policies import (
    ACCEPT,
    ENV,
    NONE,
    REJECT,
    UNKNOWN,
    CostTable,
    Fixed,
    Load,
    StepCosts,
    Trace,
    Tuner,
    bernoulli_trace,
    candidates_for,
    make_policy,
    oracle_best_fixed,
    regret,
    simulate,
    trace_from_stats,
)

CHEAP_VERIFY = lambda k, live: 1e-3 * (1 + 0.05 * k)  # a deeper block costs little more
# Step costs injected into tuners run through a real engine, in place of the machine's wall times.
STEEP_WIDTHS = {1: 1e-3, 9: 20e-3}  # width 9 costs 20 decode steps: K = 2 is best at any acceptance
CPU_WIDTHS = {1: 1e-3, 9: 2.3e-3}  # width 9 ~2.3x a decode step, as on the CPU


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)


def mode(ks):
  return collections.Counter(ks).most_common(1)[0][0]


# ---------------------------------------------------------------- candidates and construction


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  block_size: int = 16


@pytest.fixture
def block_family(monkeypatch):
  """A registered family whose deepest K depends on its options (block_size - 1, at most 7), as DFlash's will."""
  from specjax.drafters.registry import REGISTRY, DrafterFamily

  family = DrafterFamily(
      name='blocky', options=BlockOptions, build=None, depths=(3, 5, 7), max_depth=lambda o: min(o.block_size - 1, 7)
  )
  monkeypatch.setitem(REGISTRY, 'blocky', family)
  return family


def test_candidates_per_family_and_caps(block_family):
  assert candidates_for('mtp') == (2, 3, 4, 6)
  for family in ('ngram', 'draft-model', 'layer-skip'):
    assert candidates_for(family) == (2, 4, 6, 8)
  assert candidates_for('ngram', max_depth=5) == (2, 4, 5)
  assert candidates_for('mtp', max_depth=3) == (2, 3)
  assert candidates_for('blocky') == (3, 5, 7)  # min(15, 7)
  assert candidates_for('blocky', BlockOptions(6)) == (3, 5)
  assert candidates_for('blocky', BlockOptions(5)) == (3, 4)  # the cap itself is a candidate
  assert candidates_for('blocky', BlockOptions(3)) == (2,)
  assert make_policy('tuner', family='blocky', options=BlockOptions(6)).candidates == (3, 5)
  assert make_policy('load', family='blocky', options=BlockOptions(5)) == Load(full=4)


@pytest.mark.parametrize(
    'call, match',
    [
        (lambda: candidates_for('eagle9'), 'unknown drafter family'),
        (lambda: candidates_for('ngram', max_depth=0), 'max_depth'),
        (lambda: make_policy('tuner', family='ngram', candidates=(2, 9)), 'outside the drafter'),
        (lambda: make_policy('tuner', family='ngram', candidates=(0,)), 'speculation off'),
        (lambda: make_policy('tuner', family='ngram', candidates=(-1, 2)), 'outside the drafter'),
        (lambda: make_policy('fixed', family='ngram', candidates=(0, 2)), 'outside the drafter'),
        (lambda: make_policy('tuner', family='ngram', candidates=()), 'outside the drafter'),
        (lambda: make_policy('fixed', family='ngram', k=5, max_depth=4), 'outside the drafter'),
        (lambda: make_policy('load', family='mtp', k=0), 'outside the drafter'),
        (lambda: make_policy('bandit', family='ngram'), 'unknown policy'),
        (lambda: make_policy('tuner', family='ngram', threshold=4), 'no option threshold'),
        (lambda: Tuner(()), 'candidate'),
        (lambda: Tuner((2, 4), explore_every=1), 'explore_every'),
        (lambda: Tuner((2, 4), alpha=0.0), 'alpha'),
        (lambda: Fixed(0), 'K >= 1'),
        (lambda: Load(full=4, reduced=-1), 'reduced'),
        (lambda: Tuner((0,)), 'one >= 1'),
    ],
)
def test_bad_input_raises(call, match):
  with pytest.raises(SpecjaxError, match=match):
    call()


def test_make_policy_defaults():
  assert make_policy('fixed', family='ngram') == Fixed(8)
  assert make_policy('fixed', family='mtp', k=3) == Fixed(3)
  assert make_policy('tuner', family='ngram', candidates=(6, 2, 2)).candidates == (2, 6)
  tuner = make_policy('tuner', family='mtp', explore_every=8, alpha=0.2)
  assert (tuner.candidates, tuner.explore_every, tuner.alpha) == ((2, 3, 4, 6), 8, 0.2)
  assert make_policy('load', family='ngram', k=6, threshold=4) == Load(full=6, threshold=4)


def test_env_override_forces_a_policy(monkeypatch):
  monkeypatch.setenv(ENV, 'fixed:4')
  assert make_policy('tuner', family='ngram', explore_every=8) == Fixed(4)  # tuner options dropped
  monkeypatch.setenv(ENV, 'fixed')
  assert make_policy('tuner', family='mtp') == Fixed(6)
  assert make_policy('load', family='mtp', k=3) == Fixed(3)
  monkeypatch.setenv(ENV, 'tuner')
  assert make_policy('fixed', family='mtp', k=4).candidates == (2, 3, 4, 6)
  monkeypatch.setenv(ENV, 'tuner:5,2')
  assert make_policy('fixed', family='ngram').candidates == (2, 5)
  monkeypatch.setenv(ENV, 'load')
  assert make_policy('fixed', family='mtp') == Load(full=6)
  monkeypatch.setenv(ENV, 'LOAD:6')
  assert make_policy('tuner', family='ngram', threshold=2) == Load(full=6, threshold=2)
  for bad in ('greedy', 'fixed:x', 'fixed:2,4', 'load:1,2'):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(SpecjaxError, match=ENV):
      make_policy('tuner', family='ngram')
  monkeypatch.setenv(ENV, 'fixed:12')
  with pytest.raises(SpecjaxError, match='outside the drafter'):
    make_policy('tuner', family='ngram')


# ---------------------------------------------------------------- fixed and load


def test_fixed_and_load_rules():
  assert Fixed(5).candidates == (5,) and Fixed(5).choose((), 100) == 5
  load = Load(full=7)
  assert load.candidates == (3, 7)
  assert [load.choose(load.init(), live) for live in (1, 8, 9, 64)] == [7, 7, 3, 3]
  small = Load(full=2)
  assert small.candidates == (2,) and small.choose((), 50) == 2
  custom = Load(full=6, reduced=1, threshold=2)
  assert [custom.choose((), live) for live in (2, 3)] == [6, 1]
  # In replay the load rule follows the live batch as sequences finish.
  trace = bernoulli_trace(0.7, rows=12, length=40, seed=0)
  trace.lengths = [10 * (i + 1) for i in range(12)]
  sim = simulate(load, trace, cost=CHEAP_VERIFY)
  assert all(k == (7 if live <= 8 else 3) for k, live in zip(sim.ks, sim.live))
  assert {3, 7} <= set(sim.ks)


def test_speculation_off_as_a_depth():
  """K = 0 (a plain decode step) is a candidate of `Load(reduced=0)` and of a tuner given 0: E(0) = 1 at width 1."""
  load = Load(full=4, reduced=0, threshold=2)
  assert load.candidates == (0, 4) and [load.choose((), live) for live in (1, 2, 3)] == [4, 4, 0]
  tuner = Tuner((0, 2, 4), explore_every=0, costs={1: 1e-3, 5: 40e-3})
  state = tuner.init()
  assert tuner.widths().tolist() == [1, 3, 5] and tuner.widths(np.array([3])).tolist() == [1, 3, 4]
  ks = []
  for _ in range(12):  # drafts accepted half the time; a verify pass costs ~20 decode steps at width 3
    k = tuner.choose(state, 1)
    ks.append(k)
    accepted, drafted = np.array([k // 2]), np.array([k])
    state = tuner.observe(state, k, accepted, 1.0, 1, drafted, k + 1)
  assert ks[:3] == [4, 2, 0] and set(ks[3:]) == {0}, ks  # warm-up deepest first (0 once), then off
  assert tuner.expected_tokens(state)[0] == 1.0 and state.current == 0
  with pytest.raises(SpecjaxError, match='verifies 1..1'):
    tuner.observe(state, 0, np.array([0]), 1.0, 1, np.array([0]), 2)


# ---------------------------------------------------------------- tuner


def test_tuner_estimates_from_observed_positions():
  tuner = Tuner((2, 4))
  state = tuner.observe(tuner.init(), 2, np.array([0, 1, 2, 2]), 1e-3, 4)
  # Position 1 reached by 4 rows, accepted by 3; position 2 reached by 3, accepted by 2.
  np.testing.assert_allclose(tuner.acceptance(state), [3 / 4, 2 / 3, 2 / 3, 2 / 3])
  a1, a2 = 3 / 4, 2 / 3
  want = [1 + a1 + a1 * a2, 1 + a1 + a1 * a2 + a1 * a2**2 + a1 * a2**3]
  np.testing.assert_allclose(tuner.expected_tokens(state), want)
  # Later observations move the estimate by the weight of each reaching row: 1 / (carry + n) for the n-th
  # of the batch, never less than alpha.
  state = tuner.observe(state, 4, np.array([0]), 1e-3, 1)
  w = 1 / (tuner.carry + 5)
  np.testing.assert_allclose(tuner.acceptance(state)[0], a1 + w * (0 - a1))
  for _ in range(20):
    state = tuner.observe(state, 4, np.array([4]), 1e-3, 1)
  a = tuner.acceptance(state)[0]
  state = tuner.observe(state, 4, np.array([0]), 1e-3, 1)
  np.testing.assert_allclose(tuner.acceptance(state)[0], a + tuner.alpha * (0 - a))


def test_tuner_step_times_follow_the_level_and_live():
  tuner = Tuner((2, 4, 6, 8))
  state = tuner.init()
  state = tuner.observe(state, 2, np.array([0]), 1.2, 1)
  state = tuner.observe(state, 4, np.array([0]), 1.4, 1)
  np.testing.assert_allclose(tuner.step_times(state, 1), [1.2, 1.4, 1.6, 1.8])  # linear in K between
  np.testing.assert_allclose(tuner.step_times(state, 16), [1.2, 1.4, 1.6, 1.8])  # no data there: borrowed
  state = tuner.observe(state, 4, np.zeros(16, int), 2.8, 16)
  np.testing.assert_allclose(tuner.step_times(state, 16), [2.4, 2.8, 3.2, 3.6])  # the shape, scaled
  np.testing.assert_allclose(tuner.step_times(state, 1), [1.2, 1.4, 1.6, 1.8])
  # Longer contexts: K = 4 steps get slower, and K = 2 (not run) follows the level instead of staying stale.
  for _ in range(20):
    state = tuner.observe(state, 4, np.array([0]), 2.1, 1)
  times = tuner.step_times(state, 1)
  assert times[1] == pytest.approx(2.1, rel=0.05) and times[0] > 1.2 * 1.3


def test_tuner_prices_steps_by_verified_width():
  """Drafts known ahead: a step costs what its verify width costs, and E(K) stops at the pending drafts."""
  tuner = Tuner((2, 4, 6, 8))
  state = tuner.init()
  for k, drafted, width, seconds in [(8, 0, 1, 1.0), (8, 8, 9, 2.6), (4, 4, 5, 1.8), (2, 0, 1, 1.0)]:
    state = tuner.observe(state, k, np.array([0]), seconds, 1, np.array([drafted]), width)
  np.testing.assert_allclose(tuner.step_times(state, 1), [1.4, 1.8, 2.2, 2.6])  # widths 3, 5, 7, 9: linear
  np.testing.assert_allclose(tuner.step_times(state, 1, np.array([0])), [1.0] * 4)  # no drafts: decode steps
  # A 3-token draft: K = 2 verifies its 3 positions, K >= 4 the 4 of their widths (1, 2, 4, ...) that cover it.
  np.testing.assert_array_equal(tuner.widths(np.array([3])), [3, 4, 4, 4])
  full, capped = tuner.expected_tokens(state), tuner.expected_tokens(state, np.array([3, 1]))
  gain = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(tuner.acceptance(state)))])
  np.testing.assert_allclose(full, gain[[2, 4, 6, 8]])
  np.testing.assert_allclose(capped, [(gain[2] + gain[1]) / 2] + [(gain[3] + gain[1]) / 2] * 3)
  with pytest.raises(SpecjaxError, match='width'):
    tuner.observe(state, 2, np.array([0]), 1.0, 1, np.array([2]), 4)


def test_tuner_takes_injected_costs():
  """`costs=` replaces the measured step seconds: the choices no longer depend on the machine's speed."""
  table = CostTable(((1, 1.0), (3, 2.0)))
  assert [table(w, live) for w, live in [(1, 1), (2, 8), (3, 1), (5, 1)]] == [1.0, 1.5, 2.0, 3.0]  # linear in width
  assert CostTable(((4, 2.0),))(9, 1) == 2.0 and CostTable(((1, 2.0), (3, 1.0)))(9, 1) == pytest.approx(0.1)
  tuner = Tuner((2, 4), costs={3: 2.0, 1: 1.0})
  assert tuner.costs == table and hash(tuner) == hash(Tuner((2, 4), costs={1: 1.0, 3: 2.0}))
  state = tuner.init()
  for k, seconds in [(2, 123.0), (4, 1e-9), (4, 7.0)]:  # whatever the wall time
    state = tuner.observe(state, k, np.array([0]), seconds, 1)
  np.testing.assert_allclose(tuner.step_times(state, 1), [2.0, 3.0])  # widths 3 and 5
  by_live = Tuner((2, 4), costs=lambda width, live: width * live)  # a callable sees the live batch too
  state = by_live.observe(by_live.observe(by_live.init(), 2, np.zeros(4, int), 0.5, 4), 4, np.zeros(4, int), 0.5, 4)
  np.testing.assert_allclose(by_live.step_times(state, 4), [12.0, 20.0])
  # The same trace and costs choose the same depths whatever the recorded times.
  trace = bernoulli_trace(0.8, rows=2, length=200, seed=7)
  runs = [
      simulate(Tuner((2, 4, 8), costs={1: 1.0, 9: 2.5}), trace, cost=cost).ks
      for cost in (CHEAP_VERIFY, lambda k, live: 10.0 * k)
  ]
  assert runs[0] == runs[1]
  assert make_policy('tuner', family='ngram', costs={1: 1.0}).costs == CostTable(((1, 1.0),))
  for bad, match in [({}, 'cost table'), ({0: 1.0}, 'cost table'), ({1: 0.0}, 'cost table'), ([1.0], 'costs must')]:
    with pytest.raises(SpecjaxError, match=match):
      Tuner((2, 4), costs=bad)
  with pytest.raises(SpecjaxError, match='positive'):
    Tuner((2,), costs=lambda width, live: 0.0).observe(Tuner((2,)).init(), 2, np.array([0]), 1.0, 1)


def test_tuner_acceptance_given_drafts_known_ahead():
  """With pending lengths, a row without a draft at a position does not count as a rejection there."""
  tuner = Tuner((4,))
  accepted, drafted = np.array([2, 0, 1]), np.array([2, 0, 4])  # row 0 accepted both its drafts; row 1 had none
  ahead = tuner.observe(tuner.init(), 4, accepted, 1e-3, 3, drafted, 5, pending=np.array([2, 0, 6]))
  inline = tuner.observe(tuner.init(), 4, accepted, 1e-3, 3, drafted, 5)
  np.testing.assert_allclose(ahead.accept[:2], [1.0, 1 / 2])  # a1: rows 0, 2 (2 hits); a2: rows 0, 2 (1 hit)
  assert list(ahead.accept_n) == [2, 2, 0, 0]
  np.testing.assert_allclose(inline.accept[:3], [2 / 3, 1 / 2, 0.0])  # row 1 rejects a1, row 0 a3
  assert list(inline.accept_n) == [3, 2, 1, 0]


def test_observe_returns_a_new_state():
  tuner = Tuner((2, 4))
  state = tuner.init()
  for k, acc in [(4, [4, 1]), (2, [0, 2])]:
    before = copy.deepcopy(state)
    new = tuner.observe(state, k, np.array(acc), 1e-3, 2)
    fields = ('accept', 'accept_n', 'batch_n', 'stale', 'level', 'shape', 'shape_n', 'drafted_steps', 'tried_steps')
    for field in fields + ('last_tried',):
      np.testing.assert_array_equal(getattr(state, field), getattr(before, field))
    assert state.step == before.step and new.step == state.step + 1
    state = new
  with pytest.raises(SpecjaxError, match='not a candidate'):
    tuner.observe(state, 3, np.array([0]), 1e-3, 1)


def test_tuner_warm_up_gives_up_on_a_candidate_that_never_drafts():
  """A candidate whose steps draft nothing (n-gram with no match) is tried `warmup_tries` steps, not forced for
  as long as the live count stays in one bucket."""
  tuner = Tuner((2, 4), warmup_tries=3, explore_every=0)
  state, runs = tuner.init(), []
  for _ in range(8):
    k = tuner.choose(state, 1)
    runs.append(k)
    drafted = np.array([k if k == 2 else 0])  # K = 4 never finds a draft
    state = tuner.observe(state, k, np.minimum(drafted, 1), 1e-3, 1, drafted)
  assert runs[:4] == [4, 4, 4, 2] and list(state.tried_steps) == [runs.count(2), runs.count(4)], runs


def test_tuner_warms_up_deepest_first_then_explores_on_schedule():
  tuner = Tuner((2, 4, 6, 8), explore_every=8)
  sim = simulate(tuner, bernoulli_trace(0.3, rows=2, length=300, seed=0), cost=CHEAP_VERIFY)
  assert sim.ks[:4] == [8, 6, 4, 2]
  exploit = [k for t, k in enumerate(sim.ks[4:], 4) if (t + 1) % 8]
  assert exploit.count(2) > 0.8 * len(exploit)
  explored = [sim.ks[t] for t in range(7, len(sim.ks), 8)]
  assert explored[:2] == [8, 6] and set(explored) == {4, 6, 8}  # least recently tried first


@pytest.mark.parametrize('p, best', [(0.9, 8), (0.3, 2)])
def test_tuner_converges_to_the_best_depth(p, best):
  trace = bernoulli_trace(p, rows=4, length=400, seed=1)
  tuner = Tuner(candidates_for('ngram'))
  sim = simulate(tuner, trace, cost=CHEAP_VERIFY)
  oracle, rates = oracle_best_fixed(trace, tuner.candidates, cost=CHEAP_VERIFY)
  assert oracle == best
  assert mode(sim.ks[len(sim.ks) // 4 :]) == best
  assert set(sim.ks) <= set(tuner.candidates)
  assert regret(sim.tokens_per_s, rates[oracle]) < 0.05


def test_tuner_moves_when_acceptance_shifts():
  p = np.r_[np.full(300, 0.9), np.full(300, 0.2)]  # easy text, then hard
  sim = simulate(Tuner(candidates_for('ngram')), bernoulli_trace(p, rows=4, length=600, seed=2), cost=CHEAP_VERIFY)
  pos = np.cumsum([0] + [a + 1 for a in sim.accepted[0][:-1]])  # row 0's position before each step
  easy = [k for k, at in zip(sim.ks, pos) if 20 < at < 280]
  hard = [k for k, at in zip(sim.ks, pos) if at > 400]
  assert mode(easy) == 8 and mode(hard) == 2


def test_tuner_forgets_deep_positions_it_stops_reaching():
  """Batch 1, acceptance falls: deep positions are no longer reached, so their optimistic estimates age out."""
  p = np.r_[np.full(200, 0.95), np.full(400, 0.3)]
  trace = bernoulli_trace(p, rows=1, length=600, seed=5)

  def deep_steps_after_shift(tuner):
    sim = simulate(tuner, trace, cost=CHEAP_VERIFY)
    pos = np.cumsum([0] + [a + 1 for a in sim.accepted[0][:-1]])
    return sum(k == 8 for k, at in zip(sim.ks, pos) if 200 <= at < 260)

  aging, frozen = deep_steps_after_shift(Tuner(candidates_for('ngram'))), deep_steps_after_shift(
      Tuner(candidates_for('ngram'), stale_rate=0.0)
  )
  assert aging < frozen


def runs_trace(p_first: float, p_next: float, length: int, seed: int) -> Trace:
  """One row whose drafts come in runs: ACCEPT with p_next after an ACCEPT, else with p_first."""
  draws = np.random.default_rng(seed).random(length)
  outcomes, accepted = np.zeros(length, np.int8), False
  for i, u in enumerate(draws):
    accepted = u < (p_next if accepted else p_first)
    outcomes[i] = accepted
  return Trace([outcomes], [length])


def test_tuner_weighs_a_new_batch_more():
  """Requests in turn, state carried: after text with long runs, the next request leaves deep K sooner."""
  cost = lambda k, live: 1e-3 * (1 + 0.16 * k)  # width 9 ~2.3x a decode step, as on the CPU

  def deep_steps(tuner):
    n = 0
    for seed in range(8):
      state = simulate(tuner, runs_trace(0.35, 0.9, 300, seed), cost=cost).state
      sim = simulate(tuner, runs_trace(0.3, 0.6, 100, seed + 50), cost=cost, state=state)
      n += sum(k >= 6 for k in sim.ks[:20])
    return n

  assert deep_steps(Tuner(candidates_for('ngram'))) < 0.8 * deep_steps(Tuner(candidates_for('ngram'), carry=9))
  tuner = Tuner((2, 4))
  state = tuner.observe(tuner.init(), 4, np.array([4]), 1e-3, 1)
  assert list(state.batch_n) == [1] * 4
  state = tuner.begin(state, 1)
  assert list(state.batch_n) == [0] * 4 and list(state.accept_n) == [1] * 4


def test_tuner_stale_positions_blend_toward_the_one_before():
  tuner = Tuner((8,), stale_rate=0.5)
  state = tuner.observe(tuner.init(), 8, np.array([8]), 1e-3, 1, np.array([8]))  # every position accepted once
  assert list(state.stale) == [0] * 8
  state = tuner.observe(state, 8, np.array([0]), 1e-3, 1, np.array([8]))  # rejected at 1: 2..8 drafted, unreached
  assert list(state.stale) == [0] + [1] * 7
  a, a0 = tuner.acceptance(state), 1 - 1 / (tuner.carry + 2)  # the batch's second observation
  assert a[0] == pytest.approx(a0) and a[1] == pytest.approx(0.5 * 1.0 + 0.5 * a0)
  state = tuner.observe(state, 8, np.array([0]), 1e-3, 1, np.array([0]))  # a miss: nothing ages
  assert list(state.stale) == [0] + [1] * 7

  # Every draft of a shallower step accepted: the positions beyond it were never drafted and go stale, so
  # a tuner sitting at a small K in repetitive text raises its deep estimates toward the shallow ones.
  tuner = Tuner((2, 8), stale_rate=0.5)
  state = tuner.observe(tuner.init(), 8, np.array([2, 2]), 1e-3, 2, np.array([8, 8]))  # draft 3 rejected
  deep = tuner.acceptance(state)[2]
  for _ in range(3):
    state = tuner.observe(state, 2, np.array([2, 2]), 1e-3, 2, np.array([2, 2]))
  assert state.stale[2] == 6 and deep == 0.0 and tuner.acceptance(state)[2] > 0.9


def test_tuner_uses_shallower_drafts_under_load():
  cost = lambda k, live: 1e-3 * (1 + 0.05 * k * live)  # verify grows with K x live rows
  trace = bernoulli_trace(0.8, rows=16, length=1200, seed=3)
  trace.lengths = [75 * (i + 1) for i in range(16)]  # rows finish one by one
  sim = simulate(Tuner(candidates_for('ngram')), trace, cost=cost)
  high = [k for k, live in zip(sim.ks, sim.live) if live >= 9]
  low = [k for k, live in zip(sim.ks, sim.live) if live <= 3]
  assert mode(high) == 2 and mode(low) >= 4


def test_simulation_is_deterministic():
  trace = bernoulli_trace(np.linspace(0.9, 0.2, 500), rows=3, length=500, seed=4)
  a, b = (simulate(Tuner((2, 3, 4, 6)), trace, cost=CHEAP_VERIFY) for _ in range(2))
  assert a == b
  assert (
      bernoulli_trace(0.5, rows=2, length=50, seed=9).outcomes[1].tolist()
      == bernoulli_trace(0.5, rows=2, length=50, seed=9).outcomes[1].tolist()
  )


# ---------------------------------------------------------------- replay model


def test_replay_walks_positions():
  a, r, u = ACCEPT, REJECT, UNKNOWN
  trace = Trace([[a, a, a, r, a, u, a, r]], [8])
  sim = simulate(Fixed(2), trace, cost=CHEAP_VERIFY)
  # p=0: a a -> 2 accepted, bonus at 2; p=3: r -> 0; p=4: a u -> 1; p=6: a r -> 1, then the budget ends.
  assert sim.accepted == [[2, 0, 1, 1]] and sim.emitted == [8]
  assert sim.tokens == 8 and sim.steps == 4 and sim.tau == 2.0
  assert simulate(Fixed(2), trace, cost=CHEAP_VERIFY, censored='accept').accepted == [[2, 0, 2, 0]]
  # Past the stored outcomes is unknown: the last step may report more accepted than it emits.
  short = Trace([[a, a]], [2])
  assert simulate(Fixed(4), short, cost=CHEAP_VERIFY).accepted == [[2]]
  assert simulate(Fixed(4), short, cost=CHEAP_VERIFY, censored='accept').accepted == [[4]]
  with pytest.raises(SpecjaxError, match='censored'):
    simulate(Fixed(2), trace, cost=CHEAP_VERIFY, censored='maybe')


def test_static_batches_restart_the_policy():
  trace = bernoulli_trace(0.5, rows=5, length=30, seed=5)
  sim = simulate(Tuner((2, 4)), trace, batch=2, cost=CHEAP_VERIFY)
  assert max(sim.live) == 2 and sim.tokens == 150
  assert sim.ks[:2] == [4, 2]  # the first batch warms up ...
  second = next(t for t in range(1, len(sim.live)) if sim.live[t] > sim.live[t - 1])
  assert sim.ks[second : second + 2] == [4, 2]  # ... and so does the next one
  with pytest.raises(SpecjaxError, match='batch'):
    simulate(Fixed(2), trace, batch=0, cost=CHEAP_VERIFY)


def test_step_costs_from_a_recording():
  costs = StepCosts([(2, 1.0, 1), (2, 3.0, 1), (4, 3.0, 1), (2, 4.0, 4), (4, 6.0, 4)])
  assert costs(2, 1) == 2.0 and costs(4, 4) == 6.0
  assert costs(2, 2) == pytest.approx(2.0 + 2.0 / 3)  # linear in live
  assert costs(4, 8) == 6.0  # constant past the recorded lives
  assert costs(3, 1) == pytest.approx(2.5) and costs(6, 4) == pytest.approx(8.0)  # linear in K
  with pytest.raises(SpecjaxError, match='K=3 only'):
    StepCosts([(3, 1.0, 1)])(4, 1)
  with pytest.raises(SpecjaxError, match='no recorded step times'):
    simulate(Fixed(2), bernoulli_trace(0.5, rows=1, length=5))


def test_oracle_and_regret():
  trace = bernoulli_trace(0.6, rows=2, length=200, seed=6)
  best, rates = oracle_best_fixed(trace, (2, 4, 6), cost=CHEAP_VERIFY)
  assert best == max(rates, key=rates.get) and set(rates) == {2, 4, 6}
  assert regret(rates[best], rates[best]) == 0.0 and regret(50.0, 100.0) == 0.5
  with pytest.raises(SpecjaxError, match='positive'):
    regret(1.0, 0.0)


def ngram_like_trace(p_miss, p_accept, *, rows, length, seed):
  """Positions with no draft (NONE) with probability p_miss, else ACCEPT with probability p_accept."""
  rng = np.random.default_rng(seed)
  u, v = rng.random((rows, length)), rng.random((rows, length))
  outcomes = np.where(u < p_miss, NONE, np.where(v < p_accept, ACCEPT, REJECT)).astype(np.int8)
  return Trace(list(outcomes), [length] * rows)


@pytest.mark.parametrize('p_miss', [0.3, 0.6])
def test_tuner_near_oracle_with_misses(p_miss):
  """Half-missing n-gram drafts, cost by verified width: the tuner is within 5% of the best fixed K."""
  width_cost = lambda width, live: 1.0 + 0.15 * (width - 1)
  trace = ngram_like_trace(p_miss, 0.8, rows=1, length=3000, seed=3)
  best, rates = oracle_best_fixed(trace, (2, 4, 6, 8), width_cost=width_cost)
  sim = simulate(Tuner((2, 4, 6, 8)), trace, width_cost=width_cost)
  assert regret(sim.tokens_per_s, rates[best]) < 0.05, (best, rates, sim.tokens_per_s)


# ---------------------------------------------------------------- recorded runs


def test_replay_reproduces_a_recorded_run(tiny_model):
  import specjax

  engine = specjax.Engine(tiny_model, page_size=4, drafter=NgramDrafter())
  prompts = ['def add(a, b):\n    return a + b\n\ndef add(a, b):\n', 'The cat sat on the mat. The cat', 'Hello']
  for policy in (Fixed(4), Tuner((2, 4), explore_every=4, costs=CPU_WIDTHS)):
    results, stats = engine.generate(prompts, max_new_tokens=24, num_draft=policy)
    trace = trace_from_stats(results, stats)
    sim = simulate(policy, trace)
    assert sim.ks == [k for k, _, _ in stats.steps]
    assert sim.live == [live for _, _, live in stats.steps]
    assert sim.step_s == [s for _, s, _ in stats.steps]
    assert sim.accepted == [r.spec.accepted_per_step for r in results]
    assert sim.emitted == [len(r.tokens) - 1 for r in results]
  assert len(set(sim.ks)) == 2  # the tuner ran both depths
  # Off the recorded path the costs come from the recorded table.
  other = simulate(Fixed(2), trace)
  assert other.tokens == sum(len(r.tokens) - 1 for r in results) and other.seconds > 0
  with pytest.raises(SpecjaxError, match='speculative metrics'):
    trace_from_stats([dataclasses.replace(results[0], spec=None)], stats)


@pytest.mark.parametrize('policy', ['tuner', 'load'])
def test_speculation_off_runs_plain_decode_steps(tiny_model, policy):
  """A policy that chooses K = 0 runs the plain decode step (no verify pass) with the same tokens; the tuner
  learns that step's cost at width 1 and stays off when verify passes cost more than their accepted drafts."""
  import specjax

  engine = specjax.Engine(tiny_model, page_size=4, drafter=NgramDrafter())
  prompts = ['def add(a, b):\n    return a + b\n\ndef add(a, b):\n', 'The cat sat on the mat. The cat', 'Hello']
  reference, _ = engine.generate(prompts, max_new_tokens=20, num_draft=0)
  if policy == 'tuner':
    depth = Tuner((0, 2, 4), explore_every=0, costs={1: 1e-3, 5: 40e-3})
  else:
    depth = Load(full=4, reduced=0, threshold=2)
  results, stats = engine.generate(prompts, max_new_tokens=20, num_draft=depth)
  assert [r.tokens for r in results] == [r.tokens for r in reference]
  ks = [k for k, _, _ in stats.steps]
  if policy == 'tuner':
    warmup = ks[: ks.index(0)]  # each drafting candidate until it drafted, deepest first; then off for good
    assert warmup == sorted(warmup, reverse=True) and set(warmup) == {2, 4} and set(ks[len(warmup) :]) == {0}, ks
    assert stats.policy_state.step == len(ks)  # it observed every step, the off ones (priced at width 1) too
  else:
    assert all(k == (4 if live <= 2 else 0) for k, _, live in stats.steps) and {0, 4} <= set(ks), stats.steps
  assert sum(r.spec.target_steps for r in results) == sum(live for k, _, live in stats.steps if k)
  assert sum(r.spec.accepted for r in results) > 0  # the drafting steps' drafts were accepted too


def test_policy_state_carries_across_requests(tiny_model):
  import specjax

  engine = specjax.Engine(tiny_model, page_size=4, drafter=NgramDrafter())
  tuner = Tuner((2, 4, 6, 8), explore_every=0, costs=STEEP_WIDTHS)
  prompt = ['The cat sat on the mat. The cat sat on the mat. The cat']
  _, first = engine.generate(prompt, max_new_tokens=16, num_draft=tuner)
  ks = [k for k, _, _ in first.steps]
  warmup = ks[: ks.index(2) + 1]
  assert warmup[0] == 8 and warmup == sorted(warmup, reverse=True) and set(warmup) == {2, 4, 6, 8}  # deepest first
  assert set(ks[len(warmup) :]) <= {2}  # then the cheapest by the injected costs
  # The cost model learned the injected costs, not the wall times: widths 3, 5, 7, 9 priced by the table.
  np.testing.assert_allclose(tuner.step_times(first.policy_state, 1), [tuner.costs(w, 1) for w in (3, 5, 7, 9)])
  _, second = engine.generate(prompt, max_new_tokens=16, num_draft=tuner, policy_state=first.policy_state)
  assert second.policy_state.step == first.policy_state.step + len(second.steps)
  assert {k for k, _, _ in second.steps} == {2}  # no second warm-up
