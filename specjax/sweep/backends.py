"""Sweep backends beyond this process: Ray tasks and SLURM job arrays (submitit).

A worker runs whole cells (`CellWorker`: the models and engines it builds stay
cached for its next cell) and returns their rows; only the driver
(`runner.run_sweep`) writes results.jsonl, in the order the local backend
writes it. So a worker that dies leaves no row behind: its cell is retried, and
a rerun skips the cells that finished.

  Ray    one actor per worker, each holding `resources.cpus` / `resources.gpus`;
         a cell is an actor task, retried on a restarted actor when its worker
         dies (`max_restarts`, `max_task_retries`).
  SLURM  one job per cell in one submitit job array (`cpus_per_task`,
         `gpus_per_node`); a job that dies without a result is resubmitted.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import socket

from specjax.errors import SpecjaxError

EXTRAS = {'ray': 'ray', 'slurm': 'submitit'}  # backend -> the module its extra installs
# Test hook: a file naming a cell id; the worker running that cell deletes the file and dies after its first batch.
KILL_ENV = 'SPECJAX_SWEEP_TEST_KILL'


def require(backend: str) -> None:
  """A clear error naming the extra when the backend's package is missing."""
  module = EXTRAS[backend]
  if importlib.util.find_spec(module) is None:
    raise SpecjaxError(
        f'--backend {backend} needs {module}: pip install -e ".[{backend}]" in a specjax clone, '
        f'or pip install "specjax[{backend}]"'
    )


def check_options(backend: str, *, address, workers, retries, slurm_options) -> None:
  if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
    raise SpecjaxError(f'workers must be a positive integer, got {workers!r}')
  if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
    raise SpecjaxError(f'retries must be a non-negative integer, got {retries!r}')
  if address is not None and backend != 'ray':
    raise SpecjaxError('address names a Ray cluster: it goes with --backend ray')
  if slurm_options and backend != 'slurm':
    raise SpecjaxError('slurm_options go with --backend slurm')
  if slurm_options is not None and not isinstance(slurm_options, dict):
    raise SpecjaxError(f'slurm_options must be a dict of submitit parameters, got {slurm_options!r}')
  if backend == 'slurm' and (slurm_options or {}).get('cluster', 'slurm') == 'slurm' and shutil.which('sbatch') is None:
    raise SpecjaxError(
        "SLURM's sbatch is not on this machine's PATH; slurm_options={'cluster': 'local'} "
        '(--slurm-option cluster=local) runs the jobs as local processes'
    )


def check_resources(resources: dict) -> None:
  if not resources['cpus'] > 0:
    raise SpecjaxError(f'resources.cpus must be positive, got {resources["cpus"]}')
  if resources['gpus'] < 0:
    raise SpecjaxError(f'resources.gpus must be at least 0, got {resources["gpus"]}')


def host() -> str:
  """This worker: its host name and accelerators."""
  import jax

  return f'{socket.gethostname()} ({", ".join(sorted({d.device_kind for d in jax.devices()}))})'


def _kill_for_test(cell_id: str) -> None:
  path = os.environ.get(KILL_ENV)
  if not path or not os.path.isfile(path):
    return
  with open(path, encoding='utf-8') as f:
    if f.read().strip() != cell_id:
      return
  try:
    os.remove(path)  # the first worker to remove it dies; a retry runs the cell through
  except FileNotFoundError:
    return
  os._exit(17)


class CellWorker:
  """Runs whole cells of one sweep in a worker process; its models and engines stay cached across cells."""

  def __init__(self, sweep):
    from specjax.sweep import runner
    from specjax.sweep.config import expand

    cells = expand(sweep)
    self.cells = {c.id: c for c in cells}
    self.policies = {c.id: runner.make_cell_policy(c) for c in cells}
    self.bench = runner._Workbench(cells, self.policies)

  def run(self, cell_id: str, batches: list, owners: list[bool]) -> dict:
    """{'cell', 'units': per batch {'baseline', 'requests', 'seconds'}, 'host'}."""
    from specjax.sweep import runner

    cell, state, units = self.cells[cell_id], None, []
    for b, batch in enumerate(batches):
      unit, state = runner.run_unit(self.bench, cell, b, batch, self.policies[cell_id], state, owners[b])
      units.append(unit)
      _kill_for_test(cell_id)
    return {'cell': cell_id, 'units': units, 'host': host()}


def run_job(sweep, cell_id: str, batches: list, owners: list[bool]) -> dict:
  """One SLURM job: one cell in a fresh process."""
  return CellWorker(sweep).run(cell_id, batches, owners)


class _Results:
  """Hands the runner a cell's units as its worker's result arrives (`_fetch`)."""

  def __init__(self, tasks: list):
    self.results: dict[str, dict] = {}
    self.hosts: set[str] = set()

  def unit(self, cell, b: int, batch, owns_baseline: bool) -> dict:
    while cell.id not in self.results:
      result = self._fetch(cell)
      self.results[result['cell']] = result
      self.hosts.add(result['host'])
    return self.results[cell.id]['units'][b]

  def _fetch(self, cell) -> dict:
    raise NotImplementedError


