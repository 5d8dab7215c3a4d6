"""Quantized weight matrices as pytrees: int8 and packed int4 values, a scale (and min) per group.

A `QMatrix` stands for a float matrix that one of the model's `Weight` params
holds (`x @ w`, or an embedding table). Its storage is output-major: `[N, K]`
for N outputs of K inputs (an embedding table's and PyTorch's layout; a GGUF
tensor's rows), in groups of G consecutive inputs:

  w[n, k] = scales[n, k // G] * v[n, k] - mins[n, k // G]   (no mins: 0)

- bits 8: `values` int8 `[N, K]` holds v (also 5- and 6-bit GGUF values);
- bits 4: `values` uint8 `[N, K / 2]`; the group starting at k0 takes G / 2
  bytes, byte j holding element k0 + j in its low nibble and k0 + j + G / 2 in
  its high one; a nibble u means v = u - offset;
- bits 32: `values` float32 `[N, K]`, no scales: a float matrix that the
  quantized kernel multiplies (its sums do not depend on how many rows go in:
  MoE routers of a quantized model, kind 'f32').

A stack of E such matrices (routed experts) has a leading axis on every leaf:
`values [E, N, K]`, `scales [E, N, K / G]`; `out_axis` then names the axis of
each expert's logical matrix.

`out_axis` says which axis of the logical (float) matrix is N: 1 for a `[K, N]`
projection, 0 for a `[V, D]` table. `act` says how the products treat the activations: 'float', or 'int8' (quantized
per block of 32 or 16 inputs, integer dot products: `specjax.quant.cpu_kernel`). The same class holds numpy arrays at load
and jax arrays after; `.T` and `np.concatenate` along the output axis work on
it, so checkpoint mappings written for float tensors run unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

QUANT_MODES = ('int8', 'int4')
QUANT_CHOICES = ('none', 'auto', *QUANT_MODES)  # what `load(quant=)` and --quant take
QUANT_ACTS = ('float', 'int8')  # what `load(quant_act=)` and --quant-act take


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QMatrix:
  """A quantized matrix (see the module docstring); a pytree of `values`, `scales`, `mins`."""

  values: Any  # int8 [(E,) N, K], uint8 [(E,) N, K / 2] or float32 [(E,) N, K]
  scales: Any  # float32 [(E,) N, K / G] (None for bits 32)
  mins: Any  # float32 [(E,) N, K / G] or None
  bits: int = dataclasses.field(metadata=dict(static=True))
  group: int = dataclasses.field(metadata=dict(static=True))
  offset: int = dataclasses.field(default=0, metadata=dict(static=True))  # 4-bit: v = nibble - offset
  out_axis: int = dataclasses.field(default=0, metadata=dict(static=True))  # the logical matrix's N axis
  kind: str = dataclasses.field(default='', metadata=dict(static=True))  # 'int8', 'int4', a GGUF type name
  act: str = dataclasses.field(default='float', metadata=dict(static=True))  # activations: 'float' or 'int8'

  @property
  def num_outputs(self) -> int:
    return self.values.shape[-2]

  @property
  def num_inputs(self) -> int:
    return self.values.shape[-1] * (2 if self.bits == 4 else 1)

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical (float) matrix's shape (a stack's: `(E, ...)`)."""
    n, k = self.num_outputs, self.num_inputs
    return (*self.values.shape[:-2], *((n, k) if self.out_axis == 0 else (k, n)))

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self):
    return self.values.dtype if self.bits == 32 else self.scales.dtype

  @property
  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

  @property
  def T(self) -> QMatrix:  # noqa: N802 (numpy's name)
    assert self.ndim == 2, "a stack of experts swaps its matrices' axes with transpose(0, 2, 1)"
    return dataclasses.replace(self, out_axis=1 - self.out_axis)

  def transpose(self, *axes: int) -> QMatrix:
    """Each matrix's two axes swapped: `(1, 0)` of a matrix, `(0, 2, 1)` of a stack (the storage stays)."""
    if tuple(axes) != ((1, 0) if self.ndim == 2 else (0, 2, 1)):
      raise TypeError(f"a QMatrix of {self.ndim} axes transposes only its matrices' two axes, not {axes}")
    return dataclasses.replace(self, out_axis=1 - self.out_axis)

  def __getitem__(self, key):
    if key is Ellipsis:  # `variable[...]`: the value itself
      return self
    raise TypeError('a QMatrix is read through specjax.quant.ops (matmul, take, take_outputs), not indexed')

  def __array_function__(self, func, types, args, kwargs):
    if func is np.concatenate:
      return concatenate(*args, **kwargs)
    return NotImplemented

  def rows(self, index) -> QMatrix:
    """The storage rows (outputs) at `index` (an int array or a slice), as a QMatrix."""
    assert self.ndim == 2, 'a stack of experts selects whole matrices (`experts`)'
    return jax.tree.map(lambda x: x[index], self)

  def experts(self, ids) -> QMatrix:
    """The matrices `ids` (an int array) of a stack, still quantized: leaves `[*ids.shape, N, .]`."""
    return jax.tree.map(lambda x: x[ids], self)


