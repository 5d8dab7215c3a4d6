"""Twice the training steps: the EAGLE-3 head after 120 steps (one pass) against 240 (two), on Spec-Bench.

The two heads are configs/train_eagle3_gemma3_270m.py run to the end of a 120-step and of its default 240-step
schedule (the target's features of the 956 rows computed once, `train.cache_target`, a second pass reads them).
Cells at K = 5: n-gram alone (1..3); each head as a chain; the 240-step head as a 5-node tree
(top-4 expansion) and beside n-gram (`ngram+eagle3`, the head at 1 and at 5 where the lookup finds nothing).
Every category (the first 4 prompts of each, first turn), 64 new tokens, greedy, batch 1, each prompt also decoded
autoregressively, cells interleaved prompt by prompt:

  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m train.steps=120
  specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m_240
  specjax sweep configs/eagle3_steps_gemma3_270m_specbench.py \\
      --out experiments/train_eagle3_gemma3_270m/specbench_steps
"""

from specjax.sweep.config import base_config

ONE_PASS = 'runs/train_eagle3_gemma3_270m/export'
TWO_PASSES = 'runs/train_eagle3_gemma3_270m_240/export'


def get_config():
  config = base_config()
  config.name = 'eagle3_steps_gemma3_270m_specbench'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = {'k': [5]}
  config.grid.drafter = [
      {'kind': 'ngram'},
      {'kind': 'eagle3', 'draft_model': ONE_PASS},
      {'kind': 'eagle3', 'draft_model': TWO_PASSES},
      {'kind': 'eagle3', 'draft_model': TWO_PASSES, 'tree_topk': 4, 'tree_tokens': 5},
      {'kind': 'ngram+eagle3', 'draft_model': TWO_PASSES, 'fallback_depth': 1},
      {'kind': 'ngram+eagle3', 'draft_model': TWO_PASSES},
  ]
  return config
