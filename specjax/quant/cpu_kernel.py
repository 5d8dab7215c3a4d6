"""A CPU matmul that keeps weights quantized: `jax.ffi` custom call into specjax/quant/cpu/qmatmul.cc.

  y = qmatmul(x, values, scales, mins, bits=8, group=32, offset=0)  # x [..., K] float32 -> y [..., N] float32
  y = qmatmul_rows(x, values, scales, mins, ids, bits=8, group=32)  # routed experts: y[m] = x[m] @ w[ids[m]]

A matrix of K inputs and N outputs is stored output-major ([N, K], an embedding table's layout) in groups of G
consecutive k (G even, K a multiple of G; G = K is per channel):

  values  bits 8: int8 [N, K] (also holds 5- and 6-bit values); bits 4: uint8 [N, K // 2], the group starting at
          k0 in G / 2 bytes, byte j holding k0 + j in its low nibble and k0 + j + G / 2 in its high one, a nibble u
          meaning u - offset (offset 0 or 8); bits 32: float32 [N, K] (no scales, no groups);
  scales  float32 [N, K // G];  mins  float32 [N, K // G] or None;
  w[n, k] = scales[n, k // G] * v[n, k] - mins[n, k // G];  y[m, n] = sum_k x[m, k] * w[n, k].

Each y[m, n] is a function of x[m] and w[n] alone, bit for bit: the same row gives the same bits at M = 1 (decode)
and at M = 5 (verify), so greedy speculative output equals greedy autoregressive output. Per (m, n) the kernel
accumulates fused multiply-adds in SIMD lanes in group order and sums the lanes in a fixed tree; channel blocks are
shared over XLA:CPU's intra-op threads. The extension is compiled with -march=native by `pip install` on the machine
that runs it (AVX-512, AVX2 + FMA, or scalar code: `isa()` says which); the bits are fixed for one build.

Act int8 (`act_bits=8`, weights of 4 or 8 bits), what llama.cpp does on the CPU: each row x[m] is quantized per
block of B = `act_block(G)` inputs (32 where 32 divides G, else 16 where 16 does, else G):
s_x = max|x_block| / 127, q = round-half-even(x / s_x) clamped to [-127, 127] (`quantize_act`); each block's
integer dot idot[m, n, b] = sum q * v is exact (VNNI vpdpbusd: uint8 weight bytes times int8 q), and the float32
rest runs in one fixed order, each operation rounded on its own (no FMA):

  xs[m, g] = sum over the blocks b of g, in order, of s_x[m, b] * qsum[m, b]  (qsum: the block's sum of q);
  y[m, n] = sum over g, in order, of  scales[n, g] * d[m, n, g]  - mins[n, g] * xs[m, g]  (mins optional),
            d[m, n, g] = sum over the blocks b of g, in order (from 0), of s_x[m, b] * idot[m, n, b];

i.e. `acc = acc + scale * d`, then `acc = acc - min * xs`, group after group. It is the product of the
weight with the activations s_x * q, so every build gives the same bits and `qmatmul_act8_reference` (numpy)
reproduces them; `act8_dequantized` (jnp, under jit) gives the same function up to float order, for the XLA
path. Row independence holds as for float activations (the quantization is per row).

Why not oneDNN (measured on this AMD EPYC, 2 cores, oneDNN 3.13 from the PyPI `onednn` wheel, K 640 x N 262144,
int8 with a scale per 32): its matmul takes f32 activations with s8 / u4 weights and grouped scales
(`brg_matmul:avx512_core`) and was row-independent across M = 1..8, but (1) weight zero points must be integers
(f32 is refused), so a Q4_K/Q5_K `min` per group is not representable; (2) at 18.9 / 19.0 / 19.8 / 23.1 / 27.5 ms
for M = 1 / 2 / 4 / 5 / 8 it reads 8.9 GB/s at M = 1, far from this machine's ~35-49 GB/s; (3) the PyPI build is
the SYCL runtime (2 GB of DPC++ / OpenCL / TBB wheels) whose CPU engine only starts with OCL_ICD_FILENAMES pointed
at the wheel's OpenCL CPU driver. benchmarks/README.md has the kernel's figures next to it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

_MODULE = 'specjax.quant._qmatmul_cpu'
_TARGET = 'specjax_qmatmul'
_ROWS_TARGET = 'specjax_qmatmul_rows'


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
  """The loaded extension with its FFI target registered, or None and why not."""
  spec = importlib.util.find_spec(_MODULE)
  if spec is None or spec.origin is None:
    return None, f'the C++ extension {_MODULE} is not built (reinstall with a C++ compiler: pip install -e .)'
  try:
    lib = ctypes.CDLL(spec.origin)
  except OSError as e:
    return None, f'the C++ extension {spec.origin} does not load: {e}'
  lib.SpecjaxQmatmulIsa.restype = ctypes.c_char_p
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SpecjaxQmatmul), platform='cpu')
  jax.ffi.register_ffi_target(_ROWS_TARGET, jax.ffi.pycapsule(lib.SpecjaxQmatmulRows), platform='cpu')
  return lib, ''


def available() -> bool:
  """Whether the kernel's extension is built and registered."""
  return _library()[0] is not None


