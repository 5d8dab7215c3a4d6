"""Does a DFlash draft read its context? Teacher-forced block agreement with the target, context true and broken.

Over the target's own answers (a `data.regenerate` cache file), every `--stride`-th answer position a is an
anchor: its block `[x_a, MASK x (B - 1)]` sees the context features before a, and row k's draft is compared
with the target's argmax at a + k - 1. Four readings: the draft as trained; the context features of another record (the taps of
a record's tokens shuffled); the context zeroed; and the block's first token x_a swapped for another of the
record's tokens, the context kept. A draft that ignores its context scores the same in the first three; one that
ignores x_a, the same in the first and the last.
Also printed: the draft's and the target's final-norm weights and logit scales (the draft reads the target's
head through its own final norm), and how alike the context features of a record's positions are (mean pairwise
cosine: near 1, every position offers the same keys and values).

  python experiments/train_dflash_gemma3_270m/context_use.py runs/train_dflash_gemma3_270m/export \\
      runs/regenerated/<key>.jsonl --records 8
"""

import argparse
import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.train.config import resolve
from specjax.train.losses import sequence_batch, target_features
from specjax.train.trainers import make_trainer


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('draft_model')
  parser.add_argument('answers', help='a regeneration cache file (jsonl of prompt / output token ids)')
  parser.add_argument('--config', default='configs/train_dflash_gemma3_270m.py')
  parser.add_argument('--records', type=int, default=8, help='the last N records are scored')
  parser.add_argument('--max-len', type=int, default=256)
  parser.add_argument('--stride', type=int, default=4, help='every n-th answer position is an anchor')
  args = parser.parse_args()

  config = resolve(args.config)
  target = specjax.load(config['target.model'])
  model = target.module()
  trainer = make_trainer(config, target, None)
  params = trainer.load(args.draft_model)
  draft = nnx.merge(trainer.graphdef, params)
  b = trainer.cfg.block_size
  with open(args.answers, encoding='utf-8') as f:
    scored = [json.loads(line) for line in f][-args.records :]

  @jax.jit
  def run(tokens, shuffled, anchors):  # [1, T], [1, T], [1, A]
    t = tokens.shape[1]
    batch = sequence_batch(tokens)
    hidden, taps = target_features(model, batch, trainer.taps)
    _, other = target_features(model, {**batch, 'tokens': shuffled}, trainer.taps)
    best = jnp.argmax(model.logits(hidden), -1)[0]  # [T]
    reads, scales = {}, {}
    swapped = {**batch, 'tokens': batch['tokens'].at[0, anchors[0]].set(shuffled[0, anchors[0]])}
    readings = (
        ('draft', taps, batch),
        ('other context', other, batch),
        ('context zeroed', [0 * x for x in taps], batch),
        ('anchor token swapped', taps, swapped),  # the block's x_a from another position, the context kept
    )
    for name, context, block_batch in readings:
      out = trainer.blocks(params, model, block_batch, tuple(context), anchors)[0, :, 1:]  # [A, B - 1, D]
      logits = model.logits(out)
      reads[name] = jnp.argmax(logits, -1)
      scales[name] = jnp.std(logits, -1).mean()
    scales['target'] = jnp.std(model.logits(hidden), -1).mean()
    ctx = draft.context(jnp.concatenate(taps, axis=-1))[0, 1:]  # [T - 1, D] past <bos>
    u = ctx / jnp.linalg.norm(ctx, axis=-1, keepdims=True)
    scales['context cosine'] = (jnp.sum(u.sum(0) ** 2) - (t - 1)) / ((t - 1) * (t - 2))  # mean over position pairs
    want = best[jnp.minimum(anchors[0, :, None] + jnp.arange(b - 1), t - 1)]  # row k: the target's token at a + k - 1
    return {k: (v == want).sum(0) for k, v in reads.items()}, scales

  rng = np.random.default_rng(0)
  hits, n, scales = collections.Counter(), np.zeros(b - 1), collections.defaultdict(list)
  for r in scored:
    ids = (r['prompt'] + r['output'])[: args.max_len]
    anchors = np.arange(len(r['prompt']), len(ids) - b + 1, args.stride)  # whole blocks inside the answer
    if not anchors.size:
      continue
    agree, scale = jax.device_get(
        run(jnp.asarray([ids]), jnp.asarray([rng.permutation(ids)]), jnp.asarray(anchors[None], jnp.int32))
    )
    for k, v in agree.items():
      hits[k] = hits.get(k, 0) + v
    n += anchors.size
    for k, v in scale.items():
      scales[k].append(float(v))
  print(json.dumps({'blocks': int(n[0]), **{k: [round(float(x), 3) for x in v / n] for k, v in hits.items()}}))
  norm = lambda w: [round(float(x), 2) for x in np.percentile(np.asarray(w), [0, 50, 99, 100])]
  d = params['norm']['scale']
  t = model.norm.offset + model.norm.scale[...]
  print(json.dumps({'draft norm weight p0/50/99/100': norm(d), 'target norm weight': norm(t)}))
  cosine = scales.pop('context cosine')
  print(json.dumps({f'logit std, {k}': round(float(np.mean(v)), 2) for k, v in scales.items()}))
  print(
      json.dumps(
          {
              'context features hidden_norm(fc(taps)), mean pairwise cosine over positions': round(
                  float(np.mean(cosine)), 3
              )
          }
      )
  )


if __name__ == '__main__':
  main()
