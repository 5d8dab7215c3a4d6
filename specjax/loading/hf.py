"""Local HF directories and hub ids: config.json, generation_config.json,
single or sharded safetensors, tokenizer.json."""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults

WEIGHT_PATTERNS = ['config.json', 'generation_config.json', '*.safetensors', 'model.safetensors.index.json',
                   'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json']


def read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise SpecjaxError(f'{path} is not valid JSON: {e}') from None


def safetensors_files(directory: str) -> list[str]:
  """The weight files of a checkpoint directory, from the shard index if any."""
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.exists(index):
    shards = sorted(set(read_json(index).get('weight_map', {}).values()))
    missing = [s for s in shards if not os.path.exists(os.path.join(directory, s))]
    if missing:
      raise SpecjaxError(f'{directory}: shard index names missing files {missing}')
    return [os.path.join(directory, s) for s in shards]
  single = os.path.join(directory, 'model.safetensors')
  if os.path.exists(single):
    return [single]
  files = sorted(f for f in os.listdir(directory) if f.endswith('.safetensors'))
  if not files:
    raise SpecjaxError(f'{directory}: no safetensors weights (model.safetensors or a shard index)')
  return [os.path.join(directory, f) for f in files]


def read_safetensors(files: list[str], skip: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
  """All tensors (but names starting with `skip`) as float32 numpy arrays (bf16/f16 are widened)."""
  from safetensors import safe_open
  tensors = {}
  for path in files:
    with safe_open(path, framework='numpy') as f:
      for name in f.keys():
        if not (skip and name.startswith(skip)):
          tensors[name] = np.asarray(f.get_tensor(name), np.float32)
  return tensors


def tensor_names(directory: str) -> set[str]:
  """Weight names of a checkpoint directory, from the safetensors headers only."""
  from safetensors import safe_open
  names = set()
  for path in safetensors_files(directory):
    with safe_open(path, framework='numpy') as f:
      names.update(f.keys())
  return names


def generation_defaults(directory: str, config: dict) -> GenerationDefaults:
  gen_path = os.path.join(directory, 'generation_config.json')
  gen = read_json(gen_path) if os.path.exists(gen_path) else {}
  eos = gen.get('eos_token_id', config.get('eos_token_id'))
  eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
  return GenerationDefaults(
      eos_token_ids=eos,
      bos_token_id=gen.get('bos_token_id', config.get('bos_token_id')),
      pad_token_id=gen.get('pad_token_id', config.get('pad_token_id')),
      temperature=gen.get('temperature') if gen.get('do_sample') else None,
      top_k=gen.get('top_k') if gen.get('do_sample') else None,
      top_p=gen.get('top_p') if gen.get('do_sample') else None,
      min_p=gen.get('min_p') if gen.get('do_sample') else None,
  )


def read_hf_config(directory: str) -> dict:
  if not os.path.isdir(directory):
    raise SpecjaxError(f'{directory} is not a directory')
  path = os.path.join(directory, 'config.json')
  if not os.path.exists(path):
    raise SpecjaxError(f'{directory} has no config.json (not an HF checkpoint directory)')
  return read_json(path)


def load_hf_dir(directory: str, *, config: dict | None = None, skip: tuple[str, ...] = ()) -> Checkpoint:
  """Loads a local HF checkpoint directory (weights named `skip*` are not read)."""
  from specjax.loading.tokenizer import Tokenizer
  config = config or read_hf_config(directory)
  generation = generation_defaults(directory, config)
  tok_path = os.path.join(directory, 'tokenizer.json')
  if not os.path.exists(tok_path):
    raise SpecjaxError(f'{directory} has no tokenizer.json')
  tokenizer = Tokenizer.from_file(tok_path, bos_id=generation.bos_token_id, eos_ids=generation.eos_token_ids)
  tensors = read_safetensors(safetensors_files(directory), skip)
  return Checkpoint(config, tensors, tokenizer, generation, source=os.path.abspath(directory))


def hub_offline() -> bool:
  value = os.environ.get('HF_HUB_OFFLINE', '')
  return value.upper() in ('1', 'ON', 'YES', 'TRUE')


def hub_cache_dir() -> str | None:
  """The HF cache folder as the environment says now (HF_HUB_CACHE, then HF_HOME)."""
  if os.environ.get('HF_HUB_CACHE'):
    return os.environ['HF_HUB_CACHE']
  if os.environ.get('HF_HOME'):
    return os.path.join(os.environ['HF_HOME'], 'hub')
  return None


def resolve_hub_id(repo_id: str, revision: str | None = None) -> str:
  """Local snapshot directory of a hub id, from the cache when offline.

  Honours `HF_HOME` / `HF_HUB_CACHE` and `HF_HUB_OFFLINE=1` (then only the local
  cache is consulted).
  """
  import huggingface_hub
  from huggingface_hub import errors
  try:
    return huggingface_hub.snapshot_download(
        repo_id, revision=revision, allow_patterns=WEIGHT_PATTERNS, cache_dir=hub_cache_dir(),
        local_files_only=hub_offline())
  except errors.HFValidationError:
    raise SpecjaxError(f'{repo_id!r} is neither a local path nor a valid hub id') from None
  except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError):
    raise SpecjaxError(f'{repo_id}: no such hub repository or revision (or access denied)') from None
  except (errors.LocalEntryNotFoundError, FileNotFoundError):
    why = 'HF_HUB_OFFLINE is set' if hub_offline() else 'the hub is unreachable'
    raise SpecjaxError(f'{repo_id}: not in the local HF cache and {why}') from None
  except (errors.HfHubHTTPError, OSError) as e:
    raise SpecjaxError(f'{repo_id}: could not download from the hub: {e}') from None
