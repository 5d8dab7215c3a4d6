"""Decode throughput of specjax against transformers on the real Gemma 3 270M.

Runs in specjax's environment; the transformers side runs in a subprocess with
a side environment's python (torch + transformers), so specjax never imports
torch:

  python benchmarks/decode.py [--hf-python /work/torchenv/bin/python | none]
      [--max-new-tokens 64] [--repeats 2] [--json out.json]

Both sides decode greedily in float32 on the CPU, batch 1, the three prompts of
`shared/reference/baselines.md` section 2, one side after the other (never
sharing the cores), best of `--repeats` after a warm-up. The same run measures
memory bandwidth and reports decode tok/s as a fraction of the bandwidth bound
(weight bytes read per token). benchmarks/README.md defines every figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

PROMPTS = {
    'code': 'def fibonacci(n):\n    """Return the n-th Fibonacci number using iteration."""\n',
    'math': (
        'Question: A bakery sells muffins for $3 each and cookies for $2 each. On Monday it sold '
        '24 muffins and 35 cookies. How much money did the bakery make on Monday?\n'
        "Answer: Let's think step by step."
    ),
    'chat': (
        '<start_of_turn>user\nWhat are three simple tips for staying healthy while working from home?'
        '<end_of_turn>\n<start_of_turn>model\n'
    ),
}
MODEL = 'gemma-3-270m'
DEFAULT_HF_PYTHON = '/work/torchenv/bin/python'
HF_THREADS = 2
BANDWIDTH_BYTES = 512 * 2**20  # per buffer, far beyond the caches
BANDWIDTH_REPEATS = 7
GB = 1e9


def log(msg: str):
  print(f'[{time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr, flush=True)


# ---------------------------------------------------------------- transformers worker


def hf_worker(spec_path: str, out_path: str):
  """Runs in the side environment: transformers float32 on the same token ids."""
  import torch
  import transformers

  transformers.utils.logging.disable_progress_bar()
  spec = json.loads(pathlib.Path(spec_path).read_text())
  torch.set_num_threads(spec['threads'])
  gguf = pathlib.Path(spec['gguf'])
  t = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
  ).eval()
  load_s = time.perf_counter() - t
  log(f'transformers: model loaded in {load_s:.1f} s')

  def generate(ids: list[int], max_new: int, scores: bool = False):
    x = torch.tensor([ids], dtype=torch.long)
    kwargs = dict(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new,
        do_sample=False,
        output_scores=scores,
        return_dict_in_generate=True,
    )
    t = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(**kwargs)
    seconds = time.perf_counter() - t
    return out, out.sequences[0, len(ids) :].tolist(), seconds

  n = spec['max_new_tokens']
  results = {}
  for name, ids in spec['prompts'].items():
    # Warm-up, untimed, keeping each step's top-1 minus top-2 logit.
    scored, checked, _ = generate(ids, n, scores=True)
    margins = [float(v[0] - v[1]) for v in (s[0].topk(2).values for s in scored.scores)]
    e2e_s, first_s, new_ids = [], [], None
    for _ in range(spec['repeats']):
      _, new_ids, seconds = generate(ids, n)
      e2e_s.append(seconds)
      first_s.append(generate(ids, 1)[2])
    results[name] = dict(
        new_ids=new_ids, e2e_s=e2e_s, prefill_plus_one_s=first_s, margins=margins, deterministic=checked == new_ids
    )
    log(f'transformers {name}: {len(new_ids) / min(e2e_s):.1f} tok/s e2e')
  summary = dict(
      torch=torch.__version__,
      transformers=transformers.__version__,
      threads=torch.get_num_threads(),
      attention=model.config._attn_implementation,
      num_params=sum(p.numel() for p in model.parameters()),
      load_s=load_s,
      prompts=results,
  )
  pathlib.Path(out_path).write_text(json.dumps(summary))


def run_hf(hf_python: str, gguf: str, prompt_ids: dict, max_new_tokens: int, repeats: int) -> dict:
  """Launches `hf_worker` in the side environment and returns its JSON."""
  with tempfile.TemporaryDirectory() as tmp:
    spec_path, out_path = os.path.join(tmp, 'spec.json'), os.path.join(tmp, 'out.json')
    spec = dict(gguf=gguf, prompts=prompt_ids, max_new_tokens=max_new_tokens, repeats=repeats, threads=HF_THREADS)
    pathlib.Path(spec_path).write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_NO_ADVISORY_WARNINGS='1')
    cmd = [hf_python, os.path.abspath(__file__), '--worker', spec_path, out_path]
    proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0 or not os.path.exists(out_path):
      raise RuntimeError(f'transformers worker failed (exit status {proc.returncode})')
    return json.loads(pathlib.Path(out_path).read_text())


def hf_rates(side: dict) -> dict:
  """Best-of e2e tok/s and the decode estimate (n - 1) / (t(n) - t(1))."""
  ids = side['new_ids']
  t_n, t_1 = min(side['e2e_s']), min(side['prefill_plus_one_s'])
  return dict(
      tokens=len(ids),
      e2e_tok_s=len(ids) / t_n,
      decode_tok_s=(len(ids) - 1) / (t_n - t_1) if t_n > t_1 else float('nan'),
      prefill_plus_one_s=t_1,
  )


# ---------------------------------------------------------------- bandwidth


def _rates(fn, nbytes: int) -> tuple[float, float]:
  """(best, median) of nbytes / seconds over BANDWIDTH_REPEATS calls, after one warm-up."""
  fn()
  rates = []
  for _ in range(BANDWIDTH_REPEATS):
    t = time.perf_counter()
    fn()
    rates.append(nbytes / (time.perf_counter() - t))
  return max(rates), statistics.median(rates)


def _threaded(fn, args_list):
  threads = [threading.Thread(target=fn, args=args) for args in args_list]
  for t in threads:
    t.start()
  for t in threads:
    t.join()


def measure_bandwidth() -> list[dict]:
  """Copy and read-only kernels over 512 MB float32 buffers, pre-touched.

  Each entry has `traffic_gb_s` (bytes read + written, as STREAM counts them)
  and `read_gb_s` (bytes read only), best and median of the calls.
  """
  import jax
  import jax.numpy as jnp

  n = BANDWIDTH_BYTES // 4
  nbytes = n * 4
  src = np.ones(n, np.float32)
  dst = np.zeros(n, np.float32)
  halves = list(zip(np.array_split(dst, 2), np.array_split(src, 2)))
  src_halves = [(h,) for h in np.array_split(src, 2)]
  scale = jax.jit(lambda x, s: x * s, donate_argnums=0)  # s is an operand: XLA cannot fold it
  s = jnp.float32(1.0)
  box = [jnp.ones(n, jnp.float32)]

  def jax_scale():
    box[0] = scale(box[0], s)
    box[0].block_until_ready()

  rowsum = jax.jit(lambda x: x.reshape(-1, 256).sum(1))
  kernels = [
      ('numpy copyto', 'copy', 1, lambda: np.copyto(dst, src)),
      ('numpy copyto, 2 threads', 'copy', 2, lambda: _threaded(np.copyto, halves)),
      ('jax x * s, donated in place', 'copy', os.cpu_count(), jax_scale),
      ('numpy max, 2 threads', 'read', 2, lambda: _threaded(np.max, src_halves)),
      ('jax row sums', 'read', os.cpu_count(), lambda: rowsum(box[0]).block_until_ready()),
  ]
  out = []
  for name, kind, threads, fn in kernels:
    best, median = _rates(fn, nbytes)
    factor = 2 if kind == 'copy' else 1  # a copy reads and writes every byte
    out.append(
        dict(
            kernel=name,
            kind=kind,
            threads=threads,
            traffic_gb_s=factor * best / GB,
            traffic_gb_s_median=factor * median / GB,
            read_gb_s=best / GB,
            read_gb_s_median=median / GB,
        )
    )
    log(f'bandwidth {name}: {factor * best / GB:.1f} GB/s traffic, {best / GB:.1f} GB/s read')
  del src, dst, box
  return out


def bounds(bandwidth: list[dict], bytes_per_token: int) -> dict:
  """Bandwidth bounds on decode tok/s under the three definitions."""
  copies = [b for b in bandwidth if b['kind'] == 'copy']
  reads = [b for b in bandwidth if b['kind'] == 'read']
  rates = {  # (best, median) over kernels of each kind
      'copy_traffic': [(b['traffic_gb_s'], b['traffic_gb_s_median']) for b in copies],  # the bound
      'read_only': [(b['read_gb_s'], b['read_gb_s_median']) for b in reads],
      'copy_bytes_read': [(b['read_gb_s'], b['read_gb_s_median']) for b in copies],
  }
  out = {}
  for key, pairs in rates.items():
    best, median = max(p[0] for p in pairs), max(p[1] for p in pairs)
    out[key] = dict(
        gb_s=best,
        gb_s_median=median,
        bound_tok_s=best * GB / bytes_per_token,
        bound_tok_s_median=median * GB / bytes_per_token,
    )
  return out


# ---------------------------------------------------------------- specjax side


def run_specjax(max_new_tokens: int, repeats: int):
  """Loads the model, warms up every prompt, returns (model, prompt ids, results)."""
  import specjax

  t = time.perf_counter()
  model = specjax.load(MODEL)
  load_s = time.perf_counter() - t
  engine = specjax.Engine(model)
  prompt_ids = {name: engine.encode([text])[0] for name, text in PROMPTS.items()}
  log(f'specjax: loaded in {load_s:.1f} s, prompt tokens ' + ', '.join(f'{k} {len(v)}' for k, v in prompt_ids.items()))
  compile_s = 0.0
  for ids in prompt_ids.values():  # warm-up: compiles every bucket used below
    compile_s += engine.generate([ids], max_new_tokens=max_new_tokens)[1].compile_s
  results = {}
  for name, ids in prompt_ids.items():
    runs, tokens, finish = [], None, None
    for _ in range(repeats):
      (res,), stats = engine.generate([ids], max_new_tokens=max_new_tokens)
      runs.append(stats)
      tokens, finish = res.tokens, res.finish_reason
    results[name] = dict(
        tokens=len(tokens),
        new_ids=tokens,
        finish_reason=finish,
        e2e_tok_s=max(r.tokens_per_s for r in runs),
        decode_tok_s=max(r.decode_tokens_per_s for r in runs),
        prefill_s=min(r.prefill_s for r in runs),
        compile_s_in_timed_runs=sum(r.compile_s for r in runs),
        runs=[
            dict(
                prefill_s=r.prefill_s,
                decode_s=r.decode_s,
                decode_steps=r.decode_steps,
                tokens_per_s=r.tokens_per_s,
                decode_tokens_per_s=r.decode_tokens_per_s,
            )
            for r in runs
        ],
    )
    log(f'specjax {name}: {results[name]["e2e_tok_s"]:.1f} tok/s e2e, {results[name]["decode_tok_s"]:.1f} decode')
  info = dict(
      load_s=load_s,
      compile_s=compile_s,
      param_bytes=model.param_bytes,
      num_params=model.num_params,
      kv_shapes=[list(s) for s in model.kv_shapes],
      source=model.source,
  )
  return model, prompt_ids, results, info


def first_divergence(a: list[int], b: list[int]) -> int | None:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------- machine


def cpu_snapshot() -> dict:
  """Machine-wide busy and steal CPU seconds, and this process tree's own CPU seconds."""
  fields = [int(x) for x in pathlib.Path('/proc/stat').read_text().split('\n')[0].split()[1:9]]
  user, nice, system, _, _, irq, softirq, steal = fields
  tick = os.sysconf('SC_CLK_TCK')
  own = sum(
      u.ru_utime + u.ru_stime
      for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
  )
  return dict(wall=time.perf_counter(), busy=(user + nice + system + irq + softirq) / tick, steal=steal / tick, own=own)


