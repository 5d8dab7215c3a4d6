"""What a run records about itself, shared by sweeps, training and benchmarks: manifest.json, the commit, package
versions, the device, file and value hashes.

  manifest = {'git': git_info(), 'versions': package_versions(), 'device': device_description(), 'started': now()}
  write_json(os.path.join(out, MANIFEST), manifest)        # atomic: a temp file, then a rename
  read_manifest(out)                                       # None where out has none
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from typing import Any, Iterable

from specjax.errors import SpecjaxError

MANIFEST = 'manifest.json'
PACKAGES = ('specjax', 'jax', 'jaxlib', 'flax', 'numpy', 'ml_collections', 'tokenizers', 'gguf', 'matplotlib')


def now() -> str:
  """The time in UTC, ISO 8601 to the second."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def git_info(path: str | None = None) -> dict:
  """Commit and dirty flag (tracked files only) of the repository holding `path` (the specjax checkout by default);
  None for both outside a repository or without git."""
  path = path or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    return subprocess.run(['git', '-C', path, *args], capture_output=True, text=True, timeout=10)

  try:
    head = git('rev-parse', 'HEAD')
    if head.returncode:
      return {'commit': None, 'dirty': None}
    status = git('status', '--porcelain', '--untracked-files=no')
    return {'commit': head.stdout.strip(), 'dirty': bool(status.stdout.strip())}
  except (OSError, subprocess.SubprocessError):
    return {'commit': None, 'dirty': None}


def package_versions(extra: Iterable[str] = ()) -> dict:
  """Python's version and each installed version of `PACKAGES` and `extra` (None: not installed)."""
  out = {'python': platform.python_version()}
  for name in (*PACKAGES, *extra):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def device_description() -> dict:
  """jax's backend and devices, the host and its CPUs."""
  import jax

  return {
      'backend': jax.default_backend(),
      'devices': [f'{d.platform}:{getattr(d, "device_kind", "")}' for d in jax.devices()],
      'host': platform.platform(),
      'processor': platform.processor() or platform.machine(),
      'cpu_count': os.cpu_count(),
  }


def file_sha256(path: str) -> str | None:
  """The file's sha256 in hex (None: no such file)."""
  if not os.path.isfile(path):
    return None
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def stable_hash(value: Any, length: int = 12) -> str:
  """The first `length` hex digits of the sha256 of `value` as canonical JSON (sorted keys; `str` of the rest)."""
  text = json.dumps(value, sort_keys=True, separators=(',', ':'), default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:length]


def read_manifest(out_dir: str) -> dict | None:
  """`out_dir`'s manifest.json (None: there is none); an unreadable one is an error, never overwritten."""
  path = os.path.join(out_dir, MANIFEST)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (json.JSONDecodeError, OSError) as e:
    raise SpecjaxError(f'{path} is unreadable ({e}); refusing to overwrite it') from None


def write_json(path: str, value) -> None:
  """Writes `value` as indented JSON through a temporary file and a rename: readers see the old file or the new."""
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2, sort_keys=False)
    f.write('\n')
  os.replace(tmp, path)
