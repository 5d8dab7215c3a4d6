"""Quality of quantized Gemma 3 270M against float32 on Spec-Bench: top-1 agreement, KL, perplexity, n-gram τ.

  python benchmarks/quant_quality.py [--arms auto int8 int4] [--per-category 2] [--continuation 32]
      [--ngram-depth 4] [--json benchmarks/results/quant_quality_cpu.json]

For `--per-category` Spec-Bench prompts of each of the 13 categories (the first turn, BOS + raw text, at most
`--max-prompt` tokens), float32 greedy decoding continues each prompt by `--continuation` tokens. Each arm (loaded
as benchmarks/quant_decode.py loads it: `auto` the GGUF's own blocks, `int8` / `int4` float32 requantized) then
scores the same token sequences in one causal forward pass, and against float32's next-token distributions p at
every position (p from float32, q from the arm):

  top1        the share of positions where argmax q == argmax p (prompt positions and continuation positions
              apart: the continuation is where float32's own greedy path runs);
  kl          mean KL(p || q) in nats over those positions;
  ppl         perplexity of the prompt text itself (the next-token loss over the prompt's tokens), per category
              and overall; float32's own is the reference row;
  ngram       τ (tokens per verify step) of the n-gram drafter (prompt lookup, depth `--ngram-depth`), greedy, on
              the same prompts, `--continuation` new tokens, over the arm's own model; with it the arm's AR and
              speculative decode tok/s on this CPU and the speedup over the arm's own AR, overall and per
              Spec-Bench category (`ngram_by_category`).

Spec-Bench is evaluation data: nothing here trains on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from quant_decode import MODEL, load_arm  # noqa: E402

import specjax  # noqa: E402
from specjax.bench import load_prompts  # noqa: E402
from specjax.drafters.registry import make_drafter  # noqa: E402
from specjax.models.contract import StepInputs  # noqa: E402
from specjax.provenance import device_description, git_info, now  # noqa: E402
from specjax.quant import ops  # noqa: E402

BUCKET = 64  # sequences pad to a multiple of this, so each arm compiles a handful of lengths


def scorer(model):
  """A jitted `ids [1, T], length -> log-probabilities [T, V]` of one causal forward pass, no cache."""

  @jax.jit
  def logprobs(params, ids, length):  # ids [1, T]
    module = nnx.merge(model.graphdef, params)
    inputs = StepInputs.chain(None, jnp.asarray([length], jnp.int32), ids.shape[1])
    hidden, _, _ = module.forward(ids, inputs, None)
    return jax.nn.log_softmax(module.logits(hidden)[0].astype(jnp.float32), axis=-1)  # [T, V]

  return lambda ids, length: logprobs(model.params, ids, length)


@jax.jit
def compare(ref, logq, targets):  # ref, logq [T, V]; targets [T] -> per position top-1 equal, KL(p||q), -log q(t)
  top1 = jnp.argmax(ref, -1) == jnp.argmax(logq, -1)
  kl = jnp.sum(jnp.exp(ref) * (ref - logq), -1)
  nll = -jnp.take_along_axis(logq, targets[:, None], -1)[:, 0]
  return top1, kl, nll


def padded(ids: list[int]) -> np.ndarray:
  t = -(-len(ids) // BUCKET) * BUCKET
  return np.asarray([ids + [0] * (t - len(ids))], np.int32)


def ngram_run(model, rows, prompts: list[list[int]], new: int, depth: int) -> dict:
  """n-gram τ and decode tok/s, speculative and AR, on the arm's own model (greedy; compiled before timing),
  overall and per Spec-Bench category (speedup: the category's n-gram tok/s over its AR tok/s)."""
  out, per = {}, collections.defaultdict(dict)
  for name in ('ar', 'ngram'):
    drafter = make_drafter('ngram', model) if name == 'ngram' else None
    engine = specjax.Engine(model, drafter=drafter, max_draft=depth)
    engine.generate(prompts[:1], max_new_tokens=4)
    sums = collections.defaultdict(lambda: [0, 0, 0.0])  # category -> tokens, steps, seconds
    for row, prompt in zip(rows, prompts):
      _, stats = engine.generate([prompt], max_new_tokens=new)
      for key in (row.category, 'all'):
        sums[key][0] += stats.generated_tokens - stats.rows
        sums[key][1] += stats.decode_steps
        sums[key][2] += stats.decode_s
    for key, (tokens, steps, seconds) in sums.items():
      per[key][name] = (tokens / seconds, tokens / steps)
  for key, arms in per.items():
    (ar_rate, _), (rate, tau) = arms['ar'], arms['ngram']
    entry = {'ar_tok_s': round(ar_rate, 2), 'ngram_tok_s': round(rate, 2), 'tau': round(tau, 3)}
    entry['speedup'] = round(rate / ar_rate, 3)
    out[key] = entry
  return {'ngram': out.pop('all'), 'ngram_by_category': dict(sorted(out.items()))}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument('--arms', nargs='+', default=['auto', 'int8', 'int4'])
  ap.add_argument('--per-category', type=int, default=2)
  ap.add_argument('--categories', nargs='+')
  ap.add_argument('--max-prompt', type=int, default=384)
  ap.add_argument('--continuation', type=int, default=32)
  ap.add_argument('--ngram-depth', type=int, default=4)
  ap.add_argument('--no-ngram', action='store_true')
  ap.add_argument('--json')
  args = ap.parse_args()

  rows = load_prompts(categories=args.categories, limit=args.per_category)
  reference = load_arm('f32')
  tok = reference.tokenizer
  prompts = [tok.encode(r.text)[: args.max_prompt] for r in rows]
  engine = specjax.Engine(reference)
  sequences = []
  for ids in prompts:
    results, _ = engine.generate([ids], max_new_tokens=args.continuation)
    sequences.append(ids + list(results[0].tokens))
  del engine

  arms = {'f32': reference} | {arm: load_arm(arm) for arm in args.arms}
  scorers = {arm: scorer(model) for arm, model in arms.items()}
  sums = {arm: collections.defaultdict(float) for arm in arms}
  by_category = {arm: collections.defaultdict(lambda: [0.0, 0]) for arm in arms}
  t0 = time.time()
  for row, ids, seq in zip(rows, prompts, sequences):
    x = jnp.asarray(padded(seq))
    n, t = len(ids), len(seq)
    targets = jnp.asarray(padded(seq[1:] + [0])[0])
    ref = scorers['f32'](x, t)
    for arm in arms:
      logq = ref if arm == 'f32' else scorers[arm](x, t)
      top1, kl, nll = (np.asarray(a)[: t - 1] for a in compare(ref, logq, targets))
      s = sums[arm]
      for part, sl in (('prompt', slice(0, n - 1)), ('continuation', slice(n - 1, t - 1))):
        s[f'{part}_positions'] += top1[sl].size
        s[f'{part}_top1'] += float(top1[sl].sum())
        s[f'{part}_kl'] += float(kl[sl].sum())
      c = by_category[arm][row.category]
      c[0] += float(nll[: n - 1].sum())
      c[1] += n - 1
  print(f'scored {len(sequences)} sequences x {len(arms)} arms in {time.time() - t0:.0f} s', flush=True)

  report = {
      'date': now(),
      'git': git_info(),
      'device': device_description(),
      'kernel': ops.kernel_status(),
      'model': MODEL,
      'prompts': len(rows),
      'per_category': args.per_category,
      'continuation': args.continuation,
      'arms': {},
  }
  for arm, model in arms.items():
    s, cats = sums[arm], by_category[arm]
    out = {'quant': model.quant, 'weight_bytes': model.param_bytes}
    for part in ('prompt', 'continuation'):
      out[f'{part}_top1'] = round(s[f'{part}_top1'] / s[f'{part}_positions'], 4)
      out[f'{part}_kl'] = round(s[f'{part}_kl'] / s[f'{part}_positions'], 5)
    out['ppl'] = round(math.exp(sum(c[0] for c in cats.values()) / sum(c[1] for c in cats.values())), 3)
    out['ppl_by_category'] = {k: round(math.exp(v[0] / v[1]), 3) for k, v in sorted(cats.items())}
    if not args.no_ngram:
      out |= ngram_run(model, rows, prompts, args.continuation, args.ngram_depth)
    report['arms'][arm] = out
    print(arm, {k: v for k, v in out.items() if not k.endswith('_by_category')}, flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + '\n')


if __name__ == '__main__':
  main()
