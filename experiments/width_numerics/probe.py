"""Does the target's forward give the same bits for positions fed together (a verify pass) and one at a time
(decode steps)? Greedy speculative output equals AR output exactly only where it does.

    python experiments/width_numerics/probe.py f32|float|int8   # weights: float32 | --quant auto (activations)

Feeds Gemma 3 270M a Spec-Bench prompt's first n tokens, then its next 5 as one chunk or as 5 one-token steps
(the tests' jitted cache step), and prints the largest difference of the final hidden states and logits.
"""

import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(__file__), '..', '..')
sys.path[:0] = [os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'benchmarks')]

import specjax  # pylint: disable=g-import-not-at-top
from conftest import cache_step, make_cache  # pylint: disable=g-import-not-at-top
from serve_load import pick_prompts  # pylint: disable=g-import-not-at-top

WIDTH = 5


def run(model, ids: list[int], chunks: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """(logits [T, V], hidden [T, D]) of the positions after the first chunk, fed in `chunks`."""
  step, cache, start, out = cache_step(model), make_cache(model, 1, 64, page_size=16), 0, []
  for c in chunks:
    logits, hidden, cache = step(np.array([ids[start : start + c]], np.int32), cache, np.array([c], np.int32))
    out.append((np.asarray(logits)[0], np.asarray(hidden)[0]))
    start += c
  return tuple(np.concatenate(parts) for parts in zip(*out[1:]))


def main(mode: str) -> None:
  kw = {} if mode == 'f32' else {'quant': 'auto', 'quant_act': mode}
  model = specjax.load('gemma-3-270m', **kw)
  ids = model.tokenizer.encode(pick_prompts(16)[0].text)
  n = min(32, len(ids) - WIDTH)
  (la, ha), (lb, hb) = run(model, ids, [n, WIDTH]), run(model, ids, [n] + [1] * WIDTH)
  print(
      f'{mode}: prefix {n}, hidden bitwise equal {np.array_equal(ha, hb)}, max diff {np.abs(ha - hb).max():.3g}; '
      f'logits max diff {np.abs(la - lb).max():.3g}; argmax equal {bool((la.argmax(-1) == lb.argmax(-1)).all())}'
  )


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else 'f32')
