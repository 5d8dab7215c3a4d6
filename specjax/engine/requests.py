"""Requests to the continuous-batching scheduler and the streams that answer them.

A `Request` is token ids plus its own sampling settings, token budget, stop
strings and speculation setting. `Scheduler.submit(request)` checks it (a
`SpecjaxError` before anything is scheduled) and returns a `RequestHandle`:
the scheduler thread pushes `Event`s into it, and the caller reads them as an
async stream (`async for event in handle`), a blocking one (`handle.events()`)
or all at once (`handle.result()`). `handle.cancel()` frees the request's slot
and pages at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Iterator

from specjax.metrics import SpecMetrics
from specjax.sampling import SamplingParams

_ids = itertools.count()


@dataclasses.dataclass
class Request:
  """One generation request.

  `num_draft`: None follows the scheduler's depth policy, 0 turns speculation
  off for this request (it rides the plain decode path, or a verify pass that
  checks no drafts), K > 0 caps its draft depth at K. Draws are keyed by
  (sampling.seed, seq_id, position), so a request with the same seed and
  seq_id gives the same tokens alone, in any batch, and offline
  (`Engine.generate(..., request_ids=[seq_id])`); choice j of an `n`-choice
  request uses seq_id j.
  """

  prompt: list[int]  # token ids
  max_tokens: int = 64
  sampling: SamplingParams = SamplingParams()
  num_draft: int | None = None
  stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
  seq_id: int = 0
  logprobs: bool = False  # each event carries the target's log-probability of its tokens
  ignore_eos: bool = False
  trace: bool = False  # record every speculative step in `stats.trace`
  id: str = dataclasses.field(default_factory=lambda: f'req-{next(_ids)}')


@dataclasses.dataclass
class Event:
  """A piece of one request's output: tokens made final at one step, and their text."""

  tokens: list[int]
  text: str  # text these tokens complete (a stop string and what follows it are cut)
  logprobs: list[float] | None = None  # per token, when the request asked for them
  finish_reason: str | None = None  # 'stop' (EOS or a stop string), 'length', 'cancelled'; None: more follow
  time: float = 0.0  # time.perf_counter() when the scheduler produced it


@dataclasses.dataclass
class RequestStats:
  prompt_tokens: int = 0
  completion_tokens: int = 0
  drafted: int = 0  # draft tokens verified for this request
  accepted: int = 0
  spec_steps: int = 0  # verify passes this request took part in with drafts
  forced_drafted: int = 0  # grammar-forced drafts verified (constrained requests, `grammar+<family>`)
  forced_accepted: int = 0
  preemptions: int = 0
  submitted: float = 0.0  # perf_counter times
  first_token: float | None = None
  finished: float | None = None
  spec: SpecMetrics | None = None  # per-step acceptance (speculative requests on a scheduler with a drafter)
  trace: list[dict] | None = None  # `Request.trace`: {'k', 'drafts', 'accepted', 'emitted'} per speculative step

  @property
  def tau(self) -> float:
    """Tokens per verify pass: 1 + accepted / spec steps (1.0 without speculation)."""
    return 1.0 + self.accepted / self.spec_steps if self.spec_steps else 1.0


@dataclasses.dataclass
class Result:
  tokens: list[int]
  text: str
  finish_reason: str
  logprobs: list[float] | None
  stats: RequestStats


class RequestHandle:
  """The stream of one request's events, fed by the scheduler thread."""

  def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
    self.request = request
    self.stats = RequestStats(prompt_tokens=len(request.prompt), submitted=time.perf_counter())
    self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
    self._loop = loop
    self._async: asyncio.Queue[Event] | None = asyncio.Queue() if loop else None
    self.cancelled = threading.Event()
    self.done = threading.Event()
    self._seen: list[Event] = []  # events read through `events` / `result`
    self._ended = False

  @property
  def id(self) -> str:
    return self.request.id

  def cancel(self) -> None:
    """Asks the scheduler to drop this request at its next step (its slot and pages are freed)."""
    self.cancelled.set()

  # -- scheduler side

  def put(self, event: Event) -> None:
    if event.finish_reason is not None:
      self.stats.finished = event.time
      self.done.set()
    if self._async is not None:
      self._loop.call_soon_threadsafe(self._async.put_nowait, event)
    else:
      self._queue.put(event)

  # -- caller side

  def __aiter__(self) -> AsyncIterator[Event]:
    return self._aiter()

  async def _aiter(self) -> AsyncIterator[Event]:
    if self._async is None:
      raise RuntimeError('submit(..., loop=...) the request from an event loop to read it asynchronously')
    while True:
      event = await self._async.get()
      yield event
      if event.finish_reason is not None:
        return

  def ready(self) -> list[Event]:
    """The events already pushed and not read yet, without waiting (a blocking stream)."""
    out = []
    while not self._ended and not self._queue.empty():
      event = self._queue.get()
      self._seen.append(event)
      self._ended = event.finish_reason is not None
      out.append(event)
    return out

  def events(self, timeout: float | None = None) -> Iterator[Event]:
    """Blocking iteration over the events not read yet (requests submitted without an event loop)."""
    while not self._ended:
      event = self._queue.get(timeout=timeout)
      self._seen.append(event)
      self._ended = event.finish_reason is not None
      yield event

  def result(self, timeout: float | None = None) -> Result:
    """Waits for the end; the whole output (the events read before included)."""
    for _ in self.events(timeout):
      pass
    tokens, logprobs = [t for e in self._seen for t in e.tokens], [x for e in self._seen for x in e.logprobs or []]
    text = ''.join(e.text for e in self._seen)
    reason = self._seen[-1].finish_reason
    return Result(tokens, text, reason, logprobs if self.request.logprobs else None, self.stats)
