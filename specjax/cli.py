"""`specjax` command line: a thin layer over the Python API.

specjax generate -m MODEL --prompt TEXT [--prompt-file F [--prompts-per-line]] [--max-new-tokens N]
                 [--temperature T --top-k K --top-p P --min-p M --seed S] [--json]
specjax run -m TARGET [--drafter FAMILY | --mtp] [--draft-model PATH] [--n-predict K] [generate's flags]
specjax bench -m TARGET [--drafter FAMILY | --mtp] [--prompts FILE.jsonl] [--depths K ...]
specjax serve -m TARGET [run's drafter flags | --no-spec] [--host 127.0.0.1] [--port 8000] [--max-slots 8]
              [--api-key KEY] [--served-model-name NAME]
specjax sweep CONFIG [--out DIR] [--backend local|ray|slurm] [--address ADDR] [KEY=VALUE ...]
specjax train CONFIG --out DIR [KEY=VALUE ...]

A user mistake is one `error: ...` line (exit status 2); any other exception one `internal error: ...` line
(exit status 1; SPECJAX_DEBUG=1 raises it with its traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from specjax.errors import SpecjaxError
from specjax.parallel import distributed
from specjax.parallel.mesh import add_mesh_args, mesh_from_args

DEBUG_ENV = 'SPECJAX_DEBUG'  # set (not 0): unexpected exceptions keep their traceback


class _Parser(argparse.ArgumentParser):
  """argparse with its mistakes as one `error:` line (no usage block), exit status 2."""

  def error(self, message: str):
    self.exit(2, f'error: {message} (see {self.prog} --help)\n')


class _Stdout:
  """Streamed text on stdout, remembering whether its last line is unfinished (an error then starts a new one)."""

  open_line = False

  @classmethod
  def write(cls, text: str) -> None:
    if text:
      sys.stdout.write(text)
      sys.stdout.flush()
      cls.open_line = not text.endswith('\n')

  @classmethod
  def end_line(cls) -> None:
    if cls.open_line:
      cls.write('\n')


def _add_model_args(p: argparse.ArgumentParser) -> None:
  p.add_argument(
      '-m',
      '--model',
      required=True,
      help='demo name (gemma-3-270m), local HF directory, .gguf file, or hub id (org/name)',
  )
  p.add_argument('--attention-impl', default='auto', choices=('auto', 'xla', 'pallas'))
  p.add_argument('--page-size', type=int, default=16)
  p.add_argument('--num-pages', type=int, default=None, help='KV page pool size (default: what the batch needs)')
  p.add_argument('--max-seq-len', type=int, default=None, help='capacity of one sequence (prompt + new tokens)')
  p.add_argument(
      '--no-prefix-cache',
      action='store_true',
      help="prefill every prompt in full (default: prompts share the KV pages of repeated prefixes: a server's "
      'requests, and the rows and prompts of one run)',
  )
  p.add_argument(
      '--dtype',
      default=None,
      choices=('float32', 'bfloat16', 'float16'),
      help='params and compute dtype (default: float32 on CPU, bfloat16 on GPU)',
  )
  p.add_argument(
      '--quant',
      default=None,
      choices=('none', 'auto', 'int8', 'int4'),
      help='weight quantization: int8 (a scale per output channel), int4 (a scale per --quant-group inputs), auto '
      "(a GGUF file's own blocks); default none (float; GGUF dequantized)",
  )
  p.add_argument('--quant-group', type=int, default=32, help='inputs per int4 scale (default 32)')
  p.add_argument(
      '--quant-act',
      default='float',
      choices=('float', 'int8'),
      help='activations of the quantized products: float (default), or int8 (a scale per 32 inputs, integer dot '
      'products, as llama.cpp; needs --quant)',
  )
  p.add_argument(
      '--no-quant-embedding',
      dest='quant_embedding',
      action='store_false',
      help='keep the embedding and head in float under --quant',
  )
  add_mesh_args(p)


def _add_generation_args(p: argparse.ArgumentParser) -> None:
  p.add_argument('--prompt', action='append', default=[], help='prompt text (repeat for a batch)')
  p.add_argument(
      '--prompt-file',
      help='the whole file is one prompt (as llama.cpp -f: exact text, one trailing newline dropped); '
      'a .jsonl is a batch, one object per line with "prompt" or "turns"',
  )
  p.add_argument(
      '--prompts-per-line',
      action='store_true',
      help='read --prompt-file as a batch, one prompt per non-blank line (\\n in a line is a newline)',
  )
  p.add_argument('--max-new-tokens', type=int, default=64)
  p.add_argument('--temperature', type=float, default=0.0, help='0 means greedy')
  p.add_argument('--top-k', type=int, default=0)
  p.add_argument('--top-p', type=float, default=1.0)
  p.add_argument('--min-p', type=float, default=0.0)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--json', action='store_true', help='print one JSON object instead of streaming text')
  _add_constraint_args(p)


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
  group = p.add_mutually_exclusive_group()
  group.add_argument('--json-schema', metavar='FILE', help='constrain the output to this JSON Schema (a .json file)')
  group.add_argument('--regex', metavar='R', help='constrain the output to match this regex')
  group.add_argument(
      '--grammar', metavar='FILE', help="constrain the output to this grammar (llguidance's Lark, or llama.cpp GBNF)"
  )
  group.add_argument('--json-object', action='store_true', help='constrain the output to any JSON object')


def read_prompt_file(path: str, per_line: bool = False) -> list[str]:
  """The prompts of a file.

  A `.jsonl` file holds one per line (an object with "prompt" or "turns"). Any other file is one prompt, its
  exact text but for one trailing newline (as llama.cpp's `-f`); with `per_line`, each non-blank line is a
  prompt, in which the two characters `\\n` stand for a newline.
  """
  if not os.path.isfile(path):
    raise SpecjaxError(f'prompt file {path!r} does not exist')
  if path.endswith('.jsonl'):
    from specjax.bench import load_prompts

    prompts = [p.text for p in load_prompts(path)]
  else:
    with open(path, 'rb') as f:
      data = f.read()
    try:
      text = data.decode('utf-8')
    except UnicodeDecodeError as e:
      raise SpecjaxError(f'prompt file {path!r} is not UTF-8 text (byte {e.start})') from None
    if per_line:  # lines end at \n, \r\n or \r (Python's universal newlines)
      lines = text.replace('\r\n', '\n').replace('\r', '\n').split('\n')
      prompts = [line.replace('\\n', '\n') for line in lines if line.strip()]
    else:
      text = text[:-1] if text.endswith('\n') else text
      prompts = [text] if text else []
  if not prompts:
    raise SpecjaxError(
        f'prompt file {path!r} is empty' if not os.path.getsize(path) else f'prompt file {path!r} has no prompt'
    )
  return prompts


def read_prompts(args) -> list[str]:
  prompts = list(args.prompt)
  empty = [i for i, p in enumerate(prompts) if not p]
  if empty:  # as an empty prompt file: nothing to continue
    which = f' (prompt {empty[0] + 1} of {len(prompts)})' if len(prompts) > 1 else ''
    raise SpecjaxError(f'--prompt is empty{which}: give the text to continue')
  if args.prompts_per_line and not args.prompt_file:
    raise SpecjaxError('--prompts-per-line reads --prompt-file; pass --prompt-file FILE')
  if args.prompt_file:
    prompts += read_prompt_file(args.prompt_file, per_line=args.prompts_per_line)
  if not prompts:
    raise SpecjaxError('no prompt: pass --prompt TEXT or --prompt-file FILE')
  return prompts


def sampling_from_args(args):
  from specjax.sampling import SamplingParams

  def read(flag, path):
    try:
      with open(path, encoding='utf-8') as f:
        return f.read()
    except OSError as e:
      raise SpecjaxError(f'{flag} {path!r}: {e.strerror}') from None

  params = SamplingParams(
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      min_p=args.min_p,
      seed=args.seed,
      json_schema=read('--json-schema', args.json_schema) if args.json_schema else None,
      regex=args.regex,
      grammar=read('--grammar', args.grammar) if args.grammar else None,
      json_object=args.json_object,
  )
  params.validate()
  return params


def quant_args(args) -> dict:
  """`load`'s quantization arguments from the flags (a bad combination fails here, before any weight is read)."""
  from specjax.loading import check_quant_act

  check_quant_act(args.quant, args.quant_act)
  return dict(
      quant=args.quant,
      quant_group=args.quant_group,
      quant_embedding=args.quant_embedding,
      quant_act=args.quant_act,
  )


def cmd_generate(args) -> int:
  prompts = read_prompts(args)
  sampling = sampling_from_args(args)
  if args.max_new_tokens < 1:
    raise SpecjaxError(f'--max-new-tokens must be at least 1, got {args.max_new_tokens}')
  import specjax

  model = specjax.load(
      args.model, attention_impl=args.attention_impl, dtype=args.dtype, mesh=mesh_from_args(args), **quant_args(args)
  )
  engine = specjax.Engine(
      model,
      page_size=args.page_size,
      num_pages=args.num_pages,
      max_seq_len=args.max_seq_len,
      prefix_cache=False if args.no_prefix_cache else None,
  )
  return _generate_and_print(args, model, engine, prompts, sampling, num_draft=0)


def _generate_and_print(args, model, engine, prompts, sampling, num_draft: int) -> int:
  if sampling.constraint is not None:  # a bad schema, regex or grammar: an error before the prompt is echoed
    from specjax.grammar import compile_constraint

    compile_constraint(model, sampling.constraint)
  stream = None
  if not args.json and len(prompts) == 1:
    _Stdout.write(prompts[0])
    stream = lambda row, text: _Stdout.write(text)
  results, stats = engine.generate(
      prompts,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      stream=stream,
      num_draft=num_draft,
      trace=getattr(args, 'trace', False),
  )
  if args.json:
    rows = []
    for r in results:
      row = {'text': r.text, 'tokens': r.tokens, 'prompt_tokens': r.prompt_tokens, 'finish_reason': r.finish_reason}
      if r.spec is not None:
        row['spec'] = {'drafter': engine.drafter.name, **r.spec.to_json()}
      if r.trace is not None:
        row['trace'] = r.trace
      rows.append(row)
    timing = {
        'tokens_per_s': stats.tokens_per_s,
        'decode_tokens_per_s': stats.decode_tokens_per_s,
        'prefill_s': stats.prefill_s,
        'decode_s': stats.decode_s,
        'compile_s': stats.compile_s,
        'cached_tokens': stats.cached_tokens,  # prompt tokens the prefix cache held (rows sharing a prefix)
    }
    if num_draft:
      timing['step_depths'] = [k for k, _, _ in stats.steps]  # K of every step (policies vary it)
    out = {**rows[0], **timing} if len(rows) == 1 else {'results': rows, **timing}
    out['model'] = model.source
    print(json.dumps(out, ensure_ascii=False))
  elif len(prompts) == 1:
    _Stdout.write('\n')
    extra = f', tau {results[0].spec.tau:.2f}' if results[0].spec else ''
    print(f'[{stats.generated_tokens} tokens, {stats.tokens_per_s:.1f} tok/s{extra}]', file=sys.stderr)
  else:
    for prompt, r in zip(prompts, results):
      print(prompt + r.text)
      print('---')
  return 0


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
  from specjax.drafters import REGISTRY
  from specjax.drafters.registry import option_fields

  families = [f for name, f in REGISTRY.items() if '+' not in name]
  p.add_argument(
      '--drafter',
      metavar='FAMILY',
      default=None,
      help=f'drafter family, one of {", ".join(REGISTRY)} (default: with --draft-model the family its config.json '
      'architectures name, else draft-model; without, ngram): '
      + '; '.join(f'{f.name}: {f.help}' for f in families)
      + '; ngram+FAMILY: n-gram prompt lookup where it matches, else FAMILY',
  )
  p.add_argument(
      '--n-predict',
      '--mtp-n-predict',
      dest='n_predict',
      type=int,
      default=None,
      help="draft depth K per step (default: the checkpoint's own where it names one, else the family's: "
      + ', '.join(f'{f.name} {"min(block_size - 1, 7)" if f.name == "dflash" else f.default_depth}' for f in families)
      + "; ngram+FAMILY: FAMILY's; at most --max-draft); --mtp-n-predict is the mistral.rs spelling",
  )
  p.add_argument(
      '--mtp',
      action='store_true',
      help="draft with the checkpoint's built-in MTP head (Qwen3.5 / Qwen3-Next mtp.*; same as --drafter mtp)",
  )
  p.add_argument('--max-draft', type=int, default=8, help='largest K the engine reserves lookahead for')
  for name, field in option_fields().items():  # each family's options, from the registry
    meta = field.metadata
    p.add_argument(*meta['flags'], dest=name, type=meta['type'], default=None, help=meta['help'])
  p.add_argument(
      '--policy',
      choices=('fixed', 'tuner', 'load'),
      default=None,
      help='draft-depth policy (default: fixed at --n-predict); SPECJAX_POLICY overrides it',
  )
  p.add_argument(
      '--candidates',
      default=None,
      metavar='K1,K2,...',
      help="the tuner's depths (default: the drafter family's); 0 is speculation off (a plain decode step)",
  )
  p.add_argument(
      '--policy-option',
      action='append',
      default=[],
      metavar='KEY=VALUE',
      help='a policy option, repeatable: load reduced=0 (off above the threshold) threshold=8; tuner '
      'explore_every=32 margin=0.02 alpha=0.1 ...',
  )
  p.add_argument(
      '--profile', action='store_true', help='time draft and verify separately (one extra host sync per step)'
  )
  p.add_argument(
      '--trace',
      action='store_true',
      help='with --json: add `trace`, one entry per step: k, drafts (target ids), accepted, emitted',
  )


def drafter_kind(args) -> str:
  """The drafter family the flags ask for (checked before any model is read)."""
  from specjax.drafters import REGISTRY, get
  from specjax.drafters.registry import checkpoint_family, option_fields

  mtp = getattr(args, 'mtp', False)
  if mtp and args.drafter not in (None, 'mtp'):
    raise SpecjaxError(f'--mtp drafts with the built-in MTP head; it cannot be combined with --drafter {args.drafter}')
  if mtp:
    kind = 'mtp'
  elif args.drafter or not args.draft_model:
    kind = args.drafter or 'ngram'
  else:  # --draft-model / --mtp-model alone: the family its local config.json's architectures name
    kind = checkpoint_family(args.draft_model) or 'draft-model'
  family = get(kind)
  own = {f.name for f in dataclasses.fields(family.options)}
  for name, f in option_fields().items():
    if name not in own and getattr(args, name, None) is not None:
      owners = [o.name for o in REGISTRY.values() if name in {g.name for g in dataclasses.fields(o.options)}]
      owners = [o for o in owners if '+' not in o] + (['ngram+<family>'] if any('+' in o for o in owners) else [])
      raise SpecjaxError(f'{f.metadata["flags"][0]} is an option of --drafter {", ".join(owners)}, not {kind}')
  return kind


def default_depth(args) -> int:
  """K when --n-predict is not given, before the drafter is built: the drafter family's default."""
  from specjax.drafters import get

  return get(drafter_kind(args)).default_depth


def load_engine(args, drafting: bool = True):
  """(model, engine, drafter options) for the flags; bad drafter options fail before any weight is read.

  `drafting=False`: the engine has no drafter (options None).
  """
  import specjax
  from specjax.drafters import get, make_drafter

  family = options = None
  if drafting:
    kind = drafter_kind(args)
    family = get(kind)
    options = family.make_options(**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(family.options)})
  heads = {h: True for h in family.heads_for(options)} if family else {}  # e.g. mtp=True: its MTP head too
  mesh = mesh_from_args(args)
  model = specjax.load(
      args.model, attention_impl=args.attention_impl, dtype=args.dtype, mesh=mesh, **heads, **quant_args(args)
  )
  engine = specjax.Engine(
      model,
      page_size=args.page_size,
      num_pages=args.num_pages,
      max_seq_len=args.max_seq_len,
      drafter=make_drafter(kind, model, options) if drafting else None,
      max_draft=max(args.max_draft, args.n_predict or 0),
      profile=getattr(args, 'profile', False),
      prefix_cache=False if args.no_prefix_cache else None,
  )
  return model, engine, options


