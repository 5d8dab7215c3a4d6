"""The draft depths each drafter family's adaptive policies choose from."""

from __future__ import annotations

from typing import Sequence

from specjax.errors import SpecjaxError

FAMILY_CANDIDATES = {
    'mtp': (2, 3, 4, 6),  # built-in heads
    'gemma4-assistant': (2, 3, 4, 6),  # capped by num_assistant_tokens
    'dflash': (3, 5, 7),  # capped by block_size - 1
    'ngram': (2, 4, 6, 8),
    'draft-model': (2, 4, 6, 8),
    'layer-skip': (2, 4, 6, 8),
}


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
