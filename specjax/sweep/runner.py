"""Runs a sweep: every cell of the grid, resumable, into one output directory.

Per cell: the model, drafter and `Engine` come from caches shared across cells
(one engine per (model, drafter, page size), sized for the largest K any cell
asks of it). Prompts run `batch_size` at a time (never mixing categories), each
request keyed by its row in the prompt file, so its random draws do not depend
on the batch. Every batch is also decoded autoregressively once per (prompts,
sampling, budget): that baseline is shared by every cell that needs it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time
from typing import Any

from specjax.bench import Prompt, load_prompts
from specjax import provenance
from specjax.datasets import spec_bench_path
from specjax.errors import SpecjaxError
from specjax.sampling import SamplingParams
from specjax.sweep import analytics, artifacts, plots as plots_lib
from specjax.sweep.config import Cell, SweepConfig, expand, resolve


def _sampling(cell: Cell) -> SamplingParams:
  s = cell.section('sampling')
  params = SamplingParams(
      temperature=s['temperature'], top_k=s['top_k'], top_p=s['top_p'], min_p=s['min_p'], seed=s['seed']
  )
  return params.validate()


def _family(cell: Cell):
  from specjax.drafters import REGISTRY

  kind = cell.section('drafter')['kind']
  if kind not in REGISTRY:
    raise SpecjaxError(f'unknown drafter {kind!r} in cell {cell.label} (choose from {", ".join(REGISTRY)})')
  return REGISTRY[kind]


def drafter_options(cell: Cell):
  """The cell's drafter options (its family's fields of the drafter section), validated."""
  family, d = _family(cell), cell.section('drafter')
  return family.make_options(**{f.name: d[f.name] for f in dataclasses.fields(family.options)})


def drafter_key(cell: Cell) -> tuple:
  family, d = _family(cell), cell.section('drafter')
  return (family.name,) + tuple(d[f.name] for f in dataclasses.fields(family.options))


def drafter_label(cell: Cell) -> str:
  return _family(cell).describe(drafter_options(cell))


def _max_depth(cell: Cell) -> int:
  return _family(cell).max_depth(drafter_options(cell))


def make_cell_policy(cell: Cell):
  """The cell's depth policy, checked against its drafter's depth limit."""
  from specjax import policies

  if os.environ.get(policies.ENV):
    raise SpecjaxError(
        f'{policies.ENV} is set; a sweep takes its policies from the config (policy.* or grid.policy): unset it'
    )
  p, kind = cell.section('policy'), drafter_key(cell)[0]
  return policies.make_policy(
      p['name'],
      family=kind,
      candidates=tuple(p['candidates']) or None,
      k=p['k'],
      options=drafter_options(cell),
      max_depth=_max_depth(cell),
  )


def policy_label(cell: Cell) -> str:
  p = cell.section('policy')
  if p['name'] == 'fixed':
    return f"K={p['k']}"
  return p['name'] + (f"{{{','.join(map(str, p['candidates']))}}}" if p['candidates'] else '')


def setting_label(cell: Cell) -> str:
  """The drafter plus every other varying value except the policy and the category."""
  parts = [drafter_label(cell)]
  for axis, value in cell.values.items():
    if axis.startswith(('policy', 'drafter', 'prompts.categories')) or axis == 'category':
      continue
    name = {'sampling.temperature': 'T', 'batch_size': 'B'}.get(axis, axis)
    parts.append(
        f'{name}={value}' if not isinstance(value, dict) else f'{name}={{{",".join(map(str, value.values()))}}}'
    )
  return ' '.join(parts)


def setting_labels(cells: list[Cell]) -> dict[str, str]:
  """{cell id: `setting_label`}, with the drafter options that tell apart cells the label alone would pool.

  Two cells whose drafters differ only where the family's label is silent (two
  `draft_model` checkpoints of one family, say) would share a setting, and their
  acceptance, τ and speed would be pooled into one group: each gets the
  options that differ within the group, `name=value`, appended.
  """
  by_label: dict[str, list[Cell]] = collections.defaultdict(list)
  for cell in cells:
    by_label[setting_label(cell)].append(cell)
  labels = {}
  for label, group in by_label.items():
    keys = {cell.id: drafter_key(cell) for cell in group}
    for cell in group:
      labels[cell.id] = label
    if len(set(keys.values())) < 2:
      continue
    for cell in group:
      key, names = keys[cell.id], ('kind',) + tuple(f.name for f in dataclasses.fields(_family(cell).options))
      differ = [
          f'{name}={key[i]}'
          for i, name in enumerate(names)
          if any(len(other) != len(key) or other[i] != key[i] for other in keys.values())
      ]
      labels[cell.id] = ' '.join([label] + differ)
  return labels


def _check_cell(cell: Cell) -> None:
  c = cell.config
  drafter_key(cell)
  _sampling(cell)
  for key, low in (('max_new_tokens', 1), ('batch_size', 1), ('page_size', 1), ('repeats', 1)):
    if c[key] < low:
      raise SpecjaxError(f'{key} must be at least {low}, got {c[key]} (cell {cell.label})')
  if c['page_size'] & (c['page_size'] - 1):
    raise SpecjaxError(f'page_size must be a power of two, got {c["page_size"]}')
  drafter_options(cell)


class _Prompts:
  """Prompt files, read once; a request id is the prompt's row in its file."""

  def __init__(self):
    self._files: dict[str, tuple[list[Prompt], dict]] = {}

  def select(self, cell: Cell) -> list[tuple[int, Prompt]]:
    p = cell.section('prompts')
    path = spec_bench_path(p['path'])  # None: Spec-Bench
    if path not in self._files:
      rows = load_prompts(path)
      self._files[path] = (rows, {(r.category, r.id): i for i, r in enumerate(rows)})
    rows, index = self._files[path]
    chosen = load_prompts(path, p['categories'] or None, p['limit'])
    if not chosen:
      raise SpecjaxError(f'cell {cell.label} selects no prompts from {path}')
    return [(index[(r.category, r.id)], r) for r in chosen]


