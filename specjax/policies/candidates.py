"""The draft depths each drafter family's adaptive policies choose from (read from the drafter registry)."""

from __future__ import annotations

from typing import Any, Sequence

from specjax.errors import SpecjaxError


def check_candidates(candidates: Sequence[int], max_depth: int, off: bool = False) -> tuple[int, ...]:
  """Sorted unique candidates, each within the drafter's limits 1..max_depth; `off`: 0 (a plain decode step)
  may be one of them, beside at least one depth that drafts."""
  out = tuple(sorted({int(k) for k in candidates}))
  low = 0 if off else 1
  bad = [k for k in out if not low <= k <= max_depth]
  if not out or bad or out == (0,):
    raise SpecjaxError(
        f"candidate depths {tuple(candidates)} are outside the drafter's limits {low}..{max_depth}"
        + (' (0 is speculation off: give a depth that drafts beside it)' if off and out == (0,) else '')
    )
  return out


def candidates_for(family: str, options: Any = None, *, max_depth: int = 8) -> tuple[int, ...]:
  """The depths a drafter family's tuner chooses from, each capped by the family's limit and `max_depth`.

  The family's registry entry (`specjax.drafters.registry`) gives its depths
  (mtp 2, 3, 4, 6; ngram, draft-model, layer-skip 2, 4, 6, 8) and its deepest
  K for `options` (a family whose limit depends on its settings, e.g. a block
  size, caps them); a candidate above the cap becomes the cap.
  """
  from specjax import drafters  # pylint: disable=g-import-not-at-top  (registers the families)

  if family not in drafters.REGISTRY:
    raise SpecjaxError(f'unknown drafter family {family!r} (known: {", ".join(drafters.REGISTRY)})')
  return drafters.REGISTRY[family].candidates(options, max_depth=max_depth)
