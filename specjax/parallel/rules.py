"""Sharding rules: logical axes named once, mapped to mesh axes, for every family's params and decode state.

Each param is matched by name (its path in the params pytree) and rank to the
logical axes of its dims (`PARAM_RULES`); `LOGICAL_AXES` maps a logical axis
to a mesh axis (or None: replicated). There is no per-family code: Gemma 3 / 4,
Llama, Qwen3 and Qwen3.5 share the block names of `specjax.models.layers`.

Tensor parallelism over 'model' (Megatron-style, one all-reduce after each
row-parallel product):
  fused q|k|v(|gate) `qkv_proj`  column-parallel by heads, in shard-major column
                                 blocks (`shard_major`): shard s holds its query,
                                 key, value and gate heads side by side;
  `o_proj`, MLP `down`           row-parallel (the all-reduce);
  fused gate|up `gate_up`        column-parallel, shard-major like q|k|v;
  embedding / head               vocab-parallel (the tied head's logits stay
                                 split by vocab until the argmax / softmax);
  norms, routers, scalars        replicated.
KV heads: when tp does not divide them but they divide tp (Gemma 3 270M: one KV
head), each KV head is duplicated tp / K times (as vLLM does), so every shard
holds one KV head of its own and the cache stays split by head; the math is
unchanged. Replicated too (not split): Gated DeltaNet mixers and their
recurrent state (Qwen3.5), routed experts (MoE), drafter heads.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from specjax.errors import SpecjaxError
from specjax.parallel.mesh import DATA, MODEL, mesh_size

# logical axis -> mesh axis (None: replicated)
LOGICAL_AXES = {
    'batch': DATA,
    'heads': MODEL,  # query (and output-gate) heads, `o_proj` rows
    'qkv': MODEL,  # fused q|k|v(|gate) columns, shard-major
    'kv_heads': MODEL,  # KV cache pages
    'mlp': MODEL,  # fused gate|up columns (shard-major), `down` rows
    'vocab': MODEL,
    'embed': None,
    'norm': None,
    'experts': None,
    'expert_mlp': None,
    'linear': None,  # Gated DeltaNet projections, conv and state
    'per_layer': None,  # Gemma 4 per-layer embedding widths
    'drafter': None,
}

# (path regex, rank, logical axes). Paths are dotted with layer indices as '#': 'layers.#.mixer.qkv_proj'.
PARAM_RULES = (
    (r'(.*\.)?mixer\.qkv_proj', 2, ('embed', 'qkv')),
    (r'(.*\.)?mixer\.o_proj', 2, ('heads', 'embed')),
    (r'(.*\.)?mixer\.[qk]_norm\.scale', 1, ('norm',)),
    (r'(.*\.)?(mlp|shared_expert)\.gate_up', 2, ('embed', 'mlp')),
    (r'(.*\.)?(mlp|shared_expert)\.down', 2, ('mlp', 'embed')),
    (r'(.*\.)?(mlp|moe)\.gate_up', 3, ('experts', 'embed', 'expert_mlp')),
    (r'(.*\.)?(mlp|moe)\.down', 3, ('experts', 'expert_mlp', 'embed')),
    (r'(.*\.)?(mlp|moe)\.router', 2, ('embed', 'experts')),
    (r'(.*\.)?(mlp|moe)\.(per_expert_scale)', 1, ('experts',)),
    (r'(.*\.)?(mlp|moe)\.(router_scale)', 1, ('norm',)),
    (r'(.*\.)?mlp\.shared_gate', 2, ('embed', 'norm')),
    (r'(.*\.)?mixer\.(in_proj|out_proj|conv_weight)', 2, ('linear', 'linear')),
    (r'(.*\.)?mixer\.(dt_bias|A_log)', 1, ('linear',)),
    (r'(.*\.)?mixer\.norm\.scale', 1, ('linear',)),
    (r'(.*\.)?(embed_tokens|lm_head)', 2, ('embed', 'vocab')),  # [D, V]; a [V, D] table (out_axis 0) flips
    (r'embed_tokens_per_layer', 2, ('vocab', 'per_layer')),
    (r'(.*\.)?(ple_gate|per_layer_model_projection)', 2, ('embed', 'per_layer')),
    (r'(.*\.)?ple_proj', 2, ('per_layer', 'embed')),
    (r'(.*\.)?(.*norm|per_layer_projection_norm)\.scale', 1, ('norm',)),
    (r'(.*\.)?layer_scalar', 1, ('norm',)),
)

# Drafter heads (`Drafter.params()`, `Model.heads`) are replicated: their names are matched here so that a new
# param is a conscious choice too.
DRAFTER_RULES = (
    r'(.*\.)?(fc|fc_norm|embed_tokens|lm_head|hidden_projection|predecessor_codebook|successor_codebook)',
    r'(.*\.)?(base_kernel|kernel_projection|pre_projection|post_projection|centroids|token_ordering)',
    r'(.*\.)?(self_attn|mixer)\.(qkv_proj|q_proj|o_proj)',
    r'(.*\.)?\w*norm\w*(\.scale)?',
)


def path_name(path) -> str:
  """'layers.#.mixer.qkv_proj' for a params path (layer indices as '#')."""
  keys = [str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))) for k in path]
  if isinstance(path[-1], jax.tree_util.GetAttrKey) and keys[-1] == 'value':
    keys.pop()  # the array inside an `nnx.Variable`
  return '.'.join('#' if k.isdigit() else k for k in keys)


def param_axes(name: str, var) -> tuple[str | None, ...]:
  """The logical axes of one param (an `nnx.Variable` or array), by its name and rank; an unmatched one fails."""
  value = var.get_value() if isinstance(var, nnx.Variable) else var
  ndim = len(value.shape)
  for pattern, rank, axes in PARAM_RULES:
    if rank == ndim and re.fullmatch(pattern, name):
      if 'vocab' in axes and getattr(var, 'out_axis', 1) == 0 and name != 'embed_tokens_per_layer':
        axes = axes[::-1]  # a [V, D] table
      return axes
  raise SpecjaxError(f'no sharding rule matches param {name} {tuple(value.shape)} (specjax/parallel/rules.py)')


def drafter_axes(name: str, var) -> tuple[None, ...]:
  """Drafter params: replicated; the name must still match a rule (target rules count too)."""
  value = var.get_value() if isinstance(var, nnx.Variable) else var
  if not any(re.fullmatch(p, name) for p in DRAFTER_RULES):
    param_axes(name, var)
  return ('drafter',) * len(value.shape)


def spec_for(axes, shape, mesh) -> PartitionSpec:
  """Logical axes -> PartitionSpec; a dim the mesh axis does not divide is replicated."""
  spec = []
  for axis, n in zip(axes, shape):
    mesh_axis = LOGICAL_AXES[axis] if axis else None
    spec.append(mesh_axis if mesh_axis and n % mesh_size(mesh, mesh_axis) == 0 else None)
  return PartitionSpec(*spec)


def param_shardings(params, mesh, *, drafter: bool = False):
  """A `NamedSharding` per leaf of `params` (an `nnx.State` or pure pytree), by `PARAM_RULES`."""
  axes_of = drafter_axes if drafter else param_axes

  def one(path, var):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    name = path_name(path)
    return NamedSharding(mesh, spec_for(axes_of(name, var), value.shape, mesh))

  is_leaf = lambda x: isinstance(x, nnx.Variable)
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_leaf)


# ---------------------------------------------------------------- shard-major fused layouts


def padded_kv_heads(kv_heads: int, tp: int) -> int:
  """KV heads after duplication: K itself when tp divides it, tp when K divides tp, else an error."""
  if kv_heads % tp == 0:
    return kv_heads
  if tp % kv_heads == 0:
    return tp
  raise SpecjaxError(f'--tp {tp} neither divides the {kv_heads} KV heads nor is a multiple of them')


def qkv_columns(spec, tp: int) -> np.ndarray:
  """Column order of a shard-major fused q|k|v(|gate) matrix, as indices into the standard one.

  Shard s's block: its query heads, then per projection its (duplicated) KV heads, then its gate heads.
  """
  from specjax.models.layers import KV_PROJECTIONS

  n, k, h = spec.num_heads, spec.num_kv_heads, spec.head_dim
  projections = KV_PROJECTIONS[spec.kv]
  k_pad = padded_kv_heads(k, tp) if projections else k
  heads = lambda base, lo, hi, orig=lambda j: j: [base + orig(j) for j in range(lo, hi)]
  order = []
  for s in range(tp):
    order += heads(0, s * n // tp, (s + 1) * n // tp)
    for p in range(projections):
      order += heads(n + p * k, s * k_pad // tp, (s + 1) * k_pad // tp, lambda j: j * k // k_pad)
    if spec.output_gate:
      order += heads(n + projections * k, s * n // tp, (s + 1) * n // tp)
  return (np.asarray(order)[:, None] * h + np.arange(h)[None, :]).reshape(-1)


def gate_up_columns(hidden: int, tp: int) -> np.ndarray:
  """Column order of a shard-major fused gate|up matrix: shard s's block is its gate columns, then its up ones."""
  f = hidden // tp
  return np.concatenate([np.r_[s * f : (s + 1) * f, hidden + s * f : hidden + (s + 1) * f] for s in range(tp)])


