"""DFlash 2 reference modules in PyTorch, for tools/make_fixtures.py (--only dflash2) only.

A transcription of z-lab/dflash `dflash/model.py` at commit
10129599dffb338ff38cfd235a53ca6d3667b4dd (MIT License, Copyright (c) 2026 Z Lab):
the draft model's classes (`Qwen3DFlashAttention`, `Qwen3DFlashDecoderLayer`,
`GroupedDynamicCausalConv`, `CandidateSelector`, `DFlashDraftModel`,
`DFlash2DraftModel`) and the helpers they call, kept as upstream wrote them.
Left out: `dflash_generate`, `spec_generate`, `_rejection_sample` and the CUDA
timing (make_fixtures.py drives the model itself), and `from_pretrained`'s key
mapping (the fixture writes and reads the tensors directly; upstream stores the
codebooks as `nn.Embedding` weights, the checkpoint without `.weight`).

The pinned clone of z-lab/dflash (44947fb) predates DFlash 2, and sglang's
`DFlash2DraftModel` (srt/models/dflash.py) cannot be imported without sglang's
runtime, so the fixture runs this file. The same math is in SpecForge
`specforge/modeling/draft/dflash2.py` @0dcf8859 (`DFlashGroupedConv`,
`CandidateSelector.build_lattice` / `greedy_path`), whose parameter names match
sglang's loader: `layers.{i}.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}`, `candidate_selector.{predecessor_codebook,
successor_codebook, hidden_projection.weight}`.

Runs in the side environment (torch 2.13, transformers 5.24); never imported by specjax.
"""

# pylint: disable=invalid-name,missing-function-docstring,missing-class-docstring
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import (
    ALL_ATTENTION_FUNCTIONS,
    GradientCheckpointingLayer,
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def extract_context_feature(
    hidden_states: list[torch.Tensor],
    layer_ids: list[int] | None,
) -> torch.Tensor:
  offset = 1
  selected_states = [hidden_states[layer_id + offset] for layer_id in layer_ids]
  return torch.cat(selected_states, dim=-1)


def _sampling_probs(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
  scores = logits.float() / temperature
  vocab_size = scores.shape[-1]
  if 0 < top_k < vocab_size:
    scores, indices = torch.topk(scores, top_k, dim=-1)
  else:
    indices = None

  probs = torch.softmax(scores, dim=-1)
  if top_p < 1.0:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)

  if indices is not None:
    probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, indices, probs)
  return probs


def _sample_probs(probs: torch.Tensor) -> torch.Tensor:
  shape = probs.shape[:-1]
  return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(shape)


def _draft_config(config):
  return getattr(config, 'dflash_config', {})


def _draft_value(config, name, default=None):
  return _draft_config(config).get(name, getattr(config, name, default))


def _attention_mask(query, key, *, is_causal, sliding_window):
  query_position = key.shape[-2] - query.shape[-2] + torch.arange(query.shape[-2], device=query.device)[:, None]
  key_position = torch.arange(key.shape[-2], device=query.device)[None, :]
  visible = torch.ones((query.shape[-2], key.shape[-2]), dtype=torch.bool, device=query.device)
  if is_causal:
    visible &= key_position <= query_position
  if sliding_window is not None:
    visible &= query_position - key_position < sliding_window
    if not is_causal:
      visible &= key_position - query_position < sliding_window
  return visible[None, None]


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
  cos = cos.unsqueeze(unsqueeze_dim)
  sin = sin.unsqueeze(unsqueeze_dim)
  q_len = q.size(-2)
  q_embed = (q * cos[..., -q_len:, :]) + (rotate_half(q) * sin[..., -q_len:, :])
  k_embed = (k * cos) + (rotate_half(k) * sin)
  return q_embed, k_embed


