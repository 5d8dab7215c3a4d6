"""A DFlash draft for Gemma 3 270M (base), trained on the target's own answers.

specjax train configs/train_dflash_gemma3_270m.py --out runs/train_dflash_gemma3_270m
specjax run -m gemma-3-270m --drafter dflash --draft-model runs/train_dflash_gemma3_270m/export --prompt ...

Draft: three Qwen3-style layers of the target's width (640), heads (4 q / 1 kv,
head dim 256) and MLP width (2048), fed the outputs of layers 1, 8 and 15 of
the 18 (the default spacing from 1 to L - 3); the target's embedding and head.
Block 8 with gamma 4 (NVIDIA Model-Optimizer's setting; SpecForge's block 16
with gamma 7 doubles every step's cost and drafts deeper than a 270M target's
answers usually agree), mask token `<mask>` (id 4, the tokenizer's own).
64 anchors per 512-token row: about a fifth of the learnable positions, the
share of SpecForge's 512 anchors in 3072-token rows; the full-vocabulary
(262k) projection of the 7 scored rows of every block is most of a step's
cost, so anchors are the knob for a CPU budget (raise them on a GPU).
Optimizer as SpecForge's DFlash recipe: lr 6e-4, warmup 0.04, clip 1.0.
40 steps of 8 x 512 tokens (about a third of a pass over the packed rows):
what one CPU session affords (~80 s a step on 2 cores; raise it on a GPU).
Data and regeneration settings as train_eagle3_gemma3_270m.py (ShareGPT,
reasoning-gym and standard-library code, answered by the target itself), so
its regenerated answers are reused from the cache.
Smoke test:
  specjax train configs/train_dflash_gemma3_270m.py --out /tmp/smoke_df train.steps=2 data.limit=8 \
      data.regenerate_max_new_tokens=16 data.max_len=128 train.batch_size=2 eval.limit=4
"""

from specjax.train.config import base_config


def get_config():
  config = base_config()
  config.name = 'train_dflash_gemma3_270m'
  config.target.model = 'gemma-3-270m'
  config.drafter.kind = 'dflash'
  config.drafter.layers = 3
  config.drafter.block_size = 8
  config.drafter.anchors = 64
  config.data.sources = ['sharegpt', 'reasoning_gym:chain_sum,basic_arithmetic,word_sorting', 'stdlib_code']
  config.data.limit = 400  # records per source (CPU budget; raise on a GPU)
  config.data.regenerate = True
  config.data.regenerate_max_new_tokens = 192
  config.data.regenerate_batch_size = 64
  config.data.max_len = 512
  config.train.steps = 40
  config.train.batch_size = 8
  config.train.lr = 6e-4
  config.train.warmup = 0.04
  config.train.clip = 1.0
  config.train.dflash_gamma = 4.0
  config.train.save_every = 10
  config.train.cache_target = False  # under one pass: the target runs in the step (True: once per row, on disk)
  config.eval.every = 20
  config.eval.limit = 32
  return config
