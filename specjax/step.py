"""The jitted bodies of generation: prefill chunks, the decode step, and the
draft -> verify -> commit step, one executable per draft depth K.

All take the model's graphdef and params first and a `DecodeState` (donated).

  propose: drafter.propose(...)            -> drafts [B, K], draft_lens, q | None
  verify:  target.forward([last, drafts])  -> logits [B, K + 1, V], taps
  accept:  verify.verify(...)              -> n_accepted [B], tokens [B, K + 1]
  commit:  lengths += emitted; state slot; tokens buffer; drafter.commit(...)

A tree drafter's proposal (`parents` set) is verified node by node in one
pass over the flattened tree (`verify_tree_block`); the accepted path's K/V
move to consecutive slots (`KVCache.commit_path`).

Rows keep everything they accepted (ragged acceptance, never cut to the
slowest row). Emission stops at an EOS and at the row's token budget. The
rejected positions stay in the KV pages, masked by length and overwritten
later; hybrid models keep the recurrent state after every verified position
and commit the slot of the last kept one (`KVCache.commit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sampling as sampling_lib
from specjax import trees
from specjax.cache.paged import KVCache
from specjax.drafters.base import DraftContext
from specjax.grammar.bitmask import mask_law, mask_logits, tree_laws
from specjax.models.contract import StepInputs, append
from specjax.sampling import SamplingParams
from specjax.verify import verify, verify_tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  cache: KVCache
  last_tokens: jax.Array  # [B] the newest token of each row, not yet in the cache
  active: jax.Array  # [B] bool, still generating
  num_generated: jax.Array  # [B] tokens emitted so far
  max_new: jax.Array  # [B] token budget per row
  seq_ids: jax.Array  # [B] ids that seed each row's random draws
  tokens: jax.Array  # [B, C] every token of each row (prompt + generated), for drafters
  drafter: Any = ()  # the drafter's own state pytree
  row_sampling: Any = None  # the scheduler's slots: each row's `RowSampling` ([B] arrays)
  row_eos: Any = None  # the scheduler's slots: each row's EOS ids [B, E] (-1 pads; none: ignore EOS)


# ---------------------------------------------------------------- prefill and plain decoding


def prefill_chunk(graphdef, params, cache, tokens, query_lens, last_hidden, taps=()):
  """Appends one chunk of each prompt.

  Returns (cache, hidden of each row's last token, hidden [B, T, D], the
  residuals after the layers in `taps`, each [B, T, D]).
  """
  hidden, cache, tapped = append(nnx.merge(graphdef, params), tokens, cache, query_lens, taps=taps)
  idx = jnp.maximum(query_lens - 1, 0)
  chunk_last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
  return cache, jnp.where((query_lens > 0)[:, None], chunk_last, last_hidden), hidden, tapped


def emit(model, hidden, state: DecodeState, eos_ids, sampling: SamplingParams, logprobs: bool = False, bitmask=None):
  """Samples each active row's next token from `hidden` [B, D] and updates `state`.

  `logprobs=True` returns (state, the target's log-probability of each row's token [B]). `bitmask` [B, W]: each
  row's grammar mask (`specjax.grammar`).
  """
  logits = model.logits(hidden).astype(jnp.float32)
  logits = logits if bitmask is None else mask_logits(logits, bitmask)
  keys = sampling_lib.row_keys(sampling.seed, state.seq_ids, state.cache.lengths)
  tokens = sampling_lib.sample(logits, sampling, keys)
  tokens = jnp.where(state.active, tokens, state.last_tokens)
  num_generated = state.num_generated + state.active
  active = state.active & ~is_eos(tokens, eos_ids) & (num_generated < state.max_new)
  buffer = write_tokens(state.tokens, tokens[:, None], state.cache.lengths, state.active.astype(jnp.int32))
  state = dataclasses.replace(state, last_tokens=tokens, active=active, num_generated=num_generated, tokens=buffer)
  return (state, token_logprobs(logits, tokens)) if logprobs else state


def is_eos(
    tokens: jax.Array,  # [B, ...]
    eos_ids: jax.Array,  # [E], or [B, E] per row (-1 pads)
) -> jax.Array:  # [B, ...] bool
  eos = (
      eos_ids.reshape(eos_ids.shape[:1] + (1,) * (tokens.ndim - 1) + eos_ids.shape[1:])
      if eos_ids.ndim == 2
      else eos_ids
  )
  return jnp.any(tokens[..., None] == eos, axis=-1)


def token_logprobs(
    logits: jax.Array,  # [B, ..., V]
    tokens: jax.Array,  # [B, ...]
) -> jax.Array:  # [B, ...] float32
  """log p(token) under the target's raw (temperature 1) distribution."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], axis=-1)[..., 0]


