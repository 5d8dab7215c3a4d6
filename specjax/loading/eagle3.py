"""EAGLE-3 draft-head checkpoints: reading both upstream layouts against a target, and writing one.

Layouts (a directory with `config.json` and safetensors, or a hub id):
  1. SpecForge / EAGLE / SGLang / vLLM: `architectures: ["LlamaForCausalLMEagle3"]` (vLLM also names it
     `Eagle3LlamaForCausalLM`), the Llama shape fields, `draft_vocab_size`, optional `target_hidden_size`,
     `norm_before_residual` and `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc`, `midlayer.*`,
     `norm`, `lm_head [draft V, H]`, `d2t [draft V]`, `t2d [V]`, optional `embed_tokens`.
     Norm variants (in `eagle_config` or at the top level, as vLLM reads them): `norm_before_fc` (tensor
     `input_norm [n·H]`), `fc_norm` (`fc_norm.{i} [H]`, EAGLE 3.1) and `norm_output`.
  2. vllm-project/speculators: `architectures: ["Eagle3Speculator"]`, `speculators_model_type: eagle3`, the
     layer's shape in `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids` and the flags at the top
     level; the layer's tensors under `layers.0.*` instead of `midlayer.*`.

Tap ids: the stacks count them differently.
  - SGLang / SpecForge: id i is the OUTPUT of target layer i (SGLang's `set_eagle3_layers_to_capture` stores
    `val + 1` and captures the input of that layer); SpecForge's default is [1, L/2 - 1, L - 4]
    (`specforge/algorithms/model_providers.py::resolve_eagle_capture_layers`), and EAGLE's own target taps the
    inputs of layers 2, L/2, L - 3 (`eagle/model/modeling_llama_kv.py`), the same layers.
  - vLLM / speculators: id j is the INPUT of layer j, i.e. the output of layer j - 1 (`models/llama.py`:
    `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)` before layer
    idx runs; ids read unchanged by `gpu_model_runner._get_eagle3_aux_layers_from_config`); the default
    (2, L/2, L - 3) (`get_eagle3_aux_hidden_state_layers`, speculators `resolve_target_layer_ids`) again names
    the outputs of layers 1, L/2 - 1, L - 4.
  specjax's taps are layer outputs (`DecoderLM.forward(taps=...)`): layout 1's `eagle_config` ids are used as
  they are (SGLang's reading; vLLM reads the same key one layer earlier), top-level ids (speculators, vLLM)
  minus one.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading import fill, resolve, resolve_dtype
from specjax.loading.hf import (
    check_tensor_shapes,
    read_hf_config,
    read_safetensors,
    safetensors_files,
    safetensors_header,
    write_checkpoint,
)
from specjax.models import eagle3
from specjax.models.eagle3 import Eagle3Config, Eagle3Head
from specjax.models.layers import ACTIVATIONS, Rope
from specjax.models.llama import attention_fields
from specjax.taps import EAGLE3_DEFAULT, check_taps, eagle3_default_taps

LAYOUT1_ARCHITECTURES = ('LlamaForCausalLMEagle3', 'Eagle3LlamaForCausalLM')
SPECULATORS_ARCHITECTURE = 'Eagle3Speculator'
SPECULATORS_LAYER = 'layers.0.'
IGNORED = ('verifier_norm.weight', 'verifier_lm_head.weight')  # speculators' training-only copies of the target's


@dataclasses.dataclass
class Eagle3Checkpoint:
  config: Eagle3Config
  graphdef: nnx.GraphDef
  params: nnx.State
  d2t: np.ndarray  # [draft V] int32: target id = draft id + d2t[draft id]
  t2d: np.ndarray | None  # [V] bool: target ids in the draft vocabulary (training mask), if the checkpoint has it
  source: str

  def module(self) -> Eagle3Head:
    return nnx.merge(self.graphdef, self.params)


def _taps(ids: Any, convention: str, num_layers: int, where: str) -> tuple[int, ...]:
  """specjax taps from upstream ids; `convention` 'output' (SGLang) or 'input' (vLLM: id j = output of j - 1)."""
  if ids is None:
    hint = 'the checkpoint must name eagle_aux_hidden_state_layer_ids'
    return check_taps(
        eagle3_default_taps(num_layers), num_layers, f'{where}: the default taps', meaning=EAGLE3_DEFAULT, hint=hint
    )
  if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
    raise SpecjaxError(f'{where}: eagle_aux_hidden_state_layer_ids must be a list of layer ids, got {ids!r}')
  taps = tuple(i - 1 for i in ids) if convention == 'input' else tuple(ids)
  meaning = 'id j = output of layer j - 1' if convention == 'input' else 'id i = output of layer i'
  return check_taps(
      taps, num_layers, f'{where}: eagle_aux_hidden_state_layer_ids {ids} name layer outputs', meaning=meaning
  )


def _flags(hf: dict, where: str) -> dict[str, bool]:
  """The head's norm variants (`Eagle3Config` fields), read from `eagle_config` first, then the top level (vLLM)."""
  nested = hf.get('eagle_config') or {}
  flags = {}
  for flag in ('norm_before_fc', 'fc_norm', 'norm_output'):
    value = nested.get(flag, hf.get(flag))
    if value is not None and not isinstance(value, bool):
      raise SpecjaxError(f'{where}: {flag} must be true or false, got {value!r}')
    flags[flag] = bool(value)
  return flags


