"""Tokenizers from an HF `tokenizer.json` or from GGUF tokenizer metadata.

Both become a `tokenizers.Tokenizer` (the HF Rust library) that gives the same
ids as transformers 5.24's `AutoTokenizer`:

- HF directory: `tokenizer.json` as written; when `tokenizer_config.json` sets
  `add_bos_token`/`add_eos_token`, those flags rebuild the post-processor.
- GGUF, `tokenizer.ggml.model == "llama"` (SentencePiece): a byte-fallback BPE
  whose merges are rebuilt from the vocabulary, every piece split in two, best
  first. Gemma files (`gemma`, `gemma2`, `gemma3`) rank merges by vocabulary
  position, spell all-whitespace pieces with "▁", replace " " by "▁" in a
  normalizer and add no prefix space; other architectures rank merges by piece
  score and prepend "▁" to the first word (Metaspace). Control pieces
  (token_type 3) are special added tokens, user-defined pieces (4) plain added
  tokens, both matched whole in raw text. BOS/EOS adding follows
  `tokenizer.ggml.add_bos_token` (default true) / `add_eos_token`.
  One deliberate difference: transformers appends its class-default specials
  (`<s>`, `</s>` for Llama) when the vocabulary lacks them, giving ids past the
  embedding table; those are not added here. `tokenizer.ggml.add_space_prefix`
  is ignored, as transformers ignores it (Mistral's SentencePiece files take
  this path too: "▁" prefix, BOS per add_bos_token).
- GGUF, `tokenizer.ggml.model == "gemma4"` (Gemma 4: llama.cpp's converter
  copies tokenizer.json's vocabulary and merges, `LlamaHfVocab`): the same
  byte-fallback BPE as the Gemma SentencePiece files above, with the file's
  merges (split like "gpt2" ones, below) and pieces as stored.
- GGUF, `tokenizer.ggml.model == "gpt2"` (byte-level BPE: Llama 3, Qwen2/3):
  the BPE of the file's tokens and `tokenizer.ggml.merges` ("left right",
  split at the first space after the first character, as llama.cpp does),
  with the pre-tokenizer HF's tokenizer.json has for `tokenizer.ggml.pre`:
  `llama-bpe` (also `llama3`, `llama-v3`): the Llama 3 split regex, whole
  in-vocabulary words skip the merges (`ignore_merges`), BOS added unless
  add_bos_token says otherwise; `qwen2`: Qwen's regex (single digits), an NFC
  normalizer, no BOS by default. Both: a Split (Isolated) then ByteLevel (no
  prefix space, no regex), ByteLevel decoder. The regexes are the originals
  quoted in llama.cpp's `llm_tokenizer_bpe` (llama-vocab.cpp). Control tokens
  (type 3) are special added tokens, user-defined ones (4) plain added tokens.
  Other `pre` values raise. Transformers marks some type-3 tokens (those
  llama.cpp's converter promotes for looking like `<|...|>`) not special; here
  they are, which only changes `decode(skip_special_tokens=True)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from specjax.errors import SpecjaxError

_GEMMA_ARCHS = ('gemma', 'gemma2', 'gemma3')
_BYTE_PIECE = re.compile(r'<0x[0-9A-Fa-f]{2}>')
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@dataclasses.dataclass(frozen=True)
class _BytePre:
  """How HF's tokenizer.json pre-tokenizes for one `tokenizer.ggml.pre`."""

  split: str  # the Split regex (Isolated)
  nfc: bool  # NFC normalizer first
  ignore_merges: bool  # a whole word in the vocabulary is one token
  add_bos: bool  # llama.cpp's default when add_bos_token is absent


_LLAMA3_BPE = _BytePre(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+',
    nfc=False,
    ignore_merges=True,
    add_bos=True,
)
_QWEN2_BPE = _BytePre(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+',
    nfc=True,
    ignore_merges=False,
    add_bos=False,
)
_BYTE_PRE = {
    'llama-bpe': _LLAMA3_BPE,
    'llama3': _LLAMA3_BPE,
    'llama-v3': _LLAMA3_BPE,
    'qwen2': _QWEN2_BPE,
}


