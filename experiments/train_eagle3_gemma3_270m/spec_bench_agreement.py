"""The training eval's agreement on Spec-Bench text: is a served head's τ lost to the data or to serving?

For each export, the head is read back as a `drafter.init_from` start (the path
`specjax run` loads) and scored with `specjax train`'s own eval step
(teacher-forced training-time test: a_k is draft k's top-1 agreement with the
target given the true tokens before it; expected τ = 1 + Σ_k Π_{i≤k} a_i) on
two sets of rows:
  - `held-out`: the config's eval records (the target's answers to held-out
    training prompts), which `metrics.jsonl` scores;
  - Spec-Bench: the first turn of `--per-category` (4) prompts of each category,
    tokenized as the engine does, with the target's greedy continuation of
    `--max-new-tokens` (the text a greedy sweep verifies), per category.
The sweep measures the served per-position acceptance on the same continuations;
equal readings mean the export serves what was trained and the gap to the
held-out τ is the data's.

  python experiments/train_eagle3_gemma3_270m/spec_bench_agreement.py \\
      runs/train_eagle3_gemma3_270m/export runs/train_eagle3_gemma3_270m_240/export \\
      --config configs/train_eagle3_gemma3_270m.py --cache-dir runs/regenerated
"""

import argparse
import collections

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import specjax
from specjax.bench import load_prompts
from specjax.train import data as data_lib
from specjax.train.config import resolve
from specjax.train.loop import agreement, expected_tau, first_state, load_data, make_steps, optimizer
from specjax.train.regenerate import regenerate
from specjax.train.trainers import make_trainer


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('exports', nargs='+', help='EAGLE-3 export directories (config.json + model.safetensors)')
  parser.add_argument('--config', default='configs/train_eagle3_gemma3_270m.py')
  parser.add_argument('--cache-dir', default='runs/regenerated', help="the config's data.cache_dir")
  parser.add_argument('--per-category', type=int, default=4, help='Spec-Bench prompts per category (a study uses 4+)')
  parser.add_argument('--max-new-tokens', type=int, default=64)
  args = parser.parse_args()

  base = resolve(args.config, [f'data.cache_dir={args.cache_dir!r}'])
  target = specjax.load(base['target.model'])
  _, held_out = load_data(base, target, progress=False)
  prompts = load_prompts(None, limit=args.per_category)
  examples = regenerate(
      target,
      [target.tokenizer.encode(p.text) for p in prompts],
      max_new_tokens=args.max_new_tokens,
      batch_size=len(prompts),
      cache_dir=args.cache_dir,
      progress=False,
  )
  by_category = collections.defaultdict(list)
  for p, ex in zip(prompts, examples):
    by_category[p.category].append(ex)
  length = max(len(ex.ids) for ex in examples)
  sets = {'held-out': held_out, **{c: data_lib.pack(exs, length, pack=False) for c, exs in sorted(by_category.items())}}

  mesh = Mesh(np.asarray(jax.devices()), ('data',))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  tparams = jax.device_put(target.params, replicated)
  b = base['train.batch_size']
  print(f'| rows | {" | ".join(args.exports)} |')
  print('|---' * (len(args.exports) + 1) + '|')
  put = lambda batch: jax.device_put(batch, split)
  results = {name: [] for name in ['held-out', 'spec-bench', *sorted(by_category)]}
  for export in args.exports:
    cfg = resolve(base, [f'drafter.init_from={export!r}', 'drafter.tap_scale=False'])
    trainer = make_trainer(cfg, target, None)
    tx, _ = optimizer(cfg)
    _, eval_fn = make_steps(trainer, target.graphdef, tx, replicated)
    params = jax.device_put(first_state(trainer, tx, 0)['params'], replicated)
    sums = {
        name: agreement(eval_fn, params, tparams, rows, b, put, None, trainer.positions) for name, rows in sets.items()
    }
    sums['spec-bench'] = tuple(sum(sums[c][i] for c in by_category) for i in (0, 1))  # every category's rows
    for name, (agree, count) in sums.items():
      results[name].append((agree / np.maximum(count, 1), count, expected_tau(agree, count)))
  for name, rs in results.items():
    cells = [f"τ {tau:.2f}, a {' '.join(f'{x:.2f}' for x in a)} ({int(count[0])})" for a, count, tau in rs]
    print(f'| {name} | {" | ".join(cells)} |')


if __name__ == '__main__':
  main()