def check_divisible(module, tp: int, source: str) -> None:
  """Heads and MLP widths of `module` (abstract or not) must split over `tp` (KV heads: `padded_kv_heads`)."""
  from specjax.models.layers import Attention, GatedMLP

  for path, m in module.iter_modules():
    where = '.'.join(map(str, path))
    if isinstance(m, Attention):
      if m.spec.num_heads % tp:
        raise SpecjaxError(f'{source}: --tp {tp} does not divide the {m.spec.num_heads} heads of {where}')
      try:
        padded_kv_heads(m.spec.num_kv_heads, tp)
      except SpecjaxError as e:
        raise SpecjaxError(f'{source}: {e} ({where})') from None
    elif isinstance(m, GatedMLP):
      f = m.down.get_value().shape[0]
      if f % tp:
        raise SpecjaxError(f'{source}: --tp {tp} does not divide the MLP width {f} of {where}')


def shard_model(model, mesh):
  """`model` with its params placed on `mesh` (fused layouts made shard-major, KV heads duplicated as needed)."""
  from specjax.models.layers import Attention, GatedMLP
  from specjax.quant import ops

  tp = mesh_size(mesh, MODEL)
  if tp > 1 and model.quant:
    raise SpecjaxError(
        f'{model.source}: --tp {tp} with quantized weights ({model.quant}) is not supported yet; '
        'drop --quant, or use --dp alone'
    )
  module = model.module()
  check_divisible(module, tp, model.source)
  for _, m in module.iter_modules():
    if isinstance(m, Attention):
      if tp > 1 and m.shards == 1:
        m.qkv_proj.set_value(ops.take_outputs(m.qkv_proj.get_value(), qkv_columns(m.spec, tp), 1))
        m.spec = dataclasses.replace(m.spec, num_kv_heads=padded_kv_heads(m.spec.num_kv_heads, tp))
        m.shards = tp
      m.mesh = mesh
    elif isinstance(m, GatedMLP) and tp > 1 and m.shards == 1:
      hidden = m.down.get_value().shape[0]
      m.gate_up.set_value(ops.take_outputs(m.gate_up.get_value(), gate_up_columns(hidden, tp), 1))
      m.shards = tp
  graphdef, params = nnx.split(module)
  kv_shapes = [(padded_kv_heads(k, tp), h) for k, h in model.kv_shapes]
  params = jax.device_put(params, param_shardings(params, mesh))
  heads = {name: (g, jax.device_put(p, replicated(mesh))) for name, (g, p) in model.heads.items()}
  return dataclasses.replace(model, graphdef=graphdef, params=params, kv_shapes=kv_shapes, heads=heads, mesh=mesh)