class Tokenizer:
  """Text <-> ids, with the BOS/EOS ids the model family expects."""

  def __init__(
      self,
      backend: tokenizers.Tokenizer,
      *,
      bos_id: int | None = None,
      eos_ids: Iterable[int] = (),
      vocab_size: int | None = None,
  ):
    self.backend = backend
    self._bos_id = bos_id
    self._eos_ids = tuple(int(i) for i in eos_ids)
    self._vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
    self._fingerprint: str | None = None
    self._special_ids: frozenset[int] | None = None

  @classmethod
  def from_file(
      cls,
      path: str,
      *,
      bos_id: int | None = None,
      eos_ids: Iterable[int] = (),
  ) -> Tokenizer:
    """Loads an HF `tokenizer.json` (and `tokenizer_config.json` beside it).

    `path` may also be the directory holding `tokenizer.json`.
    """
    if os.path.isdir(path):
      path = os.path.join(path, 'tokenizer.json')
    if not os.path.isfile(path):
      raise SpecjaxError(f'tokenizer file not found: {path}')
    try:
      backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises plain Exceptions
      raise SpecjaxError(f'cannot read tokenizer file {path}: {e}') from None
    config = _read_tokenizer_config(os.path.dirname(path))
    eos_ids = tuple(eos_ids)
    bos_token = _token_content(config.get('bos_token'))
    eos_token = _token_content(config.get('eos_token'))
    if bos_id is None and bos_token is not None:
      bos_id = backend.token_to_id(bos_token)
    if not eos_ids and eos_token is not None:
      eos_id = backend.token_to_id(eos_token)
      eos_ids = () if eos_id is None else (eos_id,)
    if 'add_bos_token' in config or 'add_eos_token' in config or backend.post_processor is None:
      backend.post_processor = _bos_eos_processor(
          backend,
          bos_token if config.get('add_bos_token', False) else None,
          eos_token if config.get('add_eos_token', False) else None,
      )
    return cls(backend, bos_id=bos_id, eos_ids=eos_ids)

  @classmethod
  def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
    """Rebuilds the tokenizer a GGUF file describes.

    `fields` maps GGUF metadata keys to plain values (strings, numbers, lists),
    as `specjax.loading.gguf.read_gguf_metadata` returns them.
    """
    kind = fields.get('tokenizer.ggml.model')
    if kind not in ('llama', 'gpt2', 'gemma4'):
      raise SpecjaxError(
          f'unsupported GGUF tokenizer model {kind!r}'
          ' (supported: "llama", i.e. SentencePiece; "gpt2", byte-level BPE; "gemma4", Gemma 4\'s BPE)'
      )
    tokens = list(fields.get('tokenizer.ggml.tokens') or ())
    if not tokens:
      raise SpecjaxError('GGUF metadata has no tokenizer.ggml.tokens')
    token_types = list(fields.get('tokenizer.ggml.token_type') or ())
    arch = fields.get('general.architecture')
    add_bos_default = True  # llama.cpp's default for SentencePiece
    if kind == 'gpt2':
      pre = fields.get('tokenizer.ggml.pre')
      if pre not in _BYTE_PRE:
        raise SpecjaxError(
            f'unsupported pre-tokenizer tokenizer.ggml.pre = {pre!r} for GGUF'
            f" tokenizer model 'gpt2' (supported: {', '.join(_BYTE_PRE)})"
        )
      backend, pieces = _byte_level_backend(tokens, fields.get('tokenizer.ggml.merges') or (), _BYTE_PRE[pre])
      default_specials = ()
      add_bos_default = _BYTE_PRE[pre].add_bos
    elif kind == 'gemma4' or arch in _GEMMA_ARCHS:
      merges = _merge_pairs(fields.get('tokenizer.ggml.merges') or ()) if kind == 'gemma4' else None
      backend, pieces = _gemma_backend(tokens, merges)
      default_specials = ('<bos>', '<eos>', '<unk>', '<pad>', '<mask>')
    else:
      scores = list(fields.get('tokenizer.ggml.scores') or ())
      if len(scores) != len(tokens):
        raise SpecjaxError(f'GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores')
      backend, pieces = _llama_backend(tokens, scores)
      default_specials = ('<unk>', '<s>', '</s>')

    def piece(key: str) -> str | None:
      token_id = fields.get(f'tokenizer.ggml.{key}')
      if token_id is None:
        return None
      if not 0 <= int(token_id) < len(tokens):
        raise SpecjaxError(f'GGUF tokenizer.ggml.{key} = {token_id} is outside the {len(tokens)}-token vocabulary')
      return tokens[int(token_id)]

    # Class defaults, control pieces and the file's named ids are special;
    # user-defined pieces are not. Pieces outside the vocabulary (a respelled
    # "  ", a missing default) are skipped rather than appended.
    vocab = set(pieces)
    named = [piece(k) for k in ('bos_token_id', 'eos_token_id', 'unknown_token_id', 'padding_token_id')]
    specials = [*default_specials, *named] + [t for t, k in zip(tokens, token_types) if k == _CONTROL]
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials) if t in vocab]
    )
    backend.add_tokens(
        [
            tokenizers.AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, token_types)
            if k == _USER_DEFINED and t in vocab
        ]
    )

    bos_token, eos_token = piece('bos_token_id'), piece('eos_token_id')
    add_bos = bool(fields.get('tokenizer.ggml.add_bos_token', add_bos_default))
    add_eos = bool(fields.get('tokenizer.ggml.add_eos_token', False))
    backend.post_processor = _bos_eos_processor(backend, bos_token if add_bos else None, eos_token if add_eos else None)
    bos_id = fields.get('tokenizer.ggml.bos_token_id')
    eos_id = fields.get('tokenizer.ggml.eos_token_id')
    return cls(
        backend,
        bos_id=None if bos_id is None else int(bos_id),
        eos_ids=() if eos_id is None else (int(eos_id),),
        vocab_size=len(tokens),
    )

  @property
  def vocab_size(self) -> int:
    """Number of ids (GGUF: the token count, even if two pieces coincide)."""
    return self._vocab_size

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return self._eos_ids

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Ids of `text`; `add_bos` adds what the post-processor adds (BOS)."""
    return self.backend.encode(text, add_special_tokens=add_bos).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def is_byte_token(self, token_id: int) -> bool:
    """Whether `token_id` is a byte-fallback piece `<0xNN>`."""
    piece = self.backend.id_to_token(int(token_id))
    return piece is not None and _BYTE_PIECE.fullmatch(piece) is not None

  def is_special_token(self, token_id: int) -> bool:
    """Whether `decode(..., skip_special_tokens=True)` drops `token_id`."""
    if self._special_ids is None:
      self._special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
    return int(token_id) in self._special_ids

  def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
    return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

  def fingerprint(self) -> str:
    """A short hash of the id -> piece table, equal iff vocabularies match."""
    if self._fingerprint is None:
      vocab = self.backend.get_vocab(with_added_tokens=True)
      pieces = sorted(vocab.items(), key=lambda kv: kv[1])
      blob = json.dumps(pieces, ensure_ascii=False).encode('utf-8')
      self._fingerprint = hashlib.sha256(blob).hexdigest()[:16]
    return self._fingerprint


class StreamDecoder:
  """Incremental detokenisation: `step(id)` returns the newly final text.

  Text is held back while the last token is a byte piece (or a skipped
  special token after one), or while the text decoded so far ends in U+FFFD
  (a byte-level BPE piece that splits a UTF-8 character), since the next may
  complete or invalidate a multi-byte character. Joining every `step` result
  and a final `flush()` gives exactly `decode(all ids)`.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip_special = skip_special_tokens
    self._ids: list[int] = []
    self._start = 0  # decode window start; ids[start:emitted] give `done`
    self._emitted = 0  # ids before this are emitted

  def step(self, token_id: int) -> str:
    self._ids.append(int(token_id))
    tok = self._tokenizer
    if tok.is_byte_token(token_id) or (self._skip_special and tok.is_special_token(token_id)):
      return ''
    return self._emit(hold_incomplete=True)

  def flush(self) -> str:
    """Emits whatever is held back (call once, when generation ends)."""
    return self._emit()

  def _decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(ids, self._skip_special)

  def _emit(self, hold_incomplete: bool = False) -> str:
    if self._emitted == len(self._ids):
      return ''
    # The window restarts at the last chunk only if that chunk has text of its
    # own, so a decoder that strips the first space (Llama) strips it inside
    # `done`, as a one-shot decode would.
    done = self._decode(self._ids[self._start : self._emitted])
    text = self._decode(self._ids[self._start :])
    if hold_incomplete and text.endswith('\ufffd'):
      return ''  # maybe a split character: emitting it would break `done`
    if self._decode(self._ids[self._emitted :]):
      self._start = self._emitted
    self._emitted = len(self._ids)
    return text[len(done) :]  # `done` is a prefix: decoders here concatenate


