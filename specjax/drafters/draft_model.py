"""An independent draft model with its own paged KV cache.

Its cache mirrors the target's layout (same block tables, its own page pool)
and holds every committed token but the newest, like the target's. After a
fully accepted step it is one token behind, so `propose` first feeds the 1-2
pending tokens as one ragged block, then drafts K tokens one at a time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sampling as sampling_lib
from specjax.cache.paged import KVCache
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal, chain_scan
from specjax.drafters.registry import DrafterFamily, checkpoint_option
from specjax.errors import SpecjaxError
from specjax.models.base import Model
from specjax.sampling import STREAM_SAMPLE


def check_compatible(target: Model, draft: Model) -> None:
  """Target and drafter must share the vocabulary (same ids, same tokenizer)."""
  tv, dv = target.config.vocab_size, draft.config.vocab_size
  if tv != dv:
    raise SpecjaxError(f"draft model vocabulary ({dv}) differs from the target's ({tv}): {draft.source}")
  if target.tokenizer.fingerprint() != draft.tokenizer.fingerprint():
    raise SpecjaxError(f"draft model tokenizer differs from the target's: {draft.source}")


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
  """K autoregressive draft tokens: (drafts [B, K], q [B, K, V] | None, cache).

  The K - 1 draft-and-feed steps run as one `lax.scan` (`chain_scan`); the last
  draft is sampled after it without a forward pass.
  """
  hidden, cache = forward(first_tokens, cache, first_lens)
  h = jnp.take_along_axis(hidden, jnp.maximum(first_lens - 1, 0)[:, None, None], axis=1)[:, 0]
  step_lens = (first_lens > 0).astype(jnp.int32)

  def draw(h, i):  # h [B, D] -> token [B], q [B, V] | None
    logits = logits_fn(h).astype(jnp.float32)
    keys = sampling_lib.row_keys(sampling.seed, seq_ids, first_pos + i, STREAM_SAMPLE)
    return sampling_lib.sample(logits, sampling, keys), sampling_lib.probs(logits, sampling) if need_q else None

  def feed(x, h, cache):  # the drafted token x [B] through the draft model
    hidden, cache = forward(x[:, None], cache, step_lens)
    return hidden[:, 0], cache

  return chain_scan(draw, feed, h, cache, k)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelDrafter(Drafter):
  """Drafts with a separate (smaller) model of the same vocabulary."""

  model: Model = None
  name: str = 'draft-model'
  provides_q: bool = True

  def params(self):
    return self.model.params

  def init_state(self, plan: BatchPlan) -> KVCache:
    return KVCache.create(
        self.model.kv_shapes,
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        block_tables=plan.block_tables,
        dtype=self.model.dtype,
    )

  def prefill(self, target, params, state, tokens, query_lens, hidden, taps=()):
    _, state = nnx.merge(self.model.graphdef, params)(tokens, state, query_lens)
    return state

  def propose(self, target, params, state: KVCache, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    draft = nnx.merge(self.model.graphdef, params)
    pending = jnp.where(ctx.active, ctx.lengths - state.lengths + 1, 0)  # 1, or 2 after a full accept
    idx = jnp.clip(state.lengths[:, None] + jnp.arange(2)[None, :], 0, ctx.tokens.shape[1] - 1)
    first = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    drafts, q, state = draft_loop(
        draft,
        draft.logits,
        first,
        pending,
        state,
        k,
        sampling,
        ctx.seq_ids,
        ctx.lengths + 1,
        need_q=not sampling.is_greedy,
    )
    draft_lens = jnp.where(ctx.active, k, 0)
    return Proposal(drafts, draft_lens, q, state, cache)

  def commit(self, params, state: KVCache, ctx: DraftContext, n_emitted, taps, hidden=None):
    # Valid: everything up to the new last token, at most what was written.
    return dataclasses.replace(state, lengths=jnp.minimum(state.lengths, ctx.lengths))


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelOptions:
  draft_model: Any = checkpoint_option()

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter draft-model needs --draft-model PATH')


def _build(target: Model, options: DraftModelOptions) -> DraftModelDrafter:
  draft = options.draft_model
  if isinstance(draft, str):
    from specjax.loading import load

    draft = load(draft, dtype=str(target.dtype) if target.dtype is not None else None)
  check_compatible(target, draft)
  if draft.is_hybrid:
    raise SpecjaxError(
        f'draft model {draft.source}: hybrid (recurrent-state) draft models are not supported '
        'as independent drafters; use --mtp for their built-in head'
    )
  return DraftModelDrafter(model=draft)


FAMILY = DrafterFamily(
    name='draft-model',
    options=DraftModelOptions,
    build=_build,
    help='an independent smaller model, same vocabulary',
    label=lambda o: f'draft-model({os.path.basename(str(getattr(o.draft_model, "source", o.draft_model)).rstrip("/"))})',
)
