"""The EAGLE-3 draft head as a Flax NNX module (SafeAILab/EAGLE, SpecForge, vLLM, speculators).

Facts (EAGLE `eagle/model/cnets.py`, SpecForge `modeling/draft/llama3_eagle.py`,
vLLM `model_executor/models/llama_eagle3.py`): the target's residual stream
after a few layers (the taps, by default the outputs of layers 1, L/2 - 1 and
L - 4 of an L-layer target) is concatenated and projected by `fc` (no bias) to
the head's width H. One Llama decoder layer follows whose attention reads 2H:
`concat(input_layernorm(embed(x)), hidden_norm(h))` (embedding first), with the
residual `h` (or `hidden_norm(h)` with `norm_before_residual`); the MLP is
pre-normed by `post_attention_layernorm`. The layer output, before the final
norm, is what the next draft step feeds back as `h`; `lm_head(norm(out))` scores
a draft vocabulary, mapped to target ids by `d2t` (target = draft + d2t[draft]).
Variants (config flags of vLLM, SGLang and speculators checkpoints):
`norm_before_fc` RMS-normalises the concatenated taps before `fc` (`input_norm`,
one weight over n·H); `fc_norm` normalises each tap on its own (`fc_norm.{i}`,
EAGLE 3.1), after `input_norm` when both are set; `norm_output` feeds the next
step the final-normed output instead of the residual (EAGLE 3.1), so `logits`
does not norm it again.
The embedding is the target's table, a raw lookup (no Gemma sqrt(H) scale),
unless the checkpoint ships its own `embed_tokens`. RMSNorms are plain `x * w`.

Einsum letters: B batch, T tokens, E concatenated taps, D head width, V draft vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache.paged import KVCache
from specjax.models.contract import CacheLayout, PagedKV, StepInputs
from specjax.models.layers import Attention, AttentionSpec, GatedMLP, RMSNorm, Rope, param, rms_normalize
from specjax.models.transformer import mlp_params
from specjax.models.weights import tensor_taker


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  norm_eps: float
  rope: Rope  # theta and scaling, from the HF config (`llama.rope_from_hf`)
  vocab_size: int  # the target's vocabulary
  draft_vocab_size: int
  target_hidden_size: int | None = None  # width of each tap; None: hidden_size (always an int once built)
  taps: tuple[int, ...]  # target layers whose output residual feeds fc, 0-based (`DecoderLM.forward(taps=...)`)
  norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h
  norm_before_fc: bool = False  # input_norm: one RMS norm over the concatenated taps before fc
  fc_norm: bool = False  # one RMS norm per tap before fc (EAGLE 3.1)
  norm_output: bool = False  # the step's output (fed back and scored) is norm(layer output) (EAGLE 3.1)
  has_embedding: bool = False  # the checkpoint ships embed_tokens (else the target's table is used)
  max_position_embeddings: int = 8192  # exported as is: keep it >= the target's context (see save_eagle3)
  activation: str = 'silu'

  def __post_init__(self):
    if self.target_hidden_size is None:
      object.__setattr__(self, 'target_hidden_size', self.hidden_size)
    object.__setattr__(self, 'taps', tuple(int(i) for i in self.taps))

  def attention_spec(self) -> AttentionSpec:
    return AttentionSpec(
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope, scale=self.head_dim**-0.5, eps=self.norm_eps
    )


class Eagle3Head(nnx.Module):
  """EAGLE-3 head: `fuse` the taps, `forward` the one decoder layer over a paged KV cache, `logits`."""

  def __init__(
      self, cfg: Eagle3Config, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    d = cfg.hidden_size
    norm = lambda: RMSNorm(d, eps=cfg.norm_eps, offset=0.0, dtype=dtype)
    self.cfg = cfg
    n, width = len(cfg.taps), cfg.target_hidden_size
    self.fc = param(rngs, (n * width, d), dtype)
    if cfg.norm_before_fc:
      self.input_norm = RMSNorm(n * width, eps=cfg.norm_eps, offset=0.0, dtype=dtype)
    if cfg.fc_norm:
      self.fc_norm = nnx.Param(jnp.ones((n, width), dtype))  # [n, H]: tap i's norm weight in row i
    if cfg.has_embedding:
      self.embed_tokens = param(rngs, (cfg.vocab_size, d), dtype, fan_in=d)
    self.input_layernorm = norm()
    self.hidden_norm = norm()
    self.self_attn = Attention(d, cfg.attention_spec(), in_dim=2 * d, impl=attention_impl, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.mlp = GatedMLP(d, cfg.intermediate_size, activation=cfg.activation, dtype=dtype, rngs=rngs)
    self.norm = norm()
    self.lm_head = param(rngs, (d, cfg.draft_vocab_size), dtype)

  def cache_layout(self) -> CacheLayout:
    """One attention layer."""
    return CacheLayout(((self.cfg.num_kv_heads, self.cfg.head_dim),))

  def fuse(self, taps: jax.Array) -> jax.Array:  # [B, T, E] (the taps side by side, in cfg.taps order) -> [B, T, D]
    if self.cfg.norm_before_fc:
      taps = self.input_norm(taps)
    if self.cfg.fc_norm:
      per_tap = rms_normalize(taps.reshape(*taps.shape[:-1], len(self.cfg.taps), -1), self.cfg.norm_eps)
      taps = (per_tap * self.fc_norm[...].astype(jnp.float32)).reshape(taps.shape).astype(taps.dtype)
    return jnp.einsum('...e,ed->...d', taps, self.fc[...])

  def embed(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    """The checkpoint's own embedding (`has_embedding`); otherwise use the target's `lookup`."""
    if not self.cfg.has_embedding:
      raise ValueError("this EAGLE-3 head has no embedding of its own: use the target's lookup(tokens)")
    return jnp.take(self.embed_tokens[...], tokens, axis=0)

  def forward(
      self,
      embeds: jax.Array,  # [B, T, D] raw embeddings of the tokens
      hidden: jax.Array,  # [B, T, D] fused taps (first step) or the previous step's output
      inputs: StepInputs,
      cache: KVCache | None,  # one attention layer; None: attend among the given tokens only, with inputs.mask
  ) -> tuple[jax.Array, KVCache | None]:
    """Returns the step's output `[B, T, D]` (`output` of the layer's residual stream) and the cache."""
    normed = self.hidden_norm(hidden)
    residual = normed if self.cfg.norm_before_residual else hidden
    x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
    kv = None
    if cache is not None:
      kv = PagedKV(cache.k_pages[0], cache.v_pages[0], cache.block_tables, cache.lengths + inputs.query_lens)
    out, kv = self.self_attn(x, inputs, kv)
    x = residual + out
    x = x + self.mlp(self.post_attention_layernorm(x))
    if cache is not None:
      cache = dataclasses.replace(cache, k_pages=(kv.k_pages,), v_pages=(kv.v_pages,), lengths=kv.lengths)
    return self.output(x), cache

  def output(self, x: jax.Array) -> jax.Array:  # [..., D] the layer's residual stream -> what the next step reads
    return self.norm(x) if self.cfg.norm_output else x

  def logits(self, out: jax.Array) -> jax.Array:  # [..., D] a step's output -> [..., V] over the draft vocabulary
    normed = out if self.cfg.norm_output else self.norm(out)
    return jnp.einsum('...d,dv->...v', normed, self.lm_head[...])


# ---------------------------------------------------------------- checkpoint mapping

LAYER = 'midlayer.'  # the decoder layer's prefix in the SpecForge / EAGLE / vLLM layout


def hf_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
  """The head's tensors in the SpecForge / EAGLE / vLLM layout (without `d2t` / `t2d`): name -> shape."""
  d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  taps, width = len(cfg.taps), cfg.target_hidden_size
  shapes = {'fc.weight': (d, taps * width)}
  if cfg.norm_before_fc:
    shapes['input_norm.weight'] = (taps * width,)
  if cfg.fc_norm:
    shapes.update({f'fc_norm.{i}.weight': (width,) for i in range(taps)})
  for norm in ('input_layernorm', 'hidden_norm', 'post_attention_layernorm'):
    shapes[f'{LAYER}{norm}.weight'] = (d,)
  for name, rows in (('q', n * h), ('k', k * h), ('v', k * h)):
    shapes[f'{LAYER}self_attn.{name}_proj.weight'] = (rows, 2 * d)
  shapes[f'{LAYER}self_attn.o_proj.weight'] = (d, n * h)
  shapes.update({f'{LAYER}mlp.gate_proj.weight': (f, d), f'{LAYER}mlp.up_proj.weight': (f, d)})
  shapes[f'{LAYER}mlp.down_proj.weight'] = (d, f)
  shapes.update({'norm.weight': (d,), 'lm_head.weight': (cfg.draft_vocab_size, d)})
  if cfg.has_embedding:
    shapes['embed_tokens.weight'] = (cfg.vocab_size, d)
  return shapes


