"""EAGLE-3 training (SafeAILab/EAGLE, SpecForge): the head over fused target taps, unrolled `ttt_steps` times.

Step 0 at row t: `fc` of the taps (residuals after `drafter.target_layer_ids`,
default layers 1, L/2 - 1, L - 4) with the raw embedding of x_{t+1}, at
position t (the layer's residual is `hidden_norm(fc(taps))` with
`drafter.norm_before_residual`, the default: the speculators recipe's; SpecForge
adds the raw `fc(taps)`, which on Gemma 3 is ~30x what attention and MLP add,
so a head trained that way ignored its token; experiments/train_eagle3_gemma3_270m;
`drafter.norm_before_fc` / `drafter.fc_norm` normalise the taps before `fc`,
all together or each on its own, and `drafter.norm_output` feeds the next step
the final-normed output: `Eagle3Config`'s variants);
step i feeds step i - 1's output (`Eagle3Head.output`: the layer's residual, or
its final norm with `norm_output`) with x_{t+i+1} at position t + i and attends to step 0's keys causally OR the
later steps' keys at its own row (`losses.ttt_attention`).
Loss: soft cross-entropy against the target distribution restricted to the
draft vocabulary (rows whose target argmax is outside it skipped), step i
weighted `train.ttt_decay`^i. The draft vocabulary is the `draft_vocab_size`
most frequent target tokens among the loss-masked training tokens, sorted by
id: `d2t` (target id = draft id + d2t[draft id]) and `t2d` (a mask over the
target vocabulary). Export: `save_eagle3` (SpecForge / vLLM layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.taps import eagle3_default_taps
from specjax.train.features import from_batch
from specjax.train.losses import segment_mask, shift, soft_ce, target_distribution, target_features, ttt_attention
from specjax.train.base import DrafterTrainer, check_fields, final_norm_weight

NORM_FLAGS = ('norm_before_residual', 'norm_before_fc', 'fc_norm', 'norm_output')  # drafter.* keys, Eagle3Config fields


def draft_vocabulary(data, vocab_size: int, size: int) -> tuple[np.ndarray, np.ndarray]:
  """(d2t [size], t2d [V]): the `size` most frequent loss-masked target tokens (ties: lower id), sorted by id."""
  counts = np.zeros(vocab_size, np.int64)
  if data is not None and len(data):
    learned = data.loss_mask & (data.segments > 0)
    counts += np.bincount(data.tokens[learned].reshape(-1), minlength=vocab_size)[:vocab_size]
  order = np.lexsort((np.arange(vocab_size), -counts))  # by count, then by id
  ids = np.sort(order[:size])
  t2d = np.zeros(vocab_size, bool)
  t2d[ids] = True
  return (ids - np.arange(size)).astype(np.int64), t2d


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Trainer(DrafterTrainer):
  graphdef: Any = None
  cfg: Any = None  # specjax.models.eagle3.Eagle3Config
  target: Any = None  # the loaded Model
  d2t: Any = None  # [draft V] int64
  t2d: Any = None  # [V] bool
  decay: float = 0.8
  chunk: int = 256
  head_from_target: bool = False
  kind: str = 'eagle3'

  def init(self, key) -> nnx.State:
    from specjax.models.eagle3 import Eagle3Head

    head = Eagle3Head(self.cfg, dtype=jnp.float32, rngs=nnx.Rngs(params=key))
    if self.head_from_target:
      start_from_target_head(head, self.target, self.draft_ids(), self.tap_scale)
    return nnx.split(head)[1]

  def draft_ids(self) -> jax.Array:  # [V'] the target id of each draft id
    return jnp.arange(self.cfg.draft_vocab_size) + jnp.asarray(self.d2t, jnp.int32)

  def unroll(self, params, target, batch: dict, taps: tuple[jax.Array, ...]) -> list[jax.Array]:
    """The head's output [B, T, D] (`Eagle3Head.output`, what the next step reads) at each training-time-test step."""
    head = nnx.merge(self.graphdef, params)
    mask = segment_mask(batch['segments'])
    h, prev, outs = head.fuse(self.scale_taps(jnp.concatenate(taps, axis=-1).astype(jnp.float32))), [], []
    for i in range(self.positions):
      positions = batch['positions'] + i
      embeds = target.lookup(shift(batch['tokens'], i + 1)).astype(jnp.float32)
      normed = head.hidden_norm(h)
      residual = normed if self.cfg.norm_before_residual else h
      x = jnp.concatenate([head.input_layernorm(embeds), normed], axis=-1)
      out, kv = ttt_attention(head.self_attn, x, positions, mask, prev)
      prev.append(kv)
      x = residual + out
      h = head.output(x + head.mlp(head.post_attention_layernorm(x)))
      outs.append(h)
    return outs

  def loss(self, params, target, batch: dict, key, norm=None) -> tuple[jax.Array, dict]:
    head = nnx.merge(self.graphdef, params)
    hidden, taps = from_batch(batch, len(self.taps)) or target_features(target, batch, self.taps)
    segments, loss_mask = batch['segments'], batch['loss_mask']
    draft_ids = self.draft_ids()
    total, metrics = 0.0, {'ce': [], 'agree': [], 'count': [], 'norm': []}
    best = batch.get('target_best')  # cached: only the draft vocabulary is projected
    dist = target_distribution(target.logits, hidden, self.chunk, draft_ids, best)  # once, shifted for every step
    for i, h in enumerate(self.unroll(params, target, batch, taps)):
      valid = (segments > 0) & (shift(segments, i + 2, -1) == segments) & shift(loss_mask, i + 2, False)
      step_dist = tuple(shift(x, i + 1) for x in dist)
      ce, agree, count, rows = soft_ce(
          head.logits, target.logits, h, step_dist, valid, self.chunk, draft_ids, hard=self.hard_targets
      )
      total = total + self.decay**i * ce / jnp.maximum(rows if norm is None else norm[i], 1.0)
      for name, value in (('ce', ce), ('agree', agree), ('count', count), ('norm', rows)):
        metrics[name].append(value)
    return total, {k: jnp.stack(v) for k, v in metrics.items()}

  def export(self, params, path: str) -> None:
    from specjax.loading.eagle3 import save_eagle3

    save_eagle3(path, self.cfg, self.served(params), self.d2t, self.t2d)

  def load(self, path: str) -> nnx.State:
    from specjax.loading.eagle3 import load_eagle3

    return load_eagle3(path, self.target, dtype='float32').params


