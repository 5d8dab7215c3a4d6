"""HF directories, hub ids through a local cache, and bad checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest

import specjax
from specjax import SpecjaxError
from conftest import TINY, TINY_SHARDED


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


@pytest.mark.parametrize('name', ['tiny_gemma3', 'tiny_llama3', 'tiny_mistral', 'tiny_qwen3'])
def test_hub_id_from_local_cache(tmp_path, monkeypatch, name):
  """A hub id resolves offline from an HF cache layout (models--org--name/snapshots/<rev>)."""
  revision = 'a' * 40
  repo = tmp_path / 'hub' / 'models--specjax-test--tiny-gemma3'
  shutil.copytree(os.path.join(os.path.dirname(TINY), name), repo / 'snapshots' / revision)
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


def corrupt_copies(tmp_path):
  """Checkpoint copies whose model.safetensors is cut or replaced: {case: (directory, expected message)}."""
  data = open(f'{TINY}/model.safetensors', 'rb').read()
  header = 8 + int.from_bytes(data[:8], 'little')
  json_header = data[8:header]
  cases = {
      'empty': (b'', 'is empty'),
      'in the length': (data[:5], 'not a safetensors file'),
      'after the length': (data[:8], 'not a safetensors file'),
      'in the header': (data[: header // 2], 'truncated: its header needs'),
      'after the header': (data[:header], 'truncated: its tensors need'),
      'mid-tensor': (data[: len(data) // 2], 'truncated: its tensors need'),
      'last byte': (data[:-1], 'truncated'),
      'garbage': (bytes(range(256)) * 64, 'not a safetensors file'),
      'text': (b'version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 372704\n', 'not a safetensors file'),
      'bad JSON': (data[:8] + b'{"x": ' + data[14:], 'bad safetensors header'),
      'bad offsets': (
          data[:8] + json_header.replace(b'[0,65536]', b'[9,65536]', 1) + data[header:],
          'not a valid safetensors file',
      ),
      'trailing bytes': (data + b'\0' * 8, 'bytes follow the last tensor'),
  }
  out = {}
  for i, (case, (content, message)) in enumerate(cases.items()):
    path = copy_checkpoint(tmp_path / f'ckpt{i}')
    with open(f'{path}/model.safetensors', 'wb') as f:
      f.write(content)
    out[case] = (path, message)
  return out


def test_corrupt_safetensors_is_one_clear_error(tmp_path):
  from specjax.loading.hf import tensor_names

  for case, (path, message) in corrupt_copies(tmp_path).items():
    with pytest.raises(SpecjaxError) as e:
      specjax.load(path)
    msg = str(e.value)
    assert f'{path}/model.safetensors' in msg and message in msg and '\n' not in msg, (case, msg)
    if case != 'bad offsets':  # the header alone is consistent there
      with pytest.raises(SpecjaxError, match=message):
        tensor_names(path)  # headers only (the --mtp check)


def test_corrupt_safetensors_on_the_command_line(tmp_path, capsys):
  import subprocess
  import sys
  from specjax import cli

  for case, (path, message) in corrupt_copies(tmp_path).items():
    code = cli.main(['generate', '-m', path, '--prompt', 'x'])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith('error: ') and message in err and err.count('\n') == 1, (case, err)
  path, message = corrupt_copies(tmp_path / 'proc')['mid-tensor']
  proc = subprocess.run(
      [sys.executable, '-m', 'specjax.cli', 'generate', '-m', path, '--prompt', 'x'], capture_output=True, text=True
  )
  assert proc.returncode == 2 and proc.stderr.startswith('error: ') and proc.stderr.count('\n') == 1, proc.stderr
  assert 'Traceback' not in proc.stderr and 'truncated' in proc.stderr


def test_sharded_checkpoint_problems(tmp_path):
  path = str(tmp_path / 'sharded')
  shutil.copytree(TINY_SHARDED, path)
  shard = f'{path}/model-00002-of-00002.safetensors'
  data = open(shard, 'rb').read()
  with open(shard, 'wb') as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(SpecjaxError, match='model-00002-of-00002.safetensors is truncated'):
    specjax.load(path)
  os.remove(shard)
  with pytest.raises(SpecjaxError, match=r"shard index names missing files \['model-00002-of-00002.safetensors'\]"):
    specjax.load(path)
  index = f'{path}/model.safetensors.index.json'
  with open(index, 'w') as f:
    json.dump({'metadata': {}}, f)
  with pytest.raises(SpecjaxError, match='no "weight_map"'):
    specjax.load(path)