def depth_flag(args) -> int:
  """K from --n-predict or the drafter family's default, checked before any model is read."""
  k = default_depth(args) if args.n_predict is None else args.n_predict
  if k < 1:
    raise SpecjaxError(f'--n-predict must be at least 1, got {k}')
  policy_flags(args)
  return k


def depth_policy(args, engine, options, k: int):
  """What the engine drafts at: K (the drafter's own default or else the family's when --n-predict is not given,
  capped: what Engine.generate uses), or the --policy / SPECJAX_POLICY depth policy."""
  if args.n_predict is None:
    k = engine.default_depth(fallback=k)
  candidates, policy_options = policy_flags(args)
  if args.policy or os.environ.get('SPECJAX_POLICY'):
    from specjax.policies import make_policy

    return make_policy(
        args.policy or 'fixed',
        family=engine.drafter.name,
        k=args.n_predict,
        candidates=candidates,
        options=options,
        max_depth=engine.max_draft,
        **policy_options,
    )
  return k


def policy_flags(args) -> tuple[tuple[int, ...] | None, dict]:
  """--candidates and --policy-option, parsed and checked against --policy before any work."""
  if (args.candidates or args.policy_option) and not (args.policy or os.environ.get('SPECJAX_POLICY')):
    raise SpecjaxError('--candidates and --policy-option need --policy')
  if args.candidates and args.policy not in (None, 'tuner'):
    raise SpecjaxError(f"--candidates are the tuner's depths; --policy {args.policy} takes --n-predict")
  candidates = None
  if args.candidates:
    try:
      candidates = tuple(int(x) for x in args.candidates.split(','))
    except ValueError:
      raise SpecjaxError(f'--candidates takes integers like 0,2,4, got {args.candidates!r}') from None
    from specjax.policies import check_candidates

    check_candidates(candidates, max(max(candidates), 1), off=True)  # the drafter's limit is checked at load
  options = {}
  for item in args.policy_option:
    key, eq, value = item.partition('=')
    if not eq or not key.strip():
      raise SpecjaxError(f'--policy-option takes KEY=VALUE, got {item!r}')
    try:
      options[key.strip()] = int(value)
    except ValueError:
      try:
        options[key.strip()] = float(value)
      except ValueError:
        raise SpecjaxError(f'--policy-option {key.strip()} takes a number, got {value!r}') from None
  if args.policy and not os.environ.get('SPECJAX_POLICY'):
    from specjax.policies.env import check_policy_options

    check_policy_options(args.policy, options)
  return candidates, options


