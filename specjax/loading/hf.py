"""Local HF directories and hub ids: config.json, generation_config.json,
single or sharded safetensors, tokenizer.json."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults

WEIGHT_PATTERNS = [
    'config.json',
    'generation_config.json',
    '*.safetensors',
    'model.safetensors.index.json',
    'tokenizer.json',
    'tokenizer_config.json',
    'special_tokens_map.json',
]


def _umask() -> int:
  mask = os.umask(0o022)  # the only way to read it: set, then put back
  os.umask(mask)
  return mask


EXPORT_FILES = ('config.json', 'generation_config.json', 'model.safetensors')  # what specjax's exports write


def write_checkpoint(directory: str, files: dict[str, dict], tensors: dict[str, np.ndarray]) -> None:
  """Writes `files` (name -> JSON object) and `tensors` (`model.safetensors`) as the directory `directory`.

  Into a temporary sibling first, renamed into place, so a write cut short
  leaves no partial checkpoint: a new directory appears whole; an earlier
  export there (nothing but `EXPORT_FILES`, as at every training checkpoint)
  is replaced whole, and stays as it was if the write fails. A directory with
  other files keeps them and gets each file renamed in. Files get mode 0666
  and a new directory 0777, less the umask (as `open` gives; safetensors alone
  writes 0600).
  """
  from safetensors.numpy import save_file

  if os.path.exists(directory) and not os.path.isdir(directory):
    raise SpecjaxError(f'{directory} exists and is not a directory')
  directory = os.path.abspath(directory)  # no trailing separator
  parent, name = os.path.split(directory)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f'.{name}.', suffix='.tmp')
  try:
    for file, obj in files.items():
      with open(os.path.join(tmp, file), 'w', encoding='utf-8') as f:
        json.dump(obj, f, indent=2)
        f.write('\n')
    save_file(tensors, os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
    mask = _umask()
    for file in os.listdir(tmp):
      os.chmod(os.path.join(tmp, file), 0o666 & ~mask)
    os.chmod(tmp, 0o777 & ~mask)
    if not os.path.isdir(directory):
      os.rename(tmp, directory)
    elif set(os.listdir(directory)) <= set(EXPORT_FILES) and directory != os.getcwd():
      old = tmp[: -len('.tmp')] + '.old'
      os.rename(directory, old)
      try:
        os.rename(tmp, directory)
      except BaseException:
        os.rename(old, directory)
        raise
      shutil.rmtree(old, ignore_errors=True)
    else:  # other files live there: each of ours renamed in, the weights last
      for file in sorted(os.listdir(tmp), key=lambda f: f.endswith('.safetensors')):
        os.replace(os.path.join(tmp, file), os.path.join(directory, file))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


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
    weight_map = read_json(index)
    weight_map = weight_map.get('weight_map') if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
      raise SpecjaxError(f'{index}: no "weight_map" of tensor names to shard files')
    shards = sorted(set(weight_map.values()))
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


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


def safetensors_header(path: str) -> dict[str, dict]:
  """The tensor entries of a safetensors file's JSON header, checked against the file's size.

  Raises:
    SpecjaxError: the file is empty, not a safetensors file, truncated, or its header is bad.
  """
  try:
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
      prefix = f.read(8)
      length = int.from_bytes(prefix, 'little') if len(prefix) == 8 else 0
      raw = f.read(min(length, MAX_HEADER_BYTES, max(size - 8, 0)))
  except OSError as e:
    raise SpecjaxError(f'cannot read {path}: {e.strerror or e}') from None
  if size == 0:
    raise SpecjaxError(f'{path} is empty, not a safetensors file')
  if size < 8:
    raise SpecjaxError(f'{path} is not a safetensors file ({size} bytes, too short for the header length)')
  if raw[:1] != b'{' or length > MAX_HEADER_BYTES:
    raise SpecjaxError(f'{path} is not a safetensors file (no JSON header after the 8-byte header length)')
  if length > size - 8:
    raise SpecjaxError(f'{path} is truncated: its header needs {length} bytes, only {size - 8} follow')
  try:
    header = json.loads(raw.decode('utf-8'))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise SpecjaxError(f'{path} has a bad safetensors header (not valid JSON: {e})') from None
  header.pop('__metadata__', None)
  end = 0
  for name, info in header.items():
    offsets = info.get('data_offsets') if isinstance(info, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
        or not isinstance(info.get('dtype'), str)
        or not isinstance(info.get('shape'), list)
    ):
      raise SpecjaxError(f'{path} has a bad safetensors header (tensor {name!r}: {info!r:.80})')
    end = max(end, offsets[1])
  data = size - 8 - length
  if end > data:
    raise SpecjaxError(f'{path} is truncated: its tensors need {end} bytes of data, only {data} follow the header')
  if end < data:
    raise SpecjaxError(f'{path} is corrupt: {data - end} bytes follow the last tensor')
  return header


def read_safetensors(files: list[str], skip: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
  """All tensors (but names starting with `skip`) as float32 numpy arrays (bf16/f16 are widened)."""
  from safetensors import SafetensorError, safe_open

  tensors = {}
  for path in files:
    safetensors_header(path)  # one clear error for a truncated or corrupt file
    try:
      with safe_open(path, framework='numpy') as f:
        for name in f.keys():
          if not (skip and name.startswith(skip)):
            tensors[name] = np.asarray(f.get_tensor(name), np.float32)
    except (SafetensorError, OSError) as e:
      raise SpecjaxError(f'{path} is not a valid safetensors file: {" ".join(str(e).split())}') from None
  return tensors


def check_tensor_shapes(
    shapes: dict[str, tuple[int, ...]],
    want: dict[str, tuple[int, ...]],
    where: str,
    *,
    ignore: tuple[str, ...] = (),
    name=lambda n: n,
) -> None:
  """One `SpecjaxError` line unless a checkpoint's tensor `shapes` are exactly `want` (from its headers alone).

  `ignore`: names allowed besides `want`; `name`: the checkpoint's own spelling of a name, for the message.
  """
  missing = [name(n) for n in want if n not in shapes]
  if missing:
    raise SpecjaxError(f'{where}: missing tensors {missing[:6]}{" ..." if len(missing) > 6 else ""}')
  for n, shape in want.items():
    if shapes[n] != shape:
      raise SpecjaxError(f'{where}: tensor {name(n)!r} has shape {list(shapes[n])}, the config implies {list(shape)}')
  extra = sorted(name(n) for n in set(shapes) - set(want) - set(ignore))
  if extra:
    raise SpecjaxError(f'{where}: {len(extra)} unexpected tensors, e.g. {extra[:5]}')


def tensor_names(directory: str) -> set[str]:
  """Weight names of a checkpoint directory, from the safetensors headers only."""
  names = set()
  for path in safetensors_files(directory):
    names.update(safetensors_header(path))
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
        repo_id,
        revision=revision,
        allow_patterns=WEIGHT_PATTERNS,
        cache_dir=hub_cache_dir(),
        local_files_only=hub_offline(),
    )
  except errors.HFValidationError:
    raise SpecjaxError(f'{repo_id!r} is neither a local path nor a valid hub id') from None
  except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError):
    raise SpecjaxError(f'{repo_id}: no such hub repository or revision (or access denied)') from None
  except (errors.LocalEntryNotFoundError, FileNotFoundError):
    why = 'HF_HUB_OFFLINE is set' if hub_offline() else 'the hub is unreachable'
    raise SpecjaxError(f'{repo_id}: not in the local HF cache and {why}') from None
  except (errors.HfHubHTTPError, OSError) as e:
    raise SpecjaxError(f'{repo_id}: could not download from the hub: {e}') from None
