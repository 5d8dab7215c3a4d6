"""DFlash: one non-causal block forward drafts a whole chain, conditioned on target features as K/V.

State: the draft's paged context cache (its own page pool on the target's
block tables), holding the context keys and values of every committed
position: `prefill` appends each prompt chunk's, `commit` the emitted
positions' (the verify pass's taps), so its length is always the target
cache's, L, the position of each row's last token.

`propose` runs the block `[last token, MASK x (B - 1)]` at positions
L .. L + B - 1 (all `block_size` rows, as trained; they see the context and
each other), its keys and values in scratch slots past L that never persist;
the target head on rows 1..K gives K greedy drafts. DFlash 1 has no draft
distribution: sampled steps verify by sample-and-match (exact without q).

DFlash 2's candidate selector walks a path over each slot's top-k of the
unary logits. `greedy`: the argmax walk (upstream's greedy path), verified
like DFlash 1's drafts. `probabilistic` (sampled steps): slot k's token is
drawn, with the step's sampling transform (`sampling.probs` / `sample`, key
`row_keys(..., position, STREAM_SAMPLE)` as other drafters), from its
candidates' scores after the token slot k - 1 drew; q_k is that conditional
law placed in a full-vocab row (zero off the candidates), so rejection
sampling stays exact: the chain's tokens are drawn from exactly the q they
are checked against.

The block is embedded with the target's `embed` (z-lab / SpecForge call
`target.model.embed_tokens`, which carries Gemma's sqrt(D) scale; Qwen and
Llama have none) and scored by its `logits`. The block never touches the
target's cache or recurrent state, so hybrids roll back as with any chain.
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
from specjax.drafters.registry import DrafterFamily, checkpoint_option, local_config, option, quant_option, quantize_head
from specjax.errors import SpecjaxError
from specjax.models.contract import StepInputs
from specjax.models.dflash import block_mask, greedy_choice, place
from specjax.sampling import STREAM_SAMPLE

AUTO_DEPTH_CAP = 7  # mistral.rs: min(block_size - 1, 7) when no depth is given
SAMPLING_MODES = ('auto', 'greedy', 'probabilistic')


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DFlashState:
  cache: KVCache  # the context keys / values; lengths = committed positions (= the target's)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashDrafter(Drafter):
  graphdef: nnx.GraphDef = None  # the DFlashDraft module
  draft_params: Any = None
  taps: tuple[int, ...] = ()
  block_size: int = 16
  mask_token_id: int = 0
  max_depth: int = 15  # block_size - 1
  default_depth: int | None = None  # min(block_size - 1, 7) from `_build`
  probabilistic: bool = False  # sampled selector paths with q (DFlash 2); else greedy drafts
  provides_q: bool = False  # = probabilistic
  name: str = 'dflash'

  def params(self):
    return self.draft_params

  def _draft(self, params):
    return nnx.merge(self.graphdef, params)

  def lookahead(self, k: int) -> int:
    return max(self.verify_width(k), self.block_size)  # the block's scratch slots in the draft's pages

  def init_state(self, plan: BatchPlan) -> DFlashState:
    dtype = jax.tree.leaves(self.draft_params)[0].dtype
    cache = KVCache.create(
        list(self._draft(self.draft_params).cache_layout().kv_shapes),
        num_pages=plan.num_pages,
        page_size=plan.page_size,
        block_tables=plan.block_tables,
        dtype=dtype,
    )
    return DFlashState(cache)

  def _append(self, params, state: DFlashState, taps, count) -> DFlashState:
    """Appends the context of the first `count` [B] positions of `taps` (each [B, T, D])."""
    draft = self._draft(params)
    ctx = draft.context(jnp.concatenate(taps, axis=-1).astype(state.cache.k_pages[0].dtype))
    inputs = StepInputs.chain(state.cache, count.astype(jnp.int32), ctx.shape[1])
    return DFlashState(draft.append_context(ctx, inputs, state.cache))

  def prefill(self, target, params, state: DFlashState, tokens, query_lens, hidden, taps=()) -> DFlashState:
    return self._append(params, state, taps, query_lens)

  def propose(self, target, params, state: DFlashState, cache, ctx: DraftContext, k: int, sampling) -> Proposal:
    b, n = ctx.last_tokens.shape[0], self.block_size
    if k > n - 1:
      raise ValueError(f'a DFlash block of {n} drafts at most {n - 1} tokens, asked for {k}')
    tokens = jnp.concatenate([ctx.last_tokens[:, None], jnp.full((b, n - 1), self.mask_token_id, jnp.int32)], axis=1)
    draft = self._draft(params)
    embeds = target.embed(tokens).astype(state.cache.k_pages[0].dtype)  # [B, N, D]
    inputs = StepInputs.chain(state.cache, jnp.where(ctx.active, n, 0), n)
    inputs = dataclasses.replace(inputs, mask=block_mask(b, n))
    out, dcache = draft.block(embeds, inputs, state.cache)  # lengths stay at the context's
    rows = out[:, 1 : k + 1]  # [B, S = K, D]
    logits = target.logits(rows).astype(jnp.float32)  # [B, S, V]
    q = None
    if not draft.cfg.selector_rank:
      drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      values, ids = draft.selector.candidates(draft.unary(logits))  # [B, S, K]
      if self.probabilistic and not sampling.is_greedy:
        drafts, q = self._sampled_path(draft, rows, values, ids, logits.shape[-1], ctx, sampling)
      else:
        drafts, _ = draft.selector.walk(rows, values, ids, ctx.last_tokens, greedy_choice)
    lens = jnp.where(ctx.active, k, 0).astype(jnp.int32)
    return Proposal(drafts, lens, q, DFlashState(dcache), cache)

  def advance(self, target, params, state, cache, ctx: DraftContext, sampling):
    return state, cache  # its context moves at commit; drafting only writes scratch slots

  def _sampled_path(self, draft, rows, values, ids, vocab: int, ctx: DraftContext, sampling):
    """Slot by slot, a token drawn from its candidates after the previous draw: (drafts [B, S], q [B, S, V])."""

    def draw(slot, scores, slot_ids):  # scores [B, K] after the previous slot's token
      keys = sampling_lib.row_keys(sampling.seed, ctx.seq_ids, ctx.lengths + 1 + slot, STREAM_SAMPLE)
      return sampling_lib.sample(place(scores, slot_ids, vocab), sampling, keys)

    drafts, scores = draft.selector.walk(rows, values, ids, ctx.last_tokens, draw)
    return drafts, sampling_lib.probs(place(scores, ids, vocab), sampling)

  def commit(self, params, state: DFlashState, ctx: DraftContext, n_emitted, taps, hidden=None) -> DFlashState:
    # taps: the verify block's [B, K + 1, D] at positions L .. L + K; the first n_emitted are committed.
    return self._append(params, state, taps, n_emitted)


# ---------------------------------------------------------------- the family


def block_size_of(ckpt: Any) -> int | None:
  """The checkpoint's block size, cheaply (a loaded checkpoint, or a local config.json); None if unknown."""
  from specjax.loading.dflash import DFlashCheckpoint

  if isinstance(ckpt, DFlashCheckpoint):
    return ckpt.config.block_size
  hf = local_config(ckpt) or {}
  size = (hf.get('dflash_config') or {}).get('block_size', hf.get('block_size'))
  return size if isinstance(size, int) and size >= 2 else None


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashOptions:
  draft_model: Any = checkpoint_option()
  draft_quant: str | None = quant_option()
  draft_sampling: str = option(
      'auto',
      '--draft-sampling',
      '--mtp-draft-sampling',
      type=str,
      help='dflash: auto (probabilistic with a DFlash 2 selector, else greedy), greedy (drafts verified by '
      'sample-and-match when sampling) or probabilistic (needs a selector); --mtp-draft-sampling is the '
      'mistral.rs spelling',
  )

  def validate(self) -> None:
    if self.draft_model is None:
      raise SpecjaxError('--drafter dflash needs --draft-model PATH (a DFlash checkpoint)')
    if self.draft_sampling not in SAMPLING_MODES:
      raise SpecjaxError(f'--draft-sampling must be one of {", ".join(SAMPLING_MODES)}, got {self.draft_sampling!r}')


