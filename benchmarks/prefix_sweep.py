"""Cross-cell prefix sharing in a sweep, side by side: the same sweep with the prefix cache off and on.

  python benchmarks/prefix_sweep.py [-m gemma-3-270m] [--category coding] [--limit 10] [--max-new-tokens 48]
      [--depths 2 3 4 6] [--rounds 2] [--json out.json]

One Spec-Bench category, the n-gram drafter at 4 depths (4 cells on one engine) and the autoregressive
baseline (its own engine), greedy, prompt-major (`interleave`: every cell runs a prompt before the next), one
timed run per batch. Each round runs the sweep with `prefix_cache=False`, then `True`, into fresh directories;
engines stay compiled in the process across rounds and their cached pages are dropped before every run
(`Engine.reset_prefix_cache`), so a run shares only within itself: a prompt's pages, filled by the first depth
that runs it, serve the other three. Round 0 compiles (its `warmup` reruns included); later rounds are the
steady-state comparison. Reports wall seconds, the prefill seconds and prompt tokens cached over all units, and
checks every cell's tokens equal between the two.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specjax import sweep  # pylint: disable=g-import-not-at-top
from specjax.sweep import artifacts, runner  # pylint: disable=g-import-not-at-top


def config(args, prefix_cache: bool):
  c = sweep.base_config()
  c.name = 'prefix_sweep'
  c.model = args.model
  c.max_new_tokens = args.max_new_tokens
  c.interleave = True
  c.prefix_cache = prefix_cache
  c.drafter.kind = 'ngram'
  c.prompts.categories = [args.category]
  c.prompts.limit = args.limit
  c.grid.policy = [{'name': 'fixed', 'k': k} for k in args.depths]
  return c


def run_once(args, prefix_cache: bool) -> dict:
  for engine in runner._ENGINES.values():  # pylint: disable=protected-access (the process's compiled engines)
    engine.reset_prefix_cache()
  with tempfile.TemporaryDirectory() as out:
    t = time.perf_counter()
    sweep.run_sweep(config(args, prefix_cache), out, progress=False, make_plots=False)
    wall = time.perf_counter() - t
    records = artifacts.read_results(out)
  label = {r['cell']: r['label'] for r in records if r['type'] == 'cell'}  # ids hash the config: labels match
  rows = [r for r in records if r['type'] in ('request', 'baseline')]
  key = lambda r: (label.get(r.get('cell'), 'baseline'), r['request_id'])
  tokens = {key(r): r['tokens'] for r in rows}
  units = {key(r): r for r in rows if r['row'] == 0}
  return {
      'wall_s': wall,
      'prefill_s': sum(r['prefill_s'] for r in units.values()),
      'decode_s': sum(r['decode_s'] for r in units.values()),
      'prompt_tokens': sum(r['prompt_tokens'] for r in rows),
      'cached_tokens': sum(r['cached_tokens'] for r in units.values()),
      'tokens': tokens,
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('-m', '--model', default='gemma-3-270m')
  p.add_argument('--category', default='coding')
  p.add_argument('--limit', type=int, default=10, help='prompts of the category')
  p.add_argument('--max-new-tokens', type=int, default=48)
  p.add_argument('--depths', type=int, nargs='+', default=[2, 3, 4, 6])
  p.add_argument('--rounds', type=int, default=2, help='off/on pairs; round 0 compiles')
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  rounds = []
  for i in range(args.rounds):
    off, on = run_once(args, False), run_once(args, True)
    if off.pop('tokens') != on.pop('tokens'):
      raise SystemExit("the prefix cache changed a cell's tokens")
    rounds.append({'off': off, 'on': on})
    print(
        f'round {i}: wall off {off["wall_s"]:.1f} s, on {on["wall_s"]:.1f} s ({off["wall_s"] / on["wall_s"]:.3f}x); '
        f'prefill off {off["prefill_s"]:.1f} s, on {on["prefill_s"]:.1f} s; cached prompt tokens '
        f'{on["cached_tokens"]} of {on["prompt_tokens"]} (off {off["cached_tokens"]}); decode off '
        f'{off["decode_s"]:.1f} s, on {on["decode_s"]:.1f} s',
        flush=True,
    )
  steady = rounds[1:] or rounds
  ratio = statistics.median(r['off']['wall_s'] / r['on']['wall_s'] for r in steady)
  print(f'steady state: the sweep takes {ratio:.3f}x less wall time with cross-cell sharing; tokens equal')
  if args.json:
    out = {'args': vars(args), 'rounds': rounds, 'wall_ratio': ratio}
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
