"""Constrained decoding side by side on the demo model: host cost, and a JSON-extraction set per drafter.

  python benchmarks/grammar.py [-m gemma-3-270m] [--limit 50] [-k 4] [--max-tokens 96] [--batch 8]
      [--arms ar ar+json ngram+json grammar+json grammar+ngram+json] [--json out.json]

1. Host cost with the model's vocabulary: building llguidance's tokenizer; one mask (median); the K + 1 masks of a
   speculative step in one call; the bitmask applied inside jit at batch 1 and `--batch`.
2. The extraction set (`extraction_set`, written here: 5 schemas x 10 passages, a few-shot prompt each; not
   Spec-Bench), greedy, one request at a time, every arm on every prompt in turn: decode tok/s, tau, the share
   of emitted tokens that were grammar-forced drafts, how many forced drafts were accepted, and whether every
   output parses and validates against its schema (`jsonschema`). `ar` is unconstrained; `+json` arms are
   constrained by the prompt's schema.
3. The constraint's overhead at batch `--batch`, K: the step time of constrained n-gram against unconstrained
   n-gram (same shapes, alternating rounds, medians), and the host time in the matchers over the run.
`--parts host overhead set` picks what runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.drafters import make_drafter
from specjax.grammar import RowGrammars, compile_constraint, llg_tokenizer, mask_logits
from specjax.grammar import compile as grammar_compile

COMPACT = {'whitespace_flexible': False}  # llguidance's compact JSON: ',' and ':' with no spaces
SEPARATORS = (',', ':')
SCHEMAS = {
    'person': {
        'type': 'object',
        'properties': {
            'name': {'type': 'string'},
            'age': {'type': 'integer'},
            'city': {'type': 'string'},
            'job': {'type': 'string'},
        },
        'required': ['name', 'age', 'city', 'job'],
        'additionalProperties': False,
    },
    'product': {
        'type': 'object',
        'properties': {
            'product': {'type': 'string'},
            'price': {'type': 'number'},
            'currency': {'enum': ['USD', 'EUR', 'GBP']},
            'in_stock': {'type': 'boolean'},
        },
        'required': ['product', 'price', 'currency', 'in_stock'],
        'additionalProperties': False,
    },
    'event': {
        'type': 'object',
        'properties': {
            'event': {'type': 'string'},
            'date': {'type': 'string', 'pattern': '^[0-9]{4}-[0-9]{2}-[0-9]{2}$'},
            'location': {'type': 'string'},
            'attendees': {'type': 'integer'},
        },
        'required': ['event', 'date', 'location', 'attendees'],
        'additionalProperties': False,
    },
    'book': {
        'type': 'object',
        'properties': {
            'title': {'type': 'string'},
            'author': {'type': 'string'},
            'year': {'type': 'integer'},
            'genres': {'type': 'array', 'items': {'type': 'string'}, 'maxItems': 3},
        },
        'required': ['title', 'author', 'year', 'genres'],
        'additionalProperties': False,
    },
    'weather': {
        'type': 'object',
        'properties': {
            'city': {'type': 'string'},
            'temperature_c': {'type': 'number'},
            'condition': {'enum': ['sunny', 'cloudy', 'rain', 'snow']},
            'wind_kmh': {'type': 'integer'},
        },
        'required': ['city', 'temperature_c', 'condition', 'wind_kmh'],
        'additionalProperties': False,
    },
}
PASSAGES = {
    'person': [
        ('Maria Lopez', 41, 'Seville', 'nurse'),
        ('Tom Becker', 29, 'Hamburg', 'carpenter'),
        ('Aiko Tanaka', 35, 'Osaka', 'architect'),
        ('David Okafor', 52, 'Lagos', 'banker'),
        ('Elena Rossi', 23, 'Turin', 'student'),
        ('Lars Nilsson', 67, 'Uppsala', 'retired teacher'),
        ('Priya Sharma', 38, 'Pune', 'software engineer'),
        ('Jean Dupont', 45, 'Lille', 'chef'),
        ('Sofia Ivanova', 31, 'Sofia', 'journalist'),
        ('Mark Chen', 27, 'Vancouver', 'pilot'),
    ],
    'product': [
        ('wireless headphones', 89.99, 'USD', True),
        ('espresso machine', 249.0, 'EUR', False),
        ('hiking boots', 120.5, 'GBP', True),
        ('mechanical keyboard', 74.95, 'USD', True),
        ('cast iron pan', 39.0, 'EUR', True),
        ('electric scooter', 499.0, 'GBP', False),
        ('yoga mat', 25.0, 'USD', True),
        ('desk lamp', 18.75, 'EUR', False),
        ('rain jacket', 95.0, 'GBP', True),
        ('smart watch', 199.99, 'USD', False),
    ],
    'event': [
        ('Spring Music Festival', '2025-04-12', 'Austin', 850),
        ('Data Science Meetup', '2024-11-03', 'Berlin', 60),
        ('City Marathon', '2025-10-19', 'Chicago', 4200),
        ('Book Fair', '2024-09-21', 'Frankfurt', 1500),
        ('Robotics Workshop', '2025-02-08', 'Zurich', 35),
        ('Food Market', '2024-07-14', 'Lyon', 300),
        ('Chess Open', '2025-06-01', 'Reykjavik', 120),
        ('Film Night', '2024-12-13', 'Dublin', 80),
        ('Startup Pitch Day', '2025-03-27', 'Tel Aviv', 200),
        ('Jazz Evening', '2024-08-30', 'New Orleans', 450),
    ],
    'book': [
        ('The Silent Harbor', 'Anna Berg', 2019, ['mystery', 'thriller']),
        ('Gardens of Mars', 'Luis Ortega', 2022, ['science fiction']),
        ('A Year in Kyoto', 'Emma Hall', 2015, ['travel', 'memoir']),
        ('The Last Algorithm', 'Raj Patel', 2021, ['thriller', 'technology']),
        ('Bread and Salt', 'Olga Petrova', 2008, ['cooking']),
        ('Winter Light', 'Johan Lind', 2012, ['poetry']),
        ('The Copper Crown', 'Nia Adeyemi', 2020, ['fantasy', 'adventure']),
        ('Numbers Everywhere', 'Paul Weiss', 2017, ['science', 'mathematics']),
        ('River of Stars', 'Mei Lin', 2023, ['romance', 'historical']),
        ('Small Engines', 'Carl Moore', 2005, ['technical']),
    ],
    'weather': [
        ('Madrid', 31.5, 'sunny', 12),
        ('Oslo', -4.0, 'snow', 20),
        ('London', 14.0, 'rain', 25),
        ('Cairo', 36.0, 'sunny', 8),
        ('Seattle', 11.5, 'rain', 15),
        ('Moscow', -9.5, 'snow', 10),
        ('Sydney', 22.0, 'cloudy', 18),
        ('Mumbai', 29.0, 'rain', 30),
        ('Denver', 5.0, 'cloudy', 22),
        ('Lisbon', 19.5, 'sunny', 14),
    ],
}
TEMPLATES = {
    'person': '{0} is {1} years old, lives in {2} and works as a {3}.',
    'product': 'The {0} costs {1} {2} and is {3}.',
    'event': 'The {0} takes place on {1} in {2}, with {3} people expected.',
    'book': '"{0}" by {1} was published in {2}; it is shelved under {3}.',
    'weather': 'In {0} it is {1} degrees Celsius and {2}, with wind at {3} km/h.',
}


def _passage(kind: str, fields: tuple) -> str:
  if kind == 'product':
    fields = fields[:3] + ('in stock' if fields[3] else 'sold out',)
  if kind == 'book':
    fields = fields[:3] + (' and '.join(fields[3]),)
  return TEMPLATES[kind].format(*fields)


def _record(kind: str, fields: tuple) -> dict:
  return dict(zip(SCHEMAS[kind]['required'], fields))


def extraction_set(limit: int = 50) -> list[tuple[str, str, dict]]:
  """(kind, prompt, schema) per passage: a two-shot prompt (the first two passages of the same kind answered)
  for each of the kinds' passages in turn, round robin over the kinds, `limit` in all."""
  out = []
  for i in range(len(PASSAGES['person'])):
    for kind, rows in PASSAGES.items():
      shots = [rows[(i + 1) % len(rows)], rows[(i + 2) % len(rows)]]
      lines = ['Extract the fields of each text as JSON.', '']
      for shot in shots:
        lines += [
            f'Text: {_passage(kind, shot)}',
            f'JSON: {json.dumps(_record(kind, shot), separators=SEPARATORS)}',
            '',
        ]
      lines += [f'Text: {_passage(kind, rows[i])}', 'JSON: ']
      out.append((kind, '\n'.join(lines), {**SCHEMAS[kind], 'x-guidance': COMPACT}))
  return out[:limit]


