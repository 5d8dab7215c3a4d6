"""Built-in multi-token prediction (Qwen3.5 / Qwen3-Next `mtp.*`): drafts from the target's own head.

The MTP head pairs the target's final hidden state h_t with the embedding of
the next token x_{t+1} and predicts x_{t+2}. Its one attention layer has its
own paged KV cache (the target's block tables, its own page pool) holding the
pair at position t for every committed t; it shares the target's embeddings
and LM head. Its weights are its own pytree (`model.heads['mtp']`, loaded with
`specjax.load(..., mtp=True)`), apart from the target's params.

State between steps: the MTP cache (pairs up to its length m) and the target
hidden states not yet paired (`pending`, positions m .. m + n - 1; their next
tokens are already in the token buffer). `propose` feeds the pending pairs as
one ragged block, drafts x_{L+1} from the last one, then drafts deeper by
feeding its own output as the next h with the token it just drafted (the
layer's KV at draft positions is overwritten by the true pairs next step).
`commit` keeps the verify pass's hidden states of the emitted positions as the
new pending pairs. Prefill pairs each prompt chunk with the next token, one
hidden carried across chunks.
"""

from __future__ import annotations

import dataclasses

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sampling as sampling_lib
from specjax.cache.paged import KVCache
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.drafters.registry import DrafterFamily, option
from specjax.errors import SpecjaxError
from specjax.models.contract import StepInputs
from specjax.sampling import STREAM_SAMPLE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPState:
  cache: KVCache  # the MTP layer's cache; lengths = pairs committed (m)
  pending: jax.Array  # [B, S, D] target hidden states of positions m .. m + n - 1
  num_pending: jax.Array  # [B] n


def check_mtp_target(target) -> None:
  """The target must have been loaded with its MTP head (`specjax.load(..., mtp=True)` / `--mtp`)."""
  if 'mtp' not in target.heads:
    raise SpecjaxError(
        f'{target.source}: the MTP drafter needs the model loaded with its MTP head '
        '(specjax.load(path, mtp=True), or --mtp on the command line)'
    )


