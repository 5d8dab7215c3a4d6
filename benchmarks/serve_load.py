"""Serving under load: `specjax serve` (AR, n-gram, EAGLE-3, the load policy) against llama.cpp's server.

  python benchmarks/serve_load.py [-m gemma-3-270m] [--prompts 32] [--max-tokens 128]
      [--concurrency 1 2 4 8 16 32] [--arrival closed|poisson --rate R] [--arms ar ngram eagle3 load llamacpp
      llamacpp-ngram] [--ngram-k 4] [--eagle3 PATH] [--max-slots N | --slots-per-level] [--slo-ttft 2
      --slo-tpot 0.2] [--out PREFIX]

Every arm is a fresh server on a free loopback port, started as a subprocess, waited for through GET /health
and stopped after its levels (`--slots-per-level`: a fresh server per level, sized to it): `specjax serve` for
the specjax arms; for llama.cpp, this file in worker mode (`--llamacpp-worker`), which holds an
`xllamacpp.Server` (llama.cpp's own C++ server) on the same GGUF. The client is the `openai` AsyncOpenAI
client, streaming `/v1/completions` (or `/v1/chat/completions`, `--api chat`) with
`stream_options.include_usage`, temperature 0 and the same `max_tokens` for every arm.

Prompts: the first turn of a category-balanced subset of Spec-Bench `question.jsonl` (`bench.load_prompts`,
as `specjax bench` reads it): one prompt per category in turn, categories in sorted order, file order within
each. At each concurrency level C the arm runs untimed warm-up passes over the prompts at C (`--warmup-passes`:
the specjax server compiles each executable on first use), then the timed pass: closed loop (C workers, each
sending its next prompt when its last one finished) or Poisson arrivals at `--rate` requests/s with at most C in
flight (vLLM's `--request-rate` with `--max-concurrency`).

Metrics follow vLLM's benchmark_serving: output tokens from the usage chunk; TTFT (send to the first chunk that
carries a token); TPOT per request, (e2e - TTFT) / (output tokens - 1); ITL, the gaps between streamed chunks,
a chunk of n tokens counting its gap / n n times (specjax requests ask for `logprobs=0`, whose per-token list
gives each chunk's token count exactly; llama.cpp streams one token per chunk, checked against the usage);
e2e latency; p50 / p99 of each; throughput (output tokens / wall time of the timed pass); goodput (requests
meeting --slo-ttft and --slo-tpot, per second). τ, acceptance and preemptions are the differences of the
server's /metrics counters across the timed pass. Speedup is an arm's throughput over its own engine's AR arm
at the same concurrency; `identical` counts the prompts whose text equals that AR arm's (temperature 0). The
specjax servers run with JAX_LOG_COMPILES=1: warm-up passes repeat (at most `--extra-warmup-passes` more) while
a pass still compiled an executable, a timed pass that compiled is run again (at most `--timed-retries` times;
which prefill batch shapes a pass meets depends on when its requests reach the scheduler), and compiles left in
the kept pass are counted in its record.

Writes PREFIX.json (every arm x level, the command line, the machine, versions, git commit; rewritten after each
level) and PREFIX.png (speedup and throughput against concurrency), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARMS = ('ar', 'ngram', 'eagle3', 'load', 'llamacpp', 'llamacpp-ngram')
COMPILE_LINE = re.compile(r'Finished XLA compilation of (\S+) in ([0-9.eE+-]+) sec')  # jax_log_compiles
HEAVY_COMPILE_S = 0.1  # below this a compile is a scalar op, not one of the model's executables


@dataclasses.dataclass
class Arm:
  name: str
  engine: str  # 'specjax' or 'llamacpp'
  flags: list  # specjax: serve flags; llamacpp: the worker's config dict
  baseline: str  # the arm its speedup and identical counts are against
  note: str = ''


# -- prompts


def pick_prompts(n: int, path: str | None = None) -> list:
  """`n` Spec-Bench first turns, one category at a time (sorted), file order within each category."""
  from specjax import bench

  by_cat = collections.defaultdict(list)
  for p in bench.load_prompts(path):
    by_cat[p.category].append(p)
  cats, picked, i = sorted(by_cat), [], 0
  while len(picked) < n and any(by_cat.values()):
    cat = cats[i % len(cats)]
    if by_cat[cat]:
      picked.append(by_cat[cat].pop(0))
    i += 1
  return picked


# -- servers


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def gguf_path(model: str) -> str | None:
  """The GGUF file behind -m: the file itself, or the demo package's assembled file."""
  if model.endswith('.gguf') and os.path.isfile(model):
    return os.path.abspath(model)
  from specjax.loading.registry import DEMO_MODELS

  if model in DEMO_MODELS:
    path = DEMO_MODELS[model].path()
    return path if path.endswith('.gguf') else None
  return None