def concatenate(parts, axis: int = 0, **kwargs) -> QMatrix:
  """`np.concatenate` of QMatrix parts along their output axis (mixed formats: widened to int8, smallest group)."""
  if kwargs:
    raise TypeError(f'np.concatenate of QMatrix takes no {sorted(kwargs)}')
  parts = list(parts)
  if not all(isinstance(p, QMatrix) for p in parts):  # a fused weight of float and quantized tensors: float
    dense = [p if not isinstance(p, QMatrix) else dense_host(p) for p in parts]
    return np.concatenate(dense, axis=axis)
  out_axis = parts[0].out_axis
  if not all(isinstance(p, QMatrix) and p.out_axis == out_axis for p in parts) or axis % 2 != out_axis:
    raise TypeError('QMatrix parts concatenate only with each other, along their output axis')
  kind = '+'.join(dict.fromkeys(p.kind for p in parts))  # e.g. 'Q5_0+Q8_0' for a fused q | k | v
  if len({p.act for p in parts}) > 1:
    raise TypeError(f'QMatrix parts of different activation modes do not concatenate: {sorted({p.act for p in parts})}')
  if len({(p.bits, p.group, p.offset, p.mins is None) for p in parts}) > 1:
    group = math.gcd(*(p.group for p in parts))
    parts = [widen(p, group) for p in parts]
  p0 = parts[0]
  mins = None if p0.mins is None else np.concatenate([p.mins for p in parts])
  return dataclasses.replace(
      p0,
      values=np.concatenate([p.values for p in parts]),
      scales=np.concatenate([p.scales for p in parts]),
      mins=mins,
      kind=kind,
  )


def widen(q: QMatrix, group: int) -> QMatrix:
  """The same weights as int8 values, groups of `group` (a divisor of q's), with mins (zeros if q had none).

  Exact: the values are integers, a finer group repeats its scale, and `x - 0 == x`.
  """
  values = np.asarray(unpack_values(q, np))
  r = q.group // group
  scales = np.repeat(np.asarray(q.scales), r, axis=1)
  mins = np.zeros_like(scales) if q.mins is None else np.repeat(np.asarray(q.mins), r, axis=1)
  return QMatrix(values.astype(np.int8), scales, mins, 8, group, 0, q.out_axis, q.kind, q.act)