class _Ray(_Results):

  def __init__(self, sweep, tasks: list, *, address: str | None, workers: int | None, retries: int):
    super().__init__(tasks)
    import ray
    from ray.util import ActorPool

    self.ray, self.retries, self.owns_cluster = ray, retries, not ray.is_initialized()
    res = sweep.resources
    if self.owns_cluster:
      if address:
        ray.init(address=address)
      else:  # a local cluster on the loopback interface, no dashboard
        cpus = None if workers is None else max(1, math.ceil(workers * res['cpus']))
        ray.init(address='local', num_cpus=cpus, include_dashboard=False, _node_ip_address='127.0.0.1')
    try:
      total = ray.cluster_resources()
      fits = min(
          int(total.get('CPU', 0) // res['cpus']), int(total.get('GPU', 0) // res['gpus']) if res['gpus'] else 1 << 30
      )
      if fits < 1:
        raise SpecjaxError(
            f'the Ray cluster has {total.get("CPU", 0):g} CPUs and {total.get("GPU", 0):g} GPUs; a cell asks for '
            f'{res["cpus"]:g} CPUs and {res["gpus"]:g} GPUs (resources.cpus, resources.gpus)'
        )
      n = min(workers or fits, len(tasks))
      actor = ray.remote(CellWorker).options(
          num_cpus=res['cpus'], num_gpus=res['gpus'], max_restarts=retries, max_task_retries=retries
      )
      self.actors = [actor.remote(sweep) for _ in range(n)]
      self.pool = ActorPool(self.actors)
      for task in tasks:
        self.pool.submit(lambda a, t: a.run.remote(*t), task)
    except BaseException:
      self.close()
      raise

  def _fetch(self, cell) -> dict:
    from ray import exceptions

    try:
      return self.pool.get_next_unordered()
    except exceptions.RayTaskError as e:
      if isinstance(e.cause, SpecjaxError):
        raise SpecjaxError(str(e.cause)) from None
      raise
    except exceptions.RayActorError as e:
      raise SpecjaxError(
          f'a Ray worker died {self.retries + 1} times running one cell ({type(e).__name__}); '
          'the cells written so far are kept: rerun to resume'
      ) from None

  def close(self) -> list[str]:
    for a in getattr(self, 'actors', []):
      self.ray.kill(a)
    if self.owns_cluster:
      self.ray.shutdown()
    return sorted(self.hosts)


class _Slurm(_Results):

  def __init__(self, sweep, tasks: list, *, out_dir: str, workers: int | None, retries: int, options: dict | None):
    super().__init__(tasks)
    import submitit

    options = dict(options or {})
    cluster = options.pop('cluster', 'slurm')
    res = sweep.resources
    if res['gpus'] != int(res['gpus']):
      raise SpecjaxError(f'--backend slurm takes whole GPUs per cell, got resources.gpus={res["gpus"]}')
    try:
      self.executor = submitit.AutoExecutor(folder=os.path.join(out_dir, 'slurm'), cluster=cluster)
      self.executor.update_parameters(
          **{
              'name': 'specjax-sweep',
              'cpus_per_task': math.ceil(res['cpus']),
              'gpus_per_node': int(res['gpus']),
              'slurm_array_parallelism': workers or len(tasks),
              **options,
          }
      )
    except (ValueError, TypeError, AssertionError) as e:
      raise SpecjaxError(f'bad slurm_options {options}: {e}') from None
    self.tasks = {t[0]: t for t in tasks}
    self.tries = {t[0]: 0 for t in tasks}
    self.retries = retries
    with self.executor.batch():
      self.jobs = {t[0]: self.executor.submit(run_job, sweep, *t) for t in tasks}
    self.sweep = sweep

  def _fetch(self, cell) -> dict:
    from submitit.core import utils

    while True:
      job = self.jobs[cell.id]
      try:
        return job.result()
      except utils.UncompletedJobError as e:  # the job died without a result: resubmit it
        if self.tries[cell.id] >= self.retries:
          raise SpecjaxError(
              f'SLURM job {job.job_id} (cell {cell.label}) died {self.retries + 1} times: {str(e).splitlines()[0]}'
          ) from None
        self.tries[cell.id] += 1
        self.jobs[cell.id] = self.executor.submit(run_job, self.sweep, *self.tasks[cell.id])
      except utils.FailedJobError as e:
        last = [line for line in str(e).splitlines() if line.strip() and not line.startswith('-')]
        if last and last[-1].startswith('specjax.errors.SpecjaxError: '):
          raise SpecjaxError(last[-1].split(': ', 1)[1]) from None
        raise SpecjaxError(f'cell {cell.label} failed in SLURM job {job.job_id}: {last[-1] if last else e}') from None

  def close(self) -> list[str]:
    for job in getattr(self, 'jobs', {}).values():
      if not job.done():
        job.cancel(check=False)
    return sorted(self.hosts)


class _Nothing:

  def close(self) -> list[str]:
    return []


def start(backend: str, sweep, tasks: list, *, out_dir, address, workers, retries, slurm_options):
  """Starts the workers on `tasks` [(cell id, batches, owns baseline per batch)]; the runner's unit source."""
  if not tasks:
    return _Nothing()
  if backend == 'ray':
    return _Ray(sweep, tasks, address=address, workers=workers, retries=retries)
  return _Slurm(sweep, tasks, out_dir=out_dir, workers=workers, retries=retries, options=slurm_options)