def _read_tokenizer_config(directory: str) -> dict[str, Any]:
  path = os.path.join(directory, 'tokenizer_config.json')
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise SpecjaxError(f'cannot read {path}: {e}') from None


def _token_content(token: Any) -> str | None:
  """A special token from `tokenizer_config.json`: a string or a dict."""
  if isinstance(token, dict):
    return token.get('content')
  return token


def _bos_eos_processor(
    backend: tokenizers.Tokenizer,
    bos_token: str | None,
    eos_token: str | None,
) -> processors.TemplateProcessing:
  """`[bos] $A [eos]` (pair: `... [bos] $B [eos]`), as transformers builds it."""
  bos = [bos_token] if bos_token is not None else []
  eos = [eos_token] if eos_token is not None else []
  single = [f'{t}:0' for t in bos] + ['$A:0'] + [f'{t}:0' for t in eos]
  pair = single + [f'{t}:1' for t in bos] + ['$B:1'] + [f'{t}:1' for t in eos]
  specials = []
  for token in bos + eos:
    token_id = backend.token_to_id(token)
    if token_id is None:
      raise SpecjaxError(f'special token {token!r} is not in the vocabulary')
    specials.append((token, token_id))
  return processors.TemplateProcessing(single=' '.join(single), pair=' '.join(pair), special_tokens=specials)


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """BPE merges implied by a SentencePiece vocabulary (as transformers does).

  Every split of a piece into two in-vocabulary pieces is a merge; merges are
  ranked by the merged piece's score (highest first), then by longer left
  part; ties keep vocabulary order. A duplicated piece keeps its first place
  and its last score.
  """
  known = set(tokens)
  score_of = dict(zip(tokens, scores))
  ranked = []  # (score, left, right), left longest first within a piece
  for merged, score in score_of.items():
    for k in range(len(merged) - 1, 0, -1):
      left = merged[:k]
      if left in known and (right := merged[k:]) in known:
        ranked.append((score, left, right))
  ordered = list(score_of.values())
  if any(a <= b for a, b in zip(ordered, ordered[1:])):
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
  return [(left, right) for _, left, right in ranked]


