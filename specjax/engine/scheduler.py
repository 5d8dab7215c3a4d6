"""Continuous batching: requests join and leave a fixed set of slots while one thread runs the device loop.

One scheduler thread owns the decode state (a `DecodeState` of `max_slots`
rows over one page pool) and loops:

  1. take new requests and cancels from thread-safe queues;
  2. admit waiting requests into free slots (`slots.admit`: per-row state
     reset, the drafter's included);
  3. prefill joining slots a chunk each under a per-step token budget
     (`slots.prefill_rows`); a slot whose prompt ends samples its first token;
  4. run one step for the active slots: the plain decode step when no slot
     drafts, else one draft-verify step as wide as the deepest slot's depth
     (each slot drafts its own depth: the request's `num_draft`, else the
     depth policy's choice for the live load);
  5. one host transfer of the step's tokens; stream them to their requests,
     cut stop strings, free the slots that finished.

Pages are allocated as a slot grows (its prompt chunk, then its length plus
the step's lookahead) and returned when it leaves. When the pool runs out the
newest request is preempted: its pages are freed and it waits at the head of
the queue to be prefilled again with the tokens it had (its draws are keyed by
position, so it continues exactly). Full pages of repeated prefixes are shared
through the prefix cache (`specjax.cache.prefix`): a joining request starts
past its longest cached run of pages (copying a page it shares only the start
of), or waits for a slot still prefilling more of its prefix, and a request's
committed pages join the cache; a hybrid target's row
starts at a snapshot of its recurrent state, taken where a prefill chunk ends
on a snapshot boundary or where a leaving row's committed positions end. The executables are bounded: admit,
deactivate and table updates once; decode and one spec step per depth, each
greedy or sampled, per bucket of live rows (1, 2, 4, ..: a step computes only the live slots); prefill
one row a call, per chunk bucket (`executable_set`; `warmup` compiles them ahead).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import queue
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache.paged import NULL_PAGE, KVCache, PageAllocator
from specjax.cache.prefix import PrefixIndex
from specjax.depths import step_depth, verify_widths
from specjax.drafters.base import BatchPlan
from specjax.engine import slots
from specjax.engine.planner import PREFILL_BUCKETS, next_pow2
from specjax.engine.requests import Event, Request, RequestHandle
from specjax.errors import OutOfPagesError, SpecjaxError
from specjax.grammar import RowGrammars, compile_constraint, new_matcher
from specjax.metrics import SpecMetrics
from specjax.policies import Fixed, Policy
from specjax.sampling import RowSampling, SamplingParams
from specjax.step import DecodeState

# scheduler: ready


@dataclasses.dataclass
class _Job:
  """A request's host-side record, kept across preemptions."""

  handle: RequestHandle
  order: int  # first-admission counter: the largest is the newest (preempted first)
  generated: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  text: str = ''  # decoded so far
  sent: int = 0  # characters of `text` streamed
  decoder: Any = None
  slot: int = -1
  prefilled: int = 0  # tokens of `todo` in the cache
  todo: list[int] = dataclasses.field(default_factory=list)  # tokens to prefill: the prompt + tokens kept
  active: bool = False
  length: int = 0  # target cache length once active
  first_pending: bool = False  # prefilled this round; its first token comes with the round's transfer
  matcher: Any = None  # a constrained request's llguidance matcher (`specjax.grammar`): advanced by what it emits
  snaps: dict[int, int] = dataclasses.field(default_factory=dict)  # pages -> snapshot slot, not yet in the index
  cached: int = 0  # tokens its last admission found in the prefix cache (not prefilled)
  drafter_upto: int = -1  # the first position a plain decode step left out of the drafter's caches (-1: none)
  in_flight: list[bytes] = dataclasses.field(default_factory=list)  # page keys it caches when its prefill ends

  @property
  def request(self) -> Request:
    return self.handle.request


def _holdback(text: str, stops: tuple[str, ...]) -> int:
  """Characters at the end of `text` that may start a stop string."""
  best = 0
  for stop in stops:
    for n in range(min(len(stop) - 1, len(text)), best, -1):
      if text.endswith(stop[:n]):
        best = n
        break
  return best


def check_row_buckets(row_buckets: Sequence[int] | None, max_slots: int) -> list[int]:
  """The sub-batch sizes a step runs at, sorted: `row_buckets`, or powers of two up to `max_slots`'s."""
  if row_buckets is None:
    return [1 << i for i in range(next_pow2(max_slots).bit_length())]
  buckets = sorted({int(r) for r in row_buckets})
  if not buckets or buckets[0] < 1 or buckets[-1] != max_slots:
    raise SpecjaxError(
        f'row_buckets must be positive sub-batch sizes, the largest max_slots ({max_slots}), got {list(row_buckets)}'
    )
  return buckets


