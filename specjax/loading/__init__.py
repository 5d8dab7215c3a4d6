"""Loaders: local HF directories, hub ids, GGUF files and demo packages."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults  # noqa: F401 (specjax.loading API)
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
      f'or a demo name ({", ".join(DEMO_MODELS)})'
  )


MTP_PREFIX = 'mtp.'


def check_mtp(path: str, config: dict | None) -> None:
  """Built-in MTP needs an HF checkpoint of an MTP family with `mtp.*` weights (headers only are read)."""
  if config is None:
    raise SpecjaxError(
        f'{path}: built-in MTP (--mtp) is not supported from GGUF checkpoints; '
        'use the HF safetensors checkpoint, which carries the mtp.* weights'
    )
  arch, family = family_for(config, path)
  if not family.has_mtp:
    raise SpecjaxError(f'{path}: {arch} models have no built-in MTP head (--mtp is for Qwen3.5 / Qwen3-Next)')
  from specjax.loading.hf import tensor_names

  names = tensor_names(path)
  if 'mtp.fc.weight' not in names:
    raise SpecjaxError(
        f'{path}: no built-in MTP weights (mtp.* tensors) in this checkpoint; '
        'drop --mtp or use a drafter (--drafter ngram / draft-model)'
    )
  layers = {n.split('.')[2] for n in names if n.startswith('mtp.layers.')}
  if layers != {'0'}:
    raise SpecjaxError(f'{path}: the MTP head has layers {sorted(layers)}; specjax runs one MTP layer (mtp.layers.0)')


def load_checkpoint(spec: str, *, mtp: bool = False) -> Checkpoint:
  """Reads a checkpoint (config, weights, tokenizer) without building a model.

  `mtp.*` weights (a built-in MTP head) are read only with `mtp=True`, which
  first checks that the checkpoint has them.
  """
  path = resolve(spec)
  if os.path.isdir(path):
    from specjax.loading.hf import load_hf_dir, read_hf_config

    config = read_hf_config(path)
    family_for(config, path)  # unknown architectures fail before reading weights
    if mtp:
      check_mtp(path, config)
    return load_hf_dir(path, config=config, skip=() if mtp else (MTP_PREFIX,))
  if mtp:
    check_mtp(path, None)
  from specjax.loading.gguf import load_gguf

  return load_gguf(path)


def default_dtype() -> str:
  """float32 on CPU (bfloat16 is far slower on XLA:CPU), bfloat16 on accelerators."""
  return 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'


DTYPES = ('float32', 'bfloat16', 'float16')


def resolve_dtype(dtype: str | None) -> jnp.dtype:
  name = dtype or default_dtype()
  if name not in DTYPES:
    raise SpecjaxError(f'unknown dtype {name!r} (choose from {", ".join(DTYPES)})')
  return jnp.dtype(name)


def fill(abstract: nnx.Module, pure: dict, dtype, source: str) -> tuple[nnx.GraphDef, nnx.State]:
  """Splits an abstract module once and fills its state from a pure dict of numpy arrays.

  Floating arrays are cast to `dtype`; integer ones (token ids) keep theirs.
  """
  graphdef, state = nnx.split(abstract)
  cast = lambda w: jnp.asarray(w, dtype if np.issubdtype(np.asarray(w).dtype, np.floating) else None)
  nnx.replace_by_pure_dict(state, jax.tree.map(cast, pure))
  return graphdef, state


def build_model(ckpt: Checkpoint, *, attention_impl: str = 'auto', mtp: bool = False, dtype: str | None = None):
  """Builds the NNX module abstractly, splits it once and fills in the weights.

  `mtp=True` also builds the checkpoint's MTP head as its own module and params
  (`model.heads['mtp']`), apart from the target's params.
  """
  from specjax.models.base import Model

  arch, family = family_for(ckpt.config, ckpt.source)
  cfg = family.config_from_hf(ckpt.config)
  dt = resolve_dtype(dtype)
  if mtp and not family.has_mtp:
    raise SpecjaxError(f'{ckpt.source}: {arch} models have no built-in MTP head')
  heads = {}
  for name, head in family.heads.items():
    if name == 'mtp' and not mtp:  # a checkpoint's MTP head is only loaded for --mtp
      for t in [n for n in ckpt.tensors if n.startswith(head.prefix)]:
        del ckpt.tensors[t]
      continue
    abstract = nnx.eval_shape(lambda: head.build(cfg, attention_impl=attention_impl, dtype=dt))
    heads[name] = fill(abstract, head.params_from_hf(cfg, ckpt.tensors), dt, ckpt.source)
  abstract = nnx.eval_shape(lambda: family.build(cfg, attention_impl=attention_impl, dtype=dt))
  graphdef, state = fill(abstract, family.params_from_hf(cfg, ckpt.tensors), dt, ckpt.source)
  if ckpt.tensors:
    extra = sorted(ckpt.tensors)[:5]
    raise SpecjaxError(f'{ckpt.source}: {len(ckpt.tensors)} unexpected weights, e.g. {extra}')
  layout = abstract.cache_layout()
  return Model(
      graphdef,
      state,
      cfg,
      ckpt.tokenizer,
      ckpt.generation,
      ckpt.source,
      arch,
      kv_shapes=list(layout.kv_shapes),
      state_shapes=list(layout.state_shapes),
      dtype=dt,
      heads=heads,
  )


def load(spec: str, *, attention_impl: str = 'auto', mtp: bool = False, dtype: str | None = None):
  """Loads a model by demo name (`gemma-3-270m`), local path or hub id.

  `mtp=True` also loads the checkpoint's built-in multi-token-prediction head
  (Qwen3.5 / Qwen3-Next `mtp.*`), for `drafters.make_drafter('mtp', model)`.
  `dtype` ('float32', 'bfloat16'): params and compute; default float32 on CPU,
  bfloat16 on GPU.
  """
  resolve_dtype(dtype)  # a bad name fails before any weight is read
  return build_model(load_checkpoint(spec, mtp=mtp), attention_impl=attention_impl, mtp=mtp, dtype=dtype)
