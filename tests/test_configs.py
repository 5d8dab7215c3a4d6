"""Every shipped config under configs/ resolves against its schema (sweeps and trainings), without running."""

import glob
import os

import pytest

from specjax.config_files import load_config_file
from specjax.sweep import config as sweep_config
from specjax.train import config as train_config

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'configs', '*.py')))


def test_configs_found():
  assert len(CONFIGS) >= 8


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_config_resolves(path):
  config = load_config_file(path)
  if os.path.basename(path).startswith('train_'):
    cfg = train_config.resolve(config)
    assert cfg.values['target.model']
  else:
    cells = sweep_config.expand(sweep_config.resolve(config))
    assert cells


STUDY_PROMPTS = 4  # Spec-Bench prompts per category a study runs at the least


@pytest.mark.parametrize(
    'path', [p for p in CONFIGS if not os.path.basename(p).startswith('train_')], ids=os.path.basename
)
def test_spec_bench_studies_use_enough_prompts_per_category(path):
  fixtures = os.path.join('tests', 'fixtures')
  for cell in sweep_config.expand(sweep_config.resolve(load_config_file(path))):
    c = cell.config
    if c['prompts.path'] is None and fixtures not in c['model']:  # a Spec-Bench study, not a test sweep
      assert c['prompts.limit'] is None or c['prompts.limit'] >= STUDY_PROMPTS, (cell.label, c['prompts.limit'])
