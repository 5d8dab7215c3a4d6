"""Device meshes for sharded targets: axes ('data', 'model'), and the CLI flags that make one.

`make_mesh(tp, dp)` builds a `dp x tp` mesh over the local devices with Auto
axis types (XLA's sharding propagation places every intermediate; the params
and the decode state are placed by `specjax.parallel.rules`). `--tp N` splits
the target's heads, MLP columns and vocabulary over 'model'; `--dp N` splits
the batch rows over 'data'.
"""

from __future__ import annotations

import argparse

from specjax.errors import SpecjaxError

DATA, MODEL = 'data', 'model'


def make_mesh(tp: int = 1, dp: int = 1, devices=None):
  """A `dp x tp` `jax.sharding.Mesh` over `devices` (default: the first dp * tp local devices), axes ('data',
  'model'), Auto axis types."""
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh

  for name, n in (('--tp', tp), ('--dp', dp)):
    if not isinstance(n, (int, np.integer)) or n < 1:
      raise SpecjaxError(f'{name} must be a positive number of devices, got {n!r}')
  devices = list(jax.devices() if devices is None else devices)
  if tp * dp > len(devices):
    raise SpecjaxError(
        f'--tp {tp} x --dp {dp} needs {tp * dp} devices, {len(devices)} are visible '
        f'({devices[0].platform}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp})'
    )
  grid = np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp)
  return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_size(mesh, axis: str) -> int:
  """Devices along `axis` (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape[axis]


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
  """`--tp` and `--dp` on a command that loads a target."""
  group = parser.add_argument_group('sharding (specjax.parallel)')
  group.add_argument('--tp', type=int, default=1, help='tensor-parallel devices: heads, MLP and vocab split')
  group.add_argument('--dp', type=int, default=1, help='data-parallel devices: batch rows split')


def mesh_from_args(args: argparse.Namespace):
  """The mesh `--tp` / `--dp` ask for (None for one device), checked before any work."""
  tp, dp = getattr(args, 'tp', 1), getattr(args, 'dp', 1)
  if (tp, dp) == (1, 1):
    return None
  return make_mesh(tp=tp, dp=dp)
