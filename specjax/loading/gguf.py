"""GGUF files (llama.cpp) -> `Checkpoint`; architectures `gemma3`, `gemma4`, `llama`, `qwen3`.

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

Gemma 4 (`gemma4`, llama.cpp's `Gemma4Model` converter, `conversion/gemma.py`),
as an HF `gemma4_text` config with transformers 5's `per_layer_config`:

- `layer_types`: `attention.sliding_window_pattern` (a bool per layer, true =
  sliding; required, as in llama.cpp). `sliding_window`: its key, else 512.
- Head dims: `attention.key_length` is the full layers' (`global_head_dim`),
  `attention.key_length_swa` the sliding layers' (`head_dim`);
  `rope.dimension_count_swa` must equal the latter.
- kv heads: `attention.head_count_kv`, one value or one per layer (written when
  `num_global_key_value_heads` is set): the sliding layers' value is
  `num_key_value_heads`, each full layer's goes to `per_layer_config`.
- `intermediate_size`: `feed_forward_length`; a per-layer array twice as wide
  on the KV-shared layers is `use_double_wide_mlp`.
- `num_kv_shared_layers`: `attention.shared_kv_layers`, else 0.
- RoPE: full layers θ `rope.freq_base` (else 1e6), sliding `rope.freq_base_swa`
  (else 1e4, default RoPE). The converter encodes proportional RoPE as
  `rope_freqs.weight` (global_head_dim / 2 factors: 1 on the rotated
  frequencies, 1e30 on the rest): n ones give `proportional` with
  `partial_rotary_factor` 2n / global_head_dim; without the tensor, default.
- PLE: `embedding_length_per_layer_input` (0: none); its vocabulary is the
  rows of `per_layer_token_embd`.
- `attention_k_eq_v`: some unshared full layer has `attn_k` but no `attn_v`.
- MoE: `ffn_gate_inp` tensors present; `expert_count`, `expert_used_count`,
  `expert_feed_forward_length`. Fused `ffn_gate_up_exps` only (what the
  converter writes from transformers' fused tensor).
- `final_logit_softcapping`: the key, else None; `max_position_embeddings`:
  `context_length`; `hidden_activation`: "gelu_pytorch_tanh".

Tensors (`gemma4`): no norm offset (plain-weight norms), no permutation.
`layer_output_scale` -> `layer_scalar` (1 when absent, as llama.cpp),
`ffn_gate_inp.scale` -> `router.scale`, `ffn_down_exps.scale` ->
`router.per_expert_scale`, `ffn_gate_up_exps` / `ffn_down_exps` ->
`experts.gate_up_proj` / `down_proj` (`[E, 2F, D]` / `[E, D, F]`, gate rows
first), `pre_ffw_norm_2` / `post_ffw_norm_{1,2}`, PLE `inp_gate`, `proj`,
`post_norm`, `per_layer_{token_embd,model_proj,proj_norm}`. The tokenizer is
`tokenizer.ggml.model` "gemma4" (`specjax.loading.tokenizer`).

Llama / Mistral (`llama`) and Qwen3 dense (`qwen3`), from `<arch>.*` metadata:

- `model_type`: `qwen3` for `qwen3`. For `llama` (the converter writes Llama
  and Mistral alike, and leaves out Mistral's sliding window): `mistral` if
  `llama.attention.sliding_window` is set or `general.name`, `general.basename`
  or `general.base_model.0.name` names a Mistral model (mistral, ministral,
  mixtral, codestral, devstral, magistral, mathstral), else `llama`. Only
  `model_type`, `architectures` and `sliding_window` (None when absent, as in
  llama.cpp) differ; the weights and the other keys are read alike.
- `head_dim`: `attention.key_length`, else hidden_size / num_heads;
  `attention.value_length` and `rope.dimension_count` must equal it.
- `rope_theta`: `rope.freq_base`, else 10000. `max_position_embeddings`:
  `context_length`, else the HF class default (2048 llama, 131072 mistral,
  32768 qwen3). `hidden_act` is "silu" (not stored); `attention_bias` False.
- `rope_scaling`: from `rope.scaling.type` ("linear": factor; "yarn": factor,
  `original_max_position_embeddings` from `rope.scaling.original_context_length`
  and beta_fast / beta_slow / attention_factor when stored), else None.
- Llama 3 RoPE (`llama` only): convert_hf_to_gguf stores HF's `llama3`
  `rope_scaling` as a tensor, `rope_freqs.weight` (one factor per frequency,
  `LlamaModel.generate_extra_tensors`), not as metadata. When the factors equal
  the llama3 formula (rtol 1e-5) for some factor / low_freq_factor /
  high_freq_factor / original_max_position_embeddings among the usual values
  (the converter always uses 8192 for the last), `rope_scaling` is that
  `{'rope_type': 'llama3', ...}` dict, as in the HF config. Otherwise the
  factors are kept exactly as `rope_freq_factors` (a list of head_dim / 2
  floats; the model divides the inverse frequencies by them, as llama.cpp
  does), else `rope_freq_factors` is None. All-ones factors count as absent.
- `tie_word_embeddings`: true unless an `output.weight` tensor is present.
- `vocab_size`: rows of `token_embd.weight` (the converter makes the token
  list and `llama.vocab_size` that long too, padding with `[PADn]` tokens).

Tensors (`llama`, `qwen3`): no norm offset. The converter permutes the rows of
`attn_q` / `attn_k` for `llama` (`LlamaModel.permute`, applied in
`LlamaModel.modify_tensors`: HF's rotate-half pairs -> ggml's adjacent pairs,
`LLAMA_ROPE_TYPE_NORM` in llama.cpp's `llama_model_rope_type`); the loader
undoes it, so Q/K come back in HF layout. `qwen3` is not permuted
(`Qwen3Model` keeps `TextModel.modify_tensors`, and llama.cpp runs it with
`LLAMA_ROPE_TYPE_NEOX`, HF's own pairing).

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
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults, release_host_memory
from specjax.loading.tokenizer import Tokenizer
from specjax.quant.gguf import FLOAT_TYPES, REPACKED, repack

_MAGIC = b'GGUF'
_DEFAULT_ALIGNMENT = 32
_SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q5_0', 'Q4_K', 'Q5_K', 'Q6_K')
)

# GGUF metadata value types -> struct format (strings 8 and arrays 9 aside).
_SCALAR_FORMATS = {
    0: 'B',
    1: 'b',
    2: 'H',
    3: 'h',
    4: 'I',
    5: 'i',
    6: 'f',
    7: '?',
    10: 'Q',
    11: 'q',
    12: 'd',
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
_GEMMA4_LAYER_NAMES = {  # full GGUF -> HF suffixes: some are not `.weight`
    **{f'{part}.weight': f'{hf}.weight' for part, hf in _GEMMA3_LAYER_NAMES.items()},
    'layer_output_scale.weight': 'layer_scalar',
    'inp_gate.weight': 'per_layer_input_gate.weight',
    'proj.weight': 'per_layer_projection.weight',
    'post_norm.weight': 'post_per_layer_input_norm.weight',
    'ffn_gate_inp.weight': 'router.proj.weight',
    'ffn_gate_inp.scale': 'router.scale',
    'ffn_down_exps.scale': 'router.per_expert_scale',
    'ffn_gate_up_exps.weight': 'experts.gate_up_proj',
    'ffn_down_exps.weight': 'experts.down_proj',
    'pre_ffw_norm_2.weight': 'pre_feedforward_layernorm_2.weight',
    'post_ffw_norm_1.weight': 'post_feedforward_layernorm_1.weight',
    'post_ffw_norm_2.weight': 'post_feedforward_layernorm_2.weight',
}
_GEMMA4_TOP_NAMES = _GEMMA3_TOP_NAMES | {
    'per_layer_token_embd': 'model.embed_tokens_per_layer',
    'per_layer_model_proj': 'model.per_layer_model_projection',
    'per_layer_proj_norm': 'model.per_layer_projection_norm',
}
# Every Gemma 4 layer has these; the rest depends on the layer (KV sharing, k = v, MoE, PLE).
_GEMMA4_REQUIRED = frozenset(
    f'{part}.weight'
    for part in (
        'attn_norm attn_q attn_output attn_q_norm post_attention_norm ffn_norm post_ffw_norm ffn_gate ffn_up ffn_down'
    ).split()
)
_LAYER_TENSOR = re.compile(r'blk\.(\d+)\.(\w+\.\w+)')

_LLAMA_LAYER_NAMES = {
    'attn_norm': 'input_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'ffn_norm': 'post_attention_layernorm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}
_QWEN3_LAYER_NAMES = _LLAMA_LAYER_NAMES | {
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
}
_MISTRAL_NAMES = re.compile(r'mistral|ministral|mixtral|codestral|devstral|magistral|mathstral', re.I)
_ROPE_FREQS = 'rope_freqs.weight'

# Llama 3 `rope_scaling` values tried against `rope_freqs.weight`, most usual
# first; the factors depend on original_max_position_embeddings only through
# its ratios to low/high_freq_factor, so 8192 (the converter's) comes first.
_LLAMA3_FACTORS = (8.0, 32.0, 16.0, 4.0, 2.0, 64.0)
_LLAMA3_LOW_FREQ = (1.0, 0.5, 2.0, 0.25, 4.0)
_LLAMA3_HIGH_FREQ = (4.0, 2.0, 8.0, 16.0, 1.0, 32.0)
_LLAMA3_ORIGINAL_CONTEXT = (8192, 4096, 16384, 32768, 2048)


@dataclasses.dataclass(frozen=True)
class _Arch:
  """How one GGUF architecture maps to HF names and values."""

  layer_names: dict[str, str]  # `blk.N.<part>.weight` -> HF name under model.layers.N (+ `.weight`)
  norm_offset: bool  # norms stored as 1 + w (Gemma)
  permute_qk: bool  # attn_q / attn_k rows permuted by the converter
  extra: frozenset[str] = frozenset()  # tensors read into the config
  top_names: dict[str, str] = dataclasses.field(default_factory=lambda: _GEMMA3_TOP_NAMES)
  full_names: dict[str, str] | None = None  # instead of layer_names: `blk.N.<part>.<suffix>` -> full HF suffix
  required: frozenset[str] | None = None  # with full_names: the parts every layer has

  def layer_tensors(self) -> dict[str, str]:
    """`<part>.<suffix>` -> HF suffix of every known per-layer tensor."""
    if self.full_names is not None:
      return self.full_names
    return {f'{part}.weight': f'{hf}.weight' for part, hf in self.layer_names.items()}


_ARCHS = {
    'gemma3': _Arch(_GEMMA3_LAYER_NAMES, norm_offset=True, permute_qk=False),
    'gemma4': _Arch(
        {},
        norm_offset=False,
        permute_qk=False,
        extra=frozenset({_ROPE_FREQS}),
        top_names=_GEMMA4_TOP_NAMES,
        full_names=_GEMMA4_LAYER_NAMES,
        required=_GEMMA4_REQUIRED,
    ),
    'llama': _Arch(_LLAMA_LAYER_NAMES, norm_offset=False, permute_qk=True, extra=frozenset({_ROPE_FREQS})),
    'qwen3': _Arch(_QWEN3_LAYER_NAMES, norm_offset=False, permute_qk=False),
}


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
      raise SpecjaxError(f'corrupt or truncated GGUF header in {path}: {e}') from None

  def _parse(self) -> None:
    buf = self._map
    (version,) = struct.unpack_from('<I', buf, 4)
    if version not in (2, 3):
      order = 'big-endian ' if version > 0xFFFF else ''
      raise SpecjaxError(f'unsupported {order}GGUF version {version} in {self.path} (supported: little-endian v2, v3)')
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
        name: _TensorInfo(name, shape, qtype, data_start + offset) for name, shape, qtype, offset in raw_infos
    }

  def _string(self, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from('<Q', self._map, pos)
    end = pos + 8 + n
    if end > len(self._map):
      raise IndexError('string runs past the end of the file')
    return str(self._map[pos + 8 : end], 'utf-8'), end

  def _value(self, value_type: int, pos: int) -> tuple[Any, int]:
    if value_type == _STRING:
      return self._string(pos)
    if value_type == _ARRAY:
      item_type, count = struct.unpack_from('<IQ', self._map, pos)
      pos += 12
      if item_type in _SCALAR_FORMATS:
        fmt = '<' + _SCALAR_FORMATS[item_type]
        items = np.frombuffer(self._map, np.dtype(fmt), count=count, offset=pos).tolist()
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
          f' the {GGMLQuantizationType(info.qtype).name} block size {block}'
      )
    byte_shape = (*rows, width // block * block_bytes)
    nbytes = math.prod(byte_shape)
    if info.start + nbytes > len(self._map):
      raise SpecjaxError(f'GGUF file is truncated: tensor {info.name} ends past {self.path}')
    data = np.frombuffer(self._map, np.uint8, count=nbytes, offset=info.start)
    return data.reshape(byte_shape)

  def release(self, info: _TensorInfo) -> None:
    """Drops a read tensor's file pages from this process's memory (they count in its RSS while mapped; a later
    read would fault them back in from the file, so this is always safe)."""
    page = mmap.PAGESIZE
    start = info.start // page * page
    end = min(len(self._map), info.start + math.prod(self.raw(info).shape))
    if hasattr(self._map, 'madvise') and hasattr(mmap, 'MADV_DONTNEED') and end > start:
      self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_gguf_metadata(path: str) -> dict[str, Any]:
  """All metadata of a GGUF file as plain Python values (no tensor data)."""
  return _GGUFFile(path).metadata


# HF names of the tensors `--quant auto` keeps quantized: what the models read through `Weight` params.
_QUANTIZABLE = (
    tuple(f'self_attn.{p}_proj.weight' for p in 'qkvo')
    + tuple(f'mlp.{p}_proj.weight' for p in ('gate', 'up', 'down'))
    + ('experts.gate_up_proj', 'experts.down_proj')  # stacked: one matrix an expert
)
_EMBEDDING = ('model.embed_tokens.weight', 'lm_head.weight')


def quantized_types(path: str) -> list[str]:
  """The quantized (not float) tensor types of a GGUF file, from its header."""
  types = {info.qtype for info in _GGUFFile(path).tensors.values()} - set(FLOAT_TYPES)
  return sorted(_type_name(t) for t in types)


def load_gguf(path: str, *, keep_quantized: bool = False, quant_embedding: bool = True) -> Checkpoint:
  """Loads a GGUF checkpoint: config, tensors, tokenizer, defaults.

  Tensors are float32, but with `keep_quantized` the projections (and, with
  `quant_embedding`, the embedding and head) of a repackable type stay
  quantized, as `QMatrix` (`specjax.quant.gguf`).
  """
  gguf_file = _GGUFFile(path)
  meta = gguf_file.metadata
  arch = meta.get('general.architecture')
  spec = _ARCHS.get(arch)
  if spec is None:
    raise SpecjaxError(f'unsupported GGUF architecture {arch!r} in {path} (supported: {", ".join(_ARCHS)})')

  # Everything is checked before any tensor is dequantized.
  for info in gguf_file.tensors.values():
    if info.qtype not in _SUPPORTED_TYPES:
      supported = ', '.join(t.name for t in sorted(_SUPPORTED_TYPES))
      raise SpecjaxError(
          f'GGUF tensor {info.name} has unsupported type {_type_name(info.qtype)} (supported: {supported})'
      )
  if arch == 'gemma3':
    config = _gemma3_config(meta, gguf_file.tensors)
  elif arch == 'gemma4':
    config = _gemma4_config(meta, gguf_file)
  else:
    config = _dense_config(arch, meta, gguf_file)
  hf_names = _tensor_names(arch, spec, gguf_file.tensors, config['num_hidden_layers'])
  tokenizer = Tokenizer.from_gguf_fields(meta)
  release_host_memory()

  tensors = {}
  for gguf_name, hf_name in hf_names.items():
    info = gguf_file.tensors[gguf_name]
    keep = hf_name.endswith(_QUANTIZABLE) or (quant_embedding and hf_name in _EMBEDDING)
    if keep_quantized and keep and info.qtype in REPACKED and len(info.shape) in (2, 3):
      values = repack(gguf_file.raw(info), info.qtype, info.shape)
      if spec.permute_qk and gguf_name.endswith(('.attn_q.weight', '.attn_k.weight')):
        heads = config['num_attention_heads' if '.attn_q.' in gguf_name else 'num_key_value_heads']
        values = values.rows(_unpermute_rope_rows(np.arange(info.shape[0]), heads, gguf_name))
      tensors[hf_name] = values
      gguf_file.release(info)
      continue
    values = _dequantize(gguf_file.raw(info), info.qtype, info.shape)
    if spec.norm_offset and gguf_name.endswith('norm.weight'):
      values -= 1.0  # stored as 1 + w
    if spec.permute_qk and gguf_name.endswith(('.attn_q.weight', '.attn_k.weight')):
      heads = config['num_attention_heads' if '.attn_q.' in gguf_name else 'num_key_value_heads']
      values = _unpermute_rope_rows(values, heads, gguf_name)
    tensors[hf_name] = values
    gguf_file.release(info)
  if arch == 'gemma4':  # llama.cpp takes a missing layer_output_scale as 1, as does transformers' init
    for i in range(config['num_hidden_layers']):
      tensors.setdefault(f'model.layers.{i}.layer_scalar', np.ones((1,), np.float32))
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
    out_rows[start : start + step] = decode(rows[start : start + step])
  return out


def _type_name(qtype: int) -> str:
  try:
    return GGMLQuantizationType(qtype).name
  except ValueError:
    return f'#{qtype}'


def _f32(value: float) -> float:
  """A float32 metadata value as the shortest decimal that round-trips."""
  return float(str(np.float32(value)))


def _gemma3_config(meta: dict[str, Any], tensors: dict[str, _TensorInfo]) -> dict[str, Any]:
  """HF `Gemma3TextConfig` keys from `gemma3.*` metadata (defaults: above)."""

  def get(key: str, default: Any = None) -> Any:
    return meta.get(f'gemma3.{key}', default)

  def need(key: str) -> Any:
    if f'gemma3.{key}' not in meta:
      raise SpecjaxError(f'GGUF metadata lacks gemma3.{key}')
    return meta[f'gemma3.{key}']

  hidden, layers, heads, head_dim = _dimensions(tensors, need, get)
  pattern, sliding = _sliding_layers('gemma3', get('attention.sliding_window_pattern', 6), layers)

  rope_scaling = None
  if get('rope.scaling.type') == 'linear':
    rope_scaling = {'rope_type': 'linear', 'factor': _f32(get('rope.scaling.factor', 1.0))}
  final_softcap = get('final_logit_softcapping')
  attn_softcap = get('attn_logit_softcapping')

  return {
      'architectures': ['Gemma3ForCausalLM'],
      'model_type': 'gemma3_text',
      **_decoder_keys(meta, tensors, need, get, hidden, layers, heads, head_dim),
      'hidden_activation': 'gelu_pytorch_tanh',
      'rope_theta': _f32(get('rope.freq_base', 1_000_000.0)),
      'rope_local_base_freq': _f32(get('rope.freq_base_swa', 10_000.0)),
      'rope_scaling': rope_scaling,
      'sliding_window': int(get('attention.sliding_window', 512)),
      'sliding_window_pattern': pattern,
      'layer_types': ['sliding_attention' if s else 'full_attention' for s in sliding],
      'query_pre_attn_scalar': hidden // heads if layers == 62 else head_dim,
      'final_logit_softcapping': (None if final_softcap is None else _f32(final_softcap)),
      'attn_logit_softcapping': (None if attn_softcap is None else _f32(attn_softcap)),
      'max_position_embeddings': int(get('context_length', 32768)),
  }


def _sliding_layers(arch: str, pattern: int | list, layers: int) -> tuple[int, list[bool]]:
  """(period, per-layer sliding flags) of `attention.sliding_window_pattern`: a period or a bool per layer."""
  if isinstance(pattern, list):
    if len(pattern) != layers:
      raise SpecjaxError(f'{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers')
    sliding = [bool(s) for s in pattern]
    return next((i + 1 for i, s in enumerate(sliding) if not s), layers), sliding
  return int(pattern), [(i + 1) % int(pattern) != 0 for i in range(layers)]


def _gemma4_config(meta: dict[str, Any], gguf_file: _GGUFFile) -> dict[str, Any]:
  """HF `Gemma4TextConfig` keys from `gemma4.*` metadata and tensors (rules: `load_gguf`'s docstring)."""
  tensors = gguf_file.tensors

  def get(key: str, default: Any = None) -> Any:
    return meta.get(f'gemma4.{key}', default)

  def need(key: str) -> Any:
    if f'gemma4.{key}' not in meta:
      raise SpecjaxError(f'GGUF metadata lacks gemma4.{key}')
    return meta[f'gemma4.{key}']

  def scalar(read):  # per-layer arrays are resolved below
    return lambda key, *default: (v[0] if isinstance(v := read(key, *default), list) else v)

  hidden, layers, heads, global_head_dim = _dimensions(tensors, scalar(need), scalar(get))
  head_dim = int(get('attention.key_length_swa', global_head_dim))
  if int(get('rope.dimension_count_swa', head_dim)) != head_dim:
    raise SpecjaxError('GGUF metadata gemma4.rope.dimension_count_swa: partial RoPE on sliding layers is not supported')
  _, sliding = _sliding_layers('gemma4', need('attention.sliding_window_pattern'), layers)
  shared = int(get('attention.shared_kv_layers', 0))

  def per_layer(key: str, default: Any) -> list[int]:
    value = get(key, default)
    if isinstance(value, list) and len(value) != layers:
      raise SpecjaxError(f'GGUF metadata gemma4.{key} has {len(value)} entries for {layers} layers')
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers

  kv = per_layer('attention.head_count_kv', heads)
  kv_sliding = {k for k, s in zip(kv, sliding) if s}
  if len(kv_sliding) > 1:
    raise SpecjaxError(f'GGUF metadata gemma4.attention.head_count_kv varies across sliding layers ({kv})')
  ff = per_layer('feed_forward_length', None) if get('feed_forward_length') is not None else None
  if ff is None:
    raise SpecjaxError('GGUF metadata lacks gemma4.feed_forward_length')
  first_shared = layers - shared
  double_wide = ff != [ff[0]] * layers
  if double_wide and ff != [ff[0] if i < first_shared else 2 * ff[0] for i in range(layers)]:
    raise SpecjaxError(f'GGUF metadata gemma4.feed_forward_length varies across layers ({ff}) other than double-wide')

  full_rope = {'rope_type': 'default', 'rope_theta': _f32(get('rope.freq_base', 1_000_000.0))}
  if (info := tensors.get(_ROPE_FREQS)) is not None:  # 1 on rotated frequencies, 1e30 on the others
    factors = _dequantize(gguf_file.raw(info), info.qtype, info.shape)
    rotated = int(np.sum(factors == 1.0))
    if info.shape != (global_head_dim // 2,) or np.any(factors[:rotated] != 1.0) or np.any(factors[rotated:] < 1e20):
      raise SpecjaxError(f'GGUF tensor {_ROPE_FREQS} is not a proportional-RoPE mask (ones, then 1e30)')
    full_rope |= {'rope_type': 'proportional', 'partial_rotary_factor': 2 * rotated / global_head_dim}
  experts = 'blk.0.ffn_gate_inp.weight' in tensors
  k_eq_v = any(
      not sliding[i] and f'blk.{i}.attn_k.weight' in tensors and f'blk.{i}.attn_v.weight' not in tensors
      for i in range(first_shared)
  )
  ple = int(get('embedding_length_per_layer_input', 0))
  final_softcap = get('final_logit_softcapping')
  keys = _decoder_keys(meta, tensors, scalar(need), scalar(get), hidden, layers, heads, head_dim)
  return {
      'architectures': ['Gemma4ForCausalLM'],
      'model_type': 'gemma4_text',
      **keys,
      'intermediate_size': ff[0],
      'num_key_value_heads': kv_sliding.pop() if kv_sliding else heads,
      'per_layer_config': {
          str(i): {'head_dim': global_head_dim, 'num_key_value_heads': kv[i]} for i in range(layers) if not sliding[i]
      },
      'layer_types': ['sliding_attention' if s else 'full_attention' for s in sliding],
      'sliding_window': int(get('attention.sliding_window', 512)),
      'rope_parameters': {
          'sliding_attention': {'rope_type': 'default', 'rope_theta': _f32(get('rope.freq_base_swa', 10_000.0))},
          'full_attention': full_rope,
      },
      'final_logit_softcapping': None if final_softcap is None else _f32(final_softcap),
      'hidden_activation': 'gelu_pytorch_tanh',
      'max_position_embeddings': int(get('context_length', 131072)),
      'num_kv_shared_layers': shared,
      'use_double_wide_mlp': double_wide,
      'hidden_size_per_layer_input': ple,
      'vocab_size_per_layer_input': tensors['per_layer_token_embd.weight'].shape[0] if ple else None,
      'attention_k_eq_v': k_eq_v,
      'enable_moe_block': experts,
      'num_experts': int(need('expert_count')) if experts else None,
      'top_k_experts': int(need('expert_used_count')) if experts else None,
      'moe_intermediate_size': int(need('expert_feed_forward_length')) if experts else None,
  }


def _dimensions(tensors, need, get) -> tuple[int, int, int, int]:
  """(hidden size, layers, query heads, head dim) of a decoder's metadata."""
  if 'token_embd.weight' not in tensors:
    raise SpecjaxError('GGUF file has no token_embd.weight tensor')
  hidden = int(need('embedding_length'))
  heads = int(need('attention.head_count'))
  return hidden, int(need('block_count')), heads, int(get('attention.key_length', hidden // heads))


def _decoder_keys(meta, tensors, need, get, hidden: int, layers: int, heads: int, head_dim: int) -> dict[str, Any]:
  """The HF config keys every decoder family reads the same way from GGUF metadata."""
  return {
      'vocab_size': tensors['token_embd.weight'].shape[0],
      'hidden_size': hidden,
      'intermediate_size': int(need('feed_forward_length')),
      'num_hidden_layers': layers,
      'num_attention_heads': heads,
      'num_key_value_heads': int(get('attention.head_count_kv', heads)),
      'head_dim': head_dim,
      'rms_norm_eps': _f32(need('attention.layer_norm_rms_epsilon')),
      'tie_word_embeddings': 'output.weight' not in tensors,
      'bos_token_id': meta.get('tokenizer.ggml.bos_token_id'),
      'eos_token_id': meta.get('tokenizer.ggml.eos_token_id'),
      'pad_token_id': meta.get('tokenizer.ggml.padding_token_id'),
  }


def _tensor_names(arch: str, spec: _Arch, tensors: dict[str, _TensorInfo], layers: int) -> dict[str, str]:
  """GGUF name -> HF name for every tensor; unknown or missing ones raise.

  Tensors in `spec.extra` are read into the config and get no HF name.
  """
  names, layer_tensors = {}, spec.layer_tensors()
  for gguf_name in tensors:
    if gguf_name in spec.extra:
      continue
    top = spec.top_names.get(gguf_name.removesuffix('.weight'))
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
      layer, part = int(m.group(1)), m.group(2)
      if layer < layers and part in layer_tensors:
        names[gguf_name] = f'model.layers.{layer}.{layer_tensors[part]}'
        continue
    elif top is not None and gguf_name.endswith('.weight'):
      names[gguf_name] = f'{top}.weight'
      continue
    raise SpecjaxError(f'unexpected tensor {gguf_name} in a {arch} GGUF file')

  required = layer_tensors if spec.required is None else spec.required
  expected = {'token_embd.weight', 'output_norm.weight'} | {
      f'blk.{i}.{part}' for i in range(layers) for part in required
  }
  if missing := sorted(expected - set(tensors)):
    raise SpecjaxError(f'{arch} GGUF file lacks {len(missing)} tensor(s), e.g. {missing[0]}')
  return names


def _unpermute_rope_rows(values: np.ndarray, heads: int, name: str) -> np.ndarray:
  """Undoes `LlamaModel.permute` (convert_hf_to_gguf) on Q/K rows.

  The converter reshapes rows to `[heads, 2, head_dim / 2]` and swaps the last
  two axes (HF's rotate-half pairs `(i, i + head_dim / 2)` -> ggml's adjacent
  pairs `(2i, 2i + 1)`); the inverse swaps them back.
  """
  rows = values.shape[0]
  if rows % (2 * heads):
    raise SpecjaxError(f'GGUF tensor {name}: {rows} rows do not split into {heads} heads of an even head_dim')
  return np.ascontiguousarray(
      values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
  )


def _dense_config(arch: str, meta: dict[str, Any], gguf_file: _GGUFFile) -> dict[str, Any]:
  """HF `LlamaConfig` / `MistralConfig` / `Qwen3Config` keys (rules: above)."""
  tensors = gguf_file.tensors

  def get(key: str, default: Any = None) -> Any:
    value = meta.get(f'{arch}.{key}', default)
    if isinstance(value, list):  # per-layer values: must agree
      if len(set(value)) != 1:
        raise SpecjaxError(
            f'GGUF metadata {arch}.{key} varies across layers ({value[:8]}), which this loader does not support'
        )
      value = value[0]
    return value

  def need(key: str) -> Any:
    if f'{arch}.{key}' not in meta:
      raise SpecjaxError(f'GGUF metadata lacks {arch}.{key}')
    return get(key)

  hidden, layers, heads, head_dim = _dimensions(tensors, need, get)
  for key in ('attention.value_length', 'rope.dimension_count'):
    if int(get(key, head_dim)) != head_dim:
      raise SpecjaxError(
          f'GGUF metadata {arch}.{key} = {get(key)} differs from head_dim'
          f' {head_dim}, which {arch} models do not support'
      )

  if arch == 'qwen3':
    model_type, default_context = 'qwen3', 32768
  elif _is_mistral(meta):
    model_type, default_context = 'mistral', 131072
  else:
    model_type, default_context = 'llama', 2048
  context = int(get('context_length', default_context))
  rope_theta = _f32(get('rope.freq_base', 10_000.0))
  rope_scaling = _rope_scaling_from_metadata(arch, get, context)
  config = {
      'architectures': [
          {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}[model_type]
      ],
      'model_type': model_type,
      **_decoder_keys(meta, tensors, need, get, hidden, layers, heads, head_dim),
      'hidden_act': 'silu',
      'rope_theta': rope_theta,
      'rope_scaling': rope_scaling,
      'max_position_embeddings': context,
      'attention_bias': False,
  }
  if arch == 'llama':
    config['mlp_bias'] = False
    config['rope_scaling'], config['rope_freq_factors'] = _rope_freqs(
        gguf_file, rope_theta, head_dim, rope_scaling, get('rope.scaling.original_context_length')
    )
  if model_type == 'mistral':
    window = get('attention.sliding_window')
    config['sliding_window'] = int(window) if window else None
  return config


def _is_mistral(meta: dict[str, Any]) -> bool:
  if meta.get('llama.attention.sliding_window'):
    return True
  names = (meta.get(k) for k in ('general.name', 'general.basename', 'general.base_model.0.name'))
  return any(isinstance(n, str) and _MISTRAL_NAMES.search(n) for n in names)


def _rope_scaling_from_metadata(arch: str, get: Any, context: int) -> dict[str, Any] | None:
  """`rope_scaling` from `rope.scaling.*` (llama.cpp's default type: linear)."""
  kind = get('rope.scaling.type', 'linear')
  factor = get('rope.scaling.factor', get('rope.scale_linear'))
  if kind == 'none' or (kind == 'linear' and factor in (None, 0.0, 1.0)):
    return None
  if kind == 'linear':
    return {'rope_type': 'linear', 'factor': _f32(factor)}
  if kind == 'yarn':
    scaling = {
        'rope_type': 'yarn',
        'factor': _f32(factor if factor else 1.0),
        'original_max_position_embeddings': int(get('rope.scaling.original_context_length', context)),
    }
    for hf_key, gguf_key in (
        ('attention_factor', 'yarn_attn_factor'),
        ('beta_fast', 'yarn_beta_fast'),
        ('beta_slow', 'yarn_beta_slow'),
    ):
      if (value := get(f'rope.scaling.{gguf_key}')) is not None:
        scaling[hf_key] = _f32(value)
    return scaling
  raise SpecjaxError(f'unsupported {arch}.rope.scaling.type {kind!r} in GGUF metadata (supported: none, linear, yarn)')


def _rope_freqs(
    gguf_file: _GGUFFile,
    theta: float,
    head_dim: int,
    rope_scaling: dict[str, Any] | None,
    original_context: int | None,
) -> tuple[dict[str, Any] | None, list[float] | None]:
  """(`rope_scaling`, `rope_freq_factors`) given `rope_freqs.weight`."""
  info = gguf_file.tensors.get(_ROPE_FREQS)
  if info is None:
    return rope_scaling, None
  if info.shape != (head_dim // 2,):
    raise SpecjaxError(
        f'GGUF tensor {_ROPE_FREQS} has shape {info.shape}, expected ({head_dim // 2},) for head_dim {head_dim}'
    )
  factors = _dequantize(gguf_file.raw(info), info.qtype, info.shape)
  if np.all(factors == 1.0):
    return rope_scaling, None
  if rope_scaling is None:
    if llama3 := _match_llama3(factors, theta, head_dim, original_context):
      return llama3, None
  return rope_scaling, [_f32(f) for f in factors]


def _llama3_factors(
    theta: float,
    head_dim: int,
    factor: float,
    low: float,
    high: float,
    original: int,
) -> np.ndarray:
  """Per-frequency factors of HF's `llama3` rope (as the converter computes)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  wavelen = 2 * math.pi / inv_freq
  smooth = (original / wavelen - low) / (high - low)
  return np.where(
      wavelen < original / high,
      1.0,
      np.where(wavelen > original / low, factor, 1.0 / ((1.0 - smooth) / factor + smooth)),
  )


def _match_llama3(
    factors: np.ndarray,
    theta: float,
    head_dim: int,
    original_context: int | None,
) -> dict[str, Any] | None:
  """The `llama3` rope_scaling whose factors equal `factors`, if one does."""
  originals = tuple(
      dict.fromkeys(([int(original_context)] if original_context else []) + list(_LLAMA3_ORIGINAL_CONTEXT))
  )
  largest = float(np.max(factors))
  for factor in dict.fromkeys((largest, *_LLAMA3_FACTORS)):
    for original in originals:
      for low in _LLAMA3_LOW_FREQ:
        for high in _LLAMA3_HIGH_FREQ:
          if high <= low:
            continue
          want = _llama3_factors(theta, head_dim, factor, low, high, original)
          if np.allclose(factors, want, rtol=1e-5, atol=0.0):
            return {
                'rope_type': 'llama3',
                'factor': _f32(factor),
                'low_freq_factor': low,
                'high_freq_factor': high,
                'original_max_position_embeddings': original,
            }
  return None


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