def drafter_prefill(graphdef, params, dparams, dstate, tokens, query_lens, hidden, taps, drafter):
  return drafter.prefill(nnx.merge(graphdef, params), dparams, dstate, tokens, query_lens, hidden, taps)


def start(graphdef, params, state, last_hidden, eos_ids, sampling, bitmask=None):
  return emit(nnx.merge(graphdef, params), last_hidden, state, eos_ids, sampling, bitmask=bitmask)


def drafter_start(graphdef, params, dparams, state, drafter):
  return dataclasses.replace(state, drafter=drafter.start(dparams, state.drafter, draft_context(state)))


def decode_step(graphdef, params, state, eos_ids, sampling, bitmask=None):
  """Feeds each active row's last token, samples the next one."""
  model = nnx.merge(graphdef, params)
  hidden, cache, _ = append(model, state.last_tokens[:, None], state.cache, state.active.astype(jnp.int32))
  state = emit(model, hidden[:, 0], dataclasses.replace(state, cache=cache), eos_ids, sampling, bitmask=bitmask)
  return state, (state.last_tokens, state.active)


# ---------------------------------------------------------------- speculative step


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
  """Drafts K tokens per row; returns (state, proposal) with the drafter's cache writes in state.

  The proposal keeps only what the verify needs (drafts, lengths, q, tree): its cache and drafter state are the
  returned state's, so a split step passes them once, donated, not twice (a copy of every page).
  """
  target = nnx.merge(graphdef, params)
  prop = drafter.propose(target, dparams, state.drafter, state.cache, draft_context(state), k, sampling)
  return dataclasses.replace(state, cache=prop.cache, drafter=prop.state), dataclasses.replace(prop, cache=(), state=())


def verify_phase(
    graphdef, params, dparams, state, prop, eos_ids, *, drafter, k: int, sampling, logprobs=False, grammar=None
):
  """Verifies a proposal in one target pass over K + 1 positions and commits what each row accepted.

  `logprobs=True` appends the target's log-probability of each emitted token, [B, K + 1]. `grammar`
  (`GrammarInputs`): the host's drafts, cuts and masks (a tree's: per node); p and q become p' and q'.
  """
  target = nnx.merge(graphdef, params)
  old_len = state.cache.lengths
  fresh = None
  if grammar is not None:
    q = prop.q
    if q is not None and prop.parents is not None:
      q = tree_laws(q, prop.parents, grammar.bitmask)
    elif q is not None:  # forced drafts were drawn with probability 1; a kept draft's law is q given it is allowed
      q = jnp.where(grammar.forced[:, None, None], jax.nn.one_hot(grammar.drafts, q.shape[-1], dtype=q.dtype), q)
      q = mask_law(q, grammar.bitmask[:, :k])
    prop = dataclasses.replace(prop, drafts=grammar.drafts, draft_lens=grammar.draft_lens, q=q)
    fresh = grammar.fresh
  if prop.parents is None:
    block = jnp.concatenate([state.last_tokens[:, None], prop.drafts], axis=1)  # [B, K + 1]
    hidden, cache, taps = append(target, block, state.cache, jnp.where(state.active, k + 1, 0), taps=drafter.taps)
    logits = target.logits(hidden).astype(jnp.float32)  # [B, K + 1, V]
    logits = logits if grammar is None else mask_logits(logits, grammar.bitmask)
    n_accepted, out = verify(
        logits, prop.drafts, prop.draft_lens, prop.q, sampling, state.seq_ids, old_len + 1, fresh_last=fresh
    )
    lp = token_logprobs(logits, out) if logprobs else None
  else:
    n_accepted, out, path, hidden, cache, taps, lp = verify_tree_block(
        target, state, prop, drafter, k, sampling, grammar
    )
  hidden = hidden if drafter.reads_hidden else None

  steps = jnp.arange(k + 1)
  eos = is_eos(out, eos_ids) & (steps[None, :] <= n_accepted[:, None])
  first_eos = jnp.min(jnp.where(eos, steps[None, :], k + 1), axis=1)
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
  if prop.parents is None:
    cache = cache.commit(new_len, emitted)  # rejected positions: masked by length, state slot of the last kept
  else:
    cache = cache.commit_path(old_len, path, emitted)  # the accepted path, moved to consecutive slots
  new_ctx = DraftContext(tokens, new_len, last_tokens, active, state.seq_ids)
  dstate = drafter.commit(dparams, state.drafter, new_ctx, emitted, taps, hidden)
  state = dataclasses.replace(
      state,
      cache=cache,
      tokens=tokens,
      last_tokens=last_tokens,
      active=active,
      num_generated=num_generated,
      drafter=dstate,
  )
  accepted = jnp.where(emitted > 0, n_accepted, 0)
  outputs = (out, emitted, accepted, prop.draft_lens, active, prop.drafts)
  return state, outputs + (lp,) if logprobs else outputs


