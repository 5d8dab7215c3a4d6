"""Quantizing (or dequantizing) the `Weight` params of a model's state."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.quant import ops
from specjax.quant.formats import QMatrix, dequantize, quantize, to_device

EMBEDDING_NAMES = frozenset({'embed_tokens', 'lm_head'})  # the embedding and the (tied or own) head


def _weights(state: nnx.State, embedding: bool):
  from specjax.models.layers import Weight

  for path, var in nnx.to_flat_state(state):
    if isinstance(var, Weight) and (embedding or not EMBEDDING_NAMES & set(map(str, path))):
      yield path, var


def quantize_params(state: nnx.State, mode: str, *, group: int = 32, embedding: bool = True) -> nnx.State:
  """Quantizes every float `Weight` in place (`mode` 'int8' or 'int4'); the embedding and head only if `embedding`.

  A `Weight` marked `keep_float` (an MoE router) stays float, as a kind 'f32' QMatrix (`kernel_floats`).
  """
  for _, var in _weights(state, embedding):
    if not isinstance(var[...], QMatrix) and not getattr(var, 'keep_float', False):
      var.set_value(to_device(quantize(np.asarray(var[...]), mode, out_axis=var.out_axis, group=group)))
  return kernel_floats(state)


def kernel_floats(state: nnx.State, experts: bool = False) -> nnx.State:
  """Every float `Weight` marked `keep_float` as a kind 'f32' QMatrix, in place: a quantized model multiplies it
  on the kernel too, whose row sums do not depend on how many rows go in (a router's choice of experts then
  does not change between a decode step and a verify pass). `experts`: float stacks of routed experts too (a
  float model on the CPU kernel: each token's rows read their experts in place, where XLA gathers copies)."""
  for _, var in _weights(state, True):
    if isinstance(var[...], QMatrix):
      continue
    if getattr(var, 'keep_float', False) or (experts and var[...].ndim == 3):
      var.set_value(to_device(quantize(np.asarray(var[...]), 'f32', out_axis=var.out_axis)))
  return state


def float_experts_on_kernel(state: nnx.State, dtype, mesh=None) -> nnx.State:
  """A float32 model's (or head's) MoE experts and routers as kind 'f32' stacks, in place, where the CPU kernel
  runs them and no mesh shards them (`kernel_floats(experts=True)`); elsewhere (GPU, bfloat16, a mesh) unchanged."""
  if mesh is None and dtype == jnp.float32 and ops.uses_kernel():
    kernel_floats(state, experts=True)
  return state


def set_act(state: nnx.State, act: str) -> nnx.State:
  """Every quantized `QMatrix` weight's activation mode ('float' or 'int8'), in place (kind 'f32' stays float)."""
  for _, var in _weights(state, True):
    if isinstance(var[...], QMatrix) and var[...].bits != 32 and var[...].act != act:
      var.set_value(dataclasses.replace(var[...], act=act))
  return state


def dequantize_params(state: nnx.State, dtype) -> nnx.State:
  """Every `QMatrix` weight back to a float array (in its logical layout) of `dtype`, in place."""
  for _, var in _weights(state, True):
    q = var[...]
    if isinstance(q, QMatrix):
      w = dequantize(q, dtype)
      var.set_value(w if q.out_axis == 0 else jnp.swapaxes(w, -1, -2))
  return state


def settle(state: nnx.State, dtype) -> None:
  """Where the CPU kernel is missing (impl 'auto'), dequantizes the quantized weights now, with one warning line:
  XLA:CPU would materialise them in float on every call."""
  if any(isinstance(var[...], QMatrix) for _, var in _weights(state, True)) and ops.dequantize_at_load():
    dequantize_params(state, dtype)
    ops.warn_once(f'warning: {ops.kernel_status()}; quantized weights are dequantized at load (float speed)')


def quantized_kinds(state: nnx.State) -> dict[str, int]:
  """Kind ('int8', 'Q4_K', ...) -> how many weights hold it (float matrices on the kernel, 'f32', left out)."""
  kinds: dict[str, int] = {}
  for _, var in _weights(state, True):
    if isinstance(var[...], QMatrix) and var[...].bits != 32:
      kinds[var[...].kind] = kinds.get(var[...].kind, 0) + 1
  return kinds
