"""Paged attention kernel: time, HBM bandwidth, and against XLA and jax's kernel.

  python benchmarks/paged_attention.py [--batch 1 8 64] [--context 1024 8192 32768]
      [--queries 1 4 8] [--heads 4] [--kv-heads 1] [--head-dim 256] [--page-size 16]
      [--dtype bfloat16] [--iters 20] [--repeats 5] [--json out.json]

For every (batch B, context, Q queries per sequence) it times three ways to
attend Q new queries per sequence over `context` cached keys (the Q included):

  kernel  pallas_kernels.paged_attention(impl="pallas"): the Triton kernel,
          Q * G rows per KV head in one block.
  xla     the pure-JAX reference (impl="xla").
  jax1q   jax.experimental.pallas.ops.gpu.paged_attention, one query per
          row: the B * Q queries flattened into the batch, each with its own
          causal length, the block table repeated (every page read Q times).

Each call feeds its output back as the next call's q inside one jitted
`fori_loop` of `--iters` calls, so the times are device times without
dispatch; the figure is the median over `--repeats` loops, per call. Each
row also records the largest absolute difference of the kernel and of
jax1q from the XLA reference on the same inputs (`*_max_abs_err`).
Achieved bandwidth is the bytes that must move (K and V of every context
key once per KV head, plus q and the output) over the kernel's time, also
as a fraction of the measured copy bandwidth (`x * s` over a 2 GiB buffer,
read + write counted). benchmarks/README.md defines every figure.

Without a GPU it runs the same code in Pallas interpret mode on the CPU with
tiny shapes (so the script cannot rot) and says the GPU figures are pending.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention import triton_kernel

GPU_DEFAULTS = dict(
    batch=[1, 8, 64], context=[1024, 8192, 32768], queries=[1, 4, 8], dtype='bfloat16', iters=20, repeats=5
)
CPU_DEFAULTS = dict(batch=[1, 2], context=[64, 160], queries=[1, 4], dtype='float32', iters=1, repeats=1, head_dim=32)
COPY_BYTES = 2 * 2**30
TARGET_BANDWIDTH = 0.70  # of copy bandwidth, at the longest context
TARGET_VERIFY_COST = 1.3  # time(Q=8) / time(Q=1)


def log(msg: str):
  print(f'[{time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr, flush=True)


def copy_bandwidth(on_gpu: bool) -> float:
  """Bytes read + written per second by `x * s` on a donated buffer (best of 10)."""
  n = (COPY_BYTES if on_gpu else 64 * 2**20) // 4
  scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
  x, s = jnp.ones(n, jnp.float32), jnp.float32(1.0)
  x = scale(x, s).block_until_ready()
  times = []
  for _ in range(10):
    t = time.perf_counter()
    x = scale(x, s).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n * 4 / min(times)


def make_inputs(rng, *, batch, context, n_q, heads, kv_heads, head_dim, page_size, dtype):
  """Random pages in a shuffled pool; page 0 is left unused (the null page)."""
  pages_per_seq = -(-context // page_size)
  n_pool = batch * pages_per_seq + 1
  tables = (1 + rng.permutation(n_pool - 1)).reshape(batch, pages_per_seq).astype(np.int32)
  keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  shape = (kv_heads, n_pool, page_size, head_dim)
  k_pages = jax.random.normal(keys[0], shape, dtype)
  v_pages = jax.random.normal(keys[1], shape, dtype)
  q = jax.random.normal(keys[2], (batch, n_q, heads, head_dim), dtype)
  lengths = jnp.full((batch,), context, jnp.int32)
  return q, k_pages, v_pages, jnp.asarray(tables), lengths


def upstream_tiling(pages_per_seq: int) -> dict:
  """jax's kernel needs k_splits | pages_per_seq and compute block | partition."""
  k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
  per_split = pages_per_seq // k_splits
  block = next(c for c in (8, 4, 2, 1) if per_split % c == 0)
  return dict(k_splits=k_splits, pages_per_compute_block=block)


