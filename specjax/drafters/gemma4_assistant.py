"""The Gemma 4 assistant: Q-only layers over the target's own K/V, drafting from one held position.

The assistant (`google/gemma-4-*-assistant`, transformers'
`SinglePositionMultiTokenCandidateGenerator`) keeps no cache. Each draft step
reads the target's donor K/V (the last unshared layer of each layer type) in
place, from the target's page pool: `cache.k_pages[kv_donors()[type]]`, no
copy. Its queries sit at the pending token's position L for all K steps,
attending to the committed keys 0 .. L - 1.

Step i embeds the last token (the pending one, then the draft just made) with
the target's scaled embedding, pairs it with a target-width hidden state (the
target's final-normed hidden at L - 1, then the assistant's own projected
output) and scores the next token: with the centroid head, only the tokens of
the top centroids are candidates; the others get -inf, so q is exactly zero
there and rejection sampling stays exact.

State between steps: that hidden state at L - 1, taken from the prompt's last
position (`prefill`) or the last emitted position of the verify block
(`commit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax import sampling as sampling_lib
from specjax.drafters.base import BatchPlan, DraftContext, Drafter, Proposal
from specjax.drafters.registry import DrafterFamily, checkpoint_option, quant_option, quantize_head
from specjax.errors import SpecjaxError
from specjax.models.contract import PagedKV
from specjax.sampling import STREAM_SAMPLE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AssistantState:
  hidden: jax.Array  # [B, D] the target's final-normed hidden state at L - 1


def _at(x: jax.Array, idx: jax.Array) -> jax.Array:  # x [B, T, D], idx [B] -> [B, D]
  return jnp.take_along_axis(x, jnp.clip(idx, 0, x.shape[1] - 1)[:, None, None], axis=1)[:, 0]


@dataclasses.dataclass(frozen=True, eq=False)
class Gemma4AssistantDrafter(Drafter):
  graphdef: nnx.GraphDef = None  # the Gemma4Assistant module
  assistant_params: Any = None
  donors: tuple[tuple[str, int], ...] = ()  # layer type -> index of its donor in the target cache's pages
  hidden_size: int = 0  # the target's
  default_depth: int | None = None  # the checkpoint's num_assistant_tokens
  name: str = 'gemma4-assistant'
  reads_hidden: bool = True
  provides_q: bool = True

  def params(self):
    return self.assistant_params

  def init_state(self, plan: BatchPlan) -> AssistantState:
    dtype = jax.tree.leaves(self.assistant_params)[0].dtype
    return AssistantState(jnp.zeros((plan.batch, self.hidden_size), dtype))

  def prefill(self, target, params, state: AssistantState, tokens, query_lens, hidden, taps=()) -> AssistantState:
    last = _at(hidden, query_lens - 1).astype(state.hidden.dtype)
    return AssistantState(jnp.where((query_lens > 0)[:, None], last, state.hidden))

  def propose(self, target, params, state: AssistantState, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    assistant = nnx.merge(self.graphdef, params)
    donors = {
        kind: PagedKV(cache.k_pages[j], cache.v_pages[j], cache.block_tables, cache.lengths) for kind, j in self.donors
    }
    positions = ctx.lengths[:, None]  # [B, 1]: the pending token's, held for every step

    def step(carry, i):  # one assistant step from (token [B], h [B, D]); one scan body, whatever K
      token, h = carry
      embeds = target.embed(token[:, None]).astype(h.dtype)  # [B, 1, D]
      out, h_next = assistant.forward(embeds, h[:, None], positions, donors)
      logits = assistant.logits(out[:, 0]).astype(jnp.float32)  # [B, V], -inf off the candidates
      keys = sampling_lib.row_keys(sampling.seed, ctx.seq_ids, ctx.lengths + 1 + i, STREAM_SAMPLE)
      token = sampling_lib.sample(logits, sampling, keys)
      return (token, h_next[:, 0]), (token, None if sampling.is_greedy else sampling_lib.probs(logits, sampling))

    _, (drafts, qs) = jax.lax.scan(step, (ctx.last_tokens, state.hidden), jnp.arange(k))  # [K, B], [K, B, V]
    q = None if qs is None else jnp.moveaxis(qs, 0, 1)
    return Proposal(drafts.T, jnp.where(ctx.active, k, 0), q, state, cache)

  def advance(self, target, params, state, cache, ctx: DraftContext, sampling):
    return state, cache  # propose leaves the state as it is; it moves at commit

  def commit(self, params, state: AssistantState, ctx, n_emitted, taps, hidden=None) -> AssistantState:
    # hidden [B, K + 1, D]: the verify block; its position n_emitted - 1 is the new L - 1.
    last = _at(hidden, n_emitted - 1).astype(state.hidden.dtype)
    return AssistantState(jnp.where((n_emitted > 0)[:, None], last, state.hidden))


@dataclasses.dataclass(frozen=True, eq=False)
class Gemma4AssistantOptions:
  draft_model: Any = checkpoint_option()
  draft_quant: str | None = quant_option()

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter gemma4-assistant needs --draft-model PATH (a Gemma 4 assistant checkpoint)')


def _check(target, options: Gemma4AssistantOptions) -> None:
  if not target.module().kv_donors():
    raise SpecjaxError(
        f"{target.source}: the Gemma 4 assistant drafts over a Gemma 4 target's K/V "
        f'(gemma4 / gemma4_text), not {target.architecture}'
    )


def _build(target, options: Gemma4AssistantOptions) -> Gemma4AssistantDrafter:
  from specjax.loading import gemma4_assistant as loader

  ckpt = options.draft_model
  donors = target.module().kv_donors()
  check = lambda cfg, where: loader.check_against_target(
      cfg,
      hidden_size=target.config.hidden_size,
      vocab_size=target.config.vocab_size,
      kv_shapes={kind: tuple(target.kv_shapes[j]) for kind, j in donors.items()},
      where=where,
  )
  if not isinstance(ckpt, loader.Gemma4AssistantCheckpoint):
    path, cfg = loader.read_config(str(ckpt))
    check(cfg, path)  # before any weight is read
    ckpt = loader.load_gemma4_assistant(path, dtype=str(jnp.dtype(target.dtype)))
  check(ckpt.config, ckpt.source)
  return Gemma4AssistantDrafter(
      graphdef=ckpt.graphdef,
      assistant_params=quantize_head(target, ckpt.params, options),
      donors=tuple(sorted(donors.items())),
      hidden_size=target.config.hidden_size,
      default_depth=ckpt.config.num_assistant_tokens,
  )


FAMILY = DrafterFamily(
    name='gemma4-assistant',
    options=Gemma4AssistantOptions,
    build=_build,
    check=_check,
    depths=(1, 2, 3, 4, 6),
    default_depth=4,
    help="a Gemma 4 assistant checkpoint (gemma4_assistant): Q-only layers over the Gemma 4 target's donor K/V, "
    "drafting from the last committed position; the checkpoint's num_assistant_tokens sets the default depth",
)
