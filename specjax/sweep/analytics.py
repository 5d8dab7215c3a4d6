"""From results.jsonl records to per-category tables, acceptance fits, predictions and policy regret.

Acceptance fit (per setting and category, pooled over every cell's steps):
the per-position conditional acceptance beta_i = P(a >= i | a >= i - 1, K >= i),
where `a` is the drafts a step accepted, and the one-parameter geometric
alpha = sum(a) / (sum(a) + #steps with a < K) (the MLE of i.i.d. acceptance).
Predicted tau(K) = 1 + sum_{i <= K} prod_{j <= i} beta_j; predicted speedup of a
run = sum_t tau(K_t) / sum_t T(K_t) * T_AR, with T the measured mean step costs
(autoregressive T_AR from the baseline runs). The oracle best fixed K is the
fixed-K cell with the highest tokens/s; a policy's regret is
1 - its tokens/s / the oracle's. The trace-replay simulator
(`specjax.policies.simulate`) gives the same comparison offline.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

ALL = 'all'


def _steps(records: list[dict]) -> list[tuple[int, int]]:
  return [(k, a) for r in records for k, a in zip(r['k_per_step'], r.get('accepted_per_step', []))]


def fit_acceptance(steps: list[tuple[int, int]]) -> dict:
  """{'alpha', 'conditional' [Kmax], 'steps'} from (K, accepted) pairs."""
  if not steps:
    return {'alpha': None, 'conditional': [], 'steps': 0}
  k = np.array([s[0] for s in steps])
  a = np.array([s[1] for s in steps])
  failures = int((a < k).sum())
  alpha = float(a.sum() / (a.sum() + failures)) if a.sum() + failures else None
  conditional = []
  for i in range(1, int(k.max()) + 1):
    reached = (k >= i) & (a >= i - 1)
    n = int(reached.sum())
    conditional.append(float((a[reached] >= i).mean()) if n else (conditional[-1] if conditional else 0.0))
  return {'alpha': alpha, 'conditional': conditional, 'steps': len(steps)}


def predict_tau(fit: dict, k: int) -> float | None:
  beta = fit['conditional']
  if not beta:
    return None
  beta = beta + [beta[-1]] * max(0, k - len(beta))
  return 1.0 + float(np.cumprod(beta[:k]).sum())


def geometric_tau(alpha: float, k: int) -> float:
  """Leviathan et al.: expected tokens per step with i.i.d. acceptance alpha and depth k."""
  return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _throughput(records: list[dict], key: str) -> tuple[int, float]:
  """(decode tokens, decode seconds) summed over the distinct batches of `records`."""
  seen = {}
  for r in records:
    seen[(r.get(key), r.get('batch'))] = (r['batch_decode_tokens'], r['decode_s'])
  tokens = sum(t for t, _ in seen.values())
  seconds = sum(s for _, s in seen.values())
  return tokens, seconds


def _mean(values) -> float | None:
  values = list(values)
  return float(np.mean(values)) if values else None


def _policy_row(policy: str, cell: dict, records: list[dict], fit: dict, costs: dict, ar: dict) -> dict:
  tokens, seconds = _throughput(records, 'cell')
  tok_s = tokens / seconds if seconds else None
  steps = sum(r['target_steps'] for r in records)
  all_k = [k for r in records for k in r['k_per_step']]
  predicted = None
  if ar['step_s'] and all_k and all(k in costs for k in all_k) and fit['conditional']:
    t_pred = {k: predict_tau(fit, k) for k in set(all_k)}
    predicted = sum(t_pred[k] for k in all_k) / sum(costs[k] for k in all_k) * ar['step_s']
  speedup = tok_s / ar['tok_s'] if tok_s and ar['tok_s'] else None
  return {
      'policy': policy,
      'policy_name': cell['policy_name'],
      'k': cell['k'],
      'candidates': cell['candidates'],
      'tau': sum(r['emitted'] for r in records) / steps if steps else None,
      'tau_predicted': predict_tau(fit, cell['k']) if cell['k'] else None,
      'acceptance': (sum(r['accepted'] for r in records) / max(1, sum(r['drafted'] for r in records))),
      'position_acceptance': _position_acceptance(_steps(records)),
      'tok_s': tok_s,
      'speedup': speedup,
      'predicted': predicted,
      'efficiency': speedup / predicted if speedup and predicted else None,
      'mean_k': _mean(all_k),
      'requests': len(records),
      'trajectories': [(r['prompt_id'], r['k_per_step']) for r in records],
  }


def _position_acceptance(steps: list[tuple[int, int]]) -> list[float]:
  """P(draft i accepted) over steps that drafted at least i."""
  if not steps:
    return []
  k = np.array([s[0] for s in steps])
  a = np.array([s[1] for s in steps])
  return [float((a[k >= i] >= i).mean()) for i in range(1, int(k.max()) + 1)]


def analyze(records: list[dict]) -> dict:
  """{'groups': per (setting, category) tables, 'policies': regret rows, 'greedy_equal': bool | None,
  'side_by_side': `side_by_side(groups)`}."""
  cells = {r['cell']: r for r in records if r['type'] == 'cell'}
  baselines = {(r['baseline'], r['request_id']): r for r in records if r['type'] == 'baseline'}
  grouped: dict[tuple, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
  categories_by_setting = collections.defaultdict(set)
  for r in records:
    if r['type'] != 'request':
      continue
    cell = cells[r['cell']]
    grouped[(cell['setting'], r['category'])][r['cell']].append(r)
    grouped[(cell['setting'], ALL)][r['cell']].append(r)
    categories_by_setting[cell['setting']].add(r['category'])

  groups, policy_rows = [], []
  greedy_equal = None
  for (setting, category), by_cell in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1] == ALL, kv[0][1])):
    if category == ALL and len(categories_by_setting[setting]) < 2:
      continue
    requests = [r for rs in by_cell.values() for r in rs]
    base = [
        baselines[(r['baseline'], r['request_id'])] for r in requests if (r['baseline'], r['request_id']) in baselines
    ]
    base = list({(b['baseline'], b['request_id']): b for b in base}.values())
    ar_tokens, ar_seconds = _throughput(base, 'baseline')
    ar = {
        'tok_s': ar_tokens / ar_seconds if ar_seconds else None,
        'step_s': _mean(s for b in base for s in b['step_s']),
        'requests': len(base),
    }
    ar['step_ms'] = ar['step_s'] * 1e3 if ar['step_s'] else None
    step_costs = collections.defaultdict(list)
    for r in requests:
      for k, s in zip(r['k_per_step'], r['step_s']):
        step_costs[k].append(s)
    costs = {k: float(np.mean(v)) for k, v in step_costs.items()}
    fit = fit_acceptance(_steps(requests))
    rows = [_policy_row(cells[cid]['policy'], cells[cid], rs, fit, costs, ar) for cid, rs in by_cell.items()]
    rows.sort(key=lambda row: (row['k'] is None, row['k'] or 0, row['policy']))
    groups.append(
        {
            'setting': setting,
            'category': category,
            'ar': ar,
            'rows': rows,
            'fit': fit,
            'costs': costs,
            'simulation': simulate_group(by_cell, cells),
            'twins': _twins(rows),
        }
    )
    if category != ALL:
      for cid, rs in by_cell.items():
        if not cells[cid]['greedy']:
          continue
        for r in rs:
          b = baselines.get((r['baseline'], r['request_id']))
          if b is not None:
            greedy_equal = (greedy_equal is not False) and r['tokens'] == b['tokens']
    policy_rows += _regret(groups[-1])
  return {'groups': groups, 'policies': policy_rows, 'greedy_equal': greedy_equal, 'side_by_side': side_by_side(groups)}


def side_by_side(groups: list[dict]) -> dict | None:
  """Every (setting, policy) as a column over the categories, for sweeps of several drafter settings.

  {'columns': [(setting, policy)], 'rows': [(category, [row or None per column])],
  'geomean_speedup': [per column: the geometric mean over the categories ('all' aside), or None]}.
  None when the sweep has one setting (its per-category tables say it all).
  """
  if len({g['setting'] for g in groups}) < 2:
    return None
  columns, categories, cells = [], [], {}
  for g in groups:
    if g['category'] not in categories:
      categories.append(g['category'])
    for row in g['rows']:
      column = (g['setting'], row['policy'])
      if column not in columns:
        columns.append(column)
      cells[(g['category'], column)] = row
  categories.sort(key=lambda c: c == ALL)  # stable: 'all' last
  rows = [(c, [cells.get((c, column)) for column in columns]) for c in categories]
  geomean = []
  for column in columns:
    ups = [cells[(c, column)]['speedup'] for c in categories if c != ALL and (c, column) in cells]
    ok = ups and all(u for u in ups)
    geomean.append(float(np.exp(np.mean(np.log(ups)))) if ok else None)
  return {'columns': columns, 'rows': rows, 'geomean_speedup': geomean}


def _twins(rows: list[dict]) -> list[tuple[str, str, float]]:
  """Policies that ran the very same steps (e.g. load = K=8 at batch 1): their tokens/s gap is timing noise."""
  out = []
  for i, a in enumerate(rows):
    for b in rows[i + 1 :]:
      if a['trajectories'] == b['trajectories'] and a['tok_s'] and b['tok_s']:
        out.append((a['policy'], b['policy'], abs(a['tok_s'] - b['tok_s']) / max(a['tok_s'], b['tok_s'])))
  return out


def _regret(group: dict) -> list[dict]:
  """Each policy's tokens/s against the best fixed K, measured and simulated."""
  rows = group['rows']
  fixed = [r for r in rows if r['policy_name'] == 'fixed' and r['tok_s']]
  adaptive = [r for r in rows if r['policy_name'] != 'fixed']
  if not adaptive and len(fixed) < 2:
    return []
  oracle = max(fixed, key=lambda r: r['tok_s']) if fixed else None
  sim = group['simulation'] or {}
  out = []
  for r in rows:
    s = sim.get(r['policy'], {})
    out.append(
        {
            'setting': group['setting'],
            'category': group['category'],
            'policy': r['policy'],
            'policy_name': r['policy_name'],
            'tok_s': r['tok_s'],
            'oracle_k': oracle['k'] if oracle else None,
            'oracle_tok_s': oracle['tok_s'] if oracle else None,
            'regret': 1 - r['tok_s'] / oracle['tok_s'] if oracle and r['tok_s'] else None,
            'sim_tok_s': s.get('tok_s'),
            'sim_oracle_k': sim.get('_oracle', {}).get('k'),
            'sim_regret': s.get('regret'),
        }
    )
  return out


