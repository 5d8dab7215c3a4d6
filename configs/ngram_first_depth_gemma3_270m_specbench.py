"""How long a chain the trained EAGLE-3 head should draft where the n-gram lookup finds nothing (Gemma 3 270M).

On this CPU a verify of K + 1 = 6 tokens costs ~1.7 decode steps, and the head's chain emits τ ≈ 1.3 there
(configs/ngram_first_gemma3_270m_specbench.py, session 17): the hybrid's head steps lose time against n-gram's
free decode steps. `--fallback-depth N` keeps the lookup's full K = 5 and caps the head's chain at N, so rows
without a match verify N + 1 positions (rounded up to the verify widths 2, 4, 6). Cells: n-gram alone (1..3) and
`ngram+eagle3` with the head at 5 (the full K), 3, 2 and 1. Every category (the first 4 prompts of each, first turn),
64 new tokens, greedy, batch 1, each prompt also decoded autoregressively, cells interleaved prompt by prompt:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax sweep configs/ngram_first_depth_gemma3_270m_specbench.py \\
      --out experiments/train_eagle3_gemma3_270m/specbench_fallback_depth
"""

from specjax.sweep.config import base_config

EXPORT = 'runs/train_eagle3_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'ngram_first_depth_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = {'k': [5]}
  config.grid.drafter = [{'kind': 'ngram'}] + [
      {'kind': 'ngram+eagle3', 'draft_model': EXPORT, 'fallback_depth': depth} for depth in (0, 3, 2, 1)
  ]
  return config
