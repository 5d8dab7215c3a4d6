"""The interface a drafter family implements for `specjax train`, and helpers the families share.

  init(key)                                   -> params (an nnx.State of the drafter's weights)
  loss(params, target, batch, key, norm=None) -> (loss, metrics)      (jitted; target: the merged frozen module;
                                                                       key: None when evaluating)
  export(params, path)                        -> writes the family's upstream layout
  load(path)                                  -> params               (the export read back, for tests)

`metrics` holds at least `agree` and `count`, each [positions]: top-1
agreements with the target and counted predictions per draft position
(training-time-test step), summed over the batch; `ce` the summed soft
cross-entropy per position; `norm` what the loss divides its sums by (summed
over the batch, so additive over rows). `loss(..., norm=N)` divides by N instead:
with N the whole batch's, the losses of its parts add up to the whole's
(gradient accumulation). The families (`mtp`, `eagle3`, `dflash`) import
this module; the registry (`specjax.train.trainers`) imports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True, eq=False)
class DrafterTrainer:
  kind: str = 'drafter'
  positions: int = 1  # draft positions the metrics cover
  taps: tuple[int, ...] = ()  # target layers whose residuals the loss reads
  start: Any = None  # params read from `drafter.init_from` (None: `init`)
  tap_scale: Any = None  # [n * D] float32: `fc` is trained on taps / tap_scale (`drafter.tap_scale`), else None
  hard_targets: float = 0.0  # share of the target's argmax in the loss's target distribution (`train.hard_targets`)

  def init(self, key) -> Any:
    raise NotImplementedError

  def loss(self, params, target, batch: dict, key, norm=None) -> tuple[Any, dict]:
    raise NotImplementedError

  def export(self, params, path: str) -> None:
    raise NotImplementedError

  def load(self, path: str) -> Any:
    raise NotImplementedError

  def scale_taps(self, taps: jax.Array) -> jax.Array:  # [..., n * D] the taps side by side
    return taps if self.tap_scale is None else taps / jnp.asarray(self.tap_scale, taps.dtype)

  def served(self, params) -> Any:
    """`params` as served, `fc` reading raw taps: (taps / s) @ W = taps @ (W / s), the scale folded into fc's rows."""
    if self.tap_scale is None:
      return params
    scale = np.asarray(self.tap_scale, np.float32)[:, None]  # [n * D, 1]
    fold = lambda path, w: w / scale if path[0] == jax.tree_util.DictKey('fc') else w
    return jax.tree.map_with_path(fold, params)


def final_norm_weight(model) -> Any:  # a target module -> [D] float32
  """The target's final-norm weight as a plain `x * w` RMS norm applies it (Gemma's offset folded in)."""
  return (model.norm.offset + model.norm.scale[...]).astype(jnp.float32)


def check_fields(where: str, loaded, configured, fields: tuple[str, ...], hint: str) -> None:
  """One error line naming every field in which a `drafter.init_from` checkpoint differs from the config's drafter."""
  diff = [f'{f} {getattr(loaded, f)!r} (config: {getattr(configured, f)!r})' for f in fields]
  diff = [d for d, f in zip(diff, fields) if getattr(loaded, f) != getattr(configured, f)]
  if diff:
    raise SpecjaxError(f'drafter.init_from {where} differs from this config: {"; ".join(diff)}; {hint}')
