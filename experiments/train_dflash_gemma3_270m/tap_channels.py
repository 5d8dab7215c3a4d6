"""How alike are a drafter's context features across positions? Channel statistics of the target's taps.

Over the target's own answers (a `data.regenerate` cache file), the residuals after the tapped layers: per tap
its RMS, its largest entry, the RMS of its median and largest channel, the share of its energy in its 4 largest
channels and in its per-channel mean (the part every position shares), and the mean pairwise cosine of its
vectors over positions. Then what a drafter at initialisation makes of them, `fc` (random normal, std 0.02, as
`param` initialises it) of the concatenated taps: raw (DFlash, EAGLE-3), each tap RMS-normed first (EAGLE 3.1's
`fc_norm`), or each channel divided by its RMS over the first rows (`drafter.tap_scale`, the scale
`specjax.train.features.tap_scale` computes). Near 1, every position offers the drafter the same vector.

  python experiments/train_dflash_gemma3_270m/tap_channels.py runs/regenerated/<key>.jsonl --records 8
"""

import argparse
import json

import numpy as np

import specjax
from specjax.train.data import Packed
from specjax.train.features import tap_scale


def mean_cosine(x: np.ndarray) -> float:  # [N, E] -> mean cosine over pairs of rows
  u = x / np.linalg.norm(x, axis=-1, keepdims=True)
  n = len(u)
  return float((np.sum(u.sum(0) ** 2) - n) / (n * (n - 1)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('answers', help='a regeneration cache file (jsonl of prompt / output token ids)')
  parser.add_argument('--model', default='gemma-3-270m')
  parser.add_argument('--taps', type=int, nargs='+', default=[1, 8, 15])
  parser.add_argument('--records', type=int, default=8, help='the last N records, one row each')
  parser.add_argument('--max-len', type=int, default=512)
  args = parser.parse_args()

  target = specjax.load(args.model)
  with open(args.answers, encoding='utf-8') as f:
    records = [json.loads(line) for line in f][-args.records :]
  rows = np.zeros((len(records), args.max_len), np.int32)
  segments = np.zeros_like(rows)
  for i, r in enumerate(records):
    ids = (r['prompt'] + r['output'])[: args.max_len]
    rows[i, : len(ids)], segments[i, : len(ids)] = ids, 1
  positions = np.broadcast_to(np.arange(args.max_len, dtype=np.int32), rows.shape).copy()
  packed = Packed(rows, positions, segments, segments > 0)
  taps = tuple(args.taps)

  from specjax.train.losses import target_features

  module = target.module()
  _, tapped = target_features(module, packed.take(np.arange(len(packed))), taps)
  keep = (segments > 0) & (positions > 0)
  tapped = [np.asarray(x)[keep] for x in tapped]  # [N, D] each, <bos> left out
  for layer, x in zip(taps, tapped):
    channel = np.sqrt(np.mean(x**2, axis=0))
    energy = channel**2
    print(
        json.dumps(
            {
                'tap': layer,
                'rms': round(float(np.sqrt(np.mean(x**2))), 1),
                'max |x|': round(float(np.abs(x).max()), 0),
                'channel rms median / max': [round(float(np.median(channel)), 2), round(float(channel.max()), 1)],
                'energy in top 4 channels': round(float(np.sort(energy)[-4:].sum() / energy.sum()), 3),
                'energy in the channel means': round(float(np.sum(x.mean(0) ** 2) / energy.sum()), 3),
                'mean pairwise cosine': round(mean_cosine(x), 3),
            }
        )
    )
  raw = np.concatenate(tapped, axis=-1)
  fc = np.random.default_rng(0).normal(0, 0.02, (raw.shape[1], target.config.hidden_size)).astype(np.float32)
  per_tap = np.concatenate([x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True)) for x in tapped], axis=-1)
  scaled = raw / tap_scale(target, packed, taps, num_rows=len(packed))
  print(
      json.dumps(
          {
              'fc at init, mean pairwise cosine over positions': {
                  'raw taps': round(mean_cosine(raw @ fc), 3),
                  'each tap RMS-normed (fc_norm)': round(mean_cosine(per_tap @ fc), 3),
                  'each channel / its RMS (tap_scale)': round(mean_cosine(scaled @ fc), 3),
              }
          }
      )
  )


if __name__ == '__main__':
  main()