def config_from_hf(hf: dict, num_layers: int, where: str) -> tuple[Eagle3Config, str]:
  """The head's config from either layout, and the checkpoint's prefix of the decoder layer's tensors."""
  archs = hf.get('architectures') or []
  try:
    if SPECULATORS_ARCHITECTURE in archs or 'speculators_model_type' in hf:
      kind = hf.get('speculators_model_type')
      if kind != 'eagle3':
        raise SpecjaxError(f'{where}: speculators_model_type {kind!r} is not an EAGLE-3 head (expected eagle3)')
      layer, top, prefix = hf['transformer_layer_config'], hf, SPECULATORS_LAYER
      if layer.get('model_type', 'llama') != 'llama':
        raise SpecjaxError(
            f'{where}: transformer_layer_config.model_type {layer.get("model_type")!r} is not supported (llama)'
        )
      norm_before_residual = bool(top.get('norm_before_residual', True))  # vLLM's default for speculators configs
      taps = _taps(top.get('eagle_aux_hidden_state_layer_ids'), 'input', num_layers, where)
    elif any(a in LAYOUT1_ARCHITECTURES for a in archs):
      layer, top, prefix = hf, hf, eagle3.LAYER
      eagle_config = hf.get('eagle_config') or {}
      if eagle_config.get('use_aux_hidden_state', True) is False:
        raise SpecjaxError(f'{where}: eagle_config.use_aux_hidden_state=false (no target taps) is not supported')
      norm_before_residual = bool(hf.get('norm_before_residual', False))
      if eagle_config.get('eagle_aux_hidden_state_layer_ids') is not None:
        taps = _taps(eagle_config['eagle_aux_hidden_state_layer_ids'], 'output', num_layers, where)
      else:  # only vLLM reads a top-level list
        taps = _taps(hf.get('eagle_aux_hidden_state_layer_ids'), 'input', num_layers, where)
    else:
      raise SpecjaxError(
          f'{where}: not an EAGLE-3 head: architectures {archs} (supported: '
          f'{", ".join(LAYOUT1_ARCHITECTURES + (SPECULATORS_ARCHITECTURE,))})'
      )
    for flag in ('attention_bias', 'mlp_bias'):
      if layer.get(flag):
        raise SpecjaxError(f'{where}: {flag}=true is not supported')
    act = layer.get('hidden_act', 'silu')
    if act not in ACTIVATIONS:
      raise SpecjaxError(f'{where}: unsupported activation {act!r}')
    if int(layer.get('num_hidden_layers', 1)) != 1:
      raise SpecjaxError(f'{where}: num_hidden_layers={layer["num_hidden_layers"]}; specjax runs one-layer heads')
    hidden = int(layer['hidden_size'])
    vocab = int(layer['vocab_size'])
    cfg = Eagle3Config(
        **attention_fields(layer, where),
        vocab_size=vocab,
        draft_vocab_size=int(top.get('draft_vocab_size') or vocab),
        target_hidden_size=int(top.get('target_hidden_size') or hidden),
        taps=taps,
        norm_before_residual=norm_before_residual,
        **_flags(top, where),
        max_position_embeddings=int(layer.get('max_position_embeddings') or 2048),
        activation=act,
    )
  except KeyError as e:
    raise SpecjaxError(f'{where}: missing key {e.args[0]!r}') from None
  except (TypeError, ValueError) as e:
    raise SpecjaxError(f'{where}: bad value in the config: {e}') from None
  if cfg.num_heads % cfg.num_kv_heads:
    raise SpecjaxError(
        f'{where}: num_attention_heads ({cfg.num_heads}) is not a multiple of num_key_value_heads ({cfg.num_kv_heads})'
    )
  return cfg, prefix