def batches(selected: list[tuple[int, Prompt]], size: int) -> list[list[tuple[int, Prompt]]]:
  """Consecutive groups of `size` prompts, one category per group."""
  by_cat: dict[str, list] = {}
  for item in selected:
    by_cat.setdefault(item[1].category, []).append(item)
  return [rows[i : i + size] for rows in by_cat.values() for i in range(0, len(rows), size)]


_MODELS: dict[tuple, Any] = {}
_ENGINES: dict[tuple, Any] = {}


def clear_cache() -> None:
  """Drops the models and compiled engines kept for the next sweep in this process."""
  _MODELS.clear()
  _ENGINES.clear()


class _Workbench:
  """Models, drafters and engines, built once and shared by the cells.

  They stay cached in the process for the next sweep (a rerun or a resume
  compiles nothing); what that sweep does not need is dropped when it starts.
  """

  def __init__(self, cells: list[Cell], cell_policies: dict[str, Any]):
    self.max_draft: dict[tuple, int] = {}
    for cell in cells:
      key = self._base_key(cell)
      self.max_draft[key] = max(self.max_draft.get(key, 1), *cell_policies[cell.id].candidates)
    keys = {self.engine_key(c, b) for c in cells for b in (False, True)}
    # Targets load the heads their cells' drafters need (their baselines share that model).
    self.mtp_models = {
        (c.config['model'], c.config['attention_impl'])
        for c in cells
        if 'mtp' in _family(c).heads_for(drafter_options(c))
    }
    models = {k[:2] for k in keys} | {
        (c.config['drafter.draft_model'], c.config['attention_impl'])
        for c in cells
        if c.config['drafter.kind'] == 'draft-model'
    }
    models = {m + (m in self.mtp_models,) for m in models}
    for key in set(_ENGINES) - keys:
      del _ENGINES[key]
    for key in set(_MODELS) - models:
      del _MODELS[key]

  @staticmethod
  def _base_key(cell: Cell, baseline: bool = False) -> tuple:
    c = cell.config
    return (c['model'], c['attention_impl'], c['page_size'], None if baseline else drafter_key(cell))

  def engine_key(self, cell: Cell, baseline: bool = False) -> tuple:
    key = self._base_key(cell, baseline)
    return key + (0 if baseline else self.max_draft[key],)

  def model(self, spec: str, attention_impl: str):
    mtp = (spec, attention_impl) in self.mtp_models
    key = (spec, attention_impl, mtp)
    if key not in _MODELS:
      import specjax

      _MODELS[key] = specjax.load(spec, attention_impl=attention_impl, mtp=mtp)
    return _MODELS[key]

  def engine(self, cell: Cell, baseline: bool = False):
    key = self.engine_key(cell, baseline)
    if key not in _ENGINES:
      import specjax
      from specjax.drafters import make_drafter

      model_spec, impl, page_size, dkey, max_draft = key
      model = self.model(model_spec, impl)
      drafter = None
      if dkey is not None:
        options = drafter_options(cell)
        if dkey[0] == 'draft-model':  # draft models are cached with the targets
          options = dataclasses.replace(options, draft_model=self.model(options.draft_model, impl))
        drafter = make_drafter(dkey[0], model, options)
      _ENGINES[key] = specjax.Engine(model, page_size=page_size, drafter=drafter, max_draft=max(max_draft, 1))
    return _ENGINES[key]

  def build(self, cells: list[Cell]) -> None:
    """Loads every model and builds every drafter and engine (compatibility errors before any run)."""
    for cell in cells:
      self.engine(cell)
      self.engine(cell, baseline=True)


