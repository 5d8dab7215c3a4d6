"""A CPU matmul that keeps weights quantized: `jax.ffi` custom call into specjax/quant/cpu/qmatmul.cc.

  y = qmatmul(x, values, scales, mins, bits=8, group=32, offset=0)  # x [..., K] float32 -> y [..., N] float32

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


def qmatmul(x, values, scales=None, mins=None, *, bits: int, group: int | None = None, offset: int = 0):
  """y[..., n] = sum_k x[..., k] * w[n, k] for a weight kept quantized (format in the module docstring).

  x: [..., K] float32; values: [N, K] int8 | [N, K // 2] uint8 | [N, K] float32 (bits 32); scales, mins:
  [N, K // G] float32 (mins optional; neither for bits 32). Returns [..., N] float32. Works under jit.
  """
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
  )
  return y.reshape(*lead, n)  # [..., N]
