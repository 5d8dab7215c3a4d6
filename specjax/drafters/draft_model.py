"""An independent draft model with its own paged KV cache.

Its cache mirrors the target's layout (same block tables, its own page pool)
and holds every committed token but the newest, like the target's. After a
fully accepted step it is one token behind, so `propose` first feeds the 1-2
pending tokens as one ragged block, then drafts K tokens one at a time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sampling as sampling_lib
from specjax.cache.paged import KVCache
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.errors import SpecjaxError
from specjax.models.base import Model
from specjax.verify import STREAM_SAMPLE


def check_compatible(target: Model, draft: Model) -> None:
  """Target and drafter must share the vocabulary (same ids, same tokenizer)."""
  tv, dv = target.config.vocab_size, draft.config.vocab_size
  if tv != dv:
    raise SpecjaxError(f'draft model vocabulary ({dv}) differs from the target\'s ({tv}): {draft.source}')
  if target.tokenizer.fingerprint() != draft.tokenizer.fingerprint():
    raise SpecjaxError(f'draft model tokenizer differs from the target\'s: {draft.source}')


def draft_loop(
    forward,  # (tokens [B, T], cache, query_lens [B]) -> (hidden [B, T, D], cache)
    logits_fn,  # hidden [B, D] -> logits [B, V]
    first_tokens: jax.Array,  # [B, T0] tokens to feed before the first draft
    first_lens: jax.Array,  # [B] real tokens in first_tokens (0 = inactive row)
    cache,
    k: int,
    sampling,
    seq_ids: jax.Array,  # [B]
    first_pos: jax.Array,  # [B] absolute position of the first draft
    need_q: bool,
):
  """K autoregressive draft tokens: (drafts [B, K], q [B, K, V] | None, cache)."""
  hidden, cache = forward(first_tokens, cache, first_lens)
  h = jnp.take_along_axis(hidden, jnp.maximum(first_lens - 1, 0)[:, None, None], axis=1)[:, 0]
  step_lens = (first_lens > 0).astype(jnp.int32)
  drafts, qs = [], []
  for i in range(k):
    logits = logits_fn(h).astype(jnp.float32)
    keys = sampling_lib.row_keys(sampling.seed, seq_ids, first_pos + i, STREAM_SAMPLE)
    x = sampling_lib.sample(logits, sampling, keys)
    drafts.append(x)
    if need_q:
      qs.append(sampling_lib.probs(logits, sampling))
    if i < k - 1:
      hidden, cache = forward(x[:, None], cache, step_lens)
      h = hidden[:, 0]
  q = jnp.stack(qs, axis=1) if need_q else None
  return jnp.stack(drafts, axis=1), q, cache


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelDrafter(Drafter):
  """Drafts with a separate (smaller) model of the same vocabulary."""

  model: Model = None
  name: str = 'draft-model'
  provides_q: bool = True

  def params(self):
    return self.model.params

  def init_state(self, plan: BatchPlan) -> KVCache:
    return KVCache.create(self.model.kv_shapes, num_pages=plan.num_pages, page_size=plan.page_size,
                          block_tables=plan.block_tables)

  def prefill(self, target, params, state, tokens, query_lens, hidden):
    _, state = nnx.merge(self.model.graphdef, params)(tokens, state, query_lens)
    return state

  def propose(self, target, params, state: KVCache, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    draft = nnx.merge(self.model.graphdef, params)
    pending = jnp.where(ctx.active, ctx.lengths - state.lengths + 1, 0)  # 1, or 2 after a full accept
    idx = jnp.clip(state.lengths[:, None] + jnp.arange(2)[None, :], 0, ctx.tokens.shape[1] - 1)
    first = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    drafts, q, state = draft_loop(
        draft, draft.logits, first, pending, state, k, sampling, ctx.seq_ids, ctx.lengths + 1,
        need_q=not sampling.is_greedy)
    draft_lens = jnp.where(ctx.active, k, 0)
    return Proposal(drafts, draft_lens, q, state, cache)

  def commit(self, params, state: KVCache, ctx: DraftContext, n_emitted, taps, hidden=None):
    # Valid: everything up to the new last token, at most what was written.
    return dataclasses.replace(state, lengths=jnp.minimum(state.lengths, ctx.lengths))