def attention_fns(interpret: bool) -> dict:
  """name -> fn(q, k_pages, v_pages, block_tables, lengths) -> [B, Q, H, D]."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)  # Triton ops, jax >= 0.11.
    from jax.experimental.pallas.ops.gpu import paged_attention as upstream

  def kernel(q, k_pages, v_pages, tables, lengths):
    return paged_attention(q, k_pages, v_pages, tables, lengths, impl='pallas', interpret=interpret)

  def xla(q, k_pages, v_pages, tables, lengths):
    return paged_attention(q, k_pages, v_pages, tables, lengths, impl='xla')

  def jax1q(q, k_pages, v_pages, tables, lengths):
    b, n_q, h, d = q.shape
    row_lengths = (lengths[:, None] - n_q + 1 + jnp.arange(n_q, dtype=jnp.int32)).reshape(-1)
    q = (q * d**-0.5).astype(q.dtype)  # It takes no scale.
    out = upstream.paged_attention(
        q.reshape(b * n_q, h, d),
        k_pages,
        v_pages,
        jnp.repeat(tables, n_q, axis=0),
        row_lengths,
        interpret=interpret,
        **upstream_tiling(tables.shape[1]),
    )
    return out.reshape(q.shape)

  return dict(kernel=kernel, xla=xla, jax1q=jax1q)


def time_per_call(fn, args, iters: int, repeats: int) -> float:
  """Median seconds per call over `repeats` jitted loops of `iters` chained calls."""
  q, *rest = args

  @jax.jit
  def loop(q, *rest):
    return lax.fori_loop(0, iters, lambda i, x: fn(x, *rest).astype(x.dtype), q)

  loop(q, *rest).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    loop(q, *rest).block_until_ready()
    times.append((time.perf_counter() - t) / iters)
  return statistics.median(times)


def run(args, interpret: bool) -> list[dict]:
  fns = attention_fns(interpret)
  rng = np.random.default_rng(0)
  itemsize = jnp.dtype(args.dtype).itemsize
  rows = []
  for batch in args.batch:
    for context in args.context:
      for n_q in args.queries:
        inputs = make_inputs(
            rng,
            batch=batch,
            context=context,
            n_q=n_q,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            dtype=jnp.dtype(args.dtype),
        )
        nbytes = (
            2 * batch * args.kv_heads * context * args.head_dim + 2 * batch * n_q * args.heads * args.head_dim
        ) * itemsize
        row = dict(batch=batch, context=context, queries=n_q, bytes=nbytes)
        want = jax.jit(fns['xla'])(*inputs).astype(jnp.float32)
        for name in ('kernel', 'jax1q'):  # Both must match the reference.
          got = jax.jit(fns[name])(*inputs).astype(jnp.float32)
          row[f'{name}_max_abs_err'] = float(jnp.abs(got - want).max())
        del got, want
        for name, fn in fns.items():
          try:
            row[f'{name}_s'] = time_per_call(fn, inputs, args.iters, args.repeats)
          except Exception as e:  # pylint: disable=broad-except
            log(f'{name} B={batch} ctx={context} Q={n_q}: {type(e).__name__}: {e}')
            row[f'{name}_s'] = None
        log(' '.join(f'{k}={v:.3g}' if isinstance(v, float) else f'{k}={v}' for k, v in row.items()))
        rows.append(row)
        del inputs
  return rows


def summarize(rows: list[dict], copy_bw: float) -> None:
  """Adds bandwidth and ratios to each row, in place."""
  single = {(r['batch'], r['context']): r['kernel_s'] for r in rows if r['queries'] == 1}
  for r in rows:
    t = r['kernel_s']
    r['kernel_gb_s'] = r['bytes'] / t / 1e9 if t else None
    r['fraction_of_copy'] = r['bytes'] / t / copy_bw if t else None
    for other in ('xla', 'jax1q'):
      r[f'{other}_over_kernel'] = r[f'{other}_s'] / t if t and r[f'{other}_s'] else None
    t1 = single.get((r['batch'], r['context']))
    r['cost_vs_q1'] = t / t1 if t and t1 else None


def report(rows: list[dict], copy_bw: float, on_gpu: bool) -> str:
  fmt = lambda v, f: '-' if v is None else format(v, f)
  worst = lambda name: max(r[f'{name}_max_abs_err'] for r in rows)
  lines = [
      f'copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write); largest absolute difference '
      f'from the XLA reference: kernel {worst("kernel"):.2g}, jax1q {worst("jax1q"):.2g}',
      '',
      f'{"B":>3} {"ctx":>6} {"Q":>2} {"kernel us":>10} {"GB/s":>8} {"of copy":>8} '
      f'{"xla us":>9} {"xla/k":>6} {"jax1q us":>9} {"jax1q/k":>7} {"vs Q=1":>6}',
  ]
  for r in rows:
    us = lambda s: None if s is None else s * 1e6
    lines.append(
        f'{r["batch"]:>3} {r["context"]:>6} {r["queries"]:>2} {fmt(us(r["kernel_s"]), "10.1f")} '
        f'{fmt(r["kernel_gb_s"], "8.1f")} {fmt(r["fraction_of_copy"], "8.0%")} '
        f'{fmt(us(r["xla_s"]), "9.1f")} {fmt(r["xla_over_kernel"], "6.2f")} '
        f'{fmt(us(r["jax1q_s"]), "9.1f")} {fmt(r["jax1q_over_kernel"], "7.2f")} '
        f'{fmt(r["cost_vs_q1"], "6.2f")}'
    )
  lines.append('')
  if not on_gpu:
    lines.append(
        'No GPU: Pallas interpret mode on the CPU with tiny shapes; the times above say '
        'nothing about the kernel. GPU figures pending.'
    )
    return '\n'.join(lines)
  longest = max(r['context'] for r in rows)
  for batch in sorted({r['batch'] for r in rows}):
    fracs = [
        r['fraction_of_copy'] for r in rows if r['batch'] == batch and r['context'] == longest and r['fraction_of_copy']
    ]
    if fracs:
      ok = min(fracs) >= TARGET_BANDWIDTH
      lines.append(
          f'B={batch}, ctx={longest}: {min(fracs):.0%} to {max(fracs):.0%} of copy '
          f'bandwidth (target >= {TARGET_BANDWIDTH:.0%}): {"PASS" if ok else "FAIL"}'
      )
  costs = [r['cost_vs_q1'] for r in rows if r['queries'] == 8 and r['cost_vs_q1']]
  if costs:
    ok = max(costs) <= TARGET_VERIFY_COST
    lines.append(
        f'verify 8 queries vs decode 1: {min(costs):.2f}x to {max(costs):.2f}x '
        f'(target <= {TARGET_VERIFY_COST}x): {"PASS" if ok else "FAIL"}'
    )
  return '\n'.join(lines)


def main(argv=None):
  on_gpu = jax.default_backend() == 'gpu'
  defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--batch', type=int, nargs='+', default=defaults['batch'])
  p.add_argument('--context', type=int, nargs='+', default=defaults['context'])
  p.add_argument('--queries', type=int, nargs='+', default=defaults['queries'])
  p.add_argument('--heads', type=int, default=4)
  p.add_argument('--kv-heads', type=int, default=1)
  p.add_argument('--head-dim', type=int, default=defaults.get('head_dim', 256))
  p.add_argument('--page-size', type=int, default=16)
  p.add_argument('--dtype', default=defaults['dtype'], choices=['bfloat16', 'float16', 'float32'])
  p.add_argument('--iters', type=int, default=defaults['iters'])
  p.add_argument('--repeats', type=int, default=defaults['repeats'])
  p.add_argument('--json', help='write every number to this file')
  args = p.parse_args(argv)
  if min(args.context) < max(args.queries):
    p.error('every --context must hold the --queries new tokens')

  warnings.filterwarnings('ignore', message=triton_kernel.TRITON_DEPRECATION, category=DeprecationWarning)
  started = datetime.datetime.now().astimezone()
  device = jax.devices()[0]
  log(
      f'{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}'
      + ('' if on_gpu else ': no GPU, interpret mode with tiny shapes')
  )
  copy_bw = copy_bandwidth(on_gpu)
  rows = run(args, interpret=not on_gpu)
  summarize(rows, copy_bw)
  print(report(rows, copy_bw, on_gpu))
  print(
      f'\n{started:%Y-%m-%d %H:%M %Z}, {device.device_kind}, jax {jax.__version__}, '
      f'H={args.heads} Hkv={args.kv_heads} D={args.head_dim} page={args.page_size} {args.dtype}'
  )
  if args.json:
    settings = {k: v for k, v in vars(args).items() if k != 'json'}
    pathlib.Path(args.json).write_text(
        json.dumps(
            dict(
                date=started.isoformat(timespec='seconds'),
                device=device.device_kind,
                backend=jax.default_backend(),
                jax=jax.__version__,
                interpret=not on_gpu,
                settings=settings,
                copy_bytes_per_s=copy_bw,
                rows=rows,
            ),
            indent=1,
        )
    )


if __name__ == '__main__':
  main()