def reason() -> str:
  """One line: why the kernel is unavailable ('' when it is available)."""
  return _library()[1]


def isa() -> str:
  """The instruction set the extension was built for: 'avx512', 'avx2' or 'scalar'."""
  lib = _library()[0]
  return lib.SpecjaxQmatmulIsa().decode() if lib is not None else ''


def check_shapes(k: int, values_shape, scales_shape, mins_shape, *, bits: int, group: int, offset: int):
  """Raises SpecjaxError unless values / scales / mins fit an input width K in the format above."""
  if bits not in (4, 8, 32):
    raise SpecjaxError(f'qmatmul: bits must be 4, 8 or 32, got {bits}')
  if bits != 32 and (group < 2 or group % 2 or k % group):
    raise SpecjaxError(f'qmatmul: the group ({group}) must be even and divide the input width K = {k}')
  if offset not in (0, 8) or (offset and bits != 4):
    raise SpecjaxError(f'qmatmul: offset must be 0, or 8 for 4-bit values, got {offset} at {bits} bits')
  width = k // 2 if bits == 4 else k
  if len(values_shape) != 2 or values_shape[1] != width:
    raise SpecjaxError(f'qmatmul: {bits}-bit values must be [N, {width}] for K = {k}, got {list(values_shape)}')
  if bits == 32:
    return
  want = [values_shape[0], k // group]
  for name, shape in (('scales', scales_shape), ('mins', mins_shape)):
    if shape is not None and list(shape) != want:
      raise SpecjaxError(f'qmatmul: {name} must be [N, K // G] = {want}, got {list(shape)}')


def qmatmul(
    x,
    values,
    scales=None,
    mins=None,
    *,
    bits: int,
    group: int | None = None,
    offset: int = 0,
    act_bits: int = 32,
    _mutant: int = 0,
):
  """y[..., n] = sum_k x[..., k] * w[n, k] for a weight kept quantized (format in the module docstring).

  x: [..., K] float32; values: [N, K] int8 | [N, K // 2] uint8 | [N, K] float32 (bits 32); scales, mins:
  [N, K // G] float32 (mins optional; neither for bits 32). `act_bits` 32: float activations; 8: activations
  quantized per block of `act_block(G)` inputs, integer dot products (act int8 above; bits 4 or 8 only).
  `_mutant` (tests): 1 gives each block one scale for all rows (row results then depend on M).
  Returns [..., N] float32. Works under jit.
  """
  if act_bits not in (8, 32) or (act_bits == 8 and bits == 32):
    raise SpecjaxError(f'qmatmul: act_bits must be 32, or 8 with 4- or 8-bit weights, got {act_bits} at {bits} bits')
  lib, why = _library()
  if lib is None:
    raise SpecjaxError(f'qmatmul: the CPU kernel is unavailable: {why}')
  *lead, k = x.shape
  group = k if group is None or bits == 32 else group
  check_shapes(
      k,
      values.shape,
      None if scales is None else scales.shape,
      None if mins is None else mins.shape,
      bits=bits,
      group=group,
      offset=offset,
  )
  dtype = {8: np.int8, 4: np.uint8, 32: np.float32}[bits]
  if values.dtype != dtype:
    raise SpecjaxError(f'qmatmul: {bits}-bit values must be {np.dtype(dtype).name}, got {values.dtype}')
  if bits != 32 and scales is None:
    raise SpecjaxError(f'qmatmul: {bits}-bit values need scales')
  n = values.shape[0]
  rows = x.reshape(math.prod(lead), k).astype(jnp.float32)  # [M, K]
  empty = jnp.zeros((0, 0), jnp.float32)
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32), vmap_method='sequential')
  y = call(
      rows,
      values,
      empty if scales is None else scales.astype(jnp.float32),
      empty if mins is None else mins.astype(jnp.float32),
      bits=np.int64(bits),
      group=np.int64(group),
      offset=np.int64(offset),
      has_mins=mins is not None,
      act_bits=np.int64(act_bits),
      mutant=np.int64(_mutant),
  )
  return y.reshape(*lead, n)  # [..., N]


