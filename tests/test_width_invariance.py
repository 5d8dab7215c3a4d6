"""A verify pass gives each position the bits a decode step gives it (experiments/width_numerics/).

The attention reference and the RMS norm are checked here at the suite's compile flags; the real Gemma 3 270M
(`--quant auto --quant-act int8`) is checked in a subprocess at the flags a user runs with, where
XLA:CPU's optimisations (and `specjax.xla_flags`) are in force: its forward at widths 1, 5 and 9, and greedy
n-gram output against greedy autoregressive output, tokens and log-probabilities bit for bit; in the same
subprocess, the tiny Qwen3.5 hybrid at int8 (Gated DeltaNet mixers included) at widths 1, 5 and 9.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import ref_paged_attention


def _pages(rng, n_pool, page_size, head_dim=32, n_kv_heads=2):
  shape = (n_kv_heads, n_pool, page_size, head_dim)
  return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize('page_size,window', [(4, None), (4, 37), (16, None), (16, 150)])
def test_attention_queries_are_width_invariant(page_size, window):
  """Q queries in one call == each query alone (one row, a wider block table, another batch)."""
  rng = np.random.default_rng(0)
  n_q, heads, b = 6, 4, 2
  pages_per_seq = 320 // page_size
  k_pages, v_pages = _pages(rng, 2 * pages_per_seq + 8, page_size)
  tables = rng.permutation(2 * pages_per_seq + 8)[: 2 * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
  lengths = np.array([301, 97], np.int32)  # keys after the block, the block included
  q = rng.normal(size=(b, n_q, heads, 32)).astype(np.float32)
  attend = jax.jit(ref_paged_attention, static_argnames='sliding_window')
  block = np.asarray(attend(q, k_pages, v_pages, tables, lengths, sliding_window=window))
  wide = np.concatenate([tables, np.zeros((b, 40 // page_size + 3), np.int32)], axis=1)  # more chunks, masked
  for row in range(b):
    for i in range(n_q):
      alone = attend(
          q[row : row + 1, i : i + 1],
          k_pages,
          v_pages,
          wide[row : row + 1],
          jnp.asarray([lengths[row] - n_q + i + 1]),
          sliding_window=window,
      )
      np.testing.assert_array_equal(np.asarray(alone)[0, 0], block[row, i], err_msg=f'row {row} query {i}')


@pytest.mark.parametrize('window,softcap,tree', [(None, None, False), (37, 30.0, False), (None, None, True)])
def test_both_attention_paths_agree(window, softcap, tree):
  """The per-query path (CPU) and the one-pair-of-dots path (GPU) compute the same attention."""
  rng = np.random.default_rng(2)
  k_pages, v_pages = _pages(rng, 40, 4)
  tables = rng.permutation(40)[:36].reshape(2, 18).astype(np.int32)
  q = rng.normal(size=(2, 4, 4, 32)).astype(np.float32)
  kw = dict(query_lens=jnp.asarray([4, 2]), sliding_window=window, logit_softcap=softcap)
  if tree:  # node 0 the root; 1 and 2 its children; 3 a child of 1
    parents = np.array([-1, 0, 0, 1])
    mask = np.eye(4, dtype=bool)
    for i in range(1, 4):
      mask[i] |= mask[parents[i]]
    kw['mask'] = jnp.asarray(np.stack([mask, mask]))
  lengths = jnp.asarray([70, 33])
  ours = [ref_paged_attention(q, k_pages, v_pages, tables, lengths, width_invariant=w, **kw) for w in (True, False)]
  np.testing.assert_allclose(*ours, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('which', ['rms', 'l2'])
def test_norm_rows_are_width_invariant(which):
  """The RMS norm (every block) and Gated DeltaNet's l2 norm of q and k (per head, [B, T, H, Dk])."""
  from specjax.models.gated_deltanet import l2_normalize
  from specjax.models.layers import rms_normalize

  shape = (2, 9, 640) if which == 'rms' else (2, 9, 16, 128)
  x = np.random.default_rng(1).normal(size=shape).astype(np.float32) * 30
  norm = jax.jit(lambda x: rms_normalize(x, 1e-6) if which == 'rms' else l2_normalize(x))
  full = np.asarray(norm(x))
  for t in range(9):
    np.testing.assert_array_equal(np.asarray(norm(x[1:, t : t + 1]))[0, 0], full[1, t])


@pytest.mark.parametrize('width', [1, 5, 128, 640, 1001])
def test_tree_sum_rows_are_width_invariant(width):
  """`tree_sum` of a row has the same bits alone and among other rows, and is the row's sum."""
  from pallas_kernels.reductions import tree_sum

  x = np.random.default_rng(width).normal(size=(7, width)).astype(np.float32)
  full = np.asarray(jax.jit(tree_sum)(x))
  assert full.shape == (7, 1)
  np.testing.assert_allclose(full[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4)
  for r in range(7):
    np.testing.assert_array_equal(np.asarray(jax.jit(tree_sum)(x[r : r + 1]))[0], full[r])


@pytest.mark.slow
def test_real_model_verify_equals_decode_bit_for_bit():
  import conftest

  env = dict(os.environ, XLA_FLAGS=conftest._FLAGS)  # the flags a user runs with, not the suite's quick compile
  proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=900, env=env)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  assert proc.stdout.count('bitwise equal') == 4, proc.stdout


