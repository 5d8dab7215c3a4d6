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
