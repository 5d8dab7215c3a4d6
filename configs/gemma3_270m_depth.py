"""Acceptance and speedup vs draft depth across Spec-Bench categories (Gemma 3 270M, CPU).

n-gram prompt lookup and layer-skip (the first 12 of 18 layers, final norm and tied head)
at K = 2, 4, 6, 8, greedy, 4 prompts per category, 32 new tokens, batch 1. (With 4 layers
it accepts nothing: without early-exit training the head cannot read layer-4 states.)

  specjax sweep configs/gemma3_270m_depth.py --out experiments/depth_vs_category/results
"""

from specjax.sweep.config import base_config


def get_config():
  config = base_config()
  config.name = 'gemma3_270m_depth'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 32
  config.drafter.layers = 12
  config.prompts.categories = ['coding', 'math_reasoning', 'qa', 'summarization', 'translation', 'writing']
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.drafter = {'kind': ['ngram', 'layer-skip']}
  config.grid.policy = {'k': [2, 4, 6, 8]}
  return config
