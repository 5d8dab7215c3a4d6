"""A small sweep on the tiny test model: two drafters x (K = 2, K = 4, tuner), greedy.

specjax sweep configs/sweep_tiny.py --out runs/tiny
"""

import os

from specjax.sweep.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  config = base_config()
  config.name = 'sweep_tiny'
  config.model = os.path.join(ROOT, 'tests', 'fixtures', 'tiny_gemma3')
  config.page_size = 4
  config.max_new_tokens = 12
  config.drafter.layers = 2
  config.prompts.categories = ['qa', 'math']
  config.prompts.limit = 1
  config.grid.drafter = {'kind': ['ngram', 'layer-skip']}
  config.grid.policy = [
      {'name': 'fixed', 'k': 2},
      {'name': 'fixed', 'k': 4},
      {'name': 'tuner', 'candidates': [2, 4]},
  ]
  return config