def _check_target(cfg: Eagle3Config, target: Any, where: str) -> None:
  t = target.config
  if cfg.target_hidden_size != t.hidden_size:
    raise SpecjaxError(
        f'{where}: the head reads taps of width {cfg.target_hidden_size} (target_hidden_size), '
        f'the target {target.source} has hidden size {t.hidden_size}'
    )
  if not cfg.has_embedding and cfg.hidden_size != t.hidden_size:
    raise SpecjaxError(
        f"{where}: hidden size {cfg.hidden_size} != the target's {t.hidden_size} and no embed_tokens of its own"
    )
  if cfg.vocab_size != t.vocab_size:
    raise SpecjaxError(f"{where}: vocab_size {cfg.vocab_size} != the target's vocabulary ({t.vocab_size})")
  if not 1 <= cfg.draft_vocab_size <= cfg.vocab_size:
    raise SpecjaxError(f'{where}: draft_vocab_size {cfg.draft_vocab_size} must be in 1..vocab_size ({cfg.vocab_size})')


def _vocab_map(cfg: Eagle3Config, tensors: dict[str, np.ndarray], where: str) -> tuple[np.ndarray, np.ndarray | None]:
  """(d2t [draft V] int32, t2d [V] bool or None), checked against the target vocabulary."""
  d2t = tensors.pop('d2t', None)
  if d2t is None:
    if cfg.draft_vocab_size != cfg.vocab_size:
      raise SpecjaxError(
          f"{where}: no d2t tensor, but the draft vocabulary ({cfg.draft_vocab_size}) is not the target's"
      )
    d2t = np.zeros(cfg.draft_vocab_size, np.int32)
  if d2t.shape != (cfg.draft_vocab_size,) or not np.array_equal(d2t, np.round(d2t)):
    raise SpecjaxError(f'{where}: d2t must be {cfg.draft_vocab_size} integer offsets, got shape {tuple(d2t.shape)}')
  d2t = d2t.astype(np.int32)
  target_ids = np.arange(cfg.draft_vocab_size) + d2t
  bad = np.flatnonzero((target_ids < 0) | (target_ids >= cfg.vocab_size))
  if bad.size:
    raise SpecjaxError(
        f'{where}: d2t maps draft id {bad[0]} to target id {target_ids[bad[0]]}, outside the target vocabulary '
        f'(0..{cfg.vocab_size - 1}; {bad.size} such ids)'
    )
  t2d = tensors.pop('t2d', None)
  if t2d is not None:
    if t2d.shape != (cfg.vocab_size,):
      raise SpecjaxError(f'{where}: t2d must be [{cfg.vocab_size}] (the target vocabulary), got {tuple(t2d.shape)}')
    t2d = t2d != 0
  return d2t, t2d


def load_eagle3(
    path_or_hub_id: str, target: Any, *, dtype: str | None = None, attention_impl: str = 'auto'
) -> Eagle3Checkpoint:
  """Reads an EAGLE-3 head (either layout) for `target` (a loaded `Model`), checking it fits first.

  `dtype` ('float32', 'bfloat16'): the params; default the target's. Every
  mismatch with the target (tap width, vocabulary, layer ids, d2t range) and
  every missing tensor is a one-line `SpecjaxError`, raised before the weights
  are read.
  """
  dt = resolve_dtype(dtype) if dtype is not None or target.dtype is None else target.dtype
  path = resolve(path_or_hub_id)
  if not os.path.isdir(path):
    raise SpecjaxError(f'{path} is not a directory (an EAGLE-3 head is config.json + safetensors)')
  where = os.path.abspath(path)
  cfg, prefix = config_from_hf(read_hf_config(path), target.config.num_layers, where)
  headers = {}
  for f in safetensors_files(path):
    headers.update(safetensors_header(f))  # truncated or corrupt files fail here
  rename = lambda name: eagle3.LAYER + name[len(prefix) :] if name.startswith(prefix) else name
  shapes = {rename(n): tuple(h['shape']) for n, h in headers.items() if n not in IGNORED}
  cfg = dataclasses.replace(cfg, has_embedding='embed_tokens.weight' in shapes)
  _check_target(cfg, target, where)
  # Names and shapes from the headers alone, before any weight is read.
  want = eagle3.hf_shapes(cfg)
  original = lambda n: prefix + n[len(eagle3.LAYER) :] if n.startswith(eagle3.LAYER) else n
  check_tensor_shapes(shapes, want, where, ignore=('d2t', 't2d'), name=original)
  files = safetensors_files(path)
  d2t, t2d = _vocab_map(cfg, read_safetensors(files, skip=tuple(n for n in headers if n not in ('d2t', 't2d'))), where)
  tensors = {rename(n): w for n, w in read_safetensors(files, skip=('d2t', 't2d') + IGNORED).items()}
  abstract = nnx.eval_shape(lambda: Eagle3Head(cfg, attention_impl=attention_impl, dtype=dt))
  graphdef, params = fill(abstract, eagle3.params_from_hf(cfg, tensors), dt, where)
  return Eagle3Checkpoint(cfg, graphdef, params, d2t, t2d, where)


