"""What a sweep writes: manifest.json (`specjax.provenance`), results.jsonl (append-only, resumable) and summary.md.

results.jsonl holds one JSON object per line, by `type`:
  request   one request of one cell: tokens, accepted / K / seconds per step, metrics, times
  baseline  the same request decoded autoregressively (K = 0), shared by every cell that runs it
  cell      a cell finished (its request lines are complete): grid values and labels
  baseline_done  a baseline batch finished
Request lines of a cell with no `cell` line (an interrupted run) are dropped on resume and rerun.
"""

from __future__ import annotations

import json
import os

from specjax.errors import SpecjaxError
from specjax.provenance import MANIFEST, read_manifest

RESULTS = 'results.jsonl'
SUMMARY = 'summary.md'
# The fields of results.jsonl that read a clock: the only ones two backends (or two runs) write differently,
# with the manifest's started / finished / runs (which also name each run's backend and worker hosts).
# Fields that depend on the clock or on what the process ran before (the prefix cache's hits), not on the config.
TIMING_FIELDS = ('step_s', 'decode_s', 'prefill_s', 'compile_s', 'decode_s_runs', 'seconds', 'cached_tokens')


def comparable(record: dict) -> dict:
  """A results.jsonl record without its timing fields (what any backend writes identically for fixed policies)."""
  return {k: v for k, v in record.items() if k not in TIMING_FIELDS}


