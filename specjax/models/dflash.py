"""The DFlash (block-diffusion) draft model as a Flax NNX module (z-lab/dflash, SpecForge).

Facts (z-lab `dflash/model.py`, SpecForge `modeling/draft/dflash.py`): the
target's residual stream after a few layers (the taps) is concatenated and
projected, `ctx = hidden_norm(fc(concat taps))` `[B, C, D]`, the draft's width
being the target's. Qwen3 decoder layers follow (q/k norms, SwiGLU, plain
`x * w` RMSNorms) whose keys and values are `k_norm(k_proj([ctx; x]))` and
`v_proj([ctx; x])`, rotated at the context's positions then the block's;
queries come from the block rows only and see every context key and every
block row (non-causal). The block is `[last token, MASK x (B - 1)]` embedded
with the target's embedding; `norm(out)` goes through the target's head.

Context keys and values depend only on the target features (the same `ctx` in
every layer), so they live in the draft's own paged cache, appended once per
committed position (`append_context`); `block` writes the block's keys and
values to scratch slots past the context and attends to both.

Sliding layers (`layer_types`): the paged kernel places every block row at the
block's last position for the window rule (an all-true block mask has depth
B - 1), so each row sees context keys within W - 1 positions of that one
position; upstream's windows differ by at most B - 1 keys past W.

DFlash 2 (z-lab `DFlash2DraftModel`, SpecForge / sglang) adds two parts:
- a grouped dynamic depthwise convolution around every attention and MLP
  (`GroupedConv`): from the sublayer's normed input x, `kernel_projection`
  gives per-row coefficients for both sides, shared by the channels of a
  group; the input is convolved with side 0 before the sublayer and its
  output with side 1 after it, causally over the block's rows (zero padded):
  `out[t, c] = sum_j (base[side, j, c] + dyn[t, side, j, group(c)]) x[t - j, c]`.
  Context rows never pass through it (their keys and values are projections
  of `ctx`);
- a candidate selector (`CandidateSelector`): unary logits = the target head
  of the block rows times `output_multiplier`, softcapped; each slot keeps its
  top-k; a candidate c after the previous slot's token p scores
  `unary[c] + <predecessor[p] * hidden_projection(h), successor[c]>`, and a path
  is walked from the block's first token, greedily or by sampling.

Einsum letters: B batch, T tokens, E concatenated taps, D width, S draft
slots, K candidates, R selector rank, G channel groups, J conv taps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.cache.paged import KVCache, write_kv
from specjax.models.contract import CacheLayout, PagedKV, StepInputs
from specjax.models.layers import Attention, AttentionSpec, DecoderBlock, GatedMLP, RMSNorm, Rope, param
from specjax.models.transformer import block_params
from specjax.models.weights import tensor_taker


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
  hidden_size: int  # the target's
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  norm_eps: float
  rope: Rope
  num_layers: int
  block_size: int  # rows of one block: the last token and block_size - 1 masks
  mask_token_id: int
  taps: tuple[int, ...]  # target layers whose output residual feeds fc, 0-based (= upstream target_layer_ids)
  num_target_layers: int
  vocab_size: int  # the target's
  windows: tuple[int | None, ...] = ()  # per layer: sliding window or None (empty: all full)
  max_position_embeddings: int = 40960
  activation: str = 'silu'
  causal: tuple[bool, ...] = ()  # per layer: block rows see only earlier rows (empty: none)
  # DFlash 2 (0 / 1.0 / None: absent)
  conv_taps: int = 0  # grouped dynamic convolution: taps (conv_kernel_size)
  conv_group_size: int = 0  # channels sharing one dynamic coefficient
  selector_rank: int = 0  # candidate selector: rank of the transition codebooks
  selector_top_k: int = 0  # candidates per slot
  output_multiplier: float = 1.0  # unary logits = target logits * this, then softcapped
  logit_softcap: float | None = None  # final_logit_softcapping

  def __post_init__(self):
    object.__setattr__(self, 'taps', tuple(int(i) for i in self.taps))
    object.__setattr__(self, 'windows', tuple(self.windows) or (None,) * self.num_layers)
    object.__setattr__(self, 'causal', tuple(bool(c) for c in self.causal) or (False,) * self.num_layers)

  @property
  def is_dflash2(self) -> bool:
    return bool(self.conv_taps or self.selector_rank)

  @property
  def conv_groups(self) -> int:
    return self.hidden_size // self.conv_group_size if self.conv_taps else 0

  def attention_spec(self, layer: int) -> AttentionSpec:
    return AttentionSpec(
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
        self.rope,
        scale=self.head_dim**-0.5,
        eps=self.norm_eps,
        qk_norm=True,
        window=self.windows[layer],
    )


class GroupedConv(nnx.Module):
  """DFlash 2's grouped dynamic depthwise convolution over one block's rows (see the module docstring)."""

  def __init__(self, dim: int, taps: int, group_size: int, *, dtype=jnp.float32):
    self.groups = dim // group_size
    base = jnp.zeros((2, taps, dim), dtype).at[:, 0].set(1)  # [side, J, D]: identity, as upstream initialises it
    self.base_kernel = nnx.Param(base)
    self.kernel_projection = nnx.Param(jnp.zeros((dim, 2 * taps * self.groups), dtype))  # zero: dynamic part off

  def prepare(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:  # x [B, T, D]
    """(x convolved with side 0, the side-1 coefficients [B, T, J, G] for `finish`)."""
    b, t, _ = x.shape
    dyn = jnp.einsum('btd,de->bte', x, self.kernel_projection[...]).reshape(b, t, 2, -1, self.groups)
    return self._convolve(x, dyn[:, :, 0], 0), dyn[:, :, 1]

  def finish(self, x: jax.Array, dyn: jax.Array) -> jax.Array:  # x [B, T, D], dyn [B, T, J, G]
    return self._convolve(x, dyn, 1)

  def _convolve(self, x: jax.Array, dyn: jax.Array, side: int) -> jax.Array:
    b, t, d = x.shape
    taps, g = dyn.shape[2], self.groups
    rows = x.reshape(b, t, g, d // g)
    base = self.base_kernel[...][side].astype(x.dtype).reshape(taps, g, d // g)
    out = jnp.zeros_like(rows)
    for j in range(taps):  # row t reads row t - j (zeros before the block)
      shifted = jnp.pad(rows[:, : t - j], ((0, 0), (j, 0), (0, 0), (0, 0)))
      out = out + (base[j] + dyn[:, :, j, :, None]) * shifted
    return out.reshape(b, t, d)


class ConvDecoderBlock(DecoderBlock):
  """A DFlash 2 layer: each sublayer's normed input and output pass through its own `GroupedConv`."""

  def __init__(self, dim: int, mixer, mlp, *, taps: int, group_size: int, eps: float, dtype=jnp.float32):
    super().__init__(dim, mixer, mlp, eps=eps, offset=0.0, dtype=dtype)
    self.attention_conv = GroupedConv(dim, taps, group_size, dtype=dtype)
    self.mlp_conv = GroupedConv(dim, taps, group_size, dtype=dtype)

  def __call__(self, x: jax.Array, mix) -> tuple[jax.Array, object]:
    y, dyn = self.attention_conv.prepare(self.mixer_norm(x))
    out, part = mix(self.mixer, y)
    x = x + self.attention_conv.finish(out, dyn)
    y, dyn = self.mlp_conv.prepare(self.mlp_norm(x))
    return x + self.mlp_conv.finish(self.mlp(y), dyn), part