def _row_record(row: int, result, stats, prompt: Prompt, request_id: int, base: dict) -> dict:
  spec = result.spec
  n = spec.target_steps if spec else max(len(result.tokens) - 1, 0)
  steps = stats.steps[:n]  # a row is live for a prefix of the batch's steps
  record = {
      **base,
      'category': prompt.category,
      'prompt_id': prompt.id,
      'request_id': request_id,
      'row': row,
      'prompt_tokens': result.prompt_tokens,
      'tokens': [int(t) for t in result.tokens],
      'finish_reason': result.finish_reason,
      'k_per_step': [int(k) for k, _, _ in steps],
      'step_s': [float(s) for _, s, _ in steps],
      'live_per_step': [int(live) for _, _, live in steps],
      'decode_s': stats.decode_s,
      'prefill_s': stats.prefill_s,
      'cached_tokens': stats.cached_tokens,  # the batch's prompt tokens found in the prefix cache
      'compile_s': stats.compile_s,
      'batch_rows': stats.rows,
      'batch_decode_tokens': stats.generated_tokens - stats.rows,
  }
  if spec is not None:
    record.update(
        {
            'accepted_per_step': [int(a) for a in spec.accepted_per_step],
            'drafted_per_step': [int(d) for d in spec.drafted_per_step],
            'pending_per_step': [int(p) for p in spec.pending_per_step],
            'target_steps': spec.target_steps,
            'drafted': spec.drafted,
            'accepted': spec.accepted,
            'emitted': spec.emitted,
            'tau': spec.tau,
            'acceptance_rate': spec.acceptance_rate,
            'position_acceptance': spec.position_acceptance,
            'conditional_acceptance': spec.conditional_acceptance,
        }
    )
  if result.trace is not None:
    record['trace'] = result.trace
  return record


class _Progress:

  def __init__(self, total: int, enabled: bool):
    self.bar = None
    if enabled and total:
      from tqdm import tqdm

      self.bar = tqdm(total=total, file=sys.stderr, unit='batch', dynamic_ncols=True, leave=True)

  def step(self, text: str) -> None:
    if self.bar:
      self.bar.set_description_str(text[:60], refresh=False)
      self.bar.update(1)

  def close(self) -> None:
    if self.bar:
      self.bar.close()


