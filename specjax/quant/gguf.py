"""GGUF quantized blocks -> `QMatrix`, without a round trip through float32.

Each type's integers come out exactly and its scales as float32 products of
the block's f16 scale and its integer sub-scale (exact in float32), so
`dequantize(repack(...), xp=np)` equals `gguf.quants.dequantize` bit for bit
(tests/test_quant.py). Layouts (per row of K inputs, blocks along K):

- Q8_0  (32 / block: f16 d, 32 int8):            v = q,      scale d        (bits 8)
- Q4_0  (32: f16 d, 16 bytes of nibbles):        v = u - 8,  scale d        (bits 4, packed as stored)
- Q5_0  (32: f16 d, 32 high bits, nibbles):      v = q - 16, scale d        (bits 8)
- Q4_K  (256: f16 d, f16 dmin, 12 bytes of 6-bit sub-scales and mins, nibbles):
        v = u, scale d * sc, min dmin * m per 32                            (bits 4, repacked)
- Q5_K  (as Q4_K, plus a high bit per value):    v = q, scale and min per 32 (bits 8)
- Q6_K  (256: low nibbles, 2 high bits, 16 int8 sub-scales, f16 d):
        v = q - 32, scale d * sc per 16                                     (bits 8)
"""

from __future__ import annotations

import jax
import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from specjax.quant.formats import QMatrix, pack4

REPACKED = frozenset({T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K})
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] uint8 -> float32 [...]
  return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:  # [..., C * width / 2] -> [..., C * 2, width / 2 ...]
  """ggml's K-quant nibble order: each `width`-byte chunk holds 2 sub-blocks, low nibbles first."""
  c = qs.reshape(*qs.shape[:-1], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(2, 1)
  return (c & 15).reshape(*qs.shape[:-1], -1, width)


def repack(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> QMatrix:
  """A stored tensor (`raw` [(E,) N, bytes per row] uint8, `shape` ((E,) N, K)) as a QMatrix, `out_axis` 0 (a
  3-D tensor, stacked experts: one matrix each, every leaf with the leading E)."""
  if len(shape) == 3:
    e, n, k = shape
    return jax.tree.map(lambda x: x.reshape(e, n, -1), repack(raw.reshape(e * n, -1), qtype, (e * n, k)))
  qtype = T(qtype)
  n, k = shape
  block, size = quants.GGML_QUANT_SIZES[qtype]
  b = raw.reshape(n, k // block, size)
  kind = qtype.name
  if qtype == T.Q8_0:
    v = b[..., 2:].view(np.int8).reshape(n, k)
    return QMatrix(v, _f16(b[..., :2]), None, 8, 32, 0, 0, kind)
  if qtype == T.Q4_0:
    return QMatrix(np.ascontiguousarray(b[..., 2:]).reshape(n, k // 2), _f16(b[..., :2]), None, 4, 32, 8, 0, kind)
  if qtype == T.Q5_0:
    high = np.ascontiguousarray(b[..., 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [N, K/32, 32]
    low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)
    v = (low | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return QMatrix(v.reshape(n, k), _f16(b[..., :2]), None, 8, 32, 0, 0, kind)
  if qtype in (T.Q4_K, T.Q5_K):
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    scale = (d * sc.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // 32)
    mins = (dmin * m.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // 32)
    if qtype == T.Q4_K:
      u = _nibbles(b[..., 16:], 32)  # [N, K/256, 8, 32]
      return QMatrix(pack4(u.reshape(n, k), 32), scale, mins, 4, 32, 0, 0, kind)
    qh = b[..., 16:48].reshape(n, k // 256, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = _nibbles(b[..., 48:], 32) | ((qh & 1) << 4)
    return QMatrix(q.astype(np.int8).reshape(n, k), scale, mins, 8, 32, 0, 0, kind)
  if qtype == T.Q6_K:
    d = _f16(b[..., 208:210])[..., None]
    scale = (d * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, k // 16)
    low = _nibbles(b[..., :128], 64).reshape(n, -1, 8, 32)
    high = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (low | ((high & 3).reshape(n, -1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return QMatrix(q.reshape(n, k), scale, None, 8, 16, 0, 0, kind)
  raise ValueError(f'GGUF type {qtype.name} is not repacked (types: {", ".join(t.name for t in sorted(REPACKED))})')
