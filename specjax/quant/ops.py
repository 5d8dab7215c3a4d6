"""The products and lookups every family's blocks call on `Weight` params, float or quantized.

Models stay free of quantization branches: they call `matmul(x, w)` for
`x @ w` with `w [K, N]`, `matmul_t(x, table)` for `x @ table.T` with a
`[V, D]` table, `expert_matmul(x, w, ids)` for `x[m] @ w[ids[m]]` over a stack
of routed experts, `take(w, ids, axis)` for embedding rows and
`take_outputs(w, ids, axis)` for a subset of output channels (a draft
vocabulary, the key/value columns of a fused projection). On a float array each
is the jnp op it replaces; on a `QMatrix` it runs the quantized product:

- CPU with the compiled kernel (`specjax.quant.cpu_kernel`): the kernel reads
  the weights as stored. Each output element's sum runs in a fixed order that
  does not depend on how many rows go in, so a verify pass of width K + 1 and a
  decode step give the same bits for the same row (greedy speculative output
  equals greedy AR output of the same quantized model).
- elsewhere (GPU; CPU reference): dequantize inside jit, then the float product.

A QMatrix with `act='int8'` quantizes the activations per block of 32 (or 16) inputs
first: the kernel's act-int8 mode (VNNI integer dots), or inside jit the same
function (`cpu_kernel.act8_dequantized`, equal up to the order of float sums).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from specjax.quant.formats import QMatrix, dequantize

# 'auto': the CPU kernel where it is built and the backend is CPU, else XLA; 'xla' forces the dequantizing path.
_IMPL = {'matmul': 'auto'}


def set_impl(impl: str) -> None:
  """'auto' or 'xla' (tests and benchmarks compare the two; jitted functions trace with what is set)."""
  if impl not in ('auto', 'xla'):
    raise ValueError(f'unknown quantized matmul impl {impl!r}')
  _IMPL['matmul'] = impl


@functools.cache
def _kernel():
  try:
    from specjax.quant import cpu_kernel
  except ImportError:
    return None
  return cpu_kernel if cpu_kernel.available() else None


def kernel_status() -> str:
  """Why the CPU kernel is not used (or 'the CPU kernel is in use')."""
  try:
    from specjax.quant import cpu_kernel
  except ImportError as e:
    return f'the quantized CPU kernel is not installed ({e})'
  if not cpu_kernel.available():
    return f'the quantized CPU kernel is not available ({cpu_kernel.reason()})'
  return 'the CPU kernel is in use'


_WARNED: set[str] = set()


def warn_once(line: str) -> None:
  if line not in _WARNED:
    _WARNED.add(line)
    print(line, file=sys.stderr, flush=True)


def dequantize_at_load() -> bool:
  """On a CPU without the kernel (impl 'auto'), quantized weights are dequantized at load: XLA:CPU would
  materialise the float weights on every call (several times slower than float weights)."""
  return _IMPL['matmul'] == 'auto' and jax.default_backend() == 'cpu' and _kernel() is None


def uses_kernel() -> bool:
  """Whether quantized products run on the compiled CPU kernel (else dequantize inside jit)."""
  return _IMPL['matmul'] == 'auto' and jax.default_backend() == 'cpu' and _kernel() is not None


def _qdot(x: jax.Array, q: QMatrix) -> jax.Array:  # x [..., K] -> [..., N]
  act_bits = 8 if q.act == 'int8' else 32
  if uses_kernel():
    kw = dict(bits=q.bits, group=q.group, offset=q.offset, act_bits=act_bits)
    return _kernel().qmatmul(x, q.values, q.scales, q.mins, **kw).astype(x.dtype)
  if act_bits == 8:
    from specjax.quant.cpu_kernel import act8_dequantized

    x = act8_dequantized(x, q.group)
  return jnp.einsum('...k,nk->...n', x, dequantize(q, x.dtype))


def expert_matmul(x: jax.Array, w, ids: jax.Array) -> jax.Array:  # x [M, K], w [E, K, N], ids [M] -> [M, N]
  """`x[m] @ w[ids[m]]` for a stack of `[K, N]` expert weights (each row through its expert).

  Quantized on the CPU kernel, the rows of each expert are multiplied together and every row gets the bits a
  one-row product gives it (`cpu_kernel.qmatmul_rows`); elsewhere the chosen experts are gathered (still
  quantized) and dequantized inside jit.
  """
  if not isinstance(w, QMatrix):
    return jnp.einsum('mk,mkn->mn', x, w[ids])
  assert w.ndim == 3 and w.out_axis == 1, 'expert_matmul takes a stack of [K, N] weights'
  act_bits = 8 if w.act == 'int8' else 32
  if uses_kernel():
    kw = dict(bits=w.bits, group=w.group, offset=w.offset, act_bits=act_bits)
    return _kernel().qmatmul_rows(x, w.values, w.scales, w.mins, ids, **kw).astype(x.dtype)
  if act_bits == 8:
    from specjax.quant.cpu_kernel import act8_dequantized

    x = act8_dequantized(x, w.group)
  return jnp.einsum('mk,mnk->mn', x, dequantize(w.experts(ids), x.dtype))


def matmul(x: jax.Array, w) -> jax.Array:  # x [..., K], w [K, N] -> [..., N]
  """`x @ w` for a `[K, N]` weight."""
  if isinstance(w, QMatrix):
    assert w.out_axis == 1, 'a [V, D] table multiplies through matmul_t'
    return _qdot(x, w)
  return jnp.einsum('...k,kn->...n', x, w)


def matmul_t(x: jax.Array, w) -> jax.Array:  # x [..., K], w [N, K] -> [..., N]
  """`x @ w.T` for a `[N, K]` table (a tied head over a `[V, D]` embedding)."""
  if isinstance(w, QMatrix):
    assert w.out_axis == 0, 'a [K, N] weight multiplies through matmul'
    return _qdot(x, w)
  return jnp.einsum('...k,nk->...n', x, w)


def take(w, ids: jax.Array, axis: int, dtype=jnp.float32) -> jax.Array:
  """`jnp.take(w, ids, axis)` (embedding rows); a QMatrix takes along its output axis, dequantized to `dtype`."""
  if not isinstance(w, QMatrix):
    return jnp.take(w, ids, axis=axis)
  assert axis == w.out_axis, 'a QMatrix is looked up along its output axis'
  rows = dequantize(w.rows(ids.reshape(-1)), dtype).reshape(*ids.shape, w.num_inputs)
  return rows if axis == 0 else jnp.moveaxis(rows, -1, 0)


def take_outputs(w, ids, axis: int):
  """The output channels `ids` (an index array or a slice) of `w` along `axis`, still quantized if `w` is."""
  if isinstance(w, QMatrix):
    assert axis == w.out_axis, 'a QMatrix selects along its output axis'
    return w.rows(ids)
  if isinstance(ids, slice):
    return w[ids] if axis == 0 else w[:, ids]
  return jnp.take(w, ids, axis=axis)
