"""Draft-depth policies: choose K for the next step from a fixed candidate set.

  Fixed(k)                         always K (`base`).
  Tuner(candidates)                the K with the most expected tokens per second (`tuner`): an
                                   `AcceptanceEstimator` (`acceptance`) and a `CostModel` (`costs`).
  Load(full, reduced, threshold)   `full` up to `threshold` live sequences, at most `reduced` above (`base`).

The interface (`Policy.init / begin / choose / observe`) is described in
`base`; `make_policy` and the SPECJAX_POLICY override in `env`; the drafter
families' candidate depths in `candidates`; acceptance traces in `trace` and
their offline replay (`simulate`, `oracle_best_fixed`, `regret`) in `replay`;
the recorded step-cost tables in `costs`.
"""

from specjax.depths import verified_width
from specjax.policies.acceptance import AcceptanceEstimator, AcceptanceState
from specjax.policies.base import Fixed, Load, Policy
from specjax.policies.candidates import candidates_for, check_candidates
from specjax.policies.costs import LIVE_BUCKETS, CostModel, CostState, CostTable, StepCosts, WidthCosts, live_bucket
from specjax.policies.env import ENV, POLICIES, make_policy
from specjax.policies.replay import SimResult, oracle_best_fixed, regret, simulate
from specjax.policies.trace import ACCEPT, NONE, REJECT, UNKNOWN, Trace, bernoulli_trace, trace_from_stats
from specjax.policies.tuner import Tuner, TunerState

__all__ = [
    'ACCEPT',
    'ENV',
    'LIVE_BUCKETS',
    'NONE',
    'POLICIES',
    'REJECT',
    'UNKNOWN',
    'AcceptanceEstimator',
    'AcceptanceState',
    'CostModel',
    'CostState',
    'CostTable',
    'Fixed',
    'Load',
    'Policy',
    'SimResult',
    'StepCosts',
    'Trace',
    'Tuner',
    'TunerState',
    'WidthCosts',
    'bernoulli_trace',
    'candidates_for',
    'check_candidates',
    'live_bucket',
    'make_policy',
    'oracle_best_fixed',
    'regret',
    'simulate',
    'trace_from_stats',
    'verified_width',
]
