"""`specjax sweep --backend ray|slurm`: the rows of the local backend, a killed worker retried, reruns resume."""

import json
import os
import shutil

import pytest

from specjax.errors import SpecjaxError
from specjax.sweep import artifacts, backends, run_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(ROOT, 'configs', 'sweep_tiny.py')
PROMPTS = [
    {'question_id': 1, 'category': 'copy', 'turns': ['a b a b a b a b']},
    {'question_id': 2, 'category': 'free', 'turns': ['Hello world']},
    {'question_id': 3, 'category': 'free', 'turns': ['red green blue']},
]

ray = pytest.importorskip('ray')
pytest.importorskip('submitit')


@pytest.fixture(scope='module')
def overrides(tmp_path_factory):
  path = tmp_path_factory.mktemp('prompts') / 'questions.jsonl'
  path.write_text(''.join(json.dumps(p) + '\n' for p in PROMPTS))
  return [
      f'prompts.path={str(path)!r}',
      'prompts.categories=[]',
      'prompts.limit=None',
      'max_new_tokens=8',
      'grid.drafter.kind=["ngram"]',
      'grid.policy=[{"name": "fixed", "k": 2}, {"name": "fixed", "k": 3}]',
  ]


@pytest.fixture(scope='module')
def kill_file(tmp_path_factory):
  return str(tmp_path_factory.mktemp('kill') / 'cell')


@pytest.fixture(scope='module')
def cluster(kill_file):
  """One local Ray cluster for the module: 2 CPUs, loopback, no dashboard; its workers see the kill hook."""
  os.environ[backends.KILL_ENV] = kill_file
  ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1', log_to_driver=False)
  yield
  ray.shutdown()
  del os.environ[backends.KILL_ENV]


@pytest.fixture(scope='module')
def local_run(tmp_path_factory, overrides):
  out = str(tmp_path_factory.mktemp('local') / 'out')
  run_sweep(TINY_CONFIG, out, overrides, progress=False, make_plots=False)
  return out


def lines(out):
  with open(os.path.join(out, artifacts.RESULTS)) as f:
    return [artifacts.comparable(json.loads(line)) for line in f]


def manifest(out):
  m = json.load(open(os.path.join(out, artifacts.MANIFEST)))
  return {k: v for k, v in m.items() if k not in ('started', 'finished', 'runs')}


def test_ray_writes_the_local_rows_and_retries_a_killed_worker(cluster, kill_file, local_run, overrides, tmp_path):
  cells = [r['cell'] for r in lines(local_run) if r['type'] == 'cell']
  with open(kill_file, 'w') as f:
    f.write(cells[-1])  # the second cell's worker dies after its first batch
  out = str(tmp_path / 'ray')
  report = run_sweep(TINY_CONFIG, out, overrides, progress=False, make_plots=False, backend='ray', workers=2)
  assert not os.path.exists(kill_file)  # a worker died on that cell, and Ray's retry completed it
  assert report['cells_run'] == 2
  expected = lines(local_run)
  assert lines(out) == expected and len(expected) == 2 * 3 + 2 * 3 + 2  # baselines and marks, requests, cells
  assert manifest(out) == manifest(local_run)
  run = report['manifest']['runs'][-1]
  assert run['backend'] == 'ray' and run['hosts']
  mutant = [dict(r) for r in expected]  # the comparison sees a changed token
  mutant[-2]['tokens'] = mutant[-2]['tokens'][:-1] + [mutant[-2]['tokens'][-1] + 1]
  assert lines(out) != mutant

  # A rerun skips the finished cells: drop the last cell's completion line, only that cell runs again.
  path = os.path.join(out, artifacts.RESULTS)
  kept = open(path).read().splitlines(keepends=True)[:-1]
  open(path, 'w').write(''.join(kept))
  report = run_sweep(TINY_CONFIG, out, overrides, progress=False, make_plots=False, backend='ray')
  assert report['cells_run'] == 1 and report['cells_skipped'] == 1
  assert lines(out) == expected
  report = run_sweep(TINY_CONFIG, out, overrides, progress=False, make_plots=False, backend='ray')
  assert report['cells_run'] == 0 and lines(out) == expected


def test_submitit_local_executor_writes_the_local_rows(local_run, overrides, tmp_path):
  out = str(tmp_path / 'slurm')
  report = run_sweep(
      TINY_CONFIG,
      out,
      overrides,
      progress=False,
      make_plots=False,
      backend='slurm',
      slurm_options={'cluster': 'local', 'timeout_min': 10},
  )
  assert report['cells_run'] == 2 and lines(out) == lines(local_run)
  assert manifest(out) == manifest(local_run)


def test_missing_extra_and_bad_options_fail_before_any_work(overrides, tmp_path, monkeypatch):
  out = tmp_path / 'out'
  real = backends.importlib.util.find_spec
  monkeypatch.setattr(backends.importlib.util, 'find_spec', lambda name: None if name == 'ray' else real(name))
  with pytest.raises(SpecjaxError, match=r'pip install -e "\.\[ray\]"'):
    run_sweep(TINY_CONFIG, str(out), overrides, backend='ray')
  for kw, message in [
      ({'backend': 'dask'}, 'unknown sweep backend'),
      ({'backend': 'slurm', 'workers': 0}, 'workers must be a positive integer'),
      ({'backend': 'slurm', 'address': 'auto'}, 'address names a Ray cluster'),
      ({'address': 'auto'}, 'the local backend takes neither'),
      ({'backend': 'slurm'}, 'sbatch is not on'),
  ]:
    with pytest.raises(SpecjaxError, match=message):
      run_sweep(TINY_CONFIG, str(out), overrides, **kw)
  with pytest.raises(SpecjaxError, match='cannot be a grid axis'):
    run_sweep(TINY_CONFIG, str(out), [*overrides, 'grid.resources.gpus=[0, 1]'])
  assert not out.exists()
  shutil.rmtree(out, ignore_errors=True)
