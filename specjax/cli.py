"""`specjax` command line: a thin layer over the Python API.

  specjax generate -m MODEL --prompt TEXT [--prompt-file F] [--max-new-tokens N]
                   [--temperature T --top-k K --top-p P --min-p M --seed S] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax.errors import SpecjaxError


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument('-m', '--model', required=True,
                 help='demo name (gemma-3-270m), local HF directory, .gguf file, or hub id (org/name)')
  p.add_argument('--attention-impl', default='auto', choices=('auto', 'xla', 'pallas'))
  p.add_argument('--page-size', type=int, default=16)
  p.add_argument('--num-pages', type=int, default=None, help='KV page pool size (default: what the batch needs)')
  p.add_argument('--max-seq-len', type=int, default=None, help='capacity of one sequence (prompt + new tokens)')


def _add_generation_args(p: argparse.ArgumentParser) -> None:
  p.add_argument('--prompt', action='append', default=[], help='prompt text (repeat for a batch)')
  p.add_argument('--prompt-file', help='file with one prompt per line (or a .jsonl with a "prompt"/"turns" field)')
  p.add_argument('--max-new-tokens', type=int, default=64)
  p.add_argument('--temperature', type=float, default=0.0, help='0 means greedy')
  p.add_argument('--top-k', type=int, default=0)
  p.add_argument('--top-p', type=float, default=1.0)
  p.add_argument('--min-p', type=float, default=0.0)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--json', action='store_true', help='print one JSON object instead of streaming text')


def read_prompts(args) -> list[str]:
  prompts = list(args.prompt)
  if args.prompt_file:
    if not os.path.isfile(args.prompt_file):
      raise SpecjaxError(f'prompt file {args.prompt_file!r} does not exist')
    with open(args.prompt_file, encoding='utf-8') as f:
      if args.prompt_file.endswith('.jsonl'):
        for n, line in enumerate(f, 1):
          if line.strip():
            try:
              row = json.loads(line)
            except json.JSONDecodeError:
              raise SpecjaxError(f'{args.prompt_file}:{n} is not valid JSON') from None
            text = row.get('prompt') or (row.get('turns') or [None])[0]
            if not isinstance(text, str):
              raise SpecjaxError(f'{args.prompt_file}:{n} has no "prompt" or "turns" text')
            prompts.append(text)
      else:
        prompts += [line.rstrip('\n').replace('\\n', '\n') for line in f if line.strip()]
  if not prompts:
    raise SpecjaxError('no prompt: pass --prompt TEXT or --prompt-file FILE')
  return prompts


def sampling_from_args(args):
  from specjax.sampling import SamplingParams
  params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed)
  params.validate()
  return params


def cmd_generate(args) -> int:
  prompts = read_prompts(args)
  sampling = sampling_from_args(args)
  if args.max_new_tokens < 1:
    raise SpecjaxError(f'--max-new-tokens must be at least 1, got {args.max_new_tokens}')
  import specjax
  model = specjax.load(args.model, attention_impl=args.attention_impl)
  engine = specjax.Engine(model, page_size=args.page_size, num_pages=args.num_pages, max_seq_len=args.max_seq_len)
  stream = None
  if not args.json:
    if len(prompts) == 1:
      sys.stdout.write(prompts[0])
      stream = lambda row, text: (sys.stdout.write(text), sys.stdout.flush())
  results, stats = engine.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, stream=stream)
  if args.json:
    rows = [{
        'text': r.text,
        'tokens': r.tokens,
        'prompt_tokens': r.prompt_tokens,
        'finish_reason': r.finish_reason,
    } for r in results]
    timing = {
        'tokens_per_s': stats.tokens_per_s,
        'decode_tokens_per_s': stats.decode_tokens_per_s,
        'prefill_s': stats.prefill_s,
        'decode_s': stats.decode_s,
        'compile_s': stats.compile_s,
    }
    out = {**rows[0], **timing} if len(rows) == 1 else {'results': rows, **timing}
    out['model'] = model.source
    print(json.dumps(out, ensure_ascii=False))
  elif len(prompts) == 1:
    sys.stdout.write('\n')
    print(f'[{stats.generated_tokens} tokens, {stats.tokens_per_s:.1f} tok/s]', file=sys.stderr)
  else:
    for prompt, r in zip(prompts, results):
      print(prompt + r.text)
      print('---')
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog='specjax', description='Speculative decoding research framework (JAX).')
  sub = parser.add_subparsers(dest='command', required=True)
  gen = sub.add_parser('generate', help='autoregressive generation')
  _add_model_args(gen)
  _add_generation_args(gen)
  gen.set_defaults(func=cmd_generate)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except SpecjaxError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130


if __name__ == '__main__':
  sys.exit(main())
