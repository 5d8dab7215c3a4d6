"""Executables compiled ahead of time, cached per shape bucket.

Every jitted body of a step (prefill chunk, decode step, speculative step per
K, drafter calls) is lowered and compiled once for the shapes of its arguments
and kept here, so steady state never recompiles: a new shape is a new entry,
and `compile_s` counts the time spent compiling. The bench calibrates costs
through the same cache, so it times what the engine runs.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
from flax import nnx


class Executables:
  """AOT-compiled `fn(graphdef, params, *args, **static)` for one model, keyed by name, shapes and statics."""

  def __init__(self, graphdef: nnx.GraphDef, params: Any, mesh=None):
    self.graphdef = graphdef
    self.params = params
    self.mesh = mesh  # a jax Mesh: every executable runs over it (`specjax.parallel.rules.step_shardings`)
    self.compile_s = 0.0
    self._cache: dict[tuple, Callable] = {}

  def get(
      self, name: str, fn: Callable, args: tuple, static: dict | None = None, donate: tuple[int, ...] = (1,)
  ) -> Callable:
    """The compiled executable; call it as `exe(params, *args)`. `donate`: argument indices, params at 0."""
    static = static or {}
    shapes = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
    key = (name, fn, shapes, tuple(sorted(static.items())))  # fn too: a name never serves another body
    exe = self._cache.get(key)
    if exe is None:
      t = time.perf_counter()
      body = functools.partial(fn, self.graphdef, **static)
      if self.mesh is None:
        exe = jax.jit(body, donate_argnums=donate).lower(self.params, *args).compile()
      else:
        from specjax.parallel.rules import placed_executable

        exe = placed_executable(body, self.mesh, self.params, args, donate)
      self.compile_s += time.perf_counter() - t
      self._cache[key] = exe
    return exe

  def call(self, name: str, fn: Callable, args: tuple, static: dict | None = None, donate: tuple[int, ...] = (1,)):
    """Compiles if needed and runs `fn` on the model's params and `args`."""
    return self.get(name, fn, args, static, donate)(self.params, *args)

  def names(self, prefix: str = '') -> list[tuple[str, dict]]:
    """(name, static arguments) of every compiled executable whose name starts with `prefix`."""
    return [(key[0], dict(key[3])) for key in self._cache if key[0].startswith(prefix)]

  def __len__(self) -> int:
    return len(self._cache)
