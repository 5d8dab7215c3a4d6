"""An EAGLE-3 head for Gemma 3 270M (base), trained on the target's own answers.

specjax train configs/train_eagle3_gemma3_270m.py --out runs/train_eagle3_gemma3_270m

Taps: outputs of layers 1, 8 and 14 of the 18 (1, L/2 - 1, L - 4); one Llama
layer of the target's width (640), heads (4 q / 1 kv, head dim 256) and MLP;
the layer's residual is hidden_norm(fc(taps)) (`drafter.norm_before_residual`,
the default: Gemma's taps have RMS 40-900, and with the raw fc(taps) as the
residual a head trained here ignored its input token); fc reads each tap channel
divided by its RMS over the first training rows (`drafter.tap_scale`, folded
into fc at export: four channels hold 98% of Gemma 3's tap energy, and the
scaled head reaches the unscaled one's step-120 eval τ at step 80); draft
vocabulary: the 8192 most frequent target tokens of the training data,
as d2t / t2d (the draft head and the target's draft-vocab projection are most
of a step's cost on a CPU). Training-time test unrolled 6 steps (chains of 5
drafts and the bonus), weights 0.8^i. The head starts at random, as
SpecForge's (`drafter.head_from_target=True`, the target's logit lens on the
last tap, did not beat it at 40 steps; see the experiment's README). 240 steps
of 8 x 512 tokens, two passes over the 956 packed rows (eval τ 1.70; one pass,
`train.steps=120 train.cache_target=False`, gave 1.48); the target runs once
per row first (`train.cache_target`, ~28 min, ~5 GB under --out), then a step
takes ~12 s on 2 cores: ~80 minutes in all. Rerun the command to resume
(checkpoints every 10 steps; the export is refreshed at each).
Data as in train_mtp_gemma3_270m.py (ShareGPT, reasoning-gym and
standard-library code, answered by the target itself).
Smoke test (~4 minutes on 2 CPU cores; README, Training drafters):
  specjax train configs/train_eagle3_gemma3_270m.py --out /tmp/smoke_e3 train.steps=2 data.limit=8 \
      data.regenerate_max_new_tokens=16 data.max_len=128 train.batch_size=2 eval.limit=4
"""

from specjax.train.config import base_config


def get_config():
  config = base_config()
  config.name = 'train_eagle3_gemma3_270m'
  config.target.model = 'gemma-3-270m'
  config.drafter.kind = 'eagle3'
  config.drafter.draft_vocab_size = 8192
  config.drafter.tap_scale = True
  config.data.sources = ['sharegpt', 'reasoning_gym:chain_sum,basic_arithmetic,word_sorting', 'stdlib_code']
  config.data.limit = 400  # records per source (CPU budget; raise on a GPU)
  config.data.regenerate = True
  config.data.regenerate_max_new_tokens = 192
  config.data.regenerate_batch_size = 64
  config.data.max_len = 512
  config.train.steps = 240
  config.train.batch_size = 8
  config.train.lr = 6e-4
  config.train.warmup = 0.05
  config.train.clip = 0.5
  config.train.ttt_steps = 6
  config.train.save_every = 10
  config.train.cache_target = True  # two passes: the target runs once per row, its features on disk
  config.eval.every = 40
  config.eval.limit = 32
  return config
