"""XLA:CPU settings under which a verify pass computes, bit for bit, what decode steps compute.

XLA:CPU's LLVM backend contracts a product and a sum that share a fused loop into one FMA, and which ops share
a loop depends on the program's shapes. A verify pass over K + 1 positions then rounded a position's residual
stream 1 ulp away from the decode step of the same position: enough to move an int8 activation across a
rounding step and change a greedy token (experiments/width_numerics/). With the JIT's instruction set capped at
AVX there are no FMA instructions to contract into, every product is rounded on its own, and (with the
width-invariant norms and attention of `specjax.models.layers` and `pallas_kernels.paged_attention`) greedy
speculative output equals greedy autoregressive output bit for bit, log-probabilities included, on quantized
targets. XLA:CPU's precompiled matmuls and specjax's quantized kernel are not JIT code and keep their
instruction sets; the decode speed measured with and without the cap is the same within noise.

The flag is read when jax starts its CPU backend, so `import specjax` sets it before that (appended to
`XLA_FLAGS`) unless `XLA_FLAGS` already names `--xla_cpu_max_isa` (the way to opt out, e.g.
`XLA_FLAGS=--xla_cpu_max_isa=AVX2`). Started earlier (jax used before `import specjax`), the backend keeps
contraction and `Engine` says so once.
"""

import os
import platform

CPU_FLAG = '--xla_cpu_max_isa=AVX'

# 'set': specjax set the flag; 'user': XLA_FLAGS names the ISA; 'late': the backend had started; 'other': not x86
_state = {'flag': 'other'}


def set_before_backend() -> None:
  """Appends `CPU_FLAG` to XLA_FLAGS when no backend has started yet (called by `import specjax`)."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  flags = os.environ.get('XLA_FLAGS', '')
  if platform.machine().lower() not in ('x86_64', 'amd64'):
    _state['flag'] = 'other'
  elif '--xla_cpu_max_isa' in flags:
    _state['flag'] = 'user'
  elif xla_bridge.backends_are_initialized():
    _state['flag'] = 'late'
  else:
    os.environ['XLA_FLAGS'] = f'{flags} {CPU_FLAG}'.strip()
    _state['flag'] = 'set'


def width_invariant() -> bool:
  """Whether this process's CPU backend runs without FMA contraction (specjax's or the user's flag)."""
  return _state['flag'] in ('set', 'user')


def check_cpu_backend() -> None:
  """Says once, on a CPU backend that started before `import specjax`, that it keeps FMA contraction."""
  import jax  # pylint: disable=g-import-not-at-top

  from specjax.quant.ops import warn_once  # pylint: disable=g-import-not-at-top

  if _state['flag'] == 'late' and jax.default_backend() == 'cpu':
    warn_once(
        'specjax: jax started its CPU backend before `import specjax`, so XLA:CPU contracts products and sums '
        'into FMAs by program shape: greedy speculative output may leave greedy autoregressive output in the last '
        f'bits. Import specjax first, or set XLA_FLAGS={CPU_FLAG}.'
    )
