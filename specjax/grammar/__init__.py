"""Constrained decoding: llguidance grammars, exact under speculation.

`compile` turns a request's constraint into a validated grammar, `rows` keeps
each row's matcher on the host and decides a step's masks, cuts and forced
drafts, `bitmask` applies them inside the jitted step.
"""

from specjax.grammar.bitmask import GrammarInputs, mask_law, mask_logits
from specjax.grammar.compile import compile_constraint, llg_tokenizer, new_matcher
from specjax.grammar.rows import RowGrammars

__all__ = [
    'GrammarInputs',
    'RowGrammars',
    'compile_constraint',
    'llg_tokenizer',
    'mask_law',
    'mask_logits',
    'new_matcher',
]
