"""The jitted bodies of the continuous-batching scheduler over a fixed set of B slots.

A slot is one row of the `DecodeState`. Requests join a free slot (`admit`:
its per-row state reset, its tokens written), are prefilled a chunk at a
time (`prefill_rows`, on the sub-batch of the joining rows, which also samples
the first token of rows whose prompt is done), then ride the shared steps
(`decode_rows`, `spec_rows`) until they leave; the host points a free slot's
block table at the null page.

Rows work on shared page pools: a `KVCache` (the target's, or one inside the
drafter's state) has per-row fields (block tables, lengths, recurrent state)
and pools every row indexes. `take_rows` / `put_rows` / `keep_rows` move the
per-row fields and every other `[B, ...]` leaf, and pass pools through. A step
leaves the rows that were not active in it as they were (`keep_rows`), so a
slot mid-prefill or free is untouched by the others' drafting and verifying.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.cache.paged import KVCache
from specjax.drafters.base import Drafter
from specjax.models.contract import append
from specjax.step import DecodeState, draft_context, emit, prefill_chunk, propose_phase, verify_phase

_ROW_FIELDS = ('block_tables', 'lengths', 'ssm', 'conv', 'state_slot')


def is_cache(x) -> bool:
  return isinstance(x, KVCache)


def map_caches(fn, tree):
  """fn(cache) on every KVCache of `tree` (the target's and the drafter's); other leaves as they are."""
  return jax.tree.map(lambda x: fn(x) if is_cache(x) else x, tree, is_leaf=is_cache)


def _map_rows(fn, tree, *others):
  """fn(leaf, *other leaves) on every per-row array; a KVCache's pools come from `tree`."""

  def one(x, *ys):
    if isinstance(x, KVCache):
      fields = {f: jax.tree.map(fn, getattr(x, f), *(getattr(y, f) for y in ys)) for f in _ROW_FIELDS}
      return dataclasses.replace(x, **fields)
    return fn(x, *ys)

  return jax.tree.map(one, tree, *others, is_leaf=is_cache)


def take_rows(tree, rows: jax.Array):  # rows [R]; out-of-range rows read the last row (padding)
  return _map_rows(lambda x: x[jnp.minimum(rows, x.shape[0] - 1)], tree)


def put_rows(tree, sub, rows: jax.Array, pools: bool = True):
  """Writes `sub`'s rows at `rows` (out-of-range rows are dropped); pools from `sub` unless `pools=False`."""
  out = _map_rows(lambda x, s: x.at[rows].set(s, mode='drop'), tree, sub)
  if not pools:
    return out
  swap = lambda x, s: dataclasses.replace(x, k_pages=s.k_pages, v_pages=s.v_pages) if isinstance(x, KVCache) else x
  return jax.tree.map(swap, out, sub, is_leaf=is_cache)


def keep_rows(new, old, keep: jax.Array):
  """`new`, with `old`'s values in the rows where keep [B] (pools from `new`)."""
  pick = lambda n, o: jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)), o, n)
  return _map_rows(pick, new, old)


def copy_pages(state: DecodeState, copies: jax.Array) -> DecodeState:  # copies [R, 2] (source, destination)
  """Copies pages in every pool of the state (the target's and the drafter's): copy-on-write of a cached page
  a joining row shares only the start of. (0, 0) pads (the null page onto itself)."""
  src, dst = copies[:, 0], copies[:, 1]
  copy = lambda pool: pool.at[:, dst].set(pool[:, src])
  return map_caches(
      lambda x: dataclasses.replace(x, k_pages=tuple(map(copy, x.k_pages)), v_pages=tuple(map(copy, x.v_pages))), state
  )