def _recorded_batches(records: list[dict]) -> list[tuple[list[dict], list[tuple[int, float, int]]]]:
  """Requests grouped by (cell, batch), rows in order, with the batch's (K, seconds, live) steps."""
  by_batch = collections.defaultdict(list)
  for r in records:
    by_batch[(r['cell'], r['batch'])].append(r)
  out = []
  for rows in by_batch.values():
    rows = sorted(rows, key=lambda r: r['row'])
    longest = max(rows, key=lambda r: len(r['k_per_step']))  # a row is live for a prefix of the steps
    out.append((rows, list(zip(longest['k_per_step'], longest['step_s'], longest['live_per_step']))))
  return out


def _widths(rows: list[dict], steps: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
  """(verified width, seconds, live) of a recorded batch's steps."""
  from specjax import policies

  out = []
  for t, (k, seconds, live) in enumerate(steps):
    drafted = [r['drafted_per_step'][t] for r in rows if t < len(r['drafted_per_step'])] or [k]
    out.append((policies.verified_width(k, drafted), seconds, live))
  return out


def _trace(rows: list[dict], steps: list[tuple[int, float, int]]):
  from types import SimpleNamespace
  from specjax import policies

  results = [
      SimpleNamespace(
          tokens=r['tokens'],
          spec=SimpleNamespace(
              accepted_per_step=r['accepted_per_step'],
              # results written before draft counts were recorded: every step drafted K
              drafted_per_step=r.get('drafted_per_step') or r['k_per_step'][: len(r['accepted_per_step'])],
              pending_per_step=r.get('pending_per_step') or [],
          ),
      )
      for r in rows
  ]
  return policies.trace_from_stats(results, SimpleNamespace(steps=steps))


def cell_policy(cell: dict):
  """The policy a cell record ran (rebuilt for replay)."""
  from specjax import policies

  name = cell['policy_name']
  return policies.make_policy(
      name,
      family=cell['family'],
      k=cell['policy_k'],
      candidates=cell['candidates'] if name == 'tuner' else None,
      max_depth=16,
  )


def simulate_group(by_cell: dict[str, list[dict]], cells: dict[str, dict]) -> dict[str, Any] | None:
  """Replays every policy of a group over the traces of its deepest fixed-K cell.

  Step costs come from every recorded step of the group: by verified width
  when the records carry draft counts (`WidthCosts`: a step without drafts
  costs a decode step whatever K), else per K (`StepCosts`: the mean per (K,
  live), interpolated elsewhere). The recorded batches replay in order as
  generate calls, an adaptive policy's state carried from one to the next as
  the sweep does. Returns {policy label: {'tok_s', 'regret'}, '_oracle': {'k',
  'tok_s', 'rates'}}, or None without a fixed-K cell to replay.
  """
  from specjax import policies

  fixed = sorted((cells[c]['k'], c) for c in by_cell if cells[c]['policy_name'] == 'fixed')
  if not fixed:
    return None
  ref = fixed[-1][1]
  traces = [_trace(rows, steps) for rows, steps in _recorded_batches(by_cell[ref])]
  batches = [b for rs in by_cell.values() for b in _recorded_batches(rs)]
  if all('drafted_per_step' in r for rows, _ in batches for r in rows):
    kw = {'width_cost': policies.WidthCosts([w for rows, steps in batches for w in _widths(rows, steps)])}
  else:
    kw = {'cost': policies.StepCosts([s for _, steps in batches for s in steps])}

  def rate(policy) -> float:
    tokens, seconds, state = 0, 0.0, None
    for t in traces:
      run = policies.simulate(policy, t, state=state, **kw)
      tokens, seconds, state = tokens + run.tokens, seconds + run.seconds, run.state
    return tokens / seconds if seconds else 0.0

  candidates = sorted(
      {k for k, _ in fixed}
  )  # the depths measured as fixed cells: the same choice as the measured oracle
  rates = {k: rate(policies.Fixed(k)) for k in candidates}
  best = max(rates, key=lambda k: (rates[k], -k))
  out: dict[str, Any] = {'_oracle': {'k': best, 'tok_s': rates[best], 'rates': rates}}
  for c in by_cell:
    tok_s = rates[cells[c]['k']] if cells[c]['policy_name'] == 'fixed' else rate(cell_policy(cells[c]))
    out[cells[c]['policy']] = {'tok_s': tok_s, 'regret': policies.regret(tok_s, rates[best]) if rates[best] else None}
  return out
