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
  """Quantizes every float `Weight` in place (`mode` 'int8' or 'int4'); the embedding and head only if `embedding`."""
  for _, var in _weights(state, embedding):
    if not isinstance(var[...], QMatrix):
      var.set_value(to_device(quantize(np.asarray(var[...]), mode, out_axis=var.out_axis, group=group)))
  return state


def set_act(state: nnx.State, act: str) -> nnx.State:
  """Every `QMatrix` weight's activation mode ('float' or 'int8'), in place."""
  for _, var in _weights(state, True):
    if isinstance(var[...], QMatrix) and var[...].act != act:
      var.set_value(dataclasses.replace(var[...], act=act))
  return state


def dequantize_params(state: nnx.State, dtype) -> nnx.State:
  """Every `QMatrix` weight back to a float array (in its logical layout) of `dtype`, in place."""
  for _, var in _weights(state, True):
    q = var[...]
    if isinstance(q, QMatrix):
      w = dequantize(q, dtype)
      var.set_value(w if q.out_axis == 0 else jnp.transpose(w))
  return state


def settle(state: nnx.State, dtype) -> None:
  """Where the CPU kernel is missing (impl 'auto'), dequantizes the quantized weights now, with one warning line:
  XLA:CPU would materialise them in float on every call."""
  if quantized_kinds(state) and ops.dequantize_at_load():
    dequantize_params(state, dtype)
    ops.warn_once(f'warning: {ops.kernel_status()}; quantized weights are dequantized at load (float speed)')


def quantized_kinds(state: nnx.State) -> dict[str, int]:
  """Kind ('int8', 'Q4_K', ...) -> how many weights hold it."""
  kinds: dict[str, int] = {}
  for _, var in _weights(state, True):
    if isinstance(var[...], QMatrix):
      kinds[var[...].kind] = kinds.get(var[...].kind, 0) + 1
  return kinds