def cmd_run(args) -> int:
  prompts = read_prompts(args)
  sampling = sampling_from_args(args)
  k = depth_flag(args)
  if args.max_new_tokens < 1:
    raise SpecjaxError(f'--max-new-tokens must be at least 1, got {args.max_new_tokens}')
  model, engine, options = load_engine(args)
  return _generate_and_print(args, model, engine, prompts, sampling, num_draft=depth_policy(args, engine, options, k))


SERVE_EXTRA = 'pip install -e ".[serve]" in a specjax clone, or pip install "specjax[serve]"'
API_KEY_ENV = 'SPECJAX_API_KEY'


def cmd_serve(args) -> int:
  try:
    import uvicorn

    from specjax import serve
  except ImportError as e:
    raise SpecjaxError(f'serving needs fastapi, uvicorn and jinja2 ({e.name} is missing): {SERVE_EXTRA}') from None
  from specjax.engine.scheduler import Scheduler, check_row_buckets

  if args.max_slots < 1:
    raise SpecjaxError(f'--max-slots must be at least 1, got {args.max_slots}')
  check_row_buckets(args.row_buckets, args.max_slots)
  if args.prefix_snapshot_every < 1:
    raise SpecjaxError(f'--prefix-snapshot-every must be at least 1 page, got {args.prefix_snapshot_every}')
  if not 0 < args.port < 65536:
    raise SpecjaxError(f'--port must be in 1..65535, got {args.port}')
  api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
  if args.no_spec and (args.drafter or args.draft_model or args.mtp or args.n_predict or args.policy):
    raise SpecjaxError('--no-spec serves without a drafter; drop the drafter flags')
  k = None if args.no_spec else depth_flag(args)
  model, engine, options = load_engine(args, drafting=not args.no_spec)
  depth = 0 if args.no_spec else depth_policy(args, engine, options, k)
  scheduler = Scheduler(
      engine,
      max_slots=args.max_slots,
      num_pages=args.num_pages,
      max_seq_len=args.max_seq_len,
      num_draft=depth,
      prefix_cache=False if args.no_prefix_cache else None,
      prefix_snapshot_every=args.prefix_snapshot_every,
      row_buckets=args.row_buckets,
  )
  name = args.served_model_name or args.model
  app = serve.app(scheduler, api_key=api_key, model_name=name)
  host = f'[{args.host}]' if ':' in args.host else args.host
  if api_key is None and args.host not in ('127.0.0.1', 'localhost', '::1'):
    print(f'warning: serving on {args.host} without an API key (--api-key or {API_KEY_ENV})', file=sys.stderr)
  if args.warmup != 'none':
    n = len(scheduler.executable_set(sampled=args.warmup == 'all')) - 3
    print(f'specjax serve: compiling {n} step and prefill executables ...', file=sys.stderr, flush=True)
    print(f'specjax serve: compiled in {scheduler.warmup(sampled=args.warmup == "all"):.0f} s', file=sys.stderr)
  scheduler.start()
  try:
    drafter = f'drafter {engine.drafter.name}' if engine.drafter else 'no drafter'
    print(
        f'specjax serve: {name} ({drafter}, {args.max_slots} slots, prefix cache {scheduler.prefix_note}) at '
        f'http://{host}:{args.port}/v1',
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
  finally:
    scheduler.stop()
  return 0


def cmd_bench(args) -> int:
  from specjax import bench

  sampling = sampling_from_args(args)
  from specjax.drafters import get

  depths = args.n_predict_list or ([args.n_predict] if args.n_predict else list(get(drafter_kind(args)).depths))
  args.max_draft = max(args.max_draft, *depths)
  prompts = bench.load_prompts(args.prompts, args.categories, args.limit)
  if not prompts:
    raise SpecjaxError(f'no prompts selected from {args.prompts or "Spec-Bench question.jsonl"}')
  model, engine, options = load_engine(args)
  if not (args.n_predict_list or args.n_predict):  # the family's depths, capped by what the drafter drafts
    depths = sorted({min(k, engine.max_draft) for k in depths})
  for k in depths:
    engine.check_depth(k)

  def progress(n, total, prompt, k, stats):
    print(
        f'[{n + 1}/{total}] {prompt.category} #{prompt.id} K={k}: {stats.decode_tokens_per_s:.1f} tok/s',
        file=sys.stderr,
        flush=True,
    )

  report = bench.run_bench(
      engine,
      prompts,
      depths,
      max_new_tokens=args.max_new_tokens,
      sampling=sampling,
      progress=None if args.quiet else progress,
  )
  rows = bench.table(report, get(drafter_kind(args)).describe(options))
  if args.json:
    calibration = {f'{prompt_id}/K={k}': v for (prompt_id, k), v in report['calibration'].items()}
    print(
        json.dumps(
            {
                'rows': rows,
                'calibration': calibration,
                'greedy_outputs_equal': report['outputs_equal'],
                'model': model.source,
            }
        )
    )
  else:
    print(bench.format_table(rows))
    if sampling.is_greedy:
      print(f"\nspeculative outputs equal autoregressive: {report['outputs_equal']}")
  return 0


def cmd_sweep(args) -> int:
  from specjax.sweep import parse_overrides, run_sweep

  out = args.out or os.path.join('runs', os.path.splitext(os.path.basename(args.config))[0])
  slurm = parse_overrides(args.slurm_option) if args.slurm_option else None
  report = run_sweep(
      args.config,
      out,
      args.overrides,
      progress=not args.quiet,
      backend=args.backend,
      address=args.address,
      workers=args.workers,
      retries=args.retries,
      slurm_options=slurm,
  )
  print(
      f"{report['cells_run']} cells run, {report['cells_skipped']} already complete; "
      f"results in {out}/ (summary.md, results.jsonl, manifest.json, {len(report['plots'])} plots)"
  )
  return 0


def cmd_train(args) -> int:
  from specjax.train import run_training

  report = run_training(args.config, args.out, args.overrides, progress=not args.quiet)
  ev = report['eval']
  done, steps = report['step'], report['steps']
  if done == report['start_step']:  # no step ran in this invocation
    if steps == 0:
      print(f"train.steps=0: the initial drafter exported to {report['export']}/")
    elif done >= steps:
      print(f"already trained: {done} of {steps} steps in {args.out}; nothing to do (drafter in {report['export']}/)")
    else:
      print(f'already at step {done} of {steps} in {args.out} (train.stop_after); nothing to do until it is raised')
    return 0
  print(
      (f'trained {steps} steps' if done == steps else f'trained to step {done} of {steps} (rerun to resume)')
      + f" (from step {report['start_step']}); loss {report['loss']}; "
      + (f"eval τ ≈ {ev['tau']:.2f}; " if ev else '')
      + (f"{report['tokens_per_s']:,.0f} tokens/s; " if report['tokens_per_s'] else '')
      + f"drafter in {report['export']}/ (metrics.jsonl, curves.png, manifest.json in {args.out}/)"
  )
  return 0


def build_parser() -> argparse.ArgumentParser:
  from specjax.drafters import REGISTRY
  from specjax.train.trainers import TRAINERS

  parser = _Parser(prog='specjax', description='Speculative decoding research framework (JAX).')
  sub = parser.add_subparsers(dest='command', required=True)
  gen = sub.add_parser('generate', help='autoregressive generation')
  _add_model_args(gen)
  _add_generation_args(gen)
  gen.set_defaults(func=cmd_generate)
  run = sub.add_parser('run', help='speculative generation')
  _add_model_args(run)
  _add_generation_args(run)
  _add_drafter_args(run)
  run.set_defaults(func=cmd_run)
  serve = sub.add_parser('serve', help='an OpenAI-compatible HTTP server (continuous batching; the serve extra)')
  _add_model_args(serve)
  _add_drafter_args(serve)
  serve.add_argument('--no-spec', action='store_true', help='no drafter: every request decodes autoregressively')
  serve.add_argument('--host', default='127.0.0.1', help='address to bind (default: this machine only)')
  serve.add_argument('--port', type=int, default=8000)
  serve.add_argument('--max-slots', type=int, default=8, help='requests decoded together (batch rows)')
  serve.add_argument(
      '--row-buckets',
      type=int,
      nargs='+',
      metavar='N',
      help='sub-batch sizes a step runs at, the largest --max-slots (default: powers of two); fewer buckets, fewer '
      'executables to compile',
  )
  serve.add_argument(
      '--prefix-snapshot-every',
      type=int,
      default=8,
      metavar='N',
      help='hybrid targets: snapshot the recurrent state every N pages of a prefill, for the prefix cache',
  )
  serve.add_argument(
      '--api-key',
      default=None,
      help=f'clients must send Authorization: Bearer KEY (default: ${API_KEY_ENV}, else none)',
  )
  serve.add_argument('--served-model-name', default=None, help='the model name clients send (default: -m as given)')
  serve.add_argument(
      '--warmup',
      default='greedy',
      choices=('none', 'greedy', 'all'),
      help='compile the steps and prefills before serving: greedy ones (default), all (sampled too), or none',
  )
  serve.add_argument('--log-level', default='warning', choices=('critical', 'error', 'warning', 'info', 'debug'))
  serve.set_defaults(func=cmd_serve)
  bench = sub.add_parser('bench', help='autoregressive vs speculative on a prompt set, per category')
  _add_model_args(bench)
  _add_drafter_args(bench)
  bench.add_argument(
      '--prompts',
      default=None,
      help='jsonl with "prompt"/"turns" and "category" (default: Spec-Bench question.jsonl from '
      '$SPECJAX_SPEC_BENCH, else the user cache, else downloaded at a pinned commit)',
  )
  bench.add_argument('--categories', nargs='+', default=None)
  bench.add_argument('--limit', type=int, default=None, help='prompts per category')
  bench.add_argument(
      '--depths',
      dest='n_predict_list',
      metavar='K',
      type=int,
      nargs='+',
      default=None,
      help="draft depths to compare (default: --n-predict, else the family's tuner candidates: "
      + ', '.join(f'{n} {" ".join(map(str, f.depths))}' for n, f in REGISTRY.items() if '+' not in n)
      + "; ngram+FAMILY: FAMILY's; each capped by what the drafter drafts)",
  )
  bench.add_argument('--max-new-tokens', type=int, default=64)
  bench.add_argument('--temperature', type=float, default=0.0)
  bench.add_argument('--top-k', type=int, default=0)
  bench.add_argument('--top-p', type=float, default=1.0)
  bench.add_argument('--min-p', type=float, default=0.0)
  bench.add_argument('--seed', type=int, default=0)
  bench.add_argument('--json', action='store_true')
  _add_constraint_args(bench)
  bench.add_argument('--quiet', action='store_true')
  bench.set_defaults(func=cmd_bench)
  sweep = sub.add_parser('sweep', help='run every cell of a config grid (resumable) into one output directory')
  sweep.add_argument('config', help='ml_collections config file defining get_config() (see configs/)')
  sweep.add_argument(
      'overrides', nargs='*', metavar='KEY=VALUE', help='overrides, e.g. policy.k=4 prompts.limit=2 grid.policy.k=[2,4]'
  )
  sweep.add_argument('--out', default=None, help='output directory (default: runs/<config file name>)')
  sweep.add_argument('--quiet', action='store_true', help='no progress bar')
  sweep.add_argument(
      '--backend', choices=('local', 'ray', 'slurm'), default='local', help='where cells run (default: this process)'
  )
  sweep.add_argument('--address', default=None, help='Ray cluster address (default: start a local cluster)')
  sweep.add_argument('--workers', type=int, default=None, help='cells at a time (ray, slurm; default: all that fit)')
  sweep.add_argument('--retries', type=int, default=2, help='reruns of a cell whose worker died (ray, slurm)')
  sweep.add_argument(
      '--slurm-option',
      action='append',
      default=[],
      metavar='KEY=VALUE',
      help='submitit parameter, e.g. slurm_partition=gpu timeout_min=60; cluster=local runs local processes',
  )
  sweep.set_defaults(func=cmd_sweep)
  train = sub.add_parser(
      'train', help=f'train a drafter ({", ".join(TRAINERS)}) against a frozen target; rerun to resume'
  )
  train.add_argument('config', help='ml_collections config file defining get_config() (see configs/train_*.py)')
  train.add_argument(
      'overrides', nargs='*', metavar='KEY=VALUE', help='overrides, e.g. train.steps=100 data.path=data.jsonl'
  )
  train.add_argument('--out', required=True, help='output directory (checkpoints, metrics, export/)')
  train.add_argument('--quiet', action='store_true', help='no progress bar')
  train.set_defaults(func=cmd_train)
  for command in sub.choices.values():  # every command runs on one host or several
    distributed.add_distributed_args(command)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra:  # sweep overrides may follow its options: `specjax sweep CONFIG --out DIR key=value ...`
    if args.command in ('sweep', 'train') and all('=' in e and not e.startswith('-') for e in extra):
      args.overrides += extra
    else:
      parser.error(f'unrecognized arguments: {" ".join(extra)}')
  _Stdout.open_line = False
  try:
    distributed.initialize_from_args(args)  # before any backend starts
    return args.func(args)
  except SpecjaxError as e:
    _Stdout.end_line()  # streamed text stops mid-line: the error starts a line of its own
    print(f'error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    _Stdout.end_line()
    return 130
  except Exception as e:
    if os.environ.get(DEBUG_ENV, '') not in ('', '0'):
      raise
    _Stdout.end_line()
    message = ' '.join(str(e).split())  # one line
    what = f'{type(e).__name__}: {message}' if message else type(e).__name__
    print(f'internal error: {what} (please report this; {DEBUG_ENV}=1 shows the traceback)', file=sys.stderr)
    return 1


if __name__ == '__main__':
  sys.exit(main())
