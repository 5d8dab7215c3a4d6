"""Steps of each sweep cell by verify width: count, median step time, tokens emitted per step.

The width of a step is the one the engine ran for its depth and the longest pending draft
(`specjax.depths.step_depth`); drafters that do not draft ahead report no pending lengths and count as K + 1.

  python experiments/train_eagle3_gemma3_270m/step_widths.py SWEEP_DIR/results.jsonl
"""

import collections
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from specjax.depths import step_depth  # noqa: E402


def main(path: str) -> None:
  rows = [json.loads(line) for line in open(path)]
  cells = {row['cell']: row['setting'] for row in rows if row['type'] == 'cell'}
  ar = [s for row in rows if row['type'] == 'baseline' for s in row['step_s']]
  print(f'autoregressive: median step {1e3 * statistics.median(ar):.1f} ms')
  for cell, setting in cells.items():
    seconds, emitted = collections.defaultdict(list), collections.Counter()
    for row in rows:
      if row['type'] != 'request' or row['cell'] != cell:
        continue
      pending = row.get('pending_per_step') or row['k_per_step']
      for k, p, s, a in zip(row['k_per_step'], pending, row['step_s'], row['accepted_per_step']):
        width = step_depth(k, p) + 1
        seconds[width].append(s)
        emitted[width] += a + 1
    parts = [
        f'width {w}: {len(t)} steps, {1e3 * statistics.median(t):.1f} ms, τ {emitted[w] / len(t):.2f}'
        for w, t in sorted(seconds.items())
    ]
    print(f'{setting}: ' + '; '.join(parts))


if __name__ == '__main__':
  main(sys.argv[1])
