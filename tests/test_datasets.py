"""Spec-Bench data: resolution order, the pinned sha256, the cache, and errors (no network: the downloader is
replaced)."""

import collections
import hashlib
import json
import os

import pytest

from specjax import bench, datasets
from specjax.errors import SpecjaxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = b'{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n'
BAD = b'{"question_id": 1, "category": "qa", "turns": ["Tampered"]}\n'


@pytest.fixture
def sources(tmp_path, monkeypatch):
  """No env var, an empty cache and no checkout copy under tmp_path; GOOD is the pinned content."""
  monkeypatch.delenv(datasets.SPEC_BENCH_ENV, raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  seed = tmp_path / 'shared' / 'question.jsonl'
  monkeypatch.setattr(datasets, 'spec_bench_seed_path', lambda: str(seed))
  monkeypatch.setattr(datasets, 'SPEC_BENCH_SHA256', hashlib.sha256(GOOD).hexdigest())
  downloads = []

  def download(url, timeout=60.0):
    downloads.append(url)
    raise OSError('network is unreachable')

  monkeypatch.setattr(datasets, '_download', download)
  return tmp_path, seed, downloads


def write(path, data=GOOD):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)
  return str(path)


def test_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
  assert datasets.cache_dir() == str(tmp_path / 'specjax')
  monkeypatch.delenv('XDG_CACHE_HOME')
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  assert datasets.cache_dir() == str(tmp_path / 'home' / '.cache' / 'specjax')
  assert datasets.spec_bench_cache_path() == str(
      tmp_path / 'home' / '.cache' / 'specjax' / 'spec_bench' / datasets.SPEC_BENCH_COMMIT / 'question.jsonl'
  )


