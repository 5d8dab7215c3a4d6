"""MTP drafting on a hybrid target: built-in MTP vs n-gram over the MTP family's depths, plus the tuner.

  specjax sweep configs/hybrid_mtp_tiny.py --out runs/hybrid_mtp_tiny
  specjax sweep configs/hybrid_mtp_tiny.py --out runs/qwen3_5_0_8b "model='Qwen/Qwen3.5-0.8B'" page_size=16

The default model is the tiny random Qwen3.5 test checkpoint (acceptance means nothing there: it checks the
plumbing and measures cost). `drafter.kind=mtp` loads the target's mtp.* head.
"""

import os

from specjax.sweep.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  config = base_config()
  config.name = 'hybrid_mtp_tiny'
  config.model = os.path.join(ROOT, 'tests', 'fixtures', 'tiny_qwen3_5')
  config.page_size = 4
  config.max_new_tokens = 12
  config.prompts.categories = ['qa', 'math']
  config.prompts.limit = 1
  config.grid.drafter = {'kind': ['mtp', 'ngram']}
  config.grid.policy = [{'name': 'fixed', 'k': k} for k in (2, 3, 4, 6)] + [{'name': 'tuner'}]
  return config