def check_out_dir(out_dir: str, config_hash: str, prompts_sha: str | None) -> dict | None:
  """The existing manifest when `out_dir` holds this config's results; an error when it holds anything else."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise SpecjaxError(f'output path {out_dir!r} exists and is not a directory')
  manifest = read_manifest(out_dir) if os.path.isdir(out_dir) else None
  if manifest is None:
    if os.path.isdir(out_dir) and os.path.exists(os.path.join(out_dir, RESULTS)):
      raise SpecjaxError(
          f'{out_dir} holds a {RESULTS} without a {MANIFEST}; refusing to overwrite it (choose another --out)'
      )
    return None
  if manifest.get('config_hash') != config_hash:
    raise SpecjaxError(
        f'{out_dir} holds results of another config (hash {manifest.get("config_hash")}, this one is '
        f'{config_hash}); choose another --out, or rerun with the same config and overrides to resume'
    )
  if prompts_sha and manifest.get('prompts_sha256') not in (None, prompts_sha):
    raise SpecjaxError(f'{out_dir} was run on a different prompt file (sha256 differs); choose another --out')
  return manifest


class ResultsLog:
  """results.jsonl: completed cells and baselines from earlier runs, and appends for this one."""

  def __init__(self, out_dir: str):
    self.path = os.path.join(out_dir, RESULTS)
    self.done_cells: set[str] = set()
    self.done_baselines: set[str] = set()
    self.dropped = 0
    records = self._read()
    keep = [r for r in records if self._complete(r)]
    self.dropped = len(records) - len(keep)
    if self.dropped or self._torn:
      tmp = self.path + '.tmp'
      with open(tmp, 'w', encoding='utf-8') as f:
        for r in keep:
          f.write(json.dumps(r) + '\n')
      os.replace(tmp, self.path)
    self._file = open(self.path, 'a', encoding='utf-8')

  def _read(self) -> list[dict]:
    self._torn = False
    records = []
    if not os.path.isfile(self.path):
      return records
    with open(self.path, encoding='utf-8') as f:
      for line in f:
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:
          self._torn = True  # a line cut short by an interrupted write
    for r in records:
      if r.get('type') == 'cell':
        self.done_cells.add(r['cell'])
      elif r.get('type') == 'baseline_done':
        self.done_baselines.add(r['baseline'])
    return records

  def _complete(self, r: dict) -> bool:
    if r.get('type') in ('request', 'cell'):
      return r.get('cell') in self.done_cells
    if r.get('type') in ('baseline', 'baseline_done'):
      return r.get('baseline') in self.done_baselines
    return False

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(record) + '\n')
    self._file.flush()

  def mark_cell(self, record: dict) -> None:
    self.write({'type': 'cell', **record})
    os.fsync(self._file.fileno())
    self.done_cells.add(record['cell'])

  def mark_baseline(self, baseline_id: str) -> None:
    self.write({'type': 'baseline_done', 'baseline': baseline_id})
    os.fsync(self._file.fileno())
    self.done_baselines.add(baseline_id)

  def close(self) -> None:
    self._file.close()


def read_results(out_dir: str) -> list[dict]:
  """Every complete record of results.jsonl."""
  path = os.path.join(out_dir, RESULTS)
  if not os.path.isfile(path):
    return []
  records = []
  with open(path, encoding='utf-8') as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  cells = {r['cell'] for r in records if r.get('type') == 'cell'}
  baselines = {r['baseline'] for r in records if r.get('type') == 'baseline_done'}
  return [
      r
      for r in records
      if (r.get('type') in ('request', 'cell') and r.get('cell') in cells)
      or (r.get('type') in ('baseline', 'baseline_done') and r.get('baseline') in baselines)
  ]


# ---------------------------------------------------------------- summary.md


def _fmt(value, spec: str = '.2f', suffix: str = '') -> str:
  if value is None:
    return '–'
  return f'{value:{spec}}{suffix}'


def _side_by_side_lines(table: dict | None) -> list[str]:
  if not table:
    return []
  names = [f'{setting} {policy}' for setting, policy in table['columns']]
  lines = [
      '## Drafters side by side',
      '',
      'τ / speedup over autoregressive per category; last row: geometric mean of the speedups over the categories.',
      '',
      '| category | ' + ' | '.join(names) + ' |',
      '|---|' + '---|' * len(names),
  ]
  for category, rows in table['rows']:
    cells = [f"{_fmt(r['tau'])} / {_fmt(r['speedup'], '.2f', 'x')}" if r else '–' for r in rows]
    lines.append(f'| {category} | ' + ' | '.join(cells) + ' |')
  lines.append('| geomean speedup | ' + ' | '.join(_fmt(g, '.2f', 'x') for g in table['geomean_speedup']) + ' |')
  return lines + ['']


def format_summary(analysis: dict, manifest: dict, plots: list[str]) -> str:
  """summary.md: what ran, per-category tables, acceptance fits and policy regret."""
  git = manifest.get('git', {})
  lines = [
      f"# Sweep `{manifest.get('name', 'sweep')}`",
      '',
      f"- model: `{manifest['config'].get('model')}`; cells: {manifest.get('num_cells')}; "
      f"prompts: `{manifest['config']['prompts']['path'] or 'Spec-Bench question.jsonl'}`",
      f"- config hash `{manifest.get('config_hash')}`; git `{(git.get('commit') or 'none')[:12]}`"
      f"{' (dirty)' if git.get('dirty') else ''}; device: {', '.join(manifest.get('device', {}).get('devices', []))} "
      f"({manifest.get('device', {}).get('cpu_count')} CPUs)",
      f"- started {manifest.get('started')}, finished {manifest.get('finished')}",
      '',
      'τ: emitted tokens per target step (bonus included). tok/s: decode tokens (after the first) over decode '
      'time. speedup: tok/s over autoregressive tok/s on the same requests. predicted: '
      'τ̂(K) · T_AR / T_step(K), with τ̂ from the acceptance fit of the category (per-position conditional '
      'acceptance, pooled over every K) and T the measured mean step costs; measured/predicted below 1 is '
      'cost the model does not capture.',
      '',
  ]
  for group in analysis['groups']:
    lines += [f"## {group['category']} — {group['setting']}", '']
    ar = group['ar']
    lines.append(
        f"autoregressive: {_fmt(ar['tok_s'], '.1f')} tok/s over {ar['requests']} requests "
        f"(mean step {_fmt(ar['step_ms'], '.1f')} ms)"
    )
    lines.append('')
    lines.append('| policy | τ | accept | tok/s | speedup | predicted | measured/predicted | mean K | requests |')
    lines.append('|---|---|---|---|---|---|---|---|---|')
    for row in group['rows']:
      lines.append(
          f"| {row['policy']} | {_fmt(row['tau'])} | {_fmt(row['acceptance'])} | {_fmt(row['tok_s'], '.1f')} | "
          f"{_fmt(row['speedup'], '.2f', 'x')} | {_fmt(row['predicted'], '.2f', 'x')} | "
          f"{_fmt(row['efficiency'])} | {_fmt(row['mean_k'], '.1f')} | {row['requests']} |"
      )
    fit = group['fit']
    lines += [
        '',
        f"acceptance fit: α = {_fmt(fit['alpha'], '.3f')} (geometric), per-position conditional "
        f"[{', '.join(f'{b:.2f}' for b in fit['conditional'])}] over {fit['steps']} steps",
        '',
    ]
  lines += _side_by_side_lines(analysis.get('side_by_side'))
  policies = analysis.get('policies') or []
  if policies:
    lines += [
        '## Policies against the oracle best fixed K',
        '',
        'measured: the best fixed-K cell of the category (highest tok/s). sim: every policy replayed '
        '(`specjax.policies.simulate`) over the acceptance trace recorded at the deepest fixed K, with the '
        'step costs measured in the category (per verified width when draft counts are recorded), the '
        'batches in order with adaptive state carried; sim oracle = the best of the same fixed depths in the '
        'replay. '
        'regret = 1 − tok/s / oracle tok/s; ≤ 5% passes.',
        '',
        '| setting | category | policy | tok/s | oracle K | oracle tok/s | regret | within 5% | '
        'sim tok/s | sim oracle K | sim regret |',
        '|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for p in policies:
      ok = None if p['regret'] is None else ('yes' if p['regret'] <= 0.05 else 'NO')
      lines.append(
          f"| {p['setting']} | {p['category']} | {p['policy']} | {_fmt(p['tok_s'], '.1f')} | "
          f"{_fmt(p['oracle_k'], 'd')} | {_fmt(p['oracle_tok_s'], '.1f')} | {_fmt(p['regret'], '.1%')} | "
          f"{ok or '–'} | {_fmt(p['sim_tok_s'], '.1f')} | {_fmt(p['sim_oracle_k'], 'd')} | "
          f"{_fmt(p['sim_regret'], '.1%')} |"
      )
    lines.append('')
    verdicts = {}
    for p in policies:
      if p['policy_name'] != 'fixed' and p['category'] != 'all' and p['regret'] is not None:
        verdicts.setdefault((p['setting'], p['policy']), []).append(p)
    for (setting, policy), rows in sorted(verdicts.items()):
      ok = sum(p['regret'] <= 0.05 for p in rows)
      worst = max(rows, key=lambda p: p['regret'])
      sim = [p['sim_regret'] for p in rows if p['sim_regret'] is not None]
      replay = f'; in replay within 5% on {sum(r <= 0.05 for r in sim)}/{len(sim)}' if sim else ''
      lines.append(
          f'- **{policy}** ({setting}): within 5% of the measured oracle on {ok}/{len(rows)} categories '
          f"(worst: {worst['category']}, {worst['regret']:.1%} regret){replay}."
      )
    if verdicts:
      lines.append('')
  twins = [(g['setting'], g['category'], t) for g in analysis['groups'] for t in g.get('twins', [])]
  if twins:
    lines += [
        'Timing noise: these policies ran the very same steps on the same requests, so their gap in '
        'tokens/s is measurement noise alone:',
        '',
    ]
    for setting, category, (a, b, gap) in twins:
      lines.append(f'- {setting}, {category}: {a} vs {b}: {gap:.1%}')
    lines.append('')
  equal = analysis.get('greedy_equal')
  if equal is not None:
    lines += [f'Greedy speculative tokens equal autoregressive tokens on every request: {equal}.', '']
  if plots:
    lines += ['## Plots', ''] + [f'![{p}]({p})' for p in plots] + ['']
  return '\n'.join(lines)
