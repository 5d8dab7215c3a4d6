"""Spec-Bench style benchmark: autoregressive vs speculative on the same prompts.

For each prompt the engine decodes autoregressively and then speculatively at
each draft depth, batch 1, greedy by default. Per category the table reports
tau, acceptance rate, decode tokens/s, the measured speedup over
autoregressive, and the speedup predicted from the measured acceptance and the
measured costs. Per prompt p, with n_p decode tokens and s_p target steps:

  predicted = (sum_p n_p / sum_p s_p * (T_draft_p(K) + T_verify_p(K)))
              / (sum_p n_p / sum_p n_p * T_decode_p)

i.e. tau * T_decode / (T_draft + T_verify) for one prompt, where T_decode is
one autoregressive step, T_draft(K) the drafter's propose for K tokens (for
drafters that draft ahead, the lookup they run at commit) and T_verify(K) the
target pass over K + 1 tokens, each timed alone right after the prompt's runs,
at the context halfway through its output (`calibrate`: 7 interleaved rounds
of the three calls, the median of each). measured / predicted < 1 is the
framework's own overhead.
Drafters that draft ahead verify only as wide as their drafts need, so their
steps without drafts cost a decode step and the ratio can exceed 1.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax import datasets
from specjax.engine import Engine
from specjax.errors import SpecjaxError
from specjax.metrics import SpecMetrics
from specjax.models.contract import append
from specjax.sampling import SamplingParams, argmax
from specjax.step import draft_context


@dataclasses.dataclass
class Prompt:
  id: str
  category: str
  text: str


def load_prompts(
    path: str | None = None, categories: list[str] | None = None, limit: int | None = None
) -> list[Prompt]:
  """A jsonl of prompts (first turn of each question), `limit` per category.

  `path=None` reads Spec-Bench `question.jsonl` as `datasets.spec_bench_path` finds it.
  """
  path = datasets.spec_bench_path(path)
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.readlines()
  except UnicodeDecodeError as e:
    raise SpecjaxError(f'{path} is not UTF-8 text (byte {e.start})') from None
  rows = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      raise SpecjaxError(f'{path}:{n} is not valid JSON') from None
    if not isinstance(row, dict):
      raise SpecjaxError(f'{path}:{n} is not a JSON object')
    text = row.get('prompt') or (row.get('turns') or [None])[0]
    if not isinstance(text, str):
      raise SpecjaxError(f'{path}:{n} has no "prompt" or "turns" text')
    rows.append(Prompt(str(row.get('question_id', n)), row.get('category', 'all'), text))
  known = sorted({r.category for r in rows})
  if categories:
    unknown = sorted(set(categories) - set(known))
    if unknown:
      raise SpecjaxError(f'unknown categories {unknown}; {path} has {known}')
    rows = [r for r in rows if r.category in categories]
  if limit is not None:
    if limit < 1:
      raise SpecjaxError(f'--limit must be at least 1, got {limit}')
    seen = collections.Counter()
    kept = []
    for r in rows:
      if seen[r.category] < limit:
        kept.append(r)
        seen[r.category] += 1
    rows = kept
  return rows


# Each cost function donates the decode state and returns it with the target
# cache rolled back by length, so repeated timing runs in place (an undonated
# cache would be copied on every call and inflate the cost). `calibrate` runs
# them as the engine runs its steps: compiled ahead of time (`engine.executables`),
# so the host-side cost of a call is the engine's, not `jax.jit`'s dispatch.


def _draft_cost(graphdef, params, dparams, state, *, drafter, k, sampling):
  ctx = draft_context(state)
  dstate = drafter.start(dparams, state.drafter, ctx) if drafter.drafts_ahead else state.drafter  # the lookup
  prop = drafter.propose(nnx.merge(graphdef, params), dparams, dstate, state.cache, ctx, k, sampling)
  cache = dataclasses.replace(prop.cache, lengths=state.cache.lengths)
  # A drafter with its own cache advances it by K per call: prefill reserved room for that.
  return prop.drafts, dataclasses.replace(state, cache=cache, drafter=prop.state)


def _verify_cost(graphdef, params, state, *, k):
  """The target pass over K + 1 positions (K = 0: one autoregressive step)."""
  model = nnx.merge(graphdef, params)
  block = jnp.broadcast_to(state.last_tokens[:, None], (state.last_tokens.shape[0], k + 1))
  hidden, cache, _ = append(model, block, state.cache, jnp.where(state.active, k + 1, 0))
  cache = dataclasses.replace(cache, lengths=state.cache.lengths)
  return argmax(model.logits(hidden)), dataclasses.replace(state, cache=cache)


def _time_rounds(fns: dict, state, repeats: int = 7) -> tuple[dict[str, float], object]:
  """Median time of each `fn(state) -> (out, state)`, run in `repeats` interleaved rounds (after a warm-up).

  Interleaved, so the ratios of the costs do not drift with the machine's
  load; the median, not the best: the measured runs pay this machine's
  typical step time, and a best-of would make every prediction optimistic.
  """
  times = {name: [] for name in fns}
  for r in range(repeats + 1):
    for name, fn in fns.items():
      t = time.perf_counter()
      out, state = fn(state)
      jax.block_until_ready(out)
      if r:
        times[name].append(time.perf_counter() - t)
  return {name: float(np.median(v)) for name, v in times.items()}, state


def calibrate(engine: Engine, prompt: list[int], k: int, sampling: SamplingParams = SamplingParams()) -> dict:
  """Times one autoregressive step, the drafter's propose for k, and the k + 1 verify pass, each alone."""
  eos = jnp.asarray([-1], jnp.int32)
  sampling = sampling.unconstrained()  # costs of the steps themselves
  state = engine.prefill([prompt], 64, sampling, eos)
  params, drafter = engine.model.params, engine.drafter
  dparams = drafter.params()
  decode = engine.executables.get('cost_verify', _verify_cost, (state,), {'k': 0})
  verify = engine.executables.get('cost_verify', _verify_cost, (state,), {'k': k})
  draft = engine.executables.get(
      'cost_draft', _draft_cost, (dparams, state), {'drafter': drafter, 'k': k, 'sampling': sampling}, (2,)
  )
  costs, _ = _time_rounds(
      {
          'decode_s': lambda st: decode(params, st),
          'verify_s': lambda st: verify(params, st),
          'draft_s': lambda st: draft(params, dparams, st),
      },
      state,
  )
  return costs


