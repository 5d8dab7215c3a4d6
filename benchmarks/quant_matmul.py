"""Weight-only int8 matmuls at decode / verify widths: time, weight bandwidth, and against bf16.

  python benchmarks/quant_matmul.py [--sizes full | small] [--shapes square head] [--m 1 2 4 8 16 64]
      [--dtype bfloat16] [--warmup 3] [--calls 20] [--json out.json]

For each shape, [M, K] activations times a weight of K inputs and N outputs stored [N, K] (an embedding
table's layout), at each width M (decode: 1; verify: the draft depth + 1; batched rows):

  square  K = N = 4096, a 4096-wide projection;
  head    K = 640, N = 262144, Gemma 3 270M's tied embedding as the LM head;

(`--sizes small`, the default off a GPU: 256 x 256 and 64 x 8192, a smoke run) three ways, output [M, N]:

  bf16  the weight in the activation dtype (`--dtype`: bfloat16 on a GPU, float32 on the CPU), one `jnp.dot`;
  int8  the weight as int8 with a float32 scale per output channel, dequantized inside jit:
        dot(x, W.astype(x.dtype)) * scale;
  mgpu  jax's Hopper mixed-type kernel (`jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu`), on a
        Hopper GPU in bfloat16 (or float16): it takes the int8 operand on the left, so it runs the transposed problem
        W [N, K] @ x^T [K, M padded to 16 columns], then the scale; "unavailable: why" where it cannot import,
        configure or compile.

Time per call: the median of `--calls` calls after `--warmup`, each to `block_until_ready` (`wall_s`: dispatch
included, which dominates microsecond kernels), and on a GPU the kernels' own time from CUPTI (jax's Mosaic GPU
profiler; `device_s`, None where unavailable). GB/s: weight bytes (int8 plus its scales, or bf16) over the device
time where there is one, else the wall time; `speedup`: bf16's time over the method's. `max_abs_err`: the largest
difference from a float32 numpy product of the same dequantized weight (`ref_max_abs`: the reference's largest
magnitude). The XLA_FLAGS in force are recorded (benchmarks/gpu_checks.sh turns XLA's autotuning off).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SIZES = {'full': {'square': (4096, 4096), 'head': (640, 262144)}, 'small': {'square': (256, 256), 'head': (64, 8192)}}


def log(msg: str):
  print(f'[{time.strftime("%H:%M:%S")}] {msg}', flush=True)


def bf16_matmul(x, w, scale):
  del scale
  return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)


def int8_matmul(x, wq, scale):
  out = jnp.dot(x, wq.astype(x.dtype).T, preferred_element_type=jnp.float32)
  return (out * scale).astype(x.dtype)


def mixed_kernel(dtype) -> tuple[object, str]:
  """(fn(x, wq, scale) or None, 'ok' or 'unavailable: reason')."""
  dev = jax.devices()[0]
  cc = getattr(dev, 'compute_capability', '')
  if dev.platform != 'gpu' or not str(cc).startswith('9.'):
    return None, f'unavailable: not a Hopper GPU ({dev.device_kind}, compute capability {cc or "-"})'
  if dtype not in (jnp.bfloat16, jnp.float16):
    return None, f'unavailable: it multiplies int8 by bfloat16 / float16, not {jnp.dtype(dtype).name}'
  try:
    mm = importlib.import_module('jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu')
    kernel, config_cls, wg_m = mm.mixed_matmul_kernel, mm.TuningConfig, mm.MatmulDimension.M
  except Exception as e:  # pylint: disable=broad-except
    return None, f'unavailable: {type(e).__name__}: {e}'

  def fn(x, wq, scale):
    m, k = x.shape
    mp = max(16, -(-m // 16) * 16)  # the kernel's N tile: a multiple of 16 columns (a 32-byte swizzle)
    tile_n = next(t for t in (64, 32, 16) if mp % t == 0)
    config = config_cls(
        tile_m=64,
        tile_n=tile_n,
        tile_k=128 if k % 128 == 0 else 64,
        max_concurrent_steps=4,
        epi_tile_n=tile_n,
        epi_tile_m=64,
        wg_dimension=wg_m,  # the two warpgroups split the weight's rows: x^T is narrow
    )
    xt = jnp.pad(x, ((0, mp - m), (0, 0))).T
    out = kernel(wq, xt, out_dtype=x.dtype, config=config)  # [N, mp]
    return (out[:, :m].T.astype(jnp.float32) * scale).astype(x.dtype)

  return fn, 'ok'


def time_call(fn, args, warmup: int, calls: int, on_gpu: bool, notes: dict):
  """(first output, compile s, median wall s, median CUPTI device s or None)."""
  t = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  wall = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - t)
  device = None
  if on_gpu and 'cupti' not in notes:
    try:
      from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top

      _, ms = profiler.measure(fn, iterations=max(calls, 2))(*args)
      if ms:
        device = statistics.median(ms if isinstance(ms, list) else [ms]) / 1e3
    except Exception as e:  # pylint: disable=broad-except
      notes['cupti'] = f'no device times: {type(e).__name__}: {e}'
      log(notes['cupti'])
  return out, compile_s, statistics.median(wall), device


def run_shape(name, k, n, args, methods, on_gpu, notes, rows, save):
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  wq = rng.integers(-127, 128, (n, k), dtype=np.int8)
  scale = (rng.uniform(0.5, 1.5, n) / (127 * np.sqrt(k))).astype(np.float32)
  x_all = jnp.asarray(rng.standard_normal((max(args.m), k), np.float32), dtype)
  x_host = np.asarray(x_all.astype(jnp.float32))
  ref = (x_host @ wq.astype(np.float32).T) * scale  # [max M, N]
  weights = {
      'bf16': (jnp.asarray(wq.astype(np.float32) * scale[:, None], dtype), n * k * dtype.itemsize),
      'int8': (jnp.asarray(wq), n * k + 4 * n),
      'mgpu': (jnp.asarray(wq), n * k + 4 * n),
  }
  scale_dev = jnp.asarray(scale)
  for m in args.m:
    x = x_all[:m]
    base = None
    for method, fn in list(methods.items()):
      w, nbytes = weights[method]
      row = dict(shape=name, m=m, k=k, n=n, method=method, weight_bytes=nbytes)
      try:
        out, compile_s, wall, device = time_call(jax.jit(fn), (x, w, scale_dev), args.warmup, args.calls, on_gpu, notes)
      except Exception as e:  # pylint: disable=broad-except
        row['error'] = f'{type(e).__name__}: {str(e)[:500]}'
        log(f'{name} M={m} {method}: {row["error"]}')
        rows.append(row)
        failed = [r for r in rows if r['method'] == method]
        if method == 'mgpu' and len(failed) >= 2 and all('error' in r for r in failed[-2:]):
          del methods[method]  # twice in a row: no more compiles spent on it
          notes['mgpu'] = 'given up after two failures in a row'
        continue
      t = device or wall
      base = t if method == 'bf16' else base
      row.update(
          compile_s=compile_s,
          wall_s=wall,
          device_s=device,
          gb_s=nbytes / t / 1e9,
          speedup=base / t if base else None,
          max_abs_err=float(np.abs(np.asarray(out, np.float32) - ref[:m]).max()),
          ref_max_abs=float(np.abs(ref[:m]).max()),
      )
      rows.append(row)
      dev_us = '-' if device is None else f'{device * 1e6:.1f}'
      log(
          f'{name} [{m}, {k}] x [{k}, {n}] {method}: {wall * 1e6:.1f} us wall, {dev_us} us device, '
          f'{row["gb_s"]:.0f} GB/s, {row["speedup"] or 0:.2f}x bf16, max abs err {row["max_abs_err"]:.3g} '
          f'(of {row["ref_max_abs"]:.3g})'
      )
    save()


def table(rows: list[dict], args, methods: list[str]) -> str:
  done = {(r['shape'], r['m'], r['method']): r for r in rows if 'error' not in r}
  quant = [m for m in methods if m != 'bf16']
  lines = [
      f'| shape | M | {" | ".join(f"{m} us" for m in methods)} | {" | ".join(f"{m} / bf16" for m in quant)} | '
      f'{" | ".join(f"{m} GB/s" for m in quant)} |',
      '|---|---|' + '---|' * (len(methods) + 2 * len(quant)),
  ]
  fmt = lambda v, f: '-' if v is None else format(v, f)
  for name in args.shapes:
    for m in args.m:
      got = {method: done.get((name, m, method), {}) for method in methods}
      us = [fmt(1e6 * (r['device_s'] or r['wall_s']) if r else None, '.1f') for r in got.values()]
      speedup = [fmt(got[q].get('speedup'), '.2f') + ('x' if got[q].get('speedup') else '') for q in quant]
      gb_s = [fmt(got[q].get('gb_s'), '.0f') for q in quant]
      lines.append(f'| {name} | {m} | {" | ".join(us + speedup + gb_s)} |')
  return '\n'.join(lines)


def main(argv=None) -> int:
  on_gpu = jax.default_backend() == 'gpu'
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--sizes', choices=list(SIZES), default='full' if on_gpu else 'small')
  p.add_argument('--shapes', nargs='+', choices=['square', 'head'], default=['square', 'head'])
  p.add_argument('--m', type=int, nargs='+', default=[1, 2, 4, 8, 16, 64])
  p.add_argument('--dtype', choices=['bfloat16', 'float16', 'float32'], default='bfloat16' if on_gpu else 'float32')
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument('--calls', type=int, default=20 if on_gpu else 5)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)

  device = jax.devices()[0]
  mgpu, mgpu_note = mixed_kernel(jnp.dtype(args.dtype))
  methods = {'bf16': bf16_matmul, 'int8': int8_matmul} | ({'mgpu': mgpu} if mgpu else {})
  log(f'{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, {args.dtype}; mgpu: {mgpu_note}')
  notes, rows = {}, []
  out = dict(
      date=datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
      device=device.device_kind,
      backend=jax.default_backend(),
      jax=jax.__version__,
      xla_flags=os.environ.get('XLA_FLAGS', ''),
      settings={k: v for k, v in vars(args).items() if k != 'json'},
      mgpu=mgpu_note,
      notes=notes,
      rows=rows,
  )

  def save():
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(out, indent=1))

  for name in args.shapes:
    k, n = SIZES[args.sizes][name]
    run_shape(name, k, n, args, methods, on_gpu, notes, rows, save)
  names = ['bf16', 'int8'] + (['mgpu'] if mgpu else [])
  if mgpu and not any(r['method'] == 'mgpu' and 'error' not in r for r in rows):
    out['mgpu'] = mgpu_note = 'unavailable: ' + next((r['error'] for r in rows if r['method'] == 'mgpu'), 'not run')
  print(table(rows, args, names))
  print(f'(us: {"CUPTI device time" if on_gpu and "cupti" not in notes else "wall time per call"}; mgpu: {mgpu_note})')
  save()
  return 0


if __name__ == '__main__':
  sys.exit(main())
