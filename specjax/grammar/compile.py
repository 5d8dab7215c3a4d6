"""Constraints -> llguidance grammars, checked before any work, and the llguidance tokenizer of a model.

A request's constraint (`SamplingParams.constraint`) is a JSON Schema, a
regex, a Lark grammar (llguidance's dialect; a GBNF text is converted) or
"any JSON object". `compile_constraint` turns it into llguidance's grammar
text and validates it against the model's tokenizer, so a bad schema, regex
or grammar is one `SpecjaxError` naming the place, before prefill. Both the
tokenizer (~1-2 s for a 262k vocabulary) and compiled grammars are cached.
"""

from __future__ import annotations

import functools
import json

from specjax.errors import SpecjaxError

try:
  import llguidance
except ImportError:  # pragma: no cover (a dependency of the package)
  llguidance = None


def require_llguidance():
  if llguidance is None:
    raise SpecjaxError('constrained decoding needs llguidance: pip install llguidance')
  return llguidance


def llg_tokenizer(model):
  """llguidance's tokenizer for `model` (its HF tokenizer, the embedding's vocabulary, the EOS ids), cached."""
  eos = tuple(model.generation.eos_token_ids or model.tokenizer.eos_ids)
  if not eos:
    raise SpecjaxError(f'{model.source}: constrained decoding needs an EOS token, and the tokenizer has none')
  return tokenizer_for(model.tokenizer, model.config.vocab_size, eos)


def tokenizer_for(tokenizer, vocab: int, eos: tuple[int, ...]):
  """llguidance's tokenizer of a `specjax.loading.tokenizer.Tokenizer` with `vocab` ids (>= its own), cached."""
  key = tokenizer.fingerprint(), vocab, tuple(eos)
  cached = _TOKENIZERS.get(key)
  if cached is None:
    llg = require_llguidance()
    cached = _TOKENIZERS[key] = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=list(eos))
  return cached


_TOKENIZERS: dict = {}  # (vocabulary fingerprint, embedding size, EOS ids) -> LLTokenizer


def clear_tokenizers() -> None:
  """Empties the cache of llguidance tokenizers (a benchmark times a cold build)."""
  _TOKENIZERS.clear()


def _grammar_text(kind: str, source: str) -> str:
  llg = require_llguidance()
  if kind == 'json_schema':
    try:
      schema = json.loads(source)
    except ValueError as e:
      raise SpecjaxError(f'JSON schema is not valid JSON: {e}') from None
    if not isinstance(schema, (dict, bool)):
      raise SpecjaxError(f'a JSON schema is an object or a boolean, got {type(schema).__name__}')
    return llg.LLMatcher.grammar_from_json_schema(schema)
  if kind == 'regex':
    return llg.LLMatcher.grammar_from_regex(source)
  if kind == 'grammar':
    from llguidance.gbnf_to_lark import any_to_lark  # pylint: disable=g-import-not-at-top

    try:
      source = any_to_lark(source)  # GBNF (llama.cpp's) -> Lark; Lark as given
    except Exception as e:  # pylint: disable=broad-except (the converter raises plain errors)
      raise SpecjaxError(f'GBNF grammar: {e}') from None
    return llg.LLMatcher.grammar_from_lark(source)
  raise SpecjaxError(f'unknown constraint kind {kind!r}')


@functools.lru_cache(maxsize=256)
def _compile(kind: str, source: str, tokenizer) -> str:
  grammar = _grammar_text(kind, source)
  is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
  if is_error:
    label = {'json_schema': 'JSON schema', 'regex': 'regex', 'grammar': 'grammar'}[kind]
    raise SpecjaxError(f'{label}: {messages[0].strip()}')
  return grammar


def compile_constraint(model, constraint: tuple[str, str]) -> str:
  """llguidance's grammar text for `constraint` = (kind, source), validated for `model`'s tokenizer (cached)."""
  kind, source = constraint
  return _compile(kind, source, llg_tokenizer(model))


def new_matcher(model, grammar: str):
  """A fresh matcher of a compiled grammar (one per request)."""
  matcher = require_llguidance().LLMatcher(llg_tokenizer(model), grammar, log_level=0)
  if matcher.is_error():
    raise SpecjaxError(f'grammar: {matcher.get_error()}')
  return matcher