class CandidateSelector(nnx.Module):
  """DFlash 2's path selector over each slot's top-k candidates (see the module docstring)."""

  def __init__(self, dim: int, vocab: int, rank: int, top_k: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
    # Upstream's init: predecessors N(0, 0.02), successors zero (the transition starts as a no-op).
    self.predecessor_codebook = nnx.Param(jax.random.normal(rngs.params(), (vocab, rank), dtype) * 0.02)  # [V, R]
    self.successor_codebook = nnx.Param(jnp.zeros((vocab, rank), dtype))  # [V, R]
    self.hidden_projection = param(rngs, (dim, rank), dtype)  # [D, R]
    self.top_k = top_k

  def candidates(self, unary: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, S, V] -> ([B, S, K] f32, ids)
    values, ids = jax.lax.top_k(unary.astype(jnp.float32), self.top_k)
    return values, ids.astype(jnp.int32)

  def _tables(self, h: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hidden_projection(h) [B, S, R], successor rows of the candidates [B, S, K, R]), float32."""
    projected = jnp.einsum('bsd,dr->bsr', h, self.hidden_projection[...], preferred_element_type=jnp.float32)
    return projected, jnp.take(self.successor_codebook[...], ids, axis=0).astype(jnp.float32)

  def _edges(self, values, projected, successors, previous) -> jax.Array:  # [.., K], [.., R], [.., K, R], [..]
    context = jnp.take(self.predecessor_codebook[...], previous, axis=0).astype(jnp.float32) * projected
    return values + jnp.einsum('...r,...kr->...k', context, successors)

  def edges(self, h: jax.Array, values: jax.Array, ids: jax.Array, previous: jax.Array) -> jax.Array:
    """Scores [B, S, K] of each slot's candidates after the given previous tokens [B, S] (h [B, S, D])."""
    return self._edges(values, *self._tables(h, ids), previous)

  def walk(self, h: jax.Array, values: jax.Array, ids: jax.Array, anchor: jax.Array, choose) -> tuple[jax.Array, ...]:
    """A path from `anchor` [B]: (tokens [B, S], the scores each slot chose from [B, S, K]).

    `choose(slot, scores [B, K], ids [B, K]) -> tokens [B]` picks each slot's
    token among its candidates, after the previous slot's choice.
    """
    projected, successors = self._tables(h, ids)
    previous, tokens, scores = anchor, [], []
    for s in range(ids.shape[1]):
      edge = self._edges(values[:, s], projected[:, s], successors[:, s], previous)
      previous = choose(s, edge, ids[:, s])
      tokens.append(previous)
      scores.append(edge)
    return jnp.stack(tokens, axis=1), jnp.stack(scores, axis=1)


def greedy_choice(slot: int, scores: jax.Array, ids: jax.Array) -> jax.Array:  # the `walk` of upstream's greedy path
  return jnp.take_along_axis(ids, jnp.argmax(scores, axis=-1)[:, None], axis=1)[:, 0]


def place(scores: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:  # [..., K], [..., K] -> [..., V], -inf elsewhere
  """Candidate scores as full-vocab logits: no other token can be drawn."""
  out = jnp.full((*scores.shape[:-1], vocab), -jnp.inf, jnp.float32)
  return jnp.put_along_axis(out, ids, scores.astype(jnp.float32), axis=-1, inplace=False)


class DFlashDraft(nnx.Module):
  """`context` fuses the taps, `append_context` caches their K/V, `block` runs one block; DFlash 2's `selector`."""

  def __init__(
      self, cfg: DFlashConfig, *, attention_impl: str = 'auto', dtype=jnp.float32, rngs: nnx.Rngs | None = None
  ):
    rngs = rngs or nnx.Rngs(0)
    d = cfg.hidden_size
    norm = lambda: RMSNorm(d, eps=cfg.norm_eps, offset=0.0, dtype=dtype)
    self.cfg = cfg
    self.fc = param(rngs, (len(cfg.taps) * d, d), dtype)
    self.hidden_norm = norm()
    layers = []
    for i in range(cfg.num_layers):
      attn = Attention(d, cfg.attention_spec(i), impl=attention_impl, dtype=dtype, rngs=rngs)
      mlp = GatedMLP(d, cfg.intermediate_size, activation=cfg.activation, dtype=dtype, rngs=rngs)
      if cfg.conv_taps:
        kw = dict(taps=cfg.conv_taps, group_size=cfg.conv_group_size, eps=cfg.norm_eps, dtype=dtype)
        layers.append(ConvDecoderBlock(d, attn, mlp, **kw))
      else:
        layers.append(DecoderBlock(d, attn, mlp, eps=cfg.norm_eps, offset=0.0, dtype=dtype))
    self.layers = nnx.List(layers)
    self.norm = norm()
    if cfg.selector_rank:
      self.selector = CandidateSelector(
          d, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k, dtype=dtype, rngs=rngs
      )

  def cache_layout(self) -> CacheLayout:
    return CacheLayout(((self.cfg.num_kv_heads, self.cfg.head_dim),) * self.cfg.num_layers)

  def context(self, taps: jax.Array) -> jax.Array:  # [B, T, E] (taps side by side, in cfg.taps order) -> [B, T, D]
    return self.hidden_norm(jnp.einsum('bte,ed->btd', taps, self.fc[...]))

  def append_context(self, ctx: jax.Array, inputs: StepInputs, cache: KVCache) -> KVCache:
    """Writes every layer's context keys (normed, rotated at `inputs.positions`) and values; lengths advance."""
    k_all, v_all = [], []
    for layer, k_pages, v_pages in zip(self.layers, cache.k_pages, cache.v_pages):
      key, value = layer.mixer.project_kv(ctx, inputs.positions)
      k_all.append(write_kv(k_pages, key, inputs.page_ids, inputs.page_slots))
      v_all.append(write_kv(v_pages, value, inputs.page_ids, inputs.page_slots))
    return dataclasses.replace(
        cache, k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=cache.lengths + inputs.query_lens
    )

  def block(self, embeds: jax.Array, inputs: StepInputs, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Block rows `embeds` [B, T, D] over the cached context and each other; returns (norm(out) [B, T, D], cache).

    `inputs` place the rows past the context (`StepInputs.chain(cache, ...)`)
    with an all-true mask; their keys and values land in the cache's pages but
    the returned cache keeps the context's lengths.
    """
    kv_lens = cache.lengths + inputs.query_lens
    causal = dataclasses.replace(inputs, mask=None)  # causal layers: each row sees the rows before it
    x, k_all, v_all = embeds, [], []
    for layer, k_pages, v_pages, is_causal in zip(self.layers, cache.k_pages, cache.v_pages, self.cfg.causal):
      kv = PagedKV(k_pages, v_pages, cache.block_tables, kv_lens)
      x, kv = layer(x, lambda attn, y, kv=kv, rows=causal if is_causal else inputs: attn(y, rows, kv))
      k_all.append(kv.k_pages)
      v_all.append(kv.v_pages)
    return self.norm(x), dataclasses.replace(cache, k_pages=tuple(k_all), v_pages=tuple(v_all))

  def unary(self, logits: jax.Array) -> jax.Array:  # target logits [..., V] -> float32
    """DFlash 2's unary logits: `logits * output_multiplier`, then `cap * tanh(. / cap)`."""
    z = logits.astype(jnp.float32) * self.cfg.output_multiplier
    cap = self.cfg.logit_softcap
    return z if cap is None else jnp.tanh(z / cap) * cap


def block_mask(b: int, t: int) -> jax.Array:  # [B, T, T] all true: block rows see each other
  return jnp.ones((b, t, t), bool)


# ---------------------------------------------------------------- checkpoint mapping (z-lab / SpecForge layout)


CONVS = ('attention_conv', 'mlp_conv')  # DFlash 2: the convolutions of each layer
SELECTOR = {  # CandidateSelector param -> (tensor name, stored transposed)
    'predecessor_codebook': ('candidate_selector.predecessor_codebook', False),
    'successor_codebook': ('candidate_selector.successor_codebook', False),
    'hidden_projection': ('candidate_selector.hidden_projection.weight', True),
}


def hf_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
  """The draft's tensors: name -> shape."""
  d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  shapes = {'fc.weight': (d, len(cfg.taps) * d), 'hidden_norm.weight': (d,), 'norm.weight': (d,)}
  for i in range(cfg.num_layers):
    p = f'layers.{i}.'
    shapes.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,)})
    shapes.update({p + 'self_attn.q_proj.weight': (n * h, d), p + 'self_attn.o_proj.weight': (d, n * h)})
    shapes.update({p + 'self_attn.k_proj.weight': (k * h, d), p + 'self_attn.v_proj.weight': (k * h, d)})
    shapes.update({p + 'self_attn.q_norm.weight': (h,), p + 'self_attn.k_norm.weight': (h,)})
    shapes.update({p + 'mlp.gate_proj.weight': (f, d), p + 'mlp.up_proj.weight': (f, d)})
    shapes[p + 'mlp.down_proj.weight'] = (d, f)
    for conv in CONVS if cfg.conv_taps else ():
      shapes[f'{p}{conv}.base_kernel'] = (2, cfg.conv_taps, d)
      shapes[f'{p}{conv}.kernel_projection.weight'] = (2 * cfg.conv_taps * cfg.conv_groups, d)
  if cfg.selector_rank:
    v, r = cfg.vocab_size, cfg.selector_rank
    shapes['candidate_selector.predecessor_codebook'] = (v, r)
    shapes['candidate_selector.successor_codebook'] = (v, r)
    shapes['candidate_selector.hidden_projection.weight'] = (r, d)
  return shapes


