"""The trained EAGLE-3 head on Spec-Bench, sampled: EAGLE-2 trees verified one-hot against q (Gemma 3 270M).

Sampled requests verify a dynamic tree either with q (children drawn without replacement from the head's q,
kept by a per-level budget, recursive rejection sampling; the default) or one-hot (the top children, as
greedy, verified by sample-and-match: `--tree-verify one-hot`). Both are exact; this study reports their τ and
acceptance at temperature 0.7 and 1.0. Cells: the two verifications crossed with 5- and 15-node trees (top-4
expansion, depth K = 5) and both temperatures. Every category, 4 prompts each (first turn), 64 new tokens,
batch 1, one seed; every prompt is also decoded without drafts (the speedups' baseline), cells interleaved
prompt by prompt. The head is the export of configs/train_eagle3_gemma3_270m.py:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax sweep configs/eagle3_tree_verify_gemma3_270m_specbench.py \
      --out experiments/train_eagle3_gemma3_270m/specbench_tree_verify
"""

from specjax.sweep.config import base_config

EXPORT = 'runs/train_eagle3_gemma3_270m/export'


def get_config():
  config = base_config()
  config.name = 'eagle3_tree_verify_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4
  config.sampling.seed = 1
  config.policy.k = 5
  config.grid.sampling = {'temperature': [0.7, 1.0]}
  config.grid.drafter = [
      {'kind': 'eagle3', 'draft_model': EXPORT, 'tree_topk': 4, 'tree_tokens': tokens, 'tree_verify': verify}
      for tokens in (5, 15)
      for verify in ('q', 'one-hot')
  ]
  return config
