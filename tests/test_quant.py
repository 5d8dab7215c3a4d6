"""Quantized weights: GGUF repacking bit for bit, int8 / int4 quantization, the ops, and exactness under --quant."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as Q

import specjax
from specjax import SpecjaxError
from specjax.drafters import make_drafter
from specjax.loading import gguf as gguf_loader
from specjax.models.contract import StepInputs
from specjax.quant import ops
from specjax.quant.formats import QMatrix, dequantize, quantize
from specjax.quant.params import dequantize_params
from specjax.quant.gguf import REPACKED, repack
from conftest import FIXTURES, TINY, VERIFIER_MUTANTS, assert_target_law, cache_step, make_cache, mutated_verifier
from conftest import perturbed_target
from test_gguf import random_k_blocks, write_gguf
from test_scheduler import FAMILIES

DEMO_GGUF_TYPES = ('Q8_0', 'Q5_0', 'Q4_K', 'Q6_K')  # what the real Gemma 3 270M file holds


def random_blocks(rng, qtype, rows, k):
  """Valid stored blocks of a [rows, k] tensor (finite f16 scales)."""
  if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
    return random_k_blocks(rng, qtype, rows * k // 256).reshape(rows, -1)
  return gguf.quants.quantize(rng.normal(0.0, 0.5, (rows, k)).astype(np.float32), qtype)


@pytest.mark.parametrize('qtype', sorted(REPACKED), ids=lambda t: t.name)
def test_repack_equals_gguf_dequantize_bit_for_bit(qtype):
  raw = random_blocks(np.random.default_rng(int(qtype)), qtype, 6, 512)
  q = repack(raw, qtype, (6, 512))
  want = gguf.quants.dequantize(raw, qtype).reshape(6, 512)
  got = dequantize(q, np.float32, xp=np)
  assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
  assert q.values.dtype == (np.uint8 if q.bits == 4 else np.int8) and q.scales.dtype == np.float32
  # In jit (the XLA path dequantizes the same way; XLA may fuse the min into an FMA, so within an ulp).
  np.testing.assert_allclose(np.asarray(jax.jit(dequantize)(q)), want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_real_gemma3_tensors_repack_bit_for_bit():
  """Every type the demo file holds, on its own tensors (the first 64 rows of each)."""
  f = gguf_loader._GGUFFile(specjax.loading.resolve('gemma-3-270m'))
  seen = set()
  for info in f.tensors.values():
    name = gguf_loader._type_name(info.qtype)
    if name in seen or info.qtype not in REPACKED:
      continue
    seen.add(name)
    raw = f.raw(info)[:64]
    got = dequantize(repack(raw, info.qtype, (64, info.shape[1])), np.float32, xp=np)
    want = gguf.quants.dequantize(raw, info.qtype).reshape(64, -1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), info.name
  assert seen == set(DEMO_GGUF_TYPES)


def test_int8_and_int4_quantize_within_a_step_and_least_squares():
  """int8: every weight within half a step of its scale; int4 (a least-squares scale over grids): within one step,
  and less squared error than the plain grid (a group's largest magnitude at level 7)."""
  rng = np.random.default_rng(0)
  w = rng.normal(0, 1, (64, 48)).astype(np.float32)  # [K, N]
  for mode, group in (('int8', 64), ('int4', 32), ('int4', 16)):
    q = quantize(w, mode, out_axis=1, group=group)
    assert q.shape == w.shape and q.group == group
    back = dequantize(q, np.float32, xp=np).T
    step = np.repeat(np.asarray(q.scales), group, axis=1).T  # the scale of each element's group
    assert np.all(np.abs(back - w) <= (0.5 if mode == 'int8' else 1.0) * np.abs(step) + 1e-6), mode
    if mode == 'int4':
      blocks = w.T.reshape(48, -1, group)  # [N, K / G, G]
      plain = np.abs(blocks).max(-1, keepdims=True) / 7
      plain_err = ((np.round(blocks / plain).clip(-8, 7) * plain - blocks) ** 2).sum(-1)
      err = ((back.T.reshape(blocks.shape) - blocks) ** 2).sum(-1)
      assert err.sum() < 0.9 * plain_err.sum(), (err.sum(), plain_err.sum())
  with pytest.raises(SpecjaxError, match='do not divide'):
    quantize(w[:40], 'int4', out_axis=1, group=32)


def test_ops_match_the_float_ops_on_dequantized_weights():
  rng = np.random.default_rng(1)
  w = rng.normal(0, 1, (64, 96)).astype(np.float32)  # [K, N]
  x = jnp.asarray(rng.normal(0, 1, (2, 3, 64)), jnp.float32)
  ids = jnp.asarray([[5, 0], [95, 7]])
  for mode in ('int8', 'int4'):
    q = jax.tree.map(jnp.asarray, quantize(w, mode, out_axis=1))
    dense = jnp.asarray(dequantize(q, np.float32, xp=np).T)  # [K, N]
    np.testing.assert_allclose(ops.matmul(x, q), ops.matmul(x, dense), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ops.take(q, ids, axis=1), jnp.take(dense, ids, axis=1))
    cols = ops.take_outputs(q, slice(10, 30), 1)
    np.testing.assert_allclose(ops.matmul(x, cols), ops.matmul(x, dense[:, 10:30]), rtol=1e-5, atol=1e-5)
    table = dataclasses.replace(q, out_axis=0)  # the same storage read as a [N, K] table
    np.testing.assert_allclose(ops.matmul_t(x, table), ops.matmul(x, dense), rtol=1e-5, atol=1e-5)


def test_fused_weights_of_mixed_types_concatenate_exactly():
  """A fused q | k | v of Q5_0, Q4_K and Q6_K widens to int8 values and the finest group; float parts stay float."""
  rng = np.random.default_rng(2)
  parts = [(Q.Q5_0, 4), (Q.Q4_K, 2), (Q.Q6_K, 2)]
  raws = [random_blocks(rng, t, rows, 256) for t, rows in parts]
  qs = [repack(r, t, (rows, 256)) for r, (t, rows) in zip(raws, parts)]
  fused = np.concatenate(qs).T  # what the checkpoint mapping does: [K, N]
  assert isinstance(fused, QMatrix) and fused.shape == (256, 8) and fused.bits == 8 and fused.group == 16
  assert fused.kind == 'Q5_0+Q4_K+Q6_K'
  want = np.concatenate([gguf.quants.dequantize(r, t).reshape(-1, 256) for r, (t, _) in zip(raws, parts)])
  assert np.array_equal(dequantize(fused, np.float32, xp=np), want)
  mixed = np.concatenate([qs[0], want[4:]])
  assert isinstance(mixed, np.ndarray) and np.array_equal(mixed, want)


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp('qgguf') / 'tiny.gguf'
  write_gguf(path)
  return str(path)


def test_gguf_auto_keeps_blocks_and_matches_the_float_model(tiny_gguf):
  """`quant='auto'` runs the file's own blocks; its logits equal the dequantized (float) model's to float error."""
  ops.set_impl('xla')  # keep the QMatrix weights even where no kernel is built
  try:
    quantized = specjax.load(tiny_gguf, quant='auto')
  finally:
    ops.set_impl('auto')
  dense = specjax.load(tiny_gguf)
  assert quantized.quant.startswith('auto: ') and 'Q4_K' in quantized.quant and dense.quant is None
  assert quantized.param_bytes < 0.6 * dense.param_bytes
  kinds = {type(v).__name__ for v in jax.tree.leaves(quantized.params, is_leaf=lambda v: isinstance(v, QMatrix))}
  assert 'QMatrix' in kinds
  tokens = jnp.asarray([[2, 100, 101, 102, 5]])
  out = []
  for model in (quantized, dense):
    hidden, _, _ = model.module().forward(tokens, StepInputs.chain(None, jnp.asarray([5]), 5), None)
    out.append(model.module().logits(hidden))
  np.testing.assert_allclose(out[0], out[1], rtol=2e-4, atol=2e-4)


def test_bad_quantization_requests(tiny_gguf, tmp_path):
  with pytest.raises(SpecjaxError, match='already quantized .*Q4_K.*--quant int8 would quantize it twice'):
    specjax.load(tiny_gguf, quant='int8')
  with pytest.raises(SpecjaxError, match='--quant auto keeps a GGUF'):
    specjax.load(TINY, quant='auto')
  with pytest.raises(SpecjaxError, match='unknown quantization'):
    specjax.load(TINY, quant='int3')
  with pytest.raises(SpecjaxError, match='int4 groups of 96 do not divide'):
    specjax.load(TINY, quant='int4', quant_group=96)
  with pytest.raises(SpecjaxError, match='even number'):
    specjax.load(TINY, quant='int4', quant_group=7)


PROMPTS = ['def add(a, b):\n    return a + b\n\ndef add(a, b):\n', 'The cat sat on the mat. The cat', 'Hello']


@pytest.mark.parametrize('quant,impl', [('int8', 'auto'), ('int4', 'auto'), ('int4', 'xla')])
def test_greedy_speculative_equals_quantized_autoregressive(quant, impl):
  """Greedy n-gram speculation over a quantized target emits exactly that target's AR tokens, drafts accepted;
  a verifier mutant (greedy accepts every draft) breaks it, so the test can fail. `auto`: the CPU kernel (or
  weights dequantized at load where it is not built); `xla`: dequantized inside jit."""
  ops.set_impl(impl)
  try:
    _greedy_check(quant)
  finally:
    ops.set_impl('auto')


def _greedy_check(quant):
  model = specjax.load(TINY, quant=quant)
  assert model.quant in ('int8', 'int4-g32')
  reference = [r.tokens for r in specjax.Engine(model, page_size=4).generate(PROMPTS, max_new_tokens=32)[0]]
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter('ngram', model))
  results, _ = engine.generate(PROMPTS, max_new_tokens=32, num_draft=4)
  assert [r.tokens for r in results] == reference
  assert sum(r.spec.accepted for r in results) >= 10
  with mutated_verifier('greedy-accepts-all', engine):
    mutant, _ = engine.generate(PROMPTS, max_new_tokens=32, num_draft=4)
  assert [r.tokens for r in mutant] != reference