def specjax_command(flags: list) -> list:
  exe = os.path.join(os.path.dirname(sys.executable), 'specjax')
  if os.path.exists(exe):
    return [exe, 'serve', *flags]
  return [sys.executable, '-c', 'import sys; from specjax.cli import main; sys.exit(main())', 'serve', *flags]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
  try:
    with urllib.request.urlopen(url, timeout=timeout) as r:
      return r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, ''
  except (OSError, ValueError):
    return 0, ''


class Server:
  """One arm's server process on a free loopback port, its output in a log file."""

  def __init__(self, arm: Arm, args, log_dir: str, slots: int):
    self.arm, self.port = arm, free_port()
    self.url = f'http://127.0.0.1:{self.port}'
    if arm.engine == 'specjax':
      flags = [*arm.flags, '--max-slots', str(slots), '--host', '127.0.0.1', '--port', str(self.port)]
      self.command = specjax_command(flags)
    else:
      config = dict(arm.flags, parallel=slots, port=self.port)
      self.command = [sys.executable, os.path.abspath(__file__), '--llamacpp-worker', json.dumps(config)]
    self.log_path = os.path.join(log_dir, f'{arm.name}-{slots}.log')
    self.timeout = args.startup_timeout
    self.omp_wait_policy = args.omp_wait_policy
    self.proc = None

  def __enter__(self) -> Server:
    self.log = open(self.log_path, 'w')
    t = time.perf_counter()
    env = dict(os.environ)
    if self.arm.engine == 'specjax':
      env['JAX_LOG_COMPILES'] = '1'  # each compile logs a line: compiles inside a timed pass are counted
    if self.arm.engine == 'llamacpp' and self.omp_wait_policy:
      env['OMP_WAIT_POLICY'] = self.omp_wait_policy  # llama.cpp's CPU threads are OpenMP's
    self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    while get(self.url + '/health', timeout=2.0)[0] != 200:
      if self.proc.poll() is not None:
        self.stop()
        raise RuntimeError(f'{self.arm.name}: the server exited with {self.proc.returncode}:\n{self.tail()}')
      if time.perf_counter() - t > self.timeout:
        self.stop()
        raise RuntimeError(f'{self.arm.name}: no /health within {self.timeout:.0f} s:\n{self.tail()}')
      time.sleep(0.5)
    self.startup_s = time.perf_counter() - t
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signal.SIGINT)  # uvicorn and the worker both shut down on Ctrl-C
      try:
        self.proc.wait(30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.log.close()

  def tail(self, n: int = 30) -> str:
    if not self.log.closed:
      self.log.flush()
    with open(self.log_path, errors='replace') as f:  # without JAX_LOG_COMPILES' lines
      return ''.join([line for line in f if not line.startswith(('Compiling ', 'Finished '))][-n:])

  def log_size(self) -> int:
    return os.path.getsize(self.log_path)

  def compiles_since(self, offset: int) -> dict:
    """The XLA compiles the server logged after byte `offset` of its log: count, seconds, names."""
    with open(self.log_path, 'rb') as f:
      f.seek(offset)
      found = COMPILE_LINE.findall(f.read().decode(errors='replace'))
    return {
        'count': len(found),
        'seconds': sum(float(t) for _, t in found),
        'heavy': sum(float(t) >= HEAVY_COMPILE_S for _, t in found),
        'names': sorted({n for n, t in found if float(t) >= HEAVY_COMPILE_S}),
    }

  def metrics(self) -> dict:
    status, text = get(self.url + '/metrics')
    return parse_prometheus(text) if status == 200 else {}


def parse_prometheus(text: str) -> dict:
  """{'name{labels}': value} of a Prometheus text page (histograms' buckets included)."""
  out = {}
  for line in text.splitlines():
    if line and not line.startswith('#'):
      key, _, value = line.rpartition(' ')
      try:
        out[key] = float(value)
      except ValueError:
        pass
  return out


def spec_counters(engine: str, m: dict) -> dict:
  """The counters τ, acceptance and preemptions come from, by engine (None: the server does not expose it)."""
  if engine == 'specjax':
    pick = lambda prefix: sum(v for k, v in m.items() if k.startswith(prefix + '{') or k == prefix)
    return dict(
        accepted=pick('specjax_accepted_tokens_total'),
        drafted=pick('specjax_draft_tokens_total'),
        spec_steps=pick('specjax_spec_steps_total'),
        drafting_steps=sum(v for k, v in m.items() if k.startswith('specjax_position_drafted_total') and '"1"' in k),
        preemptions=m.get('specjax_preemptions_total'),
        steps=m.get('specjax_scheduler_steps_total'),
    )
  drafts = m.get('llamacpp:spec_decode_num_drafts_total')
  return dict(
      accepted=m.get('llamacpp:spec_decode_num_accepted_tokens_total'),
      drafted=m.get('llamacpp:spec_decode_num_draft_tokens_total'),
      spec_steps=drafts,  # llama.cpp counts the steps that drafted
      drafting_steps=drafts,
      preemptions=None,
      steps=m.get('llamacpp:n_decode_total'),
  )


def counter_delta(before: dict, after: dict) -> dict:
  return {k: (after[k] - before[k]) if after.get(k) is not None and before.get(k) is not None else None for k in after}


# -- llama.cpp worker (this file, run by Server as a subprocess)


def llamacpp_worker(config: dict) -> None:
  """Holds an xllamacpp.Server (llama.cpp's HTTP server in this process) until SIGINT / SIGTERM."""
  import xllamacpp as xlc

  p = xlc.CommonParams()
  p.model.path = config['model']
  p.hostnames = ['127.0.0.1']
  p.port = config['port']
  p.n_parallel = config['parallel']
  p.n_ctx = config['ctx_per_slot'] * config['parallel']  # split evenly over the slots (kv_unified off)
  p.kv_unified = False
  p.cont_batching = True
  p.cpuparams.n_threads = config['threads']
  p.cpuparams_batch.n_threads = config['threads']
  p.endpoint_metrics = True
  p.cache_ram_mib = 0  # no host-memory prompt cache across requests (requests also send cache_prompt: false)
  if config.get('ngram'):
    p.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
    p.speculative.ngram_simple.size_n = config['ngram_n']  # the suffix n-gram looked up in the context
    p.speculative.ngram_simple.size_m = config['ngram_k']  # tokens drafted after a match
    p.speculative.ngram_simple.min_hits = 1
  stop = []
  signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
  signal.signal(signal.SIGINT, lambda *_: stop.append(1))
  server = xlc.Server(p)
  print(f'llama.cpp server at {server.listening_address}', flush=True)
  while not stop:
    time.sleep(0.2)
  del server


# -- client


@dataclasses.dataclass
class Result:
  prompt: int
  ok: bool = False
  error: str = ''
  ttft: float | None = None
  e2e: float | None = None
  output_tokens: int = 0
  prompt_tokens: int = 0
  chunk_tokens: int = 0
  itl: list = dataclasses.field(default_factory=list)
  text: str = ''

  @property
  def tpot(self) -> float | None:
    if not self.ok or self.output_tokens < 2:
      return None
    return (self.e2e - self.ttft) / (self.output_tokens - 1)


def chunk_tokens(choice, api: str, exact: bool) -> tuple[str, int]:
  """(text, tokens) of one streamed choice; tokens from its logprobs when the request asked for them."""
  if api == 'chat':
    text = (choice.delta.content or '') if choice.delta else ''
    lp = choice.logprobs.content if exact and choice.logprobs is not None else None
  else:
    text = choice.text or ''
    lp = choice.logprobs.tokens if exact and choice.logprobs is not None else None
  return text, (len(lp) if lp is not None else int(bool(text)))


async def one_request(client, args, arm: Arm, index: int, prompt: str, max_tokens: int) -> Result:
  res = Result(index)
  exact = arm.engine == 'specjax'  # specjax: logprobs give each chunk's token count
  extra = {'cache_prompt': False} if arm.engine == 'llamacpp' else {}
  if args.ignore_eos:
    extra['ignore_eos'] = True
  common = dict(
      model=args.served_name,
      max_tokens=max_tokens,
      temperature=0.0,
      stream=True,
      stream_options={'include_usage': True},
      extra_body=extra,
  )
  texts, last = [], None
  t0 = time.perf_counter()
  try:
    if args.api == 'chat':
      stream = await client.chat.completions.create(
          messages=[{'role': 'user', 'content': prompt}], **common, **({'logprobs': True} if exact else {})
      )
    else:
      stream = await client.completions.create(prompt=prompt, **common, **({'logprobs': 0} if exact else {}))
    async for chunk in stream:
      now = time.perf_counter()
      if chunk.usage is not None:
        res.output_tokens = chunk.usage.completion_tokens
        res.prompt_tokens = chunk.usage.prompt_tokens
      for choice in chunk.choices or ():
        text, n = chunk_tokens(choice, args.api, exact)
        texts.append(text)
        if not n:
          continue
        res.chunk_tokens += n
        if last is None:
          res.ttft = now - t0
        else:
          res.itl += [(now - last) / n] * n
        last = now
    res.e2e = time.perf_counter() - t0
    res.ok = res.ttft is not None and res.output_tokens > 0
    if not res.ok:
      res.error = 'no tokens streamed' if res.ttft is None else 'no usage chunk'
  except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
    res.error = f'{type(e).__name__}: {e}'[:300]
  res.text = ''.join(texts)
  return res


async def run_pass(url: str, args, arm: Arm, prompts: list, concurrency: int, max_tokens: int) -> tuple[list, float]:
  """One pass of `--num-requests` requests at `concurrency`; (results, wall seconds)."""
  import openai

  client = openai.AsyncOpenAI(base_url=url + '/v1', api_key='none', max_retries=0, timeout=args.request_timeout)
  total = args.num_requests or len(prompts)
  order = [i % len(prompts) for i in range(total)]
  results = []
  t0 = time.perf_counter()
  if args.arrival == 'closed':
    nxt = iter(order)

    async def worker():
      for i in nxt:
        results.append(await one_request(client, args, arm, i, prompts[i].text, max_tokens))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
  else:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i):
      async with gate:
        results.append(await one_request(client, args, arm, i, prompts[i].text, max_tokens))

    tasks = []
    for n, i in enumerate(order):
      if n:
        await asyncio.sleep(rng.expovariate(args.rate))
      tasks.append(asyncio.create_task(gated(i)))
    await asyncio.gather(*tasks)
  wall = time.perf_counter() - t0
  await client.close()
  return results, wall


