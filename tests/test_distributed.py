"""Multi-host: two real processes on loopback (2 CPU devices each, gloo) = one process with 4 devices.

The processes run a global psum and all-gather over the 4 devices, then `specjax train` through the CLI flags,
stopped at step 2 and resumed from process 0's checkpoint; its params and losses match a one-process 4-device run. Process 0 alone prints and writes; a mutant (each process
feeding process 0's rows) must fail the same comparison. Also: an unreachable coordinator is one error naming it,
within the timeout; gradient accumulation (train.grad_accum) = one batch, and its per-micro-batch-mean mutant is
not.
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import TINY
from specjax.errors import SpecjaxError
from test_train import config, make_data, train_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240  # every process stops itself by then

# argv: config file, out dir, coordinator, process id, mutant (0/1).
WORKER = r"""
import json, sys, numpy as np
from specjax.parallel import distributed
from specjax import cli
cfg, out, coordinator, pid, mutant = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == '1'
argv = ['train', cfg, '--out', out, '--quiet', '--coordinator', coordinator, '--num-processes', '2', '--process-id', str(pid)]
assert distributed.initialize_from_args(cli.build_parser().parse_args(argv))  # as cli.main does, before it
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils
assert (jax.process_count(), jax.process_index(), len(jax.devices()), jax.local_device_count()) == (2, pid, 4, 2)
mesh = Mesh(np.asarray(jax.devices()), ('data',))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P('data')), np.arange(2.0) + 2 * pid + 1)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
gathered = multihost_utils.process_allgather(x, tiled=True)
print(json.dumps({'pid': pid, 'psum': float(total), 'gathered': np.asarray(gathered).tolist()}), file=sys.stderr)
from specjax.train import loop
if mutant:  # every process feeds the first process's rows
  real = loop.global_batch
  def global_batch(idx, take, sharding):
    first = np.concatenate([idx[: len(idx) // 2]] * 2)
    return real(first, take, sharding)
  loop.global_batch = global_batch
assert cli.main(argv + ['train.stop_after=2']) == 0  # checkpoint 2, saved by process 0
rc = cli.main(argv)  # resumed: process 0 restores checkpoint 2 and broadcasts it
assert cli.main(argv + ['train.lr=0.001']) == 2  # process 0's check of --out stops both, with one error line
print('worker stdout line', pid)
sys.exit(rc)
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def env(devices: int) -> dict:
  flags = os.environ.get('XLA_FLAGS', '') + f' --xla_force_host_platform_device_count={devices}'
  e = {**os.environ, 'XLA_FLAGS': flags.strip(), 'JAX_PLATFORMS': 'cpu'}
  e['PYTHONPATH'] = ROOT + os.pathsep + os.path.join(ROOT, 'tests') + os.pathsep + e.get('PYTHONPATH', '')
  return e


def spawn(args, devices: int):
  return subprocess.Popen(
      [sys.executable, *args], env=env(devices), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def finish(proc) -> tuple[str, str]:
  try:
    out, err = proc.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
  assert proc.returncode == 0, err[-3000:]
  return out, err


def params_of(out: str) -> list[np.ndarray]:
  """The exported drafter's weights (model.safetensors), sorted by name."""
  from safetensors.numpy import load_file

  tensors = load_file(os.path.join(out, 'export', 'model.safetensors'))
  return [tensors[k] for k in sorted(tensors)]


def close(a: list, b: list, lr: float, steps: int) -> bool:
  """Equal up to summation order, as test_train's data-parallel test allows: every weight within Adam's bound
  (lr a step), all but a few per mille to 1e-4."""
  off = total = 0
  for x, y in zip(a, b):
    diff = np.abs(x - y)
    if diff.max() > lr * steps:
      return False
    off, total = off + int(np.sum(diff > 5e-6 + 1e-4 * np.abs(y))), total + y.size
  return off <= 2e-3 * total


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  return make_data(tmp_path_factory.mktemp('data') / 'train.jsonl')


def test_two_processes_train_as_one(data, tmp_path):
  cfg = config(data, steps=3, save_every=2, batch_size=8)
  cfg['eval'] = {'every': 0}
  cfg_file = tmp_path / 'cfg.py'
  cfg_file.write_text(f'import ml_collections\ndef get_config():\n  return ml_collections.ConfigDict({cfg!r})\n')
  one = str(tmp_path / 'one')
  reference = spawn(['-m', 'specjax.cli', 'train', str(cfg_file), '--out', one, '--quiet'], devices=4)
  runs = {}
  for mutant in (False, True):
    coordinator = f'127.0.0.1:{free_port()}'
    out = str(tmp_path / ('mutant' if mutant else 'two'))
    runs[mutant] = out, [
        spawn(['-c', WORKER, str(cfg_file), out, coordinator, str(pid), '1' if mutant else '0'], devices=2)
        for pid in (0, 1)
    ]
  ref_out, _ = finish(reference)
  for mutant, (out, procs) in runs.items():
    (out0, err0), (out1, err1) = finish(procs[0]), finish(procs[1])
    for pid, err in enumerate((err0, err1)):
      line = next(json.loads(s) for s in err.splitlines() if s.startswith('{"pid"'))
      assert line == {'pid': pid, 'psum': 10.0, 'gathered': [1.0, 2.0, 3.0, 4.0]}, line
      errors = [s for s in err.splitlines() if s.startswith('error:')]
      assert len(errors) == 1 and 'holds a training run of another config' in errors[0], errors
    # Process 0 alone prints (the result lines, as one process does) and writes; gloo's own lines go to stderr.
    lines = out0.splitlines()
    assert lines[0].startswith('trained to step 2 of 3 (rerun to resume) (from step 0)'), lines
    assert lines[1].startswith('trained 3 steps (from step 2)') and ref_out.startswith('trained 3 steps (from step 0)')
    assert lines[2:] == ['worker stdout line 0'] and out1 == ''
    assert sorted(os.listdir(out)) == sorted(os.listdir(one))
    assert sorted(os.listdir(os.path.join(out, 'checkpoints'))) == ['2', '3']
  lr, steps = cfg['train']['lr'], cfg['train']['steps']
  losses = lambda out: [r['loss'] for r in train_lines(out)]
  two, mutant = runs[False][0], runs[True][0]
  assert close(params_of(two), params_of(one), lr, steps)
  np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
  with open(os.path.join(two, 'manifest.json')) as f:
    manifest = json.load(f)
  assert manifest['processes'] == 2 and manifest['data_parallel'] == 4 and manifest['steps_done'] == 3
  # The mutant trains on other rows: its losses and weights part from the one-process run's.
  assert not np.allclose(losses(mutant), losses(one), rtol=1e-3)
  assert not close(params_of(mutant), params_of(one), lr, steps)


def test_unreachable_coordinator_is_one_error_naming_it():
  port = free_port()  # nothing listens there
  script = (
      'import sys\nfrom specjax import cli\n'
      f"sys.exit(cli.main(['generate', '-m', {TINY!r}, '--prompt', 'a', '--coordinator', '127.0.0.1:{port}', "
      "'--num-processes', '2', '--process-id', '1', '--distributed-timeout', '2']))\n"
  )
  t0 = time.monotonic()
  proc = spawn(['-c', script], devices=1)
  out, err = proc.communicate(timeout=60)
  assert time.monotonic() - t0 < 30
  assert proc.returncode == 2 and out == ''
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f'error: coordinator 127.0.0.1:{port} unreachable after 2 s'), err


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(num_processes=2, process_id=0), 'needs --coordinator HOST:PORT'),
        (dict(coordinator='127.0.0.1:1234', num_processes=2), "needs this one's id: --process-id"),
        (dict(coordinator='127.0.0.1:1234', num_processes=2, process_id=2), r'--process-id must be in 0..1, got 2'),
        (dict(coordinator='nohost', num_processes=2, process_id=0), 'must be HOST:PORT'),
        (dict(coordinator='127.0.0.1:1234'), 'needs the process count'),
    ],
)
def test_bad_flags_are_one_error(kwargs, message, monkeypatch):
  from specjax.parallel import distributed

  for name in (*distributed.ENV, 'SLURM_JOB_ID', 'OMPI_MCA_orte_hnp_uri'):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(SpecjaxError, match=message):
    distributed.resolve(**kwargs)