def test_draft_model_follows_the_target_quantization():
  """A draft model loaded by path takes the target's quantization unless --draft-quant says otherwise; greedy
  output still equals the quantized target's AR output."""
  target = specjax.load(TINY, quant='int4', quant_group=16)
  drafter = make_drafter('draft-model', target, draft_model=TINY)
  assert drafter.model.quant == 'int4-g16'
  assert make_drafter('draft-model', target, draft_model=TINY, draft_quant='none').model.quant is None
  assert make_drafter('draft-model', target, draft_model=TINY, draft_quant='int8').model.quant == 'int8'
  reference = [r.tokens for r in specjax.Engine(target, page_size=4).generate(PROMPTS, max_new_tokens=16)[0]]
  results, _ = specjax.Engine(target, page_size=4, drafter=drafter).generate(PROMPTS, max_new_tokens=16, num_draft=3)
  assert [r.tokens for r in results] == reference
  assert all(r.spec.accepted == r.spec.drafted for r in results)  # the same quantized weights draft
  with pytest.raises(SpecjaxError, match='--draft-quant must be one of'):
    make_drafter('draft-model', target, draft_model=TINY, draft_quant='q4')


def test_cli_quant_flags(capsys):
  from specjax import cli

  code = cli.main(['generate', '-m', TINY, '--prompt', 'Hello', '--max-new-tokens', '3', '--quant', 'int8', '--json'])
  out, err = capsys.readouterr()
  assert code == 0, err
  code = cli.main(['run', '-m', TINY, '--prompt', 'Hello', '--drafter', 'ngram', '--draft-quant', 'int8'])
  out, err = capsys.readouterr()
  assert code != 0 and err.count('error:') == 1 and '--draft-quant is an option of --drafter draft-model' in err
  code = cli.main(['generate', '-m', TINY, '--prompt', 'Hello', '--quant', 'int4', '--quant-group', '96'])
  out, err = capsys.readouterr()
  assert code != 0 and 'int4 groups of 96 do not divide' in err and 'Hello' not in out


