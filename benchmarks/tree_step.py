"""What a draft-tree step costs against a chain step of equal depth (EAGLE-3 head, Gemma 3 270M).

  python benchmarks/tree_step.py [--model gemma-3-270m] [--depth 5] [--nodes 16 32 64] [--topk 4]
      [--new-tokens 48] [--rounds 2] [--head DIR] [--json out.json]

An EAGLE-3 head of the shape `configs/train_eagle3_gemma3_270m.py` trains
(random weights unless `--head` names an exported one) drafts a chain of
`--depth` tokens, or an EAGLE-2 tree of that depth with `--nodes` nodes
(`--topk` children per expanded node). The engine runs each configuration on
one prompt with draft / verify timing (`profile`), rounds interleaved; the
table gives the median step time, its draft and verify parts, and the ratio
to the chain step. Acceptance does not enter: the cost of a step is what is
compared, so random weights serve. `--model random` is Gemma 3 270M's shapes
with random weights, for a machine without the demo package (a device with
no network).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.drafters import make_drafter
from specjax.loading import resolve_dtype
from specjax.loading.eagle3 import Eagle3Checkpoint, load_eagle3
from specjax.models.eagle3 import Eagle3Head
from specjax.taps import eagle3_default_taps
from specjax.train.config import resolve
from specjax.train.eagle3 import head_config

PROMPT = 'Write a short story about a robot who learns to paint. Once upon a time,'


def gemma3_270m_random(dtype: str | None = None):
  """Gemma 3 270M's shapes (its GGUF's config) with random weights, and the tiny Gemma 3 fixture's tokenizer."""
  from draft_cost import FIXTURES, random_target  # pylint: disable=g-import-not-at-top

  hf = json.loads((FIXTURES / 'tiny_gemma3' / 'config.json').read_text())
  hf.update(
      vocab_size=262144,
      hidden_size=640,
      intermediate_size=2048,
      num_hidden_layers=18,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=256,
      query_pre_attn_scalar=256,
      sliding_window=512,
      max_position_embeddings=32768,
      layer_types=['full_attention' if (i + 1) % 6 == 0 else 'sliding_attention' for i in range(18)],
  )
  tokenizer = specjax.load(str(FIXTURES / 'tiny_gemma3')).tokenizer
  return random_target(hf, tokenizer, resolve_dtype(dtype))


def random_head(model, draft_vocab: int = 16000) -> Eagle3Checkpoint:
  """A random head shaped as `specjax train` shapes one for this target."""
  config = resolve(ROOT / 'configs' / 'train_eagle3_gemma3_270m.py', {'drafter.draft_vocab_size': draft_vocab})
  cfg = head_config(config, model, eagle3_default_taps(len(model.kv_shapes)))
  graphdef, params = nnx.split(Eagle3Head(cfg, dtype=model.dtype, rngs=nnx.Rngs(0)))
  return Eagle3Checkpoint(cfg, graphdef, params, np.zeros(draft_vocab, np.int32), None, 'random')


def run(engine, k: int) -> dict:
  results, stats = engine.generate([PROMPT], max_new_tokens=engine.new_tokens, num_draft=k)
  spec = results[0].spec
  steps = max(spec.target_steps, 1)
  return {
      'step_ms': 1e3 * stats.decode_s / stats.decode_steps,
      'draft_ms': 1e3 * spec.draft_s / steps,
      'verify_ms': 1e3 * spec.verify_s / steps,
      'nodes': spec.nodes / steps,
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--model', default='gemma-3-270m', help="anything `load` takes, or 'random' (270M's shapes)")
  p.add_argument('--head', default=None, help='an exported EAGLE-3 head (default: random weights)')
  p.add_argument('--depth', type=int, default=5)
  p.add_argument('--nodes', type=int, nargs='+', default=[16, 32, 64])
  p.add_argument('--topk', type=int, default=4)
  p.add_argument('--new-tokens', type=int, default=48)
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)

  model = gemma3_270m_random() if args.model == 'random' else specjax.load(args.model)
  head = load_eagle3(args.head, model) if args.head else random_head(model)
  configs = {'chain': {}} | {f'tree {n}': {'tree_topk': args.topk, 'tree_tokens': n} for n in args.nodes}
  engines = {}
  for name, options in configs.items():
    drafter = make_drafter('eagle3', model, draft_model=head, **options)
    engines[name] = specjax.Engine(model, drafter=drafter, max_draft=args.depth, profile=True)
    engines[name].new_tokens = args.new_tokens
    run(engines[name], args.depth)  # compile
  ar = specjax.Engine(model)
  ar.generate([PROMPT], max_new_tokens=8)
  rows = {name: [] for name in configs}
  ar_ms = []
  for r in range(args.rounds):
    order = list(configs) if r % 2 == 0 else list(configs)[::-1]
    for name in order:
      rows[name].append(run(engines[name], args.depth))
    _, stats = ar.generate([PROMPT], max_new_tokens=args.new_tokens)
    ar_ms.append(1e3 * stats.decode_s / stats.decode_steps)
  med = lambda name, key: statistics.median(x[key] for x in rows[name])
  chain = med('chain', 'step_ms')
  out = {
      'model': args.model,
      'depth': args.depth,
      'topk': args.topk,
      'ar_step_ms': statistics.median(ar_ms),
      'rows': [],
  }
  print(f'AR decode step: {out["ar_step_ms"]:.1f} ms; depth {args.depth}, tree top-k {args.topk}')
  print('| step | nodes verified | step ms | draft ms | verify ms | step / chain step | step / AR step |')
  print('|---|---|---|---|---|---|---|')
  for name in configs:
    row = {k: med(name, k) for k in ('step_ms', 'draft_ms', 'verify_ms', 'nodes')}
    row['name'] = name
    out['rows'].append(row)
    print(
        f'| {name} | {row["nodes"]:.0f} | {row["step_ms"]:.1f} | {row["draft_ms"]:.1f} | {row["verify_ms"]:.1f} | '
        f'{row["step_ms"] / chain:.2f}x | {row["step_ms"] / out["ar_step_ms"]:.2f}x |'
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
