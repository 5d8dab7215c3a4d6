"""Gemma 4: parity with transformers, KV sharing over the paged cache, the wrapper layout, config errors."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
from specjax.models.contract import PagedKV, StepInputs
from conftest import FIXTURES, make_cache

GEMMA4 = ['tiny_gemma4', 'tiny_gemma4_moe']
SLIDING, FULL = 'sliding_attention', 'full_attention'
TOL = 1e-4  # of max |want|: two float32 implementations of these tiny models (attention scale 1) differ by
# ~3e-5 of the logits' range, as far as each is from a float64 run of transformers


@pytest.fixture(scope='module', params=GEMMA4)
def gemma4(request):
  return specjax.load(f'{FIXTURES}/{request.param}'), np.load(f'{FIXTURES}/{request.param}_reference.npz')


@pytest.fixture(scope='module')
def tiny():
  return specjax.load(f'{FIXTURES}/tiny_gemma4')


def close(got, want, tol=TOL):
  np.testing.assert_allclose(np.asarray(got), want, atol=tol * np.abs(want).max(), rtol=0)


_JITTED = {}


def jitted(model):
  """`forward(tokens, inputs, cache, taps, num_layers)` and `logits(hidden)` of `model`, jitted once per model."""
  if id(model) not in _JITTED:
    graphdef, state = nnx.split(model.module())
    forward = jax.jit(
        lambda state, tokens, inputs, cache, taps, n: nnx.merge(graphdef, state).forward(
            tokens, inputs, cache, taps, num_layers=n
        ),
        static_argnums=(4, 5),
    )
    logits = jax.jit(lambda state, h: nnx.merge(graphdef, state).logits(h))
    _JITTED[id(model)] = (
        lambda tokens, inputs, cache, taps=(), num_layers=None: forward(state, tokens, inputs, cache, taps, num_layers),
        lambda h: np.asarray(logits(state, h)),
    )
  return _JITTED[id(model)]


def run_chunks(model, ids, chunks, lens=None, page_size=4):
  """Feeds `ids` [B, T] through the paged cache in chunks; returns (logits [B, T, V], hidden, cache)."""
  b, t = ids.shape
  lens = np.full((b,), t) if lens is None else np.asarray(lens)
  cache = make_cache(model, b, t, page_size=page_size, shuffle_pages=True)
  forward, head = jitted(model)
  logits, hidden, start = [], [], 0
  for n in chunks:
    step_lens = jnp.asarray(np.clip(lens - start, 0, n), jnp.int32)
    h, cache, _ = forward(jnp.asarray(ids[:, start : start + n]), StepInputs.chain(cache, step_lens, n), cache)
    logits.append(head(h))
    hidden.append(np.asarray(h))
    start += n
  assert start == t
  return np.concatenate(logits, axis=1), np.concatenate(hidden, axis=1), cache


def dense_forward(model, ids, lens=None, **kw):
  b, t = ids.shape
  lens = jnp.full((b,), t, jnp.int32) if lens is None else jnp.asarray(lens, jnp.int32)
  return jitted(model)[0](jnp.asarray(ids), StepInputs.chain(None, lens, t), None, **kw)


def dense_logits(model, ids, lens=None):
  return jitted(model)[1](dense_forward(model, ids, lens)[0])


def test_logits_match_transformers(gemma4):
  model, ref = gemma4
  logits, hidden, _ = run_chunks(model, ref['input_ids'], [ref['input_ids'].shape[1]])
  close(logits, ref['logits'])
  close(hidden, ref['hidden'])
  assert dense_forward(model, ref['input_ids'])[1] is None
  close(dense_logits(model, ref['input_ids']), ref['logits'])


def test_greedy_matches_transformers(gemma4):
  model, ref = gemma4
  prompts = [list(map(int, row[:n])) for row, n in zip(ref['greedy_prompt_ids'], ref['greedy_prompt_lens'])]
  results, _ = specjax.Engine(model, page_size=4).generate(prompts, max_new_tokens=16)
  assert [r.tokens for r in results] == ref['greedy_new_ids'].tolist()


def test_chunked_prefill_and_decode_equal_dense(gemma4):
  """Chunks crossing pages and the window (6), then token by token, over shuffled pages."""
  model, ref = gemma4
  ids = ref['input_ids']
  want = dense_logits(model, ids)
  stepped, _, cache = run_chunks(model, ids, [5, 9, 3] + [1] * 15)
  close(stepped, want, 2e-5)
  assert cache.lengths.tolist() == [32, 32]


def test_ragged_batch_rows_equal_alone(tiny):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 512, (3, 20)).astype(np.int32)
  lens = [20, 13, 7]
  got, _, _ = run_chunks(tiny, ids, [8, 8, 4], lens=lens)
  for row, n in enumerate(lens):
    alone = dense_logits(tiny, ids[row : row + 1], [n])[0]  # one row; keys past n are masked
    close(got[row, :n], alone[:n], 2e-5)


def test_shared_layers_own_no_pages(tiny):
  module = tiny.module()
  assert module.layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL)
  assert module.kv_donors() == {SLIDING: 3, FULL: 2}
  assert [module.kv_layer(i) for i in range(7)] == [0, 1, 2, 3, 3, 3, 2]
  assert tiny.kv_shapes == [(2, 16), (2, 16), (2, 32), (2, 16)]  # per-type head dims
  cache = make_cache(tiny, 1, 8)
  assert len(cache.k_pages) == len(cache.v_pages) == 4  # layers 4-6 read layers 3 and 2
  moe = specjax.load(f'{FIXTURES}/tiny_gemma4_moe')
  assert moe.kv_shapes == [(2, 16), (1, 32), (2, 16), (1, 32)]  # num_global_key_value_heads on full layers
  assert moe.module().kv_donors() == {SLIDING: 2, FULL: 3}


def test_donor_pages_hold_transformers_shared_kv(gemma4):
  """`cache.k_pages[kv_donors()[type]]` holds what transformers hands its assistant (`shared_kv_states`)."""
  model, ref = gemma4
  ids = ref['input_ids']
  _, _, cache = run_chunks(model, ids, [11, 21])
  b, t = ids.shape
  for layer_type, j in model.module().kv_donors().items():
    short = 'sliding' if layer_type == SLIDING else 'full'
    for pages, key in ((cache.k_pages[j], 'donor_k'), (cache.v_pages[j], 'donor_v')):
      pos = np.arange(t)
      page_ids = np.asarray(cache.block_tables)[:, pos // 4]  # [B, T]
      got = np.asarray(pages)[:, page_ids, pos % 4]  # [K, B, T, H]
      close(np.moveaxis(got, 0, 2), ref[f'{key}_{short}'])


def test_layer_skip_depths(tiny):
  """`num_layers` below, at and past the first shared layer: the truncated model, pages of later layers untouched."""
  ids = np.random.default_rng(1).integers(0, 512, (1, 12)).astype(np.int32)
  forward, _ = jitted(tiny)
  _, _, taps = dense_forward(tiny, ids, taps=tuple(range(7)))
  for n in (2, 6):
    h, _, _ = dense_forward(tiny, ids, num_layers=n)
    close(h, np.asarray(tiny.module().norm(taps[n - 1])), 1e-6)
    cache = make_cache(tiny, 1, 12)
    hp, cache, _ = forward(jnp.asarray(ids), StepInputs.chain(cache, jnp.asarray([12]), 12), cache, num_layers=n)
    close(hp, np.asarray(h), 2e-5)
    written = [bool(np.any(np.asarray(p))) for p in cache.k_pages]
    assert written == [j < n for j in range(4)], (n, written)


def test_speculative_greedy_equals_autoregressive(tiny):
  from specjax.drafters import make_drafter

  ref = np.load(f'{FIXTURES}/tiny_gemma4_reference.npz')
  prompts = [list(map(int, row[:n])) for row, n in zip(ref['greedy_prompt_ids'], ref['greedy_prompt_lens'])]
  prompts.append(prompts[0] + ref['greedy_new_ids'][0].tolist() + prompts[0])  # repeats: n-gram drafts hit
  want = [r.tokens for r in specjax.Engine(tiny, page_size=4).generate(prompts, max_new_tokens=16)[0]]
  for kind, options in (('ngram', {}), ('layer-skip', {'layers': 5})):  # 5: past the first shared layer
    engine = specjax.Engine(tiny, page_size=4, drafter=make_drafter(kind, tiny, **options), max_draft=4)
    results, _ = engine.generate(prompts, max_new_tokens=16, num_draft=3)
    assert [r.tokens for r in results] == want, (kind, options)


def wrap(src, dst, text_config=None):
  """`src` as a `Gemma4ForConditionalGeneration` checkpoint: `model.language_model.*`, towers, a `gemma4` config."""
  shutil.copytree(src, dst)
  tensors = load_file(str(dst / 'model.safetensors'))
  wrapped = {name.replace('model.', 'model.language_model.', 1): w for name, w in tensors.items()}
  wrapped |= {
      'model.vision_tower.encoder.layers.0.mlp.down_proj.linear.weight': np.ones((4, 4), np.float32),
      'model.embed_vision.embedding_projection.weight': np.ones((32, 4), np.float32),
      'model.audio_tower.layers.0.norm.weight': np.ones((4,), np.float32),
      'model.embed_audio.embedding_projection.weight': np.ones((32, 4), np.float32),
  }
  save_file(wrapped, str(dst / 'model.safetensors'))
  text = json.loads((dst / 'config.json').read_text())
  config = {
      'architectures': ['Gemma4ForConditionalGeneration'],
      'model_type': 'gemma4',
      'text_config': text_config or text,
      'vision_config': {'model_type': 'gemma4_vision', 'hidden_size': 4},
      'audio_config': {'model_type': 'gemma4_audio', 'hidden_size': 4},
      'tie_word_embeddings': True,
  }
  (dst / 'config.json').write_text(json.dumps(config))


def test_conditional_generation_layout(tmp_path, tiny):
  wrap(f'{FIXTURES}/tiny_gemma4', tmp_path / 'wrapped')
  model = specjax.load(str(tmp_path / 'wrapped'))
  assert model.architecture == 'gemma4' and model.config == tiny.config
  ref = np.load(f'{FIXTURES}/tiny_gemma4_reference.npz')
  close(dense_logits(model, ref['input_ids']), ref['logits'])


def test_shared_layers_kv_weights_are_ignored(tmp_path, tiny):
  """Checkpoints may carry k/v weights on KV-shared layers (transformers skips them): so does specjax."""
  d = tmp_path / 'extra'
  shutil.copytree(f'{FIXTURES}/tiny_gemma4', d)
  tensors = load_file(str(d / 'model.safetensors'))
  tensors['model.layers.5.self_attn.k_proj.weight'] = np.ones((32, 32), np.float32)
  tensors['model.layers.5.self_attn.k_norm.weight'] = np.ones((16,), np.float32)
  save_file(tensors, str(d / 'model.safetensors'))
  assert specjax.load(str(d)).num_params == tiny.num_params


def test_transformers5_and_hub_configs_agree(tiny):
  """tiny_gemma4 has the Hub's `global_head_dim`; the same as transformers 5's `per_layer_config`."""
  from specjax.models.gemma4 import Gemma4Config

  hub = json.loads(open(f'{FIXTURES}/tiny_gemma4/config.json').read())
  assert 'global_head_dim' in hub and 'per_layer_config' not in hub
  new = {k: v for k, v in hub.items() if k != 'global_head_dim'} | {
      'per_layer_config': {'2': {'head_dim': 32}, '6': {'head_dim': 32}}
  }
  assert Gemma4Config.from_hf(new) == tiny.config
  moe = json.loads(open(f'{FIXTURES}/tiny_gemma4_moe/config.json').read())
  assert 'per_layer_config' in moe
  cfg = Gemma4Config.from_hf(moe)
  assert cfg.kv_heads == (2, 1, 2, 1) and cfg.head_dims == (16, 32, 16, 32) and cfg.attention_k_eq_v
  # Without k_eq_v transformers ignores num_global_key_value_heads (`per_layer_config` absent).
  plain = {k: v for k, v in moe.items() if k != 'per_layer_config'} | {
      'attention_k_eq_v': False,
      'num_global_key_value_heads': 1,
      'global_head_dim': 32,
  }
  assert Gemma4Config.from_hf(plain).kv_heads == (2, 2, 2, 2)


def test_assistant_drafts_over_the_targets_donor_pages():
  """main's Gemma 4 assistant reads `cache.k_pages[kv_donors()[type]]` of this target: transformers' drafts."""
  from specjax.loading.gemma4_assistant import load_gemma4_assistant

  ref = np.load(f'{FIXTURES}/tiny_gemma4_assistant_reference.npz')
  target = specjax.load(f'{FIXTURES}/tiny_gemma4_for_assistant', dtype='float32')
  assistant = load_gemma4_assistant(f'{FIXTURES}/tiny_gemma4_assistant', dtype='float32').module()
  ids, lens = ref['input_ids'], ref['input_lens']
  _, hidden, cache = run_chunks(target, np.maximum(ids, 0), [8, 12], lens=lens)
  last = hidden[np.arange(len(lens)), lens - 1]
  close(last, ref['target_hidden'])
  module = target.module()
  close(module.logits(jnp.asarray(last)), ref['target_last_logits'])
  donors = {}
  for layer_type, j in module.kv_donors().items():
    donors[layer_type] = PagedKV(cache.k_pages[j], cache.v_pages[j], cache.block_tables, cache.lengths)

  @jax.jit  # one program for every draft (eager, each op would compile on its own)
  def draft(tokens, h, positions, donors):
    out, h = assistant.forward(module.embed(tokens[:, None]), h, positions, donors)
    return jnp.argmax(assistant.logits(out[:, 0]), axis=-1), h

  tokens, h, positions, drafts = ref['first_token'], jnp.asarray(last)[:, None], jnp.asarray(lens)[:, None], []
  for _ in range(ref['centroid_drafts'].shape[1]):
    tokens, h = draft(jnp.asarray(tokens), h, positions, donors)
    drafts.append(np.asarray(tokens))
  np.testing.assert_array_equal(np.stack(drafts, axis=1), ref['centroid_drafts'])


def test_family_facts(tiny):
  cfg = tiny.config
  assert cfg.final_logit_softcapping == 30.0 and cfg.sliding_window == 6 and cfg.first_shared == 4
  assert [cfg.mlp_width(i) for i in range(7)] == [32] * 4 + [64] * 3  # use_double_wide_mlp
  full = cfg.ropes[2]
  assert full.kind == 'proportional' and full.rope_angles == 4 and full.base == 1e6  # 0.25 * 32 / 2
  assert cfg.ropes[0].kind == 'default' and cfg.ropes[0].base == 1e4
  scalars = [float(tiny.params['layers'][i]['layer_scalar'][...][0]) for i in range(7)]
  assert min(scalars) < 0.9 and max(scalars) > 1.1
  module = tiny.module()
  ids = jnp.asarray([[2, 300]])
  np.testing.assert_allclose(module.embed(ids), module.lookup(ids) * 32**0.5, rtol=1e-6)
  h = module.embed(ids)
  np.testing.assert_allclose(module.logits(h, jnp.asarray([7, 300])), module.logits(h)[..., [7, 300]], rtol=1e-6)


def test_window_is_counted_like_transformers(tmp_path):
  """Window 6 matches transformers (keys with q - k < 6); 5 or 7 would not, so the parity test pins the count."""
  ref = np.load(f'{FIXTURES}/tiny_gemma4_reference.npz')
  for window in (5, 7):
    d = tmp_path / f'w{window}'
    shutil.copytree(f'{FIXTURES}/tiny_gemma4', d)
    config = json.loads((d / 'config.json').read_text())
    (d / 'config.json').write_text(json.dumps(config | {'sliding_window': window}))
    off = np.abs(dense_logits(specjax.load(str(d)), ref['input_ids']) - ref['logits']).max()
    assert off > 100 * TOL * np.abs(ref['logits']).max(), (window, off)


def test_e4b_config_facts():
  """google/gemma-4-E4B-it's text_config (shared/reference/models.md 2.1): donors 22 and 23, 24 cached layers."""
  from specjax.models.gemma4 import Gemma4Config

  cfg = Gemma4Config.from_hf(
      {
          'model_type': 'gemma4',
          'text_config': {
              'model_type': 'gemma4_text',
              'hidden_size': 2560,
              'intermediate_size': 10240,
              'num_hidden_layers': 42,
              'num_attention_heads': 8,
              'num_key_value_heads': 2,
              'head_dim': 256,
              'global_head_dim': 512,
              'num_global_key_value_heads': None,
              'layer_types': ([SLIDING] * 5 + [FULL]) * 7,
              'num_kv_shared_layers': 18,
              'hidden_size_per_layer_input': 256,
              'final_logit_softcapping': 30.0,
              'rope_parameters': {
                  SLIDING: {'rope_type': 'default', 'rope_theta': 10000.0},
                  FULL: {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0},
              },
          },
      }
  )
  assert cfg.first_shared == 24 and cfg.donors == {SLIDING: 22, FULL: 23}
  assert cfg.vocab_size == cfg.vocab_size_per_layer_input == 262144 and cfg.sliding_window == 512
  assert (cfg.kv_heads[5], cfg.head_dims[5], cfg.head_dims[0]) == (2, 512, 256)
  assert cfg.ropes[5].rope_angles == 64 and cfg.ropes[5].inv_freq(512)[64:].max() == 0.0