def test_draft_quant_auto_off_gguf_is_refused_before_any_load(monkeypatch, capsys):
  from specjax import cli
  from specjax.drafters import get

  monkeypatch.setattr(specjax, 'load', lambda *a, **k: pytest.fail('a model was loaded'))
  argv = ['run', '-m', TINY, '--prompt', 'Hello', '--drafter', 'draft-model', '--draft-model', TINY]
  assert cli.main([*argv, '--draft-quant', 'auto']) != 0
  out, err = capsys.readouterr()
  assert err.count('error:') == 1 and 'is not a GGUF file' in err and 'Hello' not in out
  with pytest.raises(SpecjaxError, match='mtp heads are not GGUF files'):
    get('mtp').make_options(draft_quant='auto')


@pytest.mark.parametrize('case', list(FAMILIES))
def test_every_family_greedy_equals_quantized_autoregressive(case):
  """Every drafter family over an int8 target (and its head's projections requantized to int8, the default):
  greedy speculative tokens equal that target's AR tokens; with a verifier that accepts every draft they do not."""
  kind, path, options = FAMILIES[case]
  target = specjax.load(f'{FIXTURES}/{path}', quant='int8', **({'mtp': True} if kind == 'mtp' else {}))
  if options.get('draft_model') == 'perturbed':  # the same checkpoint at int4 drafts for the int8 target: q != p
    options = {'draft_model': TINY, 'draft_quant': 'int4'}
  drafter = make_drafter(kind, target, **options)
  if kind not in ('ngram', 'layer-skip'):  # those draft with the target's own weights
    params = drafter.model.params if kind == 'draft-model' else drafter.params()
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, QMatrix))
    assert any(isinstance(v, QMatrix) for v in leaves) == ops.uses_kernel(), case
  want = [r.tokens for r in specjax.Engine(target, page_size=4).generate(PROMPTS, max_new_tokens=16)[0]]
  engine = specjax.Engine(target, page_size=4, drafter=drafter)
  results, _ = engine.generate(PROMPTS, max_new_tokens=16, num_draft=3)
  assert [r.tokens for r in results] == want, case
  with mutated_verifier('greedy-accepts-all', engine):
    mutant, _ = engine.generate(PROMPTS, max_new_tokens=16, num_draft=3)
  assert [r.tokens for r in mutant] != want, case