class Scheduler:
  """A continuous-batching engine over one `Engine`'s model and drafter.

  Args:
    engine: the `Engine` (model, drafter, page size, prefill chunk).
    max_slots: requests decoded together (the batch rows of every step).
    num_pages: the page pool (one is the null page); default: every slot at full capacity. A smaller pool
      preempts the newest request when it runs out.
    max_seq_len: capacity of one request (prompt + max_tokens + draft lookahead); default
      min(engine.max_seq_len, 2048).
    num_draft: the depth of requests that do not set one: an int (0: no speculation), a `Policy` (reads the
      live slot count, learns from the steps), None: the engine's `default_depth()`.
    prefill_budget: prompt tokens prefilled per step, across joining slots (default: the engine's prefill
      chunk).
    prefix_cache: share the KV pages of repeated prefixes between requests (`specjax.cache.prefix`): None
      (default) where the target and drafter allow it (`prefix_note` says why not), True (an error where it
      can't), False (off).
    prefix_snapshot_every: hybrid targets: a recurrent-state snapshot every this many pages of a prefill (and at
      each prompt's last full page); a cached prefix restores the longest at or before its match.
    prefix_snapshots: hybrid targets: snapshots the device pool holds (default 4 per slot); the least recently
      used is dropped when it is full.
    row_buckets: the sub-batch sizes a decode or verify step runs at (the live slots round up to one): each is
      an executable per depth and sampling mode. Default: powers of two up to max_slots'; fewer buckets compile
      fewer executables (faster start-up) and pad more rows per step.
    prefill_first: no step runs while an admitted request is still prefilling (an offline batch: `Engine.generate`
      prefills every row, then decodes); default False: prefill chunks interleave with the running slots' steps.
    prefill_pad: every prefill chunk of a row that found no cached prefix is padded to at least this many tokens
      (the bucket at or above it), so an offline batch of ragged prompts compiles one prefill executable, not one
      per chunk bucket it touches; a row past a cached prefix prefills its rest in the bucket it needs.

  `engine.profile` splits each speculative step into its draft and verify executables with a host sync between
  (`RequestStats.spec.draft_s` / `verify_s`); `step_log = []` records (K, seconds, live slots) per step.
  """

  def __init__(
      self,
      engine,
      *,
      max_slots: int = 8,
      num_pages: int | None = None,
      max_seq_len: int | None = None,
      num_draft: int | Policy | None = None,
      prefill_budget: int | None = None,
      prefix_cache: bool | None = None,
      prefix_snapshot_every: int = 8,
      prefix_snapshots: int | None = None,
      row_buckets: Sequence[int] | None = None,
      prefill_first: bool = False,
      prefill_pad: int = 0,
  ):
    if max_slots < 1:
      raise SpecjaxError(f'max_slots must be at least 1, got {max_slots}')
    self._row_buckets = check_row_buckets(row_buckets, max_slots)
    if not isinstance(prefix_snapshot_every, int) or prefix_snapshot_every < 1:
      raise SpecjaxError(f'prefix_snapshot_every must be at least 1 page, got {prefix_snapshot_every!r}')
    if prefix_snapshots is not None and prefix_snapshots < 1:
      raise SpecjaxError(f'prefix_snapshots must be at least 1, got {prefix_snapshots}')
    self.snapshot_every = prefix_snapshot_every
    self.engine = engine
    self.model = engine.model
    self.drafter = engine.drafter
    self.max_slots = max_slots
    self.page_size = engine.page_size
    self.max_seq_len = max_seq_len or min(engine.max_seq_len, 2048)
    if self.max_seq_len > engine.max_seq_len:
      raise SpecjaxError(f'max_seq_len {self.max_seq_len} is over the model capacity of {engine.max_seq_len}')
    self.pages_per_seq = math.ceil(self.max_seq_len / self.page_size)
    self.num_pages = num_pages or max_slots * self.pages_per_seq + 1
    self.prefill_budget = prefill_budget or engine.prefill_chunk
    self.max_depth = engine.max_draft if self.drafter else 0
    self.set_depth(num_draft)
    # Positions past a request's budget a step may write: a verify pass's lookahead (a decode step writes only
    # the tokens before the last).
    self.lookahead = self.drafter.lookahead(self.max_depth) if self.drafter else 0
    if self.pages_for(self.lookahead + 2) > self.num_pages - 1:
      raise OutOfPagesError(f'a pool of {self.num_pages} pages holds no request (one is the null page)')
    eos = self.model.generation.eos_token_ids or self.model.tokenizer.eos_ids
    self.eos = sorted(set(eos)) or [-1]
    self.allocator = PageAllocator(self.num_pages, self.page_size)
    self.tables = np.full((max_slots, self.pages_per_seq), NULL_PAGE, np.int32)
    self._tables_dirty = False
    self._inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()
    self.waiting: collections.deque[_Job] = collections.deque()
    self.slots: list[_Job | None] = [None] * max_slots
    self._order = 0
    self.error: BaseException | None = None
    self.counters = dict(
        preemptions=0,
        requests_finished=0,
        requests_cancelled=0,
        prompt_tokens=0,
        generated_tokens=0,
        steps=0,
        drafted=0,
        accepted=0,
        spec_steps=0,
        prefix_lookup_tokens=0,  # prompt tokens of admissions, looked up in the prefix cache
        prefix_hit_tokens=0,  # of those, found cached (not prefilled)
        prefix_copied_pages=0,  # cached pages copied on write (a request shares only their start)
        prefix_restored=0,  # hybrid rows started from a recurrent-state snapshot
        forced_drafted=0,  # grammar-forced drafts verified (`grammar+<family>` on constrained requests)
        forced_accepted=0,
    )
    self.accepted_at = [0] * max(self.max_depth, 1)
    self.drafted_at = [0] * max(self.max_depth, 1)
    self.host_s = 0.0  # host time outside the jitted calls, over `steps`
    self.grammar_s = 0.0  # host time in the grammar matchers of constrained steps
    self.step_log: list[tuple[int, float, int]] | None = None  # [] to record (K, seconds, live slots) per step
    self.prefill_first = prefill_first
    self.prefill_pad = prefill_pad
    self._phase_s = (0.0, 0.0)  # draft, verify seconds of the last profiled step
    self._deferred = 0  # waiting requests held back for a prefix another slot is prefilling (`_admit`)
    self._in_flight: collections.Counter[bytes] = collections.Counter()  # page keys prefilling slots will cache
    self._leave_snaps: list[tuple[int, int]] = []  # (slot, pool slot): leaving hybrid rows' states to snapshot
    self.state = self._initial_state()
    self.fresh = self._initial_state(num_pages=2)  # one empty row, repeated; its pools are never read
    self.snapshots = None  # hybrid targets: the snapshot pool (`slots.snapshot_pool`)
    self.prefix_trail = 0  # positions a drafter's own caches may trail the target's (set with the prefix index)
    self.prefix, self.prefix_note = self._prefix_index(prefix_cache, prefix_snapshots or 4 * max_slots)
    self.pending = np.zeros(max_slots, np.int32)  # drafts_ahead drafters: each slot's drafts for the next step

  # -- set-up

  def set_depth(self, num_draft: int | Policy | None) -> None:
    """The depth of requests that do not set one (`num_draft` as the constructor takes it), checked before any
    state changes; between offline runs (`Engine.generate` keeps a scheduler across calls), not while one runs."""
    if isinstance(num_draft, Policy):
      policy = num_draft
    else:
      k = self.engine.default_depth() if num_draft is None and self.drafter else (num_draft or 0)
      self.engine.check_depth(k)
      policy = Fixed(k) if k else None
    for k in policy.candidates if policy else ():
      self.engine.check_depth(k)
    self.policy = policy
    self.pstate = policy.init() if policy else None
    # A step's K rounds up to one of these (the policy's candidates; a request deeper than all compiles its own).
    self.step_depths = (
        sorted(k for k in (policy.candidates if policy else {self.max_depth}) if k) if self.drafter else []
    )

  def _prefix_index(self, wanted: bool | None, num_snapshots: int) -> tuple[PrefixIndex | None, str]:
    if wanted is False:
      return None, 'off'
    dcaches = [c for c in jax.tree.leaves(self.state.drafter, is_leaf=slots.is_cache) if slots.is_cache(c)]
    if any(c.state_slot is not None for c in dcaches):
      note = "off: the drafter's own cache has recurrent state (only the target's is snapshotted)"
      if wanted:
        raise SpecjaxError(f'prefix_cache=True: {note[5:]}')
      return None, note
    own = bool(dcaches)
    # A drafter cache trails the target's by its pending positions (at most a step's K + 1): a page is cached
    # once it lies that far below the request's length, so the drafter's entries in it are written too.
    self.prefix_trail = self.max_depth + 1 if own else 0
    lag = self.drafter.prefix_key_lag if self.drafter else 0
    dtype = np.dtype(self.model.dtype).name
    drafter = f'{self.drafter.name}@{id(self.drafter):x}' if own else 'no drafter cache'
    identity = f'{self.model.source}|{self.model.architecture}|{id(self.model.params):x}|{dtype}|{drafter}'
    if not self.model.is_hybrid:
      return PrefixIndex(self.page_size, identity, lag), 'on'
    self.snapshots = slots.snapshot_pool(self.state.cache, num_snapshots)
    index = PrefixIndex(self.page_size, identity, lag, snapshot_slots=num_snapshots)
    return index, f'on (recurrent state snapshotted every {self.snapshot_every} pages)'

  def _matchable_pages(self, tokens: Sequence[int]) -> int:
    """Full pages of `tokens` a request repeating them can start past (`match`: one token is always prefilled,
    and a page's key lag tokens must exist)."""
    return min((len(tokens) - 1) // self.page_size, self.prefix.full_pages(len(tokens)))

  def _snapshot_point(self, job: _Job, start: int, end: int) -> int:
    """The first position in (start, end] where a hybrid row's prefill snapshots its state (0: none): a multiple
    of `snapshot_every` pages, or the last full page a repeat of its prompt can match."""
    point = (start // (self.snapshot_every * self.page_size) + 1) * self.snapshot_every * self.page_size
    last = self._matchable_pages(job.todo) * self.page_size
    if start < last < point:
      point = last
    return point if point <= end else 0

  def pages_for(self, tokens: int) -> int:
    return math.ceil(tokens / self.page_size)

  @property
  def capacity(self) -> int:
    return self.pages_per_seq * self.page_size

  def _initial_state(self, num_pages: int | None = None) -> DecodeState:
    b, num_pages = self.max_slots, num_pages or self.num_pages
    cache = KVCache.create(
        self.model.kv_shapes,
        num_pages=num_pages,
        page_size=self.page_size,
        block_tables=self.tables,
        state_shapes=self.model.state_shapes,
        dtype=self.model.dtype,
        num_slots=max(1, self.drafter.verify_width(self.max_depth) if self.drafter else 0),
    )
    dstate = ()
    if self.drafter:
      plan = BatchPlan(b, self.capacity, num_pages, self.page_size, self.tables, self.max_depth)
      dstate = self.drafter.init_state(plan)
    zeros = lambda: jnp.zeros((b,), jnp.int32)  # a buffer each: the state is donated
    return DecodeState(
        cache=cache,
        last_tokens=zeros(),
        active=jnp.zeros((b,), bool),
        num_generated=zeros(),
        max_new=zeros(),
        seq_ids=zeros(),
        tokens=jnp.zeros((b, self.capacity), jnp.int32),
        drafter=dstate,
        row_sampling=jax.tree.map(jnp.asarray, RowSampling.of([SamplingParams()] * b)),
        row_eos=jnp.full((b, len(self.eos)), -1, jnp.int32),
    )

  def row_buckets(self) -> list[int]:
    """Sub-batch sizes a step runs at (`row_buckets`; prefill runs one row a call)."""
    return list(self._row_buckets)

  def exec_depths(self) -> list[int]:
    """Depths a draft-verify step is compiled for: `step_depths` (a slot's depth rounds up to one; drafting
    ahead, also the narrower verify widths its short drafts use)."""
    if not self.drafter:
      return []
    depths = set(self.step_depths)
    if self.drafter.drafts_ahead or self.drafter.forced_only:
      depths |= {w - 1 for d in self.step_depths for w in verify_widths(d)}
    return sorted(depths)

  def _decode_call(self, rows, greedy: bool, bitmask=None) -> tuple[str, tuple, dict]:
    """The plain decode step's (name, args, static); a drafter that drafts ahead (n-gram) also looks up its next
    drafts in it (`slots.decode_rows`)."""
    ahead = self.drafter if self.drafter is not None and self.drafter.drafts_ahead else None
    args = (self.state, rows, bitmask) + ((self.drafter.params(),) if ahead else ())
    static = {'greedy': greedy} | ({'drafter': ahead} if ahead else {})
    return ('decode' if bitmask is None else 'decode_grammar'), args, static

  def _shapes(self, sampled: bool) -> list[tuple]:
    """(name, fn, args, static, donate) of every step and prefill executable steady state may use."""
    modes = (True, False) if sampled else (True,)
    dparams = self.drafter.params() if self.drafter else ()
    out = []
    chunks = [c for c in PREFILL_BUCKETS if c < self.engine.prefill_chunk] + [self.engine.prefill_chunk]
    for r in self.row_buckets():
      rows = np.full(r, self.max_slots, np.int32)
      for greedy in modes:
        name, args, static = self._decode_call(rows, greedy)
        out.append((name, slots.decode_rows, args, static, (1,)))
        for k in self.exec_depths():
          static = {'drafter': self.drafter, 'k': k, 'greedy': greedy}
          out.append(('spec', slots.spec_rows, (dparams, self.state, rows, np.zeros(r, np.int32)), static, (2,)))
    row = np.full(1, self.max_slots, np.int32)
    for greedy in modes:
      for t in chunks:  # prefill runs one row a call
        args = (dparams, self.state, row, np.zeros((1, t), np.int32), np.zeros(1, np.int32), np.zeros(1, bool))
        static = {'drafter': self.drafter, 'greedy': greedy, 'hidden_size': self.model.config.hidden_size}
        out.append(('prefill', slots.prefill_rows, args, static, (2,)))
    return out

  def executable_set(self, sampled: bool = True) -> list[str]:
    """Every step and prefill executable steady state may use (compiled on first use, or by `warmup`), and the
    admit / deactivate / block-table updates."""
    names = ['admit', 'deactivate', 'tables'] + (['snapshot'] if self.snapshots is not None else [])
    for name, _, args, static, _ in self._shapes(sampled):
      rows = args[2 if name in ('spec', 'prefill') else 1].shape[0]
      extra = f',k={static["k"]}' if name == 'spec' else f',chunk={args[3].shape[1]}' if name == 'prefill' else ''
      names.append(f'{name}[rows={rows}{extra},{"greedy" if static["greedy"] else "sampled"}]')
    return names

  def warmup(self, sampled: bool = False) -> float:
    """Compiles every step and prefill executable (greedy; `sampled=True`: the sampled ones too) before serving,
    so no request waits on a compile; returns the seconds spent."""
    before = self.engine.executables.compile_s
    for name, fn, args, static, donate in self._shapes(sampled):
      self.engine.executables.get(name, fn, args, static, donate)
    return self.engine.executables.compile_s - before

  # -- the caller's side

  def start(self) -> Scheduler:
    if self._thread is None:
      self._stop.clear()
      self._thread = threading.Thread(target=self._run, name='specjax-scheduler', daemon=True)
      self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._wake.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def __enter__(self) -> Scheduler:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def check(self, request: Request) -> None:
    """Raises SpecjaxError for a request that cannot run; nothing is scheduled."""
    vocab = self.model.config.vocab_size
    if not request.prompt:
      raise SpecjaxError('the prompt is empty (no tokens)')
    bad = [t for t in request.prompt if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)]
    if bad:
      raise SpecjaxError(f'token ids {bad[:5]} are outside the vocabulary of {vocab}')
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
      raise SpecjaxError(f'max_tokens must be at least 1, got {request.max_tokens!r}')
    request.sampling.validate()
    if request.num_draft is not None:
      if request.num_draft and not self.drafter:
        raise SpecjaxError(f'num_draft={request.num_draft} needs a drafter (this server has none)')
      if not 0 <= request.num_draft <= self.max_depth:
        raise SpecjaxError(f'num_draft must be in 0..{self.max_depth}, got {request.num_draft}')
    if any(not isinstance(s, str) or not s for s in request.stop):
      raise SpecjaxError('stop strings must be non-empty strings')
    if request.sampling.constraint is not None:
      compile_constraint(self.model, request.sampling.constraint)  # a bad schema, regex or grammar: an error now
    need = len(request.prompt) + request.max_tokens + self.lookahead
    if need > self.capacity:
      raise SpecjaxError(
          f'the prompt has {len(request.prompt)} tokens; with max_tokens={request.max_tokens}'
          f'{f" and {self.lookahead} draft lookahead" if self.lookahead else ""} it needs {need} positions, over '
          f'the capacity of {self.capacity}'
      )
    if self.pages_for(need) > self.num_pages - 1:
      raise OutOfPagesError(f'the request needs {self.pages_for(need)} pages, the pool has {self.num_pages - 1}')

  def submit(self, request: Request, loop=None) -> RequestHandle:
    """Checks the request and queues it; returns its stream (async with `loop`, else blocking)."""
    self.check(request)
    if self.error is not None:
      raise SpecjaxError(f'the scheduler stopped: {self.error}')
    handle = RequestHandle(request, loop)
    depth = (max(self.policy.candidates) if self.policy else 0) if request.num_draft is None else request.num_draft
    if self.drafter and depth:
      handle.stats.spec = SpecMetrics(k=depth)
      handle.stats.trace = [] if request.trace else None
    constraint = request.sampling.constraint
    matcher = new_matcher(self.model, compile_constraint(self.model, constraint)) if constraint else None
    self._inbox.put(_Job(handle, 0, decoder=self.model.tokenizer.stream(), matcher=matcher))
    self._wake.set()
    return handle

  def metrics(self) -> dict:
    with self._lock:
      busy = sum(s is not None for s in self.slots)
      return dict(
          self.counters,
          live_slots=busy,
          max_slots=self.max_slots,
          free_pages=self._free_pages(),
          total_pages=self.num_pages - 1,
          prefix_cache=self.prefix_note,
          prefix_cached_pages=self.prefix.cached_pages if self.prefix else 0,
          prefix_evictions=self.prefix.evictions if self.prefix else 0,
          prefix_snapshots=self.prefix.snapshots if self.prefix else 0,
          waiting=len(self.waiting) + self._inbox.qsize(),
          drafter=self.drafter.name if self.drafter else None,
          accepted_at=list(self.accepted_at),
          drafted_at=list(self.drafted_at),
          host_ms_per_step=1e3 * self.host_s / max(self.counters['steps'], 1),
      )

  # -- the scheduler thread

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        if not self._iterate():
          self._wake.wait(0.05)
          self._wake.clear()
    except BaseException as e:  # noqa: BLE001 - every waiting request gets the error as its end
      self.error = e
      while not self._inbox.empty():
        self.waiting.append(self._inbox.get())
      for job in list(self.waiting) + [j for j in self.slots if j]:
        job.handle.put(Event([], '', finish_reason='error', time=time.perf_counter()))
      raise

  def _call(self, name, fn, args, static=None, donate=(1,)):
    t = time.perf_counter()
    out = self.engine.executables.call(name, fn, args, static, donate)
    self._dispatch_s += time.perf_counter() - t
    return out

  def drain(self, after_round: Callable[[], None] | None = None) -> None:
    """Runs rounds in the calling thread until every submitted request has ended, calling `after_round()` after
    each (the scheduler thread must not be running): an offline batch (`Engine.generate`) drives it this way."""
    if self._thread is not None:
      raise SpecjaxError('drain() runs the rounds itself: stop() the scheduler thread first')
    while self._iterate() or any(self.slots) or not self._inbox.empty():
      if after_round:
        after_round()
    if after_round:
      after_round()

  def _iterate(self) -> bool:
    """One round: admit, prefill a chunk, one step, stream. False when there was nothing to do."""
    t0 = time.perf_counter()
    compiled = self.engine.executables.compile_s  # a first call's compile is not a step's time
    self._dispatch_s = 0.0
    while not self._inbox.empty():
      self.waiting.append(self._inbox.get())
    self._cancel()
    self._admit()
    prefilling = self.prefill_first and (self._deferred or any(j and not j.active for j in self.slots))
    prefilled = self._prefill()
    stepped = None if prefilling else self._step()
    pending = self.drafter.pending_lens(self.state.drafter) if self.drafter and self.drafter.drafts_ahead else None
    t_get = time.perf_counter()
    outs = jax.device_get((prefilled, stepped, pending))  # the one host transfer of the round
    t_got = time.perf_counter()
    before = self.pending
    if pending is not None:
      self.pending = np.asarray(outs[2])
    if prefilled is not None:
      self._after_prefill(outs[0])
    if stepped is not None:
      dt = t_got - t0 - (self.engine.executables.compile_s - compiled)
      self._after_step(outs[1], dt, before, priced=prefilled is None)
      self.host_s += (t_get - t0 - self._dispatch_s) + (time.perf_counter() - t_got)
    return prefilled is not None or stepped is not None or bool(self.waiting)

  # admission and leaving

  def _free(self, job: _Job, deactivate: bool = True, counter: str | None = None) -> None:
    self._land(job)
    with self._lock:  # one update, as `metrics` reads it
      if counter:
        self.counters[counter] += 1
      if job.slot >= 0:
        self._release(job, self.allocator.drop(job.slot))
        self.slots[job.slot] = None
    if self._leave_snaps:  # before the slot is reused
      self._take_snapshots(*zip(*self._leave_snaps))
      self._leave_snaps = []
    if job.slot >= 0:
      self.tables[job.slot] = NULL_PAGE
      self._tables_dirty = True
      if job.active and deactivate:
        self._deactivate([job.slot])
      job.slot, job.active = -1, False

  def _free_pages(self) -> int:
    """Pages a request can get: free, or cached and held by none."""
    return self.allocator.free_pages + (self.prefix.evictable if self.prefix else 0)

  def _release(self, job: _Job, pages: list[int]) -> None:
    """A leaving job's pages: its full committed pages join the prefix cache, cached pages lose its reference,
    the rest are freed."""
    if self.prefix:
      self._register(job, job.length if job.active else job.prefilled, leaving=True)
      for page in [p for p in pages if self.prefix.holds(p)]:
        self.prefix.release(page)
      pages = [p for p in pages if not self.prefix.holds(p)]
      for slot in job.snaps.values():  # snapshots of pages that did not join the index
        self.prefix.free_snapshot(slot)
      job.snaps.clear()
    self.allocator.give(pages)

  def _register(self, job: _Job, filled: int, leaving: bool = False) -> None:
    """Caches the job's pages that lie wholly below `filled` committed positions (less the drafter's trail), and
    the snapshots taken at their ends; a leaving job's partly filled last page too (it is copied on write). A
    leaving hybrid row (no drafter cache: no trail) snapshots its state, which is the state after exactly
    `filled` positions, on the page where they end (`_leave_snapshot`)."""
    seq = list(job.request.prompt) + job.generated
    filled = filled if job.drafter_upto < 0 else min(filled, job.drafter_upto)  # pages whose drafter entries exist
    held = int((self.tables[job.slot] != NULL_PAGE).sum())
    ps, lag, done = self.page_size, self.prefix.key_lag, max(filled - self.prefix_trail, 0)
    n = min(self.prefix.full_pages(len(seq)), done // ps, held)
    parent, parent_page = self.prefix.root, None
    keys = self.prefix.chain(seq, n)
    for i, (key, page) in enumerate(zip(keys, self.tables[job.slot, :n].tolist())):
      if not self.prefix.holds(page) and not self.prefix.insert(
          key, parent, page, parent_page, seq[i * ps : (i + 1) * ps + lag]
      ):
        # Cached already as another page (a hybrid row recomputes the pages past its snapshot): a leaver's later
        # pages hang under that one (it holds none of them once it has left); a staying row holds the cached
        # page instead of its copy (the same positions, committed), so its later pages can join the cache.
        cached = self.prefix.page_of(key)
        if cached is not None and leaving:
          page = cached
        elif cached is not None and parent_page == self.prefix.page_of(parent):
          self.prefix.acquire([key])
          self.allocator.give([self.allocator.swap(job.slot, i, cached)])
          self.tables[job.slot, i] = page = cached
          self._tables_dirty = True
      parent, parent_page = key, page
    for pages in [p for p in job.snaps if p <= n]:
      slot = job.snaps.pop(pages)
      if not self.prefix.attach(keys[pages - 1], slot):
        self.prefix.free_snapshot(slot)
    valid = min(done, len(seq) - lag) - n * ps
    hybrid = self.snapshots is not None
    if not leaving or (hybrid and (self.prefix_trail or n * ps + valid != filled)):
      return
    if 0 < valid < ps and n < held:
      page = int(self.tables[job.slot, n])
      key = self.prefix.insert_partial(parent, page, parent_page, seq[n * ps : n * ps + valid + lag], valid)
      if hybrid and key is not None:
        self._leave_snapshot(job, key)
    elif hybrid and n and not valid and self.prefix.snapshot(keys[-1]) < 0:
      self._leave_snapshot(job, keys[-1])

  def _leave_snapshot(self, job: _Job, key: bytes) -> None:
    """Attaches a snapshot of a leaving hybrid row's state to `key`'s entry (the device copy runs before the slot
    is reused): a chat's next turn restores it and prefills only its new tokens."""
    slot = self.prefix.new_snapshot()
    if slot >= 0 and self.prefix.attach(key, slot):
      self._leave_snaps.append((job.slot, slot))
    elif slot >= 0:
      self.prefix.free_snapshot(slot)

  def _take_snapshots(self, rows: Sequence[int], dst: Sequence[int]) -> None:
    """Copies the recurrent state of slots `rows` into pool slots `dst` (one call)."""
    rows_, dst_ = np.full(self.max_slots, self.max_slots, np.int32), np.full(self.max_slots, -1, np.int32)
    rows_[: len(rows)], dst_[: len(dst)] = rows, dst
    self.snapshots = self._call('snapshot', slots.take_snapshots, (self.snapshots, self.state, rows_, dst_))

  def _finish(self, job: _Job, reason: str, tokens=(), logprobs=(), deactivate: bool = True) -> None:
    text = job.text[job.sent :]
    job.handle.stats.completion_tokens = len(job.generated)
    self._free(job, deactivate, 'requests_cancelled' if reason == 'cancelled' else 'requests_finished')
    job.handle.put(
        Event(list(tokens), text, list(logprobs) if job.request.logprobs else None, reason, time.perf_counter())
    )

  def _cancel(self) -> None:
    for job in [j for j in self.waiting if j.handle.cancelled.is_set()]:
      self.waiting.remove(job)
      self._finish(job, 'cancelled')
    for job in [j for j in self.slots if j and j.handle.cancelled.is_set()]:
      self._finish(job, 'cancelled')

  def _deactivate(self, rows: list[int]) -> None:
    padded = np.full(self.max_slots, self.max_slots, np.int32)
    padded[: len(rows)] = rows
    self.state = self._call('deactivate', slots.deactivate, (self.state, padded))

  def _push_tables(self) -> None:
    if self._tables_dirty:
      self.state = self._call('tables', slots.point_tables, (self.state, self.tables))
      self._tables_dirty = False

  def _admit(self) -> None:
    free = [i for i, s in enumerate(self.slots) if s is None]
    joined, copies, restore = [], [], []  # per joining row: (source, own page) of a copy on write; a snapshot
    deferred = []  # requests waiting for a prefix a slot is prefilling: its pages are cached when it ends
    while free and self.waiting and len(deferred) < self.max_slots:  # a bounded look past the held-back ones
      job = self.waiting.popleft()
      todo = list(job.request.prompt) + job.generated
      busy = self.max_slots - len(free)
      hybrid = self.snapshots is not None
      full = self.prefix.match(todo, (len(todo) - 1) // self.page_size) if self.prefix else []  # >= 1 left
      hit = self.prefix.upto_snapshot(full) if hybrid else full  # a hybrid row starts where a state was saved
      if self.prefix and self._prefix_in_flight(todo) > len(hit):
        deferred.append(job)
        continue
      if busy and self.pages_for(len(todo) + self.lookahead) - len(hit) + busy > self._free_pages():
        self.waiting.appendleft(job)
        break  # wait for pages: its prompt, and a page of growth for each busy slot (else it would be preempted)
      cow = (b'', 0, 0)  # a cached page it shares the start of, copied into a page of its own
      if self.prefix and self.allocator.free_pages:
        # Hybrids: only a page with a snapshot after all it holds (a leaver's), past full pages of any snapshot.
        cow = self.prefix.partial(todo, full, len(todo) - 1 - len(full) * self.page_size, hybrid)
        hit = full if cow[2] else hit
      slot = free.pop(0)
      if job.order == 0:  # first admission: its place in line, kept across preemptions
        self._order += 1
        job.order = self._order
        with self._lock:
          self.counters['prompt_tokens'] += len(job.request.prompt)
      job.slot, job.todo, job.prefilled, job.active = slot, todo, len(hit) * self.page_size + cow[2], False
      job.cached, job.drafter_upto = job.prefilled, -1  # a prefill writes the drafter's caches over all of todo
      if self.prefix:
        self._fly(job, len(hit))
      with self._lock:
        pages = self.allocator.allocate(slot, cow[2] and (len(hit) + 1) * self.page_size, [p for _, p in hit])
        if self.prefix:
          self.prefix.acquire([key for key, _ in hit])
          self.counters['prefix_lookup_tokens'] += len(todo)
          self.counters['prefix_hit_tokens'] += job.prefilled
          self.counters['prefix_copied_pages'] += bool(cow[2])
          self.counters['prefix_restored'] += bool((hit or cow[2]) and hybrid)
        self.slots[slot] = job
      if pages:
        self.tables[slot, : len(pages)] = pages
        self._tables_dirty = True
      copies.append((cow[1], pages[-1]) if cow[2] else (NULL_PAGE, NULL_PAGE))
      restore.append(self.prefix.snapshot(cow[0] if cow[2] else hit[-1][0]) if (hit or cow[2]) and hybrid else -1)
      joined.append(job)
    self.waiting.extendleft(reversed(deferred))  # their places in line
    self._deferred = len(deferred)
    if not joined:
      return
    n, c = self.max_slots, self.capacity
    rows = np.full(n, n, np.int32)
    tokens = np.zeros((n, c), np.int32)
    max_new, num_generated, seq_ids = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    lengths = np.zeros(n, np.int32)
    params = [SamplingParams()] * n
    eos = np.full((n, len(self.eos)), -1, np.int32)
    for i, job in enumerate(joined):
      r = job.request
      rows[i] = job.slot
      tokens[i, : len(job.todo)] = job.todo
      max_new[i], num_generated[i], seq_ids[i] = r.max_tokens, len(job.generated), r.seq_id
      lengths[i] = job.prefilled  # a cached prefix: every cache of the row starts past it
      params[i] = r.sampling
      if not r.ignore_eos:
        eos[i] = self.eos
    sampling = RowSampling.of(params)
    copy = np.zeros((n, 2), np.int32)
    copy[: len(copies)] = copies
    snaps = np.full(n, -1, np.int32)
    snaps[: len(restore)] = restore
    restored = (self.snapshots, snaps) if self.snapshots is not None else ()
    args = (self.state, self.fresh, rows, tokens, max_new, num_generated, seq_ids, sampling, eos, copy, restored)
    self.state = self._call('admit', slots.admit, args + (lengths,))

  def _prefix_in_flight(self, todo: list[int]) -> int:
    """Pages of `todo` a slot still prefilling will cache when its prompt is in (0: none): a request that would
    find more there than cached now waits for it instead of prefilling the same tokens beside it."""
    if not self._in_flight:
      return 0
    keys = self.prefix.chain(todo, self._matchable_pages(todo))
    return max((i for i, key in enumerate(keys, 1) if key in self._in_flight), default=0)  # a key names its prefix

  def _fly(self, job: _Job, hit: int) -> None:
    """Counts the pages past `hit` a joining job caches when its prompt is in (hybrids: those with a snapshot)."""
    ps, todo = self.page_size, job.todo
    n = min(self.prefix.full_pages(len(todo)), max(len(todo) - self.prefix_trail, 0) // ps)
    keys = list(enumerate(self.prefix.chain(todo, n), 1))[hit:]
    if self.snapshots is not None:
      last = self._matchable_pages(todo)
      keys = [(i, key) for i, key in keys if i % self.snapshot_every == 0 or i == last]
    job.in_flight = [key for _, key in keys]
    self._in_flight.update(job.in_flight)

  def _land(self, job: _Job) -> None:
    """The job's prompt is in (or it left): its pages are no longer in flight."""
    self._in_flight.subtract(job.in_flight)
    for key in job.in_flight:
      if self._in_flight[key] <= 0:
        del self._in_flight[key]
    job.in_flight = []

  def _grow(self, job: _Job, tokens: int) -> None:
    """Pages for `tokens` positions of the job's slot, preempting the newest jobs while the pool is short."""
    while True:
      try:
        with self._lock:
          pages = self.allocator.extend(job.slot, min(tokens, self.capacity))
        break
      except OutOfPagesError:
        if self.prefix and self.prefix.evictable:  # cached pages no request holds go first
          short = self.pages_for(min(tokens, self.capacity)) - int((self.tables[job.slot] != NULL_PAGE).sum())
          with self._lock:
            freed = self.prefix.evict(max(short - self.allocator.free_pages, 1))
            self.allocator.give(freed)
          if freed:
            continue
        victim = max((j for j in self.slots if j), key=lambda j: j.order)
        self._preempt(victim)
        if victim is job:
          return
    self.tables[job.slot, : len(pages)] = pages
    self._tables_dirty = True

  def _preempt(self, job: _Job) -> None:
    self._free(job)
    job.first_pending = False  # a first token not yet streamed is drawn again, the same, after the recompute
    job.handle.stats.preemptions += 1
    with self._lock:
      self.counters['preemptions'] += 1
    self.waiting.appendleft(job)

  # prefill

  def _prefill(self):
    joining = sorted((j for j in self.slots if j and not j.active), key=lambda j: j.order)
    budget, batch = self.prefill_budget, []
    for job in joining:
      if budget <= 0:
        break
      q = min(len(job.todo) - job.prefilled, budget, self.engine.prefill_chunk)
      if self.snapshots is not None:  # a hybrid's chunk ends on the first snapshot point it reaches
        q = (self._snapshot_point(job, job.prefilled, job.prefilled + q) or job.prefilled + q) - job.prefilled
      batch.append((job, q))
      budget -= q
    for job, q in batch:
      if job.slot >= 0:  # not preempted by an earlier job's growth
        self._grow(job, job.prefilled + q + (self.lookahead if job.prefilled + q == len(job.todo) else 0))
    batch = [(job, q) for job, q in batch if job.slot >= 0]  # a job may have preempted itself
    if not batch:
      return None
    self._push_tables()
    outs, snap_rows, snap_slots = [], [], []
    for job, q in batch:  # one row a call: the chunk is the batch (executables: one per chunk bucket)
      chunk = self.engine.prefill_chunk  # the chunks `_shapes` lists: the buckets below it, and it
      pad = 0 if job.cached else self.prefill_pad  # a row past a cached prefix prefills its rest in its own bucket
      t = min(next((b for b in PREFILL_BUCKETS if b >= max(q, pad)), chunk), chunk)
      tokens = np.zeros((1, t), np.int32)
      tokens[0, :q] = job.todo[job.prefilled : job.prefilled + q]
      job.prefilled += q
      finish = job.prefilled == len(job.todo)
      if finish:  # active on the device after this call: the round's step already runs it
        job.active, job.length, job.first_pending = True, len(job.todo), True
        self._land(job)
      static = {
          'drafter': self.drafter,
          'greedy': job.request.sampling.is_greedy,
          'hidden_size': self.model.config.hidden_size,
      }
      args = (
          self.drafter.params() if self.drafter else (),
          self.state,
          np.array([job.slot], np.int32),
          tokens,
          np.array([q], np.int32),
          np.array([finish]),
      )
      if job.matcher is not None:  # the first token under the grammar's mask
        args += (RowGrammars(self.model, [job.matcher]).bitmask(np.array([finish])),)
      name = 'prefill' if job.matcher is None else 'prefill_grammar'
      self.state, out = self._call(name, slots.prefill_rows, args, static, donate=(2,))
      outs.append(out)
      slot = self._new_snapshot(job, q)
      if slot >= 0:
        snap_rows.append(job.slot)
        snap_slots.append(slot)
      if finish and self.prefix:  # its prompt's pages serve the requests that join while it runs
        with self._lock:
          self._register(job, job.length)
    if snap_rows:  # one call for the round's snapshots
      self._take_snapshots(snap_rows, snap_slots)
    self._prefill_batch = batch
    return outs

  def _new_snapshot(self, job: _Job, q: int) -> int:
    """A pool slot for the state a hybrid row's chunk of q tokens ended on, when it ended on a snapshot point
    the index lacks (-1: none)."""
    pages = job.prefilled // self.page_size
    if self.snapshots is None or self._snapshot_point(job, job.prefilled - q, job.prefilled) != job.prefilled:
      return -1
    with self._lock:
      if self.prefix.snapshot(self.prefix.chain(job.todo, pages)[-1]) >= 0:
        return -1
      slot = self.prefix.new_snapshot()
      if slot < 0 and job.snaps:  # the pool holds only this row's own: a later point is worth more
        slot = job.snaps.pop(min(job.snaps))
      if slot >= 0:
        job.snaps[pages] = slot
    return slot

  def _after_prefill(self, outs) -> None:
    for (job, _), (tokens, active, logprobs) in zip(self._prefill_batch, outs):
      if not job.first_pending:
        continue
      job.first_pending = False
      if job.handle.stats.first_token is None:
        job.handle.stats.first_token = time.perf_counter()
      if job.matcher is not None:
        RowGrammars(self.model, [job.matcher]).commit(tokens[:1, None], np.ones(1, np.int32))
      self._emit(job, [int(tokens[0])], [float(logprobs[0])], bool(active[0]))

  # steps

  def _step(self):
    # A constrained request steps from the round after its first token: its matcher must have consumed it.
    live = [j for j in self.slots if j and j.active and not (j.matcher is not None and j.first_pending)]
    if not live:
      return None
    slots_ = [j.slot for j in live]
    k_step = self.policy.choose(self.pstate, len(live), self.pending[slots_]) if self.policy else 0
    depths = np.array([k_step if j.request.num_draft is None else j.request.num_draft for j in live], np.int32)
    deepest = int(depths.max())
    k_exec = min((k for k in self.step_depths if k >= deepest), default=deepest) if deepest else 0
    if deepest and (self.drafter.drafts_ahead or self.drafter.forced_only):
      pending = self.pending[slots_] if self.drafter.drafts_ahead else np.zeros(len(live), np.int32)
      if self.drafter.forced_first:  # grammar-forced runs are known on the host: verify as wide as they need
        every = np.ones(len(live), bool)
        pending = np.maximum(pending, RowGrammars(self.model, [j.matcher for j in live]).forced_lens(k_exec, every))
      k_exec = step_depth(k_exec, int(pending.max()))
    for job in live:
      if job.slot >= 0:
        self._grow(job, job.length + (self.drafter.lookahead(k_exec) if k_exec else 1))
    keep = [i for i, j in enumerate(live) if j.slot >= 0 and j.active]  # growth may preempt
    if not keep:
      return None
    live, depths = [live[i] for i in keep], depths[keep]
    self._push_tables()
    r = next(b for b in self._row_buckets if b >= len(live))
    rows = np.full(r, self.max_slots, np.int32)
    rows[: len(live)] = [j.slot for j in live]
    depths = np.pad(depths, (0, r - len(live)))
    greedy = all(j.request.sampling.is_greedy for j in live)
    self._step_live, self._step_k, self._step_depths = live, (k_step, k_exec, deepest), depths
    grammars = None
    if any(j.matcher is not None for j in live):
      grammars = RowGrammars(self.model, [j.matcher for j in live], r)
      grammars.active = np.arange(r) < len(live)
    self._step_grammars = grammars
    if not deepest:
      bitmask = None if grammars is None else grammars.bitmask(grammars.active)
      name, args, static = self._decode_call(rows, greedy, bitmask)
      self.state, out = self._call(name, slots.decode_rows, args, static)
      return out
    static = {'drafter': self.drafter, 'k': k_exec, 'greedy': greedy}
    dparams = self.drafter.params()
    if grammars is None and not self.engine.profile:
      self.state, out = self._call('spec', slots.spec_rows, (dparams, self.state, rows, depths), static, donate=(2,))
      return out
    if grammars is None:  # profiled: the draft and the verify executables, a host sync after each
      t = time.perf_counter()
      self.state, prop = self._call('propose', slots.propose_rows, (dparams, self.state, rows, depths), static, (2,))
      jax.block_until_ready(prop.drafts)
      t_mid = time.perf_counter()
      args = (dparams, self.state, rows, prop, None)
      self.state, out = self._call('verify', slots.verify_rows, args, static, donate=(2,))
      jax.block_until_ready(out[0])
      self._phase_s = (t_mid - t, time.perf_counter() - t_mid)
      return out
    # Constrained rows: draft, cut and mask on the host (`specjax.grammar.rows`), then verify.
    self.state, prop = self._call('propose', slots.propose_rows, (dparams, self.state, rows, depths), static, (2,))
    drafts, draft_lens, parents = jax.device_get((prop.drafts, prop.draft_lens, prop.parents))
    forced_first = self.drafter.forced_first
    inputs = grammars.step(drafts, draft_lens, grammars.active, forced_first=forced_first, parents=parents)
    args = (dparams, self.state, rows, prop, inputs)
    self.state, out = self._call('verify_grammar', slots.verify_rows, args, static, donate=(2,))
    return out

  def _after_step(self, outs, dt: float, before: np.ndarray, priced: bool = True) -> None:
    """Streams a step's tokens; outputs are indexed by the job's place in the step's rows. `priced`: `dt` is the
    step's time alone (a round that also prefilled is not shown to the policy: its time is not the step's)."""
    live, (k_step, k_exec, deepest) = self._step_live, self._step_k
    self.counters['steps'] += 1
    grammars = self._step_grammars
    if grammars is not None:  # each constrained row's matcher takes what the row emitted
      if deepest:
        grammars.commit(np.asarray(outs[0]), np.asarray(outs[1]), np.asarray(outs[2]))
        for job, forced in zip(live, grammars.forced):
          job.handle.stats.forced_drafted += forced.drafted
          job.handle.stats.forced_accepted += forced.accepted
          with self._lock:
            self.counters['forced_drafted'] += forced.drafted
            self.counters['forced_accepted'] += forced.accepted
      else:
        grammars.commit(np.asarray(outs[0])[:, None], grammars.active.astype(np.int32))
      self.grammar_s += grammars.host_s
    if self.step_log is not None:
      self.step_log.append((k_step if deepest else 0, dt, len(live)))
    if not deepest:
      tokens, active, logprobs = outs
      for i, job in enumerate(live):
        if job.slot >= 0:  # not finished by its first token this round
          if self.prefix_trail and job.drafter_upto < 0:  # a drafter's own caches miss what a plain step decodes
            job.drafter_upto = job.length
          job.length += 1
          self._emit(job, [int(tokens[i])], [float(logprobs[i])], bool(active[i]))
      if self.policy and priced and not k_step:  # the policy turned speculation off: it learns a plain step's cost
        none = np.zeros(len(live), np.int32)
        self.pstate = self.policy.observe(self.pstate, 0, none, dt, len(live), none, 1, None)
      return
    tokens, emitted, accepted, drafted, active, drafts, logprobs = outs
    n = len(live)
    slots_ = np.array([j.slot for j in live])
    tree, ahead = bool(self.drafter.tree_tokens), self.drafter.drafts_ahead
    for i, job in enumerate(live):
      e = int(emitted[i])
      if job.slot < 0:
        continue
      d = min(int(drafted[i]), k_exec) if tree else int(drafted[i])
      if self._step_depths[i] and e:
        stats = job.handle.stats
        stats.drafted += d
        stats.accepted += int(accepted[i])
        stats.spec_steps += 1
        if stats.spec is not None:
          pending = int(before[job.slot]) if ahead else None
          stats.spec.record(int(accepted[i]), d, e, pending, int(drafted[i]) if tree else None)
          if self.engine.profile:
            stats.spec.draft_s += self._phase_s[0]
            stats.spec.verify_s += self._phase_s[1]
        if stats.trace is not None:
          entry = {'k': int(self._step_depths[i]), 'drafts': drafts[i, : int(drafted[i])].tolist()}
          stats.trace.append(entry | {'accepted': int(accepted[i]), 'emitted': tokens[i, :e].tolist()})
        with self._lock:
          self.counters['drafted'] += d
          self.counters['accepted'] += int(accepted[i])
          self.counters['spec_steps'] += 1
          for p in range(min(d, len(self.drafted_at))):
            self.drafted_at[p] += 1
          for p in range(min(int(accepted[i]), len(self.accepted_at))):
            self.accepted_at[p] += 1
      job.length += e
      self._emit(job, tokens[i, :e].tolist(), logprobs[i, :e].tolist(), bool(active[i]))
    if self.policy and priced and k_step:  # (K = 0 with rows that set their own depth: its choice did not run)
      self.pstate = self.policy.observe(
          self.pstate,
          k_step,
          accepted[:n],
          dt,
          n,
          drafted[:n],
          k_exec + 1,
          before[slots_] if self.drafter.drafts_ahead else None,
      )

  def _emit(self, job: _Job, tokens: list[int], logprobs: list[float], still_active: bool) -> None:
    """Streams a job's new tokens; finishes it on EOS, its budget, or a stop string."""
    job.generated += tokens
    job.logprobs += logprobs
    with self._lock:
      self.counters['generated_tokens'] += len(tokens)
    for t in tokens:
      job.text += job.decoder.step(t)
    stops = job.request.stop
    if not still_active:
      job.text += job.decoder.flush()
    cut = min((i for i in (job.text.find(s, max(0, job.sent - len(s))) for s in stops) if i >= 0), default=-1)
    if cut >= 0:
      job.text = job.text[:cut]
      self._finish(job, 'stop', tokens, logprobs, deactivate=still_active)
      return
    if not still_active:
      eos = bool(job.generated) and job.generated[-1] in self.eos and not job.request.ignore_eos
      self._finish(job, 'stop' if eos else 'length', tokens, logprobs, deactivate=False)
      return
    end = len(job.text) - _holdback(job.text, stops)
    text, job.sent = job.text[job.sent : end], max(job.sent, end)
    lp = logprobs if job.request.logprobs else None
    job.handle.put(Event(tokens, text, lp, None, time.perf_counter()))
