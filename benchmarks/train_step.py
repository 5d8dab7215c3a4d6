"""Training throughput: `specjax train`'s own jitted step, timed for each drafter family.

  python benchmarks/train_step.py [--model gemma-3-270m | random] [--kind eagle3 dflash mtp]
      [--features step cached] [--batch 8] [--len 512] [--dtype float32] [--rounds 3] [--json out.json]
      [--grad-accum 4 2 1]

For each kind, the drafter of `configs/train_<kind>_gemma3_270m.py` (its draft
vocabulary, taps, block, TTT unroll, anchors) with `--batch` rows of `--len`
tokens: random token ids packed four sequences to a row, every token scored.
`step`: the frozen target runs inside the train step (the configs' default);
`cached`: its features come from `train.cache_target`'s files, computed first
(that pass is timed too, per row). The step is `specjax.train.loop.make_steps`,
the function `specjax train` runs; the first call compiles and is reported
apart. `--model random` is Gemma 3 270M's shapes with random weights (a device
without the demo package): the step costs the same, whatever the weights.
`--grad-accum N ...` times the same batch as N micro-batches (`train.grad_accum`)
and reports the device's peak memory where it keeps count (GPUs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.train import features as features_lib
from specjax.train.config import resolve
from specjax.train.data import Packed
from specjax.train.loop import first_state, make_steps, optimizer
from specjax.train.trainers import make_trainer


def random_rows(num_rows: int, length: int, vocab: int, seed: int = 0, per_row: int = 4) -> Packed:
  """[R, L] rows of `per_row` sequences of random ids, each position scored."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, (num_rows, length)).astype(np.int32)
  seg_len = length // per_row
  positions = np.tile(np.arange(length) % seg_len, (num_rows, 1)).astype(np.int32)
  segments = np.tile(np.minimum(np.arange(length) // seg_len, per_row - 1) + 1, (num_rows, 1)).astype(np.int32)
  loss_mask = (positions > 0).astype(np.int32)
  return Packed(tokens, positions, segments, loss_mask)


def time_kind(kind: str, target, mode: str, args, accum: int = 1) -> dict:
  cfg = resolve(
      str(ROOT / 'configs' / f'train_{kind}_gemma3_270m.py'),
      {'train.batch_size': args.batch, 'data.max_len': args.len, 'train.steps': 1000, 'train.grad_accum': accum},
  )
  b = args.batch
  rows = random_rows(2 * b, args.len, target.config.vocab_size)
  trainer = make_trainer(cfg, target, rows)
  mesh = Mesh(np.asarray(jax.devices()), ('data',))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  tx, _ = optimizer(cfg)
  step_fn, _ = make_steps(trainer, target.graphdef, tx, replicated, accum)
  state = jax.device_put(first_state(trainer, tx, 0), replicated)
  tparams = jax.device_put(target.params, replicated)
  result = {
      'kind': kind,
      'features': mode,
      'batch': b,
      'grad_accum': accum,
      'len': args.len,
      'dtype': str(target.dtype),
  }
  feats = None
  if mode == 'cached':
    with tempfile.TemporaryDirectory() as tmp:
      t0 = time.perf_counter()
      feats = features_lib.target_features(tmp, target, rows, trainer.taps, batch_size=b, progress=False)
      feats = {k: np.array(v) for k, v in feats.take(np.arange(len(rows))).items()}  # out of the memory maps
      result['features_s_per_row'] = (time.perf_counter() - t0) / len(rows)  # compile included
  batches = []
  for i in range(2):
    idx = np.arange(i * b, (i + 1) * b)
    batch = {**rows.take(idx), **({k: v[idx] for k, v in feats.items()} if feats else {})}
    batches.append(jax.device_put(batch, split))
  t0 = time.perf_counter()
  state, metrics = step_fn(state, tparams, batches[0])
  jax.block_until_ready(metrics)
  result['compile_s'] = time.perf_counter() - t0
  times = []
  for r in range(args.rounds):
    t0 = time.perf_counter()
    state, metrics = step_fn(state, tparams, batches[(r + 1) % 2])
    jax.device_get(metrics)  # the loop's one host transfer per step
    times.append(time.perf_counter() - t0)
  tokens = int((rows.segments[:b] > 0).sum())
  result['step_s'] = statistics.median(times)
  result['step_s_all'] = times
  result['tokens_per_s'] = tokens / result['step_s']
  stats = jax.devices()[0].memory_stats() or {}
  result['peak_bytes'] = stats.get('peak_bytes_in_use')  # since the process started (GPUs; None on CPU)
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--model', default='gemma-3-270m', help="anything `load` takes, or 'random' (270M's shapes)")
  p.add_argument('--kind', nargs='+', default=['eagle3', 'dflash', 'mtp'], choices=['eagle3', 'dflash', 'mtp'])
  p.add_argument('--features', nargs='+', default=['step', 'cached'], choices=['step', 'cached'])
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--len', type=int, default=512)
  p.add_argument('--dtype', default=None, help='target dtype (default: float32 on CPU, bfloat16 on an accelerator)')
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--json', default=None)
  p.add_argument(
      '--grad-accum',
      type=int,
      nargs='+',
      default=[1],
      help="micro-batches a step (train.grad_accum); largest first: the peak memory is the process's so far",
  )
  args = p.parse_args()
  if args.model == 'random':
    from tree_step import gemma3_270m_random  # pylint: disable=g-import-not-at-top

    target = gemma3_270m_random(args.dtype)
  else:
    target = specjax.load(args.model, dtype=args.dtype)
  device = f'{jax.devices()[0].device_kind} x{len(jax.devices())}'
  print(f'{device}; target {args.model} ({target.dtype}); batch {args.batch} x {args.len} tokens', flush=True)
  results = []
  for kind in args.kind:
    for mode in args.features:
      for accum in args.grad_accum:
        r = time_kind(kind, target, mode, args, accum)
        results.append({**r, 'device': device, 'model': args.model})
        extra = f", target features {r['features_s_per_row']:.2f} s a row" if 'features_s_per_row' in r else ''
        extra += f", peak {r['peak_bytes'] / 2**30:.2f} GiB" if r['peak_bytes'] else ''
        print(
            f"{kind:7s} target {mode:6s} grad_accum {accum}: {r['step_s']:.2f} s a step, "
            f"{r['tokens_per_s']:,.0f} tokens/s (compile {r['compile_s']:.1f} s{extra})",
            flush=True,
        )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
  main()