# -- metrics


def percentiles(values: list) -> dict:
  import numpy as np

  if not values:
    return {'mean': None, 'p50': None, 'p99': None}
  a = np.asarray(values, float)
  return {'mean': float(a.mean()), 'p50': float(np.percentile(a, 50)), 'p99': float(np.percentile(a, 99))}


def summarize(results: list, wall: float, args, counters: dict) -> dict:
  ok = [r for r in results if r.ok]
  out_tokens = sum(r.output_tokens for r in ok)
  good = [r for r in ok if r.ttft <= args.slo_ttft and (r.tpot is None or r.tpot <= args.slo_tpot)]
  c = counters
  acc, steps, drafting = c.get('accepted'), c.get('spec_steps'), c.get('drafting_steps')
  return {
      'requests': len(results),
      'completed': len(ok),
      'failed': len(results) - len(ok),
      'errors': sorted({r.error for r in results if r.error})[:5],
      'duration_s': wall,
      'output_tokens': out_tokens,
      'prompt_tokens': sum(r.prompt_tokens for r in ok),
      'output_throughput': out_tokens / wall if wall else None,
      'request_throughput': len(ok) / wall if wall else None,
      'goodput': len(good) / wall if wall else None,
      'goodput_fraction': len(good) / len(results) if results else None,
      'ttft_s': percentiles([r.ttft for r in ok]),
      'tpot_s': percentiles([r.tpot for r in ok if r.tpot is not None]),
      'itl_s': percentiles([g for r in ok for g in r.itl]),
      'e2e_s': percentiles([r.e2e for r in ok]),
      'chunk_token_mismatches': sum(r.chunk_tokens != r.output_tokens for r in ok),
      'tau': 1 + acc / steps if acc is not None and steps else None,
      'tau_drafting': 1 + acc / drafting if acc is not None and drafting else None,
      'acceptance': acc / c['drafted'] if acc is not None and c.get('drafted') else None,
      'preemptions': c.get('preemptions'),
      'counters': c,
  }


