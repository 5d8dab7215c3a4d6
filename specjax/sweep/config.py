"""Sweep configs: ml_collections files over one schema, command-line overrides, grid axes.

A config file defines `get_config()` returning an `ml_collections.ConfigDict`;
fields it leaves out keep the defaults of `base_config()`, and a field the
schema does not have is an error. `grid` holds the axes of the sweep, each a
non-empty list; every combination of their values is one cell:

  config.grid.drafter = {'kind': ['ngram', 'layer-skip']}    # axis 'drafter.kind'
  config.grid.policy = {'k': [2, 4, 6, 8]}                   # axis 'policy.k'
  config.grid.policy = [{'name': 'fixed', 'k': 4}, {'name': 'tuner'}]  # a section axis: partial updates
  config.grid.category = ['coding', 'math_reasoning']        # shorthand for prompts.categories = [c]

Overrides are `key=value` strings (`value` read with `ast.literal_eval`, else
kept as a string): `policy.k=4` fixes a key in every cell (removing an axis of
that name), `grid.policy.k=[2,4]` sets an axis.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from typing import Any, Iterable

import ml_collections

from specjax.config_files import flatten, load_config_file, parse_overrides, unflatten
from specjax.errors import SpecjaxError
from specjax.provenance import stable_hash

SECTIONS = ('drafter', 'sampling', 'prompts', 'policy')
NULLABLE = {'prompts.path': str, 'prompts.limit': int}  # keys that may be None, and their type otherwise


def _drafter_schema() -> dict[str, Any]:
  """The drafter section: `kind` and every registered family's options with their defaults."""
  from specjax.drafters.registry import option_fields

  return {'kind': 'ngram', **{name: f.default for name, f in option_fields().items()}}


def _drafter_nullable() -> dict[str, type]:
  """Drafter options that default to None, with the type they take otherwise."""
  from specjax.drafters.registry import option_fields

  return {f'drafter.{name}': f.metadata['type'] for name, f in option_fields().items() if f.default is None}


CATEGORY_AXIS = 'category'
RESOURCES = 'resources'  # worker resources: how a sweep runs, not what it computes


def base_config() -> ml_collections.ConfigDict:
  """The schema: every field a sweep config may set, with its default."""
  return ml_collections.ConfigDict(
      {
          'name': 'sweep',
          'model': 'gemma-3-270m',  # demo name, HF directory, .gguf file or hub id
          'attention_impl': 'auto',
          'drafter': _drafter_schema(),  # kind (a registered family) and each family's options
          'sampling': {'temperature': 0.0, 'top_k': 0, 'top_p': 1.0, 'min_p': 0.0, 'seed': 0},
          'prompts': {
              'path': None,  # jsonl with prompt/turns + category (None: Spec-Bench, `datasets.spec_bench_path`)
              'categories': [],  # empty: every category in the file
              'limit': None,  # prompts per category (None: all)
          },
          'max_new_tokens': 64,
          'policy': {
              'name': 'fixed',  # fixed | tuner | load
              'k': 4,  # the fixed policy's depth
              'candidates': [],  # adaptive policies' depths (empty: the drafter family's default set)
          },
          'batch_size': 1,  # prompts per generate call (batches never mix categories)
          'page_size': 16,
          'warmup': True,  # a batch whose run compiled an executable runs again, and the rerun is timed
          'repeats': 1,  # timed runs per batch; the fastest counts (the others are recorded)
          'interleave': False,  # prompt-major order: each batch runs in every cell before the next batch
          # Generate calls share the KV pages of repeated prefixes: a batch's rows, its reruns, and the cells one
          # engine runs (the same drafter; prompt-major order keeps a batch's pages until every cell has run it).
          'prefix_cache': True,
          'trace': False,  # results.jsonl keeps each speculative step's k, drafts, accepted count and emitted ids
          # What one cell asks of a worker under `backend='ray'` or `'slurm'` (not part of the config hash).
          'resources': {'cpus': 1.0, 'gpus': 0.0},
          'grid': {},
      }
  )


def _to_dict(config) -> dict:
  if isinstance(config, ml_collections.ConfigDict):
    return config.to_dict()
  if isinstance(config, dict):
    return copy.deepcopy(config)
  raise SpecjaxError(f'a sweep config must be an ml_collections.ConfigDict, got {type(config).__name__}')


_SCHEMA = flatten({k: v for k, v in base_config().to_dict().items() if k != 'grid'})
_NULLABLE = {**NULLABLE, **_drafter_nullable()}


def _check_value(key: str, value: Any) -> Any:
  """Type-checks one schema leaf; returns the value normalized (lists, floats)."""
  default = _SCHEMA[key]
  if value is None and key in _NULLABLE:
    return None
  want = _NULLABLE.get(key, type(default))
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if want is list and isinstance(value, (list, tuple)):
    return list(value)
  if want is int and isinstance(value, bool) or not isinstance(value, want):
    raise SpecjaxError(f'config key {key!r} must be {want.__name__}, got {value!r}')
  return value


def _unknown(key: str) -> SpecjaxError:
  known = ', '.join(sorted(_SCHEMA))
  return SpecjaxError(f'unknown config key {key!r} (known: {known}, grid.<key>)')


def _check_section(section: str, value: Any) -> dict:
  if not isinstance(value, dict):
    raise SpecjaxError(f'grid axis {section!r} takes dicts of {section} fields, got {value!r}')
  out = {}
  for key, v in value.items():
    path = f'{section}.{key}'
    if path not in _SCHEMA:
      raise _unknown(path)
    out[key] = _check_value(path, v)
  return out


