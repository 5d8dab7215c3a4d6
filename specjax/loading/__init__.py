"""Loaders: local HF directories, hub ids, GGUF files and demo packages."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults
from specjax.loading.registry import DEMO_MODELS, family_for

HUB_ID = re.compile(r'^[A-Za-z0-9][\w.-]*/[\w.-]+$')


def resolve(spec: str) -> str:
  """A local path for a model spec: a demo name, a path, or a hub id."""
  if spec in DEMO_MODELS:
    return DEMO_MODELS[spec].path()
  path = os.path.expanduser(spec)
  if os.path.exists(path):
    return path
  if HUB_ID.match(spec) and not spec.startswith(('.', '/')):
    from specjax.loading.hf import resolve_hub_id
    return resolve_hub_id(spec)
  raise SpecjaxError(
      f'model {spec!r} not found: not a file, a directory, a hub id (org/name) '
      f'or a demo name ({", ".join(DEMO_MODELS)})')


def load_checkpoint(spec: str) -> Checkpoint:
  """Reads a checkpoint (config, weights, tokenizer) without building a model."""
  path = resolve(spec)
  if os.path.isdir(path):
    from specjax.loading.hf import load_hf_dir, read_hf_config
    config = read_hf_config(path)
    family_for(config, path)  # unknown architectures fail before reading weights
    return load_hf_dir(path, config=config)
  from specjax.loading.gguf import load_gguf
  return load_gguf(path)


def build_model(ckpt: Checkpoint, *, attention_impl: str = 'auto'):
  """Builds the NNX module abstractly, splits it once and fills in the weights."""
  from specjax.models.base import Model
  arch, family = family_for(ckpt.config, ckpt.source)
  cfg = family.config_from_hf(ckpt.config)
  abstract = nnx.eval_shape(lambda: family.module(cfg, attention_impl=attention_impl))
  graphdef, state = nnx.split(abstract)
  pure = family.params_from_hf(cfg, ckpt.tensors)
  if ckpt.tensors:
    extra = sorted(ckpt.tensors)[:5]
    raise SpecjaxError(f'{ckpt.source}: {len(ckpt.tensors)} unexpected weights, e.g. {extra}')
  pure = jax.tree.map(jnp.asarray, pure)
  nnx.replace_by_pure_dict(state, pure)
  return Model(graphdef, state, cfg, ckpt.tokenizer, ckpt.generation, ckpt.source, arch,
               kv_shapes=abstract.kv_layer_shapes())


def load(spec: str, *, attention_impl: str = 'auto'):
  """Loads a model by demo name (`gemma-3-270m`), local path or hub id."""
  return build_model(load_checkpoint(spec), attention_impl=attention_impl)
