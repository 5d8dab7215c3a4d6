"""Decode speed and next-token agreement of quantized Gemma 3 270M, against float32 and llama.cpp, in one run.

  python benchmarks/quant_decode.py [--arms f32 auto int8 int4 auto-act8 int8-act8 int4-act8 llamacpp]
      [--max-new-tokens 64] [--repeats 2]
      [--json benchmarks/results/quant_decode_cpu.json]

Arms (greedy, batch 1, CPU, the three prompts of benchmarks/decode.py, best of `--repeats` after a warm-up):

  f32       the GGUF dequantized to float32 (`specjax.load('gemma-3-270m')`, the default);
  auto      the file's own blocks (`quant='auto'`: Q8_0 embedding / tied head, Q5_0, Q4_K, Q6_K projections);
  int8      the float32 weights requantized: int8, a scale per output channel (embedding included);
  int4      the same at int4, a scale per 32 inputs;
  *-act8    auto, int8, int4 with act int8 (`quant_act='int8'`: activations quantized per block of 32 inputs,
            integer dot products on the CPU kernel, as llama.cpp does);
  llamacpp  llama.cpp's own server (`xllamacpp`, 2 threads) on the same GGUF: its reported decode tok/s.

Per specjax arm: decode tok/s (tokens after the first over decode time), weight bytes, whether the CPU kernel ran,
and against float32 the share of generated tokens equal to f32's (greedy; a path that diverges counts from there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from decode import PROMPTS  # noqa: E402

import specjax  # noqa: E402
from specjax.provenance import device_description, git_info, now, package_versions  # noqa: E402
from specjax.quant import ops  # noqa: E402
from specjax.quant.params import quantize_params, set_act  # noqa: E402

MODEL = 'gemma-3-270m'


def load_arm(arm: str):
  arm, act8 = arm.removesuffix('-act8'), arm.endswith('-act8')
  if arm in ('f32', 'auto'):
    return specjax.load(MODEL, quant=None if arm == 'f32' else 'auto', quant_act='int8' if act8 else 'float')
  model = specjax.load(MODEL)  # float32, then requantized (the file itself is already quantized)
  quantize_params(model.params, arm, group=32)
  if act8:
    set_act(model.params, 'int8')
  quant = (arm if arm == 'int8' else 'int4-g32') + (', act int8' if act8 else '')
  return dataclasses.replace(model, quant=quant)


def run_specjax(arm: str, max_new: int, repeats: int) -> dict:
  model = load_arm(arm)
  engine = specjax.Engine(model)
  prompts = list(PROMPTS.values())
  engine.generate(prompts[:1], max_new_tokens=4)  # warm-up: compile
  best, tokens = 0.0, []
  for _ in range(repeats):
    rates, tokens = [], []
    for prompt in prompts:
      results, stats = engine.generate([prompt], max_new_tokens=max_new)
      rates.append(stats.decode_tokens_per_s)
      tokens.append(results[0].tokens)
    best = max(best, sum(rates) / len(rates))
  return {
      'decode_tok_s': round(best, 2),
      'weight_bytes': model.param_bytes,
      'quant': model.quant,
      'kernel': ops.uses_kernel() and model.quant is not None,
      'tokens': tokens,
  }


def run_llamacpp(max_new: int, repeats: int) -> dict:
  import httpx
  import xllamacpp as xlc

  p = xlc.CommonParams()
  p.model.path = specjax.loading.resolve(MODEL)
  p.hostnames = ['127.0.0.1']
  p.port = 8765
  p.n_parallel = 1
  p.n_ctx = 512
  p.cpuparams.n_threads = 2
  p.cpuparams_batch.n_threads = 2
  server = xlc.Server(p)
  url = 'http://127.0.0.1:8765/completion'
  for _ in range(100):
    try:
      httpx.get('http://127.0.0.1:8765/health', timeout=1).raise_for_status()
      break
    except httpx.HTTPError:
      time.sleep(0.2)
  body = lambda prompt, n: {'prompt': prompt, 'n_predict': n, 'temperature': 0, 'cache_prompt': False}
  httpx.post(url, json=body(PROMPTS['code'], 4), timeout=120)  # warm-up
  best = 0.0
  for _ in range(repeats):
    rates = []
    for prompt in PROMPTS.values():
      timings = httpx.post(url, json=body(prompt, max_new), timeout=300).json()['timings']
      rates.append(timings['predicted_per_second'])
    best = max(best, sum(rates) / len(rates))
  del server
  return {'decode_tok_s': round(best, 2), 'weight_bytes': os.path.getsize(p.model.path)}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
  """Share of tokens equal to the reference's, position by position, up to the first difference in each row."""
  same = total = 0
  for row, ref in zip(tokens, reference):
    n = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref)))
    same, total = same + n, total + len(ref)
  return round(same / total, 3)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  arms = ['f32', 'auto', 'int8', 'int4', 'auto-act8', 'int8-act8', 'int4-act8', 'llamacpp']
  ap.add_argument('--arms', nargs='+', default=arms)
  ap.add_argument('--max-new-tokens', type=int, default=64)
  ap.add_argument('--repeats', type=int, default=2)
  ap.add_argument('--json')
  args = ap.parse_args()
  report = {
      'date': now(),
      'git': git_info(),
      'versions': package_versions(['xllamacpp']),
      'device': device_description(),
      'kernel': ops.kernel_status(),
      'arms': {},
  }
  for arm in args.arms:
    t0 = time.time()
    out = (
        run_llamacpp(args.max_new_tokens, args.repeats)
        if arm == 'llamacpp'
        else run_specjax(arm, args.max_new_tokens, args.repeats)
    )
    out['wall_s'] = round(time.time() - t0, 1)
    report['arms'][arm] = out
    print(arm, {k: v for k, v in out.items() if k != 'tokens'}, flush=True)
  arms = report['arms']
  if 'f32' in arms:
    for arm, out in arms.items():
      if 'tokens' in out:
        out['greedy_agreement_vs_f32'] = agreement(out['tokens'], arms['f32']['tokens'])
  if 'llamacpp' in arms:
    for arm, out in arms.items():
      out['vs_llamacpp'] = round(out['decode_tok_s'] / arms['llamacpp']['decode_tok_s'], 3)
  for arm, out in arms.items():
    print(
        f'{arm:10s} {out["decode_tok_s"]:7.2f} tok/s  {out["weight_bytes"] / 1e6:7.1f} MB  '
        f'vs llama.cpp {out.get("vs_llamacpp")}  agreement {out.get("greedy_agreement_vs_f32")}'
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == '__main__':
  main()
