"""EAGLE-3: a one-layer head over fused target features, drafting chains or EAGLE-2 trees.

The head reads three tapped target residuals (`config.taps`), fused by `fc`
into one feature per position; the pair (feature at t, token t + 1) predicts
x_{t+2} over a draft vocab, whose ids map to target ids by `d2t` (target id =
draft id + d2t[draft id]). Deeper drafts feed the layer's own output instead of
a fused feature. q, for rejection sampling, is the draft-vocab distribution
(under the step's sampling transform) placed at target ids, zero elsewhere.
The cache, pending pairs, chains and trees are `head.HeadDrafter`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.head import HeadDrafter, TreeOptions, check_tree_target
from specjax.drafters.registry import DrafterFamily, checkpoint_option, quant_option, quantize_head
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Drafter(HeadDrafter):
  graphdef: nnx.GraphDef = None  # the Eagle3Head module
  head_params: Any = None  # its weights
  target_ids: jax.Array = None  # [Vd] int32 target id of each draft id
  vocab_size: int = 0  # the target's
  has_embedding: bool = False  # the head has its own token embedding (else the target's table)
  taps: tuple[int, ...] = ()  # target layers whose output residuals `fc` fuses
  name: str = 'eagle3'

  def params(self):
    return self.head_params

  def _head(self, params):
    return nnx.merge(self.graphdef, params)

  def features(self, params, hidden, taps):
    return self._head(params).fuse(jnp.concatenate(taps, axis=-1))

  def run(self, params, target, tokens, features, cache, inputs):
    head = self._head(params)
    embeds = head.embed(tokens) if self.has_embedding else target.lookup(tokens)
    return head.forward(embeds.astype(features.dtype), features, inputs, cache)

  def draft_logits(self, params, target, out):
    return self._head(params).logits(out)

  def head_layout(self, params):
    return self._head(params).cache_layout()

  def to_target(self, ids):
    return jnp.take(self.target_ids, ids, axis=0)

  def place(self, probs):  # [..., Vd] -> [..., V]
    out = jnp.zeros((*probs.shape[:-1], self.vocab_size), probs.dtype)
    return out.at[..., self.target_ids].set(probs)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Options(TreeOptions):
  draft_model: Any = checkpoint_option()
  draft_quant: str | None = quant_option()

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter eagle3 needs --draft-model PATH (an EAGLE-3 checkpoint)')
    super().validate()


def _build(target, options: Eagle3Options) -> Eagle3Drafter:
  from specjax.loading.eagle3 import Eagle3Checkpoint, load_eagle3

  ckpt = options.draft_model
  if not isinstance(ckpt, Eagle3Checkpoint):
    ckpt = load_eagle3(str(ckpt), target, dtype=target.dtype)
  cfg = ckpt.config
  target_ids = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) + jnp.asarray(ckpt.d2t, jnp.int32)
  return Eagle3Drafter(
      graphdef=ckpt.graphdef,
      head_params=quantize_head(target, ckpt.params, options),
      target_ids=target_ids,
      vocab_size=target.config.vocab_size,
      has_embedding=cfg.has_embedding,
      feature_size=cfg.hidden_size,
      taps=tuple(cfg.taps),
      **options.tree_shape(),
  )


FAMILY = DrafterFamily(
    name='eagle3',
    options=Eagle3Options,
    build=_build,
    check=check_tree_target,
    depths=(2, 3, 4, 5, 6),
    default_depth=5,
    label=lambda o: o.tree_label('eagle3'),
    help='an EAGLE-3 head (SpecForge / vLLM or speculators checkpoint) over tapped target features; chains, '
    'or EAGLE-2 trees with --tree-tokens',
)
