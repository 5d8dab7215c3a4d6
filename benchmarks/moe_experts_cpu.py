"""Routed experts (one MoE layer's `layers.routed_experts`) on the CPU: float32 against int8 / int4 experts.

  python benchmarks/moe_experts_cpu.py [--dim 2048] [--hidden 512] [--experts 64] [--top-k 8] [--tokens 1 5 8]
      [--calls 20] [--json benchmarks/results/moe_experts_cpu.json]

The layer's experts: E stacked SwiGLU experts, gate|up [E, D, 2F] and down [E, F, D] (the defaults: Qwen3.5-MoE's
expert shapes, D 2048, F 512, top-8, with 64 of its 256 experts: the chosen experts' cost does not depend on E).
Each call routes T tokens (decode: 1; a verify pass of K drafts: K + 1) to top-k experts drawn at random, the same
for every arm:

  float32  the float stack, the chosen experts gathered and multiplied (XLA);
  float32-kernel  the float stack stored [E, N, K] (kind 'f32'), each (token, expert) row on the CPU kernel;
  int8     the stack quantized per output channel, each (token, expert) row on the CPU kernel
           (`ops.expert_matmul` -> `cpu_kernel.qmatmul_rows`), weights read as stored;
  int4     groups of 32, the same path.

Reported per arm and T: the median time of `--calls` jitted calls, the stack's bytes held, the bytes of the
chosen experts' weights (the most a call must read), and the time over the same arm's T = 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax  # noqa: F401  (sets the XLA:CPU flags before the backend starts)
from specjax.models.layers import routed_experts
from specjax.quant import cpu_kernel, ops
from specjax.quant.formats import quantize, to_device


def timed(fn, args, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--dim', type=int, default=2048)
  parser.add_argument('--hidden', type=int, default=512)
  parser.add_argument('--experts', type=int, default=64)
  parser.add_argument('--top-k', type=int, default=8)
  parser.add_argument('--tokens', type=int, nargs='+', default=[1, 5, 8])
  parser.add_argument('--calls', type=int, default=20)
  parser.add_argument('--json')
  args = parser.parse_args()
  if not ops.uses_kernel():
    raise SystemExit(f'needs the CPU kernel: {ops.kernel_status()}')
  d, f, e, k = args.dim, args.hidden, args.experts, args.top_k
  rng = np.random.default_rng(0)
  gate_up = (rng.standard_normal((e, d, 2 * f), np.float32) * d**-0.5).astype(np.float32)
  down = (rng.standard_normal((e, f, d), np.float32) * f**-0.5).astype(np.float32)
  arms = {'float32': (jnp.asarray(gate_up), jnp.asarray(down))}
  for mode in ('f32', 'int8', 'int4'):
    arms['float32-kernel' if mode == 'f32' else mode] = tuple(
        to_device(quantize(w, mode, out_axis=1, group=32)) for w in (gate_up, down)
    )
  del gate_up, down
  held = lambda ws: sum(x.nbytes for w in ws for x in jax.tree.leaves(w))
  run = jax.jit(lambda x, w, ids, gu, dn: routed_experts(x, w, ids, gu, dn, 'silu', gather=True))
  rows, out = [], None
  for t in args.tokens:
    x = jnp.asarray(rng.standard_normal((1, t, d), np.float32))
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)])[None].astype(np.int32))
    weights = jnp.full((1, t, k), 1.0 / k, jnp.float32)
    chosen = len(np.unique(np.asarray(ids)))
    for arm, ws in arms.items():
      y = run(x, weights, ids, *ws)
      if arm == 'float32':
        out = y
      err = float(jnp.abs(y - out).max() / jnp.abs(out).max())
      s = timed(run, (x, weights, ids, *ws), args.calls)
      rows.append(
          dict(
              arm=arm,
              tokens=t,
              ms=round(s * 1e3, 3),
              experts_touched=chosen,
              touched_mb=round(held(ws) / e * chosen / 1e6, 2),
              held_mb=round(held(ws) / 1e6, 1),
              rel_err_vs_float=round(err, 5),
          )
      )
      print(json.dumps(rows[-1]), flush=True)
  for r in rows:
    one = next(q for q in rows if q['arm'] == r['arm'] and q['tokens'] == args.tokens[0])
    r['vs_first_width'] = round(r['ms'] / one['ms'], 2)
  print(f'\n| arm | T | ms | x T={args.tokens[0]} | experts touched | MB touched | MB held | rel. err vs float |')
  print('|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(
        f"| {r['arm']} | {r['tokens']} | {r['ms']:.2f} | {r['vs_first_width']:.2f} | {r['experts_touched']} |"
        f" {r['touched_mb']} | {r['held_mb']} | {r['rel_err_vs_float']} |"
    )
  if args.json:
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
        cpu=platform.processor() or platform.machine(),
        kernel_isa=cpu_kernel.isa(),
        jax=jax.__version__,
        args=vars(args),
    )
    with open(args.json, 'w') as fh:
      json.dump(dict(meta=meta, rows=rows), fh, indent=1)


if __name__ == '__main__':
  main()