def _gemma_backend(
    tokens: Sequence[str],
    merges: list[tuple[str, str]] | None = None,
) -> tuple[tokenizers.Tokenizer, list[str]]:
  """Gemma's tokenizer as a byte-fallback BPE (no prefix space), transformers' `GemmaTokenizer`.

  `merges` (Gemma 4's `gemma4` files store them): the file's tokens and merges
  as they are. Without (SentencePiece files of Gemma 1-3): merges rebuilt from
  the vocabulary, and whitespace-only pieces respelled with "▁".
  """
  if merges is None:
    # GGUF stores runs of spaces as " " but the model pieces use "▁".
    pieces = ['\u2581' * len(t) if ' ' in t and not t.strip() else t for t in tokens]
    # Gemma's scores do not follow merge order; the vocabulary position does.
    merges = _spm_merges(pieces, [-i for i in range(len(pieces))])
  else:
    pieces = list(tokens)
  try:
    model = models.BPE(
        vocab={t: i for i, t in enumerate(pieces)},
        merges=merges,
        unk_token='<unk>',
        fuse_unk=True,
        byte_fallback=True,
    )
  except Exception as e:  # the Rust library raises plain Exceptions
    raise SpecjaxError(f'cannot build the GGUF BPE tokenizer: {e}') from None
  backend = tokenizers.Tokenizer(model)
  backend.normalizer = normalizers.Replace(' ', '\u2581')
  backend.pre_tokenizer = pre_tokenizers.Split(' ', behavior='merged_with_previous')
  backend.decoder = decoders.Sequence([decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse()])
  return backend, pieces


def _llama_backend(tokens: Sequence[str], scores: Sequence[float]) -> tuple[tokenizers.Tokenizer, list[str]]:
  """Llama-style SentencePiece: "▁" prepended to the first word."""
  backend = tokenizers.Tokenizer(
      models.BPE(
          vocab={t: i for i, t in enumerate(tokens)},
          merges=_spm_merges(tokens, scores),
          fuse_unk=True,
          byte_fallback=True,
      )
  )
  backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='first', split=False)
  backend.decoder = decoders.Sequence(
      [decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(' ', 1, 0)]
  )
  return backend, list(tokens)


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, str]]:
  """`tokenizer.ggml.merges` ("left right") as pairs, split as llama.cpp does."""
  pairs = []
  for merge in merges:
    split = merge.find(' ', 1)  # llama.cpp: a left part may start with " "
    if split < 0:
      raise SpecjaxError(f'malformed GGUF tokenizer merge {merge!r}')
    pairs.append((merge[:split], merge[split + 1 :]))
  if not pairs:
    raise SpecjaxError('GGUF metadata has no tokenizer.ggml.merges')
  return pairs


def _byte_level_backend(
    tokens: Sequence[str], merges: Sequence[str], pre: _BytePre
) -> tuple[tokenizers.Tokenizer, list[str]]:
  """GPT-2 style byte-level BPE (Llama 3, Qwen2/3), as HF's tokenizer.json."""
  pairs = _merge_pairs(merges)
  try:
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=pairs,
        ignore_merges=pre.ignore_merges,
        fuse_unk=False,
        byte_fallback=False,
    )
  except Exception as e:  # the Rust library raises plain Exceptions
    raise SpecjaxError(f'cannot build the GGUF BPE tokenizer: {e}') from None
  backend = tokenizers.Tokenizer(model)
  if pre.nfc:
    backend.normalizer = normalizers.NFC()
  backend.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(tokenizers.Regex(pre.split), behavior='isolated', invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
  )
  backend.decoder = decoders.ByteLevel()
  return backend, list(tokens)
