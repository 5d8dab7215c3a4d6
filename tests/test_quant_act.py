"""Act int8 (`quant_act='int8'`, --quant-act int8): the QMatrix field, the XLA form against the CPU kernel, exact
greedy speculation over a target whose activations are quantized, and the flags."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import SpecjaxError
from specjax.drafters import make_drafter
from specjax.quant import cpu_kernel, ops
from specjax.quant.formats import QMatrix, concatenate, dequantize, quantize, to_device
from conftest import TINY, mutated_verifier
from test_gguf import write_gguf

PROMPTS = ['def add(a, b):\n    return a + b\n\ndef add(a, b):\n', 'The cat sat on the mat. The cat', 'Hello']


def test_qmatrix_carries_act():
  rng = np.random.default_rng(0)
  q = dataclasses.replace(quantize(rng.normal(0, 1, (48, 64)).astype(np.float32), 'int4', out_axis=0), act='int8')
  assert q.T.act == 'int8' and q.rows(slice(0, 8)).act == 'int8'
  assert np.concatenate([q, q]).act == 'int8'
  other = quantize(rng.normal(0, 1, (8, 64)).astype(np.float32), 'int4', out_axis=0, group=16)
  mixed = np.concatenate([q, dataclasses.replace(other, act='int8')])
  assert mixed.act == 'int8' and mixed.group == 16  # widened, still act int8
  assert quantize(np.ones((4, 4), np.float32), 'int8', out_axis=1).act == 'float'
  assert jax.tree.structure(q) != jax.tree.structure(dataclasses.replace(q, act='float'))  # a static field
  with pytest.raises(TypeError, match='different activation modes'):
    concatenate([q, other])


@pytest.mark.parametrize('mode', ['int8', 'int4'])
def test_xla_form_is_close_to_the_kernel(mode):
  """`ops` on an act-int8 QMatrix: the XLA path (dequantize + the act-int8 activations in jit) is the kernel's
  function up to float order, and both are act int8 (further from the float-activation product)."""
  rng = np.random.default_rng(1)
  w = rng.normal(0, 1, (640, 96)).astype(np.float32)  # [K, N]
  x = jnp.asarray(rng.normal(0, 1, (2, 3, 640)), jnp.float32)
  q = to_device(dataclasses.replace(quantize(w, mode, out_axis=1), act='int8'))
  dense = np.asarray(dequantize(q, np.float32, xp=np)).T  # [K, N]
  xla = []
  ops.set_impl('xla')
  try:
    xla = np.asarray(jax.jit(ops.matmul)(x, q))
  finally:
    ops.set_impl('auto')
  ref = np.asarray(x) @ dense
  scale = np.abs(ref).max()
  assert np.abs(xla - ref).max() < 0.01 * scale
  if cpu_kernel.available():
    kernel = np.asarray(jax.jit(ops.matmul)(x, q))
    np.testing.assert_allclose(kernel, xla, rtol=0, atol=1e-5 * scale)
    assert np.abs(kernel - ref).max() > 1e-4 * scale  # the activations really are rounded


@pytest.mark.parametrize('impl', ['auto', 'xla'])
def test_greedy_speculative_equals_act8_autoregressive(impl):
  """Greedy n-gram speculation over an int4 target with act int8 emits exactly that target's AR tokens (the kernel's
  rows do not depend on M; the XLA form's are per row too); a verifier that accepts every draft breaks it."""
  if impl == 'auto' and not cpu_kernel.available():
    pytest.skip('the CPU kernel is not built (act int8 is refused under impl auto)')
  ops.set_impl(impl)
  try:
    model = specjax.load(TINY, quant='int4', quant_act='int8')
    assert model.quant == 'int4-g32, act int8'
    qs = [v for v in jax.tree.leaves(model.params, is_leaf=lambda v: isinstance(v, QMatrix)) if isinstance(v, QMatrix)]
    if impl == 'xla' or ops.uses_kernel():
      assert qs and all(q.act == 'int8' for q in qs)
    reference = [r.tokens for r in specjax.Engine(model, page_size=4).generate(PROMPTS, max_new_tokens=32)[0]]
    engine = specjax.Engine(model, page_size=4, drafter=make_drafter('ngram', model))
    results, _ = engine.generate(PROMPTS, max_new_tokens=32, num_draft=4)
    assert [r.tokens for r in results] == reference
    assert sum(r.spec.accepted for r in results) >= 10
    with mutated_verifier('greedy-accepts-all', engine):
      mutant, _ = engine.generate(PROMPTS, max_new_tokens=32, num_draft=4)
    assert [r.tokens for r in mutant] != reference
  finally:
    ops.set_impl('auto')


