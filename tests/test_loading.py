"""HF directories, hub ids through a local cache, and bad checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest

import specjax
from specjax import SpecjaxError
from conftest import TINY, TINY_SHARDED, FIXTURES


def copy_checkpoint(dst):
  shutil.copytree(TINY, dst)
  return str(dst)


def test_single_and_sharded_directories():
  ckpt = specjax.load_checkpoint(TINY)
  assert ckpt.config['model_type'] == 'gemma3_text'
  assert ckpt.generation.eos_token_ids
  sharded = specjax.load_checkpoint(TINY_SHARDED)
  assert len([f for f in os.listdir(TINY_SHARDED) if f.endswith('.safetensors')]) > 1
  assert 'model.embed_tokens.weight' in sharded.tensors


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
  """A hub id resolves offline from an HF cache layout (models--org--name/snapshots/<rev>)."""
  revision = 'a' * 40
  repo = tmp_path / 'hub' / 'models--specjax-test--tiny-gemma3'
  shutil.copytree(TINY, repo / 'snapshots' / revision)
  (repo / 'refs').mkdir()
  (repo / 'refs' / 'main').write_text(revision)
  monkeypatch.setenv('HF_HUB_CACHE', str(tmp_path / 'hub'))
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  model = specjax.load('specjax-test/tiny-gemma3')
  assert model.source.endswith(revision)
  results, _ = specjax.generate(model, [[2, 10, 11, 12]], max_new_tokens=3, page_size=4)
  assert len(results[0].tokens) == 3
  with pytest.raises(SpecjaxError, match='not in the local HF cache'):
    specjax.load('specjax-test/absent-model')


def test_missing_path():
  with pytest.raises(SpecjaxError, match='not found'):
    specjax.load('./no/such/model')


def test_unknown_architecture_fails_before_weights(tmp_path):
  path = copy_checkpoint(tmp_path / 'ckpt')
  cfg = json.load(open(f'{path}/config.json'))
  cfg['model_type'] = 'mamba9'
  json.dump(cfg, open(f'{path}/config.json', 'w'))
  os.remove(f'{path}/model.safetensors')  # never read: the architecture check comes first
  with pytest.raises(SpecjaxError, match="unknown architecture model_type='mamba9'"):
    specjax.load(path)


def test_missing_and_misshapen_weights(tmp_path):
  from safetensors.numpy import load_file, save_file
  path = copy_checkpoint(tmp_path / 'ckpt')
  tensors = load_file(f'{path}/model.safetensors')
  del tensors['model.layers.3.mlp.up_proj.weight']
  save_file(tensors, f'{path}/model.safetensors')
  with pytest.raises(SpecjaxError, match="missing weight 'model.layers.3.mlp.up_proj.weight'"):
    specjax.load(path)
  tensors['model.layers.3.mlp.up_proj.weight'] = np.zeros((3, 3), np.float32)
  save_file(tensors, f'{path}/model.safetensors')
  with pytest.raises(SpecjaxError, match='has shape'):
    specjax.load(path)


def test_missing_config_or_weights(tmp_path):
  path = copy_checkpoint(tmp_path / 'ckpt')
  os.remove(f'{path}/model.safetensors')
  with pytest.raises(SpecjaxError, match='no safetensors'):
    specjax.load(path)
  os.remove(f'{path}/config.json')
  with pytest.raises(SpecjaxError, match='no config.json'):
    specjax.load(path)
