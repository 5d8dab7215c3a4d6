"""Runs the scheduler's prefill body (`specjax.engine.slots.prefill_rows`) in stages over a forced-host-device mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 timeout 60 \
        python experiments/mesh_hybrid_hang/probe.py STAGE ngram|none TP DP

Stages: 0 take_rows + put_rows, 1 + the target's prefill chunk, 2 + the drafter's prefill, 3 + emit (the first
token), 4 + the drafter's start. A stage that prints nothing before the timeout deadlocked. `LP=0` emits without
log-probabilities. The engine's refusal of a hybrid target over a mesh is stepped past on purpose.
"""

import dataclasses
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

import specjax
from specjax.drafters import make_drafter
from specjax.engine import slots
from specjax.engine.scheduler import Scheduler
from specjax.parallel.mesh import make_mesh
from specjax.step import draft_context, emit, prefill_chunk

TARGET = os.path.join(os.path.dirname(__file__), '..', '..', 'tests', 'fixtures', 'tiny_qwen3_5')


def probe(graphdef, params, dparams, state, rows, tokens, query_lens, finish, *, drafter, hidden_size, stage, lp):
  model = nnx.merge(graphdef, params)
  sub = slots.take_rows(state, rows)
  out = jnp.zeros(1)
  if stage >= 1:
    last_hidden = jnp.zeros((rows.shape[0], hidden_size), state.cache.k_pages[0].dtype)
    taps = drafter.taps if drafter else ()
    cache, last_hidden, hidden, tapped = prefill_chunk(
        graphdef, params, sub.cache, tokens, query_lens, last_hidden, taps
    )
    sub = dataclasses.replace(sub, cache=cache)
    out = last_hidden.sum()[None]
  if stage >= 2 and drafter:
    dstate = drafter.prefill(model, dparams, sub.drafter, tokens, query_lens, hidden, tapped)
    sub = dataclasses.replace(sub, drafter=dstate)
  if stage >= 3:
    sampling = dataclasses.replace(sub.row_sampling, is_greedy=True)
    started = emit(model, last_hidden, dataclasses.replace(sub, active=finish), sub.row_eos, sampling, lp)
    started = started[0] if lp else started
    if stage >= 4 and drafter:
      started = dataclasses.replace(started, drafter=drafter.start(dparams, started.drafter, draft_context(started)))
    sub = slots.keep_rows(started, sub, ~finish)
    out = started.last_tokens
  return slots.put_rows(state, sub, rows), out


def main(stage: int, drafter: str, tp: int, dp: int) -> None:
  mesh = make_mesh(tp=tp, dp=dp)
  model = specjax.load(TARGET, mesh=mesh)
  model.mesh = None  # past `Engine`'s refusal
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter('ngram', model) if drafter == 'ngram' else None)
  model.mesh = engine.executables.mesh = mesh
  scheduler = Scheduler(engine, max_slots=2, max_seq_len=64, row_buckets=[2])
  dparams = engine.drafter.params() if engine.drafter else ()
  tokens = np.arange(16, dtype=np.int32)[None] + 5
  args = (dparams, scheduler.state, np.array([0], np.int32), tokens, np.array([16], np.int32), np.array([True]))
  lp = os.environ.get('LP', '1') == '1'
  static = dict(drafter=engine.drafter, hidden_size=model.config.hidden_size, stage=stage, lp=lp)
  start = time.perf_counter()
  _, out = engine.executables.call('probe', probe, args, static, donate=(2,))
  print(f'stage {stage} drafter {drafter} tp {tp} dp {dp}: ok {np.asarray(out).tolist()[:2]}', end=' ')
  print(f'{time.perf_counter() - start:.1f} s', flush=True)


if __name__ == '__main__':
  main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
