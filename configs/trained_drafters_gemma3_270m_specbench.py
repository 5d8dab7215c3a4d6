"""Every drafter trained here on Spec-Bench, side by side: EAGLE-3 chain and tree, DFlash, n-gram (Gemma 3 270M).

Every category (the first 4 prompts of each, first turn), 64 new tokens, greedy, batch 1, K = 5 for every drafter:
n-gram prompt lookup, the EAGLE-3 chain, an EAGLE-2 dynamic tree of 32 nodes (top-4, depth 5) and the DFlash
block (block 8: the first 5 of its 7 drafts are verified). Every prompt is also decoded autoregressively, the
speedups' baseline; cells run interleaved prompt by prompt. The drafters are the exports of

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax train configs/train_dflash_gemma3_270m.py --out runs/train_dflash_gemma3_270m
  specjax sweep configs/trained_drafters_gemma3_270m_specbench.py --out experiments/train_dflash_gemma3_270m/specbench

(an export is refreshed at every checkpoint, so a run cut short is measured where it stopped: the manifest
records each export's files, the training manifests their steps).
"""

from specjax.sweep.config import base_config

EAGLE3 = 'runs/train_eagle3_gemma3_270m/export'
DFLASH = 'runs/train_dflash_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'trained_drafters_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.policy.k = 5
  config.grid.drafter = [
      {'kind': 'ngram'},
      {'kind': 'eagle3', 'draft_model': EAGLE3},
      {'kind': 'eagle3', 'draft_model': EAGLE3, 'tree_topk': 4, 'tree_tokens': 32},
      {'kind': 'dflash', 'draft_model': DFLASH},
  ]
  return config
