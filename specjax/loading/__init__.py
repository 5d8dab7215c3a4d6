"""Loaders: local HF directories, hub ids, GGUF files and demo packages."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import SpecjaxError
from specjax.loading.checkpoint import Checkpoint, GenerationDefaults, release_host_memory  # noqa: F401 (API)
from specjax.loading.registry import DEMO_MODELS, family_for
from specjax.quant.formats import QUANT_ACTS, QUANT_CHOICES, QMatrix, to_device
from specjax.quant.params import float_experts_on_kernel, kernel_floats, quantize_params, quantized_kinds, set_act
from specjax.quant.params import settle

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


def check_quant(quant: str | None, path: str) -> str | None:
  """The quantization a load asks for, checked against the checkpoint before any weight is read (None: float)."""
  if quant in (None, 'none'):
    return None
  if quant not in QUANT_CHOICES:
    raise SpecjaxError(f'unknown quantization {quant!r} (choose from {", ".join(QUANT_CHOICES)})')
  if os.path.isdir(path):
    if quant == 'auto':
      raise SpecjaxError(
          f"{path}: --quant auto keeps a GGUF file's own quantization; this is a safetensors checkpoint "
          '(choose --quant int8 or int4)'
      )
    return quant
  from specjax.loading.gguf import quantized_types

  types = quantized_types(path)
  if quant != 'auto' and types:
    raise SpecjaxError(
        f'{path} is already quantized ({", ".join(types)}); --quant {quant} would quantize it twice '
        '(use --quant auto to run its own blocks, or leave --quant out for float weights)'
    )
  return quant


def check_quant_act(quant: str | None, quant_act: str) -> None:
  """`quant_act` ('float' or 'int8') must name a mode, and 'int8' needs quantized weights."""
  if quant_act not in QUANT_ACTS:
    raise SpecjaxError(f'unknown --quant-act {quant_act!r} (choose from {", ".join(QUANT_ACTS)})')
  if quant_act != 'float' and quant in (None, 'none'):
    raise SpecjaxError(f'--quant-act {quant_act} quantizes the activations of quantized weights; add --quant')
  if quant_act != 'float':
    from specjax.quant import ops

    if ops.dequantize_at_load():
      raise SpecjaxError(
          f'--quant-act {quant_act} needs the CPU kernel, and {ops.kernel_status()} (quantized weights would be '
          'dequantized at load, activations float): reinstall with a C++ compiler (`pip install -e .`) or drop it'
      )


def load_checkpoint(
    spec: str, *, mtp: bool = False, quant: str | None = None, quant_embedding: bool = True
) -> Checkpoint:
  """Reads a checkpoint (config, weights, tokenizer) without building a model.

  `mtp.*` weights (a built-in MTP head) are read only with `mtp=True`, which
  first checks that the checkpoint has them. `quant='auto'` (GGUF only) keeps
  the quantized projection and embedding tensors as `QMatrix` (the embedding too
  only with `quant_embedding`); other quantizations happen in `build_model`.
  """
  path = resolve(spec)
  check_quant(quant, path)
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

  return load_gguf(path, keep_quantized=quant == 'auto', quant_embedding=quant_embedding)


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

  Floating arrays are cast to `dtype`; integer ones (token ids) keep theirs; a
  `QMatrix` keeps its integers and float32 scales.
  """
  graphdef, state = nnx.split(abstract)

  def cast(w):
    if isinstance(w, QMatrix):
      return to_device(w)
    w = np.asarray(w)
    # device_put copies once (jnp.asarray held two copies of a big weight at its peak) and aliases where aligned.
    return jax.device_put(w.astype(dtype, copy=False) if np.issubdtype(w.dtype, np.floating) else w)

  _convert_in_place(pure, cast)
  nnx.replace_by_pure_dict(state, pure)
  return graphdef, state


def _convert_in_place(tree: dict, convert) -> None:
  """Replaces each leaf of a nested dict by `convert(leaf)`, one at a time, so that each host array is freed as
  soon as its device copy exists (the peak holds one weight twice, not all of them)."""
  for key, value in tree.items():
    if isinstance(value, dict):
      _convert_in_place(value, convert)
    else:
      tree[key] = convert(value)


