"""Llama-style dense targets: Llama 3.x, Mistral and Qwen3, over the shared decoder.

Facts (HF `modeling_llama.py`, `modeling_mistral.py`, `modeling_qwen3.py`):
pre-norm blocks with plain-weight RMSNorms (`input_layernorm` before attention,
`post_attention_layernorm` before the MLP), SwiGLU MLP, NeoX RoPE over the
whole head, attention scale head_dim^-0.5, no embedding scale. Llama 3.1+
scales RoPE frequencies (`rope_type: llama3`); Mistral v0.1 attends within a
sliding window of W keys including the token itself (later versions set
`sliding_window: null`); Qwen3 adds per-head q/k RMSNorms before RoPE, sets
`head_dim` on its own and may slide its window on layers >= `max_window_layers`
(`use_sliding_window`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.errors import SpecjaxError
from specjax.models.layers import ACTIVATIONS, AttentionSpec, Rope
from specjax.models.transformer import DecoderLM, DecoderShape, DecoderSpec, decoder_params
from specjax.models.weights import tensor_taker

MODEL_TYPES = ('llama', 'mistral', 'qwen3')
SLIDING, FULL = 'sliding_attention', 'full_attention'


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderShape):
  model_type: str
  rope: Rope
  rms_norm_eps: float = 1e-5
  sliding_window: int | None = None
  qk_norm: bool = False
  hidden_act: str = 'silu'
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 8192

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
    """Reads an HF `LlamaConfig` / `MistralConfig` / `Qwen3Config` dict."""
    model_type = hf.get('model_type')
    where = f'{model_type} config'
    try:
      for flag in ('attention_bias', 'mlp_bias'):
        if hf.get(flag):
          raise SpecjaxError(f'{where}: {flag}=true is not supported')
      act = hf.get('hidden_act', 'silu')
      if act not in ACTIVATIONS:
        raise SpecjaxError(f'{where}: unsupported activation {act!r}')
      layers = int(hf['num_hidden_layers'])
      heads = int(hf['num_attention_heads'])
      window = hf.get('sliding_window')
      if model_type == 'qwen3' and not hf.get('use_sliding_window', False):
        window = None
      layer_types = hf.get('layer_types')
      if layer_types is None:
        first = int(hf.get('max_window_layers', 0)) if model_type == 'qwen3' else 0
        layer_types = [SLIDING if window and i >= first else FULL for i in range(layers)]
      unknown = sorted(set(layer_types) - {SLIDING, FULL})
      if unknown or len(layer_types) != layers:
        raise SpecjaxError(
            f'{where}: layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {unknown or len(layer_types)}'
        )
      if SLIDING in layer_types and not window:
        raise SpecjaxError(f'{where}: sliding_attention layers need a sliding_window')
      head_dim = int(hf.get('head_dim') or int(hf['hidden_size']) // heads)
      cfg = cls(
          model_type=model_type,
          vocab_size=int(hf['vocab_size']),
          hidden_size=int(hf['hidden_size']),
          intermediate_size=int(hf['intermediate_size']),
          num_layers=layers,
          num_heads=heads,
          num_kv_heads=int(hf.get('num_key_value_heads') or heads),
          head_dim=head_dim,
          layer_types=tuple(layer_types),
          rope=rope_from_hf(hf, where),
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-5)),
          sliding_window=int(window) if window else None,
          qk_norm=model_type == 'qwen3',
          hidden_act=act,
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
          max_position_embeddings=int(hf.get('max_position_embeddings', 8192)),
      )
    except KeyError as e:
      raise SpecjaxError(f'{where}: missing key {e.args[0]!r}') from None
    if cfg.num_heads % cfg.num_kv_heads:
      raise SpecjaxError(
          f'{where}: num_attention_heads ({cfg.num_heads}) is not a multiple of '
          f'num_key_value_heads ({cfg.num_kv_heads})'
      )
    return cfg

  def decoder_spec(self) -> DecoderSpec:
    layers = tuple(
        AttentionSpec(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.rope,
            scale=self.head_dim**-0.5,
            eps=self.rms_norm_eps,
            qk_norm=self.qk_norm,
            window=self.sliding_window if t == SLIDING else None,
        )
        for t in self.layer_types
    )
    return DecoderSpec(
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        layers=layers,
        activation=self.hidden_act,
        norm_eps=self.rms_norm_eps,
        tie_embeddings=self.tie_word_embeddings,
    )


def attention_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
  """The Llama-shape fields of an HF config (drafter heads' configs use these names)."""
  hidden, heads = int(hf['hidden_size']), int(hf['num_attention_heads'])
  return {
      'hidden_size': hidden,
      'intermediate_size': int(hf['intermediate_size']),
      'num_heads': heads,
      'num_kv_heads': int(hf.get('num_key_value_heads') or heads),
      'head_dim': int(hf.get('head_dim') or hidden // heads),
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'rope': rope_from_hf(hf, where),
  }


def rope_from_hf(hf: dict[str, Any], where: str) -> Rope:
  """RoPE from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
  params = dict(hf.get('rope_scaling') or {})
  params.update(hf.get('rope_parameters') or {})
  base = float(params.get('rope_theta') or hf.get('rope_theta') or 10_000.0)
  kind = params.get('rope_type', params.get('type', 'default'))
  factors = tuple(float(f) for f in hf.get('rope_freq_factors') or ())  # GGUF `rope_freqs`
  if kind == 'default':
    return Rope(base=base, freq_factors=factors)
  if kind == 'linear':
    return Rope(base=base, kind='linear', factor=float(params['factor']), freq_factors=factors)
  if kind == 'llama3':
    try:
      return Rope(
          base=base,
          kind='llama3',
          factor=float(params['factor']),
          low_freq_factor=float(params['low_freq_factor']),
          high_freq_factor=float(params['high_freq_factor']),
          original_max_position_embeddings=int(params['original_max_position_embeddings']),
      )
    except KeyError as e:
      raise SpecjaxError(f'{where}: llama3 rope scaling is missing {e.args[0]!r}') from None
  raise SpecjaxError(f'{where}: unsupported rope scaling {kind!r} (supported: default, linear, llama3)')


def build(cfg: LlamaConfig, **kwargs) -> DecoderLM:
  return DecoderLM(cfg.decoder_spec(), **kwargs)


def params_from_hf(cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps HF-named tensors (PyTorch layout) to the pure-dict state of the `DecoderLM`."""
  return decoder_params(cfg.decoder_spec(), tensor_taker(tensors), tensors)