def host_cost(model, k: int, batch: int) -> dict:
  grammar_compile.clear_tokenizers()
  t = time.perf_counter()
  llg_tokenizer(model)
  build_s = time.perf_counter() - t
  kind, prompt, schema = extraction_set(1)[0]
  grammar = compile_constraint(model, ('json_schema', json.dumps(schema)))
  rows = RowGrammars.compile(model, [grammar], 1)
  text = model.tokenizer.encode(json.dumps(_record(kind, PASSAGES[kind][0]), separators=SEPARATORS), add_bos=False)
  one, many = [], []
  for i in range(min(len(text) - k, 24)):
    rows = RowGrammars.compile(model, [grammar], 1)
    rows.commit(np.array([text[:i] or [0]]), np.array([i]))
    t = time.perf_counter()
    rows.bitmask(np.array([True]))
    one.append(time.perf_counter() - t)
    t = time.perf_counter()
    rows.step(np.array([text[i : i + k]]), np.array([k]), np.array([True]))
    many.append(time.perf_counter() - t)
  apply_s = {}
  words = (model.config.vocab_size + 31) // 32
  for b in (1, batch):
    logits = jnp.zeros((b, k + 1, model.config.vocab_size), jnp.float32)
    bitmask = jnp.full((b, k + 1, words), -1, jnp.int32)
    fn = jax.jit(mask_logits)
    fn(logits, bitmask).block_until_ready()
    times = []
    for _ in range(20):
      t = time.perf_counter()
      fn(logits, bitmask).block_until_ready()
      times.append(time.perf_counter() - t)
    apply_s[b] = statistics.median(times)
  return {
      'tokenizer_build_s': build_s,
      'one_mask_us': statistics.median(one) * 1e6,
      f'step_masks_k{k}_us': statistics.median(many) * 1e6,
      'apply_ms': {b: s * 1e3 for b, s in apply_s.items()},
  }


