"""specjax: speculative decoding research framework in JAX.

import specjax
model = specjax.load('gemma-3-270m')
results, stats = specjax.generate(model, ['The capital of France is'], max_new_tokens=32)
"""

# pylint: disable=g-import-not-at-top,g-bad-import-order
from specjax import xla_flags

xla_flags.set_before_backend()  # before jax starts its CPU backend (specjax/xla_flags.py)

from specjax.engine import Engine, GenerationResult, GenerationStats
from specjax.errors import OutOfPagesError, SpecjaxError
from specjax.loading import load, load_checkpoint
from specjax.sampling import SamplingParams


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams = SamplingParams(),
    stream=None,
    **engine_kwargs,
):
  """One-shot generation: builds an `Engine` and generates (see `Engine.generate`)."""
  return Engine(model, **engine_kwargs).generate(
      prompts, max_new_tokens=max_new_tokens, sampling=sampling, stream=stream
  )


__all__ = [
    'Engine',
    'GenerationResult',
    'GenerationStats',
    'OutOfPagesError',
    'SamplingParams',
    'SpecjaxError',
    'generate',
    'load',
    'load_checkpoint',
]
