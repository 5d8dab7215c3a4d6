"""The engine: one model (and drafter) with its executable cache, input checks and batch planning.

`Engine.generate` runs an offline batch on the continuous-batching scheduler
(`specjax.engine.scheduler`) in the calling thread: the same slots, steps and
executables `serve` uses, with every prompt prefilled before the first step.
`prefill` and `step_fn` are the batch primitives underneath the steps (a
batch's cache and its first tokens; one compiled step at depth K) that
calibration and the step-level tests drive directly. Executables are compiled
once per shape bucket and cached on the engine (`engine.executables`), so
steady state never recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache.paged import KVCache
from specjax.drafters.base import BatchPlan, Drafter
from specjax.engine.executables import Executables
from specjax.engine.planner import BatchLayout, plan_batch
from specjax.engine.requests import Request, RequestHandle
from specjax.errors import SpecjaxError
from specjax.grammar import compile_constraint
from specjax.metrics import SpecMetrics
from specjax.models.base import Model
from specjax.policies import Policy
from specjax.sampling import SamplingParams
from specjax import xla_flags
from specjax.step import (
    DecodeState,
    decode_step,
    drafter_prefill,
    drafter_start,
    prefill_chunk,
    propose_phase,
    spec_step,
    start,
    verify_phase,
)


@dataclasses.dataclass
class GenerationResult:
  text: str
  tokens: list[int]  # generated ids (an EOS that stopped the row included)
  prompt_tokens: int
  finish_reason: str  # "eos" | "length"
  spec: SpecMetrics | None = None  # speculative decoding only
  trace: list[dict] | None = None  # generate(..., trace=True): one entry per speculative step


@dataclasses.dataclass
class GenerationStats:
  prefill_s: float = 0.0
  decode_s: float = 0.0
  compile_s: float = 0.0
  decode_steps: int = 0
  generated_tokens: int = 0
  rows: int = 0
  steps: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)  # (K, seconds, live rows)
  grammar_s: float = 0.0  # host time in the grammar matchers (constrained requests), part of prefill + decode
  prompt_tokens: int = 0
  cached_tokens: int = 0  # of the prompt tokens, found in the prefix cache (not prefilled)
  policy_state: Any = None  # the depth policy's state after the last step

  @property
  def tokens_per_s(self) -> float:
    """End to end: generated tokens over prefill + decode time."""
    total = self.prefill_s + self.decode_s
    return self.generated_tokens / total if total > 0 else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    """Steady state: tokens after the first over decode time."""
    return (self.generated_tokens - self.rows) / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
  """Batched autoregressive generation for one model.

  Args:
    model: a loaded `specjax.models.base.Model`.
    page_size: tokens per KV page.
    max_seq_len: capacity of one sequence (prompt + new tokens); defaults to the
      model's `max_position_embeddings`.
    num_pages: size of the page pool (one page is the null page); defaults to
      what the batch needs. A pool too small for a request fails before work.
    prefill_chunk: the largest prefill bucket; longer prompts are prefilled in
      chunks of this many tokens.
    drafter: a `specjax.drafters.Drafter` for speculative decoding (None:
      autoregressive only).
    max_draft: the largest draft depth K a step may use (pages are reserved for
      K + 1 lookahead positions).
    profile: split each speculative step into its draft and verify executables
      with a host sync between them, to report draft / verify time per request
      (costs one extra sync per step; off for throughput runs).
    prefix_cache: `generate` keeps its batch scheduler (that of the last
      batch shape: `HELD`) and shares the KV pages of repeated prefixes
      within and across calls (`specjax.cache.prefix`): None (default) where
      the target and drafter allow it, True (an error where they can't),
      False (every call prefills every prompt, on a fresh scheduler).
  """

  # Batch schedulers `generate` keeps, one per (rows, capacity, pages), the oldest dropped first: each holds a page
  # pool of its batch's size (one: no more memory between calls than the last call used).
  HELD = 1

  def __init__(
      self,
      model: Model,
      *,
      page_size: int = 16,
      max_seq_len: int | None = None,
      num_pages: int | None = None,
      prefill_chunk: int = 512,
      drafter: Drafter | None = None,
      max_draft: int = 8,
      profile: bool = False,
      prefix_cache: bool | None = None,
  ):
    if page_size < 1 or page_size & (page_size - 1):
      raise SpecjaxError(f'page_size must be a power of two, got {page_size}')
    if drafter is not None and drafter.tree_tokens and model.is_hybrid:
      raise SpecjaxError(
          f'{model.source}: draft trees need a target whose cache rolls back by position; this hybrid '
          '(recurrent-state) target verifies chains only (drop the tree options)'
      )
    xla_flags.check_cpu_backend()
    self.model = model
    self.page_size = page_size
    self.max_seq_len = max_seq_len or model.config.max_position_embeddings
    self.num_pages = num_pages
    self.prefill_chunk = prefill_chunk
    self.drafter = drafter
    self.max_draft = min(max_draft, drafter.max_depth) if drafter else 0
    self.profile = profile
    self.phase_s = [0.0, 0.0]  # draft, verify seconds of the last profiled step
    self.executables = Executables(model.graphdef, model.params, model.mesh)
    self.scheduler = None  # `serve()`
    self.prefix_cache = prefix_cache
    self._held: collections.OrderedDict[tuple, tuple[Any, Any]] = collections.OrderedDict()  # `generate`'s

  @property
  def compile_s(self) -> float:
    return self.executables.compile_s

  def _call(self, name, fn, args, static=None, donate=(1,)):
    return self.executables.call(name, fn, args, static, donate)

  # -- validation

  @property
  def lookahead(self) -> int:
    """Positions past the token budget a verify step may write."""
    return self.drafter.lookahead(self.max_draft) if self.drafter else 0

  def plan(self, prompts: list[list[int]], max_new_tokens: int) -> BatchLayout:
    """Checks capacity and pages before any work; the batch's shapes and block tables."""
    return plan_batch(
        prompts,
        max_new_tokens,
        page_size=self.page_size,
        max_seq_len=self.max_seq_len,
        num_pages=self.num_pages,
        lookahead=self.lookahead,
        prefill_chunk=self.prefill_chunk,
    )

  def encode(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, str):
      prompts = [prompts]
    if not prompts:
      raise SpecjaxError('no prompts given')
    out = []
    vocab = self.model.config.vocab_size
    for p in prompts:
      ids = self.model.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
      bad = [t for t in ids if not 0 <= t < vocab]
      if bad:
        raise SpecjaxError(f'token ids {bad[:5]} are outside the vocabulary of {vocab}')
      out.append(ids)
    return out

  # -- generation

  def prefill(
      self,
      prompts: list[list[int]],
      max_new_tokens: int,
      sampling: SamplingParams,
      eos_ids: jax.Array,
      request_ids: Sequence[int] | None = None,
      *,
      drafting: bool = True,
  ) -> DecodeState:
    """Reserves pages, runs the prompts through the model (and drafter), samples the first token.

    `drafting=False` (plain decoding on an engine with a drafter) leaves the
    drafter's state at its initial value instead of running the drafter.
    """
    layout = self.plan(prompts, max_new_tokens)
    batch, n, lens, chunk = layout.batch, layout.rows, layout.prompt_lens, layout.prefill_chunk
    cache = KVCache.create(
        self.model.kv_shapes,
        num_pages=layout.num_pages,
        page_size=self.page_size,
        block_tables=layout.block_tables,
        state_shapes=self.model.state_shapes,
        dtype=self.model.dtype,
        num_slots=max(1, self.drafter.verify_width(self.max_draft) if self.drafter else 0),  # verified positions
    )
    buffer = np.zeros((batch, layout.capacity), np.int32)
    for i, p in enumerate(prompts):
      buffer[i, : len(p)] = p
    dstate, dparams = (), ()
    if self.drafter:
      dparams = self.drafter.params()
      dstate = self.drafter.init_state(
          BatchPlan(batch, layout.capacity, layout.num_pages, self.page_size, layout.block_tables, self.max_draft)
      )
    longest = int(lens.max())
    last_hidden = jnp.zeros((batch, self.model.config.hidden_size), self.model.dtype)
    drafting = bool(self.drafter) and drafting
    taps = {'taps': self.drafter.taps} if drafting and self.drafter.taps else {}
    for first in range(0, longest, chunk):
      tokens = np.ascontiguousarray(buffer[:, first : first + chunk])
      tokens = np.pad(tokens, ((0, 0), (0, chunk - tokens.shape[1])))
      q_lens = np.clip(lens - first, 0, chunk).astype(np.int32)
      cache, last_hidden, hidden, tapped = self._call(
          'prefill', prefill_chunk, (cache, tokens, q_lens, last_hidden), taps
      )
      if drafting:
        dstate = self._call(
            'drafter_prefill',
            drafter_prefill,
            (dparams, dstate, tokens, q_lens, hidden, tapped),
            {'drafter': self.drafter},
            donate=(2,),
        )
    state = DecodeState(
        cache=cache,
        last_tokens=jnp.zeros((batch,), jnp.int32),
        active=jnp.asarray(np.arange(batch) < n),
        num_generated=jnp.zeros((batch,), jnp.int32),
        max_new=jnp.asarray(np.where(np.arange(batch) < n, max_new_tokens, 0), jnp.int32),
        seq_ids=jnp.asarray(list(request_ids or range(n)) + list(range(n, batch)), jnp.int32),
        tokens=jnp.asarray(buffer),
        drafter=dstate,
    )
    state = self._call('start', start, (state, last_hidden, eos_ids), {'sampling': sampling})
    if drafting:
      state = self._call('drafter_start', drafter_start, (dparams, state), {'drafter': self.drafter}, donate=(2,))
    return state

  def step_fn(self, k: int | None, sampling: SamplingParams, state, eos_ids):
    """The compiled speculative step for depth k (None: the autoregressive step) and how to call it."""
    if k is None:
      exe = self.executables.get('decode', decode_step, (state, eos_ids), {'sampling': sampling})
      return lambda state: exe(self.model.params, state, eos_ids)
    dparams = self.drafter.params()
    static = {'drafter': self.drafter, 'k': k, 'sampling': sampling}
    if not self.profile:
      exe = self.executables.get('spec', spec_step, (dparams, state, eos_ids), static, (2,))
      return lambda state: exe(self.model.params, dparams, state, eos_ids)
    propose = self.executables.get('propose', propose_phase, (dparams, state), static, (2,))
    shapes = jax.eval_shape(
        lambda s: propose_phase(self.model.graphdef, self.model.params, dparams, s, **static), state
    )
    verify_exe = self.executables.get('verify', verify_phase, (dparams, *shapes, eos_ids), static, (2,))

    def profiled(state):
      t = time.perf_counter()
      state, prop = propose(self.model.params, dparams, state)
      jax.block_until_ready(prop.drafts)
      t_mid = time.perf_counter()
      out = verify_exe(self.model.params, dparams, state, prop, eos_ids)
      jax.block_until_ready(out[1])
      self.phase_s = [t_mid - t, time.perf_counter() - t_mid]
      return out

    return profiled

  def _batch_scheduler(self, layout: BatchLayout, num_draft):
    """`generate`'s scheduler for the batch's shape: a slot per row, every prompt prefilled before the first
    step; kept across calls with the prefix cache on (its pages and index outlive the call) while the weights
    are the same objects, else a fresh one."""
    from specjax.engine.scheduler import Scheduler  # pylint: disable=g-import-not-at-top (it imports this package)

    shape = (layout.batch, layout.num_pages, min(layout.capacity, self.max_seq_len))
    weights = [self.model.params] + (jax.tree.leaves(self.drafter.params()) if self.drafter else [])
    held = self._held.pop(shape, None) if self.prefix_cache is not False else None
    if held is not None and len(held[1]) == len(weights) and all(a is b for a, b in zip(held[1], weights)):
      self._held[shape] = held
      held[0].set_depth(num_draft)  # checked (`check_depth`) before anything changes
      return held[0]
    while self.prefix_cache is not False and len(self._held) >= self.HELD:  # before the new pool is built
      self._held.popitem(last=False)
    scheduler = Scheduler(
        self,
        max_slots=layout.batch,
        num_pages=layout.num_pages,
        max_seq_len=shape[2],
        num_draft=num_draft,  # checked there (`check_depth`) before any state is built
        prefill_budget=layout.batch * self.prefill_chunk,
        prefix_cache=self.prefix_cache,
        row_buckets=[layout.batch],
        prefill_first=True,
    )
    if scheduler.prefix is not None:  # held: weights are kept referenced, so their identities stay theirs
      self._held[shape] = (scheduler, weights)
    return scheduler

  def reset_prefix_cache(self) -> None:
    """Drops `generate`'s held schedulers and their cached pages: the next call prefills every prompt in full."""
    self._held.clear()

  def serve(self, **options) -> 'Scheduler':
    """Starts this engine's continuous-batching scheduler (`specjax.engine.scheduler.Scheduler` options:
    max_slots, num_pages, max_seq_len, num_draft, prefill_budget); `submit` then feeds it."""
    from specjax.engine.scheduler import Scheduler  # pylint: disable=g-import-not-at-top (it imports this package)

    if self.scheduler is not None:
      self.scheduler.stop()
    self.scheduler = Scheduler(self, **options).start()
    return self.scheduler

  def submit(self, request: Request, loop=None) -> RequestHandle:
    """Queues a request on the running scheduler (`serve()` starts one with defaults); returns its stream:
    `async for event in engine.submit(request, asyncio.get_running_loop())`, or `handle.result()`."""
    return (self.scheduler or self.serve()).submit(request, loop)

  def default_depth(self, fallback: int | None = None) -> int:
    """K when none is given: the drafter's own `default_depth` (set at build: a checkpoint's, DFlash's
    min(block_size - 1, 7)), else `fallback` (the CLI passes the family's), capped by `max_draft`; else
    `max_draft`. The one rule `generate` and `specjax run` follow."""
    own = (self.drafter.default_depth if self.drafter else None) or fallback
    return min(own, self.max_draft) if own else self.max_draft

  def check_depth(self, k: int) -> None:
    """K = 0 is plain decoding; otherwise 1 <= K <= max_draft."""
    if k < 0:
      raise SpecjaxError(f'draft depth must be in 1..{self.max_draft}, got {k}')
    if k and not self.drafter:
      raise SpecjaxError(f'num_draft={k} needs a drafter (this engine has none)')
    if self.drafter and k and not 1 <= k <= self.max_draft:
      raise SpecjaxError(f'draft depth must be in 1..{self.max_draft} for {self.drafter.name}, got {k}')

  def generate(
      self,
      prompts: Sequence[str | Sequence[int]],
      *,
      max_new_tokens: int = 64,
      sampling: SamplingParams = SamplingParams(),
      stream: Callable[[int, str], None] | None = None,
      request_ids: Sequence[int] | None = None,
      num_draft: int | Policy | None = None,
      policy_state: Any = None,
      trace: bool = False,
  ) -> tuple[list[GenerationResult], GenerationStats]:
    """Generates for a batch of prompts (texts or token ids) on the continuous-batching scheduler.

    The batch is one `Scheduler` run in this thread (`Scheduler.drain`): a
    slot per prompt (padded to a power of two), every prompt prefilled before
    the first step (`prefill_first`), then one step per round for the live
    slots, the same executables `serve` runs.
    `num_draft` is the draft depth K of each speculative step (default:
    `default_depth()`: the drafter's own when its checkpoint names one, DFlash's
    min(block_size - 1, 7), else the engine's `max_draft`, when it has a
    drafter; 0 forces plain decoding), or a
    `specjax.policies.Policy` that picks K before every step from its
    candidates (each compiled on first use, its compile kept off the clocks and
    the policy's step times). `policy_state`
    continues a policy's state from an earlier call (`stats.policy_state`), so
    an adaptive policy keeps what it learned across requests.
    `stream(row, text_delta)` is called as text becomes final for each row.
    Random draws are keyed by (seed, request id, position): request ids default
    to the row numbers, so a row's tokens do not depend on the other rows or on
    padding, and a row reruns alone with its request id.
    `trace=True` records every speculative step of each row in
    `result.trace`: `{'k', 'drafts', 'accepted', 'emitted'}` (the drafted and
    the emitted target ids, the accepted count).
    With the engine's prefix cache (`prefix_cache`), rows that repeat a
    prefix of an earlier call or of another row start past its cached pages
    (a row waits for one that is prefilling the same prefix); the tokens are
    the same either way, only the prefill is shorter.
    """
    if max_new_tokens < 1:
      raise SpecjaxError(f'max_new_tokens must be at least 1, got {max_new_tokens}')
    sampling.validate()
    ids = self.encode(prompts)
    if request_ids is not None and len(request_ids) != len(ids):
      raise SpecjaxError(f'{len(request_ids)} request ids for {len(ids)} prompts')
    if sampling.constraint is not None:
      compile_constraint(self.model, sampling.constraint)  # a bad schema, regex or grammar: an error now
    layout = self.plan(ids, max_new_tokens)  # capacity and pages for the whole batch, before any work
    compile_before = self.compile_s
    scheduler = self._batch_scheduler(layout, num_draft)
    hits_before = scheduler.counters['prefix_hit_tokens']
    scheduler.prefill_pad = layout.prefill_chunk  # one prefill executable for the batch: the longest prompt's bucket
    policy = scheduler.policy
    if policy:
      scheduler.pstate = policy.begin(policy.init() if policy_state is None else policy_state, len(ids))
    scheduler.step_log, scheduler.grammar_s = [], 0.0  # this call's (a held scheduler ran earlier ones)
    seq_ids = list(range(len(ids))) if request_ids is None else [int(r) for r in request_ids]
    requests = [Request(p, max_new_tokens, sampling, seq_id=s, trace=trace) for p, s in zip(ids, seq_ids)]
    handles = [scheduler.submit(r) for r in requests]  # results are read per handle (a row's slot may differ)
    t0 = time.perf_counter()
    clock = {'first': None, 'compile': 0.0}

    def on_round() -> None:
      for row, handle in enumerate(handles):
        for event in handle.ready():
          if stream and event.text:
            stream(row, event.text)
      if clock['first'] is None and all(h.stats.first_token is not None for h in handles):
        clock['first'], clock['compile'] = time.perf_counter(), self.compile_s - compile_before

    try:
      scheduler.drain(on_round)
    except BaseException:  # a call cut short leaves requests in its slots: the next call starts afresh
      self._held = collections.OrderedDict((k, v) for k, v in self._held.items() if v[0] is not scheduler)
      raise
    t_end = time.perf_counter()
    compile_s = self.compile_s - compile_before
    stats = GenerationStats(rows=len(ids))
    stats.compile_s = compile_s
    stats.prefill_s = clock['first'] - t0 - clock['compile']
    stats.decode_s = t_end - clock['first'] - (compile_s - clock['compile'])
    stats.steps = scheduler.step_log
    stats.decode_steps = len(scheduler.step_log)
    stats.grammar_s = scheduler.grammar_s
    stats.prompt_tokens = sum(map(len, ids))
    stats.cached_tokens = scheduler.counters['prefix_hit_tokens'] - hits_before
    stats.policy_state = scheduler.pstate if policy else None
    eos = set(scheduler.eos)
    results = []
    for handle in handles:
      out = handle.result()
      spec = handle.stats.spec
      if spec is not None:
        spec.total_s = stats.decode_s
        spec.forced_drafted, spec.forced_accepted = handle.stats.forced_drafted, handle.stats.forced_accepted
      reason = 'eos' if out.tokens and out.tokens[-1] in eos else 'length'
      text = self.model.tokenizer.decode(out.tokens)
      results.append(GenerationResult(text, out.tokens, len(handle.request.prompt), reason, spec, handle.stats.trace))
    stats.generated_tokens = sum(len(r.tokens) for r in results)
    return results, stats
