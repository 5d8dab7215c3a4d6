"""GGUF `llama` / `qwen3` loading: tiny HF checkpoints written as convert_hf_to_gguf would."""

import json
import math

import gguf
import numpy as np
import pytest
import tokenizers
from gguf.constants import GGMLQuantizationType as Q
from test_gguf import DECODERS, encode_tensor, spm_vocab

from specjax.errors import SpecjaxError
from specjax.loading import gguf as gguf_loader

# HF tokenizer.json Split regexes (meta-llama/Meta-Llama-3-8B, Qwen/Qwen3-*).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r'|\s*[\r\n]+|\s+(?!\S)|\s+'
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r'|\s*[\r\n]+|\s+(?!\S)|\s+'
)
NORMAL, CONTROL, USER, UNUSED = 1, 3, 4, 5

SHAPES = {  # hidden, layers, heads, kv_heads, head_dim, ffn
    'llama': (128, 2, 4, 2, 32, 256),
    'qwen3': (64, 2, 4, 2, 32, 256),  # head_dim != hidden / heads: key_length is read
}
SPECIALS = {  # (content, special) appended after the BPE vocabulary, as HF added_tokens
    'llama': [
        ('<|begin_of_text|>', True),
        ('<|end_of_text|>', True),
        ('<|start_header_id|>', True),
        ('<|end_header_id|>', True),
        ('<|eot_id|>', True),
    ],
    'qwen3': [
        ('<|endoftext|>', True),
        ('<|im_start|>', True),
        ('<|im_end|>', True),
        ('<think>', False),
        ('</think>', False),
    ],
}
PAD_ROWS = {'llama': 0, 'qwen3': 3}  # qwen3: config vocab_size past the tokenizer ([PADn], UNUSED)
MERGE_WORDS = [
    ' hello',
    'hello',
    ' world',
    "'s",
    ' the',
    ' here',
    '123',
    ' 12',
    'café',
    ' naïve',
    '日本',
    '\n\n',
    '  ',
    ' he',
    'HE',
]
WHOLE_WORDS = [' goodbye']  # in the vocabulary, not reachable by merges (Llama 3's ignore_merges matters)
TEXTS = [
    'hello world',
    ' hello  world\n\n',
    "he's here, the 123 12345",
    "HELLO'S wOrld",
    'cafe\u0301 naïve 日本語',
    ' goodbye goodbye',
    '🦙 llama',
    'tab\there  \n x',
    '',
    ' ',
]
SPECIAL_TEXTS = {
    'llama': ['<|begin_of_text|>hi<|eot_id|>', '<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>'],
    'qwen3': ['<|im_start|>user\nhello<|im_end|>\n', '<think>\nok</think>\n\n<|endoftext|>'],
}


def bytes_to_unicode():
  """GPT-2's byte -> printable character table."""
  bs = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


BYTE_CHARS = bytes_to_unicode()


def byte_level(text):
  return ''.join(BYTE_CHARS[b] for b in text.encode('utf-8'))


def bpe_vocab():
  """(vocab, merges): the 256 byte characters, left-to-right merges of MERGE_WORDS, WHOLE_WORDS."""
  vocab = {BYTE_CHARS[b]: i for i, b in enumerate(sorted(BYTE_CHARS))}
  merges = []
  for word in MERGE_WORDS:
    chars = byte_level(word)
    left = chars[0]
    for c in chars[1:]:
      if left + c not in vocab:
        merges.append((left, c))
        vocab[left + c] = len(vocab)
      left += c
  for word in WHOLE_WORDS:
    vocab.setdefault(byte_level(word), len(vocab))
  return vocab, merges


