"""Sums whose bits do not depend on the shape around them.

XLA:CPU orders a row reduction (and tiles a dot) by the whole array's shape, so
the same row summed inside a [1, D] array and inside a [5, D] array can give
different bits. A verify pass over K + 1 positions must give each position the
bits a one-token decode step gives it, or greedy speculative output can leave
the greedy autoregressive output (experiments/width_numerics/). These sums fix
the order of every addition by the row alone (the attention's chunked sums:
`pallas_kernels.paged_attention.reference._each_query`).
"""

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array) -> jax.Array:  # [..., D] -> [..., 1]
  """The sum over the last axis as a halving tree of elementwise adds (zero-padded to a power of two)."""
  width = 1 << max(x.shape[-1] - 1, 0).bit_length()
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x
