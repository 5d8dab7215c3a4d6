"""Paged attention: one entry point over the reference and (later) Pallas kernels."""

import jax

from pallas_kernels.paged_attention.reference import check_inputs
from pallas_kernels.paged_attention.reference import MASK_VALUE
from pallas_kernels.paged_attention.reference import ref_paged_attention

IMPLS = ("auto", "xla", "pallas")

__all__ = ["IMPLS", "MASK_VALUE", "check_inputs", "paged_attention",
           "ref_paged_attention"]


def paged_attention(
    q: jax.Array,  # [B, Q, H, D]
    k_pages: jax.Array,  # [Hkv, P, page_size, D]
    v_pages: jax.Array,  # [Hkv, P, page_size, D]
    block_tables: jax.Array,  # [B, pages_per_seq] int32
    lengths: jax.Array,  # [B] keys per sequence, including the Q new ones
    *,
    query_lens: jax.Array | None = None,  # [B]
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    mask: jax.Array | None = None,  # [B, Q, Q] bool
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:  # [B, Q, H, D]
  """Paged attention; semantics in `reference.py`.

  impl: "xla" (the pure-JAX reference), "pallas" (GPU kernels) or "auto"
  (currently always "xla"). `interpret` runs Pallas kernels in interpret mode.
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown paged attention impl {impl!r}; expected one "
                     f"of {IMPLS}")
  check_inputs(q, k_pages, v_pages, block_tables, lengths, query_lens, mask,
               sliding_window, logit_softcap)
  if impl == "pallas":
    raise NotImplementedError(
        "impl='pallas': the Pallas paged attention kernels are not built yet; "
        "use impl='xla' or 'auto'")
  del interpret  # Only meaningful for the Pallas kernels.
  return ref_paged_attention(
      q, k_pages, v_pages, block_tables, lengths, query_lens=query_lens,
      sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
      mask=mask)
