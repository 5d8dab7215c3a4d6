"""Target taps (layer outputs, 0-based, as `DecoderLM.forward(taps=...)` reads them): defaults and the one range check.

Standard library and `specjax.errors` only, so that loaders (`specjax.loading.eagle3`) and training
(`specjax.train.trainers.check_config`) share it without importing each other.
"""

from __future__ import annotations

from typing import Sequence

from specjax.errors import SpecjaxError

EAGLE3_DEFAULT = 'outputs of layers 1, L/2 - 1, L - 4'  # what `eagle3_default_taps` names


def eagle3_default_taps(num_layers: int) -> tuple[int, ...]:
  """Outputs of layers 1, L/2 - 1 and L - 4 (SpecForge's default, in specjax's convention)."""
  return (1, num_layers // 2 - 1, num_layers - 4)


def check_taps(taps: Sequence, num_layers: int, what: str, *, meaning: str = '', hint: str = '') -> tuple[int, ...]:
  """`taps` as a tuple when each is a layer of a `num_layers`-layer target; else one `SpecjaxError` line.

  The line reads `{what} {taps} ({meaning}): {bad} outside the target's L layers (0..L-1); {hint}`.
  """
  bad = [i for i in taps if type(i) is not int or not 0 <= i < num_layers]
  if bad:
    detail = f' ({meaning})' if meaning else ''
    raise SpecjaxError(
        f"{what} {list(taps)}{detail}: {bad} outside the target's {num_layers} layers (0..{num_layers - 1})"
        + (f'; {hint}' if hint else '')
    )
  return tuple(taps)
