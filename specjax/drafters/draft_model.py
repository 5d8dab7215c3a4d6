"""An independent draft model with its own paged KV cache.

Its cache mirrors the target's layout (same block tables, its own page pool)
and holds every committed token but the newest, like the target's. `propose`
first feeds the pending tokens as one ragged block (1; 2 after a fully
accepted step; up to K + 1 after a step that verified other drafts), then
drafts K tokens one at a time. `commit` keeps the fed drafts the step
emitted, compared token by token, so the cache stays exact whichever drafts
were verified (`ngram+draft-model`).
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
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal, chain_scan, token_window
from specjax.drafters.registry import DrafterFamily, checkpoint_option, draft_quant_for, quant_option
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModelState:
  cache: KVCache  # the draft model's; lengths = positions written
  fed: jax.Array  # [B, max_draft] the drafts fed at positions L + 1, ... by the last propose; -1 past them


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelDrafter(Drafter):
  """Drafts with a separate (smaller) model of the same vocabulary."""

  model: Model = None
  name: str = 'draft-model'
  provides_q: bool = True

  def params(self):
    return self.model.params

  def init_state(self, plan: BatchPlan) -> DraftModelState:
    cache = KVCache.create(
        self.model.kv_shapes,
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        block_tables=plan.block_tables,
        dtype=self.model.dtype,
    )
    return DraftModelState(cache, jnp.full((plan.batch, max(plan.max_draft, 1)), -1, jnp.int32))

  def prefill(self, target, params, state: DraftModelState, tokens, query_lens, hidden, taps=()):
    _, cache = nnx.merge(self.model.graphdef, params)(tokens, state.cache, query_lens)
    return dataclasses.replace(state, cache=cache)

  def _pending(self, state: DraftModelState, ctx: DraftContext):
    """The committed tokens not yet in the draft cache, [B, max_draft + 1], and how many each row has."""
    lengths = state.cache.lengths
    first = token_window(ctx.tokens, lengths, state.fed.shape[1] + 1)
    return first, jnp.where(ctx.active, ctx.lengths - lengths + 1, 0)

  def propose(self, target, params, state: DraftModelState, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    draft = nnx.merge(self.model.graphdef, params)
    first, pending = self._pending(state, ctx)
    drafts, q, dcache = draft_loop(
        draft,
        draft.logits,
        first,
        pending,
        state.cache,
        k,
        sampling,
        ctx.seq_ids,
        ctx.lengths + 1,
        need_q=not sampling.is_greedy,
    )
    fed = jnp.full_like(state.fed, -1).at[:, : k - 1].set(drafts[:, : k - 1])
    draft_lens = jnp.where(ctx.active, k, 0)
    return Proposal(drafts, draft_lens, q, DraftModelState(dcache, fed), cache)

  def advance(self, target, params, state: DraftModelState, cache, ctx: DraftContext, sampling):
    first, pending = self._pending(state, ctx)
    _, dcache = nnx.merge(self.model.graphdef, params)(first, state.cache, pending)
    return DraftModelState(dcache, jnp.full_like(state.fed, -1)), cache

  def commit(self, params, state: DraftModelState, ctx: DraftContext, n_emitted, taps, hidden=None):
    # Valid: everything up to the new last token that was written with the token emitted there.
    start = ctx.lengths - n_emitted + 1  # the position of the first fed draft
    emitted = token_window(ctx.tokens, start, state.fed.shape[1])
    agree = jnp.cumprod(state.fed == emitted, axis=1).sum(axis=1)
    lengths = jnp.minimum(jnp.minimum(state.cache.lengths, ctx.lengths), start + agree)
    return dataclasses.replace(state, cache=dataclasses.replace(state.cache, lengths=lengths.astype(jnp.int32)))


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModelOptions:
  draft_model: Any = checkpoint_option()
  draft_quant: str | None = quant_option()

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter draft-model needs --draft-model PATH')
    if isinstance(self.draft_model, str) and self.draft_quant == 'auto' and not _is_gguf(self.draft_model):
      raise SpecjaxError(f"--draft-quant auto keeps a GGUF draft model's blocks; {self.draft_model} is not a GGUF file")


def _is_gguf(spec: str) -> bool:
  """Whether a draft model spec (a path, demo name or hub id) resolves to a GGUF file (a wrong path raises)."""
  from specjax.loading import resolve

  return resolve(spec).endswith('.gguf')


def _build(target: Model, options: DraftModelOptions) -> DraftModelDrafter:
  draft = options.draft_model
  if isinstance(draft, str):
    from specjax.loading import load

    quant, group, act = draft_quant_for(target, options.draft_quant, gguf=_is_gguf(draft))
    dtype = str(target.dtype) if target.dtype is not None else None
    draft = load(draft, dtype=dtype, quant=quant, quant_group=group, quant_act=act)
  elif options.draft_quant is not None:
    raise SpecjaxError('--draft-quant applies to a draft model loaded from a path; this one is already loaded')
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