def unpack_values(q: QMatrix, xp=jnp):  # -> int8 [(E,) N, K]
  """The integer values v (nibbles unpacked and offset for 4 bits)."""
  if q.bits in (8, 32):
    return q.values
  *lead, n, _ = q.values.shape
  packed = q.values.reshape(*lead, n, -1, q.group // 2)
  nibbles = xp.concatenate([packed & 15, packed >> 4], axis=-1).astype(xp.int8)
  return nibbles.reshape(*lead, n, -1) - xp.asarray(q.offset, xp.int8)


def dequantize(q: QMatrix, dtype=jnp.float32, xp=jnp):  # -> [(E,) N, K] storage layout
  """The float weights, storage-major `[N, K]` (`xp=np` on the host: float32, the order of GGUF's dequantizer)."""
  if q.bits == 32:
    return q.values.astype(dtype)
  *lead, n, _ = q.values.shape
  k = q.num_inputs
  v = unpack_values(q, xp).reshape(*lead, n, k // q.group, q.group).astype(xp.float32)
  w = q.scales[..., None] * v
  if q.mins is not None:
    w = w - q.mins[..., None]
  return w.reshape(*lead, n, k).astype(dtype)


def dense_host(q: QMatrix) -> np.ndarray:
  """The float32 matrix in its logical layout, on the host."""
  w = dequantize(q, np.float32, xp=np)
  return w if q.out_axis == 0 else np.swapaxes(w, -1, -2)


def quantize(w: np.ndarray, mode: str, *, out_axis: int, group: int = 32) -> QMatrix:
  """A float matrix -> int8 (symmetric, a scale per output channel), int4 (symmetric, a scale per `group`) or
  'f32' (kept float, for the kernel); a stack `[E, ., .]` of them (routed experts) matrix by matrix."""
  w = np.asarray(w, np.float32)
  if w.ndim == 3:
    return jax.tree.map(lambda *xs: np.stack(xs), *(quantize(m, mode, out_axis=out_axis, group=group) for m in w))
  storage = w if out_axis == 0 else w.T
  n, k = storage.shape
  if mode == 'f32':
    return QMatrix(np.ascontiguousarray(storage), None, None, 32, k, 0, out_axis, 'f32')
  if mode == 'int8':
    scale = np.abs(storage).max(axis=1, keepdims=True) / 127.0
    v = np.round(storage / np.where(scale == 0, 1.0, scale)).clip(-127, 127).astype(np.int8)
    return QMatrix(v, scale.astype(np.float32), None, 8, k, 0, out_axis, 'int8')
  if mode != 'int4':
    raise SpecjaxError(f'unknown quantization {mode!r} (choose from {", ".join(QUANT_MODES)})')
  if k % group or group % 2:
    raise SpecjaxError(f'int4 groups of {group} do not divide a weight of {k} inputs (shape {tuple(w.shape)})')
  blocks = storage.reshape(-1, group)
  chunk = max(1, (1 << 25) // group)  # groups per call: bounded memory, a few compiled shapes
  parts = [_int4_search(jnp.asarray(blocks[i : i + chunk])) for i in range(0, len(blocks), chunk)]
  scale = np.concatenate([np.asarray(s) for s, _ in parts]).reshape(n, k // group)
  v = np.concatenate([np.asarray(v) for _, v in parts]).reshape(n, k)
  return QMatrix(pack4(v + 8, group), scale, None, 4, group, 8, out_axis, 'int4')


@jax.jit
def _int4_search(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:  # [R, G] -> scale [R], levels int8 [R, G]
  """Symmetric int4 levels (-8..7) and a scale per group, least squares over 19 candidate grids.

  Grid i maps the group's largest-magnitude weight x_max to -(8 + 0.1 i) for i in -9..9 (the sign chosen so that
  -8, the level without a +8 twin, can hold it); for its levels l the best scale is d = <x, l> / <l, l>, leaving
  an error |x|^2 - <x, l>^2 / <l, l>; the grid with the least error wins (llama.cpp's search for its symmetric
  4-bit types).
  """
  peak = jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=1)[:, None], axis=1)[:, 0]  # [R]
  peak = jnp.where(peak == 0, 1.0, peak)
  best = (jnp.full(peak.shape, -1.0), jnp.zeros(peak.shape), jnp.zeros(blocks.shape, jnp.int8))
  for i in range(-9, 10):
    levels = jnp.clip(jnp.round(blocks * (-(8.0 + 0.1 * i) / peak)[:, None]), -8, 7)
    xl, ll = jnp.sum(blocks * levels, axis=1), jnp.maximum(jnp.sum(levels * levels, axis=1), 1.0)
    gain = xl * xl / ll  # the error this grid removes
    better = gain > best[0]
    best = (
        jnp.where(better, gain, best[0]),
        jnp.where(better, xl / ll, best[1]),
        jnp.where(better[:, None], levels.astype(jnp.int8), best[2]),
    )
  return best[1].astype(jnp.float32), best[2]


def pack4(nibbles: np.ndarray, group: int) -> np.ndarray:  # [N, K] values 0..15 -> uint8 [N, K / 2]
  """Packs nibbles two to a byte: element j and j + G / 2 of each group share byte j."""
  n, k = nibbles.shape
  g = nibbles.astype(np.uint8).reshape(n, k // group, 2, group // 2)
  return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def to_device(q: QMatrix) -> QMatrix:
  """Host arrays -> jax arrays, dtypes as stored (float32 scales and mins)."""
  return jax.tree.map(jax.device_put, q)
