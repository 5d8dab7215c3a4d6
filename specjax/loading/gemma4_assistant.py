"""Gemma 4 assistant checkpoints (`gemma4_assistant`): reading, writing, and checking against a target.

Layout (a directory or a hub id): `config.json` (`model_type: gemma4_assistant`,
`backbone_hidden_size`, the centroid fields, a nested `text_config`),
`generation_config.json` (optional: `num_assistant_tokens`) and safetensors with
`model.embed_tokens`, `model.layers.{i}.self_attn.{q_proj,q_norm,o_proj}`, the MLP,
four sandwich norms and `layer_scalar` per layer, `model.norm`, `pre_projection`,
`post_projection`, optional `lm_head` (untied) and, for the centroid head,
`masked_embedding.{centroids,token_ordering}`. No k/v projections: every layer
reads the target's K/V.
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
    read_json,
    read_safetensors,
    safetensors_files,
    safetensors_header,
    write_checkpoint,
)
from specjax.models import gemma4_assistant as g4a
from specjax.models.gemma4_assistant import Gemma4Assistant, Gemma4AssistantConfig

ORDERING = 'masked_embedding.token_ordering'


@dataclasses.dataclass
class Gemma4AssistantCheckpoint:
  config: Gemma4AssistantConfig
  graphdef: nnx.GraphDef
  params: nnx.State
  source: str

  def module(self) -> Gemma4Assistant:
    return nnx.merge(self.graphdef, self.params)


def read_config(path_or_hub_id: str) -> tuple[str, Gemma4AssistantConfig]:
  """(directory, config) of an assistant checkpoint, without reading weights."""
  path = resolve(path_or_hub_id)
  if not os.path.isdir(path):
    raise SpecjaxError(f'{path} is not a directory (a Gemma 4 assistant is config.json + safetensors)')
  where = os.path.abspath(path)
  gen_path = os.path.join(path, 'generation_config.json')
  generation = read_json(gen_path) if os.path.exists(gen_path) else None
  return path, Gemma4AssistantConfig.from_hf(read_hf_config(path), generation, where)


def _token_ordering(files: list[str], cfg: Gemma4AssistantConfig, where: str) -> np.ndarray:
  """`token_ordering` [V] as read (integers, not widened to float), checked to be a permutation of the vocabulary."""
  from safetensors import safe_open

  for path in files:
    with safe_open(path, framework='numpy') as f:
      if ORDERING in f.keys():
        order = np.asarray(f.get_tensor(ORDERING))
        break
  if not np.issubdtype(order.dtype, np.integer) or not np.array_equal(
      np.sort(order), np.arange(cfg.vocab_size, dtype=order.dtype)
  ):
    raise SpecjaxError(f'{where}: {ORDERING} is not a permutation of the {cfg.vocab_size} token ids')
  return order


def load_gemma4_assistant(
    path_or_hub_id: str, *, dtype: str | None = None, attention_impl: str = 'auto'
) -> Gemma4AssistantCheckpoint:
  """Reads a Gemma 4 assistant (local directory or hub id).

  `dtype` ('float32', 'bfloat16'): the params; default float32 on CPU,
  bfloat16 on accelerators. A bad config, a layer with its own k/v
  projections, a missing, misshapen or unexpected tensor and a
  `token_ordering` that is not a permutation are one-line `SpecjaxError`s,
  raised before the weights are read (but `token_ordering`).
  """
  dt = resolve_dtype(dtype)
  path, cfg = read_config(path_or_hub_id)
  where = os.path.abspath(path)
  files = safetensors_files(path)
  shapes = {}
  for f in files:
    shapes.update({n: tuple(h['shape']) for n, h in safetensors_header(f).items()})  # truncated files fail here
  own_kv = sorted(n for n in shapes if n.startswith('model.layers.') and n.split('.')[-2] in g4a.KV_NAMES)
  if own_kv:
    raise SpecjaxError(
        f"{where}: {own_kv[0]} present ({len(own_kv)} k/v tensors); assistant layers must all read the target's K/V"
    )
  if cfg.tie_word_embeddings:
    shapes.pop('lm_head.weight', None)  # a tied copy
  want = g4a.hf_shapes(cfg)
  check_tensor_shapes(shapes, want, where)
  order = _token_ordering(files, cfg, where) if cfg.use_ordered_embeddings else None
  tensors = read_safetensors(files, skip=(ORDERING, 'lm_head.weight') if cfg.tie_word_embeddings else (ORDERING,))
  if order is not None:
    tensors[ORDERING] = order
  abstract = nnx.eval_shape(lambda: Gemma4Assistant(cfg, attention_impl=attention_impl, dtype=dt))
  graphdef, params = fill(abstract, g4a.params_from_hf(cfg, tensors), dt, where)
  return Gemma4AssistantCheckpoint(cfg, graphdef, params, where)


def check_against_target(
    cfg: Gemma4AssistantConfig,
    *,
    hidden_size: int,  # the target's width
    vocab_size: int,
    kv_shapes: dict[str, tuple[int, int]],  # layer type -> (kv heads, head dim) of the target's donor of that type
    where: str = 'gemma4 assistant',
) -> None:
  """Raises a one-line `SpecjaxError` unless the assistant can draft for a target of this shape."""
  if cfg.backbone_hidden_size != hidden_size:
    raise SpecjaxError(
        f"{where}: backbone_hidden_size {cfg.backbone_hidden_size} != the target's hidden size {hidden_size}"
    )
  if cfg.vocab_size != vocab_size:
    raise SpecjaxError(f"{where}: vocab_size {cfg.vocab_size} != the target's {vocab_size}")
  for kind in dict.fromkeys(cfg.layer_types):
    if kind not in kv_shapes:
      raise SpecjaxError(f'{where}: the target has no {kind} layer to lend its K/V (it has {sorted(kv_shapes)})')
    if tuple(kv_shapes[kind]) != cfg.kv_shape(kind):
      raise SpecjaxError(
          f"{where}: {kind} layers read (kv heads, head dim) {cfg.kv_shape(kind)}, the target's donor holds "
          f'{tuple(kv_shapes[kind])}'
      )


# ---------------------------------------------------------------- writing


def config_to_hf(cfg: Gemma4AssistantConfig, dtype: str) -> dict[str, Any]:
  """config.json in the Hub layout (`global_head_dim`; `per_layer_config` only for other full-layer kv heads)."""
  rope = {}
  for kind, r, dim in ((g4a.SLIDING, cfg.rope_sliding, cfg.head_dim), (g4a.FULL, cfg.rope_full, cfg.global_head_dim)):
    if r.kind == 'default' and not (r.rotary_dim or r.freq_factors):
      rope[kind] = {'rope_type': 'default', 'rope_theta': r.base}
    elif r.kind == 'proportional' and not (r.rotary_dim or r.freq_factors):
      rope[kind] = {
          'rope_type': 'proportional',
          'rope_theta': r.base,
          'partial_rotary_factor': 2 * r.rope_angles / dim,
          **({'factor': r.factor} if r.factor != 1.0 else {}),
      }
    else:
      raise SpecjaxError(f'cannot export {r} as a Gemma 4 {kind} rope (default or proportional)')
  text = {
      'model_type': 'gemma4_text',
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.hidden_size,
      'intermediate_size': cfg.intermediate_size,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'global_head_dim': cfg.global_head_dim,
      'hidden_activation': cfg.hidden_activation,
      'rms_norm_eps': cfg.rms_norm_eps,
      'sliding_window': cfg.sliding_window,
      'layer_types': list(cfg.layer_types),
      'rope_parameters': rope,
      'num_kv_shared_layers': cfg.num_layers,
      'hidden_size_per_layer_input': 0,
      'vocab_size_per_layer_input': 0,
      'enable_moe_block': False,
      'use_double_wide_mlp': False,
      'attention_k_eq_v': False,
      'final_logit_softcapping': None,
      'tie_word_embeddings': cfg.tie_word_embeddings,
  }
  if cfg.num_global_kv_heads != cfg.num_kv_heads:
    text['per_layer_config'] = {
        str(i): {'head_dim': cfg.global_head_dim, 'num_key_value_heads': cfg.num_global_kv_heads}
        for i, kind in enumerate(cfg.layer_types)
        if kind == g4a.FULL
    }
  return {
      'architectures': [g4a.ARCHITECTURE],
      'model_type': g4a.MODEL_TYPE,
      'backbone_hidden_size': cfg.backbone_hidden_size,
      'use_ordered_embeddings': cfg.use_ordered_embeddings,
      'num_centroids': cfg.num_centroids,
      'centroid_intermediate_top_k': cfg.centroid_intermediate_top_k,
      'tie_word_embeddings': cfg.tie_word_embeddings,
      'dtype': dtype,
      'text_config': text,
  }


def save_gemma4_assistant(directory: str, config: Gemma4AssistantConfig, params: Any) -> None:
  """Writes config.json, generation_config.json (with `num_assistant_tokens`, if set) and model.safetensors.

  Floats in the params' dtype, `token_ordering` int64 (as transformers
  stores it); `load_gemma4_assistant` reads it back as is.
  """
  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  tensors = g4a.params_to_hf(config, pure)
  if config.use_ordered_embeddings and not np.array_equal(np.sort(tensors[ORDERING]), np.arange(config.vocab_size)):
    raise SpecjaxError(f'token_ordering is not a permutation of the {config.vocab_size} token ids')
  files = {'config.json': config_to_hf(config, str(tensors['model.embed_tokens.weight'].dtype))}
  if config.num_assistant_tokens is not None:
    files['generation_config.json'] = {'num_assistant_tokens': config.num_assistant_tokens}
  write_checkpoint(directory, files, tensors)  # atomically, files 0666 less the umask