# -- the run


def build_arms(args, gguf: str | None) -> tuple[list, list]:
  sj = ['-m', args.model, *shlex.split(args.specjax_args)]
  if args.served_name != args.model:
    sj += ['--served-model-name', args.served_name]
  k = str(args.ngram_k)
  lookup = ['--ngram-min', str(args.ngram_min)] if args.ngram_min else []
  lookup += ['--ngram-max', str(args.ngram_max)] if args.ngram_max else []
  arms = {
      'ar': Arm('ar', 'specjax', [*sj, '--no-spec'], 'ar'),
      'ngram': Arm('ngram', 'specjax', [*sj, '--drafter', 'ngram', *lookup, '--n-predict', k], 'ar'),
      'load': Arm(
          'load',
          'specjax',
          [*sj, '--drafter', 'ngram', *lookup, '--policy', 'load'],
          'ar',
          'full depth to 8 live, then 3',
      ),
  }
  if args.eagle3:
    flags = [*sj, '--drafter', 'eagle3', '--draft-model', args.eagle3]
    arms['eagle3'] = Arm(
        'eagle3', 'specjax', flags + (['--n-predict', str(args.eagle3_k)] if args.eagle3_k else []), 'ar'
    )
  if gguf:
    base = dict(model=gguf, ctx_per_slot=args.ctx_per_slot, threads=args.threads)
    arms['llamacpp'] = Arm('llamacpp', 'llamacpp', base, 'llamacpp')
    ngram = dict(base, ngram=True, ngram_n=args.llamacpp_ngram_n, ngram_k=args.ngram_k)
    arms['llamacpp-ngram'] = Arm('llamacpp-ngram', 'llamacpp', ngram, 'llamacpp', 'ngram-simple')
  chosen, skipped = [], []
  for name in args.arms:
    if name in arms:
      chosen.append(arms[name])
    else:
      skipped.append(name)
  return chosen, skipped


