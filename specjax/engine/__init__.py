"""Generation: the engine (`core`), the continuous-batching scheduler (`scheduler`, `slots`, `requests`), the batch
planner (`planner`) and the executable cache (`executables`)."""

from specjax.engine.executables import Executables
from specjax.engine.core import Engine, GenerationResult, GenerationStats
from specjax.engine.planner import PREFILL_BUCKETS, BatchLayout, next_pow2, plan_batch
from specjax.step import DecodeState

__all__ = [
    'BatchLayout',
    'DecodeState',
    'Engine',
    'Executables',
    'GenerationResult',
    'GenerationStats',
    'PREFILL_BUCKETS',
    'next_pow2',
    'plan_batch',
]