def reference_tokenizer(arch):
  """What the model's HF tokenizer.json says, loaded by `tokenizers` itself."""
  vocab, merges = bpe_vocab()
  added = [
      {
          'id': len(vocab) + i,
          'content': t,
          'single_word': False,
          'lstrip': False,
          'rstrip': False,
          'normalized': False,
          'special': special,
      }
      for i, (t, special) in enumerate(SPECIALS[arch])
  ]
  llama = arch == 'llama'
  byte_level_json = {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': llama, 'use_regex': False}
  if llama:  # Meta-Llama-3: ByteLevel, then <|begin_of_text|> $A
    bos = added[0]['content']
    post = {
        'type': 'Sequence',
        'processors': [
            {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': False, 'use_regex': True},
            {
                'type': 'TemplateProcessing',
                'single': [{'SpecialToken': {'id': bos, 'type_id': 0}}, {'Sequence': {'id': 'A', 'type_id': 0}}],
                'pair': [
                    {'SpecialToken': {'id': bos, 'type_id': 0}},
                    {'Sequence': {'id': 'A', 'type_id': 0}},
                    {'SpecialToken': {'id': bos, 'type_id': 1}},
                    {'Sequence': {'id': 'B', 'type_id': 1}},
                ],
                'special_tokens': {bos: {'id': bos, 'ids': [added[0]['id']], 'tokens': [bos]}},
            },
        ],
    }
  else:  # Qwen3: ByteLevel only, no BOS
    post = {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': False, 'use_regex': False}
  doc = {
      'version': '1.0',
      'truncation': None,
      'padding': None,
      'added_tokens': added,
      'normalizer': None if llama else {'type': 'NFC'},
      'pre_tokenizer': {
          'type': 'Sequence',
          'pretokenizers': [
              {
                  'type': 'Split',
                  'pattern': {'Regex': LLAMA3_REGEX if llama else QWEN2_REGEX},
                  'behavior': 'Isolated',
                  'invert': False,
              },
              byte_level_json,
          ],
      },
      'post_processor': post,
      'decoder': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
      'model': {
          'type': 'BPE',
          'dropout': None,
          'unk_token': None,
          'continuing_subword_prefix': None,
          'end_of_word_suffix': None,
          'fuse_unk': False,
          'byte_fallback': False,
          'ignore_merges': llama,
          'vocab': vocab,
          'merges': [list(m) for m in merges],
      },
  }
  return tokenizers.Tokenizer.from_str(json.dumps(doc))


def gguf_vocab(arch):
  """(tokens, token types, merges) as convert_hf_to_gguf's `get_vocab_base` / SpecialVocab write them."""
  vocab, merges = bpe_vocab()
  tokens, types = list(vocab), [NORMAL] * len(vocab)
  for content, special in SPECIALS[arch]:
    looks_special = content.startswith('<|') and content.endswith('|>')
    tokens.append(content)
    types.append(CONTROL if special or looks_special else USER)
  for _ in range(PAD_ROWS[arch]):
    tokens.append(f'[PAD{len(tokens)}]')
    types.append(UNUSED)
  return tokens, types, [f'{a} {b}' for a, b in merges]


def special_id(arch, content):
  return len(bpe_vocab()[0]) + [t for t, _ in SPECIALS[arch]].index(content)


def hf_checkpoint(arch, *, seed=0, tied=False, vocab=None):
  """Random HF-layout weights, float16-representable (so F16 storage is exact)."""
  hidden, layers, heads, kv_heads, head_dim, ffn = SHAPES[arch]
  vocab = vocab or len(gguf_vocab(arch)[0])
  rng = np.random.default_rng(seed)

  def w(*shape, scale=0.5, offset=0.0):
    return (offset + rng.normal(0.0, scale, shape)).astype(np.float16).astype(np.float32)

  tensors = {'model.embed_tokens.weight': w(vocab, hidden), 'model.norm.weight': w(hidden, scale=0.1, offset=1.0)}
  if not tied:
    tensors['lm_head.weight'] = w(vocab, hidden)
  for i in range(layers):
    p = f'model.layers.{i}.'
    tensors |= {
        p + 'input_layernorm.weight': w(hidden, scale=0.1, offset=1.0),
        p + 'self_attn.q_proj.weight': w(heads * head_dim, hidden),
        p + 'self_attn.k_proj.weight': w(kv_heads * head_dim, hidden),
        p + 'self_attn.v_proj.weight': w(kv_heads * head_dim, hidden),
        p + 'self_attn.o_proj.weight': w(hidden, heads * head_dim),
        p + 'post_attention_layernorm.weight': w(hidden, scale=0.1, offset=1.0),
        p + 'mlp.gate_proj.weight': w(ffn, hidden),
        p + 'mlp.up_proj.weight': w(ffn, hidden),
        p + 'mlp.down_proj.weight': w(hidden, ffn),
    }
    if arch == 'qwen3':
      tensors[p + 'self_attn.q_norm.weight'] = w(head_dim, scale=0.1, offset=1.0)
      tensors[p + 'self_attn.k_norm.weight'] = w(head_dim, scale=0.1, offset=1.0)
  return tensors


def converter_permute(weights, n_head, n_head_kv):
  """`LlamaModel.permute` of convert_hf_to_gguf, in numpy."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (
      weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
      .swapaxes(1, 2)
      .reshape(weights.shape)
  )


def converter_rope_factors(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len=8192):
  """`LlamaModel.generate_extra_tensors` (rope_freqs) of convert_hf_to_gguf: float32 freqs, Python loop."""
  freqs = np.float32(1.0) / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  factors = []
  for freq in freqs:
    wavelen = np.float32(2 * math.pi) / freq
    if wavelen < high_freq_wavelen:
      factors.append(1)
    elif wavelen > low_freq_wavelen:
      factors.append(factor)
    else:
      smooth = (np.float32(old_context_len) / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      factors.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(factors, np.float32)


def hf_llama3_factors(base, dim, scaling):
  """transformers' `_compute_llama3_parameters` factors (inv_freq / inv_freq_llama), float64."""
  inv_freq = 1.0 / base ** (np.arange(0, dim, 2) / dim)
  factor, low, high = scaling['factor'], scaling['low_freq_factor'], scaling['high_freq_factor']
  old = scaling['original_max_position_embeddings']
  wavelen = 2 * math.pi / inv_freq
  smooth = (old / wavelen - low) / (high - low)
  scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
  mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = np.where((wavelen >= old / high) & (wavelen <= old / low), mid, scaled)
  return inv_freq / scaled


# HF name -> storage type (the rest: F32 for 1-D, F16 otherwise). Q8_0 on a permuted Q, Q4_K random blocks.
TYPES = {
    'model.embed_tokens.weight': Q.F16,
    'lm_head.weight': Q.F32,
    'model.layers.0.self_attn.q_proj.weight': Q.Q8_0,
    'model.layers.0.self_attn.k_proj.weight': Q.F32,
    'model.layers.1.self_attn.q_proj.weight': Q.F32,
    'model.layers.1.mlp.down_proj.weight': Q.Q4_K,
}


def write_dense_gguf(
    path,
    arch,
    *,
    tied=False,
    seed=0,
    rope=None,
    rope_factors=None,
    name=None,
    extra_kv=None,
    drop=(),
    add=None,
    types=None,
    spm=False,
    pre=None,
    rope_dim=None,
):
  """Converts `hf_checkpoint(arch)` like convert_hf_to_gguf; returns {HF name: expected float32 values}.

  `rope`: (factor, low_freq_factor, high_freq_factor) of a Llama 3 `rope_scaling` (-> `rope_freqs.weight`);
  `rope_factors`: raw factors to store instead. `spm`: a SentencePiece (`llama`) vocabulary, as Mistral's.
  """
  hidden, layers, heads, kv_heads, head_dim, ffn = SHAPES[arch]
  if spm:
    tokens, scores, token_types = spm_vocab()
  else:
    tokens, token_types, merges = gguf_vocab(arch)
  hf = hf_checkpoint(arch, seed=seed, tied=tied, vocab=len(tokens))
  types = TYPES | (types or {})
  rng = np.random.default_rng(seed + 1)
  tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == 'llama' else gguf.MODEL_ARCH.QWEN3, layers)

  w = gguf.GGUFWriter(str(path), arch)
  w.add_name(name or {'llama': 'Llama 3.1 8B Instruct', 'qwen3': 'Qwen3 0.6B'}[arch])
  w.add_block_count(layers)
  w.add_context_length(131072 if arch == 'llama' else 40960)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv_heads)
  w.add_rope_freq_base(500000.0 if arch == 'llama' else 1000000.0)
  w.add_layer_norm_rms_eps(1e-5 if arch == 'llama' else 1e-6)
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  if arch == 'llama':
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(rope_dim or head_dim)
  if spm:  # _set_vocab_sentencepiece
    w.add_tokenizer_model('llama')
    w.add_tokenizer_pre('default')
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
  else:  # _set_vocab_gpt2
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre(pre or ('llama-bpe' if arch == 'llama' else 'qwen2'))
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    if arch == 'llama':
      w.add_bos_token_id(special_id(arch, '<|begin_of_text|>'))
      w.add_eos_token_id(special_id(arch, '<|eot_id|>'))
      w.add_add_bos_token(True)
    else:
      w.add_bos_token_id(special_id(arch, '<|endoftext|>'))
      w.add_eos_token_id(special_id(arch, '<|im_end|>'))
      w.add_pad_token_id(special_id(arch, '<|endoftext|>'))
      w.add_add_bos_token(False)
  for key, (kind, value) in (extra_kv or {}).items():
    getattr(w, f'add_{kind}')(key, value)

  if rope is not None:
    rope_factors = converter_rope_factors(500000.0, head_dim, *rope)
  if rope_factors is not None:  # generate_extra_tensors comes first
    w.add_tensor('rope_freqs.weight', np.asarray(rope_factors, np.float32))
  expected = {}
  for hf_name, values in hf.items():
    gguf_name = tensor_map.get_name(hf_name, try_suffixes=('.weight',))
    if gguf_name.removesuffix('.weight') in drop:
      continue
    stored = values
    if arch == 'llama' and hf_name.endswith('q_proj.weight'):
      stored = converter_permute(values, heads, heads)
    elif arch == 'llama' and hf_name.endswith('k_proj.weight'):
      stored = converter_permute(values, heads, kv_heads)
    qtype = types.get(hf_name, Q.F32 if values.ndim == 1 else Q.F16)
    if qtype == Q.Q8_0:  # row-wise blocks: quantizing commutes with the row permutation
      type_size = gguf.GGML_QUANT_SIZES[qtype][1]
      expected[hf_name] = DECODERS[qtype](gguf.quants.quantize(values, qtype).reshape(-1, type_size))
      expected[hf_name] = expected[hf_name].reshape(values.shape)
      w.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    elif qtype == Q.Q4_K:  # random valid blocks (not for permuted tensors)
      blocks, expected[hf_name], _ = encode_tensor(rng, qtype, values.shape)
      w.add_tensor(gguf_name, blocks, raw_dtype=qtype)
    elif qtype == Q.Q2_K:  # unsupported by the loader: raw random bytes
      block, type_size = gguf.GGML_QUANT_SIZES[qtype]
      raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block * type_size), dtype=np.uint8)
      w.add_tensor(gguf_name, raw, raw_dtype=qtype)
    else:
      expected[hf_name] = values
      w.add_tensor(gguf_name, stored.astype(np.float16 if qtype == Q.F16 else np.float32))
  for gguf_name, shape in (add or {}).items():
    w.add_tensor(f'{gguf_name}.weight', np.zeros(shape, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expected


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  path = tmp_path_factory.mktemp('dense') / 'llama.gguf'
  expected = write_dense_gguf(path, 'llama', rope=(8.0, 1.0, 4.0))
  return expected, gguf_loader.load_gguf(str(path))


@pytest.fixture(scope='module')
def qwen3(tmp_path_factory):
  path = tmp_path_factory.mktemp('dense') / 'qwen3.gguf'
  expected = write_dense_gguf(path, 'qwen3', tied=True)
  return expected, gguf_loader.load_gguf(str(path))


def test_llama_config(llama):
  _, ckpt = llama
  bos, eot = special_id('llama', '<|begin_of_text|>'), special_id('llama', '<|eot_id|>')
  assert ckpt.config == {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': len(gguf_vocab('llama')[0]),
      'hidden_size': 128,
      'intermediate_size': 256,
      'num_hidden_layers': 2,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 32,
      'hidden_act': 'silu',
      'rms_norm_eps': 1e-5,
      'rope_theta': 500000.0,
      'rope_scaling': {
          'rope_type': 'llama3',
          'factor': 8.0,
          'low_freq_factor': 1.0,
          'high_freq_factor': 4.0,
          'original_max_position_embeddings': 8192,
      },
      'rope_freq_factors': None,
      'max_position_embeddings': 131072,
      'attention_bias': False,
      'mlp_bias': False,
      'tie_word_embeddings': False,
      'bos_token_id': bos,
      'eos_token_id': eot,
      'pad_token_id': None,
  }
  assert (ckpt.generation.eos_token_ids, ckpt.generation.bos_token_id) == ((eot,), bos)


def test_qwen3_config(qwen3):
  _, ckpt = qwen3
  eos, pad = special_id('qwen3', '<|im_end|>'), special_id('qwen3', '<|endoftext|>')
  assert ckpt.config == {
      'architectures': ['Qwen3ForCausalLM'],
      'model_type': 'qwen3',
      'vocab_size': len(gguf_vocab('qwen3')[0]),
      'hidden_size': 64,
      'intermediate_size': 256,
      'num_hidden_layers': 2,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 32,
      'hidden_act': 'silu',
      'rms_norm_eps': 1e-6,
      'rope_theta': 1000000.0,
      'rope_scaling': None,
      'max_position_embeddings': 40960,
      'attention_bias': False,
      'tie_word_embeddings': True,
      'bos_token_id': pad,
      'eos_token_id': eos,
      'pad_token_id': pad,
  }
  assert ckpt.tokenizer.vocab_size == ckpt.config['vocab_size']  # [PADn] rows included
  assert (ckpt.generation.eos_token_ids, ckpt.generation.pad_token_id) == ((eos,), pad)


@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_tensors_equal_hf(arch, llama, qwen3):
  expected, ckpt = {'llama': llama, 'qwen3': qwen3}[arch]
  assert set(ckpt.tensors) == set(expected)
  for name, want in expected.items():
    got = ckpt.tensors[name]
    assert got.dtype == np.float32 and got.flags.writeable, name
    np.testing.assert_array_equal(got, want, err_msg=name)  # F32 / F16 exact, quantized = decoder
  if arch == 'qwen3':
    assert 'lm_head.weight' not in ckpt.tensors  # tied
    assert 'model.layers.1.self_attn.k_norm.weight' in ckpt.tensors
  else:  # un-permuted Q8_0 Q is close to the HF original
    hf = hf_checkpoint('llama')
    name = 'model.layers.0.self_attn.q_proj.weight'
    np.testing.assert_allclose(ckpt.tensors[name], hf[name], atol=0.03)
    assert not np.array_equal(converter_permute(hf[name], 4, 4), hf[name])  # the permutation is not trivial


@pytest.mark.parametrize(
    'rope, want',
    [
        ((32.0, 1.0, 4.0), {'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0}),  # Llama 3.2
        ((16.0, 2.0, 8.0), None),  # equivalent parameters may be found: compare factors
    ],
)
def test_llama3_rope_recovered(tmp_path, rope, want):
  path = tmp_path / 'rope.gguf'
  write_dense_gguf(path, 'llama', rope=rope)
  config = gguf_loader.load_gguf(str(path)).config
  scaling = config['rope_scaling']
  assert scaling['rope_type'] == 'llama3' and config['rope_freq_factors'] is None
  if want is not None:
    assert scaling == {'rope_type': 'llama3', **want, 'original_max_position_embeddings': 8192}
  head_dim = config['head_dim']
  np.testing.assert_allclose(
      hf_llama3_factors(500000.0, head_dim, scaling), converter_rope_factors(500000.0, head_dim, *rope), rtol=1e-6
  )


def test_rope_freq_factors_carried(tmp_path):
  path = tmp_path / 'freqs.gguf'
  factors = np.linspace(1.0, 3.0, SHAPES['llama'][4] // 2).astype(np.float32)
  write_dense_gguf(path, 'llama', rope_factors=factors)
  config = gguf_loader.load_gguf(str(path)).config
  assert config['rope_scaling'] is None
  np.testing.assert_array_equal(np.array(config['rope_freq_factors'], np.float32), factors)
  write_dense_gguf(path, 'llama', rope_factors=np.ones(16, np.float32))  # all ones: nothing to apply
  config = gguf_loader.load_gguf(str(path)).config
  assert (config['rope_scaling'], config['rope_freq_factors']) == (None, None)


@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_tokenizer_matches_hf(arch, llama, qwen3):
  tok = {'llama': llama, 'qwen3': qwen3}[arch][1].tokenizer
  ref = reference_tokenizer(arch)
  assert tok.vocab_size == len(gguf_vocab(arch)[0])
  for text in TEXTS + SPECIAL_TEXTS[arch]:
    want = ref.encode(text)
    assert tok.encode(text) == want.ids, text
    assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids, text
    assert tok.decode(want.ids, skip_special_tokens=False) == ref.decode(want.ids, skip_special_tokens=False)
    assert tok.decode(want.ids) == ref.decode(want.ids)
  if arch == 'llama':
    assert tok.encode('hi')[0] == special_id(arch, '<|begin_of_text|>')
    assert len(tok.encode(' goodbye', add_bos=False)) == 1  # ignore_merges: a whole in-vocabulary word
  else:
    assert tok.encode('cafe\u0301') == tok.encode('café')  # NFC
    assert tok.encode('<think>', add_bos=False) == [special_id(arch, '<think>')]
    assert tok.decode(tok.encode('<think>hi')) == '<think>hi'  # user-defined: not special


def test_mistral(tmp_path):
  path = tmp_path / 'mistral.gguf'
  write_dense_gguf(path, 'llama', name='Mistral 7B Instruct v0.3')
  config = gguf_loader.load_gguf(str(path)).config
  assert (config['model_type'], config['architectures'], config['sliding_window']) == (
      'mistral',
      ['MistralForCausalLM'],
      None,
  )
  assert config['rope_scaling'] is None and config['rope_freq_factors'] is None
  write_dense_gguf(path, 'llama', name='some finetune', extra_kv={'llama.attention.sliding_window': ('uint32', 4096)})
  assert gguf_loader.load_gguf(str(path)).config['sliding_window'] == 4096


def test_mistral_sentencepiece_tokenizer(tmp_path):
  """Mistral files carry a `llama` (SentencePiece) tokenizer: Metaspace "▁" prefix, BOS added."""
  path = tmp_path / 'mistral_spm.gguf'
  write_dense_gguf(path, 'llama', name='Mistral 7B v0.1', spm=True)
  ckpt = gguf_loader.load_gguf(str(path))
  assert ckpt.config['model_type'] == 'mistral'
  assert ckpt.config['vocab_size'] == ckpt.tokenizer.vocab_size == len(spm_vocab()[0])
  tokens = spm_vocab()[0]
  ids = ckpt.tokenizer.encode('hello world')
  assert ids[0] == 2 and ckpt.tokenizer.decode(ids) == 'hello world'
  assert [tokens[i] for i in ids[1:]] == ['▁', 'hello', '▁world']  # Gemma would give no '▁' first


def test_rope_scaling_metadata(tmp_path):
  path = tmp_path / 'yarn.gguf'
  write_dense_gguf(
      path,
      'qwen3',
      tied=True,
      extra_kv={
          'qwen3.rope.scaling.type': ('string', 'yarn'),
          'qwen3.rope.scaling.factor': ('float32', 4.0),
          'qwen3.rope.scaling.original_context_length': ('uint32', 32768),
      },
  )
  assert gguf_loader.load_gguf(str(path)).config['rope_scaling'] == {
      'rope_type': 'yarn',
      'factor': 4.0,
      'original_max_position_embeddings': 32768,
  }
  write_dense_gguf(
      path,
      'llama',
      extra_kv={'llama.rope.scaling.type': ('string', 'linear'), 'llama.rope.scaling.factor': ('float32', 2.0)},
  )
  assert gguf_loader.load_gguf(str(path)).config['rope_scaling'] == {'rope_type': 'linear', 'factor': 2.0}
  write_dense_gguf(path, 'llama', extra_kv={'llama.rope.scaling.type': ('string', 'longrope')})
  with pytest.raises(SpecjaxError, match="rope.scaling.type 'longrope'"):
    gguf_loader.load_gguf(str(path))


def test_errors(tmp_path, monkeypatch):
  path = tmp_path / 'bad.gguf'
  write_dense_gguf(path, 'llama', drop=('blk.1.ffn_up',))
  with pytest.raises(SpecjaxError, match=r'llama GGUF file lacks 1 tensor.*blk\.1\.ffn_up'):
    gguf_loader.load_gguf(str(path))
  write_dense_gguf(path, 'llama', add={'blk.0.attn_q_norm': (32,)})  # a qwen3 tensor
  with pytest.raises(SpecjaxError, match=r'unexpected tensor blk\.0\.attn_q_norm\.weight in a llama GGUF'):
    gguf_loader.load_gguf(str(path))
  write_dense_gguf(path, 'qwen3', add={'rope_freqs': (16,)})
  with pytest.raises(SpecjaxError, match=r'unexpected tensor rope_freqs\.weight in a qwen3 GGUF'):
    gguf_loader.load_gguf(str(path))
  write_dense_gguf(path, 'llama', rope_dim=16)
  with pytest.raises(SpecjaxError, match='rope.dimension_count = 16 differs from head_dim 32'):
    gguf_loader.load_gguf(str(path))
  write_dense_gguf(path, 'llama', pre='tekken')
  with pytest.raises(SpecjaxError, match="pre = 'tekken'.*supported: llama-bpe, llama3, llama-v3, qwen2"):
    gguf_loader.load_gguf(str(path))

  write_dense_gguf(path, 'qwen3', types={'model.layers.1.mlp.down_proj.weight': Q.Q2_K})

  def no_dequantize(*args):
    raise AssertionError('dequantized before validating')

  monkeypatch.setattr(gguf_loader, '_dequantize', no_dequantize)
  with pytest.raises(SpecjaxError, match=r'blk\.1\.ffn_down\.weight.*Q2_K'):
    gguf_loader.load_gguf(str(path))


@pytest.mark.parametrize('arch', ['llama', 'qwen3'])
def test_byte_level_stream_matches_decode(arch, llama, qwen3):
  """Byte-level pieces split UTF-8 characters ('🦙' is 4 pieces): streaming holds them back."""
  tok = {'llama': llama, 'qwen3': qwen3}[arch][1].tokenizer
  rng = np.random.default_rng(0)
  sequences = [tok.encode(t) for t in TEXTS + SPECIAL_TEXTS[arch]]
  sequences += [rng.integers(0, tok.vocab_size, 12).tolist() for _ in range(50)]
  for ids in sequences:
    for skip in (True, False):
      stream = tok.stream(skip_special_tokens=skip)
      pieces = [stream.step(i) for i in ids] + [stream.flush()]
      assert ''.join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids
      assert '\ufffd' not in ''.join(pieces[:-1]) or '\ufffd' in tok.decode(ids, skip)
