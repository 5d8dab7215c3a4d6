"""The trained EAGLE-3 head on Spec-Bench: chain against trees, against n-gram and plain decoding (Gemma 3 270M).

Every category (the first prompt of each, first turn; `prompts.limit=2` doubles it), 64 new tokens, greedy,
batch 1, K = 5 for every drafter: n-gram prompt lookup, the EAGLE-3 chain (6 tokens verified a step) and an
EAGLE-2 dynamic tree of 32 nodes (top-4 expansion, depth 5; add `{'kind': 'eagle3', 'draft_model': EXPORT,
'tree_topk': 4, 'tree_tokens': 16}` for 16). Every prompt is also decoded autoregressively, the speedups'
baseline. Cells run interleaved prompt by prompt, so every cell meets the same machine load. The head is the
export of configs/train_eagle3_gemma3_270m.py:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m
  specjax sweep configs/eagle3_gemma3_270m_specbench.py --out experiments/train_eagle3_gemma3_270m/specbench
"""

from specjax.sweep.config import base_config

EXPORT = 'runs/train_eagle3_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'eagle3_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 1
  config.policy.k = 5
  config.grid.drafter = [
      {'kind': 'ngram'},
      {'kind': 'eagle3', 'draft_model': EXPORT},
      {'kind': 'eagle3', 'draft_model': EXPORT, 'tree_topk': 4, 'tree_tokens': 32},
  ]
  return config
