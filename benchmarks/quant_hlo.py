"""Do the weights stay quantized in memory? The compiled decode and verify steps of Gemma 3 270M, read from XLA.

  python benchmarks/quant_hlo.py [--arms f32 auto auto-act8 int8 int4] [--json benchmarks/results/quant_hlo_cpu.json]

Per arm (loaded as benchmarks/quant_decode.py loads it) and per matmul path (`auto`: the CPU kernel where built;
`xla`: the dequantize-inside-jit path that GPUs take, forced with `ops.set_impl('xla')`), the greedy decode step
and the n-gram verify step (K = 4) are compiled as the engine compiles them, then read back:

  argument MB   what the executable takes (weights, cache, state): the weights' stored size, not float32's;
  temp MB       XLA's scratch: a dequantized float copy of a weight would show here (the tied head alone is 671 MB);
  custom calls  `specjax_qmatmul` calls in the optimized HLO (one per quantized product);
  f32 weights   float32 arrays in the HLO at least as large as a layer's MLP weight (640 x 2048) with two
                dimensions >= 512 (not logits, not scales): a dequantized weight, by shape.

Nothing is timed: this is the compiler's own account of the buffers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from quant_decode import load_arm  # noqa: E402

import specjax  # noqa: E402
from specjax.drafters.registry import make_drafter  # noqa: E402
from specjax.provenance import device_description, git_info, now  # noqa: E402
from specjax.quant import ops  # noqa: E402

LARGE = 640 * 2048  # elements of one MLP projection: a float array this big is a weight's copy


def describe(exe) -> dict:
  """Buffer sizes and quantized-product facts of one compiled executable."""
  text, stats = exe.as_text(), exe.memory_analysis()
  shapes = {tuple(int(d) for d in dims.split(',')) for dims in re.findall(r'f32\[([\d,]+)\]', text)}
  large = sorted((s for s in shapes if sum(d >= 512 for d in s) >= 2 and _size(s) >= LARGE), key=_size, reverse=True)
  return {
      'argument_mb': round(stats.argument_size_in_bytes / 1e6, 1),
      'temp_mb': round(stats.temp_size_in_bytes / 1e6, 1),
      'custom_calls': len(re.findall(r'custom_call_target="specjax_qmatmul"', text)),
      'f32_weights': ['x'.join(map(str, s)) for s in large[:4]],
  }


def _size(shape) -> int:
  out = 1
  for d in shape:
    out *= d
  return out


def run(arm: str, impl: str) -> dict:
  ops.set_impl(impl)
  try:
    model = load_arm(arm)
    out = {'quant': model.quant, 'weight_mb': round(model.param_bytes / 1e6, 1)}
    engine = specjax.Engine(model, max_seq_len=256, drafter=make_drafter('ngram', model), max_draft=4)
    engine.generate(['The capital of France is'], max_new_tokens=2, num_draft=0)
    engine.generate(['The capital of France is'], max_new_tokens=2, num_draft=4)
    for key, exe in engine.executables._cache.items():  # pylint: disable=protected-access
      if key[0] in ('decode', 'spec'):
        out['verify' if key[0] == 'spec' else 'decode'] = describe(exe)
    return out
  finally:
    ops.set_impl('auto')


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--arms', nargs='+', default=['f32', 'auto', 'auto-act8', 'int8', 'int4'])
  ap.add_argument('--json', default=None)
  args = ap.parse_args()
  report = {'date': now(), 'git': git_info(), 'device': device_description(), 'kernel': ops.kernel_status()}
  rows = {}
  for arm in args.arms:
    for impl in ('auto', 'xla') if arm != 'f32' else ('auto',):
      rows[f'{arm}/{impl}'] = row = run(arm, impl)
      print(f'{arm}/{impl}', json.dumps(row), flush=True)
  report['arms'] = rows
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + '\n')


if __name__ == '__main__':
  main()