def _check_axis(axis: str, values: Any) -> list:
  if not isinstance(values, (list, tuple)):
    raise SpecjaxError(f'grid axis {axis!r} must be a list of values, got {values!r}')
  if not values:
    raise SpecjaxError(f'grid axis {axis!r} has no values')
  if axis == CATEGORY_AXIS:
    bad = [v for v in values if not isinstance(v, str)]
    if bad:
      raise SpecjaxError(f'grid axis {axis!r} takes category names, got {bad}')
    return list(values)
  if axis in SECTIONS:
    return [_check_section(axis, v) for v in values]
  if axis.split('.')[0] == RESOURCES:
    raise SpecjaxError(f'{axis!r} cannot be a grid axis: every worker of a sweep asks for the same resources')
  if axis not in _SCHEMA:
    raise SpecjaxError(f'unknown grid axis {axis!r} (an axis is a config key, a section, or {CATEGORY_AXIS!r})')
  return [_check_value(axis, v) for v in values]


def _grid_axes(grid: dict) -> dict[str, list]:
  """Flattens `grid` to {axis: values}: a list leaf is an axis (sections hold lists of dicts)."""
  axes = {}

  def walk(node: dict, prefix: str):
    for key, value in node.items():
      path = f'{prefix}{key}'
      if isinstance(value, dict):
        walk(value, path + '.')
      else:
        axes[path] = _check_axis(path, value)

  if not isinstance(grid, dict):
    raise SpecjaxError(f'config grid must be a dict of axes, got {grid!r}')
  walk(grid, '')
  return axes


@dataclasses.dataclass
class SweepConfig:
  """A resolved sweep: base values (overrides applied), grid axes and the pinned overrides."""

  base: dict  # flat {key: value}
  axes: dict[str, list]
  pinned: dict  # flat {key: value} from the command line, applied last in every cell
  source: str = ''

  def to_dict(self) -> dict:
    nested = unflatten(self.base)
    nested['grid'] = {axis: values for axis, values in self.axes.items()}
    return nested

  def to_config_dict(self) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({**unflatten(self.base), 'grid': unflatten(self.axes)})

  @property
  def hash(self) -> str:
    """Identifies what the sweep computes: values that differ from the schema defaults, and the grid."""
    return stable_hash({'base': changed(self.base), 'grid': self.axes})

  @property
  def resources(self) -> dict:
    """{'cpus', 'gpus'}: what each cell asks of a Ray or SLURM worker."""
    return {k.split('.', 1)[1]: v for k, v in self.base.items() if k.split('.')[0] == RESOURCES}


def changed(flat: dict) -> dict:
  """The entries of a flat config that differ from the schema defaults (new fields keep old hashes).

  Worker resources are left out: a sweep resumed on another backend or cluster keeps its hash.
  """
  return {k: v for k, v in flat.items() if k.split('.')[0] != RESOURCES and (k not in _SCHEMA or v != _SCHEMA[k])}


def resolve(config, overrides: Iterable[str] | dict | None = None) -> SweepConfig:
  """A config file path, ConfigDict or dict (+ overrides) -> a checked `SweepConfig`."""
  source = ''
  if isinstance(config, SweepConfig):
    if not overrides:
      return config
    config = config.to_dict()
  elif isinstance(config, (str, os.PathLike)):
    source = os.fspath(config)
    config = load_config_file(source)
  user = _to_dict(config)
  grid = user.pop('grid', None) or {}
  base = dict(_SCHEMA)
  for key, value in flatten(user).items():
    if key not in _SCHEMA:
      raise _unknown(key)
    base[key] = _check_value(key, value)
  for section in SECTIONS:
    if section in user and not isinstance(user[section], dict):
      raise SpecjaxError(f'config key {section!r} is a section; set its fields ({section}.<field>)')
  axes = _grid_axes(grid)
  pinned = {}
  for key, value in parse_overrides(overrides).items():
    if key.startswith('grid.'):
      axis = key[len('grid.') :]
      axes[axis] = _check_axis(axis, value)
    elif key in _SCHEMA:
      pinned[key] = base[key] = _check_value(key, value)
      axes.pop(key, None)
    else:
      raise _unknown(key)
  if CATEGORY_AXIS in axes and 'prompts.categories' in axes:
    raise SpecjaxError(f'grid has both {CATEGORY_AXIS!r} and "prompts.categories"; use one')
  return SweepConfig(base, axes, pinned, source)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One combination of grid values, fully resolved."""

  id: str
  values: dict  # {axis: value}
  config: dict  # flat {key: value}

  @property
  def label(self) -> str:
    return ' '.join(f'{a}={_short(v)}' for a, v in self.values.items()) or 'base'

  def section(self, name: str) -> dict:
    prefix = name + '.'
    return {k[len(prefix) :]: v for k, v in self.config.items() if k.startswith(prefix)}


def _short(value) -> str:
  if isinstance(value, dict):
    return ','.join(f'{k}:{v}' for k, v in value.items())
  return str(value)


def expand(sweep: SweepConfig) -> list[Cell]:
  """Every combination of the grid axes (sorted by axis name), deduplicated by resolved values."""
  names = sorted(sweep.axes)
  cells, seen = [], set()
  for combo in itertools.product(*(sweep.axes[a] for a in names)):
    flat = dict(sweep.base)
    for axis, value in zip(names, combo):
      if axis == CATEGORY_AXIS:
        flat['prompts.categories'] = [value]
      elif axis in SECTIONS:
        flat.update({f'{axis}.{k}': v for k, v in value.items()})
      else:
        flat[axis] = value
    flat.update(sweep.pinned)
    flat.pop('name', None)  # the sweep's name does not change what a cell computes
    for key in [k for k in flat if k.split('.')[0] == RESOURCES]:
      del flat[key]
    cid = stable_hash(changed(flat))
    if cid not in seen:
      seen.add(cid)
      cells.append(Cell(cid, dict(zip(names, combo)), flat))
  return cells
