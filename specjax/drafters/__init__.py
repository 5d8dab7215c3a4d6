"""Drafter families behind one interface (`base.Drafter`), named in one registry (`registry`)."""

from __future__ import annotations

from specjax.drafters import dflash, draft_model, eagle3, gemma4_assistant, grammar_first, layer_skip, mtp, ngram, ngram_first
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.drafters.dflash import DFlashDrafter
from specjax.drafters.draft_model import DraftModelDrafter, check_compatible
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.gemma4_assistant import Gemma4AssistantDrafter
from specjax.drafters.grammar_first import GrammarFirstDrafter
from specjax.drafters.layer_skip import LayerSkipDrafter
from specjax.drafters.mtp import MTPDrafter, check_mtp_target
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.ngram_first import NgramFirstDrafter
from specjax.drafters.registry import REGISTRY, DrafterFamily, get, make_drafter, names, register

# One line per family.
register(ngram.FAMILY)
register(draft_model.FAMILY)
register(layer_skip.FAMILY)
register(mtp.FAMILY)
register(eagle3.FAMILY)
register(dflash.FAMILY)
register(gemma4_assistant.FAMILY)
# n-gram lookup first, each of the others where it finds nothing: ngram+eagle3, ngram+dflash, ...
_BASE = list(REGISTRY.values())
for _family in [f for f in _BASE if f.name != 'ngram']:
  register(ngram_first.ngram_first_family(_family))
# Grammar-forced tokens on constrained requests: grammar (alone), grammar+ngram, grammar+eagle3, ...
register(grammar_first.FAMILY)
for _family in _BASE:
  register(grammar_first.grammar_first_family(_family))

__all__ = [
    'BatchPlan',
    'DraftContext',
    'Drafter',
    'DFlashDrafter',
    'DrafterFamily',
    'DraftModelDrafter',
    'Eagle3Drafter',
    'Gemma4AssistantDrafter',
    'GrammarFirstDrafter',
    'LayerSkipDrafter',
    'MTPDrafter',
    'NgramDrafter',
    'NgramFirstDrafter',
    'Proposal',
    'REGISTRY',
    'check_compatible',
    'check_mtp_target',
    'get',
    'make_drafter',
    'names',
    'register',
]
