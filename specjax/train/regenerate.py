"""`data.regenerate`: the target answers the training prompts itself, so the drafter learns its distribution.

Prompts (each record's messages up to its first user turn, formatted as for
training) are answered in batches through `Engine.generate`. The answers are
cached on disk once per prompt, in a file keyed by the target (source,
architecture, parameter count, a hash of its weights, tokenizer) and the
settings (weights rewritten at the same path are a new target, never served
another model's answers):
`<cache>/<key>.jsonl`, one line per prompt, appended batch by batch. An
interrupted regeneration continues where it stopped, and any other set of
prompts (a data-size ablation, more data) reuses every answer already there.
"""

from __future__ import annotations

import json
import os
import sys

from specjax.errors import SpecjaxError
from specjax.provenance import stable_hash
from specjax.train.data import Example


def cache_path(target, settings: dict, cache_dir: str | None) -> str:
  from specjax.datasets import cache_dir as user_cache

  key = stable_hash(
      {
          'target': [os.path.abspath(target.source), target.architecture, target.num_params, str(target.dtype)],
          'weights': target.weights_fingerprint(),
          'tokenizer': target.tokenizer.fingerprint(),
          'settings': settings,
      },
      24,
  )
  return os.path.join(cache_dir or os.path.join(user_cache(), 'regenerated'), f'{key}.jsonl')


def _read(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  out = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break  # a line cut short by an interrupted write: redo from there
  return out


def regenerate(
    target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    seed: int = 0,
    cache_dir: str | None = None,
    progress: bool = True,
) -> list[Example]:
  """Prompt ids + the target's answer for each prompt; the answer tokens carry the loss."""
  import specjax

  if not prompts:
    raise SpecjaxError('data.regenerate: no prompts to answer (the records have no user turn)')
  settings = {'max_new_tokens': max_new_tokens, 'temperature': temperature, 'seed': seed}
  path = cache_path(target, settings, cache_dir)
  done = _read(path)
  answers = {tuple(r['prompt']): r['output'] for r in done}
  first = {}  # each prompt's first index: its request id (the seed of its draws)
  for i, p in enumerate(prompts):
    first.setdefault(tuple(p), i)
  todo = sorted(set(first) - set(answers), key=first.get)
  if progress:
    cached = len(first) - len(todo)
    print(
        f'regenerate: the target answers {len(todo)} of {len(first)} prompts ({cached} cached in {path})'
        if todo
        else f'regenerate: all {len(first)} answers cached in {path}',
        file=sys.stderr,
        flush=True,
    )
  if todo:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:  # rewrite the complete lines, drop a torn one
      f.writelines(json.dumps(r) + '\n' for r in done)
    engine = specjax.Engine(target, max_seq_len=max(len(p) for p in todo) + max_new_tokens + 1)
    sampling = specjax.SamplingParams(temperature=temperature, seed=seed)
    bar = None
    if progress:
      from tqdm import tqdm

      bar = tqdm(
          total=len(prompts), initial=len(prompts) - len(todo), file=sys.stderr, unit='prompt', desc='regenerate'
      )
    with open(path, 'a', encoding='utf-8') as f:
      for start in range(0, len(todo), batch_size):
        batch = [list(p) for p in todo[start : start + batch_size]]
        ids = [first[tuple(p)] for p in batch]
        results, _ = engine.generate(batch, max_new_tokens=max_new_tokens, sampling=sampling, request_ids=ids)
        for p, r in zip(batch, results):
          f.write(json.dumps({'prompt': p, 'output': r.tokens}) + '\n')
          answers[tuple(p)] = r.tokens
        f.flush()
        os.fsync(f.fileno())
        if bar:
          bar.update(len(batch))
    if bar:
      bar.close()
  done = [{'prompt': p, 'output': answers[tuple(p)]} for p in prompts]
  return [Example(r['prompt'] + r['output'], [False] * len(r['prompt']) + [True] * len(r['output'])) for r in done]
