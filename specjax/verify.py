"""Lossless verification of a chain of K drafts against one target pass.

Notation: `logits[:, i]` is the target's prediction for the token after
`[x_0, .., x_i]`, so position i checks draft `drafts[:, i]` (i < K) and position
K yields the bonus token. `positions[b]` is the absolute position of the token
that `logits[b, 0]` predicts.

Three schemes, chosen by the sampling settings and whether the drafter gives q:
- greedy (temperature 0): accept while the draft equals argmax p.
- sample-and-match (no q: n-gram, any deterministic drafter): draw y_i ~ p_i
  with the key a plain sampler would use at that position, accept while
  x_i == y_i, emit y at the first mismatch. The output is token-for-token what
  autoregressive sampling with the same seed emits.
- rejection sampling (q given): accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a draw from
  norm(max(0, p_i - q_i)); after K acceptances the bonus token from p_K.
p and q both pass through `sampling.probs`, so the output law is exactly the
target's sampling distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import sampling as sampling_lib
from specjax.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, SamplingParams

RESIDUAL_EPS = 1e-9


def leading_true(x: jax.Array) -> jax.Array:  # [B, K] bool -> [B] int32
  """Length of the all-true prefix of each row."""
  return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify(
    logits: jax.Array,  # [B, K + 1, V] target logits
    drafts: jax.Array,  # [B, K] int32
    draft_lens: jax.Array,  # [B] valid drafts per row (later ones never accepted)
    q: jax.Array | None,  # [B, K, V] draft distributions, or None
    sampling: SamplingParams,
    seq_ids: jax.Array,  # [B]
    positions: jax.Array,  # [B] absolute position predicted by logits[:, 0]
) -> tuple[jax.Array, jax.Array]:
  """Returns (n_accepted [B], tokens [B, K + 1]).

  The emitted tokens of row b are `tokens[b, :n_accepted[b] + 1]`: the accepted
  drafts, then the correction (or bonus) token.
  """
  b, k = drafts.shape
  steps = jnp.arange(k + 1)
  valid = steps[None, :k] < draft_lens[:, None]  # [B, K]
  pos = positions[:, None] + steps[None, :]  # [B, K + 1]

  if sampling.is_greedy or q is None:
    keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], pos, STREAM_SAMPLE)
    target = sampling_lib.sample(logits, sampling, keys)  # [B, K + 1]
    n_accepted = leading_true((drafts == target[:, :k]) & valid)
    return n_accepted, target

  p = sampling_lib.probs(logits, sampling)  # [B, K + 1, V]
  p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, K]
  q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  accept_keys = sampling_lib.row_keys(sampling.seed, seq_ids[:, None], pos[:, :k], STREAM_ACCEPT)
  u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(accept_keys)  # [B, K]
  # Strict: u in [0, 1) can be 0, and a draft the target excludes (p = 0) must never pass.
  n_accepted = leading_true((u * q_draft < p_draft) & valid)

  # The token at n_accepted: a residual draw after a rejected valid draft,
  # otherwise (bonus, or no draft there) a plain draw from p.
  p_at = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  q_at = jnp.take_along_axis(q_pad, n_accepted[:, None, None], axis=1)[:, 0]
  rejected = n_accepted < draft_lens
  residual = jnp.maximum(p_at - q_at, 0.0)
  use_residual = rejected & (residual.sum(-1) > RESIDUAL_EPS)
  weights = jnp.where(use_residual[:, None], residual, p_at)
  at = positions + n_accepted
  key_data = lambda stream: jax.random.key_data(sampling_lib.row_keys(sampling.seed, seq_ids, at, stream))
  keys = jnp.where(use_residual[:, None], key_data(STREAM_RESIDUAL), key_data(STREAM_SAMPLE))  # [B, 2]
  last = sampling_lib.gumbel_argmax(jnp.log(weights), keys)  # [B]
  tokens = jnp.where(steps[None, :] < n_accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
  return n_accepted, tokens.astype(jnp.int32)