ARMS = {  # arm -> (drafter kind or None, constrained)
    'ar': (None, False),
    'ar+json': (None, True),
    'ngram+json': ('ngram', True),
    'grammar+json': ('grammar', True),
    'grammar+ngram+json': ('grammar+ngram', True),
}


def run_set(model, items, arms: list[str], k: int, max_tokens: int) -> dict:
  engines = {}
  for arm in arms:
    kind, _ = ARMS[arm]
    drafter = make_drafter(kind, model) if kind else None
    engines[arm] = specjax.Engine(model, drafter=drafter, max_draft=k)
  out = {arm: {'tokens': 0, 'decode_s': 0.0, 'steps': 0, 'forced': 0, 'forced_drafted': 0, 'valid': 0} for arm in arms}
  outputs = {}
  for i, (_, prompt, schema) in enumerate(items):
    for arm in arms:
      kind, constrained = ARMS[arm]
      sampling = specjax.SamplingParams(json_schema=schema if constrained else None)
      engine = engines[arm]
      if i == 0:  # compile
        engine.generate([prompt], max_new_tokens=8, sampling=sampling, num_draft=k if kind else 0)
      results, stats = engine.generate(
          [prompt], max_new_tokens=max_tokens, sampling=sampling, num_draft=k if kind else 0
      )
      r, row = results[0], out[arm]
      row['tokens'] += len(r.tokens) - 1
      row['decode_s'] += stats.decode_s
      row['steps'] += stats.decode_steps
      if r.spec:
        row['forced'] += r.spec.forced_accepted
        row['forced_drafted'] += r.spec.forced_drafted
      text = r.text.split('\n')[0]
      try:
        jsonschema.validate(json.loads(text), {k_: v for k_, v in schema.items() if k_ != 'x-guidance'})
        row['valid'] += 1
      except (ValueError, jsonschema.ValidationError):
        pass
      outputs.setdefault(arm, []).append(r.tokens)
  for arm, row in out.items():
    row['tok_s'] = row['tokens'] / row['decode_s'] if row['decode_s'] else 0.0
    row['tau'] = row['tokens'] / row['steps'] if row['steps'] else 0.0
    row['forced_share'] = row['forced'] / row['tokens'] if row['tokens'] else 0.0
    row['forced_accept'] = row['forced'] / row['forced_drafted'] if row['forced_drafted'] else None
  greedy_equal = {arm: outputs[arm] == outputs['ar+json'] for arm in arms if ARMS[arm][1] and 'ar+json' in outputs}
  return {'arms': out, 'constrained_outputs_equal_ar': greedy_equal}


