"""Config files and `key=value` overrides, shared by sweeps (`specjax.sweep.config`) and training
(`specjax.train.config`), each over its own schema.

  config = load_config_file('configs/sweep_tiny.py')       # the file's get_config(): an ml_collections.ConfigDict
  parse_overrides(['policy.k=4', 'prompts.limit=2'])     # {'policy.k': 4, 'prompts.limit': 2}
  flatten({'policy': {'k': 4}})                          # {'policy.k': 4}; unflatten is its inverse
"""

from __future__ import annotations

import ast
import importlib.util
import os
from typing import Any, Iterable

from specjax.errors import SpecjaxError
from specjax.provenance import stable_hash


def flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
  """Nested dicts -> {'a.b.c': leaf}."""
  out = {}
  for key, value in tree.items():
    path = f'{prefix}{key}'
    if isinstance(value, dict):
      out.update(flatten(value, path + '.'))
    else:
      out[path] = value
  return out


def unflatten(flat: dict) -> dict:
  """{'a.b.c': leaf} -> nested dicts."""
  out: dict = {}
  for key, value in flat.items():
    node = out
    *parents, leaf = key.split('.')
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def load_config_file(path: str):
  """Imports a config file by path and returns its `get_config()`."""
  if not os.path.isfile(path):
    raise SpecjaxError(f'config file {path!r} does not exist')
  spec = importlib.util.spec_from_file_location(f'specjax_config_{stable_hash(os.path.abspath(path))}', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SpecjaxError:
    raise
  except Exception as e:  # a broken config file is the user's mistake: one line naming it
    raise SpecjaxError(f'config file {path!r} failed to load: {type(e).__name__}: {e}') from None
  if not hasattr(module, 'get_config'):
    raise SpecjaxError(f'config file {path!r} defines no get_config()')
  try:
    return module.get_config()
  except SpecjaxError:
    raise
  except Exception as e:
    raise SpecjaxError(f'{path}: get_config() failed: {type(e).__name__}: {e}') from None


def parse_overrides(items: Iterable[str] | dict | None) -> dict[str, Any]:
  """`['policy.k=4', 'prompts.limit=2']` (or a dict) -> {key: value}; a value `ast.literal_eval` cannot read stays
  a string."""
  if not items:
    return {}
  if isinstance(items, dict):
    return dict(items)
  out = {}
  for item in items:
    key, sep, text = item.partition('=')
    key = key.strip()
    if not sep or not key:
      raise SpecjaxError(f'override {item!r} is not key=value')
    try:
      value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
      value = text.strip()
    out[key] = value
  return out
