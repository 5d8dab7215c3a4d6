"""A trained MTP head on disk: `config.json` + `model.safetensors` with Qwen's `mtp.*` names.

`specjax train` (drafter.kind = mtp) exports this layout; `load_mtp_head(path,
target)` reads it back for the target it was trained on (the `mtp` drafter's
`draft_model` option, `specjax run --drafter mtp --draft-model DIR`). The
tensors are named as in a Qwen3.5 checkpoint (`mtp.fc.weight` [D, 2D],
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.layers.0.*` in the target family's layer names, `mtp.norm.weight`),
float32. For a Qwen3.5 / Qwen3-Next target they are exactly the checkpoint's.
`head_for(target)` is the head a target of any family gets: Qwen's own layout
(gated attention) for the hybrids, else `models.mtp.draft_mtp_head` shaped as
the target's `draft_layer_spec()`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.models import mtp, qwen3_5

ARCHITECTURE = 'SpecjaxMTPHead'
CONFIG, WEIGHTS = 'config.json', 'model.safetensors'


def head_for(target, *, rngs: nnx.Rngs | None = None, attention_impl: str = 'auto', dtype=None) -> mtp.MTPHead:
  """A freshly initialised MTP head for a loaded target (`specjax.models.base.Model`), in `dtype` (its own)."""
  dtype = dtype or target.dtype or jnp.float32
  if isinstance(target.config, qwen3_5.Qwen35Config):
    return qwen3_5.mtp_head(target.config, attention_impl=attention_impl, dtype=dtype, rngs=rngs)
  return mtp.draft_mtp_head(target.module().draft_layer_spec(), attention_impl=attention_impl, dtype=dtype, rngs=rngs)


def params_from_hf(target, tensors: dict) -> dict:
  """HF-named `mtp.*` tensors as the pure-dict state of `head_for(target)`'s head."""
  if isinstance(target.config, qwen3_5.Qwen35Config):
    return qwen3_5.mtp_params_from_hf(target.config, tensors)
  return mtp.draft_params_from_hf(target.module().draft_layer_spec(), tensors)


def _describe(target) -> dict:
  return {
      'target_model_type': target.architecture,
      'hidden_size': int(target.config.hidden_size),
      'vocab_size': int(target.config.vocab_size),
      'tokenizer_fingerprint': target.tokenizer.fingerprint(),
  }


def save_mtp_head(path: str, target, params, *, extra: dict | None = None) -> None:
  """Writes `params` (an `MTPHead` state for `target`) to the directory `path` (atomically, files 0666 less the
  umask: `specjax.loading.hf.write_checkpoint`)."""
  from specjax.loading.hf import write_checkpoint
  from specjax.models.weights import hf_from_params

  pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
  tensors = hf_from_params(lambda t: params_from_hf(target, t), jax.device_get(pure))
  config = {
      'architectures': [ARCHITECTURE],
      'model_type': 'specjax_mtp',
      'mtp_num_hidden_layers': 1,
      **_describe(target),
      'torch_dtype': 'float32',
      **(extra or {}),
  }
  write_checkpoint(path, {CONFIG: config}, tensors)


def load_mtp_head(path: str, target, *, attention_impl: str = 'auto') -> tuple[nnx.GraphDef, nnx.State]:
  """An exported MTP head for `target` (a loaded Model): (graphdef, params) in the target's dtype."""
  from safetensors.numpy import load_file

  from specjax.loading import fill

  config_path = os.path.join(path, CONFIG)
  if not os.path.isfile(config_path):
    raise SpecjaxError(f'{path}: not an exported MTP head (needs {CONFIG} and {WEIGHTS})')
  with open(config_path, encoding='utf-8') as f:
    config = json.load(f)
  if not isinstance(config, dict) or ARCHITECTURE not in (config.get('architectures') or []):
    archs = config.get('architectures') if isinstance(config, dict) else None
    raise SpecjaxError(f'{path}: {CONFIG} is not an MTP head (architectures {archs})')
  if not os.path.isfile(os.path.join(path, WEIGHTS)):
    raise SpecjaxError(f'{path}: not an exported MTP head (needs {CONFIG} and {WEIGHTS})')
  want = _describe(target)
  for key in ('target_model_type', 'hidden_size', 'vocab_size', 'tokenizer_fingerprint'):
    if config.get(key) != want[key]:
      raise SpecjaxError(
          f'{path}: trained for another target ({key} {config.get(key)!r}, this target has {want[key]!r})'
      )
  tensors = load_file(os.path.join(path, WEIGHTS))
  abstract = nnx.eval_shape(lambda: head_for(target, attention_impl=attention_impl))
  pure = params_from_hf(target, tensors)
  if tensors:
    raise SpecjaxError(f'{path}: unexpected weights {sorted(tensors)[:5]}')
  return fill(abstract, pure, target.dtype, path)
