"""The drafter families `specjax train` knows: `TRAINERS` maps `drafter.kind` to the family's `make(config, target,
data) -> DrafterTrainer` (`specjax.train.base`; `data`: the packed training rows, e.g. for a draft vocabulary), and the
checks a config gets against its target before any data. The loop (`specjax.train.loop`) does the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.errors import SpecjaxError
from specjax.train import dflash, eagle3, mtp
from specjax.train.base import DrafterTrainer

TRAINERS: dict[str, Callable[[Any, Any, Any], DrafterTrainer]] = {
    'mtp': mtp.make,
    'eagle3': eagle3.make,
    'dflash': dflash.make,
}


def first_params(trainer: DrafterTrainer, key) -> Any:
  """The params a run starts from: `trainer.start` in float32, else a fresh `init(key)`.

  `start` needs no shape check here: each family's loader checks the
  checkpoint against the config it returns, and the trainer is built from it.
  """
  if trainer.start is None:
    return trainer.init(key)
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), trainer.start)


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
    dflash.draft_config(config, target)  # taps below the last layer, a mask token inside the vocabulary


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
