"""The Gemma 4 assistant drafter (`gemma4_assistant`, e.g. google/gemma-4-E4B-it-assistant) as a Flax NNX module.

Facts (transformers `models/gemma4_assistant/`, `models/gemma4/modeling_gemma4.py`,
`generation/candidate_generator.py::SinglePositionMultiTokenCandidateGenerator`):
a few Gemma 4 decoder layers with no key/value projections of their own. Each
layer's queries attend to the TARGET's keys and values of the target's last
non-shared layer of the same type (the "donor"; no KV cache of the assistant's
own, nothing written). One draft step, repeated K times at one fixed query
position p (the position of the pending token, = the committed length L):

  x   = pre_projection([target.embed(token) (sqrt(E)-scaled), h])   E: the target's width
  x   = layer_i(x): q = RoPE(q_norm(q_proj x), p), attention with scale 1 over the
        donor K/V, o_proj; Gemma sandwich norms, GeGLU MLP; x *= layer_scalar_i
  out = norm(x);  logits = head(out);  h_next = post_projection(out)

`h` starts as the target's hidden at the last committed position L - 1, AFTER
the final norm (transformers' `hidden_states[-1]`, which the generator reads, is
`norm(last layer's output)` exactly: tools/README.md §9), then is the previous
step's `h_next`. transformers matches this definition in the first draft round
after prefill; later rounds of its generator also show the assistant the keys of
rejected drafts (tools/README.md §9).

Masks: full layers see all L committed keys; sliding layers see the last
`sliding_window + 1` of them (transformers flips a bidirectional window mask,
`|q - k| <= W`, inclusive: W + 1 keys, keys L - W - 1 .. L - 1; checked by
perturbing each key), not the W a target token would see. RMSNorms are plain
`x * w`; no logit softcap.

Head: tied to the assistant's own `embed_tokens` ([V, D], the target's token ids)
or an untied `lm_head`. With `use_ordered_embeddings` (E2B / E4B) it is sparse:
the C centroids score `out`, the top X are kept, and centroid c owns the token
ids `token_ordering[c * V/C : (c + 1) * V/C]`: `token_ordering` holds target
(canonical) token ids grouped by centroid, not a reordering of the table. Those
X * V/C ids get `out . embed_tokens[id]`; every other id gets -inf here
(transformers fills `min(candidates) - 1` instead: `hf_fill`).

Einsum letters: B batch, T tokens, D assistant width, E target width, F = 2E
(embedding and hidden side by side), S keys, N query heads, K kv heads, G query
heads per kv head, H head dim, Q = N * H, V vocab, C centroids, M candidates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.paged_attention import paged_attention
from specjax.errors import SpecjaxError
from specjax.models.contract import PagedKV
from specjax.models.gemma4 import DEFAULT_ROPE, FULL, SLIDING, rope_from_hf
from specjax.models.layers import ACTIVATIONS, AttentionSpec, DecoderBlock, GatedMLP, RMSNorm, Rope, dense_attention, param
from specjax.models.transformer import mlp_params
from specjax.models import weights
from specjax.models.weights import hf_from_params, tensor_taker

MODEL_TYPE = 'gemma4_assistant'
ARCHITECTURE = 'Gemma4AssistantForCausalLM'
DEFAULT_GLOBAL_HEAD_DIM = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma4AssistantConfig:
  vocab_size: int  # the target's
  hidden_size: int  # D, the assistant's width
  intermediate_size: int
  num_heads: int
  layer_types: tuple[str, ...]  # per layer: 'sliding_attention' or 'full_attention'
  head_dim: int  # sliding layers
  global_head_dim: int  # full layers
  num_kv_heads: int  # sliding layers: must equal the target donor's
  num_global_kv_heads: int  # full layers
  sliding_window: int  # HF's W; sliding layers see W + 1 keys (`sliding_keys`)
  rope_sliding: Rope
  rope_full: Rope
  backbone_hidden_size: int  # E, the target's width
  rms_norm_eps: float = 1e-6
  hidden_activation: str = 'gelu_pytorch_tanh'
  tie_word_embeddings: bool = True
  use_ordered_embeddings: bool = False  # the centroid-masked head
  num_centroids: int = 2048
  centroid_intermediate_top_k: int = 32
  num_assistant_tokens: int | None = None  # generation_config.json (transformers' default when absent: 20)

  def __post_init__(self):
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))

  @property
  def num_layers(self) -> int:
    return len(self.layer_types)

  @property
  def sliding_keys(self) -> int:
    """Committed keys a sliding layer sees: W + 1 (transformers' inclusive bidirectional window, flipped)."""
    return self.sliding_window + 1

  @property
  def tokens_per_centroid(self) -> int:
    return self.vocab_size // self.num_centroids

  def kv_shape(self, layer_type: str) -> tuple[int, int]:
    """(kv heads, head dim) of a layer type: what the target's donor of that type must hold."""
    if layer_type == FULL:
      return self.num_global_kv_heads, self.global_head_dim
    return self.num_kv_heads, self.head_dim

  def attention_spec(self, layer_type: str) -> AttentionSpec:
    kv, h = self.kv_shape(layer_type)
    sliding = layer_type == SLIDING
    return AttentionSpec(
        self.num_heads,
        kv,
        h,
        self.rope_sliding if sliding else self.rope_full,
        scale=1.0,
        eps=self.rms_norm_eps,
        qk_norm=True,
        window=self.sliding_keys if sliding else None,  # the query sits at L - 1 for the window rule
    )

  @classmethod
  def from_hf(
      cls, hf: dict[str, Any], generation: dict[str, Any] | None = None, where: str = 'gemma4_assistant config'
  ) -> Gemma4AssistantConfig:
    """Reads a `gemma4_assistant` config.json (nested `text_config`) and, if given, its generation_config.json.

    Full layers' head dim: `global_head_dim` (Hub configs) or transformers 5's
    `per_layer_config` overrides. Raises a one-line `SpecjaxError` for another
    model_type, per-layer embeddings, MoE, double-wide MLPs, layers that are not
    all KV-shared, unknown layer or RoPE types, or a centroid count that does
    not divide the vocabulary.
    """
    if hf.get('model_type') != MODEL_TYPE:
      raise SpecjaxError(f'{where}: model_type {hf.get("model_type")!r} is not a Gemma 4 assistant ({MODEL_TYPE!r})')
    try:
      t = hf['text_config']
      layers = int(t['num_hidden_layers'])
      for key in ('hidden_size_per_layer_input', 'enable_moe_block', 'use_double_wide_mlp'):
        if t.get(key):
          raise SpecjaxError(f'{where}: text_config.{key}={t[key]!r}; an assistant has no PLE, MoE or double-wide MLP')
      shared = t.get('num_kv_shared_layers') or layers  # transformers: 0 / missing means all
      if shared != layers:
        raise SpecjaxError(
            f'{where}: num_kv_shared_layers={shared} but {layers} layers; every assistant layer must read the '
            "target's K/V"
        )
      layer_types = tuple(t.get('layer_types') or ())
      if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
        raise SpecjaxError(f'{where}: layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {list(layer_types)}')
      heads = int(t['num_attention_heads'])
      head_dim = int(t.get('head_dim') or t['hidden_size'] // heads)
      kv = int(t.get('num_key_value_heads') or heads)
      global_dim = int(t.get('global_head_dim') or DEFAULT_GLOBAL_HEAD_DIM)
      global_kv = int(t.get('num_global_key_value_heads') or kv) if t.get('attention_k_eq_v') else kv
      if t.get('per_layer_config'):  # transformers 5 saves this instead of global_head_dim
        global_dim, global_kv = full_layer_shape(t['per_layer_config'], layer_types, head_dim, kv, where)
      vocab = int(t['vocab_size'])
      act = t.get('hidden_activation') or t.get('hidden_act') or 'gelu_pytorch_tanh'
      if act not in ACTIVATIONS:
        raise SpecjaxError(f'{where}: unsupported activation {act!r}')
      rope = t.get('rope_parameters') or DEFAULT_ROPE
      cfg = cls(
          vocab_size=vocab,
          hidden_size=int(t['hidden_size']),
          intermediate_size=int(t['intermediate_size']),
          num_heads=heads,
          layer_types=layer_types,
          head_dim=head_dim,
          global_head_dim=global_dim,
          num_kv_heads=kv,
          num_global_kv_heads=global_kv,
          sliding_window=int(t.get('sliding_window') or 512),
          rope_sliding=rope_from_hf(rope, SLIDING, head_dim, where),
          rope_full=rope_from_hf(rope, FULL, global_dim, where),
          backbone_hidden_size=int(hf['backbone_hidden_size']),
          rms_norm_eps=float(t.get('rms_norm_eps', 1e-6)),
          hidden_activation=act,
          tie_word_embeddings=bool(hf.get('tie_word_embeddings', True)),
          use_ordered_embeddings=bool(hf.get('use_ordered_embeddings', False)),
          num_centroids=int(hf.get('num_centroids', 2048)),
          centroid_intermediate_top_k=int(hf.get('centroid_intermediate_top_k', 32)),
          num_assistant_tokens=(generation or {}).get('num_assistant_tokens'),
      )
    except KeyError as e:
      raise SpecjaxError(f'{where}: missing key {e.args[0]!r}') from None
    except (TypeError, ValueError, AttributeError) as e:
      raise SpecjaxError(f'{where}: bad value in the config: {e}') from None
    for kind in dict.fromkeys(cfg.layer_types):
      n_kv = cfg.kv_shape(kind)[0]
      if n_kv < 1 or cfg.num_heads % n_kv:
        raise SpecjaxError(f'{where}: num_attention_heads {cfg.num_heads} is not a multiple of {kind} kv heads {n_kv}')
    if cfg.use_ordered_embeddings:
      c, x = cfg.num_centroids, cfg.centroid_intermediate_top_k
      if c < 1 or cfg.vocab_size % c:
        raise SpecjaxError(f'{where}: num_centroids {c} does not divide vocab_size {cfg.vocab_size}')
      if not 1 <= x <= c:
        raise SpecjaxError(f'{where}: centroid_intermediate_top_k {x} must be in 1..num_centroids ({c})')
    k = cfg.num_assistant_tokens
    if k is not None and (type(k) is not int or k < 1):
      raise SpecjaxError(f'{where}: generation_config num_assistant_tokens must be a positive int, got {k!r}')
    return cfg


def full_layer_shape(
    per_layer: dict, layer_types: tuple[str, ...], head_dim: int, kv: int, where: str
) -> tuple[int, int]:
  """(head dim, kv heads) of the full layers from transformers' `per_layer_config` {layer index: overrides}."""
  per_layer = {int(i): o for i, o in per_layer.items()}
  shapes = {SLIDING: set(), FULL: set()}
  for i, kind in enumerate(layer_types):
    o = per_layer.get(i) or {}
    shapes[kind].add((int(o.get('head_dim', head_dim)), int(o.get('num_key_value_heads', kv))))
  if shapes[SLIDING] - {(head_dim, kv)} or len(shapes[FULL]) > 1:
    raise SpecjaxError(f'{where}: per_layer_config must give all full layers one shape and override no sliding layer')
  return next(iter(shapes[FULL]), (head_dim, kv))


# ---------------------------------------------------------------- the target's K/V


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseKV:
  """A donor layer's keys and values as plain arrays (tests, training): keys 0..S-1 at positions 0..S-1."""

  k: jax.Array  # [B, S, K, H] normed, rotated (as the target's cache holds them)
  v: jax.Array  # [B, S, K, H]
  lengths: jax.Array  # [B] (or [B, T]: per query) committed keys L; keys >= L are ignored


def donor_attention(
    q: jax.Array,  # [B, T, N, H] normed, rotated
    kv: PagedKV | DenseKV,  # lengths [B] or [B, T]
    *,
    window: int | None,  # keys seen: the last `window` of the L committed ones (None: all)
    impl: str = 'auto',
) -> jax.Array:  # [B, T, N, H]
  """Every query sees the committed keys `[L - window, L)` (all of `[0, L)` without a window), scale 1.

  Paged: the rows' T queries are folded into the batch, each one query at L - 1
  for the kernel's window rule (`pos - key < window`); rows with L = 0 give zeros.
  """
  b, t, n, h = q.shape
  lengths = kv.lengths.astype(jnp.int32)
  lengths = jnp.broadcast_to(lengths[:, None] if lengths.ndim == 1 else lengths, (b, t))  # [B, T]
  if isinstance(kv, PagedKV):
    lens = lengths.reshape(b * t)
    out = paged_attention(
        q.reshape(b * t, 1, n, h),
        kv.k_pages,
        kv.v_pages,
        jnp.repeat(kv.block_tables, t, axis=0),
        lens,
        query_lens=jnp.minimum(lens, 1),
        sliding_window=window,
        scale=1.0,
        impl=impl,
    )
    return out.reshape(b, t, n, h)
  key = jnp.arange(kv.k.shape[1])[None, None, :]  # [1, 1, S]
  seen = key < lengths[:, :, None]  # [B, T, S]
  if window is not None:
    seen &= key >= lengths[:, :, None] - window
  return dense_attention(q, kv.k, kv.v, seen, scale=1.0)


# ---------------------------------------------------------------- the module


class DonorAttention(nnx.Module):
  """Queries only (`q_proj`, `q_norm`, RoPE), attention over the target's donor K/V, `o_proj`."""

  def __init__(self, dim: int, spec: AttentionSpec, *, impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs):
    n, h = spec.num_heads, spec.head_dim
    self.q_proj = param(rngs, (dim, n * h), dtype)
    self.q_norm = RMSNorm(h, eps=spec.eps, offset=0.0, dtype=dtype)
    self.o_proj = param(rngs, (n * h, dim), dtype)
    self.spec = spec
    self.impl = impl

  def __call__(self, x: jax.Array, positions: jax.Array, kv: PagedKV | DenseKV) -> jax.Array:  # x [B, T, D]
    s = self.spec
    b, t, _ = x.shape
    q = jnp.einsum('btd,dq->btq', x, self.q_proj[...]).reshape(b, t, s.num_heads, s.head_dim)
    q = s.rope(self.q_norm(q), positions)
    out = donor_attention(q, kv, window=s.window, impl=self.impl)
    return jnp.einsum('btq,qd->btd', out.reshape(b, t, -1).astype(x.dtype), self.o_proj[...])


class Gemma4Assistant(nnx.Module):
  """`forward` one draft step over the target's donor K/V, `logits` (centroid-masked or dense)."""

  def __init__(
      self,
      cfg: Gemma4AssistantConfig,
      *,
      attention_impl: str = 'auto',
      dtype=jnp.float32,
      rngs: nnx.Rngs | None = None,
  ):
    rngs = rngs or nnx.Rngs(0)
    d, e = cfg.hidden_size, cfg.backbone_hidden_size
    self.cfg = cfg
    self.pre_projection = param(rngs, (2 * e, d), dtype)
    self.layers = nnx.List(
        [
            DecoderBlock(
                d,
                DonorAttention(d, cfg.attention_spec(t), impl=attention_impl, dtype=dtype, rngs=rngs),
                GatedMLP(d, cfg.intermediate_size, activation=cfg.hidden_activation, dtype=dtype, rngs=rngs),
                eps=cfg.rms_norm_eps,
                offset=0.0,
                sandwich=True,
                dtype=dtype,
            )
            for t in cfg.layer_types
        ]
    )
    self.layer_scalar = nnx.Variable(jnp.ones((cfg.num_layers,), dtype))  # HF buffers: not trained
    self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, offset=0.0, dtype=dtype)
    self.post_projection = param(rngs, (d, e), dtype)
    self.embed_tokens = param(rngs, (cfg.vocab_size, d), dtype, fan_in=d)  # [V, D]: the tied head's rows
    if not cfg.tie_word_embeddings:
      self.lm_head = param(rngs, (cfg.vocab_size, d), dtype, fan_in=d)
    if cfg.use_ordered_embeddings:
      self.centroids = param(rngs, (d, cfg.num_centroids), dtype)
      self.token_ordering = nnx.Variable(jnp.arange(cfg.vocab_size, dtype=jnp.int32))  # [V] target ids

  def forward(
      self,
      embeds: jax.Array,  # [B, T, E] the target's scaled embedding of each step's input token
      hidden: jax.Array,  # [B, T, E] the target's final-normed hidden, then the previous step's next_hidden
      positions: jax.Array,  # [B, T] the query position (the drafter holds it at L for all K steps)
      donors: dict[str, PagedKV | DenseKV],  # per layer type: the target's donor K/V, lengths = committed L
  ) -> tuple[jax.Array, jax.Array]:
    """One draft step: the final-normed output `[B, T, D]` (for `logits`) and `next_hidden` `[B, T, E]`.

    `donors[type]` is a `PagedKV` (the target's pages of its donor layer of
    that type, `lengths` [B] or [B, T] = L; never written) or a `DenseKV`.
    Queries see the committed keys only; `positions` is used for RoPE alone.
    """
    x = jnp.einsum('btf,fd->btd', jnp.concatenate([embeds, hidden], axis=-1), self.pre_projection[...])
    scalars = self.layer_scalar[...]
    for i, kind in enumerate(self.cfg.layer_types):
      if kind not in donors:
        raise ValueError(f'no donor K/V for layer type {kind!r} (given: {sorted(donors)})')
      x, _ = self.layers[i](x, lambda attn, y, kv=donors[kind]: (attn(y, positions, kv), None))
      x = x * scalars[i].astype(x.dtype)
    out = self.norm(x)
    return out, jnp.einsum('btd,de->bte', out, self.post_projection[...])

  def head(self) -> jax.Array:  # [V, D]
    return self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]

  def candidates(self, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The centroid head's candidates: target ids `[..., M]` int32 and their logits `[..., M]`, M = X * V/C."""
    cfg = self.cfg
    if not cfg.use_ordered_embeddings:
      raise ValueError('candidates: this assistant has a dense head (use_ordered_embeddings is false)')
    scores = jnp.einsum('...d,dc->...c', out, self.centroids[...])
    _, top = jax.lax.top_k(scores, cfg.centroid_intermediate_top_k)  # [..., X]
    blocks = self.token_ordering[...].reshape(cfg.num_centroids, cfg.tokens_per_centroid)
    ids = blocks[top].reshape(*out.shape[:-1], -1)  # [..., M]
    rows = jnp.take(self.head(), ids, axis=0)  # [..., M, D]
    return ids, jnp.einsum('...md,...d->...m', rows, out)

  def logits(self, out: jax.Array) -> jax.Array:  # [..., D] -> [..., V]
    """Dense: `out @ head`. Centroid head: the candidates' logits, -inf at every other id."""
    if not self.cfg.use_ordered_embeddings:
      return jnp.einsum('...d,vd->...v', out, self.head())
    ids, cand = self.candidates(out)
    full = jnp.full((*out.shape[:-1], self.cfg.vocab_size), -jnp.inf, cand.dtype)
    return jnp.put_along_axis(full, ids, cand, axis=-1, inplace=False)


def hf_fill(logits: jax.Array) -> jax.Array:
  """transformers' form of centroid-head logits: -inf replaced by (the smallest finite logit in the array) - 1.

  One fill for the whole array, as transformers takes the min over every row
  of the call; softmax then gives non-candidates a small nonzero probability.
  """
  finite = jnp.isfinite(logits)
  low = jnp.min(jnp.where(finite, logits, jnp.inf))
  return jnp.where(finite, logits, low - 1)


# ---------------------------------------------------------------- checkpoint mapping

KV_NAMES = ('k_proj', 'v_proj', 'k_norm', 'v_norm')  # a shared layer has none of these


def params_from_hf(cfg: Gemma4AssistantConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Pops the assistant's HF tensors (PyTorch layout) into the pure-dict state of `Gemma4Assistant`."""
  take = tensor_taker(tensors)
  d, e, f, v, n = cfg.hidden_size, cfg.backbone_hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_heads
  layers, scalars = {}, []
  for i, kind in enumerate(cfg.layer_types):
    p = f'model.layers.{i}.'
    h = cfg.kv_shape(kind)[1]
    norm = lambda name, dim, p=p: {'scale': take(p + name + '.weight', (dim,))}
    layers[i] = {
        'mixer_norm': norm('input_layernorm', d),
        'mixer': {
            'q_proj': take(p + 'self_attn.q_proj.weight', (n * h, d)).T,
            'q_norm': norm('self_attn.q_norm', h),
            'o_proj': take(p + 'self_attn.o_proj.weight', (d, n * h)).T,
        },
        'mixer_post_norm': norm('post_attention_layernorm', d),
        'mlp_norm': norm('pre_feedforward_layernorm', d),
        'mlp': mlp_params(take, p + 'mlp.', d, f),
        'mlp_post_norm': norm('post_feedforward_layernorm', d),
    }
    scalars.append(take(p + 'layer_scalar', (1,)))
  params = {
      'pre_projection': take('pre_projection.weight', (d, 2 * e)).T,
      'layers': layers,
      'layer_scalar': np.concatenate(scalars),
      'norm': {'scale': take('model.norm.weight', (d,))},
      'post_projection': take('post_projection.weight', (e, d)).T,
      'embed_tokens': take('model.embed_tokens.weight', (v, d)),
  }
  if not cfg.tie_word_embeddings:
    params['lm_head'] = take('lm_head.weight', (v, d))
  if cfg.use_ordered_embeddings:
    params['centroids'] = take('masked_embedding.centroids.weight', (cfg.num_centroids, d)).T
    params['token_ordering'] = take('masked_embedding.token_ordering', (v,)).astype(np.int32)
  return params


def params_to_hf(cfg: Gemma4AssistantConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`: HF-named tensors, floats in the params' dtype, `token_ordering` int64."""
  dtype = np.asarray(params['embed_tokens']).dtype
  tensors = hf_from_params(lambda t: params_from_hf(cfg, t), params)
  return {
      name: np.ascontiguousarray(w.astype(np.int64 if name.endswith('token_ordering') else dtype))
      for name, w in tensors.items()
  }


def hf_shapes(cfg: Gemma4AssistantConfig) -> dict[str, tuple[int, ...]]:
  """The checkpoint's tensors: name -> shape."""
  return weights.hf_shapes(lambda t: params_from_hf(cfg, t))
