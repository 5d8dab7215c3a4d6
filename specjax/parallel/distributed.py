"""Multi-host start-up: one JAX runtime over several processes (hosts), before any backend starts.

  initialize(coordinator, num_processes, process_id)   explicit, or from the environment:
      --coordinator/--num-processes/--process-id, else JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES +
      JAX_PROCESS_ID, else SLURM (srun) or Open MPI (mpirun), as `jax.distributed.initialize` detects them;
      a no-op for one process.
  is_main_process(), main_print(...)                   process 0 speaks, writes and prints.
  add_distributed_args(parser), initialize_from_args(args)   the CLI's flags on every command.
  main_only(fn, ...)                                   fn on process 0; its SpecjaxError raised on every process.

After `initialize`, `jax.devices()` lists every process's devices and a `Mesh` over them spans the hosts; on CPU
the processes talk through gloo (TCP).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

from specjax.errors import SpecjaxError

TIMEOUT_S = 120  # how long a process waits for the coordinator and its peers
ENV = ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS', 'SLURM_PROCID', 'SLURM_LOCALID')
_OMPI = ('OMPI_MCA_orte_hnp_uri', 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK')
_LOOPBACK = ('127.0.0.1', 'localhost', '::1', '[::1]')
_stdout_moved = False  # initialize_from_args has moved stdout (once per process)


def _int(value, name: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise SpecjaxError(f'{name} must be an integer, got {value!r}') from None


def resolve(coordinator=None, num_processes=None, process_id=None) -> tuple[str | None, int, int | None]:
  """(coordinator HOST:PORT or None: the cluster's own, process count, this process's id or None) to start with.

  Explicit arguments first, then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, then SLURM's or
  Open MPI's variables (whose coordinator jax derives: None here). One process: (None, 1, 0).
  """
  env = os.environ
  coordinator = coordinator or env.get(ENV[0]) or None
  if num_processes is None and env.get(ENV[1]):
    num_processes = _int(env[ENV[1]], ENV[1])
  if process_id is None and env.get(ENV[2]):
    process_id = _int(env[ENV[2]], ENV[2])
  if num_processes is None and coordinator is None and process_id is None:
    if all(k in env for k in _SLURM):
      num_processes, process_id = _int(env['SLURM_NTASKS'], 'SLURM_NTASKS'), _int(env['SLURM_PROCID'], 'SLURM_PROCID')
    elif all(k in env for k in _OMPI):
      num_processes = _int(env['OMPI_COMM_WORLD_SIZE'], 'OMPI_COMM_WORLD_SIZE')
      process_id = _int(env['OMPI_COMM_WORLD_RANK'], 'OMPI_COMM_WORLD_RANK')
    else:
      return None, 1, 0
  if num_processes is None:
    raise SpecjaxError(f'a multi-process run needs the process count: --num-processes N (or {ENV[1]})')
  if num_processes < 1:
    raise SpecjaxError(f'--num-processes must be at least 1, got {num_processes}')
  if num_processes == 1:
    return None, 1, 0
  if process_id is None:
    raise SpecjaxError(f"a run of {num_processes} processes needs this one's id: --process-id I (or {ENV[2]})")
  if not 0 <= process_id < num_processes:
    raise SpecjaxError(f'--process-id must be in 0..{num_processes - 1}, got {process_id}')
  if coordinator is not None:
    host, _, port = coordinator.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise SpecjaxError(f"--coordinator must be HOST:PORT (process 0's address and a free port), got {coordinator!r}")
  elif not any(all(k in env for k in keys) for keys in (_SLURM, _OMPI)):
    raise SpecjaxError(f'a run of {num_processes} processes needs --coordinator HOST:PORT (or {ENV[0]})')
  return coordinator, num_processes, process_id


def _wait_for(coordinator: str, timeout_s: float) -> None:
  """Returns once `coordinator` accepts a TCP connection; a SpecjaxError naming it after `timeout_s`."""
  host, _, port = coordinator.rpartition(':')
  host = host.strip('[]')
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
        return
    except OSError as e:
      reason = e.strerror or type(e).__name__
    if time.monotonic() >= deadline:
      raise SpecjaxError(
          f'coordinator {coordinator} unreachable after {timeout_s:g} s ({reason}): start process 0 with '
          f'--coordinator {coordinator}, or check the address and the firewall'
      )
    time.sleep(0.25)


def _watchdog(message: str, timeout_s: float) -> threading.Timer:
  """A timer that prints `error: message` and ends the process (status 2) unless cancelled in time.

  jax's own deadline aborts the process with a native stack trace; this one fires first.
  """

  def fire():
    print(f'error: {message}', file=sys.stderr, flush=True)
    os._exit(2)

  timer = threading.Timer(timeout_s, fire)
  timer.daemon = True
  timer.start()
  return timer


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = TIMEOUT_S,
) -> bool:
  """Starts the multi-process JAX runtime (`jax.distributed.initialize`); False (a no-op) for one process.

  Call it before anything touches a JAX backend (`jax.devices()`, an array). `coordinator` is process 0's
  HOST:PORT, where it serves and every other process connects; see `resolve` for the environment. CPU processes
  exchange data over gloo. A process that cannot reach the coordinator, or a coordinator whose peers do not all
  arrive, stops within `timeout_s` with one error naming the address.
  """
  import jax

  coordinator, num_processes, process_id = resolve(coordinator, num_processes, process_id)
  if num_processes == 1:
    return False
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
      raise SpecjaxError(
          f'the runtime is already started as process {jax.process_index()} of {jax.process_count()}, '
          f'not {process_id} of {num_processes}'
      )
    return True
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    raise SpecjaxError('multi-host start-up must come before any JAX computation (a backend is already running)')
  if 'JAX_CPU_COLLECTIVES_IMPLEMENTATION' not in os.environ:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  where = coordinator or "the cluster's coordinator"
  if coordinator is not None and process_id != 0:
    _wait_for(coordinator, timeout_s)
  bind = None
  if coordinator is not None and coordinator.rpartition(':')[0] in _LOOPBACK:
    bind = coordinator  # this machine only: not every interface, as jax binds by default
  timer = _watchdog(
      f'process {process_id} of {num_processes}: the {num_processes} processes did not all connect to {where} '
      f'within {timeout_s:g} s (start each with the same --coordinator and --num-processes, and its own --process-id)',
      timeout_s,
  )
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s) + 30,
        coordinator_bind_address=bind,
    )
  except (RuntimeError, ValueError) as e:
    raise SpecjaxError(f'multi-host start-up at {where} failed: {" ".join(str(e).split())}') from None
  finally:
    timer.cancel()
  return True


def is_main_process() -> bool:
  """True in process 0 (and in a single-process run): the one that prints and writes outputs."""
  import jax

  return jax.process_index() == 0


def main_print(*args, **kwargs) -> None:
  """`print` in process 0 only."""
  if is_main_process():
    print(*args, **kwargs)


def main_only(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` in process 0 (None elsewhere); a SpecjaxError it raises is raised in every process.

  For checks only process 0 can make (its output directory): every process stops together, with the same
  message, rather than the others waiting in a collective for one that has left.
  """
  import jax
  import numpy as np

  if jax.process_count() == 1:
    return fn(*args, **kwargs)
  from jax.experimental import multihost_utils

  result, message = None, b''
  if is_main_process():
    try:
      result = fn(*args, **kwargs)
    except SpecjaxError as e:
      message = str(e).encode()[:4096] or b'error'
  code = np.zeros(4096, np.uint8)
  code[: len(message)] = np.frombuffer(message, np.uint8)
  code = np.asarray(multihost_utils.broadcast_one_to_all(code))
  if code.any():
    raise SpecjaxError(bytes(code[code > 0]).decode(errors='replace'))
  return result


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
  """--coordinator, --num-processes, --process-id, --distributed-timeout on a command's parser."""
  group = parser.add_argument_group('multi-host (one process per host; see README "Multi-host")')
  group.add_argument(
      '--coordinator',
      metavar='HOST:PORT',
      default=None,
      help=f"process 0's address and a free port, the same on every process (default: ${ENV[0]}, else SLURM's or "
      "Open MPI's, else one process)",
  )
  group.add_argument(
      '--num-processes', metavar='N', type=int, default=None, help=f'processes in the run (default: ${ENV[1]})'
  )
  group.add_argument(
      '--process-id', metavar='I', type=int, default=None, help=f"this process's id, 0..N-1 (default: ${ENV[2]})"
  )
  group.add_argument(
      '--distributed-timeout',
      metavar='S',
      type=float,
      default=TIMEOUT_S,
      help=f'seconds to wait for the coordinator and every process (default {TIMEOUT_S})',
  )


def initialize_from_args(args) -> bool:
  """`initialize` from the flags; then stdout is process 0's alone (others' goes to /dev/null).

  Native libraries' own stdout lines (gloo's connection notes) go to stderr, so that stdout holds the command's
  output only.
  """
  if args.distributed_timeout <= 0:
    raise SpecjaxError(f'--distributed-timeout must be positive, got {args.distributed_timeout}')
  global _stdout_moved
  started = initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.distributed_timeout)
  if started and not _stdout_moved:
    _stdout_moved = True
    sys.stdout.flush()
    stdout = os.dup(1)
    os.dup2(2, 1)  # fd 1 (native writes) -> stderr
    if is_main_process():
      sys.stdout = os.fdopen(stdout, 'w', buffering=1, encoding='utf-8', errors=sys.stdout.errors)
    else:
      os.close(stdout)
      sys.stdout = open(os.devnull, 'w', encoding='utf-8')
  return started
