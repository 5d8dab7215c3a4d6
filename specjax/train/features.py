"""The frozen target's side of training, computed once per packed row and kept on disk.

A drafter's loss needs, for every position, the target's final-normed hidden
state, the residuals after its tapped layers and (with a draft vocabulary)
the target's argmax over the whole vocabulary. The target is frozen, so these
never change between epochs: `target_features` runs it once over the rows
(`data.Packed`) and writes `.npy` files that later steps read by memory map,
in place of a target forward and a full-vocabulary projection per step.

Files under `dir`: `hidden.npy [R, L, D]`, `taps.npy [R, L, n * D]`,
`best.npy [R, L]` and `meta.json`, whose fingerprint (rows, target, taps)
says what they hold and `done` how many rows are written: an interrupted run
resumes, and changed data or target starts over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.train.data import Packed
from specjax.train.losses import target_features as run_target

FIELDS = ('hidden', 'taps', 'best')


@dataclasses.dataclass
class TargetFeatures:
  hidden: np.ndarray  # [R, L, D] float32 final-normed hidden states
  taps: np.ndarray  # [R, L, n * D] float32 residuals after the tapped layers, side by side
  best: np.ndarray  # [R, L] int32 the target's argmax over its vocabulary
  num_taps: int

  def take(self, rows) -> dict[str, np.ndarray]:
    """Batch entries for `rows` (`target_hidden`, `target_taps`, `target_best`)."""
    rows = np.asarray(rows)
    return {f'target_{name}': np.asarray(getattr(self, name)[rows]) for name in FIELDS}


def from_batch(batch: dict, num_taps: int) -> tuple[jax.Array, tuple[jax.Array, ...]] | None:
  """(hidden [B, T, D], taps) from a batch that carries cached features; None when it does not."""
  if 'target_hidden' not in batch:
    return None
  taps = batch['target_taps']
  return batch['target_hidden'], tuple(jnp.split(taps, num_taps, axis=-1)) if num_taps else ()


def fingerprint(rows: Packed, target, taps: tuple[int, ...]) -> str:
  digest = hashlib.sha256()
  for array in (rows.tokens, rows.positions, rows.segments):
    digest.update(np.ascontiguousarray(array).tobytes())
  digest.update(json.dumps([target.source, target.architecture, str(target.dtype), list(taps)]).encode())
  return digest.hexdigest()


def target_features(
    path: str, target, rows: Packed, taps: tuple[int, ...], *, batch_size: int, progress: bool = True
) -> TargetFeatures:
  """The target's features of every row of `rows`, from `path` (computed there first, resumably)."""
  os.makedirs(path, exist_ok=True)
  r, length = rows.tokens.shape
  d = target.config.hidden_size
  shapes = {'hidden': ((r, length, d), np.float32), 'taps': ((r, length, len(taps) * d), np.float32)}
  shapes['best'] = ((r, length), np.int32)
  meta_path = os.path.join(path, 'meta.json')
  key = fingerprint(rows, target, taps)
  meta = {}
  if os.path.exists(meta_path):
    with open(meta_path, encoding='utf-8') as f:
      meta = json.load(f)
  fresh = meta.get('fingerprint') != key
  files = {
      name: np.lib.format.open_memmap(
          os.path.join(path, f'{name}.npy'), mode='w+' if fresh else 'r+', dtype=dtype, shape=shape
      )
      for name, (shape, dtype) in shapes.items()
  }
  done = 0 if fresh else int(meta.get('done', 0))
  if progress:
    print(
        f'target features: the target runs over {r - done} of {r} rows ({done} cached) into {path}'
        if done < r
        else f'target features: all {r} rows cached in {path}',
        file=sys.stderr,
        flush=True,
    )
  graphdef = target.graphdef

  @jax.jit
  def compute(params, batch):
    model = nnx.merge(graphdef, params)
    hidden, tapped = run_target(model, batch, taps)
    best = jnp.argmax(model.logits(hidden).astype(jnp.float32), axis=-1).astype(jnp.int32)
    tapped = jnp.concatenate(tapped, axis=-1) if tapped else jnp.zeros(hidden.shape[:2] + (0,))
    return hidden.astype(jnp.float32), tapped.astype(jnp.float32), best

  for at in range(done, r, batch_size):
    idx = np.arange(at, min(at + batch_size, r))
    batch = {k: np.pad(v, ((0, batch_size - len(idx)), (0, 0))) for k, v in rows.take(idx).items()}
    out = jax.device_get(compute(target.params, batch))
    for name, value in zip(FIELDS, out):
      files[name][idx] = value[: len(idx)]
      files[name].flush()
    with open(meta_path, 'w', encoding='utf-8') as f:
      json.dump({'fingerprint': key, 'done': int(idx[-1]) + 1, 'rows': r, 'taps': list(taps)}, f)
    if progress:
      print(f'target features: {idx[-1] + 1}/{r} rows', file=sys.stderr, flush=True)
  if fresh and r == 0:
    with open(meta_path, 'w', encoding='utf-8') as f:
      json.dump({'fingerprint': key, 'done': 0, 'rows': 0, 'taps': list(taps)}, f)
  read = {name: np.load(os.path.join(path, f'{name}.npy'), mmap_mode='r') for name in FIELDS}
  return TargetFeatures(read['hidden'], read['taps'], read['best'], len(taps))


def tap_scale(target, rows: Packed, taps: tuple[int, ...], *, num_rows: int = 16) -> np.ndarray:
  """Per-channel RMS [n * D] of the taps over the first `num_rows` rows (real tokens, sequence starts excluded).

  Gemma 3's residual stream holds a few channels of ~1e4 at every position
  (98% of the energy of layer 1's and 8's output on Gemma 3 270M), so `fc` of
  the raw taps is nearly the same vector everywhere (pairwise cosine ~0.8-0.96).
  Dividing each channel by its RMS gives every channel a say; `drafter.tap_scale`
  trains `fc` on the scaled taps and folds the scale into `fc` at export.
  Floored at 1e-3 of the median channel's RMS (dead channels are not blown up).
  """
  idx = np.arange(min(num_rows, len(rows)))
  batch = rows.take(idx)
  graphdef = target.graphdef
  run = jax.jit(lambda params, b: run_target(nnx.merge(graphdef, params), b, taps)[1])
  tapped = np.concatenate([np.asarray(x, np.float32) for x in jax.device_get(run(target.params, batch))], axis=-1)
  keep = (batch['segments'] > 0) & (batch['positions'] > 0)
  x = tapped[keep] if keep.any() else tapped.reshape(-1, tapped.shape[-1])
  rms = np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=0))  # [n * D]
  floor = 1e-3 * np.median(rms) if np.median(rms) > 0 else 1.0
  return np.maximum(rms, floor).astype(np.float32)
