"""The CPU quantized-matmul kernel at decode / verify widths, float and int8 activations, against an f32 XLA dot.

  python benchmarks/quant_matmul_cpu.py [--shapes head up down] [--m 1 2 4 5 8] [--calls 20]
      [--json benchmarks/results/quant_matmul_cpu.json]

Shapes (Gemma 3 270M): head K 640 x N 262144 (the tied embedding), up K 640 x N 2048, down K 2048 x N 640.
Formats, each as the kernel reads it ([N, K] storage): int8 (a scale per output channel, G = K; the `int8` arm),
q8_0 (int8, a scale per 32: the GGUF head), int4 (a scale per 32, offset 8), q4_k (int4 nibbles, a scale and a min
per 32). Each format at act 32 (float activations, FMAs) and act 8 (act int8: VNNI); f32: `jnp.dot` of the float
weight. Time: the median of `--calls` jitted calls after 3 warm-ups; GB/s: the bytes the call reads from the
weight (values, scales, mins; f32: the float matrix) over that time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.provenance import device_description, git_info, now
from specjax.quant import cpu_kernel

SHAPES = {'head': (640, 262144), 'up': (640, 2048), 'down': (2048, 640)}
FORMATS = {'int8': (8, None, 0, False), 'q8_0': (8, 32, 0, False), 'int4': (4, 32, 8, False), 'q4_k': (4, 32, 0, True)}


def weights(rng, k: int, n: int, fmt: str):
  bits, group, offset, mins = FORMATS[fmt]
  group = group or k
  if bits == 8:
    values = rng.integers(-127, 128, (n, k), dtype=np.int8)
  else:
    values = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  scales = rng.uniform(0.001, 0.01, (n, k // group)).astype(np.float32)
  lows = rng.uniform(0, 0.01, (n, k // group)).astype(np.float32) if mins else None
  return [jnp.asarray(a) if a is not None else None for a in (values, scales, lows)], dict(
      bits=bits, group=group, offset=offset
  )


def timed(f, x, calls: int) -> float:
  for _ in range(3):
    f(x).block_until_ready()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--shapes', nargs='+', default=list(SHAPES))
  ap.add_argument('--formats', nargs='+', default=list(FORMATS))
  ap.add_argument('--m', nargs='+', type=int, default=[1, 2, 4, 5, 8])
  ap.add_argument('--calls', type=int, default=20)
  ap.add_argument('--json')
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for shape in args.shapes:
    k, n = SHAPES[shape]
    dense = jnp.asarray(rng.standard_normal((k, n)).astype(np.float32))
    arms = {'f32': (jax.jit(lambda x: jnp.dot(x, dense)), dense.size * 4)}
    for fmt in args.formats:
      (values, scales, lows), kw = weights(rng, k, n, fmt)
      nbytes = sum(a.size * a.dtype.itemsize for a in (values, scales, lows) if a is not None)
      for act in (32, 8):
        f = jax.jit(
            lambda x, v=values, s=scales, lo=lows, kw=kw, act=act: cpu_kernel.qmatmul(x, v, s, lo, **kw, act_bits=act)
        )
        arms[f'{fmt}/act{act}'] = (f, nbytes)
    for m in args.m:
      x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
      for arm, (f, nbytes) in arms.items():
        s = timed(f, x, args.calls)
        row = {
            'shape': shape,
            'k': k,
            'n': n,
            'm': m,
            'arm': arm,
            'ms': round(s * 1e3, 3),
            'gb_s': round(nbytes / s / 1e9, 1),
        }
        rows.append(row)
        print(f'{shape:5s} M={m} {arm:12s} {row["ms"]:9.3f} ms {row["gb_s"]:6.1f} GB/s', flush=True)
  if args.json:
    report = {'date': now(), 'git': git_info(), 'device': device_description(), 'isa': cpu_kernel.isa(), 'rows': rows}
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == '__main__':
  main()
