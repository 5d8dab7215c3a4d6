"""Training configs: an ml_collections `get_config()` file over one schema, plus `key=value` overrides.

Loading and override parsing: `specjax.config_files`; the hash: `specjax.provenance`.
The schema is this file's. A key the schema does not have is refused, naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Iterable

import ml_collections

from specjax.config_files import flatten, load_config_file, parse_overrides, unflatten
from specjax.errors import SpecjaxError
from specjax.provenance import stable_hash

KINDS = ('mtp', 'eagle3', 'dflash')


def base_config() -> ml_collections.ConfigDict:
  """The schema: every field a training config may set, with its default."""
  return ml_collections.ConfigDict(
      {
          'name': 'train',
          'target': {
              'model': 'gemma-3-270m',  # anything `specjax.load` takes
              'attention_impl': 'auto',
              'dtype': None,  # float32 | bfloat16 (None: float32 on CPU, bfloat16 on GPU)
          },
          'drafter': {
              'kind': 'mtp',  # mtp | eagle3 | dflash
              'layers': 1,  # decoder layers of the drafter (mtp: 1)
              'draft_vocab_size': 32000,  # eagle3: top-N target tokens of the training data
              'block_size': 16,  # dflash: rows of a block (the anchor and block_size - 1 masks)
              'anchors': 512,  # dflash: blocks per packed row (random anchors, SpecForge's 512)
              'context_dropout': 0.0,  # dflash: share of training blocks that see no context (their x_a only)
              'mask_token_id': None,  # dflash: None: the tokenizer's mask token, a spare embedding row, pad or unk
              'target_layer_ids': [],  # taps (eagle3, dflash); empty: the family's default
              'head_from_target': False,  # start from the target's final norm (eagle3: and head, draft vocab columns)
              'norm_before_residual': True,  # eagle3: the layer's residual is hidden_norm(fc(taps)), not fc(taps)
              'norm_before_fc': False,  # eagle3: one RMS norm over the concatenated taps before fc
              'fc_norm': False,  # eagle3: one RMS norm per tap before fc (EAGLE 3.1)
              'norm_output': False,  # eagle3: the next step reads the final-normed output (EAGLE 3.1)
              'tap_scale': False,  # eagle3, dflash: fc trained on taps / their per-channel RMS, folded into fc at export
              'init_from': None,  # a drafter directory of this kind (an export or upstream checkpoint) to start from
          },
          'data': {
              'path': None,  # jsonl: ShareGPT `conversations`, `prompt`/`turns`, `messages` or `text` records
              'sources': [],  # registered sources, e.g. 'sharegpt', 'reasoning_gym:chain_sum', 'stdlib_code'
              'limit': None,  # records per source (None: all)
              'fraction': 1.0,  # of the training records, after the eval hold-out (data-size ablations; nested)
              'max_len': 512,  # tokens per packed row
              'pack': True,  # several sequences per row (never for hybrid targets)
              'chat_template': 'auto',  # auto: the target's template if it has one, else plain text | none
              'loss_on': 'assistant',  # assistant: answer tokens only (text records: all) | all
              'regenerate': False,  # answer the prompts with the target itself (cached on disk once)
              'regenerate_max_new_tokens': 256,
              'regenerate_batch_size': 8,
              'regenerate_temperature': 0.0,
              'cache_dir': None,  # regenerated data (None: the user cache, ~/.cache/specjax/regenerated)
          },
          'train': {
              'steps': 1000,  # 0: export the initialised drafter
              'batch_size': 8,  # rows per step, over all devices (and processes)
              'grad_accum': 1,  # micro-batches per step: a device holds batch_size / (devices * grad_accum) rows
              'lr': 1e-4,
              'warmup': 0.015,  # fraction of the steps
              'end_lr': 0.0,  # fraction of lr at the last step (cosine)
              'b1': 0.9,
              'b2': 0.95,
              'weight_decay': 0.0,
              'clip': 0.5,  # global gradient norm
              'seed': 0,
              'ttt_steps': 7,  # training-time-test unroll (eagle3, mtp)
              'ttt_decay': 0.8,  # weight of step i: decay^i
              'hard_targets': 0.0,  # loss target (1 - h) * p + h * one_hot(argmax p): 0 soft (EAGLE-3's), 1 hard
              'dflash_gamma': 7.0,  # dflash: block row k weighted exp(-(k - 1) / gamma) (SpecForge: 7 for B 16, 4 for B 8)
              'loss_chunk': 256,  # rows per chunk of the vocabulary projection
              'log_every': 10,
              'save_every': 100,
              'keep': 3,  # checkpoints kept
              'cache_target': False,  # run the frozen target once per row, keep its features on disk (`features`)
              'stop_after': 0,  # end this invocation after that step (0: at train.steps); rerun to resume
              'time_limit': 0.0,  # minutes: end this invocation at the first step past it (0: none); rerun to resume
          },
          'eval': {
              'prompts': None,  # jsonl (same record shapes); None: eval.limit training records are held out
              'every': 0,  # steps between agreement / tau estimates (0: off)
              'limit': 16,  # eval records
          },
      }
  )


_SCHEMA = flatten(base_config().to_dict())
_NULLABLE = {
    'drafter.mask_token_id': int,
    'drafter.init_from': str,
    'target.dtype': str,
    'data.path': str,
    'data.limit': int,
    'data.cache_dir': str,
    'eval.prompts': str,
}
_CHOICES = {
    'drafter.kind': KINDS,
    'target.dtype': ('float32', 'bfloat16', 'float16'),
    'data.chat_template': ('auto', 'none'),
    'data.loss_on': ('assistant', 'all'),
}


def _check_value(key: str, value: Any) -> Any:
  default = _SCHEMA[key]
  if value is None and key in _NULLABLE:
    return None
  want = _NULLABLE.get(key, type(default))
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  elif want is list and isinstance(value, (list, tuple)):
    value = list(value)
  elif want is int and isinstance(value, bool) or not isinstance(value, want):
    raise SpecjaxError(f'config key {key!r} must be {want.__name__}, got {value!r}')
  if key in _CHOICES and value not in _CHOICES[key]:
    raise SpecjaxError(f'config key {key!r} must be one of {", ".join(_CHOICES[key])}, got {value!r}')
  return value


def _unknown(key: str) -> SpecjaxError:
  return SpecjaxError(f'unknown config key {key!r} (known: {", ".join(sorted(_SCHEMA))})')


@dataclasses.dataclass
class TrainConfig:
  """A resolved training config: flat {key: value} over the schema."""

  values: dict
  source: str = ''

  def __getitem__(self, key: str) -> Any:
    return self.values[key]

  def section(self, name: str) -> dict:
    prefix = name + '.'
    return {k[len(prefix) :]: v for k, v in self.values.items() if k.startswith(prefix)}

  def to_dict(self) -> dict:
    return unflatten(self.values)

  @property
  def hash(self) -> str:
    """What the run computes: values that differ from the defaults, minus those that only say how it runs."""
    return stable_hash({k: v for k, v in self.values.items() if k not in _RUN_ONLY and v != _SCHEMA[k]})


# Keys that change how a run goes, not what it computes: changing them keeps the run resumable.
_RUN_ONLY = {
    'name',
    'train.log_every',
    'train.save_every',
    'train.keep',
    'train.cache_target',
    'train.stop_after',
    'train.time_limit',
    'eval.every',
    'data.cache_dir',
}


def resolve(config, overrides: Iterable[str] | dict | None = None) -> TrainConfig:
  """A config file path, ConfigDict, dict or TrainConfig (+ overrides) -> a checked `TrainConfig`."""
  source = ''
  if isinstance(config, TrainConfig):
    source, config = config.source, config.to_dict()
  elif isinstance(config, (str, os.PathLike)):
    source = os.fspath(config)
    config = load_config_file(source)
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  elif isinstance(config, dict):
    config = copy.deepcopy(config)
  else:
    raise SpecjaxError(f'a training config must be an ml_collections.ConfigDict, got {type(config).__name__}')
  values = dict(_SCHEMA)
  for key, value in [*flatten(config).items(), *parse_overrides(overrides).items()]:
    if key not in _SCHEMA:
      raise _unknown(key)
    values[key] = _check_value(key, value)
  _check_ranges(values)
  return TrainConfig(values, source)


def _check_ranges(v: dict) -> None:
  positive = (
      'train.batch_size',
      'train.grad_accum',
      'data.max_len',
      'train.ttt_steps',
      'train.loss_chunk',
      'train.keep',
      'drafter.layers',
  )
  for key in positive + ('drafter.anchors',):
    if v[key] < 1:
      raise SpecjaxError(f'config key {key!r} must be at least 1, got {v[key]}')
  if v['drafter.head_from_target'] and v['drafter.kind'] not in ('eagle3', 'dflash'):
    raise SpecjaxError(f"config key 'drafter.head_from_target' applies to eagle3 and dflash, not {v['drafter.kind']}")
  if v['drafter.init_from'] is not None and v['drafter.head_from_target']:
    raise SpecjaxError("config keys 'drafter.init_from' and 'drafter.head_from_target' both set the first weights")
  if v['drafter.tap_scale']:
    if v['drafter.kind'] not in ('eagle3', 'dflash'):
      raise SpecjaxError(f"config key 'drafter.tap_scale' applies to eagle3 and dflash, not {v['drafter.kind']}")
    if v['drafter.init_from'] is not None:
      raise SpecjaxError("config key 'drafter.tap_scale' cannot rescale a drafter.init_from checkpoint's fc")
    normed = [k for k in ('drafter.norm_before_fc', 'drafter.fc_norm') if v['drafter.kind'] == 'eagle3' and v[k]]
    if normed:
      raise SpecjaxError(f"config key 'drafter.tap_scale' needs fc on the raw taps; {normed[0]} normalises them first")
  if not 0 <= v['drafter.context_dropout'] < 1:
    raise SpecjaxError(f"config key 'drafter.context_dropout' must be in [0, 1), got {v['drafter.context_dropout']}")
  if v['drafter.context_dropout'] and v['drafter.kind'] != 'dflash':
    raise SpecjaxError(f"config key 'drafter.context_dropout' applies to dflash, not {v['drafter.kind']}")
  if v['drafter.block_size'] < 2:
    raise SpecjaxError(f"config key 'drafter.block_size' must be at least 2 (one draft), got {v['drafter.block_size']}")
  if not v['train.dflash_gamma'] > 0:
    raise SpecjaxError(f"config key 'train.dflash_gamma' must be positive, got {v['train.dflash_gamma']}")
  for key in ('train.steps', 'eval.every', 'eval.limit', 'train.save_every', 'train.log_every', 'train.stop_after'):
    if v[key] < 0:
      raise SpecjaxError(f'config key {key!r} must be at least 0, got {v[key]}')
  if not v['train.time_limit'] >= 0:
    raise SpecjaxError(f"config key 'train.time_limit' must be minutes, at least 0, got {v['train.time_limit']}")
  if v['train.lr'] <= 0:
    raise SpecjaxError(f"config key 'train.lr' must be positive, got {v['train.lr']}")
  if not 0 <= v['train.warmup'] <= 1 or not 0 <= v['train.end_lr'] <= 1:
    raise SpecjaxError('config keys train.warmup and train.end_lr are fractions in [0, 1]')
  if not 0 <= v['train.hard_targets'] <= 1:
    raise SpecjaxError(f"config key 'train.hard_targets' must be in [0, 1], got {v['train.hard_targets']}")
  if not 0 < v['data.fraction'] <= 1:
    raise SpecjaxError(f"config key 'data.fraction' must be in (0, 1], got {v['data.fraction']}")
  if v['data.max_len'] < 4:
    raise SpecjaxError(f"config key 'data.max_len' must be at least 4, got {v['data.max_len']}")
  if v['data.path'] is None and not v['data.sources'] and v['train.steps'] > 0:
    raise SpecjaxError('no training data: set data.path (a jsonl) or data.sources (e.g. ["sharegpt"])')
