"""What a drafter family supplies to `specjax train`: the `DrafterTrainer` interface and its registry.

  init(key)                                   -> params (an nnx.State of the drafter's weights)
  loss(params, target, batch, key)            -> (loss, metrics)      (jitted; target: the merged frozen module;
                                                                       key: None when evaluating)
  export(params, path)                        -> writes the family's upstream layout
  load(path)                                  -> params               (the export read back, for tests)

`metrics` holds at least `agree` and `count`, each [positions]: top-1
agreements with the target and counted predictions per draft position
(training-time-test step), summed over the batch; `ce` the summed soft
cross-entropy per position. A family registers `make(config, target, data)
-> DrafterTrainer` in `TRAINERS` (`data`: the packed training rows, e.g. for
a draft vocabulary); the loop (`specjax.train.loop`) does the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

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

  def loss(self, params, target, batch: dict, key) -> tuple[Any, dict]:
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


def _mtp(config, target, data):
  from specjax.train.mtp import make

  return make(config, target, data)


def _eagle3(config, target, data):
  try:
    import specjax.models.eagle3  # noqa: F401
  except ImportError:
    raise SpecjaxError('drafter.kind eagle3 needs the EAGLE-3 head module (specjax/models/eagle3.py)') from None
  from specjax.train.eagle3 import make

  return make(config, target, data)


def _dflash(config, target, data):
  from specjax.train.dflash import make

  return make(config, target, data)


TRAINERS: dict[str, Callable[[Any, Any, Any], DrafterTrainer]] = {'mtp': _mtp, 'eagle3': _eagle3, 'dflash': _dflash}


def final_norm_weight(model) -> Any:  # a target module -> [D] float32
  """The target's final-norm weight as a plain `x * w` RMS norm applies it (Gemma's offset folded in)."""
  return (model.norm.offset + model.norm.scale[...]).astype(jnp.float32)


def first_params(trainer: DrafterTrainer, key) -> Any:
  """The params a run starts from: `trainer.start` in float32, else a fresh `init(key)`.

  `start` needs no shape check here: each family's loader checks the
  checkpoint against the config it returns, and the trainer is built from it.
  """
  if trainer.start is None:
    return trainer.init(key)
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainer.start)


def check_fields(where: str, loaded, configured, fields: tuple[str, ...], hint: str) -> None:
  """One error line naming every field in which a `drafter.init_from` checkpoint differs from the config's drafter."""
  diff = [f'{f} {getattr(loaded, f)!r} (config: {getattr(configured, f)!r})' for f in fields]
  diff = [d for d, f in zip(diff, fields) if getattr(loaded, f) != getattr(configured, f)]
  if diff:
    raise SpecjaxError(f'drafter.init_from {where} differs from this config: {"; ".join(diff)}; {hint}')


def check_taps(config, num_layers: int) -> tuple[int, ...] | None:
  """The taps `config` asks of a `num_layers`-layer target (explicit, or EAGLE-3's default), each checked to be one
  of its layers (`specjax.taps.check_taps`, the loaders' check); None: the family's own default (checked by it)."""
  from specjax.taps import EAGLE3_DEFAULT, check_taps as check, eagle3_default_taps

  ids = config['drafter.target_layer_ids']
  if ids:
    return check(ids, num_layers, 'drafter.target_layer_ids')
  if config['drafter.kind'] == 'eagle3':
    what = 'drafter.kind eagle3: the default taps'
    hint = 'set drafter.target_layer_ids'
    return check(eagle3_default_taps(num_layers), num_layers, what, meaning=EAGLE3_DEFAULT, hint=hint)
  return None


def check_config(config, target) -> None:
  """What a config asks of the target (taps in range, a draft vocabulary within the target's): before any data."""
  check_taps(config, target.config.num_layers)
  vocab, draft_vocab = target.config.vocab_size, config['drafter.draft_vocab_size']
  if config['drafter.kind'] == 'eagle3' and not 1 <= draft_vocab <= vocab:
    raise SpecjaxError(f'drafter.draft_vocab_size={draft_vocab} must be in 1..{vocab} (the target vocabulary)')
  if config['drafter.kind'] == 'dflash':
    from specjax.train.dflash import draft_config

    draft_config(config, target)  # taps below the last layer, a mask token inside the vocabulary


def make_trainer(config, target, data) -> DrafterTrainer:
  """The trainer of `config['drafter.kind']` for `target` (a loaded Model) and the packed training rows."""
  check_config(config, target)
  trainer = TRAINERS[config['drafter.kind']](config, target, data)
  trainer = dataclasses.replace(trainer, hard_targets=config['train.hard_targets'])
  if config['drafter.tap_scale']:
    from specjax.train.features import tap_scale

    if data is None or not len(data):
      raise SpecjaxError('drafter.tap_scale measures the taps on the training rows: there are none')
    trainer = dataclasses.replace(trainer, tap_scale=tap_scale(target, data, trainer.taps))
  return trainer
