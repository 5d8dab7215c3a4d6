"""DFlash training (SpecForge `OnlineDFlashModel`): random anchors, one block each, all in one draft forward.

Per packed row, up to `drafter.anchors` anchors a are drawn from the step's
key among the positions whose next token is learned (loss_mask[a + 1], a + 1
in a's sequence). Anchor a's block is `[x_a, MASK x (B - 1)]` at positions
a .. a + B - 1 of its sequence, embedded with the target's `embed`: the block
serving runs after committing x_0 .. x_{a-1}. `blocks` runs every block of
the rows in one forward of the draft. Context keys and values come from
`hidden_norm(fc(taps))` at every row position; a block row sees the context
of its own sequence before its anchor (strictly; on sliding layers only
within the window of the block's last position, where the paged kernel
places every row of an all-true block mask), its own block's rows (causal
layers: the rows up to it) and never another block.

Loss: block row k (1..B - 1) goes through the target's head and is scored by
soft cross-entropy against the target's distribution at a + k - 1, as
`eagle3` and `mtp` score theirs (on regenerated data the data token is that
distribution's argmax; the soft target keeps the rest of it, and data the
target did not write still teaches the target's law). It counts where
x_{a+k} is in a's sequence and learned; row k weighs exp(-(k - 1) / gamma)
(`train.dflash_gamma`), and the sum is divided by the summed weights
(upstream's weighted mean). Metrics per row k: top-1 agreement with the
target. `drafter.head_from_target` starts the draft's final norm as the
target's (Gemma's weights reach ~300; a draft whose norm starts at 1 reads
the target's head in another geometry; on Gemma 3 270M it trained worse,
experiments/train_dflash_gemma3_270m). `drafter.context_dropout` p hides
the context from a share p of the training blocks (not at eval): a draft
that has learned to read only the context (on Gemma 3 270M its block rows
put ~0.1% of their attention on x_a) must predict those from x_a and the
block alone. Export: `save_dflash` (z-lab /
SpecForge layout), served by `--drafter dflash --draft-model OUT/export`. DFlash 1 only: DFlash 2's
convolutions and candidate selector are not trained.

Einsum letters: R rows, T row positions (the context), A anchors, B block
rows (C: the same as keys), K kv heads, G query heads per kv head, H head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.paged_attention import MASK_VALUE
from specjax.errors import SpecjaxError
from specjax.train.features import from_batch
from specjax.train.losses import shift, soft_ce, target_features
from specjax.train.base import DrafterTrainer, check_fields, final_norm_weight

MASK_TOKENS = ('<|MASK|>', '<mask>', '<|mask|>', '[MASK]')


def sample_anchors(key, batch: dict, n: int) -> tuple[jax.Array, jax.Array]:
  """Up to `n` distinct anchors per row ([R, A] row indices) whose next token is learned, and which are real."""
  segments = batch['segments']
  ok = (segments > 0) & (shift(segments, 1, -1) == segments) & shift(batch['loss_mask'], 1, False)  # [R, T]
  score = jnp.where(ok, jax.random.uniform(key, ok.shape), 2.0)
  neg, anchors = jax.lax.top_k(-score, min(n, ok.shape[1]))  # uniformly drawn, without replacement
  return anchors.astype(jnp.int32), neg > -2.0


def block_attention(attn, x: jax.Array, positions: jax.Array, context: tuple, seen: tuple) -> jax.Array:
  """One draft layer's attention for all blocks: x [R, A * B, D] normed rows at positions [R, A * B].

  `context`: the layer's context (keys, values) [R, T, K, H]; `seen`: which
  context keys [R, A, B or 1, T] and block rows [B, C] each row sees.
  """
  s = attn.spec
  seen_context, seen_block = seen
  r, a, b = x.shape[0], seen_context.shape[1], seen_block.shape[0]
  q, k, v, gate = attn.project(x, positions)
  n, h, kh = q.shape[2], q.shape[3], k.shape[2]
  qg = q.reshape(r, a, b, kh, n // kh, h)
  kb, vb = k.reshape(r, a, b, kh, h), v.reshape(r, a, b, kh, h)
  keys, values = context
  t = keys.shape[1]
  logits = (
      jnp.concatenate(
          [
              jnp.einsum('rabkgh,rtkh->rkgabt', qg, keys, preferred_element_type=jnp.float32),
              jnp.einsum('rabkgh,rackh->rkgabc', qg, kb, preferred_element_type=jnp.float32),
          ],
          axis=-1,
      )
      * s.scale
  )  # [R, K, G, A, B, T + C]
  if s.softcap:
    logits = jnp.tanh(logits / s.softcap) * s.softcap
  mask = jnp.concatenate([jnp.broadcast_to(seen_context, (r, a, b, t)), jnp.broadcast_to(seen_block, (r, a, b, b))], -1)
  probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, MASK_VALUE), axis=-1)  # a row always sees itself
  probs = probs.astype(v.dtype)
  out = jnp.einsum('rkgabt,rtkh->rabkgh', probs[..., :t], values)
  out = out + jnp.einsum('rkgabc,rackh->rabkgh', probs[..., t:], vb)
  return attn.output(out.reshape(r, a * b, n, h), gate)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashTrainer(DrafterTrainer):
  graphdef: Any = None
  cfg: Any = None  # specjax.models.dflash.DFlashConfig
  target: Any = None  # the loaded Model (export, load)
  anchors: int = 512
  gamma: float = 7.0
  chunk: int = 256
  norm_from_target: bool = False  # drafter.head_from_target
  context_dropout: float = 0.0  # drafter.context_dropout: share of training blocks without context
  kind: str = 'dflash'

  def init(self, key) -> nnx.State:
    from specjax.models.dflash import DFlashDraft

    draft = DFlashDraft(self.cfg, dtype=jnp.float32, rngs=nnx.Rngs(params=key))
    if self.norm_from_target:  # the draft's output enters the target's head as the target's own final norm leaves it
      draft.norm.scale[...] = final_norm_weight(nnx.merge(self.target.graphdef, self.target.params))
    return nnx.split(draft)[1]

  def visibility(self, batch: dict, anchors: jax.Array, blind=None) -> list[tuple[jax.Array, jax.Array]]:
    """Per draft layer: (context keys [R, A, B or 1, T], block rows [B, C]) each block row sees.

    `blind` [R, A]: blocks that see no context (`context_dropout`), only their own rows.
    """
    segments, positions = batch['segments'], batch['positions']
    b, t = self.cfg.block_size, segments.shape[1]
    start = jnp.take_along_axis(positions, anchors, axis=1)  # [R, A]
    own = jnp.take_along_axis(segments, anchors, axis=1)[..., None] == segments[:, None]
    if blind is not None:
      own = own & ~blind[..., None]
    before = (own & (jnp.arange(t) < anchors[..., None]))[:, :, None]  # [R, A, 1, T]
    rows, out = jnp.arange(b), []
    for window, causal in zip(self.cfg.windows, self.cfg.causal):
      # The paged kernel's window rule: a row sits at its depth in the block mask (all-true: B - 1).
      depth = rows if causal else jnp.full((b,), b - 1)
      block = rows[None, :] <= rows[:, None] if causal else jnp.ones((b, b), bool)
      context = before
      if window is not None:
        context = context & (start[..., None, None] + depth[:, None] - positions[:, None, None] < window)
        block = block & (depth[:, None] - rows[None, :] < window)
      out.append((context, block))
    return out

  def blocks(self, params, target, batch: dict, taps: tuple[jax.Array, ...], anchors: jax.Array, blind=None):
    """norm(out) [R, A, B, D] of the block of each anchor (row indices [R, A]), over the rows' taps."""
    draft = nnx.merge(self.graphdef, params)
    b, (r, a) = self.cfg.block_size, anchors.shape
    ctx = draft.context(self.scale_taps(jnp.concatenate(taps, axis=-1).astype(jnp.float32)))  # [R, T, D]
    first = jnp.take_along_axis(batch['tokens'], anchors, axis=1)[..., None]
    tokens = jnp.concatenate([first, jnp.full((r, a, b - 1), self.cfg.mask_token_id, first.dtype)], axis=-1)
    x = target.embed(tokens.reshape(r, a * b)).astype(jnp.float32)  # [R, A * B, D]
    start = jnp.take_along_axis(batch['positions'], anchors, axis=1)
    positions = (start[..., None] + jnp.arange(b)).reshape(r, a * b)
    for layer, seen in zip(draft.layers, self.visibility(batch, anchors, blind)):
      context = layer.mixer.project_kv(ctx, batch['positions'])
      mix = lambda attn, y, context=context, seen=seen: (block_attention(attn, y, positions, context, seen), None)
      x, _ = layer(x, mix)
    return draft.norm(x).reshape(r, a, b, -1)

  def loss(self, params, target, batch: dict, key, norm=None) -> tuple[jax.Array, dict]:
    hidden, taps = from_batch(batch, len(self.taps)) or target_features(target, batch, self.taps)
    segments, loss_mask = batch['segments'], batch['loss_mask']
    t = segments.shape[1]
    anchors, keep = sample_anchors(jax.random.key(0) if key is None else key, batch, self.anchors)  # eval: one draw
    blind = None
    if self.context_dropout and key is not None:
      blind = jax.random.bernoulli(jax.random.fold_in(key, 1), self.context_dropout, anchors.shape)  # [R, A]
    out = self.blocks(params, target, batch, taps, anchors, blind)
    own = jnp.take_along_axis(segments, anchors, axis=1)
    ks = jnp.arange(1, self.cfg.block_size)  # [B - 1] row k drafts x_{a+k}, the target's next token at a + k - 1
    at = jnp.minimum(anchors[None] + ks[:, None, None], t - 1)  # [B - 1, R, A]
    take = lambda x: jnp.take_along_axis(x[None], at, axis=2)  # [R, T] -> [B - 1, R, A]
    valid = keep & (anchors + ks[:, None, None] < t) & (take(segments) == own) & take(loss_mask)
    th = jnp.take_along_axis(hidden[None], (at - 1)[..., None], axis=2)  # [B - 1, R, A, D]
    flat = lambda x: x.reshape((x.shape[0], -1) + x.shape[3:])  # [B - 1, R, A, ...] -> [B - 1, R * A, ...]
    drafts = jnp.moveaxis(out[:, :, 1:], 2, 0)  # [B - 1, R, A, D]
    # One scan over all block rows, k-major, `chunk` rows of the vocabulary projection at a time.
    chunk = max(1, self.chunk // (self.cfg.block_size - 1))
    ce, agree, count, rows = soft_ce(
        target.logits, target.logits, flat(drafts), flat(th), flat(valid), chunk, by_row=True, hard=self.hard_targets
    )  # [B - 1] each
    w = jnp.exp(-(ks - 1) / self.gamma)
    denominator = jnp.sum(w * (rows if norm is None else norm))
    return jnp.sum(w * ce) / jnp.maximum(denominator, 1e-6), {'ce': ce, 'agree': agree, 'count': count, 'norm': rows}

  def export(self, params, path: str) -> None:
    from specjax.loading.dflash import save_dflash

    save_dflash(path, self.cfg, self.served(params))

  def load(self, path: str) -> nnx.State:
    from specjax.loading.dflash import load_dflash

    return load_dflash(path, self.target, dtype='float32').params


def default_mask_token(target) -> int | None:
  """A mask token the tokenizer names, else the first embedding row past the tokenizer's (Qwen3's `<|MASK|>`,
  151669, is that row), else pad or unk; None without any."""
  backend, vocab = target.tokenizer.backend, target.config.vocab_size
  named = lambda names: next((i for i in map(backend.token_to_id, names) if i is not None and i < vocab), None)
  found = named(MASK_TOKENS)
  if found is None and backend.get_vocab_size(with_added_tokens=True) < vocab:
    found = backend.get_vocab_size(with_added_tokens=True)
  return named(('<pad>', '<unk>', '[PAD]', '<|pad|>')) if found is None else found


def draft_config(config, target):
  """A `DFlashConfig` shaped like the target's `draft_layer_spec()` (in Qwen3 layers: q/k norms, SwiGLU)."""
  from specjax.loading.dflash import default_taps
  from specjax.models.dflash import DFlashConfig

  c = target.config
  layers = config['drafter.layers']
  taps = tuple(config['drafter.target_layer_ids']) or default_taps(c.num_layers, layers)
  if not all(0 <= i < c.num_layers - 1 for i in taps):  # upstream reads hidden_states[id + 1], never the final one
    origin = 'drafter.target_layer_ids' if config['drafter.target_layer_ids'] else 'the default taps'
    raise SpecjaxError(
        f"drafter.kind dflash: {origin} {list(taps)} must be in 0..{c.num_layers - 2} for the target's "
        f'{c.num_layers} layers (set drafter.target_layer_ids)'
    )
  mask = config['drafter.mask_token_id']
  mask = default_mask_token(target) if mask is None else mask
  if mask is None or not 0 <= mask < c.vocab_size:
    raise SpecjaxError(
        f'drafter.mask_token_id={mask} must be a token id inside the target vocabulary (0..{c.vocab_size - 1})'
        if mask is not None
        else 'drafter.kind dflash: the tokenizer has no mask, pad or unk token; set drafter.mask_token_id'
    )
  layer = target.module().draft_layer_spec()
  attn = layer.attention
  return DFlashConfig(
      hidden_size=c.hidden_size,
      intermediate_size=layer.intermediate_size,
      num_heads=attn.num_heads,
      num_kv_heads=attn.num_kv_heads,
      head_dim=attn.head_dim,
      norm_eps=layer.norm_eps,
      rope=attn.rope,
      num_layers=layers,
      block_size=config['drafter.block_size'],
      mask_token_id=mask,
      taps=taps,
      num_target_layers=c.num_layers,
      vocab_size=c.vocab_size,
      max_position_embeddings=c.max_position_embeddings,
  )


def make(config, target, data) -> DFlashTrainer:
  from specjax.models.dflash import DFlashDraft

  cfg, start = draft_config(config, target), None
  if config['drafter.init_from']:  # fine-tuning: the checkpoint's draft (and its RoPE, position limit)
    from specjax.loading.dflash import load_dflash

    ck = load_dflash(config['drafter.init_from'], target, dtype='float32')
    fields = ('num_layers', 'block_size', 'mask_token_id', 'taps', 'windows', 'causal', 'conv_taps', 'selector_rank')
    check_fields(
        ck.source, ck.config, cfg, fields, "set the drafter keys to the checkpoint's (DFlash 2 cannot be trained)"
    )
    cfg, start = ck.config, ck.params
  graphdef = nnx.split(nnx.eval_shape(lambda: DFlashDraft(cfg, dtype=jnp.float32)))[0]
  return DFlashTrainer(
      positions=cfg.block_size - 1,
      taps=cfg.taps,
      graphdef=graphdef,
      cfg=cfg,
      target=target,
      anchors=config['drafter.anchors'],
      gamma=config['train.dflash_gamma'],
      chunk=config['train.loss_chunk'],
      norm_from_target=config['drafter.head_from_target'],
      context_dropout=config['drafter.context_dropout'],
      start=start,
  )