def params_from_hf(cfg: DFlashConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """Pops the draft's tensors (PyTorch layout) into the pure-dict state of `DFlashDraft`."""
  take = tensor_taker(tensors)
  d = cfg.hidden_size
  shapes = hf_shapes(cfg)
  layers = {}
  for i in range(cfg.num_layers):
    p = f'layers.{i}.'
    layers[i] = block_params(take, p, cfg.attention_spec(i), d, cfg.intermediate_size, sandwich=False)
    for conv in CONVS if cfg.conv_taps else ():
      kernel, projection = f'{p}{conv}.base_kernel', f'{p}{conv}.kernel_projection.weight'
      layers[i][conv] = {
          'base_kernel': take(kernel, shapes[kernel]),
          'kernel_projection': take(projection, shapes[projection]).T,
      }
  params = {
      'fc': take('fc.weight', (d, len(cfg.taps) * d)).T,
      'hidden_norm': {'scale': take('hidden_norm.weight', (d,))},
      'layers': layers,
      'norm': {'scale': take('norm.weight', (d,))},
  }
  if cfg.selector_rank:
    params['selector'] = {
        key: take(name, shapes[name]).T if transposed else take(name, shapes[name])
        for key, (name, transposed) in SELECTOR.items()
    }
  return params


def params_to_hf(cfg: DFlashConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf`."""
  n, k, h, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  arr = np.asarray
  tensors = {
      'fc.weight': arr(params['fc']).T,
      'hidden_norm.weight': arr(params['hidden_norm']['scale']),
      'norm.weight': arr(params['norm']['scale']),
  }
  for i in range(cfg.num_layers):
    layer, p = params['layers'][i], f'layers.{i}.'
    attn, mlp = layer['mixer'], layer['mlp']
    q, key, value = np.split(arr(attn['qkv_proj']).T, [n * h, (n + k) * h])
    gate, up = np.split(arr(mlp['gate_up']).T, [f])
    tensors.update(
        {
            p + 'input_layernorm.weight': arr(layer['mixer_norm']['scale']),
            p + 'post_attention_layernorm.weight': arr(layer['mlp_norm']['scale']),
            p + 'self_attn.q_proj.weight': q,
            p + 'self_attn.k_proj.weight': key,
            p + 'self_attn.v_proj.weight': value,
            p + 'self_attn.o_proj.weight': arr(attn['o_proj']).T,
            p + 'self_attn.q_norm.weight': arr(attn['q_norm']['scale']),
            p + 'self_attn.k_norm.weight': arr(attn['k_norm']['scale']),
            p + 'mlp.gate_proj.weight': gate,
            p + 'mlp.up_proj.weight': up,
            p + 'mlp.down_proj.weight': arr(mlp['down']).T,
        }
    )
    for conv in CONVS if cfg.conv_taps else ():
      tensors[f'{p}{conv}.base_kernel'] = arr(layer[conv]['base_kernel'])
      tensors[f'{p}{conv}.kernel_projection.weight'] = arr(layer[conv]['kernel_projection']).T
  for key, (name, transposed) in SELECTOR.items() if cfg.selector_rank else ():
    tensors[name] = arr(params['selector'][key]).T if transposed else arr(params['selector'][key])
  return {name: np.ascontiguousarray(w) for name, w in tensors.items()}
