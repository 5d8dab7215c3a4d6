"""The scheduler's batching throughput in process: output tokens/s against concurrency, with no HTTP in the way.

  python benchmarks/serve_batch.py [-m gemma-3-270m | random] [--arms ar ngram] [--concurrency 1 4 16 64]
      [--requests N] [--max-tokens 64] [--ngram-k 4] [--dtype bfloat16] [--prefill-chunk 512]
      [--prefill-budget N] [--weights f32 auto-act8 ...] [--json out.json]

One `Scheduler` per arm with as many slots as the largest concurrency, compiled ahead by `Scheduler.warmup()`:
`ar` (no drafter), and prompt lookup under a depth policy: `ngram` (fixed at `--ngram-k`), `load` (mistral.rs's
rule: `--ngram-k` up to 8 live requests, 3 above), `load-off` (`--ngram-k` up to `--load-threshold` live, plain
decode steps above: `Load(reduced=0)`) and `tuner` (learns online over depths 0 (off), 2 and `--ngram-k`). At each concurrency C, C client threads each
submit their next request when the last one finished (closed loop) until `--requests` (default 2C, at least one
per prompt, as serve_load.py's passes) are done; one untimed pass first, then the timed one. Prompts are Spec-Bench first turns, category-balanced
(as benchmarks/serve_load.py picks them) for a real model; for `-m random` (Gemma 3 270M's shapes with random
weights, a device without the demo package) 64 random token ids each, and every request runs its full
`--max-tokens` (`ignore_eos`). Set against serve_load.py's figures for the same arm, the gap is what HTTP,
streaming and the client cost; set against each other, the levels show how a step's cost grows with its rows.
The warm-up compiles a decode (and, drafting, a spec) step per power-of-two row bucket up to the largest
concurrency and a prefill per chunk bucket up to `--prefill-chunk` (the engine's largest, default 512):
`--prefill-chunk 64` with `--prefill-budget 512` (prompt tokens prefilled a step, the scheduler's option; by
default the chunk) runs 64-token prompts exactly as the defaults do, on three prefill executables instead of six.
`--weights` runs every arm over each weight setting in turn, side by side: `f32` (the default: float, a GGUF
dequantized), or a `--quant` value with an optional `-act8` (`auto-act8`: the GGUF's own blocks, int8
activations; `int4`, `int8-act8`, ...). Each level also reports the scheduler's host time a step outside the
jitted calls (`host_ms`).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import platform
import statistics
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.drafters import make_drafter
from specjax.engine.requests import Request
from specjax.engine.scheduler import Scheduler
from specjax.policies import Load, Tuner


def closed_loop(scheduler: Scheduler, prompts: list[list[int]], c: int, n: int, max_tokens: int, ignore_eos: bool):
  """n requests, c in flight: returns (wall s, results)."""
  lock, nxt, results = threading.Lock(), [0], []

  def client():
    while True:
      with lock:
        i, nxt[0] = nxt[0], nxt[0] + 1
      if i >= n:
        return
      request = Request(prompts[i % len(prompts)], max_tokens=max_tokens, ignore_eos=ignore_eos, seq_id=i)
      out = scheduler.submit(request).result()
      with lock:
        results.append(out)

  threads = [threading.Thread(target=client) for _ in range(c)]
  start = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return time.perf_counter() - start, results


def level(scheduler: Scheduler, prompts, c: int, n: int, max_tokens: int, ignore_eos: bool) -> dict:
  closed_loop(scheduler, prompts, c, n, max_tokens, ignore_eos)  # untimed
  before, host_before = dict(scheduler.counters), scheduler.host_s
  scheduler.step_log = log = []  # (K, seconds, live) per step
  wall, results = closed_loop(scheduler, prompts, c, n, max_tokens, ignore_eos)
  scheduler.step_log = None
  delta = {k: scheduler.counters[k] - before[k] for k in before}
  host_ms = 1e3 * (scheduler.host_s - host_before) / max(delta['steps'], 1)
  tokens = sum(len(r.tokens) for r in results)
  ttft = [r.stats.first_token - r.stats.submitted for r in results if r.stats.first_token]
  return {
      'concurrency': c,
      'requests': n,
      'wall_s': wall,
      'output_tokens': tokens,
      'tok_s': tokens / wall,
      'ttft_p50_s': statistics.median(ttft) if ttft else None,
      'steps': delta['steps'],
      'step_ms': 1e3 * wall / max(delta['steps'], 1),
      'host_ms': host_ms,
      'k_steps': {str(k): n for k, n in sorted(collections.Counter(k for k, _, _ in log).items())},
      'tau': 1 + delta['accepted'] / delta['spec_steps'] if delta['spec_steps'] else 1.0,
      'preemptions': delta['preemptions'],
  }


def run_arm(model, arm: str, name: str, prompts, ignore_eos: bool, args) -> dict:
  """One arm's scheduler, compiled ahead, over every concurrency level."""
  drafting = arm != 'ar'
  k = args.ngram_k
  depth = {
      'ar': 0,
      'ngram': k,
      'load': Load(full=k),
      'load-off': Load(full=k, reduced=0, threshold=args.load_threshold),
      'tuner': Tuner(tuple(sorted({0, 2, k}))),
  }[arm]
  engine = specjax.Engine(
      model,
      drafter=make_drafter('ngram', model) if drafting else None,
      max_draft=args.ngram_k,
      max_seq_len=args.max_seq_len,
      prefill_chunk=args.prefill_chunk,
  )
  scheduler = Scheduler(
      engine,
      max_slots=max(args.concurrency),
      num_draft=depth,
      prefill_budget=args.prefill_budget,
  )
  compile_s = scheduler.warmup()
  print(
      f'{name}: warm-up compiled {len(scheduler.executable_set(sampled=False))} executables in {compile_s:.0f} s',
      flush=True,
  )
  rows = []
  with scheduler:
    for c in args.concurrency:
      n = args.requests or max(2 * c, len(prompts))
      rows.append(level(scheduler, prompts, c, n, args.max_tokens, ignore_eos))
      r = rows[-1]
      print(
          f'{name} C={c}: {r["tok_s"]:.1f} tok/s, {r["step_ms"]:.1f} ms/step (host {r["host_ms"]:.2f}), '
          f'tau {r["tau"]:.2f}, TTFT p50 {r["ttft_p50_s"]:.3f} s, steps by K {r["k_steps"]}',
          flush=True,
      )
  return {'warmup_compile_s': compile_s, 'levels': rows}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('-m', '--model', default='gemma-3-270m', help="anything `load` takes, or 'random' (270M's shapes)")
  p.add_argument('--arms', nargs='+', choices=['ar', 'ngram', 'load', 'load-off', 'tuner'], default=['ar', 'ngram'])
  p.add_argument('--concurrency', type=int, nargs='+', default=[1, 4, 16, 64])
  p.add_argument(
      '--requests', type=int, default=None, help='requests per timed pass (default 2C, at least one per prompt)'
  )
  p.add_argument('--prompts', type=int, default=16)
  p.add_argument('--max-tokens', type=int, default=64)
  p.add_argument('--ngram-k', type=int, default=4)
  p.add_argument('--load-threshold', type=int, default=2, help="load-off's live requests with drafting (default 2)")
  p.add_argument('--max-seq-len', type=int, default=1024)
  p.add_argument('--dtype', default=None, help='default: float32 on CPU, bfloat16 on an accelerator')
  p.add_argument('--prefill-chunk', type=int, default=512, help="the engine's largest prefill bucket")
  p.add_argument('--prefill-budget', type=int, default=None, help="the scheduler's prompt tokens a step")
  p.add_argument(
      '--weights',
      nargs='+',
      default=['f32'],
      help='weight settings run side by side: f32, or a --quant value (auto, int8, int4) with an optional -act8',
  )
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top

  prompts, ignore_eos = None, args.model == 'random'
  out = {
      'model': args.model,
      'device': str(jax.devices()[0]),
      'machine': platform.processor() or platform.machine(),
      'args': vars(args),
      'arms': {},
  }
  for weights in args.weights:
    quant, _, act = weights.partition('-')
    kw = {} if quant == 'f32' else {'quant': quant, 'quant_act': 'int8' if act == 'act8' else 'float'}
    if args.model == 'random':
      from tree_step import gemma3_270m_random  # pylint: disable=g-import-not-at-top

      if kw:
        raise SystemExit('--weights other than f32 need a real model')
      model = gemma3_270m_random(args.dtype)
      rng = np.random.default_rng(0)
      prompts = [rng.integers(3, model.config.vocab_size, 64).tolist() for _ in range(args.prompts)]
    else:
      from serve_load import pick_prompts  # pylint: disable=g-import-not-at-top

      model = specjax.load(args.model, dtype=args.dtype, **kw)
      prompts = [model.tokenizer.encode(q.text) for q in pick_prompts(args.prompts)]
    out['dtype'] = str(model.dtype)
    for arm in args.arms:
      name = arm if args.weights == ['f32'] else f'{weights}/{arm}'
      out['arms'][name] = run_arm(model, arm, name, prompts, ignore_eos, args)
      if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    del model
  c1 = {arm: v['levels'][0]['tok_s'] for arm, v in out['arms'].items()}
  print(f'| arm | {" | ".join(f"C={c} tok/s" for c in args.concurrency)} | host ms a step | warm-up compile s |')
  print('|---|' + '---|' * (len(args.concurrency) + 2))
  for arm, v in out['arms'].items():
    cells = ' | '.join(f'{r["tok_s"]:.1f} ({r["tok_s"] / c1[arm]:.1f}x)' for r in v['levels'])
    host = '/'.join(f'{r["host_ms"]:.1f}' for r in v['levels'])
    print(f'| {arm} | {cells} | {host} | {v["warmup_compile_s"]:.0f} |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
