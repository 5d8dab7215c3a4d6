"""`data.regenerate`: the target answers the training prompts itself, so the drafter learns its distribution.

Prompts (each record's messages up to its first user turn, formatted as for
training) are answered in batches through `Engine.generate`. The answers are
cached on disk once, keyed by the target (source, architecture, parameter
count, tokenizer), the prompt ids and the settings: `<cache>/<key>.jsonl`, one
line per prompt, appended batch by batch, so an interrupted regeneration
continues where it stopped.
"""

from __future__ import annotations

import json
import os
import sys

from specjax.errors import SpecjaxError
from specjax.sweep.config import stable_hash
from specjax.train.data import Example


def cache_path(target, prompts: list[list[int]], settings: dict, cache_dir: str | None) -> str:
  from specjax.datasets import cache_dir as user_cache

  key = stable_hash(
      {
          'target': [os.path.abspath(target.source), target.architecture, target.num_params, str(target.dtype)],
          'tokenizer': target.tokenizer.fingerprint(),
          'prompts': stable_hash(prompts, 32),
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
  path = cache_path(target, prompts, settings, cache_dir)
  done = _read(path)[: len(prompts)]
  if len(done) < len(prompts):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:  # rewrite the complete lines, drop a torn one
      f.writelines(json.dumps(r) + '\n' for r in done)
    engine = specjax.Engine(target, max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 1)
    sampling = specjax.SamplingParams(temperature=temperature, seed=seed)
    bar = None
    if progress:
      from tqdm import tqdm

      bar = tqdm(total=len(prompts), initial=len(done), file=sys.stderr, unit='prompt', desc='regenerate')
    with open(path, 'a', encoding='utf-8') as f:
      for start in range(len(done), len(prompts), batch_size):
        ids = list(range(start, min(start + batch_size, len(prompts))))
        results, _ = engine.generate(
            [prompts[i] for i in ids], max_new_tokens=max_new_tokens, sampling=sampling, request_ids=ids
        )
        for i, r in zip(ids, results):
          record = {'prompt': prompts[i], 'output': r.tokens}
          f.write(json.dumps(record) + '\n')
          done.append(record)
        f.flush()
        os.fsync(f.fileno())
        if bar:
          bar.update(len(ids))
    if bar:
      bar.close()
  return [Example(r['prompt'] + r['output'], [False] * len(r['prompt']) + [True] * len(r['output'])) for r in done]
