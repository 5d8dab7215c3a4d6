"""Paged attention over a mesh: the Pallas kernel runs per shard under `shard_map`.

XLA cannot partition a Pallas custom call, so on a mesh the kernel runs once
per device on that device's heads ('model': query heads and their KV heads'
pages) and batch rows ('data', when it divides them). The pure-JAX reference
(`impl='xla'`, every CPU run) stays a plain jitted function that XLA's sharding
propagation splits the same way.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention import paged_attention, select_impl
from specjax.parallel.mesh import DATA, MODEL, mesh_size


def sharded_paged_attention(
    mesh,
    q: jax.Array,  # [B, T, N, H]
    k_pages: jax.Array,  # [K, P, page, H]
    v_pages: jax.Array,  # [K, P, page, H]
    block_tables: jax.Array,  # [B, pages_per_seq]
    lengths: jax.Array,  # [B]
    *,
    query_lens: jax.Array,  # [B]
    mask: jax.Array | None = None,  # [B, T, T]
    impl: str = 'auto',
    interpret: bool = False,
    **options,  # sliding_window, logit_softcap, scale
) -> jax.Array:  # [B, T, N, H]
  """`paged_attention` on `mesh`: the kernel per shard of heads (and rows); the reference as is."""
  attend = functools.partial(paged_attention, impl=impl, interpret=interpret, **options)
  if select_impl(impl, q.shape[-1], k_pages.shape[2], interpret) == 'xla':
    return attend(q, k_pages, v_pages, block_tables, lengths, query_lens=query_lens, mask=mask)
  rows = DATA if q.shape[0] % mesh_size(mesh, DATA) == 0 else None
  heads = MODEL if k_pages.shape[0] % mesh_size(mesh, MODEL) == 0 else None
  row = P(rows)

  def body(q, k_pages, v_pages, block_tables, lengths, query_lens, mask):
    return attend(q, k_pages, v_pages, block_tables, lengths, query_lens=query_lens, mask=mask)

  return jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(rows, None, heads), P(heads), P(heads), row, row, row, None if mask is None else row),
      out_specs=P(rows, None, heads),
      check_vma=False,
  )(q, k_pages, v_pages, block_tables, lengths, query_lens, mask)
