"""The trained EAGLE-3 head on Spec-Bench: chain against tree at equal verify budget (Gemma 3 270M).

A chain of K drafts and a tree of K draft nodes both verify K + 1 tokens a step. Cells: depth K in {5, 15}
crossed with the chain and EAGLE-2 dynamic trees (top-4 expansion) of 5 and 15 draft nodes, so each chain
has a tree of equal depth and equal budget beside it (K = 5 with 5 nodes, K = 15 with 15), and the other two
cells trade depth for breadth at a fixed budget. Every category (the first 4 prompts of each, first turn), 64 new
tokens, greedy, batch 1; every prompt is also decoded autoregressively, the speedups' baseline, and cells run
interleaved prompt by prompt. n-gram, DFlash and the 32-node tree are in
configs/trained_drafters_gemma3_270m_specbench.py. The head is the export of
configs/train_eagle3_gemma3_270m.py:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax sweep configs/eagle3_gemma3_270m_specbench.py --out experiments/train_eagle3_gemma3_270m/specbench_budget
"""

from specjax.sweep.config import base_config

EXPORT = 'runs/train_eagle3_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'eagle3_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = {'k': [5, 15]}
  config.grid.drafter = [
      {'kind': 'eagle3', 'draft_model': EXPORT},
      {'kind': 'eagle3', 'draft_model': EXPORT, 'tree_topk': 4, 'tree_tokens': 5},
      {'kind': 'eagle3', 'draft_model': EXPORT, 'tree_topk': 4, 'tree_tokens': 15},
  ]
  return config
