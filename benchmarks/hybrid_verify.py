"""Hybrid targets: what verifying K drafts costs, and what the state slots cost.

  python benchmarks/hybrid_verify.py [--models tiny_qwen3_5 tiny_qwen3_next small]
      [--batch 1 8] [--context 256] [--iters 20] [--json out.json]

For each model it prefills `--context` tokens, then times (median of
`--iters`, each call on a donated cache):
  decode      one target step (T = 1) on a cache with 1 state slot (plain AR);
  verify K    the verify pass of a speculative step, K = 1..6: the target over
              K + 1 positions on a cache with K + 1 slots (every state kept),
              logits, greedy check, commit of a slot;
  gdn scan    the recurrent Gated DeltaNet scan alone over K + 1 positions,
              summed over the GDN layers (the part that is new for hybrids).
and reports the state-slot memory: bytes per row for one slot and for K + 1,
for these models and for the published Qwen3.5 / Qwen3-Next shapes.

Acceptance is meaningless on random weights, so this is cost only. `small`
is a random Qwen3.5-0.8B-like model cut to 8 layers (H 1024, 6 GDN layers of
16 x 128 heads, 2 attention layers, vocab 32k) built in memory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.cache.paged import KVCache, state_bytes
from specjax.models import gated_deltanet as gdn
from specjax.models import qwen3_5
from specjax.models.base import Model
from specjax.models.contract import append

FIXTURES = ROOT / 'tests' / 'fixtures'
DEPTHS = range(1, 7)
PUBLISHED = {  # (GDN layers, value heads, Dk, Dv, key heads, conv kernel)
    'Qwen3.5-0.8B': (18, 16, 128, 128, 16, 4),
    'Qwen3.5-27B': (48, 48, 128, 128, 16, 4),
    'Qwen3-Next-80B-A3B': (36, 32, 128, 128, 16, 4),
}


def small_model() -> Model:
  cfg = qwen3_5.Qwen35Config(
      vocab_size=32768,
      hidden_size=1024,
      intermediate_size=3584,
      num_layers=8,
      num_heads=8,
      num_kv_heads=2,
      head_dim=256,
      layer_types=('linear_attention',) * 3 + ('full_attention',) + ('linear_attention',) * 3 + ('full_attention',),
      linear_num_key_heads=16,
      linear_num_value_heads=16,
      linear_key_head_dim=128,
      linear_value_head_dim=128,
  )
  module = qwen3_5.Qwen35(cfg, rngs=nnx.Rngs(0))  # random weights
  graphdef, state = nnx.split(module)
  layout = module.cache_layout()
  return Model(
      graphdef,
      state,
      cfg,
      None,
      None,
      'small (random)',
      'qwen3_5_text',
      list(layout.kv_shapes),
      list(layout.state_shapes),
      dtype=jnp.float32,
  )


def make_cache(model: Model, batch: int, capacity: int, num_slots: int, page_size: int = 16) -> KVCache:
  pages = -(-capacity // page_size)
  tables = np.arange(1, batch * pages + 1, dtype=np.int32).reshape(batch, pages)
  return KVCache.create(
      model.kv_shapes,
      num_pages=batch * pages + 1,
      page_size=page_size,
      block_tables=tables,
      state_shapes=model.state_shapes,
      num_slots=num_slots,
  )


def step_fn(model: Model):
  """Target over T tokens, logits, greedy check of T - 1 drafts, commit (a jitted, cache-donating step)."""

  def step(params, cache, tokens):  # tokens [B, T]
    target = nnx.merge(model.graphdef, params)
    b, t = tokens.shape
    hidden, cache, _ = append(target, tokens, cache, jnp.full((b,), t, jnp.int32))
    best = jnp.argmax(target.logits(hidden), axis=-1)  # [B, T]
    match = jnp.cumprod((best[:, :-1] == tokens[:, 1:]).astype(jnp.int32), axis=1).sum(1)
    kept = match + 1
    return cache.commit(cache.lengths - t + kept, kept), best

  return jax.jit(step, donate_argnums=1)


def timed(fn, args_fn, iters: int) -> float:
  times = []
  for _ in range(iters + 2):
    args = args_fn()
    jax.block_until_ready(args)
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times[2:])


def bench_model(name: str, model: Model, batch: int, context: int, iters: int) -> dict:
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  step = step_fn(model)
  prompt = jnp.asarray(rng.integers(3, vocab, (batch, context)), jnp.int32)
  row = {'model': name, 'batch': batch, 'context': context}
  caches = {}
  for slots in sorted({1, *(k + 1 for k in DEPTHS)}):
    cache, _ = step(model.params, make_cache(model, batch, context + 64, slots), prompt)  # prefill
    caches[slots] = jax.block_until_ready(cache)
    if slots == 1:
      row['state_bytes_per_row_one_slot'] = state_bytes(cache) // batch
  fresh = lambda slots: jax.tree.map(jnp.copy, caches[slots])
  tokens = lambda t: jnp.asarray(rng.integers(3, vocab, (batch, t)), jnp.int32)
  row['decode_s'] = timed(lambda c, x: step(model.params, c, x), lambda: (fresh(1), tokens(1)), iters)
  cfg = model.config
  n_gdn = cfg.layer_types.count('linear_attention')
  scan = jax.jit(gdn.recurrent_gated_delta_rule)
  for k in DEPTHS:
    row[f'verify_s_k{k}'] = timed(lambda c, x: step(model.params, c, x), lambda: (fresh(k + 1), tokens(k + 1)), iters)
    row[f'verify_vs_decode_k{k}'] = row[f'verify_s_k{k}'] / row['decode_s']
    nv, nk, dk, dv = (
        cfg.linear_num_value_heads,
        cfg.linear_num_key_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    t = k + 1
    qk = jnp.ones((batch, t, nk, dk))
    args = (
        qk,
        qk,
        jnp.ones((batch, t, nv, dv)),
        -jnp.ones((batch, t, nv)) * 0.1,
        jnp.full((batch, t, nv), 0.5),
        jnp.zeros((batch, nv, dk, dv)),
    )
    row[f'gdn_scan_s_k{k}'] = n_gdn * timed(scan, lambda: args, iters)
  return row


def published_memory() -> list[dict]:
  rows = []
  for name, (layers, nv, dk, dv, nk, w) in PUBLISHED.items():
    one = layers * (nv * dk * dv * 4 + (w - 1) * (2 * nk * dk + nv * dv) * 2)  # f32 state, bf16 conv
    rows.append({'model': name, 'state_mib_per_row_one_slot': one / 2**20, 'state_mib_per_row_k4': 5 * one / 2**20})
  return rows


def report(rows: list[dict]) -> str:
  head = '| model | B | decode ms | ' + ' | '.join(f'K={k}' for k in DEPTHS) + ' | GDN scan share K=4 | slot KiB/row |'
  lines = [head, '|' + '---|' * (5 + len(DEPTHS))]
  for r in rows:
    ratios = ' | '.join(f"{r[f'verify_vs_decode_k{k}']:.2f}x" for k in DEPTHS)
    share = r['gdn_scan_s_k4'] / r['verify_s_k4']
    lines.append(
        f"| {r['model']} | {r['batch']} | {r['decode_s'] * 1e3:.2f} | {ratios} | {share:.0%} | "
        f"{r['state_bytes_per_row_one_slot'] / 1024:.0f} |"
    )
  lines += ['', '| published model | state MiB/row, 1 slot | K = 4 (5 slots) |', '|---|---|---|']
  for r in published_memory():
    lines.append(f"| {r['model']} | {r['state_mib_per_row_one_slot']:.0f} | {r['state_mib_per_row_k4']:.0f} |")
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--models', nargs='+', default=['tiny_qwen3_5', 'tiny_qwen3_next', 'small'])
  p.add_argument('--batch', type=int, nargs='+', default=[1, 8])
  p.add_argument('--context', type=int, default=256)
  p.add_argument('--iters', type=int, default=20)
  p.add_argument('--json')
  args = p.parse_args(argv)
  device = jax.devices()[0]
  print(f'{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}', flush=True)
  rows = []
  for name in args.models:
    model = small_model() if name == 'small' else specjax.load(str(FIXTURES / name))
    for batch in args.batch:
      rows.append(bench_model(name, model, batch, args.context, args.iters))
      print(json.dumps(rows[-1]), flush=True)
  print(report(rows))
  if args.json:
    pathlib.Path(args.json).write_text(
        json.dumps(
            {
                'device': device.device_kind,
                'backend': jax.default_backend(),
                'jax': jax.__version__,
                'settings': vars(args),
                'rows': rows,
                'published_memory': published_memory(),
            },
            indent=1,
        )
    )


if __name__ == '__main__':
  main()