def _max_depth(options: DFlashOptions) -> int:
  size = block_size_of(options.draft_model)
  return 16 if size is None else size - 1


def _build(target, options: DFlashOptions) -> DFlashDrafter:
  from specjax.loading.dflash import DFlashCheckpoint, load_dflash

  ckpt = options.draft_model
  if not isinstance(ckpt, DFlashCheckpoint):
    ckpt = load_dflash(str(ckpt), target, dtype=target.dtype)
  cfg = ckpt.config
  if options.draft_sampling == 'probabilistic' and not cfg.selector_rank:  # only it gives a draft distribution
    raise SpecjaxError(
        f'{ckpt.source}: --draft-sampling probabilistic needs a DFlash 2 candidate selector; a DFlash 1 '
        'checkpoint drafts greedily (use auto or greedy)'
    )
  probabilistic = options.draft_sampling != 'greedy' and bool(cfg.selector_rank)
  return DFlashDrafter(
      graphdef=ckpt.graphdef,
      draft_params=quantize_head(target, ckpt.params, options),
      taps=cfg.taps,
      block_size=cfg.block_size,
      mask_token_id=cfg.mask_token_id,
      max_depth=cfg.block_size - 1,
      default_depth=min(cfg.block_size - 1, AUTO_DEPTH_CAP),  # what Engine and `specjax run` draft by default
      probabilistic=probabilistic,
      provides_q=probabilistic,
  )


FAMILY = DrafterFamily(
    name='dflash',
    options=DFlashOptions,
    build=_build,
    depths=(3, 5, 7),
    default_depth=AUTO_DEPTH_CAP,
    max_depth=_max_depth,
    help='a DFlash or DFlash 2 block-diffusion draft (z-lab / SpecForge checkpoint): one block forward drafts up '
    'to block_size - 1 tokens from target features; default depth min(block_size - 1, 7)',
)