# ---------------------------------------------------------------- decode state


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def state_shardings(tree, mesh, batch: int):
  """A `NamedSharding` per leaf of a step's arguments or results (KV pages by head, batch rows over 'data').

  Leaves under a `KVCache`'s `k_pages` / `v_pages` `[K, P, page, H]` are split
  by KV head over 'model'; other leaves whose leading dim is the batch `batch`
  are split over 'data' (when it divides them); the rest is replicated.
  """
  dp, tp = mesh_size(mesh, DATA), mesh_size(mesh, MODEL)

  def one(path, x):
    names = [getattr(k, 'name', getattr(k, 'key', None)) for k in path]
    shape = getattr(x, 'shape', ())
    if ('k_pages' in names or 'v_pages' in names) and len(shape) == 4:
      return NamedSharding(mesh, PartitionSpec(MODEL if shape[0] % tp == 0 else None))
    if 'drafter' not in names and shape and shape[0] == batch and batch % dp == 0 and dp > 1:
      return NamedSharding(mesh, PartitionSpec(DATA))
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(one, tree)


def step_shardings(tree: tuple, mesh, batch: int | None):
  """`state_shardings` per top-level element of a step's arguments or results; drafter params (dicts, states)
  are replicated."""
  return tuple(
      jax.tree.map(lambda _: replicated(mesh), x)
      if isinstance(x, (dict, nnx.State)) or batch is None
      else state_shardings(x, mesh, batch)
      for x in tree
  )


def batch_of(args) -> int | None:
  """The batch rows of a step: the block table rows of the first `KVCache` among `args` (None if there is none)."""
  from specjax.cache.paged import KVCache

  for x in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, KVCache)):
    if isinstance(x, KVCache):
      return x.block_tables.shape[0]
  return None


def placed_executable(body, mesh, params, args: tuple, donate: tuple[int, ...]):
  """`body(params, *args)` compiled over `mesh`: params as placed, the arguments and results by `step_shardings`
  (so a step's state comes back placed as the next step takes it); the call places its arguments first."""
  batch = batch_of(args)
  in_args = step_shardings(args, mesh, batch)
  out = jax.eval_shape(body, params, *args)
  out_shardings = step_shardings(out, mesh, batch) if type(out) is tuple else step_shardings((out,), mesh, batch)[0]
  in_params = jax.tree.map(lambda x: x.sharding, params)
  jitted = jax.jit(body, donate_argnums=donate, in_shardings=(in_params, *in_args), out_shardings=out_shardings)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), args, in_args)
  compiled = jitted.lower(params, *abstract).compile()

  def call(params, *args):
    return compiled(params, *jax.device_put(args, in_args))

  call.compiled = compiled
  return call
