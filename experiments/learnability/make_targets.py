"""Writes the synthetic targets of this study under DIR (default runs/synthetic) and a prompts file.

python experiments/learnability/make_targets.py [DIR]
"""

import json
import os
import sys

import numpy as np

from specjax.train.synthetic import make_synthetic_target

TOKENIZER = os.path.join(os.path.dirname(__file__), '..', '..', 'tests', 'fixtures', 'tiny_llama3')
WORDS = 'the cat sat on a mat and the dog ran to the park while birds sang in trees of green old houses by rivers'


def main(root: str) -> None:
  targets = {
      'bigram': {},
      'copy': {},
      'confident': {},  # random weights of std 0.1, lm_head x 8: max p 0.66, entropy 1.09 nats
      'flat': {'std': 0.02},  # Hugging Face's initialiser, lm_head x 8: max p 0.047, entropy 5.42 nats
  }
  for name, kw in targets.items():
    kind = 'confident' if name == 'flat' else name
    print(make_synthetic_target(os.path.join(root, name), kind, tokenizer_from=TOKENIZER, **kw))
  rng = np.random.default_rng(0)
  with open(os.path.join(root, 'prompts.jsonl'), 'w') as f:
    for _ in range(256):
      prompt = ' '.join(rng.choice(WORDS.split(), rng.integers(4, 12)))
      f.write(json.dumps({'prompt': prompt, 'response': ''}) + '\n')


if __name__ == '__main__':
  main(sys.argv[1] if len(sys.argv) > 1 else 'runs/synthetic')
