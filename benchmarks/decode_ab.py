"""Decode tok/s of this checkout against another commit, side by side in one run.

  python benchmarks/decode_ab.py --base 515be0e [--rounds 4] [--max-new-tokens 64] [--json out.json]

The base commit is exported (`git archive`) to a temporary folder; each round
runs one process per side, alternating which goes first, each loading the
real Gemma 3 270M (float32, CPU), warming up, then decoding the three prompts of
benchmarks/decode.py greedily at batch 1 (best of 2 per prompt). Reports each
side's decode tok/s per round and the ratio this / base: the median of the
per-round ratios, so drift of the machine between rounds cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import specjax
from benchmarks_decode_prompts import PROMPTS
model = specjax.load('gemma-3-270m')
engine = specjax.Engine(model)
engine.generate([PROMPTS['code']], max_new_tokens=8)  # compile
rates = {}
for name, prompt in PROMPTS.items():
  best = 0.0
  for _ in range(2):
    _, stats = engine.generate([prompt], max_new_tokens=int(sys.argv[2]))
    best = max(best, stats.decode_tokens_per_s)
  rates[name] = best
print(json.dumps({'specjax': specjax.__file__, 'rates': rates}))
"""


def export(commit: str, into: str) -> str:
  """The tree of `commit` under `into` (git archive; no worktree state)."""
  archive = subprocess.run(['git', '-C', str(ROOT), 'archive', commit], check=True, capture_output=True).stdout
  path = os.path.join(into, commit)
  os.makedirs(path)
  with tempfile.TemporaryFile() as f:
    f.write(archive)
    f.seek(0)
    tarfile.open(fileobj=f).extractall(path, filter='data')
  return path


def run_side(tree: str, max_new_tokens: int, prompts_dir: str) -> dict:
  env = dict(os.environ, PYTHONPATH=prompts_dir)
  out = subprocess.run(
      [sys.executable, '-c', WORKER, tree, str(max_new_tokens)],
      check=True,
      capture_output=True,
      text=True,
      cwd=tree,
      env=env,
  )
  result = json.loads(out.stdout.strip().splitlines()[-1])
  if not result['specjax'].startswith(tree):
    raise RuntimeError(f'side {tree} imported specjax from {result["specjax"]}')
  return result['rates']


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--base', required=True, help='the commit to compare against (e.g. the one before a change)')
  p.add_argument('--rounds', type=int, default=4)
  p.add_argument('--max-new-tokens', type=int, default=64)
  p.add_argument('--json', help='write every number to this file')
  args = p.parse_args(argv)
  head = subprocess.run(
      ['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'], check=True, capture_output=True, text=True
  ).stdout.strip()
  dirty = bool(
      subprocess.run(
          ['git', '-C', str(ROOT), 'status', '--porcelain', '--untracked-files=no'],
          check=True,
          capture_output=True,
          text=True,
      ).stdout.strip()
  )
  with tempfile.TemporaryDirectory() as tmp:
    base = export(args.base, tmp)
    prompts_dir = os.path.join(tmp, 'prompts')
    os.makedirs(prompts_dir)
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    from decode import PROMPTS  # pylint: disable=g-import-not-at-top

    pathlib.Path(prompts_dir, 'benchmarks_decode_prompts.py').write_text(f'PROMPTS = {PROMPTS!r}\n')
    rounds = []
    for r in range(args.rounds):
      order = [('this', str(ROOT)), ('base', base)]
      if r % 2:
        order.reverse()
      got = {}
      for side, tree in order:
        t = time.perf_counter()
        got[side] = run_side(tree, args.max_new_tokens, prompts_dir)
        print(
            f'[round {r + 1}] {side}: '
            + ', '.join(f'{k} {v:.1f}' for k, v in got[side].items())
            + f' tok/s ({time.perf_counter() - t:.0f} s)',
            file=sys.stderr,
            flush=True,
        )
      mean = {side: statistics.mean(rates.values()) for side, rates in got.items()}
      rounds.append({'this': got['this'], 'base': got['base'], 'ratio': mean['this'] / mean['base']})
  ratios = [r['ratio'] for r in rounds]
  summary = {
      'this': head + ('+dirty' if dirty else ''),
      'base': args.base,
      'max_new_tokens': args.max_new_tokens,
      'rounds': rounds,
      'median_ratio': statistics.median(ratios),
      'min_ratio': min(ratios),
      'max_ratio': max(ratios),
  }
  print(
      f"decode tok/s, this ({summary['this']}) / base ({args.base}): median {summary['median_ratio']:.3f} "
      f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
  )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(summary, indent=2))
  return 0


if __name__ == '__main__':
  sys.exit(main())
