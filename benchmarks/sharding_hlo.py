"""Collectives of one sharded decode step, read from the compiled HLO (nothing is timed).

For a target at each --tp (forced CPU devices): the decode step's compiled HLO
(the executable the engine runs), its collectives by kind (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute), the bytes each
device sends per step (each collective's result bytes per device), and the
param bytes per device. Also the greedy tokens of a short generation, equal to
the one-device run.

  python benchmarks/sharding_hlo.py -m gemma-3-270m --tp 1 2 4 --json benchmarks/results/sharding_hlo_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
DTYPE_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1, 's64': 8, 'f64': 8}


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO result shape such as 'f32[1,1,640]' or '(f32[2]{0}, s32[2]{0})'."""
  total = 0
  for dtype, dims in re.findall(r'(\w+)\[([\d,]*)\]', shape):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * DTYPE_BYTES.get(dtype, 4)
  return total


def collectives(hlo: str) -> dict:
  """{kind: {'count', 'bytes'}} over the instructions of a compiled HLO module (async pairs counted once)."""
  out = {kind: {'count': 0, 'bytes': 0, 'shapes': []} for kind in COLLECTIVES}
  for line in hlo.splitlines():
    m = re.match(r'\s*(?:ROOT )?%?[\w.-]+ = (.+?) ([\w-]+)\(', line)
    if not m:
      continue
    shape, op = m.groups()
    kind = op.removesuffix('-start')
    if kind in out and not op.endswith('-done'):
      if op.endswith('-start'):  # the start's shape is (operands, results): count the results' half
        shape = shape.split('}, ', 1)[-1] if shape.startswith('((') else shape
      out[kind]['count'] += 1
      out[kind]['bytes'] += shape_bytes(shape)
      out[kind]['shapes'].append(shape)
  return out


def run(model_spec: str, tps: list[int], prompt: str, new_tokens: int) -> dict:
  import jax
  import numpy as np

  import specjax
  from specjax.parallel.mesh import make_mesh
  from specjax.sampling import SamplingParams
  from specjax.step import decode_step

  rows = []
  reference = None
  for tp in tps:
    mesh = make_mesh(tp=tp) if tp > 1 else None
    model = specjax.load(model_spec, mesh=mesh, dtype='float32')
    engine = specjax.Engine(model)
    results, _ = engine.generate([prompt], max_new_tokens=new_tokens)
    tokens = results[0].tokens
    reference = reference or tokens
    sampling = SamplingParams()
    eos = np.asarray([-1], np.int32)
    eos = jax.numpy.asarray(eos)
    state = engine.prefill([engine.encode([prompt])[0]], 8, sampling, eos)
    exe = engine.executables.get('decode', decode_step, (state, eos), {'sampling': sampling})
    compiled = getattr(exe, 'compiled', exe)
    hlo = compiled.as_text()
    found = collectives(hlo)
    device0 = jax.devices()[0]
    param_bytes = sum(
        sum(s.data.nbytes for s in x.addressable_shards if s.device == device0) for x in jax.tree.leaves(model.params)
    )
    row = {
        'tp': tp,
        'collectives': {k: v['count'] for k, v in found.items()},
        'collective_shapes': {k: v['shapes'] for k, v in found.items() if v['count']},
        'bytes_per_step': sum(v['bytes'] for v in found.values()),
        'param_bytes_per_device': param_bytes,
        'param_bytes_total': model.param_bytes,
        'kv_heads_per_layer': [k for k, _ in model.kv_shapes][:1],
        'tokens': tokens,
        'tokens_equal_tp1': tokens == reference,
    }
    rows.append(row)
    print(
        f'tp={tp}: '
        + ', '.join(f'{k} {v}' for k, v in row['collectives'].items())
        + f"; {row['bytes_per_step']} B/step; params/device {param_bytes / 2**20:.1f} MiB;"
        f" tokens equal: {row['tokens_equal_tp1']}",
        flush=True,
    )
  return {
      'model': model_spec,
      'layers': model.config.num_layers if hasattr(model.config, 'num_layers') else None,
      'prompt': prompt,
      'new_tokens': new_tokens,
      'jax': jax.__version__,
      'backend': jax.default_backend(),
      'rows': rows,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('-m', '--model', default='gemma-3-270m')
  parser.add_argument('--tp', type=int, nargs='+', default=[1, 2, 4])
  parser.add_argument('--prompt', default='The capital of France is')
  parser.add_argument('--new-tokens', type=int, default=8)
  parser.add_argument('--json', default=None)
  args = parser.parse_args(argv)
  flag = f'--xla_force_host_platform_device_count={max(args.tp)}'
  if flag not in os.environ.get('XLA_FLAGS', '') and 'jax' not in sys.modules:
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + flag).strip()
  result = run(args.model, args.tp, args.prompt, args.new_tokens)
  if args.json:
    os.makedirs(os.path.dirname(args.json) or '.', exist_ok=True)
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