def snapshot_pool(cache: KVCache, size: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """`size` empty recurrent-state snapshots: per recurrent layer (ssm [M, N, Dk, Dv], conv [M, W - 1, C])."""
  return tuple(jnp.zeros((size, *x.shape[2:]), x.dtype) for x in cache.ssm), tuple(
      jnp.zeros((size, *x.shape[2:]), x.dtype) for x in cache.conv
  )


def take_snapshots(graphdef, params, pool, state: DecodeState, rows, dst):
  """The pool with the current recurrent state of slots `rows` [R] written at `dst` [R] (-1 or out of range:
  padding, dropped)."""
  del graphdef, params
  cache = state.cache
  r = jnp.minimum(rows, cache.state_slot.shape[0] - 1)
  slot = cache.state_slot[r]
  dst = jnp.where(dst < 0, pool[0][0].shape[0], dst)
  put = lambda p, x: p.at[dst].set(x[r, slot], mode='drop')
  return tuple(map(put, pool[0], cache.ssm)), tuple(map(put, pool[1], cache.conv))


def restore_snapshots(cache: KVCache, pool, snaps: jax.Array) -> KVCache:  # snaps [R], -1: a fresh state
  """Rows of `cache` whose recurrent state starts from pool slot `snaps` (in state slot 0)."""
  has, idx = snaps >= 0, jnp.maximum(snaps, 0)
  pick = lambda x, p: x.at[:, 0].set(jnp.where(has.reshape((-1,) + (1,) * (p.ndim - 1)), p[idx], x[:, 0]))
  ssm = tuple(map(pick, cache.ssm, pool[0]))
  conv = tuple(map(pick, cache.conv, pool[1]))
  return dataclasses.replace(cache, ssm=ssm, conv=conv, state_slot=jnp.zeros_like(cache.state_slot))


def set_tables(state: DecodeState, tables: jax.Array) -> DecodeState:  # tables [B, pages_per_seq]
  """Points every KVCache of the state (the target's and the drafter's) at the host's block tables."""
  return map_caches(lambda x: dataclasses.replace(x, block_tables=tables), state)


# ---------------------------------------------------------------- jitted bodies (graphdef, params first)


def admit(
    graphdef,
    params,
    state: DecodeState,
    fresh: DecodeState,
    rows,
    tokens,
    max_new,
    num_generated,
    seq_ids,
    sampling,
    eos,
    copies,
    restore,
    lengths,
):
  """Resets slots `rows` [R] for new requests: `fresh`'s per-row values (empty caches, the drafter's initial
  state), tokens [R, C], budgets, seq ids, each row's sampling settings and EOS ids [R, E]; inactive until
  its prefill ends. copies [R, 2]: pages copied on write first (`copy_pages`); restore: () or (snapshot pool,
  slots [R]) of hybrid rows starting from a snapshot; lengths [R]: positions every cache of the row already
  holds (a cached prefix's pages)."""
  del graphdef, params
  state = copy_pages(state, copies)
  sub = take_rows(fresh, jnp.zeros_like(rows))  # every row of `fresh` is the same empty row
  if restore:
    sub = dataclasses.replace(sub, cache=restore_snapshots(sub.cache, *restore))
  sub = map_caches(lambda x: dataclasses.replace(x, lengths=lengths.astype(jnp.int32)), sub)
  sub = dataclasses.replace(
      sub,
      tokens=tokens,
      max_new=max_new,
      num_generated=num_generated,
      seq_ids=seq_ids,
      active=jnp.zeros_like(rows, bool),
      row_sampling=sampling,
      row_eos=eos,
  )
  return put_rows(state, sub, rows, pools=False)


def prefill_rows(
    graphdef,
    params,
    dparams,
    state: DecodeState,
    rows,
    tokens,
    query_lens,
    finish,
    bitmask=None,
    *,
    drafter,
    greedy: bool,
    hidden_size: int,
):
  """One prompt chunk for slots `rows` [R]: tokens [R, T], query_lens [R] (0: padding). Rows whose prompt ends
  here (`finish` [R]) sample their first token (under `bitmask` [R, W], a constrained request's grammar mask)
  and become active.

  Returns (state, (first tokens [R], active [R], log-probabilities [R])).
  """
  model = nnx.merge(graphdef, params)
  sub = take_rows(state, rows)
  taps = drafter.taps if drafter else ()
  last_hidden = jnp.zeros((rows.shape[0], hidden_size), state.cache.k_pages[0].dtype)
  cache, last_hidden, hidden, tapped = prefill_chunk(graphdef, params, sub.cache, tokens, query_lens, last_hidden, taps)
  dstate = sub.drafter
  if drafter:
    dstate = drafter.prefill(model, dparams, dstate, tokens, query_lens, hidden, tapped)
  sub = dataclasses.replace(sub, cache=cache, drafter=dstate)
  sampling = dataclasses.replace(sub.row_sampling, is_greedy=greedy)
  started, logprobs = emit(
      model, last_hidden, dataclasses.replace(sub, active=finish), sub.row_eos, sampling, True, bitmask
  )
  if drafter:
    started = dataclasses.replace(started, drafter=drafter.start(dparams, started.drafter, draft_context(started)))
  sub = keep_rows(started, sub, ~finish)
  return put_rows(state, sub, rows), (started.last_tokens, started.active & finish, logprobs)


def live_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
  """The sub-batch of slots `rows` [R] a step runs on; out-of-range rows are inactive padding."""
  sub = take_rows(state, rows)
  return dataclasses.replace(sub, active=sub.active & (rows < state.active.shape[0]))


def decode_rows(graphdef, params, state: DecodeState, rows, bitmask=None, dparams=(), *, greedy: bool, drafter=None):
  """One token for each active slot of `rows` [R] (the live slots, padded to a bucket), under `bitmask` [R, W]
  (grammar masks, all ones for unconstrained rows) when given. `drafter` (one that drafts ahead, with `dparams`)
  looks up the next step's drafts after the token, as a draft-verify step would: a policy that turned
  speculation off sees the drafts the context has and can turn it back on.

  Returns (state, (tokens [R], active [R], log-probabilities [R])).
  """
  model = nnx.merge(graphdef, params)
  sub = live_rows(state, rows)
  hidden, cache, _ = append(model, sub.last_tokens[:, None], sub.cache, sub.active.astype(jnp.int32))
  sampling = dataclasses.replace(sub.row_sampling, is_greedy=greedy)
  new, logprobs = emit(model, hidden[:, 0], dataclasses.replace(sub, cache=cache), sub.row_eos, sampling, True, bitmask)
  if drafter is not None:
    new = dataclasses.replace(new, drafter=drafter.start(dparams, new.drafter, draft_context(new)))
  new = keep_rows(new, sub, ~sub.active)
  return put_rows(state, new, rows), (new.last_tokens, new.active, logprobs)


def spec_rows(graphdef, params, dparams, state: DecodeState, rows, depths, *, drafter: Drafter, k: int, greedy: bool):
  """One draft-verify step at width K for each active slot of `rows` [R], each drafting at most depths [R] (0:
  none; a tree row drafts its whole tree or nothing).

  Returns (state, (tokens [R, K+1], emitted, accepted, drafted, active, drafts [R, K], log-probabilities
  [R, K+1])).
  """
  sub = live_rows(state, rows)
  sampling = dataclasses.replace(sub.row_sampling, is_greedy=greedy)
  static = dict(drafter=drafter, k=k, sampling=sampling)
  new, prop = _propose(graphdef, params, dparams, sub, depths, **static)
  new, out = verify_phase(graphdef, params, dparams, new, prop, sub.row_eos, logprobs=True, **static)
  return put_rows(state, keep_rows(new, sub, ~sub.active), rows), out


def _propose(graphdef, params, dparams, sub: DecodeState, depths, *, drafter: Drafter, k: int, sampling):
  """Drafts for a step's rows, each cut to its depth [R] (0: none; a tree row drafts its whole tree or nothing)."""
  new, prop = propose_phase(graphdef, params, dparams, sub, drafter=drafter, k=k, sampling=sampling)
  lens = jnp.where(depths > 0, prop.draft_lens, 0) if drafter.tree_tokens else jnp.minimum(prop.draft_lens, depths)
  return new, dataclasses.replace(prop, draft_lens=lens.astype(prop.draft_lens.dtype))


def propose_rows(
    graphdef, params, dparams, state: DecodeState, rows, depths, *, drafter: Drafter, k: int, greedy: bool
):
  """The draft half of `spec_rows`, for constrained rounds (the host cuts and masks the drafts between it and
  `verify_rows`) and profiled ones. Returns (state, proposal)."""
  sub = live_rows(state, rows)
  sampling = dataclasses.replace(sub.row_sampling, is_greedy=greedy)
  new, prop = _propose(graphdef, params, dparams, sub, depths, drafter=drafter, k=k, sampling=sampling)
  return put_rows(state, keep_rows(new, sub, ~sub.active), rows), prop


def verify_rows(graphdef, params, dparams, state: DecodeState, rows, prop, grammar, *, drafter, k: int, greedy: bool):
  """The verify half: `prop` checked (under the rows' `GrammarInputs`, when given); returns what `spec_rows`
  does."""
  sub = live_rows(state, rows)
  sampling = dataclasses.replace(sub.row_sampling, is_greedy=greedy)
  new, out = verify_phase(
      graphdef,
      params,
      dparams,
      sub,
      prop,
      sub.row_eos,
      logprobs=True,
      drafter=drafter,
      k=k,
      sampling=sampling,
      grammar=grammar,
  )
  return put_rows(state, keep_rows(new, sub, ~sub.active), rows), out


def deactivate(graphdef, params, state: DecodeState, rows) -> DecodeState:
  """Slots `rows` [R] stop (a cancel, a stop string, a preemption); out-of-range rows are padding."""
  del graphdef, params
  return dataclasses.replace(state, active=state.active.at[rows].set(False, mode='drop'))


def point_tables(graphdef, params, state: DecodeState, tables) -> DecodeState:
  del graphdef, params
  return set_tables(state, tables)
