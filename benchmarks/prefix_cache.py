"""The prefix cache side by side: time to first token of a repeated long prompt, and a multi-turn chat's prefill.

  python benchmarks/prefix_cache.py [-m gemma-3-270m] [--prompt-tokens 1024] [--repeats 3] [--turns 8]
      [--max-tokens 32] [--hybrid tests/fixtures/tiny_qwen3_5] [--only-hybrid] [--json out.json]

Two schedulers on one engine (one slot, greedy, no drafter), the cache on and off, compiled ahead (`warmup`),
run alternately:
  * TTFT: a prompt of `--prompt-tokens` tokens (Spec-Bench first turns joined, cut to length) sent `--repeats`
    + 1 times one after another; the first fills the cache, the median TTFT of the rest is reported;
  * chat: `--turns` turns, each prompt the last prompt, its answer and the next Spec-Bench question, each turn
    sent when the last answer is in; prompt tokens prefilled (the prompt's less the cached ones) and wall time.
  * hybrid: the same TTFT and chat for `--hybrid` (default: the tiny Qwen3.5, Gated DeltaNet + attention), whose
    rows restore a snapshot of their recurrent state: a prompt's, or (the chat's next turns) the one a leaving row
    took after its answer (`--only-hybrid`: this part alone).
Outputs are checked equal between the two.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.engine.requests import Request
from specjax.engine.scheduler import Scheduler


def ttft(scheduler: Scheduler, prompt: list[int], repeats: int, max_tokens: int) -> tuple[list[float], list[int]]:
  times, tokens = [], None
  for _ in range(repeats + 1):
    result = scheduler.submit(Request(prompt, max_tokens)).result()
    times.append(result.stats.first_token - result.stats.submitted)
    tokens = tokens or result.tokens
    assert result.tokens == tokens
  return times, tokens


def chat(scheduler: Scheduler, tokenizer, questions: list[str], max_tokens: int) -> dict:
  before = dict(scheduler.counters)
  prompt, outputs, start = tokenizer.encode(questions[0]), [], time.perf_counter()
  for q in questions[1:]:
    result = scheduler.submit(Request(prompt, max_tokens)).result()
    outputs.append(result.tokens)
    prompt = prompt + result.tokens + tokenizer.encode('\n\n' + q)
  wall = time.perf_counter() - start
  looked = scheduler.counters['prefix_lookup_tokens'] - before['prefix_lookup_tokens']
  hit = scheduler.counters['prefix_hit_tokens'] - before['prefix_hit_tokens']
  prompt_tokens = scheduler.counters['prompt_tokens'] - before['prompt_tokens']
  return {
      'wall_s': wall,
      'prompt_tokens': prompt_tokens,
      'prefilled': prompt_tokens - hit if looked else prompt_tokens,
      'outputs': outputs,
  }


def both_chats(schedulers: dict[str, Scheduler], tokenizer, questions: list[str], args, label: str = ''):
  """The chat on the cache-off and cache-on schedulers, outputs checked equal: (each setting's figures, a line)."""
  chats = {name: chat(s, tokenizer, questions[: args.turns + 1], args.max_tokens) for name, s in schedulers.items()}
  assert chats['on']['outputs'] == chats['off']['outputs'], f'{label}chat outputs differ with the cache'
  c_off, c_on = chats['off'], chats['on']
  line = (
      f'{label}{args.turns}-turn chat: {c_off["prefilled"]} prompt tokens prefilled without the cache, '
      f'{c_on["prefilled"]} with it ({c_off["prefilled"] / max(c_on["prefilled"], 1):.1f}x fewer); '
      f'wall {c_off["wall_s"]:.2f} s vs {c_on["wall_s"]:.2f} s'
  )
  return {name: {k: v for k, v in c.items() if k != 'outputs'} for name, c in chats.items()}, line


def chat_capacity(args) -> int:
  """Positions a scheduler needs for the TTFT prompt or the chat's last turn (questions run to ~256 tokens)."""
  return min(args.prompt_tokens + args.turns * (args.max_tokens + 256) + 64, 4096)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('-m', '--model', default='gemma-3-270m')
  p.add_argument('--prompt-tokens', type=int, default=1024)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--turns', type=int, default=8)
  p.add_argument('--max-tokens', type=int, default=32)
  p.add_argument('--hybrid', default=str(ROOT / 'tests/fixtures/tiny_qwen3_5'), help='a hybrid target ("": none)')
  p.add_argument('--only-hybrid', action='store_true')
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  from serve_load import pick_prompts  # pylint: disable=g-import-not-at-top

  questions = [q.text for q in pick_prompts(args.turns + 40)]
  out = {'model': args.model, 'args': vars(args), 'compile_s': {}}
  if args.hybrid:
    out['hybrid'] = hybrid_ttft(specjax.load(args.hybrid), questions, args)
  if not args.only_hybrid:
    out.update(dense(args, questions))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
  return 0


def long_prompt(model, questions: list[str], n: int) -> list[int]:
  long = []
  for q in questions:
    long += model.tokenizer.encode(q + '\n\n')
  if len(long) < n:
    raise SystemExit(f'the joined prompts have {len(long)} tokens, fewer than --prompt-tokens')
  return long[:n]


def hybrid_ttft(model, questions: list[str], args) -> dict:
  """TTFT of the repeated prompt and the chat on a hybrid target, the cache off and on (recurrent-state
  snapshots)."""
  prompt = long_prompt(model, questions, args.prompt_tokens)
  engine = specjax.Engine(model, max_seq_len=args.prompt_tokens + args.max_tokens + 64)
  chat_engine = specjax.Engine(model, max_seq_len=chat_capacity(args))
  schedulers, chat_schedulers = (
      {
          name: Scheduler(e, max_slots=1, max_seq_len=e.max_seq_len, prefix_cache=on)
          for name, on in (('off', False), ('on', True))
      }
      for e in (engine, chat_engine)
  )
  compile_s = {name: s.warmup() for name, s in schedulers.items()}
  compile_s |= {f'chat_{name}': s.warmup() for name, s in chat_schedulers.items()}
  for s in [*schedulers.values(), *chat_schedulers.values()]:
    s.start()
  try:
    runs = {name: ttft(s, prompt, args.repeats, args.max_tokens) for name, s in schedulers.items()}
    chats, chat_line = both_chats(chat_schedulers, model.tokenizer, questions, args, 'hybrid ')
    metrics = schedulers['on'].metrics()
  finally:
    for s in [*schedulers.values(), *chat_schedulers.values()]:
      s.stop()
  assert runs['on'][1] == runs['off'][1], 'hybrid outputs differ with the cache'
  res = {
      name: {'first_s': t[0], 'repeat_s': t[1:], 'median_repeat_s': statistics.median(t[1:])}
      for name, (t, _) in runs.items()
  }
  t_off, t_on = res['off']['median_repeat_s'], res['on']['median_repeat_s']
  print(
      f'hybrid {model.source}: TTFT of a repeated {args.prompt_tokens}-token prompt: {t_off * 1e3:.1f} ms without '
      f'the cache, {t_on * 1e3:.1f} ms with it ({t_off / t_on:.1f}x lower); first (cold) {res["off"]["first_s"] * 1e3:.1f} '
      f'vs {res["on"]["first_s"] * 1e3:.1f} ms; {metrics["prefix_snapshots"]} snapshots, {metrics["prefix_restored"]} restored'
  )
  print(chat_line)
  return {'ttft': res, 'chat': chats, 'compile_s': compile_s, 'metrics_on': metrics}


def dense(args, questions: list[str]) -> dict:
  model = specjax.load(args.model)
  prompt = long_prompt(model, questions, args.prompt_tokens)
  engine = specjax.Engine(model, max_seq_len=4096)
  schedulers = {
      name: Scheduler(engine, max_slots=1, max_seq_len=chat_capacity(args), prefix_cache=on)
      for name, on in (('off', False), ('on', True))
  }
  out = {'compile_s': {}}
  for name, s in schedulers.items():
    out['compile_s'][name] = s.warmup()
    s.start()
  try:
    runs = {name: ttft(s, prompt, args.repeats, args.max_tokens) for name, s in schedulers.items()}
    assert runs['on'][1] == runs['off'][1], 'outputs differ with the cache'
    out['ttft'] = {
        name: {'first_s': t[0], 'repeat_s': t[1:], 'median_repeat_s': statistics.median(t[1:])}
        for name, (t, _) in runs.items()
    }
    out['chat'], chat_line = both_chats(schedulers, model.tokenizer, questions, args)
    out['metrics_on'] = schedulers['on'].metrics()
  finally:
    for s in schedulers.values():
      s.stop()
  t_off, t_on = out['ttft']['off']['median_repeat_s'], out['ttft']['on']['median_repeat_s']
  print(
      f'TTFT of a repeated {args.prompt_tokens}-token prompt: {t_off * 1e3:.0f} ms without the cache, '
      f'{t_on * 1e3:.0f} ms with it ({t_off / t_on:.1f}x lower)'
  )
  print(chat_line)
  return out


if __name__ == '__main__':
  sys.exit(main())
