"""Batch planning: capacity checks, page reservation, shape buckets, before any work.

A batch of prompts is padded to a power-of-two number of rows and its block
tables to a power-of-two number of pages, so that batches of similar size share
executables; prefill chunks are padded to `PREFILL_BUCKETS`. Every prompt must
fit `max_seq_len` with its token budget and the draft lookahead, and the page
pool must hold them all: either failure is a clear error before compiling or
running anything.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.cache.paged import PageAllocator
from specjax.errors import OutOfPagesError, SpecjaxError

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def next_pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """Shapes and pages of one batch."""

  rows: int  # real prompts
  batch: int  # padded rows (a power of two)
  pages_per_seq: int  # block table width (a power of two)
  num_pages: int  # page pool size, the null page included
  page_size: int
  block_tables: np.ndarray  # [batch, pages_per_seq] int32
  prompt_lens: np.ndarray  # [batch] (0 for padding rows)
  prefill_chunk: int  # tokens per prefill call (a bucket)

  @property
  def capacity(self) -> int:
    """Tokens one row can hold."""
    return self.pages_per_seq * self.page_size


def plan_batch(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    page_size: int,
    max_seq_len: int,
    num_pages: int | None = None,
    lookahead: int = 0,
    prefill_chunk: int = 512,
) -> BatchLayout:
  """Checks capacity and pages, reserves each prompt's pages; raises before any work."""
  reserve = max_new_tokens + lookahead
  for i, p in enumerate(prompts):
    if not p:
      raise SpecjaxError(f'prompt {i} is empty (no tokens)')
    if len(p) + reserve > max_seq_len:
      extra = f' + {lookahead} draft lookahead' if lookahead else ''
      raise SpecjaxError(
          f'prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens}{extra} it needs '
          f'{len(p) + reserve} positions, over the capacity of {max_seq_len}'
      )
  longest = max(len(p) for p in prompts)
  pages_per_seq = next_pow2(math.ceil((longest + reserve) / page_size))
  batch = next_pow2(len(prompts))
  num_pages = num_pages or batch * pages_per_seq + 1
  need = sum(math.ceil((len(p) + reserve) / page_size) for p in prompts)
  if need > num_pages - 1:
    raise OutOfPagesError(
        f'KV cache out of pages: the batch needs {need} pages of {page_size} tokens, '
        f'the pool has {num_pages - 1} (raise num_pages or lower the batch / max_new_tokens)'
    )
  allocator = PageAllocator(num_pages, page_size)
  for i, p in enumerate(prompts):
    allocator.allocate(i, len(p) + reserve)
  lens = np.array([len(p) for p in prompts] + [0] * (batch - len(prompts)))
  chunk = min(prefill_chunk, next(b for b in PREFILL_BUCKETS + (1 << 30,) if b >= longest))
  return BatchLayout(
      len(prompts),
      batch,
      pages_per_seq,
      num_pages,
      page_size,
      allocator.block_table(list(range(batch)), pages_per_seq),
      lens,
      chunk,
  )