def cpu_usage(before: dict, after: dict) -> dict:
  """CPU seconds that other processes (and the hypervisor, as steal) took in between."""
  wall = after['wall'] - before['wall']
  others = max(0.0, (after['busy'] - before['busy']) - (after['own'] - before['own']))
  steal = after['steal'] - before['steal']
  return dict(
      wall_s=wall,
      others_cpu_s=others,
      steal_cpu_s=steal,
      others_share=others / (wall * os.cpu_count()),
      steal_share=steal / (wall * os.cpu_count()),
  )


# ---------------------------------------------------------------- report


def machine() -> dict:
  cpu = platform.processor()
  try:
    for line in pathlib.Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        cpu = line.split(':', 1)[1].strip()
        break
  except OSError:
    pass
  mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return dict(
      cpu=cpu,
      cores=os.cpu_count(),
      memory_gib=round(mem / 2**30, 1),
      python=platform.python_version(),
      platform=platform.platform(),
  )


def report(r: dict) -> str:
  n = r['settings']['max_new_tokens']
  bound = r['bounds']['copy_traffic']['bound_tok_s']
  lines = [
      f'## Decode, {MODEL} float32, batch 1, greedy, {n} new tokens, best of {r["settings"]["repeats"]}',
      '',
      '| prompt | prompt tokens | specjax e2e tok/s | specjax decode tok/s | specjax prefill ms '
      '| transformers e2e tok/s | transformers decode tok/s | e2e ratio | decode ratio '
      '| decode / bound | same ids |',
      '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name in PROMPTS:
    s = r['specjax']['prompts'][name]
    h = r['transformers']['prompts'].get(name) if r['transformers'] else None
    cells = [
        name,
        str(len(r['prompt_ids'][name])),
        f'{s["e2e_tok_s"]:.1f}',
        f'{s["decode_tok_s"]:.1f}',
        f'{1e3 * s["prefill_s"]:.0f}',
    ]
    if h:
      cmp = r['comparison'][name]
      same = (
          'yes'
          if cmp['first_divergence'] is None
          else (f'no: from token {cmp["first_divergence"]} (margin {cmp["margin_at_divergence"]:.3f})')
      )
      cells += [
          f'{h["e2e_tok_s"]:.1f}',
          f'{h["decode_tok_s"]:.1f}',
          f'{s["e2e_tok_s"] / h["e2e_tok_s"]:.2f}x',
          f'{s["decode_tok_s"] / h["decode_tok_s"]:.2f}x',
      ]
    else:
      cells += ['n/a'] * 4
    cells.append(f'{s["decode_tok_s"] / bound:.0%}')
    cells.append(same if h else 'n/a')
    if s['tokens'] != n or (h and h['tokens'] != n):
      cells[0] += f' (tokens: specjax {s["tokens"]}, transformers {h["tokens"] if h else "n/a"})'
    lines.append('| ' + ' | '.join(cells) + ' |')
  summary = r['summary']
  lines += [
      '',
      f'mean over prompts: specjax {summary["specjax_e2e_tok_s"]:.1f} tok/s e2e, '
      f'{summary["specjax_decode_tok_s"]:.1f} decode; compile {r["specjax"]["compile_s"]:.1f} s '
      f'(warm-up, excluded); load {r["specjax"]["load_s"]:.1f} s',
  ]
  if r['transformers']:
    t = r['transformers']
    lines.append(
        f'transformers {t["transformers"]} / torch {t["torch"]}, {t["threads"]} threads, '
        f'{t["attention"]} attention: {summary["hf_e2e_tok_s"]:.1f} tok/s e2e, '
        f'{summary["hf_decode_tok_s"]:.1f} decode; load {t["load_s"]:.1f} s; '
        f'specjax / transformers e2e {summary["e2e_ratio"]:.2f}x, decode {summary["decode_ratio"]:.2f}x'
    )
  lines += [
      '',
      f'## Memory bandwidth (512 MB float32 buffers, best / median of {BANDWIDTH_REPEATS})',
      '',
      '| kernel | kind | threads | traffic GB/s (read + write) | read GB/s |',
      '|---|---|---|---|---|',
  ]
  for b in r['bandwidth']:
    lines.append(
        f'| {b["kernel"]} | {b["kind"]} | {b["threads"]} | {b["traffic_gb_s"]:.1f} / '
        f'{b["traffic_gb_s_median"]:.1f} | {b["read_gb_s"]:.1f} / {b["read_gb_s_median"]:.1f} |'
    )
  bpt = r['bytes_per_token']
  lines += [
      '',
      f'weight bytes read per decode token: {bpt:,} ({bpt / GB:.3f} GB, float32 params; '
      f'KV cache reads add at most {r["kv_bytes_per_token_max"] / 1e6:.1f} MB, not counted)',
      '',
      '| bound definition | bandwidth GB/s, best / median | bound tok/s, best / median '
      '| specjax decode / bound, best / median |',
      '|---|---|---|---|',
  ]
  names = {
      'copy_traffic': '**copy traffic, read + write (STREAM counting): the bound**',
      'read_only': 'read-only kernels (reference)',
      'copy_bytes_read': 'copy, bytes read only (lenient)',
  }
  for key, label in names.items():
    b = r['bounds'][key]
    decode = summary['specjax_decode_tok_s']
    lines.append(
        f'| {label} | {b["gb_s"]:.1f} / {b["gb_s_median"]:.1f} | {b["bound_tok_s"]:.1f} / '
        f'{b["bound_tok_s_median"]:.1f} | {decode / b["bound_tok_s"]:.0%} / '
        f'{decode / b["bound_tok_s_median"]:.0%} |'
    )
  lines += [
      '',
      f'targets: e2e >= 1.2x transformers: '
      + (
          f'{"PASS" if summary["e2e_ratio"] >= 1.2 else "FAIL"} ({summary["e2e_ratio"]:.2f}x)'
          if r['transformers']
          else 'n/a'
      )
      + f'; decode >= 80% of the bound: {"PASS" if summary["fraction_of_bound"] >= 0.8 else "FAIL"} '
      f'({summary["fraction_of_bound"]:.0%})',
  ]
  lines += [
      '',
      'other load during the run (CPU seconds used by other processes / stolen by the hypervisor, '
      'as a share of the cores): '
      + '; '.join(
          f'{k} {v["others_cpu_s"]:.1f} s ({v["others_share"]:.0%}) / {v["steal_cpu_s"]:.1f} s '
          f'({v["steal_share"]:.0%}) over {v["wall_s"]:.0f} s'
          for k, v in r['interference'].items()
      ),
  ]
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument(
      '--hf-python',
      default=DEFAULT_HF_PYTHON if os.path.exists(DEFAULT_HF_PYTHON) else 'none',
      help="python of an environment with torch + transformers, or 'none' to skip that side",
  )
  p.add_argument('--max-new-tokens', type=int, default=64)
  p.add_argument('--repeats', type=int, default=2)
  p.add_argument('--json', help='write every number to this file')
  p.add_argument('--worker', nargs=2, metavar=('SPEC', 'OUT'), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return hf_worker(*args.worker)
  if args.hf_python != 'none' and not os.path.exists(args.hf_python):
    p.error(f'--hf-python {args.hf_python}: no such file')
  if args.max_new_tokens < 2 or args.repeats < 1:
    p.error('--max-new-tokens must be at least 2 and --repeats at least 1')

  load_before = os.getloadavg()
  started = datetime.datetime.now().astimezone()
  snaps = [cpu_snapshot()]
  time.sleep(1.0)
  if cpu_usage(snaps[0], cpu_snapshot())['others_share'] > 0.1:
    log('warning: other processes are using the CPU: the figures will be low (see "other load" below)')
  snaps = [cpu_snapshot()]
  log('measuring memory bandwidth')
  bandwidth = measure_bandwidth()
  snaps.append(cpu_snapshot())
  model, prompt_ids, sj_results, sj_info = run_specjax(args.max_new_tokens, args.repeats)
  snaps.append(cpu_snapshot())

  from specjax.loading.registry import DEMO_MODELS
  import jax

  gguf = DEMO_MODELS[MODEL].path()
  hf = None
  if args.hf_python != 'none':
    log(f'transformers side: {args.hf_python}')
    try:
      hf = run_hf(args.hf_python, gguf, prompt_ids, args.max_new_tokens, args.repeats)
    except RuntimeError as e:
      log(f'warning: {e}; reporting specjax only')
  snaps.append(cpu_snapshot())
  phases = ('bandwidth', 'specjax', 'transformers')
  interference = {name: cpu_usage(a, b) for name, a, b in zip(phases, snaps, snaps[1:])}
  comparison = {}
  if hf:
    for name in PROMPTS:
      side = hf['prompts'][name]
      side.update(hf_rates(side))
      div = first_divergence(sj_results[name]['new_ids'], side['new_ids'])
      margin = side['margins'][div] if div is not None and div < len(side['margins']) else None
      comparison[name] = dict(first_divergence=div, margin_at_divergence=margin, min_margin=min(side['margins']))

  bytes_per_token = sj_info['param_bytes']
  context = max(len(v) for v in prompt_ids.values()) + args.max_new_tokens
  kv_max = sum(2 * h * d * 4 for h, d in sj_info['kv_shapes']) * context
  bound = bounds(bandwidth, bytes_per_token)
  mean = lambda xs: sum(xs) / len(xs)
  summary = dict(
      specjax_e2e_tok_s=mean([v['e2e_tok_s'] for v in sj_results.values()]),
      specjax_decode_tok_s=mean([v['decode_tok_s'] for v in sj_results.values()]),
  )
  summary['fraction_of_bound'] = summary['specjax_decode_tok_s'] / bound['copy_traffic']['bound_tok_s']
  if hf:
    summary['hf_e2e_tok_s'] = mean([hf['prompts'][k]['e2e_tok_s'] for k in PROMPTS])
    summary['hf_decode_tok_s'] = mean([hf['prompts'][k]['decode_tok_s'] for k in PROMPTS])
    summary['e2e_ratio'] = summary['specjax_e2e_tok_s'] / summary['hf_e2e_tok_s']
    summary['decode_ratio'] = summary['specjax_decode_tok_s'] / summary['hf_decode_tok_s']
  result = dict(
      date=started.isoformat(timespec='seconds'),
      machine=machine(),
      load_average_before=load_before,
      load_average_after=os.getloadavg(),
      settings=dict(
          model=MODEL,
          gguf=gguf,
          max_new_tokens=args.max_new_tokens,
          repeats=args.repeats,
          hf_python=args.hf_python,
          hf_threads=HF_THREADS,
          bandwidth_bytes=BANDWIDTH_BYTES,
      ),
      versions=dict(specjax=importlib.metadata.version('specjax'), jax=jax.__version__, numpy=np.__version__),
      prompt_ids=prompt_ids,
      specjax=dict(sj_info, prompts=sj_results),
      transformers=hf,
      comparison=comparison,
      bandwidth=bandwidth,
      bytes_per_token=bytes_per_token,
      kv_bytes_per_token_max=kv_max,
      bounds=bound,
      summary=summary,
      interference=interference,
  )
  print(report(result))
  print(
      f'\n{started:%Y-%m-%d %H:%M %Z}, {result["machine"]["cpu"]}, {result["machine"]["cores"]} cores, '
      f'load average {load_before[0]:.2f} before, {result["load_average_after"][0]:.2f} after'
  )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  del model


if __name__ == '__main__':
  main()
