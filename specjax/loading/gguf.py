"""GGUF files (llama.cpp) -> `Checkpoint`; architecture `gemma3` today.

The header (metadata and tensor table) is parsed here from a memory map, which
reads the 262k-entry vocabulary about 50x faster than `gguf.GGUFReader`;
tensors are dequantized to float32 with `gguf.quants`, in PyTorch `[out, in]`
layout under their HF names.

Gemma 3 config, for what the file omits (llama.cpp hard-codes the same values
in its gemma3 loader; transformers 5.24 fills them in too):

- `rope_local_base_freq`: `gemma3.rope.freq_base_swa`, else 10000.
- `rope_theta`: `gemma3.rope.freq_base`, else 1e6.
- `sliding_window`: `gemma3.attention.sliding_window`, else 512.
- `sliding_window_pattern` / `layer_types`: `attention.sliding_window_pattern`
  (an int period or a per-layer bool list, true = sliding), else 6: every 6th
  layer (5, 11, 17, ...) uses full attention.
- `query_pre_attn_scalar`: `attention.key_length` (head_dim), except the 62-layer
  27B model, which uses hidden_size / num_heads (168), as llama.cpp does.
- `head_dim`: `attention.key_length`, else hidden_size / num_heads.
- `num_key_value_heads`: `attention.head_count_kv`, else num_heads.
- `final_logit_softcapping` / `attn_logit_softcapping`: the key, else None.
- `rope_scaling`: `rope.scaling.type` "linear" with its factor, else None.
- `tie_word_embeddings`: true unless an `output.weight` tensor is present.
- `hidden_activation`: "gelu_pytorch_tanh" (not stored).
- `vocab_size`: rows of `token_embd.weight`.
- Float keys are stored as float32; they are rounded to the shortest decimal
  that round-trips (9.99999997e-07 -> 1e-06).

Tensors: the converter stores every `*norm.weight` of gemma3 as `1 + w`; the
loader subtracts 1 so the model uses the HF `(1 + w)` RMSNorm form. No Q/K
permutation is applied (Gemma uses NeoX rope).

Generation: EOS ids are `tokenizer.ggml.eos_token_id` plus `eot_token_id` and
`eom_token_id` when present (transformers stops on the EOS id only; llama.cpp
also guesses end-of-turn tokens by name, which is not done here).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import struct
from typing import Any

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults
from specjax.loading.tokenizer import Tokenizer

_MAGIC = b'GGUF'
_DEFAULT_ALIGNMENT = 32
_SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q5_0', 'Q4_K', 'Q5_K',
                 'Q6_K'))

# GGUF metadata value types -> struct format (strings 8 and arrays 9 aside).
_SCALAR_FORMATS = {
    0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q',
    11: 'q', 12: 'd',
}
_STRING, _ARRAY = 8, 9

_GEMMA3_LAYER_NAMES = {
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
_GEMMA3_TOP_NAMES = {
    'token_embd': 'model.embed_tokens',
    'output_norm': 'model.norm',
    'output': 'lm_head',
}
_LAYER_TENSOR = re.compile(r'blk\.(\d+)\.(\w+)\.weight')


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  name: str
  shape: tuple[int, ...]  # numpy / PyTorch order (ggml `ne` reversed)
  qtype: int  # GGMLQuantizationType value
  start: int  # absolute byte offset in the file


class _GGUFFile:
  """A parsed GGUF header over a read-only memory map of the file."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise SpecjaxError(f'GGUF file not found: {path}')
    self.path = path
    with open(path, 'rb') as f:
      if os.fstat(f.fileno()).st_size < 24 or f.read(4) != _MAGIC:
        raise SpecjaxError(f'not a GGUF file (no "GGUF" magic): {path}')
      self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
      self._parse()
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
      raise SpecjaxError(
          f'corrupt or truncated GGUF header in {path}: {e}') from None

  def _parse(self) -> None:
    buf = self._map
    (version,) = struct.unpack_from('<I', buf, 4)
    if version not in (2, 3):
      order = 'big-endian ' if version > 0xFFFF else ''
      raise SpecjaxError(
          f'unsupported {order}GGUF version {version} in {self.path}'
          ' (supported: little-endian v2, v3)')
    n_tensors, n_kv = struct.unpack_from('<QQ', buf, 8)
    pos = 24
    self.metadata: dict[str, Any] = {}
    for _ in range(n_kv):
      key, pos = self._string(pos)
      (value_type,) = struct.unpack_from('<I', buf, pos)
      self.metadata[key], pos = self._value(value_type, pos + 4)

    raw_infos = []
    for _ in range(n_tensors):
      name, pos = self._string(pos)
      (n_dims,) = struct.unpack_from('<I', buf, pos)
      ne = struct.unpack_from(f'<{n_dims}Q', buf, pos + 4)
      qtype, offset = struct.unpack_from('<IQ', buf, pos + 4 + 8 * n_dims)
      pos += 4 + 8 * n_dims + 12
      raw_infos.append((name, tuple(reversed(ne)), qtype, offset))
    alignment = int(self.metadata.get('general.alignment', _DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    self.tensors = {
        name: _TensorInfo(name, shape, qtype, data_start + offset)
        for name, shape, qtype, offset in raw_infos
    }

  def _string(self, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from('<Q', self._map, pos)
    end = pos + 8 + n
    if end > len(self._map):
      raise IndexError('string runs past the end of the file')
    return str(self._map[pos + 8:end], 'utf-8'), end

  def _value(self, value_type: int, pos: int) -> tuple[Any, int]:
    if value_type == _STRING:
      return self._string(pos)
    if value_type == _ARRAY:
      item_type, count = struct.unpack_from('<IQ', self._map, pos)
      pos += 12
      if item_type in _SCALAR_FORMATS:
        fmt = '<' + _SCALAR_FORMATS[item_type]
        items = np.frombuffer(
            self._map, np.dtype(fmt), count=count, offset=pos).tolist()
        return items, pos + count * struct.calcsize(fmt)
      items = []
      for _ in range(count):
        item, pos = self._value(item_type, pos)
        items.append(item)
      return items, pos
    if value_type not in _SCALAR_FORMATS:
      raise ValueError(f'unknown metadata value type {value_type}')
    fmt = '<' + _SCALAR_FORMATS[value_type]
    (value,) = struct.unpack_from(fmt, self._map, pos)
    return value, pos + struct.calcsize(fmt)

  def raw(self, info: _TensorInfo) -> np.ndarray:
    """The stored bytes of a tensor, `[rows..., bytes_per_row]` uint8."""
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
    *rows, width = info.shape
    if width % block:
      raise SpecjaxError(
          f'GGUF tensor {info.name}: row length {width} is not a multiple of'
          f' the {GGMLQuantizationType(info.qtype).name} block size {block}')
    byte_shape = (*rows, width // block * block_bytes)
    nbytes = math.prod(byte_shape)
    if info.start + nbytes > len(self._map):
      raise SpecjaxError(
          f'GGUF file is truncated: tensor {info.name} ends past {self.path}')
    data = np.frombuffer(self._map, np.uint8, count=nbytes, offset=info.start)
    return data.reshape(byte_shape)


def read_gguf_metadata(path: str) -> dict[str, Any]:
  """All metadata of a GGUF file as plain Python values (no tensor data)."""
  return _GGUFFile(path).metadata


def load_gguf(path: str) -> Checkpoint:
  """Loads a GGUF checkpoint: config, float32 tensors, tokenizer, defaults."""
  gguf_file = _GGUFFile(path)
  meta = gguf_file.metadata
  arch = meta.get('general.architecture')
  if arch != 'gemma3':
    raise SpecjaxError(
        f'unsupported GGUF architecture {arch!r} in {path} (supported: gemma3)')

  # Everything is checked before any tensor is dequantized.
  for info in gguf_file.tensors.values():
    if info.qtype not in _SUPPORTED_TYPES:
      supported = ', '.join(t.name for t in sorted(_SUPPORTED_TYPES))
      raise SpecjaxError(
          f'GGUF tensor {info.name} has unsupported type'
          f' {_type_name(info.qtype)} (supported: {supported})')
  config = _gemma3_config(meta, gguf_file.tensors)
  hf_names = _gemma3_tensor_names(gguf_file.tensors, config)
  tokenizer = Tokenizer.from_gguf_fields(meta)

  tensors = {}
  for gguf_name, hf_name in hf_names.items():
    info = gguf_file.tensors[gguf_name]
    values = _dequantize(gguf_file.raw(info), info.qtype, info.shape)
    if gguf_name.endswith('norm.weight'):
      values -= 1.0  # stored as 1 + w
    tensors[hf_name] = values
  return Checkpoint(
      config=config,
      tensors=tensors,
      tokenizer=tokenizer,
      generation=_generation_defaults(meta),
      source=os.path.abspath(path),
  )


def _dequantize(
    raw: np.ndarray,  # [rows..., bytes_per_row] uint8
    qtype: int,
    shape: tuple[int, ...],
) -> np.ndarray:
  """Float32 values of a stored tensor, in a new array of `shape`.

  Rows go through `gguf.quants` in chunks of ~4M values: its own `dequantize`
  loops over 16-row groups, which is 4x slower on a 262k-row embedding.
  """
  qtype = GGMLQuantizationType(qtype)
  out = np.empty(shape, np.float32)
  width = shape[-1] if shape else 1
  rows, out_rows = raw.reshape(-1, raw.shape[-1]), out.reshape(-1, width)
  if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
    def decode(chunk):
      return quants.dequantize(chunk, qtype)
  else:
    decode = getattr(quants, qtype.name).dequantize_rows
  step = max(1, (1 << 22) // width)
  for start in range(0, rows.shape[0], step):
    out_rows[start:start + step] = decode(rows[start:start + step])
  return out


def _type_name(qtype: int) -> str:
  try:
    return GGMLQuantizationType(qtype).name
  except ValueError:
    return f'#{qtype}'


def _f32(value: float) -> float:
  """A float32 metadata value as the shortest decimal that round-trips."""
  return float(str(np.float32(value)))


def _gemma3_config(
    meta: dict[str, Any], tensors: dict[str, _TensorInfo]
) -> dict[str, Any]:
  """HF `Gemma3TextConfig` keys from `gemma3.*` metadata (defaults: above)."""

  def get(key: str, default: Any = None) -> Any:
    return meta.get(f'gemma3.{key}', default)

  def need(key: str) -> Any:
    if f'gemma3.{key}' not in meta:
      raise SpecjaxError(f'GGUF metadata lacks gemma3.{key}')
    return meta[f'gemma3.{key}']

  if 'token_embd.weight' not in tensors:
    raise SpecjaxError('GGUF file has no token_embd.weight tensor')
  hidden = int(need('embedding_length'))
  layers = int(need('block_count'))
  heads = int(need('attention.head_count'))
  head_dim = int(get('attention.key_length', hidden // heads))

  pattern = get('attention.sliding_window_pattern', 6)
  if isinstance(pattern, list):
    if len(pattern) != layers:
      raise SpecjaxError(
          f'gemma3.attention.sliding_window_pattern has {len(pattern)} entries'
          f' for {layers} layers')
    sliding = [bool(s) for s in pattern]
    pattern = next((i + 1 for i, s in enumerate(sliding) if not s), layers)
  else:
    pattern = int(pattern)
    sliding = [(i + 1) % pattern != 0 for i in range(layers)]

  rope_scaling = None
  if get('rope.scaling.type') == 'linear':
    rope_scaling = {
        'rope_type': 'linear', 'factor': _f32(get('rope.scaling.factor', 1.0))}
  final_softcap = get('final_logit_softcapping')
  attn_softcap = get('attn_logit_softcapping')

  return {
      'architectures': ['Gemma3ForCausalLM'],
      'model_type': 'gemma3_text',
      'vocab_size': tensors['token_embd.weight'].shape[0],
      'hidden_size': hidden,
      'intermediate_size': int(need('feed_forward_length')),
      'num_hidden_layers': layers,
      'num_attention_heads': heads,
      'num_key_value_heads': int(get('attention.head_count_kv', heads)),
      'head_dim': head_dim,
      'hidden_activation': 'gelu_pytorch_tanh',
      'rms_norm_eps': _f32(need('attention.layer_norm_rms_epsilon')),
      'rope_theta': _f32(get('rope.freq_base', 1_000_000.0)),
      'rope_local_base_freq': _f32(get('rope.freq_base_swa', 10_000.0)),
      'rope_scaling': rope_scaling,
      'sliding_window': int(get('attention.sliding_window', 512)),
      'sliding_window_pattern': pattern,
      'layer_types': [
          'sliding_attention' if s else 'full_attention' for s in sliding],
      'query_pre_attn_scalar': hidden // heads if layers == 62 else head_dim,
      'final_logit_softcapping': (
          None if final_softcap is None else _f32(final_softcap)),
      'attn_logit_softcapping': (
          None if attn_softcap is None else _f32(attn_softcap)),
      'max_position_embeddings': int(get('context_length', 32768)),
      'tie_word_embeddings': 'output.weight' not in tensors,
      'bos_token_id': meta.get('tokenizer.ggml.bos_token_id'),
      'eos_token_id': meta.get('tokenizer.ggml.eos_token_id'),
      'pad_token_id': meta.get('tokenizer.ggml.padding_token_id'),
  }


def _gemma3_tensor_names(
    tensors: dict[str, _TensorInfo], config: dict[str, Any]
) -> dict[str, str]:
  """GGUF name -> HF name for every tensor; unknown or missing ones raise."""
  layers = config['num_hidden_layers']
  names = {}
  for gguf_name in tensors:
    top = _GEMMA3_TOP_NAMES.get(gguf_name.removesuffix('.weight'))
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
      layer, part = int(m.group(1)), m.group(2)
      if layer < layers and part in _GEMMA3_LAYER_NAMES:
        names[gguf_name] = (
            f'model.layers.{layer}.{_GEMMA3_LAYER_NAMES[part]}.weight')
        continue
    elif top is not None and gguf_name.endswith('.weight'):
      names[gguf_name] = f'{top}.weight'
      continue
    raise SpecjaxError(f'unexpected tensor {gguf_name} in a gemma3 GGUF file')

  expected = {'token_embd.weight', 'output_norm.weight'} | {
      f'blk.{i}.{part}.weight'
      for i in range(layers) for part in _GEMMA3_LAYER_NAMES}
  if missing := sorted(expected - set(tensors)):
    raise SpecjaxError(
        f'gemma3 GGUF file lacks {len(missing)} tensor(s), e.g. {missing[0]}')
  return names


def _generation_defaults(meta: dict[str, Any]) -> GenerationDefaults:
  eos_ids = []
  for key in ('eos_token_id', 'eot_token_id', 'eom_token_id'):
    token_id = meta.get(f'tokenizer.ggml.{key}')
    if token_id is not None and int(token_id) not in eos_ids:
      eos_ids.append(int(token_id))

  def sampling(key: str) -> float | None:
    value = meta.get(f'general.sampling.{key}')
    return None if value is None else _f32(value)

  top_k = meta.get('general.sampling.top_k')
  return GenerationDefaults(
      eos_token_ids=tuple(eos_ids),
      bos_token_id=meta.get('tokenizer.ggml.bos_token_id'),
      pad_token_id=meta.get('tokenizer.ggml.padding_token_id'),
      temperature=sampling('temp'),
      top_k=None if top_k is None else int(top_k),
      top_p=sampling('top_p'),
      min_p=sampling('min_p'),
  )