# ---------------------------------------------------------------- writing (layout 1)


def rope_to_hf(rope: Rope) -> dict[str, Any]:
  """`rope_theta` and `rope_scaling` as Llama configs spell them (the inverse of `llama.rope_from_hf`)."""
  if rope.rotary_dim or rope.freq_factors or rope.kind not in ('default', 'linear', 'llama3'):
    raise SpecjaxError(f'cannot export {rope} in a Llama config (default, linear or llama3 RoPE over the whole head)')
  scaling = None
  if rope.kind == 'linear':
    scaling = {'rope_type': 'linear', 'factor': rope.factor}
  elif rope.kind == 'llama3':
    scaling = {
        'rope_type': 'llama3',
        'factor': rope.factor,
        'low_freq_factor': rope.low_freq_factor,
        'high_freq_factor': rope.high_freq_factor,
        'original_max_position_embeddings': rope.original_max_position_embeddings,
    }
  return {'rope_theta': rope.base, 'rope_scaling': scaling}


def config_to_hf(cfg: Eagle3Config, dtype: str) -> dict[str, Any]:
  """config.json of layout 1, with the fields vLLM, SGLang and SpecForge read."""
  hf = {
      'architectures': [LAYOUT1_ARCHITECTURES[0]],
      'model_type': 'llama',
      'hidden_size': cfg.hidden_size,
      'intermediate_size': cfg.intermediate_size,
      'num_hidden_layers': 1,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'hidden_act': cfg.activation,
      'rms_norm_eps': cfg.norm_eps,
      **rope_to_hf(cfg.rope),
      'max_position_embeddings': cfg.max_position_embeddings,
      'vocab_size': cfg.vocab_size,
      'draft_vocab_size': cfg.draft_vocab_size,
      'norm_before_residual': cfg.norm_before_residual,
      'norm_before_fc': cfg.norm_before_fc,
      'fc_norm': cfg.fc_norm,
      'norm_output': cfg.norm_output,
      'tie_word_embeddings': False,
      'attention_bias': False,
      'mlp_bias': False,
      'pretraining_tp': 1,
      'torch_dtype': dtype,
      'use_cache': True,
      # SGLang / SpecForge read these as layer outputs (see the module docstring; vLLM reads them one layer earlier).
      'eagle_config': {'eagle_aux_hidden_state_layer_ids': list(cfg.taps), 'use_aux_hidden_state': True},
  }
  if cfg.target_hidden_size != cfg.hidden_size:
    hf['target_hidden_size'] = cfg.target_hidden_size
  return hf


def save_eagle3(
    directory: str,
    config: Eagle3Config,
    params: Any,  # nnx.State of an Eagle3Head, or its pure dict
    d2t: np.ndarray,  # [draft V] offsets: target id = draft id + d2t[draft id]
    t2d: np.ndarray | None = None,  # [V] bool
) -> None:
  """Writes layout 1 (config.json + model.safetensors) in the params' dtype; `load_eagle3` reads it back as is.

  Set `config.max_position_embeddings` to the target's context length: SGLang
  and vLLM cap the draft's positions by it, and a small value silently lowers
  acceptance on long prompts. Written atomically, files 0666 less the umask
  (`specjax.loading.hf.write_checkpoint`).
  """
  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  tensors = eagle3.params_to_hf(config, pure)
  d2t = np.asarray(d2t)
  if d2t.shape != (config.draft_vocab_size,):
    raise SpecjaxError(f'd2t must have shape [{config.draft_vocab_size}] (draft_vocab_size), got {list(d2t.shape)}')
  target_ids = np.arange(config.draft_vocab_size) + d2t
  if target_ids.min() < 0 or target_ids.max() >= config.vocab_size:
    raise SpecjaxError(f'd2t maps draft ids outside the target vocabulary (0..{config.vocab_size - 1})')
  tensors['d2t'] = d2t.astype(np.int64)
  if t2d is not None:
    t2d = np.asarray(t2d)
    if t2d.shape != (config.vocab_size,):
      raise SpecjaxError(f't2d must have shape [{config.vocab_size}] (vocab_size), got {list(t2d.shape)}')
    tensors['t2d'] = t2d.astype(bool)
  write_checkpoint(directory, {'config.json': config_to_hf(config, str(tensors['fc.weight'].dtype))}, tensors)
