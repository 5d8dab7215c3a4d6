"""Does an EAGLE-3 head read its input token? Step-0 top-1 agreement with the target, tokens true and shuffled.

Teacher-forced over the target's own answers (a `data.regenerate` cache file: one {"prompt", "output"} line per
prompt), the head's first draft at row s (taps at s, token x_{s+1}) is compared with the target's argmax at
s + 1, over answer rows. Three readings: the head as trained; the same with the input tokens shuffled within
the record (a head that ignores its token scores the same); the taps zeroed. A bigram table of the other
records' answers (x_{s+1} -> its most frequent successor) is the token-only baseline. Also printed: the RMS
of each tap, of fc(taps), of the layer's residual (fc(taps), or its hidden_norm with
`norm_before_residual`) and of what the layer adds to it (attention + MLP).

  python experiments/train_eagle3_gemma3_270m/token_use.py runs/train_eagle3_gemma3_270m/export \\
      runs/regenerated/<key>.jsonl --records 24
"""

import argparse
import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.loading.eagle3 import load_eagle3
from specjax.models.contract import StepInputs
from specjax.train.losses import sequence_batch, target_features


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('draft_model')
  parser.add_argument('answers', help='a regeneration cache file (jsonl of prompt / output token ids)')
  parser.add_argument('--target', default='gemma-3-270m')
  parser.add_argument(
      '--records', type=int, default=24, help='the last N records are scored, the rest give the bigrams'
  )
  parser.add_argument('--max-len', type=int, default=256)
  args = parser.parse_args()

  target = specjax.load(args.target)
  model = target.module()
  ck = load_eagle3(args.draft_model, target, dtype='float32')
  head = nnx.merge(ck.graphdef, ck.params)
  draft_ids = np.arange(ck.config.draft_vocab_size) + ck.d2t
  with open(args.answers, encoding='utf-8') as f:
    records = [json.loads(line) for line in f]
  rest, scored = records[: -args.records], records[-args.records :]
  successors = collections.defaultdict(collections.Counter)
  for r in rest:
    for a, b in zip(r['output'], r['output'][1:]):
      successors[a][b] += 1

  @jax.jit
  def run(tokens, shuffled):  # [1, T] each
    t = tokens.shape[1]
    batch = sequence_batch(tokens)
    hidden, taps = target_features(model, batch, ck.config.taps)
    best = jnp.argmax(model.logits(hidden), -1)  # [1, T]
    fused = head.fuse(jnp.concatenate(taps, -1))[:, :-1]
    chain = StepInputs.chain(None, jnp.asarray([t - 1]), t - 1)
    reads, outs = {}, {}
    for name, ids, h in (
        ('head', tokens[:, 1:], fused),
        ('head, tokens shuffled', shuffled[:, 1:], fused),
        ('head, taps zeroed', tokens[:, 1:], jnp.zeros_like(fused)),
    ):
      outs[name], _ = head.forward(model.lookup(ids), h, chain, None)
      reads[name] = jnp.argmax(head.logits(outs[name]), -1)
    rms = lambda x: jnp.sqrt(jnp.mean(x**2))
    residual = head.hidden_norm(fused) if ck.config.norm_before_residual else fused
    sizes = {f'tap {i} rms': rms(x) for i, x in zip(ck.config.taps, taps)}
    sizes |= {'fc(taps) rms': rms(fused), 'residual rms': rms(residual), 'layer adds rms': rms(outs['head'] - residual)}
    return best, reads, sizes

  rng = np.random.default_rng(0)
  hits, n, sizes = collections.Counter(), 0, collections.defaultdict(list)
  for r in scored:
    ids = (r['prompt'] + r['output'])[: args.max_len]
    best, reads, size = jax.device_get(
        run(jnp.asarray([ids], jnp.int32), jnp.asarray([rng.permutation(ids)], jnp.int32))
    )
    rows = range(len(r['prompt']) - 1, len(ids) - 2)  # row s predicts the target's token after x_{s+1}
    for name, read in reads.items():
      hits[name] += sum(int(draft_ids[read[0, s]] == best[0, s + 1]) for s in rows)
    for s in rows:
      common = successors[ids[s + 1]].most_common(1)
      hits['bigram of the other answers'] += int(bool(common) and common[0][0] == best[0, s + 1])
    n += len(rows)
    for k, v in size.items():
      sizes[k].append(float(v))
  print(json.dumps({'rows': n, **{k: round(v / n, 4) for k, v in hits.items()}}))
  print(json.dumps({k: round(float(np.mean(v)), 2) for k, v in sizes.items()}))


if __name__ == '__main__':
  main()