def test_environment_detection(monkeypatch):
  from specjax.parallel import distributed

  for name in (*distributed.ENV, 'SLURM_JOB_ID', 'OMPI_MCA_orte_hnp_uri'):
    monkeypatch.delenv(name, raising=False)
  assert distributed.resolve() == (None, 1, 0)
  assert distributed.initialize() is False  # one process: a no-op
  slurm = dict(SLURM_JOB_ID='7', SLURM_STEP_NODELIST='node[01-02]', SLURM_NTASKS='2', SLURM_PROCID='1')
  for k, v in {**slurm, 'SLURM_LOCALID': '0'}.items():
    monkeypatch.setenv(k, v)
  assert distributed.resolve() == (None, 2, 1)  # the coordinator: jax's, from the node list
  monkeypatch.setenv('SLURM_NTASKS', '1')
  assert distributed.resolve() == (None, 1, 0)
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', '10.0.0.1:1234')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '4')
  monkeypatch.setenv('JAX_PROCESS_ID', '3')
  assert distributed.resolve() == ('10.0.0.1:1234', 4, 3)
  assert distributed.resolve(num_processes=1) == (None, 1, 0)


def test_grad_accum_matches_one_batch(data, tmp_path, monkeypatch):
  """train.grad_accum=2 (micro-batches of B/2) = one batch of B; a mutant that averages the micro-batches' own
  means (each normalised by its own counts, as optax.MultiSteps) does not."""
  from specjax.train import mtp, run_training

  def run(name, accum):
    cfg = config(data, steps=3, save_every=0, batch_size=4, grad_accum=accum)
    cfg['eval'] = {'every': 0}
    r = run_training(cfg, str(tmp_path / name), progress=False)
    return [r['loss'] for r in train_lines(str(tmp_path / name))], jax.tree.leaves(jax.device_get(r['params']))

  lr = config(data)['train']['lr']
  loss1, params1 = run('one', 1)
  loss2, params2 = run('two', 2)
  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  assert close(params2, params1, lr, 3)
  real = mtp.MTPTrainer.loss
  monkeypatch.setattr(mtp.MTPTrainer, 'loss', lambda self, p, t, b, k, norm=None: _half(real(self, p, t, b, k)))
  loss_m, params_m = run('mutant', 2)
  assert not np.allclose(loss_m, loss1, rtol=1e-3)


def _half(out):
  loss, metrics = out
  return loss / 2, metrics


def test_bad_grad_accum_is_refused(data, tmp_path):
  from specjax.train import run_training

  with pytest.raises(
      SpecjaxError, match=r'train.batch_size=4 must be a multiple of the 1 devices x train.grad_accum=3'
  ):
    run_training(config(data, grad_accum=3), str(tmp_path / 'x'), progress=False)
  with pytest.raises(SpecjaxError, match="'train.grad_accum' must be at least 1"):
    run_training(config(data, grad_accum=0), str(tmp_path / 'x'), progress=False)
