"""The jitted draft -> verify -> commit step, one executable per draft depth K.

  propose: drafter.propose(...)            -> drafts [B, K], draft_lens, q | None
  verify:  target.forward([last, drafts])  -> logits [B, K + 1, V], taps
  accept:  verify.verify(...)              -> n_accepted [B], tokens [B, K + 1]
  commit:  lengths += emitted; state slot; tokens buffer; drafter.commit(...)

Rows keep everything they accepted (ragged acceptance, never cut to the
slowest row). Emission stops at an EOS and at the row's token budget. The
rejected positions stay in the KV pages, masked by length and overwritten
later; hybrid models keep the recurrent state after every verified position
and commit the slot of the last kept one (`KVCache.commit`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.depths import step_depth, verify_widths  # noqa: F401  re-exported: older imports read them here
from specjax.drafters.base import DraftContext
from specjax.verify import verify


def write_tokens(
    buffer: jax.Array,  # [B, C]
    tokens: jax.Array,  # [B, T]
    start: jax.Array,  # [B] position of tokens[:, 0]
    count: jax.Array,  # [B] how many to write
) -> jax.Array:
  t = tokens.shape[1]
  idx = start[:, None] + jnp.arange(t)[None, :]
  idx = jnp.where(jnp.arange(t)[None, :] < count[:, None], idx, buffer.shape[1])  # out of range: dropped
  return buffer.at[jnp.arange(buffer.shape[0])[:, None], idx].set(tokens, mode='drop')


def draft_context(state) -> DraftContext:
  """What a drafter sees of a decode state."""
  return DraftContext(state.tokens, state.cache.lengths, state.last_tokens, state.active, state.seq_ids)


def propose_phase(graphdef, params, dparams, state, *, drafter, k: int, sampling):
  """Drafts K tokens per row; returns (state, proposal) with the drafter's cache writes in state."""
  target = nnx.merge(graphdef, params)
  prop = drafter.propose(target, dparams, state.drafter, state.cache, draft_context(state), k, sampling)
  return dataclasses.replace(state, cache=prop.cache, drafter=prop.state), prop


def verify_phase(graphdef, params, dparams, state, prop, eos_ids, *, drafter, k: int, sampling):
  """Verifies a proposal in one target pass over K + 1 positions and commits what each row accepted."""
  target = nnx.merge(graphdef, params)
  old_len = state.cache.lengths
  block = jnp.concatenate([state.last_tokens[:, None], prop.drafts], axis=1)  # [B, K + 1]
  hidden, cache, taps = target.forward(
      block, state.cache, jnp.where(state.active, k + 1, 0).astype(jnp.int32), taps=drafter.taps)
  logits = target.logits(hidden).astype(jnp.float32)  # [B, K + 1, V]
  n_accepted, out = verify(logits, prop.drafts, prop.draft_lens, prop.q, sampling, state.seq_ids, old_len + 1)
  hidden = hidden if drafter.reads_hidden else None

  steps = jnp.arange(k + 1)
  is_eos = jnp.any(out[..., None] == eos_ids[None, None, :], axis=-1) & (steps[None, :] <= n_accepted[:, None])
  first_eos = jnp.min(jnp.where(is_eos, steps[None, :], k + 1), axis=1)
  budget = state.max_new - state.num_generated
  emitted = jnp.minimum(jnp.minimum(n_accepted + 1, first_eos + 1), budget)
  emitted = jnp.where(state.active, emitted, 0)
  num_generated = state.num_generated + emitted
  finished = (first_eos < emitted) | (num_generated >= state.max_new)
  active = state.active & ~finished
  last = jnp.take_along_axis(out, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
  last_tokens = jnp.where(emitted > 0, last, state.last_tokens)
  new_len = old_len + emitted
  tokens = write_tokens(state.tokens, out, old_len + 1, emitted)
  cache = cache.commit(new_len, emitted)  # rejected positions: masked by length, state slot of the last kept
  new_ctx = DraftContext(tokens, new_len, last_tokens, active, state.seq_ids)
  dstate = drafter.commit(dparams, state.drafter, new_ctx, emitted, taps, hidden)
  state = dataclasses.replace(state, cache=cache, tokens=tokens, last_tokens=last_tokens, active=active,
                              num_generated=num_generated, drafter=dstate)
  accepted = jnp.where(emitted > 0, n_accepted, 0)
  return state, (out, emitted, accepted, prop.draft_lens, active)


def spec_step(graphdef, params, dparams, state, eos_ids, *, drafter, k: int, sampling):
  """One speculative step; returns (state, (tokens [B, K+1], emitted [B], accepted [B], drafted [B], active [B]))."""
  static = dict(drafter=drafter, k=k, sampling=sampling)
  state, prop = propose_phase(graphdef, params, dparams, state, **static)
  return verify_phase(graphdef, params, dparams, state, prop, eos_ids, **static)
