"""Pieces every drafter loss shares: target features, shifts, training-time-test attention, chunked soft CE.

A batch holds packed rows (`specjax.train.data.Packed`): `tokens`,
`positions`, `segments` (0: padding) and `loss_mask`, each [B, T]. The frozen
target runs cache-free over them (`target_features`): a token sees the earlier
tokens of its own sequence.

Training-time test (EAGLE-3, and the MTP head drafting deeper): step i runs
the drafter at row t at position t + i on step i - 1's output; its attention
sees step 0's keys causally (rows <= t of its sequence) OR the keys of steps
1..i at its own row (the diagonal): exactly what the drafter's cache holds
when it drafts the (i+1)-th token in serving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.contract import StepInputs
from specjax.models.layers import dense_attention


def shift(x: jax.Array, k: int, fill=0) -> jax.Array:
  """x[:, t + k] at t (axis 1), `fill` past the end."""
  if k == 0:
    return x
  pad = [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2)
  return jnp.pad(x[:, k:], pad, constant_values=fill)


def segment_mask(segments: jax.Array) -> jax.Array:  # [B, T] -> [B, T, T]
  """Token i sees token j iff j <= i in the same (non-padding) sequence."""
  t = segments.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  return causal[None] & (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)


def sequence_batch(tokens: jax.Array) -> dict:  # [B, T] -> a batch of B whole sequences, every token learned
  """The batch `target_features` and the trainers read, for unpacked rows (one sequence each, from position 0)."""
  b, t = tokens.shape
  return {
      'tokens': tokens,
      'positions': jnp.broadcast_to(jnp.arange(t), (b, t)),
      'segments': jnp.ones((b, t), jnp.int32),
      'loss_mask': jnp.ones((b, t), bool),
  }


def target_features(target, batch: dict, taps: tuple[int, ...] = ()) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """The frozen target over packed rows: final-normed hidden [B, T, D] and the residuals after `taps`.

  Hybrid targets (recurrent layers) take one sequence per row (`data.pack` is off for them) and no mask.
  """
  tokens, segments = batch['tokens'], batch['segments']
  if target.cache_layout().state_shapes:  # recurrent layers: one sequence per row, left-aligned, causal
    inputs = StepInputs(batch['positions'], jnp.sum(segments > 0, axis=1).astype(jnp.int32))
  else:
    lens = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    inputs = StepInputs(batch['positions'], lens, segment_mask(segments))
  hidden, _, tapped = target.forward(tokens, inputs, None, taps)
  return jax.lax.stop_gradient(hidden), tuple(jax.lax.stop_gradient(x) for x in tapped)


def ttt_attention(attn, x: jax.Array, positions: jax.Array, mask: jax.Array, prev: list) -> tuple[jax.Array, tuple]:
  """One training-time-test step of an `Attention` block.

  x [B, T, D] at `positions` [B, T]; `mask` [B, T, T] the step-0 (causal) mask;
  `prev` the (keys, values) of the earlier steps, step 0 first. Returns the
  output [B, T, D] and this step's (keys, values).
  """
  s = attn.spec
  q, k, v, gate = attn.project(x, positions)
  (k0, v0), diag = (prev[0], prev[1:] + [(k, v)]) if prev else ((k, v), [])
  seen = mask
  if s.window is not None:  # step-0 key j at position p_j, this query at p_i (+ the step): p_i - p_j < window
    seen = seen & (positions[:, :, None] - (positions - len(diag))[:, None, :] < s.window)
  out = dense_attention(q, k0, v0, seen, scale=s.scale, softcap=s.softcap, row_kv=tuple(diag))
  return attn.output(out, gate), (k, v)


def _target_chunk(target_logits, th: jax.Array, draft_ids: jax.Array | None, best: jax.Array | None = None):
  """The target's side of one chunk: (p [.., V'] on the draft vocabulary, argmax in it [..] bool, argmax [..]).

  With the target's argmax `best` known (cached features), only the draft
  vocabulary's columns are projected (`target_logits(th, ids)`).
  """
  if best is not None and draft_ids is not None:
    p_logits = jax.lax.stop_gradient(target_logits(th, draft_ids).astype(jnp.float32))
  else:
    full = jax.lax.stop_gradient(target_logits(th).astype(jnp.float32))
    best = jnp.argmax(full, axis=-1)
    if draft_ids is None:
      return jax.nn.softmax(full, axis=-1), jnp.ones(best.shape, bool), best
    p_logits = jnp.take(full, draft_ids, axis=-1)
  return jax.nn.softmax(p_logits, axis=-1), draft_ids[jnp.argmax(p_logits, axis=-1)] == best, best


def _chunks(x: jax.Array, c: int) -> jax.Array:  # [B, T, ...] -> [T / c, B, c, ...] (T padded)
  pad = -x.shape[1] % c
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((x.shape[0], -1, c) + x.shape[2:]), 1, 0)


def target_distribution(
    target_logits,  # fn: [B, C, D] -> [B, C, V]
    target_hidden: jax.Array,  # [B, T, D]
    chunk: int,
    draft_ids: jax.Array | None = None,  # [V']
    best: jax.Array | None = None,  # [B, T] the target's argmax over its vocabulary, when cached
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The target's side of `soft_ce` for every position, once: (p [B, T, V'], argmax in V' [B, T], argmax [B, T]).

  Training-time test compares every step with the same target rows (shifted),
  so a drafter with a small vocabulary computes them once and passes them to
  `soft_ce` instead of the hidden states.
  """
  b, t, _ = target_hidden.shape
  c = min(chunk, t)
  if best is None:
    chunk_fn = lambda _, th: (None, _target_chunk(target_logits, th, draft_ids))
    xs = _chunks(target_hidden, c)
  else:
    chunk_fn = lambda _, x: (None, _target_chunk(target_logits, x[0], draft_ids, x[1]))
    xs = (_chunks(target_hidden, c), _chunks(best, c))
  _, out = jax.lax.scan(chunk_fn, None, xs)
  return tuple(jnp.moveaxis(x, 0, 1).reshape((b, -1) + x.shape[3:])[:, :t] for x in out)


