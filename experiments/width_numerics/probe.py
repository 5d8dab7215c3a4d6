"""Does the target's forward give the same bits for positions fed together (a verify pass) and one at a time
(decode steps)? Greedy speculative output equals AR output exactly only where it does.

    python experiments/width_numerics/probe.py f32|float|int8 [--width 5] [--rows 1] [--max-len 64]
        [--prefix 22] [--prompt 0]   # weights: float32 | --quant auto (activations)

Feeds Gemma 3 270M a Spec-Bench prompt's first `prefix` tokens, then its next `width` as one chunk or as
one-token steps (the tests' jitted cache step, `rows` identical rows, a block table of `max-len` keys), and prints
the largest difference of the final hidden states and logits.
"""

import argparse
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(__file__), '..', '..')
sys.path[:0] = [os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'benchmarks')]

import specjax  # pylint: disable=g-import-not-at-top
from conftest import cache_step, make_cache  # pylint: disable=g-import-not-at-top
from serve_load import pick_prompts  # pylint: disable=g-import-not-at-top


def run(model, ids: list[int], chunks: list[int], rows: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(logits [T, V], hidden [T, D]) of row 0's positions after the first chunk, fed in `chunks`."""
  step, cache, start, out = cache_step(model), make_cache(model, rows, max_len, page_size=16), 0, []
  for c in chunks:
    tokens = np.array([ids[start : start + c]] * rows, np.int32)
    logits, hidden, cache = step(tokens, cache, np.full((rows,), c, np.int32))
    out.append((np.asarray(logits)[0], np.asarray(hidden)[0]))
    start += c
  return tuple(np.concatenate(parts) for parts in zip(*out[1:]))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('mode', nargs='?', default='f32', choices=['f32', 'float', 'int8'])
  parser.add_argument('--width', type=int, default=5)
  parser.add_argument('--rows', type=int, default=1)
  parser.add_argument('--max-len', type=int, default=64)
  parser.add_argument('--prefix', type=int, default=22)
  parser.add_argument('--prompt', type=int, default=0)
  args = parser.parse_args()
  kw = {} if args.mode == 'f32' else {'quant': 'auto', 'quant_act': args.mode}
  model = specjax.load('gemma-3-270m', **kw)
  ids = model.tokenizer.encode(pick_prompts(16)[args.prompt].text) * 4
  n, width = args.prefix, args.width
  (la, ha), (lb, hb) = (run(model, ids, c, args.rows, args.max_len) for c in ([n, width], [n] + [1] * width))
  print(
      f'{args.mode}: prefix {n}, width {width}, rows {args.rows}, table {args.max_len}: hidden bitwise equal '
      f'{np.array_equal(ha, hb)}, max diff {np.abs(ha - hb).max():.3g}; logits max diff {np.abs(la - lb).max():.3g}; '
      f'argmax equal {bool((la.argmax(-1) == lb.argmax(-1)).all())}'
  )


if __name__ == '__main__':
  main()
