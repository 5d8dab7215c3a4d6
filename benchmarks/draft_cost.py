"""What drafting costs against the target's own decode step (Gemma 4 assistant, DFlash 1 / 2).

  python benchmarks/draft_cost.py [--shape tiny-g4 e2b tiny-dflash tiny-dflash2 qwen3-0.6b]
      [--vocab 32768] [--depth 4] [--new-tokens 24] [--prompt-tokens 96] [--rounds 2] [--json out.json]

Each shape is a target and a drafter for it, random weights:
- `tiny-g4`: the Gemma 4 test fixtures (`tiny_gemma4_for_assistant`, `tiny_gemma4_assistant`);
- `e2b`: Gemma 4 E2B's layer shapes (H 1536, 35 layers, the last 15 KV-shared, heads 8 / 1 kv, head dims
  256 / 512, window 512, per-layer embeddings of 256, double-wide MLPs on shared layers) and an assistant shaped
  like the E-model ones (H 256, 4 Q-only layers, 2048 centroids, top 32), with the vocabulary cut to `--vocab`
  (CPU memory: the full 262144 puts 2.3B parameters in the per-layer table alone);
- `tiny-dflash`, `tiny-dflash2`: `tiny_qwen3` with the DFlash 1 / DFlash 2 test drafts;
- `qwen3-0.6b`: Qwen3-0.6B's shapes (H 1024, 28 layers, 16 / 8 heads, head dim 128, vocabulary 151936) with a
  DFlash 1 draft of 5 layers at its width and block 16 (z-lab's `-b16` layout).
The engine runs with draft / verify timing (`profile`), AR and speculative rounds interleaved. Reported: the
target's decode step (one token, AR, host loop included), its verify step (K + 1 tokens), the draft step (K
tokens: K assistant steps, or one DFlash block) and per drafted token, and draft per token / decode step.
Acceptance does not enter (random weights): what drafting costs next to one target token is the quantity.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import specjax  # pylint: disable=g-import-not-at-top
from specjax.drafters import make_drafter
from specjax.loading.checkpoint import GenerationDefaults
from specjax.loading.gemma4_assistant import Gemma4AssistantCheckpoint, load_gemma4_assistant
from specjax.loading.registry import family_for
from specjax.models.base import Model
from specjax.models.gemma4_assistant import Gemma4Assistant, Gemma4AssistantConfig

FIXTURES = ROOT / 'tests' / 'fixtures'
SHAPES = ('tiny-g4', 'e2b', 'tiny-dflash', 'tiny-dflash2', 'qwen3-0.6b')
SLIDING, FULL = 'sliding_attention', 'full_attention'
ROPE = {
    SLIDING: {'rope_type': 'default', 'rope_theta': 10_000.0},
    FULL: {'rope_type': 'proportional', 'partial_rotary_factor': 0.25, 'rope_theta': 1_000_000.0},
}


def e2b_target(vocab: int) -> dict:
  return {
      'model_type': 'gemma4_text',
      'vocab_size': vocab,
      'vocab_size_per_layer_input': vocab,
      'hidden_size': 1536,
      'intermediate_size': 6144,
      'num_hidden_layers': 35,
      'num_attention_heads': 8,
      'num_key_value_heads': 1,
      'head_dim': 256,
      'global_head_dim': 512,
      'layer_types': ([SLIDING] * 4 + [FULL]) * 7,
      'sliding_window': 512,
      'num_kv_shared_layers': 15,
      'hidden_size_per_layer_input': 256,
      'use_double_wide_mlp': True,
      'final_logit_softcapping': 30.0,
      'rope_parameters': ROPE,
      'tie_word_embeddings': True,
  }


def e2b_assistant(vocab: int) -> dict:
  text = {
      'model_type': 'gemma4_text',
      'vocab_size': vocab,
      'hidden_size': 256,
      'intermediate_size': 2048,
      'num_hidden_layers': 4,
      'num_attention_heads': 4,
      'num_key_value_heads': 1,
      'head_dim': 256,
      'global_head_dim': 512,
      'layer_types': [SLIDING] * 3 + [FULL],
      'sliding_window': 512,
      'num_kv_shared_layers': 4,
      'hidden_size_per_layer_input': 0,
      'vocab_size_per_layer_input': 0,
      'rope_parameters': ROPE,
  }
  return {
      'model_type': 'gemma4_assistant',
      'text_config': text,
      'backbone_hidden_size': 1536,
      'use_ordered_embeddings': True,
      'num_centroids': 2048,
      'centroid_intermediate_top_k': 32,
      'tie_word_embeddings': True,
  }


def random_target(hf: dict, tokenizer, dtype=jnp.float32) -> Model:
  """A target of this config with random weights (no checkpoint is written)."""
  _, family = family_for(hf, 'random')
  cfg = family.config_from_hf(hf)
  graphdef, params = nnx.split(family.build(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  layout = nnx.merge(graphdef, params).cache_layout()
  return Model(
      graphdef,
      params,
      cfg,
      tokenizer,
      GenerationDefaults(),
      'random',
      hf['model_type'],
      list(layout.kv_shapes),
      [],
      dtype,
  )


def random_assistant(hf: dict) -> Gemma4AssistantCheckpoint:
  cfg = Gemma4AssistantConfig.from_hf(hf, {'num_assistant_tokens': 4}, 'random')
  module = Gemma4Assistant(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1))
  module.token_ordering.value = jnp.asarray(np.random.default_rng(0).permutation(cfg.vocab_size), jnp.int32)
  graphdef, params = nnx.split(module)
  return Gemma4AssistantCheckpoint(cfg, graphdef, params, 'random')


def qwen3_06b() -> dict:
  return {
      'model_type': 'qwen3',
      'vocab_size': 151936,
      'hidden_size': 1024,
      'intermediate_size': 3072,
      'num_hidden_layers': 28,
      'num_attention_heads': 16,
      'num_key_value_heads': 8,
      'head_dim': 128,
      'rope_theta': 1_000_000.0,
      'tie_word_embeddings': True,
  }


def random_dflash(target: Model, layers: int = 5, block: int = 16):
  from specjax.loading.dflash import DFlashCheckpoint, config_from_hf
  from specjax.models.dflash import DFlashDraft

  c = target.config
  hf = {
      'architectures': ['DFlashDraftModel'],
      'block_size': block,
      'dflash_config': {'mask_token_id': c.vocab_size - 1},
      'num_target_layers': c.num_layers,
      'hidden_size': c.hidden_size,
      'intermediate_size': c.intermediate_size,
      'num_hidden_layers': layers,
      'num_attention_heads': c.num_heads,
      'num_key_value_heads': c.num_kv_heads,
      'head_dim': c.head_dim,
      'rope_theta': 1_000_000.0,
      'vocab_size': c.vocab_size,
  }
  cfg = config_from_hf(hf, c, 'random')
  graphdef, params = nnx.split(DFlashDraft(cfg, dtype=jnp.float32, rngs=nnx.Rngs(1)))
  return DFlashCheckpoint(cfg, graphdef, params, 'random')


def pair(shape: str, vocab: int):
  """(target, drafter family, drafter checkpoint) of a shape."""
  tiny = lambda name: specjax.load(str(FIXTURES / name))
  if shape == 'tiny-g4':
    return (
        tiny('tiny_gemma4_for_assistant'),
        'gemma4-assistant',
        load_gemma4_assistant(str(FIXTURES / 'tiny_gemma4_assistant')),
    )
  if shape == 'e2b':
    tokenizer = tiny('tiny_gemma4_for_assistant').tokenizer  # prompts go in as ids
    return random_target(e2b_target(vocab), tokenizer), 'gemma4-assistant', random_assistant(e2b_assistant(vocab))
  if shape in ('tiny-dflash', 'tiny-dflash2'):
    return tiny('tiny_qwen3'), 'dflash', str(FIXTURES / shape.replace('-', '_'))
  target = random_target(qwen3_06b(), tiny('tiny_qwen3').tokenizer)
  return target, 'dflash', random_dflash(target)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--shape', nargs='+', default=list(SHAPES), choices=SHAPES)
  p.add_argument('--vocab', type=int, default=32768, help='vocabulary of the e2b shape (262144 on an accelerator)')
  p.add_argument('--depth', type=int, default=4)
  p.add_argument('--new-tokens', type=int, default=24)
  p.add_argument('--prompt-tokens', type=int, default=96)
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)

  out = {'depth': args.depth, 'vocab_e2b': args.vocab, 'rows': []}
  print(f'depth K = {args.depth}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens')
  print(
      '| shape | drafter | target params | drafter params | decode step ms | verify step ms (K + 1) | draft step ms '
      '(K) | draft ms / token | draft token / decode step |'
  )
  print('|---|---|---|---|---|---|---|---|---|')
  for shape in args.shape:
    target, family, checkpoint = pair(shape, args.vocab)
    target.generation = GenerationDefaults()  # no EOS: every run decodes its full length
    prompt = list(np.random.default_rng(0).integers(3, min(target.config.vocab_size, 500), args.prompt_tokens))
    drafter = make_drafter(family, target, draft_model=checkpoint)
    spec = specjax.Engine(target, drafter=drafter, max_draft=args.depth, profile=True)
    ar = specjax.Engine(target)
    for engine, k in ((spec, args.depth), (ar, 0)):  # compile
      engine.generate([prompt], max_new_tokens=4, num_draft=k)
    decode, verify, draft = [], [], []
    for _ in range(args.rounds):
      _, stats = ar.generate([prompt], max_new_tokens=args.new_tokens, num_draft=0)
      decode.append(stats.decode_s / stats.decode_steps)
      results, _ = spec.generate([prompt], max_new_tokens=args.new_tokens, num_draft=args.depth)
      s = results[0].spec
      verify.append(s.verify_s / s.target_steps)
      draft.append(s.draft_s / s.target_steps)
    row = {
        'shape': shape,
        'drafter': family,
        'target_params': target.num_params,
        'drafter_params': sum(x.size for x in jax.tree.leaves(drafter.params())),
        'decode_ms': 1e3 * statistics.median(decode),
        'verify_ms': 1e3 * statistics.median(verify),
        'draft_step_ms': 1e3 * statistics.median(draft),
    }
    row['draft_token_ms'] = row['draft_step_ms'] / args.depth
    row['ratio'] = row['draft_token_ms'] / row['decode_ms']
    out['rows'].append(row)
    print(
        f'| {shape} | {family} | {row["target_params"] / 1e6:,.1f}M | {row["drafter_params"] / 1e6:,.1f}M | '
        f'{row["decode_ms"]:.1f} | {row["verify_ms"]:.1f} | {row["draft_step_ms"]:.1f} | '
        f'{row["draft_token_ms"]:.2f} | {row["ratio"]:.3f} |',
        flush=True,
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
