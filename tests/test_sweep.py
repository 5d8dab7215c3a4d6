"""`specjax sweep`: configs, overrides, artifacts, determinism, resume and bad input (tiny model)."""

import json
import os

import numpy as np
import pytest

from specjax import cli
from specjax.errors import SpecjaxError
from specjax.sweep import base_config, expand, resolve, run_sweep
from specjax.sweep import artifacts
from specjax.sweep.runner import setting_labels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(ROOT, 'configs', 'sweep_tiny.py')
PROMPTS = [
    {'question_id': 1, 'category': 'copy', 'turns': ['a b a b a b a b']},
    {'question_id': 2, 'category': 'copy', 'turns': ['the cat the cat the cat']},
    {'question_id': 3, 'category': 'free', 'turns': ['Hello world']},
    {'question_id': 4, 'category': 'free', 'turns': ['red green blue']},
]
PLOTS = (
    'tau_vs_k.png',
    'speedup_vs_k.png',
    'position_acceptance.png',
    'predicted_vs_measured.png',
    'policy_trajectories.png',
)


@pytest.fixture(scope='module')
def prompt_file(tmp_path_factory):
  path = tmp_path_factory.mktemp('prompts') / 'questions.jsonl'
  path.write_text(''.join(json.dumps(p) + '\n' for p in PROMPTS))
  return str(path)


def tiny_overrides(prompt_file, *extra):
  return [f'prompts.path={prompt_file!r}', 'prompts.categories=[]', 'prompts.limit=None', *extra]


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, prompt_file):
  out = str(tmp_path_factory.mktemp('sweep') / 'a')
  report = run_sweep(TINY_CONFIG, out, tiny_overrides(prompt_file), progress=False)
  return out, report


def records(out, kind=None):
  with open(os.path.join(out, artifacts.RESULTS)) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if kind is None or r['type'] == kind]


def tokens_by_request(out):
  return {(r['cell'], r['request_id']): r['tokens'] for r in records(out, 'request')}


# ---------------------------------------------------------------- configs


def test_grid_expands_to_cells_with_stable_ids():
  sweep = resolve(TINY_CONFIG)
  cells = expand(sweep)
  assert len(cells) == 6  # 2 drafters x 3 policies
  assert {c.config['drafter.kind'] for c in cells} == {'ngram', 'layer-skip'}
  assert [c.id for c in cells] == [c.id for c in expand(resolve(TINY_CONFIG))]
  tuner = [c for c in cells if c.config['policy.name'] == 'tuner']
  assert all(c.config['policy.candidates'] == [2, 4] for c in tuner)


def test_overrides_set_values_pin_axes_and_add_axes():
  sweep = resolve(
      TINY_CONFIG,
      ['max_new_tokens=5', 'drafter.kind=ngram', 'grid.sampling.temperature=[0.0, 0.7]', 'prompts.categories=["qa"]'],
  )
  cells = expand(sweep)
  assert 'drafter.kind' not in sweep.axes
  assert len(cells) == 6  # 3 policies x 2 temperatures
  assert all(c.config['max_new_tokens'] == 5 and c.config['drafter.kind'] == 'ngram' for c in cells)
  assert sorted({c.config['sampling.temperature'] for c in cells}) == [0.0, 0.7]
  assert resolve(TINY_CONFIG).hash != sweep.hash


def test_category_axis_and_partial_config():
  config = base_config()
  config.grid.category = ['qa', 'coding']
  cells = expand(resolve(config))
  assert [c.config['prompts.categories'] for c in cells] == [['qa'], ['coding']]
  assert len(expand(resolve({'max_new_tokens': 8}))) == 1  # a partial dict keeps the defaults, no grid: one cell