def test_drafters_follow_the_target_act(tmp_path):
  ops.set_impl('xla')  # keep the QMatrix weights even where no kernel is built
  try:
    target = specjax.load(TINY, quant='int4', quant_group=16, quant_act='int8')
    assert make_drafter('draft-model', target, draft_model=TINY).model.quant == 'int4-g16, act int8'
    assert make_drafter('draft-model', target, draft_model=TINY, draft_quant='int8').model.quant == 'int8, act int8'
    assert make_drafter('draft-model', target, draft_model=TINY, draft_quant='none').model.quant is None
    path = tmp_path / 'tiny.gguf'
    write_gguf(path)
    auto = specjax.load(str(path), quant='auto', quant_act='int8')
  finally:
    ops.set_impl('auto')
  assert auto.quant.startswith('auto: ') and auto.quant.endswith(', act int8')
  assert auto.weights_fingerprint() != specjax.load(str(path), quant='auto').weights_fingerprint()


def test_quant_act_errors(capsys):
  from specjax import cli

  with pytest.raises(SpecjaxError, match='--quant-act int8 .* add --quant'):
    specjax.load(TINY, quant_act='int8')
  with pytest.raises(SpecjaxError, match='unknown --quant-act'):
    specjax.load(TINY, quant='int8', quant_act='int4')
  code = cli.main(['generate', '-m', TINY, '--prompt', 'Hello', '--max-new-tokens', '3', '--quant-act', 'int8'])
  out, err = capsys.readouterr()
  assert code != 0 and err.count('error:') == 1 and '--quant-act int8' in err and 'add --quant' in err
  assert 'Hello' not in out
  argv = ['generate', '-m', TINY, '--prompt', 'Hello', '--max-new-tokens', '3', '--quant', 'int8', '--quant-act']
  code = cli.main([*argv, 'int8', '--json'])
  out, err = capsys.readouterr()
  assert code == 0 if cpu_kernel.available() else 'needs the CPU kernel' in err, err


def test_act_int8_without_the_kernel_is_refused(monkeypatch, capsys):
  """Where the kernel is missing the weights are dequantized at load: act int8 would be dropped, so it is refused
  before any work, and a plain `--quant` says in `model.quant` that its weights are float."""
  from specjax import cli

  monkeypatch.setattr(ops, 'dequantize_at_load', lambda: True)
  with pytest.raises(SpecjaxError, match='--quant-act int8 needs the CPU kernel'):
    specjax.load(TINY, quant='int8', quant_act='int8')
  argv = ['generate', '-m', TINY, '--prompt', 'Hello', '--max-new-tokens', '3', '--quant', 'int8']
  assert cli.main([*argv, '--quant-act', 'int8']) != 0
  out, err = capsys.readouterr()
  assert err.count('error:') == 1 and 'needs the CPU kernel' in err and 'Hello' not in out
  model = specjax.load(TINY, quant='int8')
  assert model.quant == 'int8, dequantized at load'
  assert not [
      v for v in jax.tree.leaves(model.params, is_leaf=lambda v: isinstance(v, QMatrix)) if isinstance(v, QMatrix)
  ]


@pytest.mark.skipif(not cpu_kernel.available(), reason='the CPU kernel is not built')
def test_an_m_dependent_kernel_breaks_greedy_equality(monkeypatch):
  """The equality above rests on the kernel's row independence: with a block scale shared by the rows of a call
  (`_mutant=1`), a verify pass and a decode step round the same row differently and the tokens change."""
  import functools

  monkeypatch.setattr(cpu_kernel, 'qmatmul', functools.partial(cpu_kernel.qmatmul, _mutant=1))
  model = specjax.load(TINY, quant='int4', quant_act='int8')
  reference = [r.tokens for r in specjax.Engine(model, page_size=4).generate(PROMPTS, max_new_tokens=32)[0]]
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter('ngram', model))
  results, _ = engine.generate(PROMPTS, max_new_tokens=32, num_draft=4)
  assert [r.tokens for r in results] != reference
