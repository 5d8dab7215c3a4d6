"""Block sizes of the Triton paged attention kernel, per shape, from a table.

A program of the kernel owns one (sequence, KV head, key split, row block).
Its rows are the Q queries times the G query heads of that KV head, packed
query-major (row = i * G + g), so each page is read once per KV head. It walks
its share of the sequence's pages `pages_per_compute_block` at a time.

`_TABLE` maps the head dim to (keys per step, most rows per block, warps,
pipeline stages). Values are starting points derived from the shapes, not yet
measured on a GPU (run `benchmarks/paged_attention.py` and update them):

  head dim  keys/step  rows  warps  stages   K+V tile per stage (bf16)
  <= 64        128      128     4      3      32 KiB
  65-128       128       64     4      2      64 KiB
  129-256       64       64     8      2      64 KiB
  > 256         32       32     8      1      >= 32 KiB

- Keys per step: large enough to keep many loads in flight (the kernel is
  bandwidth bound), small enough that K, V and the [rows, keys] logits fit in
  shared memory and registers with the stages above (Ampere has 164 KiB).
  A step is whole pages: one page when pages are longer than the entry.
- Rows: Q * G rounded up to a power of two, at least 16 (Triton's smallest
  dot); past the table's cap the rows split into several blocks, each of
  which re-reads the pages (only very wide verify trees get there).
- Key splits (flash decoding): enough programs to fill the GPU twice over
  (`2 * num_cores` with `num_cores` the SM count), at least two steps of keys
  per split, at most 32 splits. Splits divide each sequence's own key range
  (window included) at run time, so short sequences in a wide batch cost
  little.
"""

import dataclasses

# head dim upper bound -> (keys per step, max rows, num_warps, num_stages).
_TABLE = (
    (64, (128, 128, 4, 3)),
    (128, (128, 64, 4, 2)),
    (256, (64, 64, 8, 2)),
)
_WIDE_HEADS = (32, 32, 8, 1)  # head dim > 256.
MIN_ROWS = 16  # Triton's smallest dot operand.
MIN_KEYS = 16
MAX_SPLITS = 32
MIN_STEPS_PER_SPLIT = 2
DEFAULT_NUM_CORES = 132  # H100 / H200 SMs; used when the device has no count.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Static tiling of one kernel launch."""

  block_rows: int  # packed (query, head) rows per program; power of two
  pages_per_compute_block: int  # pages per online-softmax step; power of two
  k_splits: int  # key splits per sequence, merged after the kernel
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if not is_power_of_2(self.block_rows) or self.block_rows < MIN_ROWS:
      raise ValueError(f'block_rows must be a power of two >= {MIN_ROWS}, got {self.block_rows}')
    if not is_power_of_2(self.pages_per_compute_block):
      raise ValueError(f'pages_per_compute_block must be a power of two, got {self.pages_per_compute_block}')
    if self.k_splits < 1:
      raise ValueError(f'k_splits must be >= 1, got {self.k_splits}')


def next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def is_power_of_2(n: int) -> bool:
  return n > 0 and not n & (n - 1)


def table_entry(head_dim: int) -> tuple[int, int, int, int]:
  for max_dim, entry in _TABLE:
    if head_dim <= max_dim:
      return entry
  return _WIDE_HEADS


def pick_block_sizes(
    *,
    n_rows: int,  # Q * G
    n_q: int,
    page_size: int,
    head_dim: int,
    pages_per_seq: int,
    batch: int,
    n_kv_heads: int,
    sliding_window: int | None = None,
    num_cores: int = DEFAULT_NUM_CORES,
) -> BlockSizes:
  """Block sizes for one shape: the table row of `head_dim`, then splits."""
  keys_per_step, max_rows, num_warps, num_stages = table_entry(head_dim)
  block_rows = min(next_power_of_2(max(n_rows, MIN_ROWS)), max_rows)
  row_blocks = -(-n_rows // block_rows)

  keys_per_step = max(keys_per_step, MIN_KEYS, page_size)
  pages_per_block = max(keys_per_step // page_size, 1)
  block_k = pages_per_block * page_size
  # Steps of keys one sequence can need: the whole table, or a window's span.
  steps = -(-pages_per_seq // pages_per_block)
  if sliding_window is not None:
    steps = min(steps, -(-(sliding_window - 1 + n_q) // block_k) + 1)

  programs = batch * n_kv_heads * row_blocks
  wanted = -(-2 * num_cores // programs)
  k_splits = max(1, min(wanted, steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
  return BlockSizes(
      block_rows=block_rows,
      pages_per_compute_block=pages_per_block,
      k_splits=k_splits,
      num_warps=num_warps,
      num_stages=num_stages,
  )
