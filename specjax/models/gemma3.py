"""Gemma 3 text: config and weight names over the shared decoder (`specjax.models.transformer`).

Facts (HF `modeling_gemma3.py`): embeddings scaled by sqrt(D); (1 + w)
RMSNorms; sandwich norms around attention and MLP; per-head q/k norms; NeoX
RoPE with base 1e6 on full layers and 1e4 on sliding ones; sliding windows that
hold W keys including the token itself; GeGLU MLP; tied head; optional final
logit softcap.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.errors import SpecjaxError
from specjax.models.layers import ACTIVATIONS, AttentionSpec, Rope
from specjax.models.transformer import DecoderLM, DecoderShape, DecoderSpec, decoder_params
from specjax.models.weights import tensor_taker

SLIDING, FULL = 'sliding_attention', 'full_attention'


@dataclasses.dataclass(frozen=True)
class Gemma3Config(DecoderShape):
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  rope_local_base_freq: float = 10_000.0
  rope_scaling_factor: float = 1.0  # linear scaling of full-attention layers (4B+)
  sliding_window: int = 512
  query_pre_attn_scalar: float = 256.0
  final_logit_softcapping: float | None = None
  attn_logit_softcapping: float | None = None
  hidden_activation: str = 'gelu_pytorch_tanh'
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = True

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> Gemma3Config:
    """Reads an HF `Gemma3TextConfig` dict (or the `text_config` of a Gemma 3)."""
    hf = hf.get('text_config', hf)
    try:
      layers = int(hf['num_hidden_layers'])
      layer_types = hf.get('layer_types')
      if layer_types is None:
        pattern = int(hf.get('sliding_window_pattern', 6))
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
      unknown = sorted(set(layer_types) - {SLIDING, FULL})
      if unknown or len(layer_types) != layers:
        raise SpecjaxError(
            f'gemma3 config: layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {unknown or len(layer_types)}'
        )
      scaling = hf.get('rope_scaling') or {}
      if scaling and scaling.get('rope_type', scaling.get('type')) not in ('linear', 'default'):
        raise SpecjaxError(f'gemma3 config: unsupported rope_scaling {scaling}')
      act = hf.get('hidden_activation') or hf.get('hidden_act') or 'gelu_pytorch_tanh'
      if act not in ACTIVATIONS:
        raise SpecjaxError(f'gemma3 config: unsupported activation {act!r}')
      heads = int(hf['num_attention_heads'])
      return cls(
          vocab_size=int(hf['vocab_size']),
          hidden_size=int(hf['hidden_size']),
          intermediate_size=int(hf['intermediate_size']),
          num_layers=layers,
          num_heads=heads,
          num_kv_heads=int(hf.get('num_key_value_heads', heads)),
          head_dim=int(hf.get('head_dim') or hf['hidden_size'] // heads),
          layer_types=tuple(layer_types),
          rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
          rope_theta=float(hf.get('rope_theta', 1e6)),
          rope_local_base_freq=float(hf.get('rope_local_base_freq', 1e4)),
          rope_scaling_factor=float(scaling.get('factor', 1.0)),
          sliding_window=int(hf.get('sliding_window') or 512),
          query_pre_attn_scalar=float(hf.get('query_pre_attn_scalar') or hf.get('head_dim') or 256),
          final_logit_softcapping=hf.get('final_logit_softcapping'),
          attn_logit_softcapping=hf.get('attn_logit_softcapping'),
          hidden_activation=act,
          max_position_embeddings=int(hf.get('max_position_embeddings', 32768)),
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', True)),
      )
    except KeyError as e:
      raise SpecjaxError(f'gemma3 config: missing key {e.args[0]!r}') from None

  def decoder_spec(self) -> DecoderSpec:
    layers = []
    for t in self.layer_types:
      sliding = t == SLIDING
      if sliding:
        rope = Rope(base=self.rope_local_base_freq)
      elif self.rope_scaling_factor != 1.0:
        rope = Rope(base=self.rope_theta, kind='linear', factor=self.rope_scaling_factor)
      else:
        rope = Rope(base=self.rope_theta)
      layers.append(
          AttentionSpec(
              self.num_heads,
              self.num_kv_heads,
              self.head_dim,
              rope,
              scale=self.query_pre_attn_scalar**-0.5,
              eps=self.rms_norm_eps,
              qk_norm=True,
              norm_offset=1.0,
              window=self.sliding_window if sliding else None,
              softcap=self.attn_logit_softcapping,
          )
      )
    return DecoderSpec(
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        layers=tuple(layers),
        activation=self.hidden_activation,
        norm_eps=self.rms_norm_eps,
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=True,
        tie_embeddings=self.tie_word_embeddings,
        final_softcap=self.final_logit_softcapping,
    )


def build(cfg: Gemma3Config, **kwargs) -> DecoderLM:
  return DecoderLM(cfg.decoder_spec(), **kwargs)


def params_from_hf(cfg: Gemma3Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Maps HF-named tensors (PyTorch layout) to the pure-dict state of the `DecoderLM`."""
  return decoder_params(cfg.decoder_spec(), tensor_taker(tensors), tensors)