def test_settings_apart_where_the_drafter_label_is_silent():
  config = base_config()
  config.grid.drafter = [
      {'kind': 'eagle3', 'draft_model': 'runs/a/export'},
      {'kind': 'eagle3', 'draft_model': 'runs/b/export'},
      {'kind': 'eagle3', 'draft_model': 'runs/b/export', 'tree_topk': 4, 'tree_tokens': 5},
      {'kind': 'ngram'},
  ]
  cells = expand(resolve(config))
  labels = [setting_labels(cells)[c.id] for c in cells]  # two checkpoints of one family are two settings
  assert labels == [
      'eagle3 draft_model=runs/a/export',
      'eagle3 draft_model=runs/b/export',
      'eagle3-tree(4x5)',
      'ngram(1..3)',
  ]


@pytest.mark.parametrize(
    'overrides,message',
    [
        (['policy.kk=3'], "unknown config key 'policy.kk'"),
        (['grid.policy.k=[]'], "grid axis 'policy.k' has no values"),
        (['grid.policy.k=4'], 'must be a list'),
        (['grid.nothing=[1]'], "unknown grid axis 'nothing'"),
        (['max_new_tokens="many"'], "'max_new_tokens' must be int"),
        (['policy.k'], 'is not key=value'),
    ],
)
def test_bad_overrides(overrides, message):
  with pytest.raises(SpecjaxError, match=message):
    resolve(TINY_CONFIG, overrides)


def test_unknown_key_in_config_file(tmp_path):
  path = tmp_path / 'typo.py'
  path.write_text(
      'import ml_collections\n'
      'def get_config():\n'
      '  return ml_collections.ConfigDict({"drafter": {"kind": "ngram", "ngram_mx": 3}})\n'
  )
  with pytest.raises(SpecjaxError, match="unknown config key 'drafter.ngram_mx'"):
    resolve(str(path))
  with pytest.raises(SpecjaxError, match='does not exist'):
    resolve(str(tmp_path / 'missing.py'))


@pytest.mark.parametrize(
    'overrides,message',
    [
        (['policy.name="tuner"', 'policy.candidates=[2, 32]'], 'outside the drafter'),
        (['policy.k=17'], 'outside the drafter'),
        (['policy.name="greedy"'], "unknown policy 'greedy'"),
        (['drafter.kind="medusa"'], "unknown drafter 'medusa'"),
        (['prompts.categories=["poetry"]'], 'unknown categories'),
        (['drafter.layers=6'], 'layer-skip needs 1 <= layers < 6'),
    ],
)
def test_bad_cells_fail_before_any_work(tmp_path, prompt_file, overrides, message):
  out = tmp_path / 'out'
  with pytest.raises(SpecjaxError, match=message):
    run_sweep(TINY_CONFIG, str(out), tiny_overrides(prompt_file, *overrides), progress=False)
  assert not out.exists()


def test_forced_policy_env_is_refused(tmp_path, prompt_file, monkeypatch):
  monkeypatch.setenv('SPECJAX_POLICY', 'fixed:2')
  with pytest.raises(SpecjaxError, match='SPECJAX_POLICY'):
    run_sweep(TINY_CONFIG, str(tmp_path / 'out'), tiny_overrides(prompt_file), progress=False)


def test_acceptance_fit_and_prediction():
  from specjax.sweep import analytics

  steps = [(4, 4)] * 3 + [(4, 1)] * 2 + [(2, 0)] * 5  # (K, accepted)
  fit = analytics.fit_acceptance(steps)
  assert fit['alpha'] == pytest.approx(14 / 21)  # accepted / (accepted + steps that stopped short of K)
  assert fit['conditional'] == pytest.approx([0.5, 0.6, 1.0, 1.0])  # P(a >= i | a >= i - 1, K >= i)
  assert analytics.predict_tau(fit, 2) == pytest.approx(1 + 0.5 + 0.5 * 0.6)
  assert analytics.geometric_tau(0.5, 2) == pytest.approx(1.75)


# ---------------------------------------------------------------- a tiny sweep


