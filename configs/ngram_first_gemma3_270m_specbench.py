"""n-gram lookup first, the trained EAGLE-3 head elsewhere, on Spec-Bench (Gemma 3 270M).

Cells at depth K = 5: n-gram alone (1..3), the EAGLE-3 head alone as a chain and as a 5-node EAGLE-2 tree (top-4
expansion, the same verify budget), and `ngram+eagle3` with the lookup's shortest match at 1, 2 and 3 tokens
(shorter matches look up more steps and leave fewer to the head). Every category (the first 4 prompts of each,
first turn), 64 new tokens, greedy, batch 1; every prompt is also decoded autoregressively, the speedups'
baseline, and cells run interleaved prompt by prompt. The head is the export of
configs/train_eagle3_gemma3_270m.py:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax sweep configs/ngram_first_gemma3_270m_specbench.py --out experiments/train_eagle3_gemma3_270m/specbench_ngram_first
"""

from specjax.sweep.config import base_config

EXPORT = 'runs/train_eagle3_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'ngram_first_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = {'k': [5]}
  config.grid.drafter = [
      {'kind': 'ngram'},
      {'kind': 'eagle3', 'draft_model': EXPORT},
      {'kind': 'eagle3', 'draft_model': EXPORT, 'tree_topk': 4, 'tree_tokens': 5},
      {'kind': 'ngram+eagle3', 'draft_model': EXPORT, 'ngram_min': 1},
      {'kind': 'ngram+eagle3', 'draft_model': EXPORT, 'ngram_min': 2},
      {'kind': 'ngram+eagle3', 'draft_model': EXPORT, 'ngram_min': 3},
  ]
  return config