class Qwen3DFlashAttention(nn.Module):

  def __init__(self, config: Qwen3Config, layer_idx: int):
    super().__init__()
    self.config = config
    self.layer_idx = layer_idx
    self.head_dim = getattr(config, 'head_dim', config.hidden_size // config.num_attention_heads)
    self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
    self.scaling = self.head_dim**-0.5
    self.attention_dropout = config.attention_dropout
    self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
    self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
    self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
    self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
    self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
    self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
    layer_types = getattr(config, 'layer_types', None)
    layer_type = layer_types[layer_idx] if layer_types else 'full_attention'
    is_causal = getattr(config, 'is_causal', None)
    self.is_causal = layer_type == 'sliding_attention' if is_causal is None else bool(is_causal)
    self.sliding_window = config.sliding_window if layer_type == 'sliding_attention' else None

  def forward(
      self,
      hidden_states: torch.Tensor,
      target_hidden: torch.Tensor,
      position_embeddings: tuple[torch.Tensor, torch.Tensor],
      attention_mask: torch.Tensor | None,
      past_key_values: Cache | None = None,
      cache_position: torch.LongTensor | None = None,
      **kwargs,
  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    bsz, q_len = hidden_states.shape[:-1]
    ctx_len = target_hidden.shape[1]
    q = self.q_proj(hidden_states)
    q = q.view(bsz, q_len, -1, self.head_dim)
    q = self.q_norm(q).transpose(1, 2)
    k_ctx = self.k_proj(target_hidden)
    k_noise = self.k_proj(hidden_states)
    v_ctx = self.v_proj(target_hidden)
    v_noise = self.v_proj(hidden_states)
    k = torch.cat([k_ctx, k_noise], dim=1).view(bsz, ctx_len + q_len, -1, self.head_dim)
    v = torch.cat([v_ctx, v_noise], dim=1).view(bsz, ctx_len + q_len, -1, self.head_dim)
    k = self.k_norm(k).transpose(1, 2)
    v = v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if past_key_values is not None:
      cache_kwargs = {'sin': sin, 'cos': cos, 'cache_position': cache_position}
      k, v = past_key_values.update(k, v, self.layer_idx, cache_kwargs)
    if attention_mask is None and (self.is_causal or self.sliding_window is not None):
      attention_mask = _attention_mask(
          q,
          k,
          is_causal=self.is_causal,
          sliding_window=self.sliding_window,
      )
    attn_output, attn_weights = ALL_ATTENTION_FUNCTIONS['sdpa'](
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=self.sliding_window,
        **kwargs,
    )
    attn_output = attn_output.reshape(bsz, q_len, -1)
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


class Qwen3DFlashDecoderLayer(GradientCheckpointingLayer):

  def __init__(self, config: Qwen3Config, layer_idx: int):
    super().__init__()
    self.self_attn = Qwen3DFlashAttention(config=config, layer_idx=layer_idx)
    self.mlp = Qwen3MLP(config)
    self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.attention_conv = None
    self.mlp_conv = None

  def forward(
      self,
      target_hidden: torch.Tensor | None = None,
      hidden_states: torch.Tensor | None = None,
      attention_mask: torch.Tensor | None = None,
      position_ids: torch.LongTensor | None = None,
      past_key_value: Cache | None = None,
      output_attentions: bool | None = False,
      use_cache: bool | None = False,
      cache_position: torch.LongTensor | None = None,
      position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
      **kwargs,
  ) -> torch.Tensor:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attention_kernel = None
    if self.attention_conv is not None:
      hidden_states, attention_kernel = self.attention_conv.prepare(hidden_states)
    hidden_states = self.self_attn(
        hidden_states=hidden_states,
        target_hidden=target_hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_value,
        output_attentions=output_attentions,
        use_cache=use_cache,
        cache_position=cache_position,
        position_embeddings=position_embeddings,
        **kwargs,
    )[0]
    if attention_kernel is not None:
      hidden_states = self.attention_conv.finish(hidden_states, attention_kernel)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    mlp_kernel = None
    if self.mlp_conv is not None:
      hidden_states, mlp_kernel = self.mlp_conv.prepare(hidden_states)
    hidden_states = self.mlp(hidden_states)
    if mlp_kernel is not None:
      hidden_states = self.mlp_conv.finish(hidden_states, mlp_kernel)
    hidden_states = residual + hidden_states
    return hidden_states


def _grouped_dynamic_convolve(hidden, dynamic, base, group_size):
  batch, length, hidden_size = hidden.shape
  groups = hidden_size // group_size
  blocks = hidden.view(batch, length, groups, group_size)
  dynamic = dynamic.view(batch, length, base.shape[0], groups, 1)
  output = torch.zeros_like(blocks)
  for offset in range(base.shape[0]):
    values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
    kernel = base[offset].view(1, 1, groups, group_size).to(hidden.dtype)
    output = output + kernel * values
    output = torch.addcmul(output, dynamic[:, :, offset], values)
  return output.view_as(hidden)


class GroupedDynamicCausalConv(nn.Module):

  def __init__(self, hidden_size, kernel_size, group_size):
    super().__init__()
    self.kernel_size = kernel_size
    self.group_size = group_size
    groups = hidden_size // group_size
    self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
    self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

  def prepare(self, hidden):
    groups = hidden.shape[-1] // self.group_size
    dynamic = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.kernel_size, groups)
    return (
        _grouped_dynamic_convolve(hidden, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size),
        dynamic[..., 1, :, :],
    )

  def finish(self, hidden, dynamic):
    return _grouped_dynamic_convolve(hidden, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):

  def __init__(self, config):
    super().__init__()
    rank = int(_draft_value(config, 'selector_rank'))
    self.top_k = int(_draft_value(config, 'selector_top_k'))
    self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
    self.successor_codebook = nn.Embedding(config.vocab_size, rank)
    self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

  def select(self, hidden, logits, anchor_ids, temperature):
    unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
    hidden = self.hidden_projection(hidden)
    predecessor = anchor_ids
    path, q_rows = [], []
    for position in range(hidden.shape[1]):
      scores = unary[:, position] + torch.einsum(
          'br,bkr->bk',
          self.predecessor_codebook(predecessor) * hidden[:, position],
          self.successor_codebook(candidates[:, position]),
      )
      if temperature > 0:
        q = _sampling_probs(scores[:, None], temperature)[:, 0]
        index = _sample_probs(q)
        q_rows.append(q)
      else:
        index = torch.argmax(scores, dim=-1)
      predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
      path.append(predecessor)
    return (
        torch.stack(path, dim=1),
        candidates,
        torch.stack(q_rows, dim=1) if q_rows else None,
    )


class DFlashDraftModel(Qwen3PreTrainedModel):
  config_class = Qwen3Config
  _no_split_modules: ClassVar[list[str]] = ['Qwen3DFlashDecoderLayer']

  def __init__(self, config) -> None:
    super().__init__(config)
    self.config = config
    self.layers = nn.ModuleList(
        [Qwen3DFlashDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
    )
    self.target_layer_ids = _draft_value(config, 'target_layer_ids')
    if self.target_layer_ids is None:
      raise ValueError('Draft config must define dflash_config.target_layer_ids.')
    self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.rotary_emb = Qwen3RotaryEmbedding(config)
    self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
    self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    self.block_size = int(_draft_value(config, 'block_size', 16))
    self.mask_token_id = _draft_value(config, 'mask_token_id')
    self.post_init()

  def forward(
      self,
      position_ids: torch.LongTensor,
      attention_mask: torch.Tensor | None = None,
      noise_embedding: torch.Tensor | None = None,
      target_hidden: torch.Tensor | None = None,
      past_key_values: Cache | None = None,
      use_cache: bool = False,
      **kwargs,
  ) -> torch.Tensor:
    hidden_states = noise_embedding
    target_hidden = self.hidden_norm(self.fc(target_hidden))
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    for layer in self.layers:
      hidden_states = layer(
          hidden_states=hidden_states,
          target_hidden=target_hidden,
          attention_mask=attention_mask,
          position_ids=position_ids,
          past_key_value=past_key_values,
          use_cache=use_cache,
          position_embeddings=position_embeddings,
          **kwargs,
      )
    return self.norm(hidden_states)

  def compute_logits(self, hidden, output_head):
    logits = output_head(hidden)
    logits = logits * float(_draft_value(self.config, 'output_multiplier', 1.0))
    softcap = _draft_value(self.config, 'final_logit_softcapping')
    if softcap is not None and float(softcap) > 0:
      logits = torch.tanh(logits / float(softcap)) * float(softcap)
    return logits


class DFlash2DraftModel(DFlashDraftModel):

  def __init__(self, config) -> None:
    super().__init__(config)
    kernel_size = int(_draft_value(config, 'conv_kernel_size'))
    group_size = int(_draft_value(config, 'conv_group_size'))
    for layer in self.layers:
      layer.attention_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)
      layer.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, kernel_size, group_size)
    self.candidate_selector = CandidateSelector(config)
    self.post_init()

  def propose(self, hidden, anchor_ids, output_head, temperature):
    return self.candidate_selector.select(
        hidden,
        self.compute_logits(hidden, output_head),
        anchor_ids,
        temperature,
    )
