"""DFlash draft checkpoints (z-lab / SpecForge layout): reading one against a target, and writing one.

Layout: a directory (or hub id) with `config.json` (`architectures:
["DFlashDraftModel"]`, the Qwen3 shape fields, `block_size`,
`dflash_config.{mask_token_id, target_layer_ids}`, `num_target_layers`,
optional `layer_types` / `sliding_window`) and safetensors `fc [H, n_taps * H]`,
`hidden_norm`, `layers.{i}.*` (Qwen3 layers with q/k norms), `norm`. No
embedding or head: the target's are used.

Tap ids: upstream reads `hidden_states[id + 1]` (z-lab `extract_context_feature`,
offset 1: index 0 is the embedding output), i.e. the output of layer `id`,
0-based: specjax's tap convention as is. transformers' last `hidden_states`
entry is final-normed, so ids must stay below L - 1 (defaults reach L - 3).
Default ids (`build_target_layer_ids`): `round(1 + i * (L - 4) / (n - 1))` for the
n draft layers, `[L // 2]` for one.

DFlash 2 (`architectures: ["DFlash2DraftModel"]`, as z-lab, sglang and vLLM
detect it): the same backbone; `dflash_config` holds `block_size`,
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`,
`output_multiplier`, `final_logit_softcapping` (each also read at the top
level, dflash_config first, as z-lab's `_draft_value`), plus the tensors
`layers.{i}.{attention,mlp}_conv.{base_kernel [2, taps, H],
kernel_projection.weight [2 * taps * H / group, H]}` and
`candidate_selector.{predecessor_codebook, successor_codebook} [V, rank]`,
`candidate_selector.hidden_projection.weight [rank, H]`. Block attention is
causal where `is_causal` says so; without the key, DFlash 2's sliding layers
are causal (z-lab's default) and DFlash 1's never (SpecForge's).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading import fill, resolve, resolve_dtype
from specjax.loading.eagle3 import rope_to_hf
from specjax.loading.hf import (
    check_tensor_shapes,
    read_hf_config,
    read_safetensors,
    safetensors_files,
    safetensors_header,
    write_checkpoint,
)
from specjax.models import dflash
from specjax.models.dflash import DFlashConfig, DFlashDraft
from specjax.models.layers import ACTIVATIONS
from specjax.models.llama import attention_fields

ARCHITECTURE = 'DFlashDraftModel'
ARCHITECTURE2 = 'DFlash2DraftModel'
# Names that only DFlash 2 has (sglang `DFlash2DraftModel`, `DFlashGroupedConv`, `CandidateSelector`).
DFLASH2_MARKERS = ('kernel_projection', 'base_kernel', 'codebook', 'hidden_projection', 'selector')
DFLASH2_SIZES = ('conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k')


@dataclasses.dataclass
class DFlashCheckpoint:
  config: DFlashConfig
  graphdef: nnx.GraphDef
  params: nnx.State
  source: str

  def module(self) -> DFlashDraft:
    return nnx.merge(self.graphdef, self.params)


def default_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """z-lab / SpecForge `build_target_layer_ids`: evenly spaced from layer 1 to L - 3 (one draft layer: L // 2)."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def is_dflash(hf: dict) -> bool:
  return bool({ARCHITECTURE, ARCHITECTURE2} & set(hf.get('architectures') or [])) or 'dflash_config' in hf


def is_dflash2(hf: dict) -> bool:
  return ARCHITECTURE2 in (hf.get('architectures') or [])


def default_causal(dflash2: bool, layer_types) -> tuple[bool, ...]:
  """Causal block layers without `is_causal`: DFlash 2's sliding layers (z-lab's rule); DFlash 1: none (SpecForge)."""
  return tuple(dflash2 and t == 'sliding_attention' for t in layer_types)


def _dflash2_fields(value, where: str) -> dict[str, Any]:
  """DFlash 2's config fields (`value(name)`: dflash_config first, then the top level)."""
  sizes = {}
  for name in DFLASH2_SIZES:
    size = value(name)
    if size is None:
      raise SpecjaxError(f'{where}: {ARCHITECTURE2} needs dflash_config.{name}')
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
      raise SpecjaxError(f'{where}: dflash_config.{name} must be a positive integer, got {size!r}')
    sizes[name] = size
  multiplier, cap = value('output_multiplier', 1.0), value('final_logit_softcapping')
  for name, x in (('output_multiplier', multiplier), ('final_logit_softcapping', cap)):
    if x is None and name == 'final_logit_softcapping':
      continue
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < float('inf'):
      raise SpecjaxError(f'{where}: dflash_config.{name} must be a positive number, got {x!r}')
  return {
      'conv_taps': sizes['conv_kernel_size'],
      'conv_group_size': sizes['conv_group_size'],
      'selector_rank': sizes['selector_rank'],
      'selector_top_k': sizes['selector_top_k'],
      'output_multiplier': float(multiplier),
      'logit_softcap': None if cap is None else float(cap),
  }


def config_from_hf(hf: dict, target_config: Any, where: str) -> DFlashConfig:
  """The draft's config, checked against the target's (`Model.config`): hidden size, vocab, layers, taps, mask id."""
  if not is_dflash(hf):
    raise SpecjaxError(
        f'{where}: not a DFlash draft: architectures {hf.get("architectures")} (expected {ARCHITECTURE})'
    )
  try:
    dcfg = hf.get('dflash_config') or {}
    value = lambda name, default=None: dcfg.get(name, hf.get(name, default))  # z-lab's `_draft_value`
    for key in ('projector_type', 'pure_draft_prefix_len', 'shift_label'):
      if dcfg.get(key):
        raise SpecjaxError(f'{where}: dflash_config.{key}={dcfg[key]!r} is not supported (plain DFlash only)')
    for flag in ('attention_bias', 'mlp_bias'):
      if hf.get(flag):
        raise SpecjaxError(f'{where}: {flag}=true is not supported')
    act = hf.get('hidden_act', 'silu')
    if act not in ACTIVATIONS:
      raise SpecjaxError(f'{where}: unsupported activation {act!r}')
    layers = int(hf['num_hidden_layers'])
    vocab = int(hf['vocab_size'])
    if value('block_size') is None:
      raise KeyError('block_size')
    block = int(value('block_size'))
    target_layers = int(hf.get('num_target_layers') or target_config.num_layers)
    types = hf.get('layer_types') or ['full_attention'] * layers
    if len(types) != layers or set(types) - {'full_attention', 'sliding_attention'}:
      raise SpecjaxError(
          f'{where}: layer_types {types} must name full_attention / sliding_attention for {layers} layers'
      )
    window = hf.get('sliding_window')
    if 'sliding_attention' in types and not (isinstance(window, int) and window > 0):
      raise SpecjaxError(f'{where}: sliding_attention layers need a positive sliding_window, got {window!r}')
    mask, ids = value('mask_token_id'), value('target_layer_ids')
    extra = _dflash2_fields(value, where) if is_dflash2(hf) else {}
    causal = hf.get('is_causal')
    if causal is not None and not isinstance(causal, bool):
      raise SpecjaxError(f'{where}: is_causal must be true or false, got {causal!r}')
    if causal is None:
      causal = list(default_causal(bool(extra), types))
    cfg = DFlashConfig(
        **attention_fields(hf, where),
        num_layers=layers,
        block_size=block,
        mask_token_id=-1 if mask is None else int(mask),
        taps=default_taps(target_layers, layers) if ids is None else tuple(int(i) for i in ids),
        num_target_layers=target_layers,
        vocab_size=vocab,
        windows=tuple(window if t == 'sliding_attention' else None for t in types),
        max_position_embeddings=int(hf.get('max_position_embeddings') or 40960),
        activation=act,
        causal=tuple(causal) if isinstance(causal, list) else (causal,) * layers,
        **extra,
    )
  except KeyError as e:
    raise SpecjaxError(f'{where}: missing key {e.args[0]!r}') from None
  except (TypeError, ValueError) as e:
    raise SpecjaxError(f'{where}: bad value in the config: {e}') from None
  _check(cfg, target_config, ids is None, where)
  return cfg


def _check(cfg: DFlashConfig, t: Any, default_ids: bool, where: str) -> None:
  if cfg.num_heads % cfg.num_kv_heads:
    raise SpecjaxError(
        f'{where}: num_attention_heads ({cfg.num_heads}) is not a multiple of num_key_value_heads ({cfg.num_kv_heads})'
    )
  if cfg.block_size < 2:
    raise SpecjaxError(f'{where}: block_size {cfg.block_size} drafts nothing (it must be at least 2)')
  if cfg.hidden_size != t.hidden_size:
    raise SpecjaxError(f"{where}: hidden size {cfg.hidden_size} != the target's {t.hidden_size}")
  if cfg.vocab_size != t.vocab_size:
    raise SpecjaxError(f"{where}: vocab_size {cfg.vocab_size} != the target's vocabulary ({t.vocab_size})")
  if cfg.num_target_layers != t.num_layers:
    raise SpecjaxError(
        f"{where}: num_target_layers {cfg.num_target_layers} != the target's {t.num_layers} layers "
        '(the draft was trained on another target)'
    )
  if not all(0 <= i < t.num_layers - 1 for i in cfg.taps):
    origin = 'the default target_layer_ids' if default_ids else 'dflash_config.target_layer_ids'
    raise SpecjaxError(
        f'{where}: {origin} {list(cfg.taps)} (outputs of layers, 0-based) must be in 0..{t.num_layers - 2} for the '
        f"target's {t.num_layers} layers"
    )
  if cfg.conv_taps and cfg.hidden_size % cfg.conv_group_size:
    raise SpecjaxError(
        f'{where}: dflash_config.conv_group_size {cfg.conv_group_size} does not divide hidden_size {cfg.hidden_size}'
    )
  if cfg.conv_taps > cfg.block_size:
    raise SpecjaxError(f'{where}: dflash_config.conv_kernel_size {cfg.conv_taps} exceeds block_size {cfg.block_size}')
  if cfg.selector_top_k > cfg.vocab_size:
    raise SpecjaxError(
        f'{where}: dflash_config.selector_top_k {cfg.selector_top_k} exceeds the vocabulary ({cfg.vocab_size})'
    )
  if not 0 <= cfg.mask_token_id < t.vocab_size:
    raise SpecjaxError(
        f'{where}: dflash_config.mask_token_id {cfg.mask_token_id if cfg.mask_token_id >= 0 else None} must be a '
        f'token id inside the vocabulary (0..{t.vocab_size - 1})'
    )


def read_config(path_or_hub_id: str) -> tuple[str, dict]:
  """(directory, config.json) of a DFlash checkpoint, without reading weights."""
  path = resolve(path_or_hub_id)
  if not os.path.isdir(path):
    raise SpecjaxError(f'{path} is not a directory (a DFlash draft is config.json + safetensors)')
  return path, read_hf_config(path)


def load_dflash(
    path_or_hub_id: str, target: Any, *, dtype: str | None = None, attention_impl: str = 'auto'
) -> DFlashCheckpoint:
  """Reads a DFlash draft for `target` (a loaded `Model`); every mismatch is one `SpecjaxError` before weights."""
  dt = resolve_dtype(dtype) if dtype is not None or target.dtype is None else target.dtype
  path, hf = read_config(path_or_hub_id)
  where = os.path.abspath(path)
  cfg = config_from_hf(hf, target.config, where)  # the architecture and config first, then the weights' headers
  headers = {}
  for f in safetensors_files(path):
    headers.update(safetensors_header(f))  # truncated or corrupt files fail here
  stray = [n for n in headers if not cfg.is_dflash2 and any(m in n for m in DFLASH2_MARKERS)]
  if stray:
    raise SpecjaxError(
        f'{where}: DFlash 2 tensors ({", ".join(stray[:2])}, ...) but architectures {hf.get("architectures")} do '
        f'not name {ARCHITECTURE2}'
    )
  shapes = {n: tuple(h['shape']) for n, h in headers.items()}
  want = dflash.hf_shapes(cfg)
  check_tensor_shapes(shapes, want, where)
  tensors = read_safetensors(safetensors_files(path))
  abstract = nnx.eval_shape(lambda: DFlashDraft(cfg, attention_impl=attention_impl, dtype=dt))
  graphdef, params = fill(abstract, dflash.params_from_hf(cfg, tensors), dt, where)
  return DFlashCheckpoint(cfg, graphdef, params, where)


def _default_causal(cfg: DFlashConfig) -> tuple[bool, ...]:
  types = ['full_attention' if w is None else 'sliding_attention' for w in cfg.windows]
  return default_causal(cfg.is_dflash2, types)


def config_to_hf(cfg: DFlashConfig, dtype: str) -> dict[str, Any]:
  """config.json in the z-lab / SpecForge layout (DFlash 2: every DFlash field under dflash_config, as z-lab's)."""
  sliding = [w for w in cfg.windows if w is not None]
  dflash = {'mask_token_id': cfg.mask_token_id, 'target_layer_ids': list(cfg.taps)}
  head = {'architectures': [ARCHITECTURE], 'model_type': 'qwen3', 'block_size': cfg.block_size}
  if cfg.is_dflash2:
    dflash.update(
        block_size=cfg.block_size,
        conv_kernel_size=cfg.conv_taps,
        conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k,
        output_multiplier=cfg.output_multiplier,
        final_logit_softcapping=cfg.logit_softcap,
    )
    head = {'architectures': [ARCHITECTURE2], 'model_type': 'qwen3'}
  if cfg.causal != _default_causal(cfg):
    head['is_causal'] = cfg.causal[0]
  return {
      **head,
      'dflash_config': dict(sorted(dflash.items())),
      'num_target_layers': cfg.num_target_layers,
      'hidden_size': cfg.hidden_size,
      'intermediate_size': cfg.intermediate_size,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'hidden_act': cfg.activation,
      'rms_norm_eps': cfg.norm_eps,
      **rope_to_hf(cfg.rope),
      'max_position_embeddings': cfg.max_position_embeddings,
      'vocab_size': cfg.vocab_size,
      'layer_types': ['full_attention' if w is None else 'sliding_attention' for w in cfg.windows],
      'use_sliding_window': bool(sliding),
      'sliding_window': sliding[0] if sliding else None,
      'max_window_layers': cfg.num_layers,
      'attention_bias': False,
      'attention_dropout': 0.0,
      'tie_word_embeddings': False,
      'torch_dtype': dtype,
      'use_cache': True,
  }


def save_dflash(directory: str, config: DFlashConfig, params: Any) -> None:
  """Writes config.json + model.safetensors (z-lab / SpecForge layout) in the params' dtype.

  Atomically, files 0666 less the umask (`specjax.loading.hf.write_checkpoint`).
  """
  if len({w for w in config.windows if w is not None}) > 1:
    raise SpecjaxError('cannot export sliding layers with different windows (one sliding_window in the config)')
  if config.causal != _default_causal(config) and len(set(config.causal)) > 1:
    raise SpecjaxError('cannot export these causal and non-causal layers (one is_causal in the config)')
  if config.is_dflash2 and not (config.conv_taps and config.selector_rank):
    raise SpecjaxError('cannot export a DFlash 2 draft without both its convolutions and its selector')
  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  tensors = dflash.params_to_hf(config, pure)
  write_checkpoint(directory, {'config.json': config_to_hf(config, str(tensors['fc.weight'].dtype))}, tensors)
