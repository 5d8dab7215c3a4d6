"""Config-driven sweeps: configs -> cells -> results.jsonl, manifest, summary and plots.

from specjax.sweep import run_sweep
report = run_sweep('configs/sweep_tiny.py', 'runs/tiny', ['prompts.limit=1'])
"""

from specjax.sweep.config import Cell, SweepConfig, base_config, expand, load_config_file, parse_overrides, resolve
from specjax.sweep.runner import clear_cache, prepare, run_sweep

__all__ = [
    'Cell',
    'SweepConfig',
    'base_config',
    'clear_cache',
    'expand',
    'load_config_file',
    'parse_overrides',
    'prepare',
    'resolve',
    'run_sweep',
]