@pytest.mark.parametrize(
    'change,message',
    [
        ({'num_kv_shared_layers': 7}, 'must leave layers'),
        ({'num_kv_shared_layers': 5}, "is 'full_attention'"),  # layers 0, 1 are both sliding
        ({'rope_parameters': {SLIDING: {'rope_type': 'yarn', 'factor': 2.0}}}, 'unsupported rope_type'),
        ({'use_bidirectional_attention': 'all'}, 'non-causal'),
        ({'attention_bias': True}, 'attention_bias'),
        ({'num_key_value_heads': 3}, 'multiple of'),
        ({'per_layer_config': {'2': {'sliding_window': 4}}}, 'per_layer_config sets'),
        ({'enable_moe_block': True, 'num_experts': 4, 'top_k_experts': 5, 'moe_intermediate_size': 8}, 'top_k'),
        ({'hidden_activation': 'relu2'}, 'activation'),
        ({'num_hidden_layers': None}, 'num_hidden_layers'),
    ],
)
def test_config_errors(tmp_path, change, message):
  d = tmp_path / 'bad'
  shutil.copytree(f'{FIXTURES}/tiny_gemma4', d)
  config = json.loads((d / 'config.json').read_text())
  config = {k: v for k, v in (config | change).items() if v is not None}
  (d / 'config.json').write_text(json.dumps(config))
  with pytest.raises(specjax.SpecjaxError, match=message):
    specjax.load(str(d))