def _forward_widths(model, ids: list[int], width: int, rows: int, max_len: int = 2048) -> None:
  """Positions n..n+width fed as one chunk == fed one at a time (hidden states, bit for bit)."""
  sys.path.insert(0, os.path.dirname(__file__))
  from conftest import cache_step, make_cache  # pylint: disable=g-import-not-at-top

  step, n = cache_step(model), 30
  outs = []
  for chunks in ([n, width], [n] + [1] * width):
    # Hybrids keep a recurrent state per position of a pass: a slot for each of the `width` one-token steps too.
    cache, start, hidden = make_cache(model, rows, max_len, page_size=16, num_slots=width + 1), 0, []
    for c in chunks:
      tokens = np.array([ids[start : start + c]] * rows, np.int32)
      _, h, cache = step(tokens, cache, np.full((rows,), c, np.int32))
      hidden.append(np.asarray(h))
      start += c
    outs.append(np.concatenate(hidden[1:], axis=1))
  assert np.array_equal(*outs), f'width {width}, {rows} rows: {np.abs(outs[0] - outs[1]).max()}'


def main() -> None:
  import specjax  # pylint: disable=g-import-not-at-top
  from specjax import bench  # pylint: disable=g-import-not-at-top
  from specjax.drafters import make_drafter  # pylint: disable=g-import-not-at-top
  from specjax.engine.requests import Request  # pylint: disable=g-import-not-at-top
  from specjax.quant import ops  # pylint: disable=g-import-not-at-top

  assert specjax.xla_flags.width_invariant(), os.environ.get('XLA_FLAGS')
  # A hybrid (Gated DeltaNet + attention, dense MLP), int8 with int8 activations: its mixers' projections run on
  # the quantized kernel, its l2 and RMS norms are fixed trees, its recurrence is one token a scan step.
  path = os.path.join(os.path.dirname(__file__), 'fixtures', 'tiny_qwen3_5')
  hybrid = specjax.load(path, quant='int8', quant_act='int8')
  text = hybrid.tokenizer.encode('The quick brown fox jumps over the lazy dog. ' * 6)
  for width, rows in ((5, 1), (9, 3)):
    _forward_widths(hybrid, text, width, rows, max_len=128)
  print('hybrid: forward at widths 5 and 9 bitwise equal', flush=True)
  # MoE targets, int8 with int8 activations: each (token, expert) row on the kernel's expert-indexed product,
  # routers float on the kernel, softmax and slot sums in a fixed order. Dequantizing inside jit instead (XLA's
  # dots, whose sums follow the pass's width) is caught.
  for name in ('tiny_qwen3_5_moe', 'tiny_qwen3_next', 'tiny_gemma4_moe'):
    moe = specjax.load(os.path.join(os.path.dirname(path), name), quant='int8', quant_act='int8')
    for width, rows in ((5, 1), (9, 3)):
      _forward_widths(moe, text, width, rows, max_len=128)
  ops.set_impl('xla')
  try:
    _forward_widths(moe, text, 5, 1, max_len=128)
    raise SystemExit('the dequantizing XLA path gave width-invariant MoE rows: the check has no power here')
  except AssertionError:
    pass
  finally:
    ops.set_impl('auto')
  print('moe: forward at widths 5 and 9 bitwise equal', flush=True)
  by_category = {}
  for p in bench.load_prompts():
    by_category.setdefault(p.category, p.text)
  # The first Spec-Bench question of the first and fourth categories: with FMA contraction on, n-gram output
  # left AR output on both (int8 activations; tokens 37 and 8).
  prompts = [by_category[c] for c in sorted(by_category)[:4:3]]
  for act in ('int8',):  # int8 rounding turns any 1-ulp difference into a large one (float activations: same code)
    model = specjax.load('gemma-3-270m', quant='auto', quant_act=act)
    ids = [model.tokenizer.encode(p) for p in prompts]
    for width, rows in ((5, 1), (9, 4)):
      _forward_widths(model, ids[1] * 3, width, rows)
    ar = specjax.Engine(model, prefix_cache=False)
    ngram = specjax.Engine(model, drafter=make_drafter('ngram', model), prefix_cache=False)
    for p in ids:
      a = ar.submit(Request(p, max_tokens=48, num_draft=0, logprobs=True)).result()
      b = ngram.submit(Request(p, max_tokens=48, num_draft=4, logprobs=True)).result()
      assert a.tokens == b.tokens, (act, a.tokens, b.tokens)
      assert np.array_equal(a.logprobs, b.logprobs), (act, np.abs(np.subtract(a.logprobs, b.logprobs)).max())
      assert b.stats.accepted > 0
      print(f'{act}: {len(p)}-token prompt, {b.stats.accepted} drafts accepted, bitwise equal', flush=True)
    ar.scheduler.stop()
    ngram.scheduler.stop()


if __name__ == '__main__':
  main()
