"""Drafter training learns what it is given (issue: "drafters barely learn where the answer is one matmul away").

Synthetic targets (`specjax.train.synthetic`) whose next-next token is an easy
function of what a drafter sees: `bigram` (the next token is σ(x_t), so a
drafter fed x_{t+1} drafts σ(x_{t+1}), a lookup) and `copy` (the next token is
the one 3 back: drafts copy the context). Each family trains through
`run_training`, must reach top-1 agreement >= 0.9 on the held-out rows, and its
export, served at K = 4 greedy on unseen prompts, must reach τ >= 3 with the
autoregressive output.

Data: prompts answered by the target itself. The bigram target's answers are
sampled (T = 1 over a head of scale 1.1: σ(x) has p ~ 0.7), so they wander over the
vocabulary; greedy answers would all be one walk, since plain-text prompts end
in the same "\\n\\n" token and the target reads only its last token. Random text
is no substitute: a head trained where x_{t+1} is unrelated to the taps at t
agrees 0.97 teacher-forced and serves τ 1.19 on the target's own walks
(experiments/learnability/README.md).
"""

import json
import os

import numpy as np
import pytest

from conftest import FIXTURES

TOKENIZER = os.path.join(FIXTURES, 'tiny_llama3')
LETTERS = 'abcdefghijklmnopqrstuvwxyz'


def random_prompts(n: int, seed: int) -> list[str]:
  """Strings of random letters: BPE pieces all over the vocabulary, so the answers visit every token."""
  rng = np.random.default_rng(seed)
  word = lambda: ''.join(rng.choice(list(LETTERS), rng.integers(2, 7)))
  return [' '.join(word() for _ in range(rng.integers(3, 8))) for _ in range(n)]


@pytest.fixture(scope='module')
def targets(tmp_path_factory):
  from specjax.train.synthetic import make_synthetic_target

  root = tmp_path_factory.mktemp('synthetic')
  data = {'answers': root / 'prompts.jsonl', 'text': root / 'text.jsonl'}
  with open(data['answers'], 'w') as f:
    for p in random_prompts(288, seed=0):
      f.write(json.dumps({'prompt': p, 'response': ''}) + '\n')
  with open(data['text'], 'w') as f:
    for p in random_prompts(32, seed=2):
      f.write(json.dumps({'text': p}) + '\n')
  paths = {
      'bigram': make_synthetic_target(str(root / 'bigram'), 'bigram', tokenizer_from=TOKENIZER, scale=1.1),
      'copy': make_synthetic_target(str(root / 'copy'), 'copy', tokenizer_from=TOKENIZER),
  }
  return paths, {k: str(v) for k, v in data.items()}, str(root / 'regenerated')


def train(targets, kind: str, family: str, out: str, steps: int, **drafter):
  from specjax.train import run_training

  paths, data, cache = targets
  cfg = {
      'target': {'model': paths[kind]},
      'drafter': {'kind': family, **drafter},
      'data': {
          'path': data['answers'],
          'max_len': 64,
          'regenerate': True,
          'regenerate_max_new_tokens': 40,
          'regenerate_temperature': 1.0 if kind == 'bigram' else 0.0,
          'cache_dir': cache,
      },
      'train': {'steps': steps, 'batch_size': 8, 'lr': 3e-3, 'warmup': 0.05, 'ttt_steps': 4, 'log_every': steps},
      'eval': {'every': steps, 'limit': 32},
  }
  run_training(cfg, out, progress=False)
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    (last,) = [r for r in map(json.loads, f) if r['type'] == 'eval']
  return last


def serve_tau(targets, kind: str, family: str, export: str) -> float:
  import specjax
  from specjax.drafters import make_drafter

  model = specjax.load(targets[0][kind])
  # Unseen prompts from the training distribution, formatted as training formats them (plain text: the prompt,
  # then a blank line): the copy target's answers repeat the prompt's last tokens, that blank line among them.
  prompts = [p + '\n\n' for p in random_prompts(6, seed=1)]
  plain, _ = specjax.Engine(model).generate(prompts, max_new_tokens=32)
  engine = specjax.Engine(model, drafter=make_drafter(family, model, draft_model=export), max_draft=4)
  spec, _ = engine.generate(prompts, max_new_tokens=32, num_draft=4)
  assert [r.tokens for r in spec] == [r.tokens for r in plain]
  return float(np.mean([r.spec.tau for r in spec]))


@pytest.mark.parametrize(
    'kind,family,steps,drafter',
    [
        ('bigram', 'eagle3', 250, {'draft_vocab_size': 512, 'target_layer_ids': [0, 1, 2]}),
        ('copy', 'eagle3', 300, {'draft_vocab_size': 512, 'target_layer_ids': [0, 1, 2]}),
        ('bigram', 'mtp', 150, {}),
        pytest.param(
            'copy',
            'dflash',
            300,
            {'block_size': 8, 'target_layer_ids': [0, 1], 'mask_token_id': 503},
            marks=pytest.mark.xfail(
                reason='DFlash plateaus below 0.9 on the copy target: held-out agreement 0.87 / 0.87 / 0.90 / 0.95 at '
                'step 450 (0.87 / 0.88 / 0.90 / 0.93 at 300), served τ ~3.1 at K = 4 (experiments/learnability)'
            ),
        ),
    ],
)
def test_trained_drafter_learns_and_serves(targets, tmp_path, kind, family, steps, drafter):
  out = str(tmp_path / 'run')
  last = train(targets, kind, family, out, steps, **drafter)
  tau = serve_tau(targets, kind, family, os.path.join(out, 'export'))
  assert min(last['agree'][:4]) >= 0.9, last
  assert tau >= 3.0


def test_logit_lens_start_predicts_the_token_the_head_is_given(targets):
  """`drafter.head_from_target` on the final layer's tap reproduces the target's prediction at t exactly: x_{t+1},
  the token step 0 is fed. EAGLE-3 scores step 0 on x_{t+2} (the target at t + 1), which the lens gets only where
  the two coincide: on the bigram target, never. The start is exact; it answers the question one token early."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import specjax
  from specjax.train.config import resolve
  from specjax.train.losses import sequence_batch, target_features
  from specjax.train.trainers import make_trainer

  model = specjax.load(targets[0]['bigram'])
  cfg = {
      'target': {'model': targets[0]['bigram']},
      'drafter': {'kind': 'eagle3', 'draft_vocab_size': 512, 'target_layer_ids': [0, 1, 2], 'head_from_target': True},
      'data': {'path': targets[1]['text']},
  }
  trainer = make_trainer(resolve(cfg), model, None)
  params, target = trainer.init(jax.random.key(0)), model.module()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 501, (2, 24)), jnp.int32)
  batch = sequence_batch(tokens)
  hidden, taps = target_features(target, batch, trainer.taps)
  step0 = trainer.unroll(params, target, batch, taps)[0]
  drafted = trainer.draft_ids()[jnp.argmax(nnx.merge(trainer.graphdef, params).logits(step0), axis=-1)]
  best = jnp.argmax(target.logits(hidden), axis=-1)  # [B, T] the target's prediction at t: x_{t+1}
  assert bool(jnp.all(drafted == best))
  assert float(jnp.mean(drafted[:, :-1] == best[:, 1:])) < 0.05  # what training scores step 0 on
