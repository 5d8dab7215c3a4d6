"""`specjax generate`: JSON output, streaming, and one-line errors for user mistakes."""

import json
import shutil
import subprocess
import sys

import pytest

from specjax import cli
from conftest import FIXTURES, TINY

QWEN = f'{FIXTURES}/tiny_qwen3_5'


def run_cli(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_generate_json(capsys):
  code, out, err = run_cli(
      capsys, 'generate', '-m', TINY, '--prompt', 'Hello', '--max-new-tokens', '5', '--page-size', '4', '--json'
  )
  assert code == 0, err
  row = json.loads(out)
  for key in ('text', 'tokens', 'prompt_tokens', 'tokens_per_s', 'prefill_s', 'decode_s'):
    assert key in row
  assert len(row['tokens']) == 5


def test_generate_streams_text(capsys, tmp_path):
  prompts = tmp_path / 'prompts.txt'
  prompts.write_text('Hello\n')
  code, out, err = run_cli(
      capsys,
      'generate',
      '-m',
      TINY,
      '--prompt-file',
      str(prompts),
      '--max-new-tokens',
      '4',
      '--temperature',
      '0.8',
      '--top-k',
      '20',
      '--seed',
      '1',
  )
  assert code == 0 and out.startswith('Hello')


def test_prompt_file_is_one_prompt(tmp_path):
  path = tmp_path / 'prompt.txt'
  path.write_bytes('Line one\n\n  indented\\n kept\n'.encode())
  assert cli.read_prompt_file(str(path)) == ['Line one\n\n  indented\\n kept']  # one trailing newline dropped
  path.write_bytes(b'a\r\nb\r\n\n')
  assert cli.read_prompt_file(str(path)) == ['a\r\nb\r\n']  # exact bytes, as llama.cpp -f
  path.write_bytes('  café'.encode())
  assert cli.read_prompt_file(str(path)) == ['  café']


def test_prompts_per_line_and_jsonl_are_batches(tmp_path):
  path = tmp_path / 'prompts.txt'
  path.write_bytes(b'Hello\r\n\n  \nThe cat\\nsat \n')
  assert cli.read_prompt_file(str(path), per_line=True) == ['Hello', 'The cat\nsat ']
  jsonl = tmp_path / 'prompts.jsonl'
  jsonl.write_text(json.dumps({'prompt': 'a\nb'}) + '\n' + json.dumps({'turns': ['c', 'd']}) + '\n')
  assert cli.read_prompt_file(str(jsonl)) == ['a\nb', 'c']
  assert cli.read_prompt_file(str(jsonl), per_line=True) == ['a\nb', 'c']  # a .jsonl is always JSON lines


def test_prompt_file_through_the_cli(capsys, tmp_path):
  text = 'The cat sat.\nThe cat'
  path = tmp_path / 'prompt.txt'
  path.write_text(text + '\n')
  common = ['--max-new-tokens', '3', '--page-size', '4', '--json']
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt-file', str(path), *common)
  assert code == 0, err
  whole = json.loads(out)
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt', text, *common)
  assert code == 0 and json.loads(out)['tokens'] == whole['tokens'], err
  assert json.loads(out)['prompt_tokens'] == whole['prompt_tokens']
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt-file', str(path), '--prompts-per-line', *common)
  assert code == 0, err
  assert len(json.loads(out)['results']) == 2


@pytest.mark.parametrize(
    'content,flags,message',
    [
        (b'', [], 'is empty'),
        (b'\n', [], 'has no prompt'),
        (b'\n  \n\n', ['--prompts-per-line'], 'has no prompt'),
        (b'', ['--prompts-per-line'], 'is empty'),
        (b'caf\xe9\n', [], 'not UTF-8'),
    ],
)
def test_bad_prompt_file_is_one_error_line(capsys, tmp_path, content, flags, message):
  path = tmp_path / 'prompt.txt'
  path.write_bytes(content)
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt-file', str(path), *flags)
  assert code == 2 and err.startswith('error: ') and message in err and err.count('\n') == 1, err


@pytest.mark.parametrize(
    'argv,message',
    [
        (['-m', './missing-model', '--prompt', 'x'], 'not found'),
        (['-m', TINY], 'no prompt'),
        (['-m', TINY, '--prompt', 'x', '--temperature', '-1'], 'temperature'),
        (['-m', TINY, '--prompt', 'x', '--top-p', '0'], 'top_p'),
        (['-m', TINY, '--prompt', 'x', '--top-k', '-3'], 'top_k'),
        (['-m', TINY, '--prompt', 'x', '--max-new-tokens', '0'], 'max-new-tokens'),
        (['-m', TINY, '--prompt', 'x', '--max-new-tokens', '1000'], 'capacity'),
        (
            ['-m', TINY, '--prompt', 'x y z', '--max-new-tokens', '100', '--num-pages', '3', '--page-size', '4'],
            'out of pages',
        ),
        (['-m', TINY, '--prompt-file', '/no/such/file'], 'does not exist'),
        (['-m', TINY, '--prompt', 'x', '--prompts-per-line'], '--prompts-per-line reads --prompt-file'),
        (['-m', TINY, '--prompt', ''], '--prompt is empty: give the text to continue'),  # as an empty prompt file
        (['-m', TINY, '--prompt', 'x', '--prompt', ''], '--prompt is empty (prompt 2 of 2)'),
    ],
)
def test_bad_input_is_one_error_line(capsys, argv, message):
  code, out, err = run_cli(capsys, 'generate', *argv)
  assert code != 0
  assert err.startswith('error: ') and message in err and err.count('\n') == 1, err
  assert 'Traceback' not in err


def test_error_after_streaming_starts_on_a_fresh_line(capsys):
  """The prompt is streamed before the engine's checks: the error line must not continue it."""
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt', 'x y z', '--max-new-tokens', '1000')
  assert code == 2 and out == 'x y z\n', out
  assert err.startswith('error: ') and 'capacity' in err and err.count('\n') == 1, err


def test_unexpected_exception_is_one_internal_error_line(capsys, monkeypatch):
  """A bug is one `internal error:` line (exit 1); SPECJAX_DEBUG=1 raises it with its traceback."""

  def bug(args):
    raise RuntimeError('no such\n  thing')

  monkeypatch.setattr(cli, 'read_prompts', bug)
  monkeypatch.delenv('SPECJAX_DEBUG', raising=False)
  code, out, err = run_cli(capsys, 'generate', '-m', TINY, '--prompt', 'x')
  assert code == 1 and out == ''
  assert err == (
      'internal error: RuntimeError: no such thing (please report this; SPECJAX_DEBUG=1 shows the traceback)\n'
  ), err
  monkeypatch.setenv('SPECJAX_DEBUG', '1')
  with pytest.raises(RuntimeError, match='no such'):
    cli.main(['generate', '-m', TINY, '--prompt', 'x'])


@pytest.mark.parametrize(
    'argv,message',
    [
        (
            ['run', '-m', TINY, '--prompt', 'x', '--drafter', 'nope'],
            "error: unknown drafter 'nope' (choose from ngram, ",
        ),
        (
            ['generate', '-m', TINY, '--attention-impl', 'nope'],
            "error: argument --attention-impl: invalid choice: 'nope'",
        ),
        (['generate', '--prompt', 'x'], 'error: the following arguments are required: -m/--model'),
        (['frobnicate'], 'error: argument command: invalid choice'),
    ],
)
def test_usage_mistakes_are_one_error_line(capsys, argv, message):
  """Unknown drafters name the registered ones; argparse's own mistakes are one line too, not its usage block."""
  try:
    code = cli.main(argv)
  except SystemExit as e:  # argparse exits
    code = e.code
  out, err = capsys.readouterr()
  assert code == 2 and err.startswith(message) and err.count('\n') == 1 and not out, err
  if 'drafter' in message:
    from specjax.drafters import REGISTRY

    assert all(name in err for name in REGISTRY)


def test_help_names_every_family_and_trainer(capsys, monkeypatch):
  """--help lists what exists: every drafter family (run, bench) and every trainer kind (train)."""
  from specjax.drafters import REGISTRY
  from specjax.train.trainers import TRAINERS

  monkeypatch.setenv('COLUMNS', '10000')  # one line per option: names are not broken at hyphens
  helps = {}
  for command in ([], ['run'], ['bench'], ['train']):
    with pytest.raises(SystemExit):
      cli.main(command + ['--help'])
    helps[' '.join(command)] = capsys.readouterr().out
  assert f'train a drafter ({", ".join(TRAINERS)})' in helps[''] and 'dflash' in TRAINERS
  for command in ('run', 'bench'):
    drafter = next(line for line in helps[command].splitlines() if line.strip().startswith('--drafter'))
    assert all(name in drafter for name in REGISTRY), drafter
  depths = next(line for line in helps['bench'].splitlines() if line.strip().startswith('--depths'))
  assert 'dflash 3 5 7' in depths and 'mtp 2 3 4 6' in depths, depths


@pytest.mark.parametrize(
    'drafter,config,message',
    [
        ('dflash', 'tiny_eagle3', 'not a DFlash draft'),
        ('eagle3', 'tiny_dflash', 'not an EAGLE-3 head'),
        ('mtp', 'tiny_eagle3', 'is not an MTP head'),
    ],
)
def test_drafter_of_another_family_is_named_before_its_weights(capsys, tmp_path, drafter, config, message):
  """A checkpoint of another family (here with no weights at all) is refused by its architecture."""
  shutil.copy(f'{FIXTURES}/{config}/config.json', tmp_path / 'config.json')
  code, out, err = run_cli(
      capsys, 'run', '-m', TINY, '--prompt', 'x', '--drafter', drafter, '--draft-model', str(tmp_path)
  )
  assert code == 2 and err.startswith('error: ') and message in err and err.count('\n') == 1, err
  assert 'safetensors' not in err


def test_entry_point_exit_code():
  proc = subprocess.run(
      [sys.executable, '-m', 'specjax.cli', 'generate', '-m', '/no/model', '--prompt', 'x'],
      capture_output=True,
      text=True,
  )
  assert proc.returncode == 2
  assert proc.stderr.strip().startswith('error:') and 'Traceback' not in proc.stderr


def test_run_json_has_spec_metrics(capsys):
  code, out, err = run_cli(
      capsys,
      'run',
      '-m',
      TINY,
      '--prompt',
      'The cat sat on the mat. The cat',
      '--drafter',
      'ngram',
      '--n-predict',
      '3',
      '--max-new-tokens',
      '12',
      '--page-size',
      '4',
      '--json',
  )
  assert code == 0, err
  row = json.loads(out)
  spec = row['spec']
  for key in (
      'target_steps',
      'drafted',
      'accepted',
      'tau',
      'acceptance_rate',
      'position_acceptance',
      'conditional_acceptance',
      'total_s',
  ):
    assert key in spec
  assert len(row['tokens']) == 12 and spec['emitted'] == 11


def test_mistral_rs_aliases(capsys):
  code, out, err = run_cli(
      capsys,
      'run',
      '-m',
      TINY,
      '--prompt',
      'Hello',
      '--mtp-model',
      TINY,
      '--mtp-n-predict',
      '2',
      '--max-new-tokens',
      '6',
      '--page-size',
      '4',
      '--json',
  )
  assert code == 0, err
  spec = json.loads(out)['spec']
  assert spec['drafter'] == 'draft-model' and spec['k'] == 2
  assert spec['acceptance_rate'] == 1.0  # the target drafting for itself


def test_run_mtp(capsys):
  code, out, err = run_cli(
      capsys, 'run', '-m', QWEN, '--mtp', '--prompt', 'Hello', '--max-new-tokens', '6', '--page-size', '4', '--json'
  )
  assert code == 0, err
  spec = json.loads(out)['spec']
  assert spec['drafter'] == 'mtp' and spec['k'] == 3 and len(json.loads(out)['tokens']) == 6


def test_bench_table(capsys, tmp_path):
  prompts = tmp_path / 'q.jsonl'
  prompts.write_text(
      '\n'.join(
          json.dumps({'question_id': i, 'category': c, 'turns': [t]})
          for i, (c, t) in enumerate([('copy', 'a b c a b c a b'), ('copy', 'x y x y x'), ('chat', 'Hello there')])
      )
  )
  code, out, err = run_cli(
      capsys,
      'bench',
      '-m',
      TINY,
      '--drafter',
      'ngram',
      '--prompts',
      str(prompts),
      '--depths',
      '1',
      '2',
      '--max-new-tokens',
      '8',
      '--page-size',
      '4',
      '--quiet',
  )
  assert code == 0, err
  assert '| copy | ngram(1..3) | 2 |' in out and '| all | ngram(1..3) | 1 |' in out
  assert 'speculative outputs equal autoregressive: True' in out


@pytest.mark.parametrize(
    'argv,message',
    [
        (['run', '-m', TINY, '--prompt', 'x', '--n-predict', '0'], 'n-predict'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'draft-model'], 'needs --draft-model'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'layer-skip', '--layers', '9'], 'layer-skip needs'),
        (['run', '-m', TINY, '--prompt', 'x', '--draft-model', '/no/such/model'], 'not found'),
        (['bench', '-m', TINY, '--prompts', '/no/file.jsonl'], 'does not exist'),
        (['run', '-m', TINY, '--prompt', 'x', '--mtp'], 'no built-in MTP head'),
        (['run', '-m', 'gemma-3-270m', '--prompt', 'x', '--mtp'], 'not supported from GGUF'),
        (['run', '-m', QWEN, '--prompt', 'x', '--mtp', '--drafter', 'ngram'], 'cannot be combined'),
        (['run', '-m', QWEN, '--prompt', 'x', '--drafter', 'layer-skip'], 'not supported on hybrid targets'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--candidates', '0,2'], 'need --policy'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--policy', 'load', '--candidates', '2'], 'tuner'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--policy', 'tuner', '--candidates', 'a'], '0,2,4'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--policy', 'tuner', '--candidates', '0'], 'off'),
        (['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--policy', 'load', '--policy-option', 'x'], 'KEY'),
        (
            ['run', '-m', TINY, '--prompt', 'x', '--drafter', 'ngram', '--policy', 'load', '--policy-option', 'm=1'],
            'no option m',
        ),
    ],
)
def test_speculative_bad_input(capsys, argv, message):
  code, out, err = run_cli(capsys, *argv)
  assert code != 0 and err.startswith('error: ') and message in err and 'Traceback' not in err, err


def test_bench_unknown_category(capsys, spec_bench):
  """The default prompts are Spec-Bench's (resolved without a path relative to the working directory)."""
  code, out, err = run_cli(capsys, 'bench', '-m', TINY, '--categories', 'nope', '--limit', '1')
  assert code == 2 and err.startswith('error: unknown categories') and err.count('\n') == 1, err
  assert spec_bench in err