def prepare(config, overrides=None) -> tuple[SweepConfig, list[Cell], dict]:
  """Resolves and checks a sweep before any model is loaded: (sweep, cells, policies by cell id)."""
  sweep = resolve(config, overrides)
  cells = expand(sweep)
  if not cells:
    raise SpecjaxError('the sweep has no cells')
  prompts = _Prompts()
  policies = {}
  for cell in cells:
    _check_cell(cell)
    policies[cell.id] = make_cell_policy(cell)
    prompts.select(cell)
  return sweep, cells, policies


BACKENDS = ('local', 'ray', 'slurm')


def run_sweep(
    config,
    out_dir: str,
    overrides=None,
    *,
    progress: bool = True,
    make_plots: bool = True,
    backend: str = 'local',
    address: str | None = None,
    workers: int | None = None,
    retries: int = 2,
    slurm_options: dict | None = None,
) -> dict:
  """Runs every unfinished cell of `config` (a file path, ConfigDict or SweepConfig) into `out_dir`.

  Writes manifest.json, results.jsonl, summary.md and the plots; returns
  {'out_dir', 'manifest', 'analysis', 'cells_run', 'cells_skipped', 'plots'}.
  Cells already complete in `out_dir` are skipped; an `out_dir` holding another
  config's results is refused (SpecjaxError), never overwritten.

  `backend='local'` runs the cells in this process. `'ray'` runs each cell as a
  task on a Ray cluster (`address`; None starts a local one) and `'slurm'` as an
  element of a submitit job array (`slurm_options`: submitit executor parameters;
  `{'cluster': 'local'}` runs the jobs as local processes), `workers` cells at a
  time, each asking for the config's `resources`; a worker that dies is retried
  up to `retries` times. Workers return rows and this process writes them, in the
  order the local backend writes them (`specjax.sweep.backends`).
  """
  if backend not in BACKENDS:
    raise SpecjaxError(f'unknown sweep backend {backend!r} (choose from {", ".join(BACKENDS)})')
  if backend != 'local':
    from specjax.sweep import backends

    backends.require(backend)
    backends.check_options(backend, address=address, workers=workers, retries=retries, slurm_options=slurm_options)
  elif address is not None or slurm_options:
    raise SpecjaxError('address and slurm_options are for the ray and slurm backends; the local backend takes neither')
  sweep, cells, cell_policies = prepare(config, overrides)
  if backend != 'local':
    backends.check_resources(sweep.resources)
  prompts_path = spec_bench_path(sweep.base['prompts.path'])
  prompts_sha = provenance.file_sha256(prompts_path)
  manifest = artifacts.check_out_dir(out_dir, sweep.hash, prompts_sha)
  settings = setting_labels(cells)
  if backend == 'local':
    bench = _Workbench(cells, cell_policies)
    bench.build(cells)
  os.makedirs(out_dir, exist_ok=True)
  started = provenance.now()
  run_info = {
      'started': started,
      'git': provenance.git_info(),
      'device': provenance.device_description(),
      'versions': provenance.package_versions(),
  }
  if backend != 'local':
    run_info['backend'] = backend
  if manifest is None:
    manifest = {
        'name': sweep.base['name'],
        'config_hash': sweep.hash,
        'source': sweep.source,
        'overrides': sweep.pinned,
        'config': sweep.to_dict(),
        'prompts_sha256': prompts_sha,
        'num_cells': len(cells),
        'cells': [{'id': c.id, 'label': c.label, 'values': c.values} for c in cells],
        'seeds': sorted({c.config['sampling.seed'] for c in cells}),
        'started': started,
        'finished': None,
        'runs': [],
    }
  manifest.update({k: run_info[k] for k in ('git', 'device', 'versions')})
  manifest['runs'].append(run_info)
  provenance.write_json(os.path.join(out_dir, provenance.MANIFEST), manifest)

  log = artifacts.ResultsLog(out_dir)
  pending = [c for c in cells if c.id not in log.done_cells]
  prompts = _Prompts()
  plan = {c.id: batches(prompts.select(c), c.config['batch_size']) for c in pending}
  units = [(cell, b, batch) for cell in pending for b, batch in enumerate(plan[cell.id])]
  if sweep.base['interleave']:  # prompt-major: every cell runs a batch before the next batch starts
    first: dict[tuple, int] = {}
    units.sort(key=lambda u: first.setdefault(tuple(rid for rid, _ in u[2]), len(first)))
  # Each baseline is decoded by the first unit that needs it (its rows are written before that unit's).
  owners, owned = set(), set(log.done_baselines)
  for cell, b, batch in units:
    baseline_id = baseline_key(cell, batch)
    if baseline_id not in owned:
      owned.add(baseline_id)
      owners.add((cell.id, b))
  if backend == 'local':
    source = _LocalUnits(bench, cell_policies)
  else:
    order = list(dict.fromkeys(cell.id for cell, _, _ in units))  # cells by their first unit
    source = backends.start(
        backend,
        sweep,
        [(cid, plan[cid], [(cid, b) in owners for b in range(len(plan[cid]))]) for cid in order],
        out_dir=out_dir,
        address=address,
        workers=workers,
        retries=retries,
        slurm_options=slurm_options,
    )
  left = {c.id: len(plan[c.id]) for c in pending}
  seconds = {c.id: 0.0 for c in pending}
  bar = _Progress(len(units), progress)
  try:
    for cell, b, batch in units:
      unit = source.unit(cell, b, batch, (cell.id, b) in owners)
      if unit['baseline'] is not None:
        for record in unit['baseline']:
          log.write(record)
        log.mark_baseline(unit['baseline'][0]['baseline'])
      for record in unit['requests']:
        log.write(record)
      bar.step(f'{cell.label} [{b + 1}/{len(plan[cell.id])}]')
      seconds[cell.id] += unit['seconds']
      left[cell.id] -= 1
      if left[cell.id]:
        continue
      policy, sampling = cell_policies[cell.id], _sampling(cell)
      log.mark_cell(
          {
              'cell': cell.id,
              'values': cell.values,
              'label': cell.label,
              'drafter': drafter_label(cell),
              'setting': settings[cell.id],
              'policy': policy_label(cell),
              'policy_name': cell.config['policy.name'],
              'policy_k': cell.config['policy.k'],
              'family': drafter_key(cell)[0],
              'k': cell.config['policy.k'] if cell.config['policy.name'] == 'fixed' else None,
              'candidates': list(policy.candidates),
              'greedy': sampling.is_greedy,
              'seconds': seconds[cell.id],
          }
      )
  finally:
    bar.close()
    log.close()
    hosts = source.close()

  if hosts:
    run_info['hosts'] = hosts
  manifest['finished'] = run_info['finished'] = provenance.now()
  run_info.update({'cells_run': len(pending), 'cells_skipped': len(cells) - len(pending)})
  provenance.write_json(os.path.join(out_dir, provenance.MANIFEST), manifest)
  records = artifacts.read_results(out_dir)
  for r in records:  # labels of this code, also for cells an earlier run marked
    if r['type'] == 'cell' and r['cell'] in settings:
      r['setting'] = settings[r['cell']]
  analysis = analytics.analyze(records)
  written = plots_lib.write_plots(analysis, out_dir) if make_plots else []
  with open(os.path.join(out_dir, artifacts.SUMMARY), 'w', encoding='utf-8') as f:
    f.write(artifacts.format_summary(analysis, manifest, written))
  return {
      'out_dir': out_dir,
      'manifest': manifest,
      'analysis': analysis,
      'cells_run': len(pending),
      'cells_skipped': len(cells) - len(pending),
      'plots': written,
  }