def test_hybrid_mixer_projections_are_quantized():
  """Gated DeltaNet's input and output projections are `Weight`s, quantized with the rest (conv, norms and the
  decay params stay float); the int8 hybrid's logits stay within quantization noise of the float model's."""
  from flax import nnx

  from specjax.models.layers import Weight

  path = f'{FIXTURES}/tiny_qwen3_5'
  model, reference = specjax.load(path, quant='int8'), specjax.load(path)
  flat = {'.'.join(map(str, p)): v for p, v in nnx.to_flat_state(model.params)}
  mixers = [k for k in flat if k.endswith(('mixer.in_proj', 'mixer.out_proj'))]
  assert len(mixers) == 2 * model.config.layer_types.count('linear_attention'), sorted(flat)
  assert all(isinstance(flat[k], Weight) for k in mixers)
  assert all(isinstance(flat[k][...], QMatrix) for k in mixers) == ops.uses_kernel()
  assert not any(isinstance(v[...], QMatrix) for k, v in flat.items() if k.endswith(('conv_weight', 'A_log')))
  tokens = np.asarray([model.tokenizer.encode(PROMPTS[1])], np.int32)
  lens = np.full((1,), tokens.shape[1], np.int32)
  quantized, float_ = (cache_step(m)(tokens, make_cache(m, 1, 64), lens)[0] for m in (model, reference))
  err = float(jnp.abs(quantized - float_).max() / jnp.abs(float_).max())
  assert 0 < err < 0.1, err