def machine_info() -> dict:
  cpu = ''
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), '')
  except OSError:
    pass
  mem = None
  try:
    with open('/proc/meminfo') as f:
      mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemTotal'))
  except (OSError, StopIteration):
    pass
  return {
      'cpu': cpu,
      'cpus': os.cpu_count(),
      'memory_bytes': mem,
      'platform': platform.platform(),
      'python': platform.python_version(),
      'loadavg_at_start': os.getloadavg(),
  }


def versions() -> dict:
  from specjax.provenance import package_versions

  out = package_versions(('openai', 'fastapi', 'uvicorn', 'xllamacpp'))
  try:
    import jax

    out['jax_backend'] = jax.default_backend()
  except Exception:  # noqa: BLE001
    out['jax_backend'] = None
  return out


def digest(text: str) -> str:
  return hashlib.sha1(text.encode()).hexdigest()[:12]


def add_comparisons(report: dict) -> None:
  """Speedup and identical outputs of every arm's levels against its baseline arm at the same concurrency."""
  arms = {a['name']: a for a in report['arms']}
  for arm in report['arms']:
    base = arms.get(arm['baseline'])
    for level in arm['levels']:
      ref = next((b for b in (base or {}).get('levels', []) if b['concurrency'] == level['concurrency']), None)
      if ref is None or not ref.get('output_throughput'):
        level['speedup'], level['identical'] = None, None
        continue
      level['speedup'] = level['output_throughput'] / ref['output_throughput']
      same = [p for p, h in level['outputs'].items() if ref['outputs'].get(p) == h]
      level['identical'] = f'{len(same)}/{len(level["outputs"])}'


def save(report: dict, prefix: str) -> None:
  add_comparisons(report)
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  tmp = prefix + '.json.tmp'
  with open(tmp, 'w') as f:
    json.dump(report, f, indent=1)
  os.replace(tmp, prefix + '.json')