def run_unit(bench: _Workbench, cell: Cell, b: int, batch, policy, policy_state, owns_baseline: bool):
  """One batch of one cell: ({'baseline': rows | None, 'requests': rows, 'seconds'}, the policy's new state).

  The rows are what results.jsonl gets; `owns_baseline`: this unit also decodes
  the batch autoregressively (the first unit of the sweep that needs that baseline).
  """
  t = time.perf_counter()
  sampling = _sampling(cell)
  ids = [rid for rid, _ in batch]
  baseline_id = baseline_key(cell, batch)
  baseline = _baseline_rows(bench, cell, batch, sampling, baseline_id) if owns_baseline else None
  results, stats, runs = _generate(
      bench.engine(cell), cell, [p.text for _, p in batch], ids, sampling, policy, policy_state
  )
  base = {'type': 'request', 'cell': cell.id, 'baseline': baseline_id, 'batch': b, 'decode_s_runs': runs}
  requests = [
      _row_record(row, result, stats, prompt, rid, base)
      for row, ((rid, prompt), result) in enumerate(zip(batch, results))
  ]
  return {'baseline': baseline, 'requests': requests, 'seconds': time.perf_counter() - t}, stats.policy_state


class _LocalUnits:
  """The local backend: each unit runs in this process when the runner asks for it."""

  def __init__(self, bench: _Workbench, cell_policies: dict[str, Any]):
    self.bench, self.policies = bench, cell_policies
    self.states: dict[str, Any] = {}  # an adaptive policy learns across its cell's batches

  def unit(self, cell: Cell, b: int, batch, owns_baseline: bool) -> dict:
    out, self.states[cell.id] = run_unit(
        self.bench, cell, b, batch, self.policies[cell.id], self.states.get(cell.id), owns_baseline
    )
    return out

  def close(self) -> None:
    return None


