"""`make_policy` and the SPECJAX_POLICY override.

`make_policy(name, family=...)` builds one over the drafter family's
candidates (`candidates_for`). The environment variable SPECJAX_POLICY forces
a policy, whatever the caller asked for:

  SPECJAX_POLICY=fixed:4        Fixed(4); plain `fixed`: the caller's K, else the deepest candidate
  SPECJAX_POLICY=tuner          Tuner over the family's candidates
  SPECJAX_POLICY=tuner:2,4,6    Tuner over these candidates
  SPECJAX_POLICY=tuner:0,2,4    ... with speculation off (a plain decode step) as a candidate
  SPECJAX_POLICY=load           Load with the caller's K, else the deepest candidate, as full depth
  SPECJAX_POLICY=load:6         Load with full depth 6

Options the caller passed that the forced policy does not have are dropped.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from specjax.errors import SpecjaxError
from specjax.policies.base import Fixed, Load, Policy
from specjax.policies.candidates import candidates_for, check_candidates
from specjax.policies.tuner import Tuner

ENV = 'SPECJAX_POLICY'
POLICIES = ('fixed', 'tuner', 'load')


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


def policy_options(name: str) -> set[str]:
  """The options a policy takes beside its depths."""
  cls = {'fixed': Fixed, 'tuner': Tuner, 'load': Load}[name]
  return {f.name for f in dataclasses.fields(cls)} - {'name', 'k', 'full', 'candidates'}


def check_policy_options(name: str, kw: dict) -> None:
  unknown = sorted(set(kw) - policy_options(name))
  if unknown:
    allowed = ', '.join(sorted(policy_options(name))) or 'none'
    raise SpecjaxError(f'policy {name!r} has no option {", ".join(unknown)} (options: {allowed})')


def make_policy(
    name: str,
    *,
    family: str,
    candidates: Sequence[int] | None = None,
    k: int | None = None,
    max_depth: int = 8,
    options: Any = None,
    **kw,
) -> Policy:
  """Builds 'fixed' (depth k), 'tuner' or 'load' (full depth k) for a drafter family.

  Candidates default to `candidates_for(family, options)` (the drafter
  family's registry entry and its options); k defaults to the
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
  if forced:
    kw = {key: v for key, v in kw.items() if key in policy_options(name)}
  check_policy_options(name, kw)

  def depths() -> tuple[int, ...]:
    if candidates is not None:
      return check_candidates(candidates, max_depth, off=name == 'tuner')
    return candidates_for(family, options, max_depth=max_depth)

  if name == 'tuner':
    return Tuner(depths(), **kw)
  if k is None:
    k = depths()[-1]
  check_candidates([k], max_depth)
  return Fixed(k) if name == 'fixed' else Load(full=k, **kw)
