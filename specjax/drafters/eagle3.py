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

from specjax import trees
from specjax.drafters.head import HeadDrafter
from specjax.drafters.registry import DrafterFamily, checkpoint_option, option
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
class Eagle3Options:
  draft_model: Any = checkpoint_option()
  tree_topk: int | None = option(
      None, '--tree-topk', type=int, help='eagle3: children per expanded node of an EAGLE-2 draft tree (default 4)'
  )
  tree_tokens: int = option(
      0,
      '--tree-tokens',
      type=int,
      help='eagle3: draft-tree nodes verified per step (0: a chain of --n-predict drafts); the tree is '
      '--n-predict deep',
  )

  tree_parents: Any = option(
      None,
      '--tree-parents',
      type=str,
      help='eagle3: a static draft tree, the parent of each node as a comma-separated list (0: the root, node i '
      'is i); nodes deeper than --n-predict are dropped',
  )

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter eagle3 needs --draft-model PATH (an EAGLE-3 checkpoint)')
    if self.tree_parents is not None and (self.tree_tokens or self.tree_topk is not None):
      raise SpecjaxError('--tree-parents gives a static tree; it cannot be combined with --tree-tokens / --tree-topk')
    self.parents()
    if self.tree_tokens < 0:
      raise SpecjaxError(f'--tree-tokens must be >= 0 (0: chains), got {self.tree_tokens}')
    if self.tree_topk is not None and not self.tree_tokens:
      raise SpecjaxError('--tree-topk shapes a draft tree: give --tree-tokens too')
    if self.tree_topk is not None and self.tree_topk < 1:
      raise SpecjaxError(f'--tree-topk must be at least 1, got {self.tree_topk}')

  def parents(self) -> tuple[int, ...]:
    """The static tree's parent list (node i + 1's parent; 0: the root), or ()."""
    if self.tree_parents is None:
      return ()
    entries = self.tree_parents
    if isinstance(entries, str):
      try:
        entries = [int(x) for x in entries.replace(' ', '').split(',') if x]
      except ValueError:
        raise SpecjaxError(f'--tree-parents must be comma-separated integers, got {self.tree_parents!r}') from None
    return tuple(int(p) for p in trees.static_tree([0, *entries])[1:])

  @property
  def topk(self) -> int:
    return 0 if not self.tree_tokens else (self.tree_topk or 4)


def _check(target, options: Eagle3Options) -> None:
  if (options.tree_tokens or options.tree_parents) and target.is_hybrid:
    raise SpecjaxError(
        f'{target.source}: draft trees need a target whose cache rolls back by position; this hybrid '
        '(recurrent-state) target verifies chains only (drop --tree-tokens)'
    )
  if not hasattr(target.module(), 'lookup'):
    raise SpecjaxError(f'{target.source}: EAGLE-3 needs a target with a token-embedding table')


def _build(target, options: Eagle3Options) -> Eagle3Drafter:
  from specjax.loading.eagle3 import Eagle3Checkpoint, load_eagle3

  ckpt = options.draft_model
  if not isinstance(ckpt, Eagle3Checkpoint):
    ckpt = load_eagle3(str(ckpt), target, dtype=target.dtype)
  cfg = ckpt.config
  target_ids = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) + jnp.asarray(ckpt.d2t, jnp.int32)
  return Eagle3Drafter(
      graphdef=ckpt.graphdef,
      head_params=ckpt.params,
      target_ids=target_ids,
      vocab_size=target.config.vocab_size,
      has_embedding=cfg.has_embedding,
      feature_size=cfg.hidden_size,
      taps=tuple(cfg.taps),
      tree_topk=options.topk,
      tree_tokens=len(options.parents()) or options.tree_tokens,
      tree_parents=options.parents(),
  )


def _label(options: Eagle3Options) -> str:
  if options.tree_parents is not None:
    return f'eagle3-tree(static {len(options.parents())})'
  return f'eagle3-tree({options.topk}x{options.tree_tokens})' if options.tree_tokens else 'eagle3'


FAMILY = DrafterFamily(
    name='eagle3',
    options=Eagle3Options,
    build=_build,
    check=_check,
    depths=(2, 3, 4, 5, 6),
    default_depth=5,
    label=_label,
    help='an EAGLE-3 head (SpecForge / vLLM or speculators checkpoint) over tapped target features; chains, '
    'or EAGLE-2 trees with --tree-tokens',
)
