"""The trained DFlash draft on Spec-Bench at its full block (Gemma 3 270M): alone, beside n-gram, and n-gram first.

Block 8, so K = 7 drafts for every cell: n-gram prompt lookup (1..3), the DFlash draft, and `ngram+dflash` (the
lookup where the last tokens occurred before, the draft's block elsewhere). Every category (the first 4 prompts
of each, first turn), 64 new tokens, greedy, batch 1; every prompt is also decoded autoregressively, the
speedups' baseline, and cells run interleaved prompt by prompt. The draft is the export of the 120-step run:

  specjax train configs/train_dflash_gemma3_270m.py --out runs/train_dflash_gemma3_270m \\
      data.cache_dir="'runs/regenerated'" drafter.tap_scale=True train.steps=120
  specjax sweep configs/dflash_gemma3_270m_specbench.py --out experiments/train_dflash_gemma3_270m/specbench_120
"""

from specjax.sweep.config import base_config

DFLASH = 'runs/train_dflash_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'dflash_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = {'k': [7]}
  config.grid.drafter = [
      {'kind': 'ngram'},
      {'kind': 'dflash', 'draft_model': DFLASH},
      {'kind': 'ngram+dflash', 'draft_model': DFLASH},
  ]
  return config