def overhead(model, items, k: int, batch: int, rounds: int = 5, tokens: int = 20) -> dict:
  """Per-step time of n-gram at depth k over `batch` rows, constrained (one schema) and not, in alternating
  rounds of `tokens` tokens (short enough that no constrained row finishes its JSON first); medians."""
  schema = items[0][2]  # one schema for the batch (Engine.generate takes one sampling per call)
  prompts = [p for kind, p, _ in items if kind == items[0][0]][:batch]
  engine = specjax.Engine(model, drafter=make_drafter('ngram', model), max_draft=k)
  arms = {'ngram': specjax.SamplingParams(), 'ngram+json': specjax.SamplingParams(json_schema=schema)}
  step_ms, host = {name: [] for name in arms}, []
  for name, sampling in arms.items():
    engine.generate(prompts, max_new_tokens=8, sampling=sampling, num_draft=k)  # compile
  for _ in range(rounds):
    for name, sampling in arms.items():
      _, stats = engine.generate(prompts, max_new_tokens=tokens, sampling=sampling, num_draft=k)
      step_ms[name].append(stats.decode_s / stats.decode_steps * 1e3)
      if sampling.constraint:
        host.append(stats.grammar_s / (stats.prefill_s + stats.decode_s))
  out = {name: {'step_ms': statistics.median(v), 'rounds': v} for name, v in step_ms.items()}
  out['host_share'] = statistics.median(host)
  out['step_ratio'] = out['ngram+json']['step_ms'] / out['ngram']['step_ms']
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('-m', '--model', default='gemma-3-270m')
  parser.add_argument('--limit', type=int, default=50)
  parser.add_argument('-k', type=int, default=4)
  parser.add_argument('--max-tokens', type=int, default=96)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--arms', nargs='+', default=list(ARMS), choices=list(ARMS))
  parser.add_argument('--parts', nargs='+', default=['host', 'overhead', 'set'], choices=['host', 'overhead', 'set'])
  parser.add_argument('--json', default=None)
  args = parser.parse_args(argv)
  model = specjax.load(args.model)
  items = extraction_set(args.limit)
  report = {'model': model.source, 'cpu': platform.processor() or platform.machine(), 'k': args.k}
  if 'host' in args.parts:
    report['host'] = host_cost(model, args.k, args.batch)
    print(json.dumps(report['host']), flush=True)
  if 'overhead' in args.parts:
    report['overhead'] = overhead(model, items, args.k, args.batch)
    print(json.dumps(report['overhead']), flush=True)
  if 'set' not in args.parts:
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
  report['set'] = run_set(model, items, args.arms, args.k, args.max_tokens)
  base = report['set']['arms'].get('ar+json', {}).get('tok_s')
  print('| arm | tok/s | vs ar+json | tau | forced share | forced accepted | valid JSON |')
  print('|---|---|---|---|---|---|---|')
  for arm, row in report['set']['arms'].items():
    ratio = f'{row["tok_s"] / base:.2f}x' if base else '-'
    accept = '-' if row['forced_accept'] is None else f'{row["forced_accept"]:.3f}'
    print(
        f'| {arm} | {row["tok_s"]:.1f} | {ratio} | {row["tau"]:.2f} | {row["forced_share"]:.3f} | {accept} |'
        f' {row["valid"]}/{len(items)} |'
    )
  print('constrained outputs equal ar+json:', report['set']['constrained_outputs_equal_ar'])
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