def _generate(
    engine, cell: Cell, texts: list[str], ids: list[int], sampling: SamplingParams, num_draft, policy_state=None
):
  """A batch's timed generate calls: the fastest of `repeats` runs counts (all must give the same tokens).

  Every run starts from the same `policy_state` (the cell's policy state after its previous batch); the
  fastest run's final state carries on.

  With `warmup`, a call that compiled anything is run again before the timed
  runs. Tokens never change between runs (draws are keyed by seed, request id
  and position), only the clock does. Returns (results, stats, decode seconds of every timed run).
  """
  kw = dict(max_new_tokens=cell.config['max_new_tokens'], sampling=sampling, request_ids=ids, num_draft=num_draft)
  engine.prefix_cache = None if cell.config['prefix_cache'] else False  # one engine (compiled once) serves both
  if num_draft:
    kw['policy_state'] = policy_state
    kw['trace'] = cell.config['trace']
  results, stats = engine.generate(texts, **kw)
  if cell.config['warmup'] and stats.compile_s > 0:
    results, stats = engine.generate(texts, **kw)
  runs = [stats.decode_s]
  for _ in range(cell.config['repeats'] - 1):
    again, again_stats = engine.generate(texts, **kw)
    if [r.tokens for r in again] != [r.tokens for r in results]:
      raise SpecjaxError(f'cell {cell.label}: a repeated run gave different tokens (request ids {ids})')
    runs.append(again_stats.decode_s)
    if again_stats.decode_s < stats.decode_s:
      results, stats = again, again_stats
  return results, stats, runs


def baseline_key(cell: Cell, batch) -> str:
  """The id of `batch`'s autoregressive baseline: one per (model, prompts, sampling, budget)."""
  c = cell.config
  return provenance.stable_hash(
      {
          'model': c['model'],
          'attention_impl': c['attention_impl'],
          'page_size': c['page_size'],
          'max_new_tokens': c['max_new_tokens'],
          'sampling': cell.section('sampling'),
          'prompts': c['prompts.path'],
          'request_ids': [rid for rid, _ in batch],
      }
  )


def _baseline_rows(bench: _Workbench, cell: Cell, batch, sampling: SamplingParams, baseline_id: str) -> list[dict]:
  """Decodes `batch` autoregressively: its baseline rows."""
  ids = [rid for rid, _ in batch]
  engine = bench.engine(cell, baseline=True)
  results, stats, runs = _generate(engine, cell, [p.text for _, p in batch], ids, sampling, 0)
  base = {'type': 'baseline', 'baseline': baseline_id, 'k': 0, 'decode_s_runs': runs}
  return [
      _row_record(row, result, stats, prompt, rid, base)
      for row, ((rid, prompt), result) in enumerate(zip(batch, results))
  ]
