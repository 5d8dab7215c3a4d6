"""A 16-cell tiny sweep: wall time on the local backend against Ray with 2 workers (local cluster).

python benchmarks/sweep_backends.py   # -> benchmarks/results/sweep_backends.json

Ideal Ray time: local / 2 plus Ray's start-up (cluster and 2 actors, measured apart). Each worker loads the
tiny model and compiles its engines once, as the local process does.
"""

import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'configs', 'sweep_tiny.py')
OVERRIDES = [
    'grid.drafter.kind=["ngram"]',
    'grid.policy=[{"name": "fixed", "k": 1}, {"name": "fixed", "k": 2}, {"name": "fixed", "k": 3}, {"name": "fixed", "k": 4}]',
    'grid.sampling.seed=[0, 1, 2, 3]',  # 16 cells, one engine
    'max_new_tokens=32',
]


def main():
  import ray

  from specjax.sweep import run_sweep
  from specjax.sweep.backends import CellWorker

  tmp = tempfile.mkdtemp()
  t = time.perf_counter()
  run_sweep(CONFIG, os.path.join(tmp, 'local'), OVERRIDES, progress=False, make_plots=False)
  local_s = time.perf_counter() - t

  t = time.perf_counter()
  ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1', log_to_driver=False)
  cluster_s = time.perf_counter() - t
  from specjax.sweep import resolve

  t = time.perf_counter()  # two actors built and idle: what the sweep's own actors cost before a cell runs
  actors = [ray.remote(CellWorker).options(num_cpus=1).remote(resolve(CONFIG, OVERRIDES)) for _ in range(2)]
  ray.get([a.__ray_ready__.remote() for a in actors])
  actors_s = time.perf_counter() - t
  for a in actors:
    ray.kill(a)
  t = time.perf_counter()
  report = run_sweep(
      CONFIG, os.path.join(tmp, 'ray'), OVERRIDES, progress=False, make_plots=False, backend='ray', workers=2
  )
  ray_s = time.perf_counter() - t
  ray.shutdown()
  shutil.rmtree(tmp)
  startup_s = cluster_s + actors_s
  ideal_s = local_s / 2 + actors_s
  result = {
      'cells': report['manifest']['num_cells'],
      'cpu_cores': os.cpu_count(),
      'local_s': round(local_s, 2),
      'ray_s': round(ray_s, 2),
      'ray_cluster_start_s': round(cluster_s, 2),
      'ray_actor_start_s': round(actors_s, 2),
      'ideal_ray_s': round(ideal_s, 2),
      'ray_over_ideal': round(ray_s / ideal_s, 3),
      'python': sys.version.split()[0],
  }
  os.makedirs(os.path.join(ROOT, 'benchmarks', 'results'), exist_ok=True)
  with open(os.path.join(ROOT, 'benchmarks', 'results', 'sweep_backends.json'), 'w') as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == '__main__':
  main()