@dataclasses.dataclass
class Cell:
  category: str
  k: int  # 0 = autoregressive
  tokens: int = 0
  decode_s: float = 0.0
  model_s: float = 0.0  # the decode time the calibrated costs predict for the same steps
  metrics: SpecMetrics | None = None

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.decode_s if self.decode_s else 0.0

  @property
  def model_tokens_per_s(self) -> float:
    return self.tokens / self.model_s if self.model_s else 0.0


def run_bench(
    engine: Engine,
    prompts: list[Prompt],
    depths: list[int],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    progress=None,
) -> dict:
  """Runs every prompt autoregressively and at every depth; returns cells and calibration."""
  for k in depths:
    if k < 1:
      raise SpecjaxError(f'draft depths must be at least 1, got {k}')
    engine.check_depth(k)
  ids = engine.encode([p.text for p in prompts])
  engine.generate([ids[0]], max_new_tokens=4, num_draft=0, sampling=sampling)  # compile the buckets
  for k in depths:
    engine.generate([ids[0]], max_new_tokens=4, num_draft=k, sampling=sampling)
  cells: dict[tuple[str, int], Cell] = {}
  calib: dict[tuple[str, int], dict] = {}
  outputs_equal = True
  for n, (prompt, p_ids) in enumerate(zip(prompts, ids)):
    runs = {}
    for k in [0] + list(depths):
      results, stats = engine.generate([p_ids], max_new_tokens=max_new_tokens, num_draft=k, sampling=sampling)
      runs[k] = (results[0], stats)
      if k and sampling.is_greedy and results[0].tokens != runs[0][0].tokens:
        outputs_equal = False
      if progress:
        progress(n, len(prompts), prompt, k, stats)
    # Costs right after the prompt's runs, at the context halfway through its autoregressive output.
    ar_tokens = runs[0][0].tokens
    context = list(p_ids) + list(ar_tokens[: len(ar_tokens) // 2])
    costs = {k: calibrate(engine, context, k, sampling) for k in depths}
    calib.update({(prompt.id, k): c for k, c in costs.items()})
    decode_s = float(np.median([c['decode_s'] for c in costs.values()]))
    for k, (r, stats) in runs.items():
      steps = len(r.tokens) - 1 if k == 0 else r.spec.target_steps
      step_s = decode_s if k == 0 else costs[k]['draft_s'] + costs[k]['verify_s']
      for cat in (prompt.category, 'all'):
        cell = cells.setdefault((cat, k), Cell(cat, k, metrics=SpecMetrics(k=k) if k else None))
        cell.tokens += len(r.tokens) - 1  # tokens after the first, over decode time
        cell.decode_s += stats.decode_s
        cell.model_s += steps * step_s
        if k:
          cell.metrics = cell.metrics.merge(r.spec)
  return {'cells': cells, 'calibration': calib, 'outputs_equal': outputs_equal}


def table(report: dict, drafter: str) -> list[dict]:
  cells = report['cells']
  rows = []
  categories = sorted({c for c, _ in cells}, key=lambda c: (c == 'all', c))
  for cat in categories:
    ar = cells[(cat, 0)]
    for (c, k), cell in sorted(cells.items()):
      if c != cat or k == 0:
        continue
      predicted = cell.model_tokens_per_s / ar.model_tokens_per_s if ar.model_tokens_per_s else 0.0
      speedup = cell.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0
      rows.append(
          {
              'category': cat,
              'drafter': drafter,
              'k': k,
              'tau': cell.metrics.tau,
              'acceptance': cell.metrics.acceptance_rate,
              'ar_tok_s': ar.tokens_per_s,
              'spec_tok_s': cell.tokens_per_s,
              'speedup': speedup,
              'predicted': predicted,
              'efficiency': speedup / predicted if predicted else 0.0,
          }
      )
  return rows


def format_table(rows: list[dict]) -> str:
  head = '| category | drafter | K | τ | accept | AR tok/s | spec tok/s | speedup | predicted | measured/predicted |'
  lines = [head, '|' + '---|' * 10]
  for r in rows:
    lines.append(
        f"| {r['category']} | {r['drafter']} | {r['k']} | {r['tau']:.2f} | {r['acceptance']:.2f} | "
        f"{r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['predicted']:.2f}x | "
        f"{r['efficiency']:.2f} |"
    )
  return '\n'.join(lines)