def build_model(
    ckpt: Checkpoint,
    *,
    attention_impl: str = 'auto',
    mtp: bool = False,
    dtype: str | None = None,
    quant: str | None = None,
    quant_group: int = 32,
    quant_embedding: bool = True,
    quant_act: str = 'float',
    mesh=None,
):
  """Builds the NNX module abstractly, splits it once and fills in the weights.

  `mtp=True` also builds the checkpoint's MTP head as its own module and params
  (`model.heads['mtp']`), apart from the target's params. `quant`, `mesh`: see `load`.
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
  quant = None if quant == 'none' else quant
  check_quant_act(quant, quant_act)
  if quant == 'int4':
    check_groups(abstract, quant_group, ckpt.source)
  if mesh is not None:
    from specjax.parallel.rules import check_divisible

    check_divisible(abstract, mesh.shape['model'], ckpt.source)
  graphdef, state = fill(abstract, family.params_from_hf(cfg, ckpt.tensors), dt, ckpt.source)
  if ckpt.tensors:
    extra = sorted(ckpt.tensors)[:5]
    raise SpecjaxError(f'{ckpt.source}: {len(ckpt.tensors)} unexpected weights, e.g. {extra}')
  if quant in ('int8', 'int4'):
    quantize_params(state, quant, group=quant_group, embedding=quant_embedding)
  if quant:
    set_act(kernel_floats(state), quant_act)
  else:
    float_experts_on_kernel(state, dt, mesh)
  quant = quant and describe_quant(state, quant, quant_group, dt, quant_act)
  layout = abstract.cache_layout()
  release_host_memory()
  model = Model(
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
      quant=quant,
  )
  if mesh is None:
    return model
  from specjax.parallel.rules import shard_model

  return shard_model(model, mesh)


def load(
    spec: str,
    *,
    attention_impl: str = 'auto',
    mtp: bool = False,
    dtype: str | None = None,
    quant: str | None = None,
    quant_group: int = 32,
    quant_embedding: bool = True,
    quant_act: str = 'float',
    mesh=None,
):
  """Loads a model by demo name (`gemma-3-270m`), local path or hub id.

  `mtp=True` also loads the checkpoint's built-in multi-token-prediction head
  (Qwen3.5 / Qwen3-Next `mtp.*`), for `drafters.make_drafter('mtp', model)`.
  `dtype` ('float32', 'bfloat16'): params and compute; default float32 on CPU,
  bfloat16 on GPU.

  `quant` quantizes the projection matrices (attention, MLP) and, with
  `quant_embedding`, the embedding and head: 'int8' (a scale per output
  channel), 'int4' (a scale per `quant_group` inputs), 'auto' (a GGUF file's
  own blocks, repacked: Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K), None / 'none'
  (float; a GGUF file is dequantized). Where the CPU kernel is not built the
  quantized weights are dequantized at load, with one warning line.

  `quant_act` ('float', the default, or 'int8'; only with `quant`): 'int8'
  quantizes the activations of every quantized product per block of 32 (or 16)
  inputs and runs integer dot products (`specjax.quant.cpu_kernel`, act int8).

  `mesh` (a `jax.sharding.Mesh` from `specjax.parallel.mesh.make_mesh`): places
  the params sharded over it (`specjax.parallel.rules`); engines over the model
  then run every step over the mesh.
  """
  resolve_dtype(dtype)  # a bad name fails before any weight is read
  if quant_group < 2 or quant_group % 2:
    raise SpecjaxError(f'--quant-group must be an even number of inputs, got {quant_group}')
  check_quant_act(quant, quant_act)
  if mesh is not None and quant not in (None, 'none') and mesh.shape['model'] > 1:
    raise SpecjaxError(f"--tp {mesh.shape['model']} with --quant {quant} is not supported yet; drop --quant")
  ckpt = load_checkpoint(spec, mtp=mtp, quant=quant, quant_embedding=quant_embedding)
  return build_model(
      ckpt,
      attention_impl=attention_impl,
      mtp=mtp,
      dtype=dtype,
      quant=quant,
      quant_group=quant_group,
      quant_embedding=quant_embedding,
      quant_act=quant_act,
      mesh=mesh,
  )


def check_groups(abstract: nnx.Module, group: int, source: str) -> None:
  """int4 groups must divide the inputs of every weight they quantize."""
  from specjax.models.layers import Weight

  for path, var in nnx.to_flat_state(nnx.state(abstract)):
    if isinstance(var, Weight) and not getattr(var, 'keep_float', False):
      shape = var.get_value().shape
      inputs = shape[len(shape) - 1 - var.out_axis]  # a stack of experts: each matrix's
      if inputs % group:
        name = '.'.join(map(str, path))
        raise SpecjaxError(
            f'{source}: int4 groups of {group} do not divide {name} ({inputs} inputs); choose --quant-group '
            f'from the divisors of {inputs}, or --quant int8'
        )


def describe_quant(state: nnx.State, quant: str, group: int, dtype, act: str = 'float') -> str | None:
  """'int8', 'int4-g32', or for a GGUF file its kinds by count ('auto: Q5_0 x81, Q8_0 x10, ...'), then ', act
  int8' under act int8; where the CPU kernel is missing it warns, dequantizes and says ', dequantized at load'."""
  kinds = quantized_kinds(state)
  if not kinds:
    return None
  settle(state, dtype)
  suffix = ', act int8' if act == 'int8' else ''
  if not quantized_kinds(state):
    suffix = ', dequantized at load'
  if quant == 'auto':
    return 'auto: ' + ', '.join(f'{k} x{n}' for k, n in sorted(kinds.items())) + suffix
  return (f'int4-g{group}' if quant == 'int4' else quant) + suffix
