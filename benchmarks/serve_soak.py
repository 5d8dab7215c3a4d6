"""A soak of `specjax serve` on a real model: many requests, cancels, preemption, over HTTP.

  python benchmarks/serve_soak.py [-m gemma-3-270m] [--requests 1000] [--concurrency 32] [--cancel 0.1]
      [--max-tokens 48] [--prompts 48] [--max-prompt-tokens 200] [--num-pages 96] [--json out.json]

A `specjax serve` subprocess on a free loopback port (n-gram drafter, the `load` depth policy, `--max-slots`
= the concurrency, a page pool of `--num-pages` pages: far below the slots' need, so requests are preempted and
recomputed; the prefix cache on, so repeated prompts share and cached pages are evicted under that pressure).
The `openai` client keeps `--concurrency` streaming `/v1/completions` requests in flight, `--requests` in all:
a Spec-Bench first turn (of `--prompts`, each at most `--max-prompt-tokens` tokens), a random `max_tokens` in
1..`--max-tokens`, temperature 0, and a random `speculative` setting per request (the server's policy, off,
or K = 2); a `--cancel` share closes its stream after the first chunk. A task polls GET /health every second.

Checks: every completed response's text equals the offline greedy reference (`Engine.generate` in this
process before the server starts, cut to the request's `max_tokens`), the free-page count and live slots return
to their start, /health answered 200 throughout, and preemptions happened. Reports wall time, throughput and
the server's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

from serve_load import Arm, Server, get, parse_prometheus, pick_prompts  # pylint: disable=g-import-not-at-top


def references(args) -> tuple[list[str], list[list[int]], list[str]]:
  """(prompt texts, greedy reference ids, their texts at every length) from offline decoding."""
  import specjax  # pylint: disable=g-import-not-at-top

  model = specjax.load(args.model)
  tok = model.tokenizer
  texts = [p.text for p in pick_prompts(4 * args.prompts) if len(tok.encode(p.text)) <= args.max_prompt_tokens]
  texts = texts[: args.prompts]
  engine = specjax.Engine(model, max_seq_len=args.max_prompt_tokens + args.max_tokens + 16)
  ids = []
  for i in range(0, len(texts), 8):
    results, _ = engine.generate(texts[i : i + 8], max_new_tokens=args.max_tokens)
    ids += [r.tokens for r in results]
  return texts, ids, tok


async def soak(url: str, args, texts, ids, tok) -> dict:
  import openai  # pylint: disable=g-import-not-at-top

  rng = random.Random(args.seed)
  client = openai.AsyncOpenAI(base_url=url + '/v1', api_key='none', max_retries=0, timeout=600)
  counts = {'completed': 0, 'cancelled': 0, 'mismatched': 0, 'errors': 0, 'health_fail': 0}
  mismatches = []
  plan = [
      (
          rng.randrange(len(texts)),
          rng.randrange(1, args.max_tokens + 1),
          rng.random() < args.cancel,
          rng.choice([None, None, {'enabled': False}, {'num_draft': 2}]),
      )
      for _ in range(args.requests)
  ]
  done = asyncio.Event()

  async def health():
    while not done.is_set():
      status, _ = await asyncio.to_thread(get, url + '/health', 5.0)
      counts['health_fail'] += status != 200
      await asyncio.sleep(1.0)

  async def one(i, max_tokens, cancel, spec):
    extra = {'speculative': spec} if spec else {}
    try:
      stream = await client.completions.create(
          model=args.served_name,
          prompt=texts[i],
          max_tokens=max_tokens,
          temperature=0.0,
          stream=True,
          extra_body=extra,
      )
      parts = []
      async for chunk in stream:
        parts += [c.text or '' for c in chunk.choices or ()]
        if cancel and parts:
          await stream.close()  # the client goes away mid-stream
          counts['cancelled'] += 1
          return
      text, want = ''.join(parts), tok.decode(ids[i][:max_tokens])
      counts['completed'] += 1
      if text != want:
        counts['mismatched'] += 1
        mismatches.append({'prompt': i, 'max_tokens': max_tokens, 'got': text[:200], 'want': want[:200]})
    except Exception as e:  # noqa: BLE001 - counted, reported
      counts['errors'] += 1
      mismatches.append({'prompt': i, 'error': f'{type(e).__name__}: {e}'[:300]})

  queue = iter(plan)

  async def worker():
    for item in queue:
      await one(*item)

  watcher = asyncio.create_task(health())
  t0 = time.perf_counter()
  await asyncio.gather(*(worker() for _ in range(args.concurrency)))
  wall = time.perf_counter() - t0
  done.set()
  await watcher
  await client.close()
  return {**counts, 'wall_s': wall, 'mismatches': mismatches[:10]}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('-m', '--model', default='gemma-3-270m')
  p.add_argument('--requests', type=int, default=1000)
  p.add_argument('--concurrency', type=int, default=32)
  p.add_argument('--cancel', type=float, default=0.1)
  p.add_argument('--max-tokens', type=int, default=48)
  p.add_argument('--prompts', type=int, default=48)
  p.add_argument('--max-prompt-tokens', type=int, default=200)
  p.add_argument('--num-pages', type=int, default=96)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--startup-timeout', type=float, default=600)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  args.served_name, args.omp_wait_policy = args.model, None
  t = time.perf_counter()
  texts, ids, tok = references(args)
  ref_s = time.perf_counter() - t
  print(f'{len(texts)} prompts, offline references in {ref_s:.0f} s', flush=True)
  flags = [
      '-m',
      args.model,
      '--drafter',
      'ngram',
      '--n-predict',
      '4',
      '--policy',
      'load',
      '--num-pages',
      str(args.num_pages),
      '--max-seq-len',
      str(args.max_prompt_tokens + args.max_tokens + 16),
  ]
  arm = Arm('soak', 'specjax', flags, 'soak')
  with tempfile.TemporaryDirectory() as log_dir, Server(arm, args, log_dir, args.concurrency) as server:
    before = parse_prometheus(get(server.url + '/metrics')[1])
    out = asyncio.run(soak(server.url, args, texts, ids, tok))
    time.sleep(1.0)  # the last cancels' slots leave within a step
    after = parse_prometheus(get(server.url + '/metrics')[1])
    out['health_after'] = get(server.url + '/health')[0]
  keys = (
      'specjax_free_pages',
      'specjax_live_slots',
      'specjax_preemptions_total',
      'specjax_prefix_cache_evictions_total',
      'specjax_prefix_cache_hits_total',
      'specjax_prefix_cache_queries_total',
      'specjax_scheduler_requests_cancelled_total',
      'specjax_scheduler_requests_finished_total',
      'specjax_generation_tokens_total',
  )
  out['server'] = {k: (before.get(k), after.get(k)) for k in keys}
  generated = after.get('specjax_generation_tokens_total', 0.0) - before.get('specjax_generation_tokens_total', 0.0)
  out['throughput_tok_s'] = generated / out['wall_s']
  ok = (
      out['mismatched'] == 0
      and out['errors'] == 0
      and out['health_fail'] == 0
      and after.get('specjax_free_pages') == before.get('specjax_free_pages')
      and after.get('specjax_live_slots') == 0
      and (after.get('specjax_preemptions_total') or 0) > 0
  )
  out['ok'] = ok
  print(json.dumps({k: v for k, v in out.items() if k != 'mismatches'}, indent=1))
  if out['mismatches']:
    print('mismatches:', json.dumps(out['mismatches'], indent=1))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({'args': vars(args), 'ref_s': ref_s, **out}, indent=1))
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