def test_wrapper_without_text_config(tmp_path):
  wrap(f'{FIXTURES}/tiny_gemma4', tmp_path / 'w')
  config = json.loads((tmp_path / 'w' / 'config.json').read_text())
  del config['text_config']
  (tmp_path / 'w' / 'config.json').write_text(json.dumps(config))
  with pytest.raises(specjax.SpecjaxError, match="gemma4 config: missing key 'text_config'"):
    specjax.load(str(tmp_path / 'w'))


# ---------------------------------------------------------------- GGUF (llama.cpp's `gemma4`)


def write_gemma4_gguf(src, path, drop=(), qtypes=None):
  """Converts an HF directory as llama.cpp's `Gemma4Model` does (`conversion/gemma.py`): tensors float32, or
  quantized to `qtypes[kind]` (kind: the GGUF name without its block, e.g. 'ffn_gate_up_exps.weight')."""
  import gguf

  hp = json.loads((src / 'config.json').read_text())
  full = next(iter((hp.get('per_layer_config') or {}).values()), {})
  global_head_dim = hp.get('global_head_dim') or full['head_dim']
  global_kv = hp.get('num_global_key_value_heads') if 'global_head_dim' in hp else full.get('num_key_value_heads')
  layers, shared, head_dim = hp['num_hidden_layers'], hp['num_kv_shared_layers'], hp['head_dim']
  swa = [t == SLIDING for t in hp['layer_types']]
  rope = hp['rope_parameters']
  w = gguf.GGUFWriter(str(path), 'gemma4')
  w.add_block_count(layers)
  w.add_context_length(hp['max_position_embeddings'])
  w.add_embedding_length(hp['hidden_size'])
  ff = hp['intermediate_size']
  w.add_feed_forward_length(
      [ff * (1 + (i >= layers - shared)) for i in range(layers)] if hp['use_double_wide_mlp'] else ff
  )
  w.add_head_count(hp['num_attention_heads'])
  kv = hp['num_key_value_heads']
  w.add_head_count_kv(kv if global_kv is None else [kv if s else global_kv for s in swa])
  w.add_rope_freq_base(rope[FULL]['rope_theta'])
  w.add_rope_freq_base_swa(rope[SLIDING]['rope_theta'])
  w.add_layer_norm_rms_eps(hp['rms_norm_eps'])
  if hp.get('enable_moe_block'):
    w.add_expert_count(hp['num_experts'])
    w.add_expert_used_count(hp['top_k_experts'])
    w.add_expert_feed_forward_length(hp['moe_intermediate_size'])
  w.add_key_length(global_head_dim)
  w.add_value_length(global_head_dim)
  w.add_key_length_swa(head_dim)
  w.add_value_length_swa(head_dim)
  w.add_final_logit_softcapping(hp['final_logit_softcapping'])
  w.add_sliding_window(hp['sliding_window'])
  w.add_shared_kv_layers(shared)
  w.add_embedding_length_per_layer_input(hp['hidden_size_per_layer_input'] or 0)
  w.add_sliding_window_pattern(swa)
  w.add_rope_dimension_count(global_head_dim)
  w.add_rope_dimension_count_swa(head_dim)
  # set_vocab: LlamaHfVocab tokens and types, SpecialVocab merges and ids.
  tok = json.loads((src / 'tokenizer.json').read_text())
  vocab = sorted(tok['model']['vocab'].items(), key=lambda kv: kv[1])
  specials = {t['content'] for t in tok['added_tokens'] if t['special']}
  w.add_tokenizer_model('gemma4')
  w.add_token_list([t for t, _ in vocab])
  w.add_token_scores([-1000.0] * len(vocab))
  w.add_token_types([6 if t.startswith('<0x') else 3 if t in specials else 1 for t, _ in vocab])
  w.add_token_merges([' '.join(m) if isinstance(m, list) else m for m in tok['model']['merges']])
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_space_prefix(False)
  w.add_add_bos_token(True)
  # generate_extra_tensors: proportional RoPE as frequency factors of the full layers.
  rotated = int(global_head_dim * rope[FULL]['partial_rotary_factor'] / 2)
  w.add_tensor('rope_freqs.weight', np.asarray([1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated), np.float32))
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
  for name, values in load_file(str(src / 'model.safetensors')).items():
    if name.endswith(('router.scale', 'router.per_expert_scale')):
      part = 'ffn_gate_inp' if name.endswith('router.scale') else 'ffn_down_exps'
      gguf_name = f'blk.{name.split(".")[2]}.{part}.scale'
    else:
      suffix = '' if name.endswith('.weight') else '.weight'  # filter_tensors: layer_scalar, experts.*
      gguf_name = names.get_name(name + suffix, try_suffixes=('.weight',))
    qtype = (qtypes or {}).get(gguf_name.split('.', 2)[-1])
    if gguf_name.rsplit('.', 1)[0] in drop:
      continue
    if qtype is None:
      w.add_tensor(gguf_name, values.astype(np.float32))
    else:
      w.add_tensor(gguf_name, gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize('name', GEMMA4)
def test_gguf_equals_hf(tmp_path, name):
  hf = specjax.load(f'{FIXTURES}/{name}')
  write_gemma4_gguf(pathlib.Path(FIXTURES) / name, tmp_path / 'model.gguf')
  model = specjax.load(str(tmp_path / 'model.gguf'))
  assert model.architecture == 'gemma4_text' and model.config == hf.config
  assert model.kv_shapes == hf.kv_shapes
  got, want = jax.tree.leaves(model.params), jax.tree.leaves(hf.params)
  assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
  assert model.generation.eos_token_ids == (1,) and model.generation.bos_token_id == 2
  texts = [
      'The quick brown fox jumps over the lazy dog.',
      '  two  spaces\tand a tab\n',
      'def add(a, b):\n    return a + b',
      'Unseen: naïve café 日本 ẞ',
      '<start_of_turn>user\nHi<end_of_turn>',
  ]
  for text in texts:
    ids = hf.tokenizer.encode(text)
    assert model.tokenizer.encode(text) == ids, text
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == hf.tokenizer.decode(ids, skip_special_tokens=False)


def test_gguf_quantized_experts_stay_quantized(tmp_path):
  """`--quant auto` keeps a GGUF file's stacked expert blocks (Q8_0 here) as one QMatrix of E matrices, not float;
  its logits equal those of the same file dequantized at load."""
  import gguf

  from specjax.quant import ops
  from specjax.quant.formats import QMatrix

  write_gemma4_gguf(
      pathlib.Path(FIXTURES) / 'tiny_gemma4_moe',
      tmp_path / 'm.gguf',
      qtypes={'ffn_gate_up_exps.weight': gguf.GGMLQuantizationType.Q8_0},
  )
  kept, dense = (specjax.load(str(tmp_path / 'm.gguf'), quant=q) for q in ('auto', None))
  flat = {'.'.join(map(str, p)): v[...] for p, v in nnx.to_flat_state(kept.params)}
  gate_up = flat['layers.0.moe.gate_up']
  if ops.uses_kernel():
    assert isinstance(gate_up, QMatrix) and gate_up.kind == 'Q8_0' and gate_up.values.shape == (4, 32, 32)
  assert 'Q8_0' in kept.quant
  ids = np.asarray([kept.tokenizer.encode('The quick brown fox')], np.int32)
  got, want = (np.asarray(dense_logits(m, ids)) for m in (kept, dense))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_gguf_without_layer_scale_and_errors(tmp_path):
  src = pathlib.Path(FIXTURES) / 'tiny_gemma4'
  write_gemma4_gguf(src, tmp_path / 'a.gguf', drop={f'blk.{i}.layer_output_scale' for i in range(7)})
  model = specjax.load(str(tmp_path / 'a.gguf'))
  assert all(float(model.params['layers'][i]['layer_scalar'][...][0]) == 1.0 for i in range(7))
  write_gemma4_gguf(src, tmp_path / 'b.gguf', drop={'blk.1.attn_q_norm'})
  with pytest.raises(specjax.SpecjaxError, match='lacks 1 tensor'):
    specjax.load(str(tmp_path / 'b.gguf'))
  write_gemma4_gguf(src, tmp_path / 'c.gguf', drop={'blk.1.attn_k'})
  with pytest.raises(specjax.SpecjaxError, match="missing weight 'model.layers.1.self_attn.k_proj.weight'"):
    specjax.load(str(tmp_path / 'c.gguf'))