def test_seed_path_is_beside_the_checkout_not_the_cwd(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  want = os.path.normpath(os.path.join(ROOT, '..', 'shared', 'data', 'spec_bench', 'question.jsonl'))
  assert datasets.spec_bench_seed_path() == want


def test_pinned_url():
  assert datasets.SPEC_BENCH_URL == (
      'https://raw.githubusercontent.com/hemingkx/Spec-Bench/'
      f'{datasets.SPEC_BENCH_COMMIT}/data/spec_bench/question.jsonl'
  )
  assert len(datasets.SPEC_BENCH_COMMIT) == 40 and len(datasets.SPEC_BENCH_SHA256) == 64


def test_resolution_order(sources, monkeypatch):
  tmp, seed, downloads = sources
  cached = datasets.spec_bench_cache_path()
  explicit = write(tmp / 'explicit.jsonl', BAD)  # explicit and env files are used as given, sha unchecked
  env = write(tmp / 'env.jsonl', BAD)
  write(seed)
  write(tmp / 'cache' / 'specjax' / 'spec_bench' / datasets.SPEC_BENCH_COMMIT / 'question.jsonl')
  monkeypatch.setenv(datasets.SPEC_BENCH_ENV, env)
  assert datasets.spec_bench_path(explicit) == explicit
  assert datasets.spec_bench_path() == env
  monkeypatch.delenv(datasets.SPEC_BENCH_ENV)
  assert datasets.spec_bench_path() == cached
  os.remove(cached)
  assert datasets.spec_bench_path() == cached and open(cached, 'rb').read() == GOOD  # seeded
  os.remove(cached)
  os.remove(seed)
  with pytest.raises(SpecjaxError):
    datasets.spec_bench_path()
  assert downloads == [datasets.SPEC_BENCH_URL]


def test_download_is_verified_and_written_atomically(sources, monkeypatch):
  tmp, seed, downloads = sources
  monkeypatch.setattr(datasets, '_download', lambda url, timeout=60.0: downloads.append(url) or GOOD)
  path = datasets.spec_bench_path()
  assert path == datasets.spec_bench_cache_path() and open(path, 'rb').read() == GOOD
  assert os.listdir(os.path.dirname(path)) == ['question.jsonl']  # no temporary file left
  assert datasets.spec_bench_path() == path and len(downloads) == 1  # the second call reads the cache


def test_download_with_wrong_sha_is_refused(sources, monkeypatch):
  monkeypatch.setattr(datasets, '_download', lambda url, timeout=60.0: BAD)
  with pytest.raises(SpecjaxError, match='sha256 .* not the pinned Spec-Bench.*not used'):
    datasets.spec_bench_path()
  assert not os.path.exists(datasets.spec_bench_cache_path())


def test_cached_file_with_wrong_sha_is_refused(sources):
  tmp, seed, downloads = sources
  write(seed)
  cached = write(tmp / 'cache' / 'specjax' / 'spec_bench' / datasets.SPEC_BENCH_COMMIT / 'question.jsonl', BAD)
  with pytest.raises(SpecjaxError, match=f'cached {cached} has sha256 .*not used'):
    datasets.spec_bench_path()
  assert open(cached, 'rb').read() == BAD and not downloads  # left for the user to inspect


def test_checkout_copy_with_wrong_sha_is_not_used(sources, monkeypatch):
  tmp, seed, downloads = sources
  write(seed, BAD)
  with pytest.raises(SpecjaxError, match=f'the copy {seed} has sha256 .*not used'):
    datasets.spec_bench_path()
  assert downloads  # fell through to the download
  monkeypatch.setattr(datasets, '_download', lambda url, timeout=60.0: GOOD)
  assert open(datasets.spec_bench_path(), 'rb').read() == GOOD


def test_no_source_is_one_line_naming_where_it_looked(sources):
  tmp, seed, downloads = sources
  with pytest.raises(SpecjaxError) as e:
    datasets.spec_bench_path()
  msg = str(e.value)
  assert '\n' not in msg
  for part in (
      datasets.SPEC_BENCH_ENV,
      datasets.spec_bench_cache_path(),
      str(seed),
      datasets.SPEC_BENCH_URL,
      'network is unreachable',
      '--prompts',
  ):
    assert part in msg
  with pytest.raises(SpecjaxError, match='downloading is off'):
    datasets.spec_bench_path(download=False)
  assert len(downloads) == 1


def test_missing_explicit_or_env_file(sources, monkeypatch):
  tmp, seed, downloads = sources
  write(seed)
  with pytest.raises(SpecjaxError, match='does not exist'):
    datasets.spec_bench_path(str(tmp / 'nope.jsonl'))
  monkeypatch.setenv(datasets.SPEC_BENCH_ENV, str(tmp / 'nope.jsonl'))
  with pytest.raises(SpecjaxError, match=f'{datasets.SPEC_BENCH_ENV}=.*does not exist'):
    datasets.spec_bench_path()


def test_unwritable_cache_reads_the_checkout_copy(sources, monkeypatch):
  tmp, seed, downloads = sources
  write(seed)
  (tmp / 'cache').write_text('a file, not a folder')
  assert datasets.spec_bench_path() == str(seed)


def test_load_prompts_defaults_to_spec_bench(sources):
  tmp, seed, downloads = sources
  write(seed)
  rows = bench.load_prompts()
  assert [(r.id, r.category, r.text) for r in rows] == [('1', 'qa', 'Why?')]


def test_real_spec_bench(spec_bench):
  """The local copy (env var, cache or checkout) is Spec-Bench: 480 questions, 13 categories."""
  if spec_bench != os.environ.get(datasets.SPEC_BENCH_ENV):
    with open(spec_bench, 'rb') as f:
      assert hashlib.sha256(f.read()).hexdigest() == datasets.SPEC_BENCH_SHA256
  rows = bench.load_prompts(spec_bench)
  assert len(rows) == 480
  counts = collections.Counter(r.category for r in rows)
  assert len(counts) == 13 and counts['math_reasoning'] == 80
  with open(spec_bench, encoding='utf-8') as f:
    assert all(json.loads(line)['turns'] for line in f)
