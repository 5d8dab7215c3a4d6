"""`GET /metrics`: the server's measurements in the Prometheus text format (version 0.0.4), written by hand.

The app times every request it streams (`RequestTimer`): time to first token (TTFT) from submission to the first
event with tokens, and inter-token latency (ITL), each later event's gap spread evenly over its tokens (a
speculative step that emits 3 tokens after 30 ms counts three 10 ms gaps). The scheduler's own counters
(`Scheduler.metrics()`) are read at each scrape.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time

CONTENT_TYPE = 'text/plain; version=0.0.4; charset=utf-8'
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
THROUGHPUT_WINDOW_S = 10.0  # specjax_generation_tokens_per_second averages over this


class Histogram:
  """Cumulative buckets, a sum and a count (what a Prometheus histogram exposes)."""

  def __init__(self, buckets=LATENCY_BUCKETS):
    self.buckets = tuple(buckets)
    self.counts = [0] * (len(self.buckets) + 1)  # the last one: +Inf
    self.sum = 0.0
    self.count = 0

  def observe(self, value: float, times: int = 1) -> None:
    self.counts[bisect.bisect_left(self.buckets, value)] += times
    self.sum += value * times
    self.count += times

  def lines(self, name: str) -> list[str]:
    out, total = [], 0
    for le, n in zip([*map(_num, self.buckets), '+Inf'], self.counts):
      total += n
      out.append(f'{name}_bucket{{le="{le}"}} {total}')
    return out + [f'{name}_sum {_num(self.sum)}', f'{name}_count {self.count}']


class ServeMetrics:
  """What the app measures itself; `render(scheduler.metrics())` is the whole /metrics page."""

  def __init__(self):
    self.lock = threading.Lock()
    self.ttft = Histogram()
    self.itl = Histogram()
    self.latency = Histogram(REQUEST_BUCKETS)
    self.finished = collections.Counter()  # finish reason -> requests
    self.rejected = 0  # requests refused before scheduling (400, 404, 413)
    self.recent = collections.deque()  # (time, tokens) of the last THROUGHPUT_WINDOW_S

  def timer(self, submitted: float) -> RequestTimer:
    return RequestTimer(self, submitted)

  def tokens_per_s(self, now: float) -> float:
    while self.recent and self.recent[0][0] < now - THROUGHPUT_WINDOW_S:
      self.recent.popleft()
    return sum(n for _, n in self.recent) / THROUGHPUT_WINDOW_S

  def render(self, snap: dict) -> str:
    """The exposition text: this app's histograms and counters, then the scheduler's snapshot `snap`."""
    out = []

    def metric(name, kind, help, samples):
      out.extend([f'# HELP {name} {help}', f'# TYPE {name} {kind}'])
      out.extend(f'{name}{_labels(labels)} {_num(v)}' for labels, v in samples)

    with self.lock:
      for name, hist, help in (
          ('specjax_time_to_first_token_seconds', self.ttft, 'Time from submission to the first token.'),
          ('specjax_inter_token_latency_seconds', self.itl, 'Gap between tokens (a step spread over its tokens).'),
          ('specjax_request_latency_seconds', self.latency, 'Time from submission to the last token.'),
      ):
        out.extend([f'# HELP {name} {help}', f'# TYPE {name} histogram', *hist.lines(name)])
      metric(
          'specjax_requests_total',
          'counter',
          'Requests finished, by finish reason (stop, length, cancelled).',
          [({'finish_reason': r}, self.finished[r]) for r in sorted({'stop', 'length', 'cancelled', *self.finished})],
      )
      metric('specjax_requests_rejected_total', 'counter', 'Requests refused before scheduling.', [({}, self.rejected)])
      throughput = self.tokens_per_s(time.perf_counter())
    metric(
        'specjax_generation_tokens_per_second',
        'gauge',
        f'Tokens streamed per second over the last {THROUGHPUT_WINDOW_S:g} s.',
        [({}, throughput)],
    )
    counters = (
        ('prompt_tokens', 'specjax_prompt_tokens_total', 'Prompt tokens prefilled.'),
        ('generated_tokens', 'specjax_generation_tokens_total', 'Tokens generated (rate() gives tokens/s).'),
        ('preemptions', 'specjax_preemptions_total', 'Requests preempted to free KV pages.'),
        ('steps', 'specjax_scheduler_steps_total', 'Scheduler steps (target forwards of the batch).'),
        ('requests_finished', 'specjax_scheduler_requests_finished_total', 'Requests the scheduler finished.'),
        ('requests_cancelled', 'specjax_scheduler_requests_cancelled_total', 'Requests the scheduler cancelled.'),
        ('prefix_lookup_tokens', 'specjax_prefix_cache_queries_total', 'Prompt tokens looked up in the prefix cache.'),
        ('prefix_hit_tokens', 'specjax_prefix_cache_hits_total', 'Prompt tokens found in the prefix cache.'),
        ('prefix_evictions', 'specjax_prefix_cache_evictions_total', 'Cached KV pages evicted.'),
        ('prefix_copied_pages', 'specjax_prefix_cache_copied_pages_total', 'Cached pages copied on write.'),
        ('prefix_restored', 'specjax_prefix_cache_restored_total', 'Hybrid rows started from a state snapshot.'),
        ('forced_drafted', 'specjax_grammar_forced_drafts_total', 'Grammar-forced draft tokens verified.'),
        ('forced_accepted', 'specjax_grammar_forced_accepted_total', 'Grammar-forced draft tokens accepted.'),
    )
    for key, name, help in counters:
      metric(name, 'counter', help, [({}, snap.get(key, 0))])
    gauges = (
        ('live_slots', 'specjax_live_slots', 'Requests in the running batch.'),
        ('max_slots', 'specjax_max_slots', 'Batch slots.'),
        ('waiting', 'specjax_waiting_requests', 'Requests queued for a slot.'),
        ('free_pages', 'specjax_free_pages', 'KV cache pages a request can get (free, or cached and unused).'),
        ('prefix_cached_pages', 'specjax_prefix_cache_pages', 'KV pages held by the prefix cache.'),
        ('prefix_snapshots', 'specjax_prefix_cache_snapshots', 'Recurrent-state snapshots in the prefix cache.'),
        ('total_pages', 'specjax_total_pages', 'KV cache pages.'),
    )
    for key, name, help in gauges:
      metric(name, 'gauge', help, [({}, snap.get(key, 0))])
    drafter = snap.get('drafter')
    if drafter:
      d = {'drafter': drafter}
      spec_steps, accepted = snap.get('spec_steps', 0), snap.get('accepted', 0)
      metric('specjax_draft_tokens_total', 'counter', 'Draft tokens verified.', [(d, snap.get('drafted', 0))])
      metric('specjax_accepted_tokens_total', 'counter', 'Draft tokens accepted.', [(d, accepted)])
      metric(
          'specjax_spec_steps_total',
          'counter',
          'Request-steps in draft-verify passes with speculation on (some may have found no drafts).',
          [(d, spec_steps)],
      )
      metric(
          'specjax_tau',
          'gauge',
          'Tokens per verify pass: 1 + accepted / spec steps.',
          [(d, 1.0 + accepted / spec_steps if spec_steps else 1.0)],
      )
      drafted_at, accepted_at = snap.get('drafted_at') or [], snap.get('accepted_at') or []
      at = lambda counts: [({**d, 'position': str(i + 1)}, n) for i, n in enumerate(counts)]
      metric('specjax_position_drafted_total', 'counter', 'Steps that drafted position i (1-based).', at(drafted_at))
      metric('specjax_position_accepted_total', 'counter', 'Steps that accepted position i.', at(accepted_at))
      metric(
          'specjax_position_acceptance',
          'gauge',
          'P(draft position i accepted) over the steps that drafted position i (1-based).',
          [
              ({**d, 'position': str(i + 1)}, (accepted_at[i] if i < len(accepted_at) else 0) / n)
              for i, n in enumerate(drafted_at)
              if n
          ],
      )
    return '\n'.join(out) + '\n'


class RequestTimer:
  """TTFT, ITL and latency of one request, fed its events in order (`timer(event)`)."""

  def __init__(self, metrics: ServeMetrics, submitted: float):
    self.metrics, self.submitted, self.last = metrics, submitted, None

  def __call__(self, event) -> None:
    m, n = self.metrics, len(event.tokens)
    with m.lock:
      if n:
        m.recent.append((event.time, n))
        if self.last is None:
          m.ttft.observe(max(event.time - self.submitted, 0.0))
        else:
          m.itl.observe(max(event.time - self.last, 0.0) / n, n)
        self.last = event.time
      if event.finish_reason is not None:
        m.finished[event.finish_reason] += 1
        m.latency.observe(max(event.time - self.submitted, 0.0))


def _labels(labels: dict) -> str:
  if not labels:
    return ''
  esc = lambda v: str(v).replace('\\', '\\\\').replace('"', '\\"').replace('\n', '\\n')
  return '{' + ','.join(f'{k}="{esc(v)}"' for k, v in labels.items()) + '}'


def _num(x: float) -> str:
  if isinstance(x, float) and math.isinf(x):
    return '+Inf' if x > 0 else '-Inf'
  return repr(float(x)) if isinstance(x, float) else str(x)