def verify_tree_block(target, state: DecodeState, prop, drafter, k: int, sampling, grammar=None):
  """Verifies a draft tree (`prop.parents`) in one target pass over the root and its N nodes (under `grammar`:
  each node's logits masked by its state's mask, refused nodes cut; q is already q').

  Also returns the target's log-probability of each emitted token along the path, [B, K + 1].

  Node i of the block (0 = the root, the last token) sits at position
  `length + depth(i)`, is written to slot `length + i` and attends to the
  cache and its ancestors. Returns (n_accepted [B], tokens [B, K + 1], path
  [B, K + 1], hidden and taps gathered along the accepted path [B, K + 1, D],
  cache).
  """
  b, n = prop.drafts.shape
  block = jnp.concatenate([state.last_tokens[:, None], prop.drafts], axis=1)  # [B, N + 1]
  parents = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), prop.parents.astype(jnp.int32)], axis=1)
  depths = trees.node_depths(parents)
  num_nodes = jnp.where(state.active, prop.draft_lens + 1, 0)
  inputs = StepInputs.tree(state.cache, depths, trees.ancestor_mask(parents), num_nodes)
  hidden, cache, taps = target.forward(block, inputs, state.cache, taps=drafter.taps)
  logits = target.logits(hidden).astype(jnp.float32)  # [B, N + 1, V]
  node_ok = None
  if grammar is not None:
    logits = mask_logits(logits, grammar.bitmask)
    node_ok = jnp.concatenate([jnp.ones((b, 1), bool), grammar.valid], axis=1)
  q = None if prop.q is None else jnp.concatenate([jnp.zeros_like(prop.q[:, :1]), prop.q], axis=1)
  n_accepted, path, out = verify_tree(
      logits,
      block,
      parents,
      num_nodes,
      q,
      sampling,
      state.seq_ids,
      state.cache.lengths + 1,
      max_depth=k,
      node_ok=node_ok,
  )
  along = lambda x: jnp.take_along_axis(x, path[:, :, None], axis=1)  # [B, N + 1, D] -> [B, K + 1, D]
  lp = token_logprobs(along(logits), out)
  return n_accepted, out, path, along(hidden), cache, tuple(along(t) for t in taps), lp


def spec_step(graphdef, params, dparams, state, eos_ids, *, drafter, k: int, sampling):
  """One speculative step.

  Returns (state, (tokens [B, K+1], emitted [B], accepted [B], drafted [B],
  active [B], drafts [B, K])).
  """
  static = dict(drafter=drafter, k=k, sampling=sampling)
  state, prop = propose_phase(graphdef, params, dparams, state, **static)
  return verify_phase(graphdef, params, dparams, state, prop, eos_ids, **static)