def start_from_target_head(head, target, draft_ids: jax.Array, tap_scale=None) -> None:
  """Starts the head as the target's logit lens on its last tap: the target's head and norm, the layer a no-op.

  `lm_head` takes the target head's draft-vocabulary columns
  (`target.logits(I, draft_ids)`; a final softcap leaves them as they are to
  ~1e-6, head weights being far below it), `norm` the target's final norm,
  `fc` passes the last tap through, and the layer's output projections
  (`o_proj`, MLP `down`) start at zero. So the first logits are the target's
  own read of that layer's residual, in the target's logit scale (a random
  residual through Gemma's final norm, scales up to ~300, gives losses in the
  hundreds). SpecForge starts at random; on Gemma 3 270M, 40 steps from here did
  not beat 40 from random (experiments/train_eagle3_gemma3_270m). With a
  `tap_scale` [n * D], `fc` reads taps / scale, so it starts as diag(scale) on
  the last tap: the served `fc` (scale folded in) is still the pass-through.
  """
  model = nnx.merge(target.graphdef, target.params)
  d = head.cfg.hidden_size
  eye = jnp.eye(d, dtype=jnp.float32)
  head.lm_head[...] = model.logits(eye.astype(target.dtype), draft_ids).astype(jnp.float32)  # [D, V']
  head.norm.scale[...] = final_norm_weight(model)
  last = eye if tap_scale is None else eye * jnp.asarray(tap_scale[-d:], jnp.float32)[:, None]
  head.fc[...] = jnp.zeros_like(head.fc[...]).at[-d:].set(last)  # [n * D, D]: the last tap
  head.self_attn.o_proj[...] = jnp.zeros_like(head.self_attn.o_proj[...])
  head.mlp.down[...] = jnp.zeros_like(head.mlp.down[...])


def head_config(config, target, taps: tuple[int, ...]):
  """An `Eagle3Config` shaped like the target's `draft_layer_spec()`: its width, heads, MLP and RoPE."""
  from specjax.models.eagle3 import Eagle3Config

  c, layer = target.config, target.module().draft_layer_spec()
  attn = layer.attention
  return Eagle3Config(
      hidden_size=c.hidden_size,
      intermediate_size=layer.intermediate_size,
      num_heads=attn.num_heads,
      num_kv_heads=attn.num_kv_heads,
      head_dim=attn.head_dim,
      norm_eps=layer.norm_eps,
      rope=attn.rope,
      vocab_size=c.vocab_size,
      draft_vocab_size=config['drafter.draft_vocab_size'],
      taps=taps,
      max_position_embeddings=c.max_position_embeddings,  # a small value here silently lowers τ when served
      **{flag: config[f'drafter.{flag}'] for flag in NORM_FLAGS},
  )


def make(config, target, data) -> Eagle3Trainer:
  from specjax.errors import SpecjaxError
  from specjax.models.eagle3 import Eagle3Head

  if config['drafter.layers'] != 1:
    raise SpecjaxError(f"drafter.kind eagle3 has one decoder layer (drafter.layers=1), got {config['drafter.layers']}")
  taps = tuple(config['drafter.target_layer_ids']) or eagle3_default_taps(target.config.num_layers)
  cfg = head_config(config, target, taps)
  start = None
  if config['drafter.init_from']:  # fine-tuning: the checkpoint's head, vocabulary map and RoPE
    from specjax.loading.eagle3 import load_eagle3

    ck = load_eagle3(config['drafter.init_from'], target, dtype='float32')
    check_fields(
        ck.source,
        ck.config,
        cfg,
        ('taps', 'draft_vocab_size', *NORM_FLAGS, 'has_embedding'),
        f'set drafter.target_layer_ids, drafter.draft_vocab_size and drafter.{", drafter.".join(NORM_FLAGS)} to the '
        "checkpoint's (its own embed_tokens cannot be trained: training reads the target's)",
    )
    cfg, start, d2t, t2d = ck.config, ck.params, ck.d2t.astype(np.int64), ck.t2d
    if t2d is None:
      t2d = np.zeros(cfg.vocab_size, bool)
      t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
  else:
    d2t, t2d = draft_vocabulary(data, target.config.vocab_size, cfg.draft_vocab_size)
  graphdef = nnx.split(nnx.eval_shape(lambda: Eagle3Head(cfg, dtype=jnp.float32)))[0]
  return Eagle3Trainer(
      positions=config['train.ttt_steps'],
      taps=taps,
      graphdef=graphdef,
      cfg=cfg,
      target=target,
      d2t=d2t,
      t2d=t2d,
      decay=config['train.ttt_decay'],
      chunk=config['train.loss_chunk'],
      head_from_target=config['drafter.head_from_target'],
      start=start,
  )
