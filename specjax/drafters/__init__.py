"""Drafter families behind one interface (`base.Drafter`)."""

from __future__ import annotations

from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.drafters.draft_model import DraftModelDrafter, check_compatible
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.mtp import MTPDrafter, check_mtp_target
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import SpecjaxError

DRAFTERS = ('ngram', 'draft-model', 'layer-skip', 'mtp')


def make_drafter(kind: str, target, *, draft_model=None, ngram_min: int = 1, ngram_max: int = 3,
                 layers: int | None = None) -> Drafter:
  """Builds a drafter for `target` (a loaded Model), checking compatibility first."""
  if kind == 'ngram':
    return NgramDrafter(n_min=ngram_min, n_max=ngram_max)
  if kind == 'draft-model':
    if draft_model is None:
      raise SpecjaxError('--drafter draft-model needs --draft-model PATH')
    check_compatible(target, draft_model)
    if draft_model.is_hybrid:
      raise SpecjaxError(f'draft model {draft_model.source}: hybrid (recurrent-state) draft models are not supported '
                         'as independent drafters; use --mtp for their built-in head')
    return DraftModelDrafter(model=draft_model)
  if kind == 'mtp':
    check_mtp_target(target)
    return MTPDrafter(kv_shape=tuple(target.kv_shapes[0]), hidden_size=target.config.hidden_size)
  if kind == 'layer-skip':
    if target.is_hybrid:
      raise SpecjaxError(f'layer-skip drafting is not supported on hybrid targets ({target.architecture}): '
                         'its drafts would advance the recurrent state; use --mtp or --drafter ngram')
    total = target.config.num_layers
    layers = layers if layers is not None else max(1, total // 4)
    if not 1 <= layers < total:
      raise SpecjaxError(f'layer-skip needs 1 <= layers < {total} (the target\'s depth), got {layers}')
    return LayerSkipDrafter(num_layers=layers)
  raise SpecjaxError(f'unknown drafter {kind!r} (choose from {", ".join(DRAFTERS)})')


__all__ = ['BatchPlan', 'DraftContext', 'Drafter', 'DraftModelDrafter', 'LayerSkipDrafter', 'MTPDrafter', 'NgramDrafter',
           'Proposal', 'make_drafter', 'DRAFTERS']