def soft_ce(
    draft_logits,  # fn: [B, C, D] -> [B, C, V'] the drafter's logits (V' = V, or the draft vocabulary)
    target_logits,  # fn: [B, C, D] -> [B, C, V] the target's logits
    draft_hidden: jax.Array,  # [B, T, D]
    target_hidden: jax.Array | tuple,  # [B, T, D] aligned: row t holds the target state whose next token row t
    # predicts; or that row's `target_distribution`, computed once
    valid: jax.Array,  # [B, T] bool
    chunk: int,
    draft_ids: jax.Array | None = None,  # [V'] target id of each draft-vocabulary id (None: the same vocabulary)
    by_row: bool = False,
    hard: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Soft cross-entropy against the target distribution: (summed CE, agreements, predictions, CE rows).

  The four are scalars, or with `by_row` summed over T only ([B] each).

  With a draft vocabulary the target distribution is its softmax restricted to
  `draft_ids`, and a row counts for the loss only where the target's argmax is
  among them; agreement (the drafted target id = the target's argmax) counts
  every valid row. `hard` in [0, 1] mixes the target's argmax into its
  distribution, (1 - hard) * p + hard * one_hot(argmax p): the token greedy
  verification accepts, whose share of the loss does not shrink when p is
  flat. The vocabulary projection runs `chunk` positions at a time,
  so [B, T, V] logits never exist at once. Each chunk computes its gradient with
  respect to `draft_hidden` in the forward pass, (softmax(q) - p) pulled back
  through the head, and enters the loss through a term linear in
  `draft_hidden` (value 0, gradient that): three vocabulary-sized matmuls per
  position instead of five (forward, rematerialised forward, backward), and no
  logits kept for the backward pass.
  """
  b, t, _ = draft_hidden.shape
  c = min(chunk, t)
  given = isinstance(target_hidden, tuple)
  xs = (_chunks(draft_hidden, c), tuple(_chunks(x, c) for x in target_hidden) if given else _chunks(target_hidden, c))

  def body(carry, xs):
    (dh, v), target = xs
    fixed = jax.lax.stop_gradient(dh)
    q_logits, pullback = jax.vjp(lambda x: draft_logits(x).astype(jnp.float32), fixed)
    logq = jax.nn.log_softmax(q_logits, axis=-1)
    p, in_draft, best = target if given else _target_chunk(target_logits, target, draft_ids)
    if hard:
      p = (1.0 - hard) * p + hard * jax.nn.one_hot(jnp.argmax(p, axis=-1), p.shape[-1], dtype=p.dtype)
    drafted = jnp.argmax(q_logits, axis=-1)
    if draft_ids is not None:
      drafted = draft_ids[drafted]
    hit = v & in_draft  # the target's argmax is in the draft vocabulary
    ce = -jnp.sum(p * logq, axis=-1)
    w = hit.astype(jnp.float32)
    (grad,) = pullback((jnp.exp(logq) - p) * w[..., None])  # d sum(w * ce) / d dh (p sums to 1)
    grad = jax.lax.stop_gradient(grad)
    v = v.astype(jnp.float32)
    linear = jnp.sum(grad * dh, axis=(1, 2)) - jnp.sum(grad * fixed, axis=(1, 2))  # 0, with gradient `grad`
    sums = (jnp.sum(ce * w, 1) + linear, jnp.sum((drafted == best) * v, 1), jnp.sum(v, 1), jnp.sum(w, 1))
    return tuple(a + (x if by_row else jnp.sum(x)) for a, x in zip(carry, sums)), None

  zero = jnp.zeros((b,) if by_row else (), jnp.float32)
  out, _ = jax.lax.scan(body, (zero,) * 4, ((xs[0], _chunks(valid, c)), xs[1]))
  return out