def qmatmul_rows(x, values, scales, mins, ids, *, bits: int, group: int, offset: int = 0, act_bits: int = 32):
  """y[m] = x[m] @ w[ids[m]].T over a stack of E matrices in qmatmul's format (routed experts).

  x: [M, K] float32; values: [E, N, K] int8 | [E, N, K // 2] uint8 | [E, N, K] float32; scales, mins:
  [E, N, K // G] (mins optional; neither for bits 32); ids: [M] int in [0, E). Each row's output has the bits
  `qmatmul(x[m:m+1], values[ids[m]], ...)` gives, whatever the other rows (the kernel gathers each expert's
  rows into one product). Returns [M, N] float32. Works under jit.
  """
  lib, why = _library()
  if lib is None:
    raise SpecjaxError(f'qmatmul_rows: the CPU kernel is unavailable: {why}')
  m, k = x.shape
  group = k if bits == 32 else group
  for shape in (values.shape, None if scales is None else scales.shape, None if mins is None else mins.shape):
    if shape is not None and len(shape) != 3:
      raise SpecjaxError(f'qmatmul_rows: values, scales and mins must be [E, N, .], got {list(shape)}')
  inner = lambda a: None if a is None else a.shape[1:]
  check_shapes(k, values.shape[1:], inner(scales), inner(mins), bits=bits, group=group, offset=offset)
  empty = jnp.zeros((0, 0, 0), jnp.float32)
  call = jax.ffi.ffi_call(
      _ROWS_TARGET, jax.ShapeDtypeStruct((m, values.shape[1]), jnp.float32), vmap_method='sequential'
  )
  return call(
      x.astype(jnp.float32),
      values,
      empty if scales is None else scales.astype(jnp.float32),
      empty if mins is None else mins.astype(jnp.float32),
      ids.astype(jnp.int32),
      bits=np.int64(bits),
      group=np.int64(group),
      offset=np.int64(offset),
      has_mins=mins is not None,
      act_bits=np.int64(act_bits),
  )


def act_block(group: int) -> int:
  """B, the inputs per activation scale under act int8: 32 where 32 divides G, else 16 where 16 does, else G."""
  return 32 if group % 32 == 0 else 16 if group % 16 == 0 else group


def quantize_act(x, block: int, xp=np):  # x [M, K] float32 -> q int8 [M, K // B, B], s_x float32 [M, K // B]
  """Each block of B inputs of each row: s_x = max|x| / 127, q = round-half-even(x / s_x) in [-127, 127]."""
  m, k = x.shape
  xb = x.astype(xp.float32).reshape(m, k // block, block)
  sx = xp.max(xp.abs(xb), axis=-1) / xp.float32(127.0)
  q = xp.clip(xp.round(xb / xp.where(sx == 0, xp.float32(1.0), sx)[..., None]), -127, 127).astype(xp.int8)
  return q, sx


def qmatmul_act8_reference(x, values, scales, mins=None, *, bits: int, group: int, offset: int = 0) -> np.ndarray:
  """The kernel's act-int8 output, bit for bit, in numpy (the order of the module docstring). x [M, K] -> [M, N]."""
  x = np.asarray(x, np.float32)
  values, scales = np.asarray(values), np.asarray(scales, np.float32)
  m, k = x.shape
  n, groups, block = values.shape[0], k // group, act_block(group)
  if bits == 8:
    v = values.astype(np.int64)
  else:
    halves = values.reshape(n, groups, group // 2)
    v = np.concatenate([halves & 15, halves >> 4], axis=-1).reshape(n, k).astype(np.int64) - offset
  q, sx = quantize_act(x, block)
  idot = np.einsum('mbi,nbi->mnb', q.astype(np.int64), v.reshape(n, k // block, block)).astype(np.float32)
  qsum = q.astype(np.int64).sum(-1).astype(np.float32)  # [M, K // B]
  per = group // block
  acc = np.zeros((m, n), np.float32)
  for g in range(groups):
    d = np.zeros((m, n), np.float32)
    xs = np.zeros(m, np.float32)
    for b in range(g * per, (g + 1) * per):
      d = d + sx[:, b, None] * idot[:, :, b]
      xs = xs + sx[:, b] * qsum[:, b]
    acc = acc + scales[None, :, g] * d
    if mins is not None:
      acc = acc - np.asarray(mins, np.float32)[None, :, g] * xs[:, None]
  return acc


def act8_dequantized(x, group: int):  # x [..., K] -> [..., K]
  """x as act int8 sees it (s_x * q per block), in jnp (works under jit): `x' @ w` is the same function as the
  kernel's act-int8 product up to the order of float sums."""
  *lead, k = x.shape
  rows = x.reshape(-1, k).astype(jnp.float32)
  q, sx = quantize_act(rows, act_block(group), xp=jnp)
  return (q.astype(jnp.float32) * sx[..., None]).reshape(*lead, k).astype(x.dtype)
