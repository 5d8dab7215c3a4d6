"""Built-in multi-token prediction (Qwen3.5 / Qwen3-Next `mtp.*`): drafts from the target's own head.

The MTP head pairs the target's final hidden state h_t with the embedding of
the next token x_{t+1} and predicts x_{t+2}, sharing the target's embeddings
and LM head. Its weights are its own pytree (`model.heads['mtp']`, loaded with
`specjax.load(..., mtp=True)`), apart from the target's params. Its cache,
pending pairs, chains and trees are `head.HeadDrafter`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from specjax.drafters.head import HeadDrafter, TreeOptions, check_tree_target
from specjax.drafters.registry import DrafterFamily, checkpoint_option, quant_option, quantize_head
from specjax.errors import SpecjaxError


def check_mtp_target(target) -> None:
  """The target must have been loaded with its MTP head (`specjax.load(..., mtp=True)` / `--mtp`)."""
  if 'mtp' not in target.heads:
    raise SpecjaxError(
        f'{target.source}: the MTP drafter needs the model loaded with its MTP head '
        '(specjax.load(path, mtp=True), or --mtp on the command line)'
    )


@dataclasses.dataclass(frozen=True, eq=False)
class MTPDrafter(HeadDrafter):
  graphdef: nnx.GraphDef = None  # the MTPHead module
  head_params: Any = None  # its weights
  name: str = 'mtp'
  reads_hidden: bool = True

  def params(self):
    return self.head_params

  def features(self, params, hidden, taps):
    return hidden

  def run(self, params, target, tokens, features, cache, inputs):
    return nnx.merge(self.graphdef, params)(target.embed(tokens), features, cache, inputs)

  def draft_logits(self, params, target, out):
    return target.logits(out)

  def head_layout(self, params):
    return nnx.merge(self.graphdef, params).cache_layout()


@dataclasses.dataclass(frozen=True, eq=False)
class MTPOptions(TreeOptions):
  """The head: the checkpoint's built-in one, or a trained one (`specjax train`'s export); depth is the step's K."""

  draft_model: Any = checkpoint_option()
  draft_quant: str | None = quant_option()


def _build(target, options: MTPOptions) -> MTPDrafter:
  if options.draft_model is not None:
    from specjax.loading.mtp_head import load_mtp_head

    graphdef, params = load_mtp_head(options.draft_model, target)
  else:
    graphdef, params = target.heads['mtp']
  params = quantize_head(target, params, options)
  return MTPDrafter(
      graphdef=graphdef, head_params=params, feature_size=target.config.hidden_size, **options.tree_shape()
  )


def _check(target, options: MTPOptions) -> None:
  check_tree_target(target, options)
  if options.draft_model is None:
    check_mtp_target(target)


FAMILY = DrafterFamily(
    name='mtp',
    options=MTPOptions,
    build=_build,
    check=_check,
    label=lambda o: o.tree_label('mtp'),
    depths=(2, 3, 4, 6),
    default_depth=3,
    target_heads=lambda o: () if o.draft_model is not None else ('mtp',),
    help="an MTP head: the checkpoint's built-in one (Qwen3.5 / Qwen3-Next mtp.*) or --draft-model DIR (trained)",
)
