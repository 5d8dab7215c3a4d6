"""MTP training for any target: a one-layer head over [norm(embed(x_{t+1})), norm(h_t)] predicts x_{t+2}.

The head (`specjax.models.mtp.MTPHead`, built by `specjax.loading.mtp_head.head_for`) shares the
target's embedding and LM head. Step 0 pairs the target's final hidden h_t
with x_{t+1} at position t and learns the target's distribution at t + 1;
step i (training-time test, `train.ttt_steps`) pairs step i - 1's output with
x_{t+i+1} at position t + i, as the drafter feeds itself when drafting deeper.
Loss: soft cross-entropy against the target distribution over the full
vocabulary, step i weighted `train.ttt_decay`^i. Export: `save_mtp_head`
(`specjax.loading.mtp_head`), served by `make_drafter('mtp', target,
draft_model=DIR)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading.mtp_head import head_for, load_mtp_head, save_mtp_head
from specjax.train.features import from_batch
from specjax.train.losses import segment_mask, shift, soft_ce, target_features, ttt_attention
from specjax.train.base import DrafterTrainer


@dataclasses.dataclass(frozen=True, eq=False)
class MTPTrainer(DrafterTrainer):
  graphdef: Any = None
  target: Any = None  # the loaded Model (export, load)
  decay: float = 0.8
  chunk: int = 256
  kind: str = 'mtp'

  def init(self, key) -> nnx.State:
    head = head_for(self.target, rngs=nnx.Rngs(params=key), dtype=jnp.float32)  # float32 master weights
    return nnx.split(head)[1]

  def unroll(self, params, target, batch: dict, hidden: jax.Array) -> list[jax.Array]:
    """The head's output [B, T, D] at each training-time-test step (step i at row t: position t + i)."""
    head = nnx.merge(self.graphdef, params)
    mask = segment_mask(batch['segments'])
    h, prev, outs = hidden, [], []
    for i in range(self.positions):
      positions = batch['positions'] + i
      x = head.fuse(target.embed(shift(batch['tokens'], i + 1)), h)
      x, kv = head.layer(x, lambda attn, y: ttt_attention(attn, y, positions, mask, prev))
      prev.append(kv)
      h = head.norm(x)
      outs.append(h)
    return outs

  def loss(self, params, target, batch: dict, key, norm=None) -> tuple[jax.Array, dict]:
    hidden, _ = from_batch(batch, 0) or target_features(target, batch)
    segments, loss_mask = batch['segments'], batch['loss_mask']
    total, metrics = 0.0, {'ce': [], 'agree': [], 'count': [], 'norm': []}
    for i, h in enumerate(self.unroll(params, target, batch, hidden)):
      # Row t predicts token t + i + 2 from the target's distribution at row t + i + 1, within its sequence.
      valid = (segments > 0) & (shift(segments, i + 2, -1) == segments) & shift(loss_mask, i + 2, False)
      ce, agree, count, _ = soft_ce(
          target.logits, target.logits, h, shift(hidden, i + 1), valid, self.chunk, hard=self.hard_targets
      )
      total = total + self.decay**i * ce / jnp.maximum(count if norm is None else norm[i], 1.0)
      for name, value in (('ce', ce), ('agree', agree), ('count', count), ('norm', count)):
        metrics[name].append(value)
    return total, {k: jnp.stack(v) for k, v in metrics.items()}

  def export(self, params, path: str) -> None:
    save_mtp_head(path, self.target, params)

  def load(self, path: str) -> nnx.State:
    return load_mtp_head(path, self.target)[1]


def make(config, target, data) -> MTPTrainer:
  if config['drafter.layers'] != 1:
    raise SpecjaxError(f"drafter.kind mtp has one decoder layer (drafter.layers=1), got {config['drafter.layers']}")
  if config['drafter.target_layer_ids']:
    raise SpecjaxError("drafter.kind mtp reads the target's final hidden state; drafter.target_layer_ids is not used")
  graphdef = nnx.split(nnx.eval_shape(lambda: head_for(target, dtype=jnp.float32)))[0]
  start = None
  if config['drafter.init_from']:  # fine-tuning an exported head
    start = load_mtp_head(config['drafter.init_from'], target)[1]
  return MTPTrainer(
      positions=config['train.ttt_steps'],
      graphdef=graphdef,
      target=target,
      decay=config['train.ttt_decay'],
      chunk=config['train.loss_chunk'],
      start=start,
  )