@pytest.mark.parametrize('name', ['tiny_qwen3_5_moe', 'tiny_qwen3_next', 'tiny_gemma4_moe'])
def test_moe_experts_are_quantized(name):
  """Routed experts quantize matrix by matrix into one stacked QMatrix (int8: a byte a weight);
  routers and the shared expert's gate stay float, multiplied on the kernel (kind 'f32'); the logits equal (to
  float rounding) the float path's over the same weights dequantized, as do the dequantizing XLA path's; greedy
  n-gram speculation emits the quantized target's AR tokens."""
  from flax import nnx

  path = f'{FIXTURES}/{name}'
  model, reference = specjax.load(path, quant='int8'), specjax.load(path)
  if not ops.uses_kernel():
    pytest.skip(ops.kernel_status())
  flat = {'.'.join(map(str, p)): v[...] for p, v in nnx.to_flat_state(model.params)}
  floats = {'.'.join(map(str, p)): v[...] for p, v in nnx.to_flat_state(reference.params)}
  experts = [
      k for k in flat if k.endswith(('moe.gate_up', 'moe.down', 'mlp.gate_up', 'mlp.down')) and flat[k].ndim == 3
  ]
  assert experts and all(flat[k].kind == 'int8' and flat[k].values.ndim == 3 for k in experts), sorted(flat)
  # The float model keeps its experts and routers float, stored for the kernel too (kind 'f32').
  assert all(floats[k].kind == 'f32' and 4 * flat[k].values.nbytes == floats[k].nbytes for k in experts)
  routers = [k for k in flat if k.endswith(('router', 'shared_gate'))]
  assert routers and all(flat[k].kind == floats[k].kind == 'f32' for k in routers)
  assert all(np.array_equal(flat[k].values, floats[k].values) for k in routers)
  tokens = np.asarray([model.tokenizer.encode(PROMPTS[1])], np.int32)
  lens = np.full((1,), tokens.shape[1], np.int32)
  logits = lambda m: cache_step(m)(tokens, make_cache(m, 1, 64), lens)[0]
  dequantized = dataclasses.replace(
      model, params=dequantize_params(jax.tree.map(lambda x: x, model.params), jnp.float32)
  )
  quantized, same_weights = logits(model), logits(dequantized)  # the float path over the quantized weights
  assert float(jnp.abs(quantized - same_weights).max() / jnp.abs(same_weights).max()) < 1e-4
  assert not np.array_equal(quantized, logits(reference))
  ops.set_impl('xla')
  try:
    xla = logits(model)
  finally:
    ops.set_impl('auto')
  assert float(jnp.abs(xla - quantized).max() / jnp.abs(quantized).max()) < 1e-4
  want = [r.tokens for r in specjax.Engine(model, page_size=4).generate(PROMPTS, max_new_tokens=12)[0]]
  engine = specjax.Engine(model, page_size=4, drafter=make_drafter('ngram', model))
  assert [r.tokens for r in engine.generate(PROMPTS, max_new_tokens=12, num_draft=3)[0]] == want


def test_sampled_law_holds_under_quantization():
  """Sampled speculation over an int4 target keeps that target's law: a float copy of the checkpoint with weight
  noise 0.01 drafts (q near p, not equal), one draft a step, 1000 requests; the target's law is computed by the same quantized
  weights. Every sampled-law verifier mutant breaks it."""
  target = specjax.load(TINY, quant='int4')
  drafter = make_drafter('draft-model', target, draft_model=perturbed_target(0.01))
  engine = specjax.Engine(target, page_size=8, drafter=drafter, max_draft=1)
  prompt = engine.encode(['def add(a, b):'])[0]
  sampling = specjax.SamplingParams(temperature=1.0, seed=4)
  results, _ = assert_target_law(engine, target, prompt, sampling, n=1000, k=1, mutants=list(VERIFIER_MUTANTS))
  accepted, drafted = sum(r.spec.accepted for r in results), sum(r.spec.drafted for r in results)
  print('accepted', accepted, 'of', drafted)
  assert 0.3 * drafted < accepted < 0.97 * drafted  # drafts accepted often, and rejected often enough