def test_sweep_writes_every_artifact(tiny_run):
  out, report = tiny_run
  assert report['cells_run'] == 6 and report['cells_skipped'] == 0
  manifest = json.load(open(os.path.join(out, artifacts.MANIFEST)))
  for key in ('config', 'config_hash', 'git', 'versions', 'device', 'seeds', 'started', 'finished', 'cells'):
    assert key in manifest, key
  assert set(manifest['git']) == {'commit', 'dirty'} and manifest['seeds'] == [0]
  assert manifest['versions']['jax'] and manifest['finished'] >= manifest['started']
  requests = records(out, 'request')
  assert len(requests) == 6 * len(PROMPTS) and len(records(out, 'cell')) == 6
  assert len(records(out, 'baseline')) == len(PROMPTS)  # one autoregressive baseline per prompt, shared
  for r in requests:
    steps = r['target_steps']
    assert len(r['accepted_per_step']) == len(r['k_per_step']) == len(r['step_s']) == steps > 0
    assert len(r['tokens']) == 12 and r['emitted'] == 11
    assert all(0 <= a <= k for a, k in zip(r['accepted_per_step'], r['k_per_step']))
    assert len(r['position_acceptance']) >= max(r['k_per_step']) and r['decode_s'] > 0
  summary = open(os.path.join(out, artifacts.SUMMARY)).read()
  for heading in (
      '## copy — ngram(1..3)',
      '## free — layer-skip(2)',
      'Policies against the oracle best fixed K',
      '| tuner{2,4} |',
      '## Drafters side by side',
      '| category | layer-skip(2) K=2 |',
      '| geomean speedup |',
  ):
    assert heading in summary
  table = report['analysis']['side_by_side']
  assert len(table['columns']) == 6 and [c for c, _ in table['rows']] == ['copy', 'free', 'all']
  for (setting, policy), g in zip(table['columns'], table['geomean_speedup']):
    ups = [
        next(r for r in grp['rows'] if r['policy'] == policy)['speedup']
        for grp in report['analysis']['groups']
        if grp['setting'] == setting and grp['category'] != 'all'
    ]
    assert g == pytest.approx(float(np.exp(np.mean(np.log(ups)))))
  assert 'Greedy speculative tokens equal autoregressive tokens on every request: True' in summary
  for name in PLOTS:
    with open(os.path.join(out, name), 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n', name
  assert report['analysis']['greedy_equal'] is True


def test_same_config_same_tokens_and_cli(tiny_run, prompt_file, tmp_path, capsys):
  out, _ = tiny_run
  again = str(tmp_path / 'b')
  code = cli.main(['sweep', TINY_CONFIG, '--out', again, '--quiet', *tiny_overrides(prompt_file)])
  captured = capsys.readouterr()
  assert code == 0, captured.err
  assert '6 cells run' in captured.out
  assert tokens_by_request(again) == tokens_by_request(out)
  assert (
      json.load(open(os.path.join(again, artifacts.MANIFEST)))['config_hash']
      == json.load(open(os.path.join(out, artifacts.MANIFEST)))['config_hash']
  )


def test_resume_skips_finished_cells(tiny_run, prompt_file, tmp_path):
  src, _ = tiny_run
  out = tmp_path / 'resume'
  out.mkdir()
  for name in (artifacts.MANIFEST, artifacts.RESULTS):
    (out / name).write_bytes(open(os.path.join(src, name), 'rb').read())
  before = tokens_by_request(str(out))
  report = run_sweep(TINY_CONFIG, str(out), tiny_overrides(prompt_file), progress=False)
  assert report['cells_run'] == 0 and report['cells_skipped'] == 6
  assert tokens_by_request(str(out)) == before
  # An interrupted cell: its completion line is missing and the last write is torn.
  lines = (out / artifacts.RESULTS).read_text().splitlines(keepends=True)
  last = max(i for i, line in enumerate(lines) if json.loads(line)['type'] == 'cell')
  cut = json.loads(lines[last])['cell']
  (out / artifacts.RESULTS).write_text(''.join(lines[:last] + lines[last + 1 :]) + '{"type": "requ')
  report = run_sweep(TINY_CONFIG, str(out), tiny_overrides(prompt_file), progress=False)
  assert report['cells_run'] == 1 and report['cells_skipped'] == 5
  rows = records(str(out), 'request')
  assert sum(r['cell'] == cut for r in rows) == len(PROMPTS)  # rerun once, the partial lines dropped
  assert tokens_by_request(str(out)) == before
  assert len(json.load(open(out / artifacts.MANIFEST))['runs']) == 3


def test_out_dir_of_another_config_is_refused(tiny_run, prompt_file):
  out, _ = tiny_run
  before = open(os.path.join(out, artifacts.RESULTS), 'rb').read()
  with pytest.raises(SpecjaxError, match='holds results of another config'):
    run_sweep(TINY_CONFIG, out, tiny_overrides(prompt_file, 'max_new_tokens=8'), progress=False)
  assert open(os.path.join(out, artifacts.RESULTS), 'rb').read() == before


def test_cli_bad_input_is_one_error_line(tiny_run, prompt_file, capsys):
  out, _ = tiny_run
  for argv, message in [
      (['sweep', TINY_CONFIG, 'policy.kk=1'], 'unknown config key'),
      (['sweep', TINY_CONFIG, '--out', out, *tiny_overrides(prompt_file, 'max_new_tokens=8')], 'another config'),
      (['sweep', '/no/such/config.py'], 'does not exist'),
  ]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith('error: ') and message in err and err.count('\n') == 1, err


def test_sampled_sweep_is_deterministic(prompt_file, tmp_path):
  overrides = tiny_overrides(
      prompt_file,
      'sampling.temperature=0.8',
      'sampling.top_k=20',
      'sampling.seed=3',
      'grid.drafter.kind=["ngram"]',
      'grid.policy=[{"name": "fixed", "k": 3}]',
      'prompts.categories=["copy"]',
      'interleave=True',
      'repeats=2',
  )
  overrides.append('trace=True')
  a = run_sweep(TINY_CONFIG, str(tmp_path / 'a'), overrides, progress=False, make_plots=False)
  b = run_sweep(TINY_CONFIG, str(tmp_path / 'b'), overrides, progress=False, make_plots=False)
  assert a['cells_run'] == b['cells_run'] == 1
  assert tokens_by_request(str(tmp_path / 'a')) == tokens_by_request(str(tmp_path / 'b'))
  assert all(len(r['decode_s_runs']) == 2 for r in records(str(tmp_path / 'a'), 'request'))
  # n-gram drafts are verified by sample-and-match: token for token the autoregressive sample.
  base = {r['request_id']: r['tokens'] for r in records(str(tmp_path / 'a'), 'baseline')}
  assert all(r['tokens'] == base[r['request_id']] for r in records(str(tmp_path / 'a'), 'request'))
  for r in records(str(tmp_path / 'a'), 'request'):  # trace=True keeps every step's drafts and emitted ids
    assert len(r['trace']) == r['target_steps'] and sum(t['accepted'] for t in r['trace']) == r['accepted']
    assert [x for t in r['trace'] for x in t['emitted']] == r['tokens'][1:]


def test_hybrid_mtp_config(prompt_file, tmp_path):
  """configs/hybrid_mtp_tiny.py: the built-in MTP drafter and n-gram on a hybrid target, from a config."""
  config = os.path.join(ROOT, 'configs', 'hybrid_mtp_tiny.py')
  out = str(tmp_path / 'mtp')
  report = run_sweep(
      config,
      out,
      tiny_overrides(prompt_file, 'grid.policy=[{"name": "fixed", "k": 3}, {"name": "tuner"}]'),
      progress=False,
  )
  assert report['cells_run'] == 4 and report['analysis']['greedy_equal'] is True
  cells = {c['cell']: c for c in records(out, 'cell')}
  mtp = [r for r in records(out, 'request') if cells[r['cell']]['drafter'] == 'mtp']
  assert len(mtp) == 2 * len(PROMPTS)
  tuner = [r for r in mtp if cells[r['cell']]['policy'].startswith('tuner')]
  assert tuner and {k for r in tuner for k in r['k_per_step']} <= {2, 3, 4, 6}  # the MTP family's depths
