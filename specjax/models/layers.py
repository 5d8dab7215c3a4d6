"""Layers shared by the model families: norms, rotary embeddings, MLPs.

Einsum letters: B batch, T tokens, D model dim, F MLP dim, N query heads,
K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _zeros(*shape):
  return nnx.Param(jnp.zeros(shape, jnp.float32))


class RMSNorm(nnx.Module):
  """RMS norm over the last axis, `x * rsqrt(mean(x^2) + eps) * scale`.

  `offset=1.0` gives Gemma's zero-centred form `(1 + w)`; `offset=0.0` the plain
  weight of Llama, Qwen and Gemma 4.
  """

  def __init__(self, dim: int, *, eps: float, offset: float = 0.0):
    self.scale = _zeros(dim)
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * (self.offset + self.scale[...])).astype(x.dtype)


def apply_rope(
    x: jax.Array,  # [B, T, N, H]
    positions: jax.Array,  # [B, T]
    *,
    base: float,
    rotary_dim: int | None = None,
) -> jax.Array:
  """NeoX-style rotary embedding (dim i pairs with i + rotary_dim / 2).

  Only the first `rotary_dim` features rotate (partial rotary); the rest pass.
  """
  head_dim = x.shape[-1]
  rotary_dim = rotary_dim or head_dim
  half = rotary_dim // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2 / rotary_dim)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, half]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:rotary_dim]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  rotated = rotated.astype(x.dtype)
  if rotary_dim == head_dim:
    return rotated
  return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


class GatedMLP(nnx.Module):
  """`down(act(gate(x)) * up(x))`: GeGLU (Gemma) or SwiGLU (Llama, Qwen)."""

  def __init__(self, dim: int, hidden: int, *, activation: str):
    self.gate_up = _zeros(dim, 2 * hidden)  # gate and up side by side: one pass over the weights
    self.down = _zeros(hidden, dim)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D]
    gate, up = jnp.split(jnp.einsum('btd,df->btf', x, self.gate_up[...]), 2, axis=-1)
    return jnp.einsum('btf,fd->btd', ACTIVATIONS[self.activation](gate) * up, self.down[...])


ACTIVATIONS = {
    'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'silu': jax.nn.silu,
}