@dataclasses.dataclass(frozen=True, eq=False)
class MTPDrafter(Drafter):
  graphdef: nnx.GraphDef = None  # the MTPHead module
  head_params: Any = None  # its weights
  hidden_size: int = 1
  name: str = 'mtp'
  provides_q: bool = True
  reads_hidden: bool = True

  def params(self):
    return self.head_params

  def _head(self, params):
    return nnx.merge(self.graphdef, params)

  def init_state(self, plan: BatchPlan) -> MTPState:
    layout = self._head(self.head_params).cache_layout()
    dtype = jax.tree.leaves(self.head_params)[0].dtype
    cache = KVCache.create(
        list(layout.kv_shapes),
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        block_tables=plan.block_tables,
        dtype=dtype,
    )
    pending = jnp.zeros((plan.batch, plan.max_draft + 1, self.hidden_size), dtype)
    return MTPState(cache, pending, jnp.zeros((plan.batch,), jnp.int32))

  def _run(self, params, target, tokens, hidden, cache, query_lens):
    """The head over pairs (next tokens [B, T], hidden [B, T, D]) appended to its cache."""
    inputs = StepInputs.chain(cache, query_lens, tokens.shape[1])
    return self._head(params)(target.embed(tokens), hidden, cache, inputs)

  def prefill(self, target, params, state: MTPState, tokens, query_lens, hidden, taps=()) -> MTPState:
    # tokens [B, T], hidden [B, T, D]. Pair j of this chunk: (combined[j + 1 - n], tokens[j + 1 - n]),
    # combined = [carried hidden, chunk hiddens]; q - 1 + n pairs; the chunk's last hidden is carried.
    t = tokens.shape[1]
    carried = state.num_pending
    combined = jnp.concatenate([state.pending[:, :1], hidden.astype(state.pending.dtype)], axis=1)
    idx = jnp.arange(t)[None, :] + 1 - carried[:, None]  # [B, T]
    pair_hidden = jnp.take_along_axis(combined, idx[..., None], axis=1)
    pair_tokens = jnp.take_along_axis(tokens, jnp.minimum(idx, t - 1), axis=1)
    count = jnp.where(query_lens > 0, query_lens - 1 + carried, 0).astype(jnp.int32)
    _, cache = self._run(params, target, pair_tokens, pair_hidden, state.cache, count)
    last = jnp.take_along_axis(hidden, jnp.maximum(query_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    has_new = query_lens > 0
    pending = state.pending.at[:, 0].set(jnp.where(has_new[:, None], last, state.pending[:, 0]))
    return MTPState(cache, pending, jnp.where(has_new, 1, carried).astype(jnp.int32))

  def propose(self, target, params, state: MTPState, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    s = state.pending.shape[1]
    m = state.cache.lengths
    count = jnp.where(ctx.active, state.num_pending, 0).astype(jnp.int32)
    idx = jnp.clip(m[:, None] + 1 + jnp.arange(s)[None, :], 0, ctx.tokens.shape[1] - 1)
    next_tokens = jnp.take_along_axis(ctx.tokens, idx, axis=1)  # [B, S] x_{t+1} of each pending pair
    out, mtp_cache = self._run(params, target, next_tokens, state.pending, state.cache, count)
    committed = mtp_cache.lengths
    h = jnp.take_along_axis(out, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
    step_lens = ctx.active.astype(jnp.int32)
    need_q = not sampling.is_greedy
    drafts, qs = [], []
    for i in range(k):
      logits = target.logits(h).astype(jnp.float32)
      keys = sampling_lib.row_keys(sampling.seed, ctx.seq_ids, ctx.lengths + 1 + i, STREAM_SAMPLE)
      x = sampling_lib.sample(logits, sampling, keys)
      drafts.append(x)
      if need_q:
        qs.append(sampling_lib.probs(logits, sampling))
      if i < k - 1:
        out, mtp_cache = self._run(params, target, x[:, None], h[:, None], mtp_cache, step_lens)
        h = out[:, 0]
    mtp_cache = dataclasses.replace(mtp_cache, lengths=committed)  # draft pairs are not committed
    state = MTPState(mtp_cache, state.pending, jnp.where(ctx.active, 0, state.num_pending).astype(jnp.int32))
    q = jnp.stack(qs, axis=1) if need_q else None
    return Proposal(jnp.stack(drafts, axis=1), jnp.where(ctx.active, k, 0), q, state, cache)

  def commit(self, params, state: MTPState, ctx: DraftContext, n_emitted, taps, hidden=None) -> MTPState:
    # hidden [B, K + 1, D]: the verify block's; its first n_emitted positions are now committed.
    pad = state.pending.shape[1] - hidden.shape[1]
    pending = jnp.pad(hidden.astype(state.pending.dtype), ((0, 0), (0, pad), (0, 0)))
    return MTPState(state.cache, pending, jnp.where(n_emitted > 0, n_emitted, state.num_pending).astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class MTPOptions:
  """The head: the checkpoint's built-in one, or a trained one (`specjax train`'s export); depth is the step's K."""

  draft_model: Any = option(
      None,
      '--draft-model',
      '--mtp-model',
      type=str,
      help='mtp: a trained MTP head (the export/ directory of `specjax train`; default: the built-in head)',
  )


def _build(target, options: MTPOptions) -> MTPDrafter:
  if options.draft_model is not None:
    from specjax.loading.mtp_head import load_mtp_head

    graphdef, params = load_mtp_head(options.draft_model, target)
  else:
    graphdef, params = target.heads['mtp']
  return MTPDrafter(graphdef=graphdef, head_params=params, hidden_size=target.config.hidden_size)


def _check(target, options: MTPOptions) -> None:
  if options.draft_model is None:
    check_mtp_target(target)


FAMILY = DrafterFamily(
    name='mtp',
    options=MTPOptions,
    build=_build,
    check=_check,
    depths=(2, 3, 4, 6),
    default_depth=3,
    target_heads=lambda o: () if o.draft_model is not None else ('mtp',),
    help="an MTP head: the checkpoint's built-in one (Qwen3.5 / Qwen3-Next mtp.*) or --draft-model DIR (trained)",
)
