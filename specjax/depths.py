"""Verify widths of a depth-K step when drafts can be short (standard library only).

Drafters that draft ahead (`Drafter.drafts_ahead`) tell the host their draft
lengths before the step; it verifies only the width the longest one needs,
rounded up to `verify_widths(k)`, by running the step compiled for depth
`step_depth(k, longest)`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def verify_widths(k: int) -> tuple[int, ...]:
  """Verify widths a depth-K step may use when drafts can be short: 1, 2, 4, ... and K + 1."""
  return tuple(sorted({w for w in (1, 2, 4, 8, 16) if w < k + 1} | {k + 1}))


def step_depth(k: int, pending: int) -> int:
  """The executable a depth-K step runs when the longest pending draft has `pending` tokens.

  Its verify width is the smallest of `verify_widths(k)` that covers the draft;
  it runs the step compiled for depth width - 1 (0: no drafts, a decode step
  that still commits through the drafter).
  """
  widths = verify_widths(k)
  return widths[bisect.bisect_left(widths, min(pending, k) + 1)] - 1


def verified_width(k: int, drafted: Iterable[int]) -> int:
  """Positions a verify pass at depth K runs for these rows' draft counts (`step_depth` of the longest)."""
  return step_depth(k, int(max(drafted))) + 1
