"""One style for the tree (pyproject.toml): pyink formatting, single quotes (ruff's flake8-quotes rules)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
  path = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
  if not os.path.exists(path):
    pytest.skip(f'{name} is not installed (pip install -e ".[test]")')
  return path


@pytest.mark.parametrize(
    'command',
    [['pyink', '--check', '--quiet', '.'], ['ruff', 'check', '--quiet', '.']],
    ids=['pyink', 'ruff'],
)
def test_tree_is_formatted(command):
  out = subprocess.run([tool(command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, f'run `{command[0]} .` to fix:\n{out.stdout}{out.stderr}'