def params_from_hf(cfg: Eagle3Config, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Pops the head's tensors (PyTorch layout, `midlayer.*` names) into the pure-dict state of `Eagle3Head`."""
  take = tensor_taker(tensors)
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  norm = lambda name: {'scale': take(name + '.weight', (d,))}
  p = LAYER + 'self_attn.'
  params = {
      'fc': take('fc.weight', (d, len(cfg.taps) * cfg.target_hidden_size)).T,
      'input_layernorm': norm(LAYER + 'input_layernorm'),
      'hidden_norm': norm(LAYER + 'hidden_norm'),
      'self_attn': {
          'qkv_proj': np.concatenate(
              [
                  take(p + 'q_proj.weight', (n * h, 2 * d)),
                  take(p + 'k_proj.weight', (k * h, 2 * d)),
                  take(p + 'v_proj.weight', (k * h, 2 * d)),
              ]
          ).T,
          'o_proj': take(p + 'o_proj.weight', (d, n * h)).T,
      },
      'post_attention_layernorm': norm(LAYER + 'post_attention_layernorm'),
      'mlp': mlp_params(take, LAYER + 'mlp.', d, cfg.intermediate_size),
      'norm': norm('norm'),
      'lm_head': take('lm_head.weight', (cfg.draft_vocab_size, d)).T,
  }
  taps, width = len(cfg.taps), cfg.target_hidden_size
  if cfg.norm_before_fc:
    params['input_norm'] = {'scale': take('input_norm.weight', (taps * width,))}
  if cfg.fc_norm:
    params['fc_norm'] = np.stack([take(f'fc_norm.{i}.weight', (width,)) for i in range(taps)])
  if cfg.has_embedding:
    params['embed_tokens'] = take('embed_tokens.weight', (cfg.vocab_size, d))
  return params


def params_to_hf(cfg: Eagle3Config, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`: PyTorch-layout tensors under `midlayer.*` names."""
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  f = cfg.intermediate_size
  arr = lambda x: np.asarray(x)
  attn, mlp = params['self_attn'], params['mlp']
  q, key, value = np.split(arr(attn['qkv_proj']).T, [n * h, (n + k) * h])
  gate, up = np.split(arr(mlp['gate_up']).T, [f])
  tensors = {
      'fc.weight': arr(params['fc']).T,
      LAYER + 'input_layernorm.weight': arr(params['input_layernorm']['scale']),
      LAYER + 'hidden_norm.weight': arr(params['hidden_norm']['scale']),
      LAYER + 'self_attn.q_proj.weight': q,
      LAYER + 'self_attn.k_proj.weight': key,
      LAYER + 'self_attn.v_proj.weight': value,
      LAYER + 'self_attn.o_proj.weight': arr(attn['o_proj']).T,
      LAYER + 'post_attention_layernorm.weight': arr(params['post_attention_layernorm']['scale']),
      LAYER + 'mlp.gate_proj.weight': gate,
      LAYER + 'mlp.up_proj.weight': up,
      LAYER + 'mlp.down_proj.weight': arr(mlp['down']).T,
      'norm.weight': arr(params['norm']['scale']),
      'lm_head.weight': arr(params['lm_head']).T,
  }
  if cfg.norm_before_fc:
    tensors['input_norm.weight'] = arr(params['input_norm']['scale'])
  if cfg.fc_norm:
    tensors.update({f'fc_norm.{i}.weight': w for i, w in enumerate(arr(params['fc_norm']))})
  if cfg.has_embedding:
    tensors['embed_tokens.weight'] = arr(params['embed_tokens'])
  return {name: np.ascontiguousarray(w) for name, w in tensors.items()}
