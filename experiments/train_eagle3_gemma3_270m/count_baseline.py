"""The bar a trained drafter should clear: an n-gram table counted over the same training rows, scored as the eval.

Reads a training config's data exactly as `specjax train` does (`specjax.train.loop.load_data`: the same
records, regenerated answers from the cache, the same eval hold-out and packing) and counts the most frequent
learned next token after every context of up to n - 1 tokens in the training rows. On the eval rows, from every
learned position a, depth k predicts x_{a+k} (the longest context seen in training, backing off to shorter ones)
in two readings, one per family's eval:

- teacher-forced: from the true tokens up to a + k - 1, as EAGLE-3's training-time test feeds step k the
  true token (its a_k is the acceptance of draft k given the drafts before it accepted);
- chain: from the true tokens up to a and the table's own k - 1 predictions, as a DFlash block drafts row k
  from x_a and masks alone (its a_k is unconditional).

Agreement is with the data token, the target's greedy token on regenerated answers, counted where `specjax
train`'s eval counts (x_{a+k} learned, in a's sequence); τ is the training eval's expected τ (1 + Σ_k Π_{i<=k}
a_i). DFlash's eval scores only its anchors (64 a row, a fixed draw), a subset of these positions.

  python experiments/train_eagle3_gemma3_270m/count_baseline.py configs/train_eagle3_gemma3_270m.py \\
      data.cache_dir="'runs/regenerated'" --depth 7
"""

import argparse
import collections
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import specjax  # noqa: E402
from specjax.train.config import resolve  # noqa: E402
from specjax.train.loop import expected_tau, load_data  # noqa: E402


def sequences(rows):
  """(tokens, learned) per packed sequence, as lists."""
  for tokens, segments, mask in zip(rows.tokens, rows.segments, rows.loss_mask):
    for s in np.unique(segments[segments > 0]):
      at = segments == s
      yield tokens[at].tolist(), mask[at].tolist()


def count(rows, order: int) -> list[dict]:
  """tables[n][context of n tokens] = the most frequent learned next token."""
  counts = [collections.defaultdict(collections.Counter) for _ in range(order)]
  for tokens, learned in sequences(rows):
    for i in range(1, len(tokens)):
      if learned[i]:
        for n in range(min(order - 1, i) + 1):
          counts[n][tuple(tokens[i - n : i])][tokens[i]] += 1
  return [{ctx: c.most_common(1)[0][0] for ctx, c in table.items()} for table in counts]


def predict(tables, context: list[int]) -> int:
  for n in range(min(len(tables) - 1, len(context)), -1, -1):
    token = tables[n].get(tuple(context[len(context) - n :]) if n else ())
    if token is not None:
      return token
  raise AssertionError('the empty context is always counted')


def score(tables, rows, depth: int, teacher_forced: bool) -> tuple[np.ndarray, np.ndarray]:
  """(agreements [depth], predictions [depth]) of the table's drafts from every learned position of `rows`."""
  agree, seen = np.zeros(depth), np.zeros(depth)
  for tokens, learned in sequences(rows):
    for a in range(len(tokens) - 1):
      if not learned[a + 1]:
        continue
      chain = tokens[: a + 1]
      for k in range(1, min(depth, len(tokens) - 1 - a) + 1):
        draft = predict(tables, tokens[: a + k] if teacher_forced else chain)
        chain = chain + [draft]
        if learned[a + k]:
          seen[k - 1] += 1
          agree[k - 1] += draft == tokens[a + k]
  return agree, seen


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('config')
  parser.add_argument('overrides', nargs='*', help='KEY=VALUE, as for specjax train')
  parser.add_argument('--depth', type=int, default=6, help='draft positions scored (EAGLE-3: ttt_steps; DFlash: B - 1)')
  parser.add_argument('--orders', type=int, nargs='+', default=[1, 2, 3, 4], help='n of the n-gram tables')
  args = parser.parse_args()
  cfg = resolve(args.config, args.overrides)
  target = specjax.load(cfg['target.model'])
  train, evals = load_data(cfg, target, progress=False)
  print(f'{len(train)} training rows ({train.num_tokens} tokens), {len(evals)} eval rows ({evals.num_tokens} tokens)')
  print('| table | reading | ' + ' '.join(f'a_{k}' for k in range(1, args.depth + 1)) + ' | expected τ |')
  for order in args.orders:
    tables = count(train, order)
    for reading in ('teacher-forced', 'chain'):
      agree, seen = score(tables, evals, args.depth, reading == 'teacher-forced')
      a = ' '.join(f'{x:.3f}' for x in agree / np.maximum(seen, 1))
      print(f'| {order}-gram | {reading} | {a} | {expected_tau(agree, seen):.3f} |')
  print(f'positions scored at each depth: {seen.astype(int).tolist()}')


if __name__ == '__main__':
  main()