def plot(report: dict, prefix: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for arm in report['arms']:
    levels = [lv for lv in arm['levels'] if lv.get('output_throughput')]
    if not levels:
      continue
    c = [lv['concurrency'] for lv in levels]
    style = '-o' if arm['engine'] == 'specjax' else '--s'
    color = f'C{ARMS.index(arm["name"]) % 10}'
    label = arm['name'] if arm['engine'] == 'specjax' else f'{arm["name"]} (llama.cpp)'
    ax2.plot(c, [lv['output_throughput'] for lv in levels], style, color=color, label=label)
    if arm['name'] != arm['baseline']:
      s = [(lv['concurrency'], lv['speedup']) for lv in levels if lv.get('speedup')]
      if s:
        ax1.plot(*zip(*s), style, color=color, label=f'{label} / {arm["baseline"]}')
  ax1.axhline(1.0, color='grey', lw=0.8)
  ax1.set(xscale='log', xlabel='concurrency', ylabel='output tok/s over AR (same engine)', title='speedup vs AR')
  ax2.set(xscale='log', xlabel='concurrency', ylabel='output tokens / s', title='throughput')
  for ax in (ax1, ax2):
    ax.set_xticks(report['settings']['concurrency'], [str(c) for c in report['settings']['concurrency']])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  s = report['settings']
  fig.suptitle(
      f'{s["model"]}, {s["prompts"]} Spec-Bench prompts, {s["max_tokens"]} tokens, {s["arrival"]}'
      f'{" " + str(s["rate"]) + " req/s" if s["arrival"] == "poisson" else ""}, slots {s["max_slots"]}; '
      f'{report["machine"]["cpu"]} ({report["machine"]["cpus"]} CPUs)',
      fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(prefix + '.png', dpi=120)
  plt.close(fig)


def fmt(x, scale=1.0, digits=1) -> str:
  return '-' if x is None else f'{x * scale:.{digits}f}'


def table(report: dict) -> str:
  rows = [
      '| arm | C | out tok/s | speedup | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 s '
      '| goodput req/s | τ | accept | preempt | same text |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for arm in report['arms']:
    for lv in arm['levels']:
      pp = lambda k, s, d: f'{fmt(lv[k]["p50"], s, d)} / {fmt(lv[k]["p99"], s, d)}'
      failed = f' ({lv["failed"]} failed)' if lv['failed'] else ''
      if lv.get('compiles_in_timed_pass', {}).get('heavy'):
        failed += f' (compiled {lv["compiles_in_timed_pass"]["seconds"]:.0f} s)'
      rows.append(
          f'| {arm["name"]} | {lv["concurrency"]} | {fmt(lv["output_throughput"])}{failed} | '
          f'{fmt(lv.get("speedup"), 1, 2)} | {pp("ttft_s", 1e3, 0)} | {pp("tpot_s", 1e3, 0)} | {pp("itl_s", 1e3, 0)} '
          f'| {pp("e2e_s", 1, 1)} | {fmt(lv["goodput"], 1, 2)} | {fmt(lv["tau"], 1, 2)} | '
          f'{fmt(lv["acceptance"], 1, 2)} | {fmt(lv["preemptions"], 1, 0)} | {lv.get("identical") or "-"} |'
      )
  return '\n'.join(rows)


def compile_warning(level: dict) -> str:
  c = level['compiles_in_timed_pass']
  if not c['heavy']:
    return ''
  return f'; WARNING: {c["heavy"]} compiles ({c["seconds"]:.1f} s) inside the timed pass: {", ".join(c["names"])}'


def run_arm(arm: Arm, args, prompts: list, report: dict, log_dir: str) -> None:
  record = {
      'name': arm.name,
      'engine': arm.engine,
      'baseline': arm.baseline,
      'note': arm.note,
      'levels': [],
  }
  report['arms'].append(record)
  if args.slots_per_level:  # a fresh server per level, as many slots as the level's concurrency
    groups = [(c, [c]) for c in args.concurrency]
  else:
    groups = [(args.max_slots, args.concurrency)]
  for slots, levels in groups:
    run_server(arm, args, prompts, report, record, log_dir, slots, levels)


def run_server(arm: Arm, args, prompts, report, record, log_dir, slots: int, levels: list) -> None:
  print(f'[{arm.name}] starting with {slots} slots', file=sys.stderr, flush=True)
  with Server(arm, args, log_dir, slots) as server:
    command = shlex.join(server.command)
    record.setdefault('command', command)
    print(f'[{arm.name}] up in {server.startup_s:.1f} s: {command}', file=sys.stderr, flush=True)
    for c in levels:
      t, passes = time.perf_counter(), 0
      while passes < (args.warmup_passes + args.extra_warmup_passes if args.warmup_passes else 0):
        offset = server.log_size()
        warm, _ = asyncio.run(run_pass(server.url, args, arm, prompts, c, args.warmup_max_tokens))
        passes += 1
        if not any(r.ok for r in warm):
          raise RuntimeError(f'{arm.name}: every warm-up request failed: {warm[0].error}\n{server.tail()}')
        if passes >= args.warmup_passes and not server.compiles_since(offset)['heavy']:
          break  # a pass that compiled nothing: the timed one most likely will not either
      warm_s = time.perf_counter() - t
      for attempt in range(1 + args.timed_retries):
        load0 = os.getloadavg()[0]
        before, offset = spec_counters(arm.engine, server.metrics()), server.log_size()
        results, wall = asyncio.run(run_pass(server.url, args, arm, prompts, c, args.max_tokens))
        delta = counter_delta(before, spec_counters(arm.engine, server.metrics()))
        compiles = server.compiles_since(offset)
        if not compiles['heavy'] or attempt == args.timed_retries:
          break
        print(f'[{arm.name}] C={c}: the timed pass compiled {", ".join(compiles["names"])}; again', file=sys.stderr)
      level = {'concurrency': c, 'slots': slots, **summarize(results, wall, args, delta)}
      level.update(warmup_s=warm_s, warmup_passes=passes, timed_attempts=attempt + 1, compiles_in_timed_pass=compiles)
      level['server'] = {'command': command, 'startup_s': server.startup_s}
      level['loadavg_1m'] = [load0, os.getloadavg()[0]]
      outputs = {}
      for r in sorted(results, key=lambda r: r.prompt):
        if r.ok:
          outputs.setdefault(str(r.prompt), digest(r.text))
      level['outputs'] = outputs
      record['levels'].append(level)
      save(report, args.out)
      print(
          f'[{arm.name}] C={c}: {fmt(level["output_throughput"])} tok/s, TTFT p50 '
          f'{fmt(level["ttft_s"]["p50"], 1e3, 0)} ms, TPOT p50 {fmt(level["tpot_s"]["p50"], 1e3, 0)} ms, '
          f'τ {fmt(level["tau"], 1, 2)}, {level["failed"]} failed ({wall:.1f} s; {passes} warm-up passes, '
          f'{warm_s:.1f} s){compile_warning(level)}',
          file=sys.stderr,
          flush=True,
      )


def main(argv=None) -> int:
  if argv is None and len(sys.argv) == 3 and sys.argv[1] == '--llamacpp-worker':
    llamacpp_worker(json.loads(sys.argv[2]))
    return 0
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('-m', '--model', default='gemma-3-270m', help='specjax -m; llama.cpp gets its GGUF file')
  p.add_argument('--prompts', type=int, default=32, help='Spec-Bench prompts, category-balanced')
  p.add_argument('--prompt-file', default=None, help='a jsonl instead of Spec-Bench question.jsonl')
  p.add_argument('--num-requests', type=int, default=None, help='requests per pass (default: one per prompt)')
  p.add_argument('--max-tokens', type=int, default=128)
  p.add_argument('--ignore-eos', action='store_true', help='every request generates --max-tokens')
  p.add_argument('--api', choices=('completions', 'chat'), default='completions')
  p.add_argument('--concurrency', type=int, nargs='+', default=[1, 2, 4, 8, 16, 32])
  p.add_argument('--arrival', choices=('closed', 'poisson'), default='closed')
  p.add_argument('--rate', type=float, default=None, help='poisson: requests per second')
  p.add_argument('--seed', type=int, default=0, help='poisson arrival times')
  p.add_argument('--arms', nargs='+', choices=ARMS, default=list(ARMS), help='(eagle3 needs --eagle3)')
  p.add_argument('--ngram-k', type=int, default=4, help='draft depth of the n-gram arms (both engines)')
  p.add_argument('--ngram-min', type=int, default=None, help="specjax n-gram arms' shortest lookup (server default 1)")
  p.add_argument('--ngram-max', type=int, default=None, help="specjax n-gram arms' longest lookup (server default 3)")
  p.add_argument('--eagle3', default=None, help='an EAGLE-3 head for the target (adds the eagle3 arm)')
  p.add_argument('--eagle3-k', type=int, default=None, help="eagle3 arm's depth (default: the server's)")
  p.add_argument('--max-slots', type=int, default=None, help='batch slots / llama.cpp n_parallel (default: max C)')
  p.add_argument(
      '--slots-per-level',
      action='store_true',
      help='a fresh server per concurrency level with --max-slots / n_parallel = C (default: one server per arm '
      'sized for the largest level; specjax steps compute only the live slots)',
  )
  p.add_argument('--specjax-args', default='', help='extra `specjax serve` flags for every specjax arm')
  p.add_argument('--ctx-per-slot', type=int, default=2048, help='llama.cpp context per slot')
  p.add_argument('--threads', type=int, default=os.cpu_count(), help='llama.cpp threads')
  p.add_argument(
      '--omp-wait-policy',
      default='passive',
      help='OMP_WAIT_POLICY of the llama.cpp server (passive: threads sleep at barriers instead of spinning; '
      'spinning threads that share the cores with the client or other work slow it by 5-10x; empty: inherit)',
  )
  p.add_argument('--llamacpp-ngram-n', type=int, default=3, help='llama.cpp ngram-simple lookup length (size_n)')
  p.add_argument('--warmup-passes', type=int, default=1, help='untimed passes before each timed one')
  p.add_argument(
      '--extra-warmup-passes',
      type=int,
      default=2,
      help='further warm-up passes while the last one still compiled (specjax; seen in the server log)',
  )
  p.add_argument(
      '--timed-retries',
      type=int,
      default=2,
      help='rerun a timed pass that compiled (the batching a pass meets depends on timing), at most this often',
  )
  p.add_argument('--warmup-max-tokens', type=int, default=None, help='max_tokens of warm-up requests (default: same)')
  p.add_argument('--slo-ttft', type=float, default=2.0, help='goodput SLO on TTFT, seconds')
  p.add_argument('--slo-tpot', type=float, default=0.2, help='goodput SLO on TPOT, seconds')
  p.add_argument('--startup-timeout', type=float, default=900.0)
  p.add_argument('--request-timeout', type=float, default=1800.0)
  p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'serve_load', 'serve_load'))
  p.add_argument('--logs', default=None, help='server logs folder (default: a temporary one, removed after)')
  args = p.parse_args(argv)
  if args.arrival == 'poisson' and not (args.rate and args.rate > 0):
    p.error('--arrival poisson needs --rate R > 0')
  if args.eagle3 and 'eagle3' not in args.arms:
    args.arms.append('eagle3')
  args.max_slots = args.max_slots or max(args.concurrency)
  args.warmup_max_tokens = args.warmup_max_tokens or args.max_tokens
  args.served_name = args.model
  args.out = os.path.splitext(args.out)[0] if args.out.endswith('.json') else args.out

  prompts = pick_prompts(args.prompts, args.prompt_file)
  gguf = None
  if any(a.startswith('llamacpp') for a in args.arms):
    try:
      import xllamacpp  # noqa: F401
    except ImportError:
      print('xllamacpp is not installed (pip install -e ".[bench]"): no llama.cpp arms', file=sys.stderr)
    else:
      gguf = gguf_path(args.model)
      if gguf is None:
        print(f'{args.model} is not a GGUF file: no llama.cpp arms', file=sys.stderr)
  arms, skipped = build_arms(args, gguf)
  from specjax.provenance import git_info

  report = {
      'benchmark': 'serve_load',
      'command': shlex.join([sys.executable, *sys.argv]),
      'date_utc': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S'),
      'machine': machine_info(),
      'versions': versions(),
      'git': git_info(),
      'settings': {
          'model': args.model,
          'gguf': gguf,
          'prompts': len(prompts),
          'num_requests': args.num_requests or len(prompts),
          'max_tokens': args.max_tokens,
          'ignore_eos': args.ignore_eos,
          'temperature': 0.0,
          'api': args.api,
          'concurrency': args.concurrency,
          'arrival': args.arrival,
          'rate': args.rate,
          'max_slots': 'C (a server per level)' if args.slots_per_level else args.max_slots,
          'ngram_k': args.ngram_k,
          'ngram_min': args.ngram_min,
          'ngram_max': args.ngram_max,
          'llamacpp_ngram_n': args.llamacpp_ngram_n,
          'llamacpp_threads': args.threads,
          'llamacpp_omp_wait_policy': args.omp_wait_policy,
          'warmup_passes': args.warmup_passes,
          'extra_warmup_passes': args.extra_warmup_passes,
          'timed_retries': args.timed_retries,
          'warmup_max_tokens': args.warmup_max_tokens,
          'slo_ttft_s': args.slo_ttft,
          'slo_tpot_s': args.slo_tpot,
      },
      'prompts': [{'id': q.id, 'category': q.category, 'chars': len(q.text)} for q in prompts],
      'skipped_arms': skipped,
      'arms': [],
      'failures': [],
  }
  log_dir = args.logs or tempfile.mkdtemp(prefix='serve_load_')
  os.makedirs(log_dir, exist_ok=True)
  try:
    for arm in arms:
      try:
        run_arm(arm, args, prompts, report, log_dir)
      except RuntimeError as e:
        print(f'[{arm.name}] failed: {e}', file=sys.stderr, flush=True)
        report['failures'].append({'arm': arm.name, 'error': str(e)[-3000:]})
      save(report, args.out)
  finally:
    if not args.logs:
      shutil.rmtree(log_dir, ignore_errors=True)
  save(report, args.out)
  plot(report, args.out)
  print(table(report))
  print(f'\n{args.out}.json, {args.out}.png', file=sys.stderr)
  return 1 if report['failures'] else 0


if __name__ == '__main__':
  sys.exit(main())
