"""Evaluation data: the Spec-Bench prompts, found locally or downloaded at a pinned commit.

Spec-Bench (https://github.com/hemingkx/Spec-Bench, Apache-2.0) `data/spec_bench/question.jsonl`: 480
questions in 13 categories. It is evaluation data only; nothing in specjax trains on it.

`spec_bench_path()` looks, in order, at an explicit path, `$SPECJAX_SPEC_BENCH`, the user cache
(`cache_dir()/spec_bench/<commit>/question.jsonl`), the copy beside this checkout
(`<repository root>/../shared/data/spec_bench/question.jsonl`, copied into the cache), and finally downloads
the file at the pinned commit into the cache. Files from the cache, the checkout's copy and the download must
have the pinned sha256; an explicit path or `$SPECJAX_SPEC_BENCH` is used as given.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from specjax.errors import SpecjaxError

SPEC_BENCH_ENV = 'SPECJAX_SPEC_BENCH'
SPEC_BENCH_REPO = 'hemingkx/Spec-Bench'
SPEC_BENCH_COMMIT = 'fd2c1cd7d2201ef71db4c5f4e455008f017967bf'  # 2025-04-22; the file is unchanged since 66230f1
SPEC_BENCH_FILE = 'data/spec_bench/question.jsonl'
SPEC_BENCH_SHA256 = '4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04'
SPEC_BENCH_URL = f'https://raw.githubusercontent.com/{SPEC_BENCH_REPO}/{SPEC_BENCH_COMMIT}/{SPEC_BENCH_FILE}'


def cache_dir() -> str:
  """specjax's user cache: `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`."""
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'specjax')


def spec_bench_cache_path() -> str:
  """Where the pinned question.jsonl lives in the user cache."""
  return os.path.join(cache_dir(), 'spec_bench', SPEC_BENCH_COMMIT, 'question.jsonl')


def spec_bench_seed_path() -> str:
  """The copy beside this checkout, from the package's location (never the working directory)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return os.path.normpath(os.path.join(root, '..', 'shared', 'data', 'spec_bench', 'question.jsonl'))


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _read(path: str) -> bytes:
  with open(path, 'rb') as f:
    return f.read()


def _write_atomic(path: str, data: bytes) -> None:
  """Writes `data` to `path` through a temporary file in the same folder, so `path` is never partial."""
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix='.question.jsonl.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


def _download(url: str, timeout: float = 60.0) -> bytes:
  """The bytes at `url` (raises OSError or http.client.HTTPException on failure)."""
  import urllib.request

  with urllib.request.urlopen(url, timeout=timeout) as response:
    return response.read()


def _mismatch(what: str, path: str, got: str) -> str:
  return f'{what} {path} has sha256 {got}, not the pinned Spec-Bench {SPEC_BENCH_SHA256}'


def spec_bench_path(path: str | None = None, *, download: bool = True) -> str:
  """Path of Spec-Bench `question.jsonl`.

  Args:
    path: an explicit file (`--prompts`); used as given when set.
    download: fetch the file at the pinned commit when no local copy exists.

  Returns:
    `path`, `$SPECJAX_SPEC_BENCH`, or the verified copy in the user cache (seeded from the checkout's copy or
    downloaded on first use).

  Raises:
    SpecjaxError: a named file is missing, a cached or downloaded file has the wrong sha256, or no source
      has the file.
  """
  if path:
    if not os.path.isfile(path):
      raise SpecjaxError(f'prompt file {path!r} does not exist')
    return path
  env = os.environ.get(SPEC_BENCH_ENV)
  if env:
    if not os.path.isfile(env):
      raise SpecjaxError(f'{SPEC_BENCH_ENV}={env!r} does not exist')
    return env
  cached = spec_bench_cache_path()
  if os.path.isfile(cached):
    got = _sha256(_read(cached))
    if got != SPEC_BENCH_SHA256:
      raise SpecjaxError(f'{_mismatch("cached", cached, got)}; not used (delete it to fetch it again)')
    return cached
  seed = spec_bench_seed_path()
  notes = [f'{SPEC_BENCH_ENV} not set', f'not in the cache ({cached})']
  if os.path.isfile(seed):
    data = _read(seed)
    got = _sha256(data)
    if got == SPEC_BENCH_SHA256:
      try:
        _write_atomic(cached, data)
      except OSError:
        return seed  # the cache is not writable: read the verified copy in place
      return cached
    notes.append(f'{_mismatch("the copy", seed, got)}, not used')
  else:
    notes.append(f'no copy at {seed}')
  if not download:
    notes.append('downloading is off')
  else:
    import http.client

    try:
      data = _download(SPEC_BENCH_URL)
    except (OSError, http.client.HTTPException, ValueError) as e:
      notes.append(f'the download failed ({getattr(e, "reason", None) or e})')
    else:
      got = _sha256(data)
      if got != SPEC_BENCH_SHA256:
        raise SpecjaxError(f'{_mismatch("the download of", SPEC_BENCH_URL, got)}; not used')
      try:
        _write_atomic(cached, data)
      except OSError as e:
        raise SpecjaxError(
            f'cannot write the Spec-Bench cache {cached}: {e.strerror or e}; set XDG_CACHE_HOME or {SPEC_BENCH_ENV}'
        ) from None
      return cached
  raise SpecjaxError(
      f'Spec-Bench question.jsonl not found: {"; ".join(notes)}. Save {SPEC_BENCH_URL} as {cached}, '
      f'set {SPEC_BENCH_ENV}=FILE, or pass --prompts FILE'
  )
