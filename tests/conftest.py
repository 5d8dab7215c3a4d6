import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures')
TINY = os.path.join(FIXTURES, 'tiny_gemma3')
TINY_SHARDED = os.path.join(FIXTURES, 'tiny_gemma3_sharded')


@pytest.fixture(scope='session')
def tiny_model():
  import specjax
  return specjax.load(TINY)


@pytest.fixture(scope='session')
def tiny_engine(tiny_model):
  import specjax
  return specjax.Engine(tiny_model, page_size=4)


def perturbed_target(scale: float):
  """The tiny target with noisy weights: a draft model that agrees with it partly."""
  import numpy as np
  import specjax
  from specjax.loading import build_model
  ckpt = specjax.load_checkpoint(TINY)
  rng = np.random.default_rng(0)
  for name, w in ckpt.tensors.items():
    ckpt.tensors[name] = w + rng.normal(0, scale, w.shape).astype(np.float32)
  return build_model(ckpt)
