"""Draft-depth policies against the oracle best fixed K (Gemma 3 270M, CPU, n-gram drafter).

Fixed K = 2, 4, 6, 8, the tuner over {2, 4, 6, 8} and the load policy (full depth 8; at
batch 1 it never reduces), greedy, 4 prompts per category, 64 new tokens. Cells run
interleaved, prompt by prompt, so every policy meets the same machine load on each prompt,
and each batch is timed twice (the faster run counts) to damp the noise of a shared CPU.

  specjax sweep configs/gemma3_270m_policies.py --out experiments/policies_vs_oracle/results
"""

from specjax.sweep.config import base_config


def get_config():
  config = base_config()
  config.name = 'gemma3_270m_policies'
  config.model = 'gemma-3-270m'
  config.max_new_tokens = 64
  config.interleave = True
  config.repeats = 2
  config.drafter.kind = 'ngram'
  config.prompts.categories = ['coding', 'math_reasoning', 'qa', 'summarization', 'translation', 'writing']
  config.prompts.limit = 4  # prompts per category: a study uses at least 4
  config.grid.policy = [
      {'name': 'fixed', 'k': 2},
      {'name': 'fixed', 'k': 4},
      {'name': 'fixed', 'k': 6},
      {'name': 'fixed', 'k': 8},
      {'name': 'tuner', 'candidates': [2, 4, 6, 8]},
      {'name': 'load', 'k': 8},
  ]
  return config
