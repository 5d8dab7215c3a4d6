"""Training data: jsonl record shapes, the truncated-JSON reader, sources, eval-set refusal, formatting, packing."""

import json
import os

import numpy as np
import pytest

from conftest import TINY
from specjax.errors import SpecjaxError
from specjax.train import data as data_lib
from specjax.train.config import resolve


def write_jsonl(path, rows):
  with open(path, 'w', encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  return str(path)


def test_jsonl_record_shapes(tmp_path):
  path = write_jsonl(
      tmp_path / 'data.jsonl',
      [
          {'conversations': [{'from': 'human', 'value': 'hi'}, {'from': 'gpt', 'value': 'hello'}]},
          {'prompt': '2+2?', 'response': '4'},
          {'turns': ['first turn', 'second turn']},
          {'text': 'plain text'},
          {'messages': [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'q'}]},
          {'conversations': []},  # nothing usable: skipped
      ],
  )
  records = list(data_lib.read_jsonl(path))
  assert [r.messages for r in records[:3]] == [
      [('user', 'hi'), ('assistant', 'hello')],
      [('user', '2+2?'), ('assistant', '4')],
      [('user', 'first turn')],
  ]
  assert records[3].text == 'plain text' and records[3].messages is None
  assert records[4].prompt == [('system', 'be brief'), ('user', 'q')]
  assert len(records) == 5
  assert len(list(data_lib.read_jsonl(path, limit=2))) == 2


def test_jsonl_bad_lines(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "ok"}\nnot json\n')
  with pytest.raises(SpecjaxError, match=r'bad.jsonl:2 is not valid JSON'):
    list(data_lib.read_jsonl(str(bad)))
  odd = write_jsonl(tmp_path / 'odd.jsonl', [{'question': 'no known field'}])
  with pytest.raises(SpecjaxError, match='has none of'):
    list(data_lib.read_jsonl(odd))
  with pytest.raises(SpecjaxError, match='does not exist'):
    list(data_lib.read_jsonl(str(tmp_path / 'missing.jsonl')))


def test_truncated_json_array(tmp_path):
  records = [{'id': i, 'conversations': [{'from': 'human', 'value': f'q{i} ]}}'}]} for i in range(4)]
  text = json.dumps(records, indent=2)
  path = tmp_path / 'cut.json'
  path.write_text(text[: text.index('"q3') + 2])  # cut inside the fourth record
  assert [r['id'] for r in data_lib.read_json_array(str(path))] == [0, 1, 2]
  path.write_text(text)  # complete: every record
  assert [r['id'] for r in data_lib.read_json_array(str(path))] == [0, 1, 2, 3]
  assert [r['id'] for r in data_lib.read_json_array(str(path), limit=2)] == [0, 1]
  path.write_text('[]')
  assert list(data_lib.read_json_array(str(path))) == []


def test_eval_sets_refused(tmp_path):
  from specjax.datasets import spec_bench_seed_path

  spec_bench = spec_bench_seed_path()
  if os.path.isfile(spec_bench):  # Spec-Bench is recognised by its sha256 whatever its name
    copy = tmp_path / 'renamed.jsonl'
    copy.write_bytes(open(spec_bench, 'rb').read())
    with pytest.raises(SpecjaxError, match='evaluation set'):
      list(data_lib.read_jsonl(str(copy)))
  for name in ('spec_bench_questions.jsonl', 'HumanEval.jsonl', 'mt_bench.jsonl', 'gsm8k_test.jsonl'):
    path = write_jsonl(tmp_path / name, [{'text': 'x'}])
    with pytest.raises(SpecjaxError, match='never trains on evaluation data'):
      list(data_lib.read_jsonl(path))


def test_sources(tmp_path):
  code = list(data_lib.SOURCES['stdlib_code'].read('', 2, 0))
  assert len(code) == 2 and all(r.text for r in code)
  with pytest.raises(SpecjaxError, match='unknown data source'):
    data_lib.read_records(None, ['nope'], None, 0)
  pytest.importorskip('reasoning_gym')
  with pytest.raises(SpecjaxError, match='gsm_symbolic.*GSM8K'):
    list(data_lib.SOURCES['reasoning_gym'].read('gsm_symbolic', 2, 0))
  gym = data_lib.read_records(None, ['reasoning_gym:basic_arithmetic,chain_sum'], 3, 0)
  assert len(gym) == 3 and all(r.messages[1][0] == 'assistant' for r in gym)


@pytest.fixture(scope='module')
def tokenizer():
  from specjax.loading.tokenizer import Tokenizer

  return Tokenizer.from_file(TINY)


def test_plain_formatting_masks_answers(tokenizer):
  fmt = data_lib.Formatter(tokenizer, None)
  ex = fmt.example(data_lib.Record(messages=[('user', 'the cat'), ('assistant', 'sat on the mat')]))
  answer = tokenizer.decode([i for i, m in zip(ex.ids, ex.mask) if m])
  assert answer.strip() == 'sat on the mat'
  assert ex.ids[0] == tokenizer.bos_id and not ex.mask[0]
  assert fmt.example(data_lib.Record(messages=[('user', 'no answer')])) is None  # nothing to learn
  everything = data_lib.Formatter(tokenizer, None, 'all').example(data_lib.Record(messages=[('user', 'no answer')]))
  assert all(everything.mask)
  assert fmt.prompt_ids(data_lib.Record(messages=[('user', 'q'), ('assistant', 'a')])) == tokenizer.encode('q\n\n')


def test_chat_template_formatting(tokenizer, tmp_path):
  pytest.importorskip('jinja2')
  template = (
      '{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}'
      '{% if add_generation_prompt %}<assistant>{% endif %}'
  )
  fmt = data_lib.Formatter(tokenizer, template)
  record = data_lib.Record(messages=[('user', 'the cat'), ('assistant', 'sat')])
  assert fmt.render(record.messages) == '<bos><user>the cat</s><assistant>sat</s>'
  ex = fmt.example(record)
  assert ex.ids[0] == tokenizer.bos_id and ex.ids.count(tokenizer.bos_id) == 1
  assert 'sat' in tokenizer.decode([i for i, m in zip(ex.ids, ex.mask) if m])
  assert 'cat' not in tokenizer.decode([i for i, m in zip(ex.ids, ex.mask) if m])
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'chat_template': template}))
  assert data_lib.chat_template(str(tmp_path)) == template
  assert data_lib.chat_template(TINY) is None


def test_pack():
  ex = lambda n: data_lib.Example(list(range(1, n + 1)), [True] * n)
  packed = data_lib.pack([ex(3), ex(4), ex(9), ex(5), ex(2)], 8)  # 9 is cut to 8; 2 is too short
  assert packed.tokens.shape == (3, 8)
  np.testing.assert_array_equal(packed.segments[0], [1, 1, 1, 2, 2, 2, 2, 0])
  np.testing.assert_array_equal(packed.positions[0], [0, 1, 2, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(packed.segments[1], [1] * 8)
  np.testing.assert_array_equal(packed.segments[2], [1, 1, 1, 1, 1, 0, 0, 0])
  assert packed.num_tokens == 20
  single = data_lib.pack([ex(3), ex(4)], 8, pack=False)
  assert single.tokens.shape == (2, 8)
  rows = [data_lib.batch_rows(10, 4, s, seed=1) for s in range(4)]
  assert sorted(np.concatenate(rows[:2]).tolist()) == sorted(set(np.concatenate(rows[:2]).tolist()))  # an epoch
  np.testing.assert_array_equal(rows[3], data_lib.batch_rows(10, 4, 3, seed=1))  # a pure function of the step


def test_config_checks(tmp_path):
  with pytest.raises(SpecjaxError, match=r"unknown config key 'train.stepz'"):
    resolve({'data': {'path': 'x.jsonl'}}, ['train.stepz=3'])
  with pytest.raises(SpecjaxError, match="'train.steps' must be int"):
    resolve({'data': {'path': 'x.jsonl'}, 'train': {'steps': 'many'}})
  with pytest.raises(SpecjaxError, match="'drafter.kind' must be one of"):
    resolve({'data': {'path': 'x.jsonl'}, 'drafter': {'kind': 'medusa'}})
  with pytest.raises(SpecjaxError, match='no training data'):
    resolve({})
  cfg = resolve({'data': {'path': 'x.jsonl'}}, ['train.lr=1e-3', 'train.log_every=5'])
  assert cfg['train.lr'] == 1e-3
  assert cfg.hash == resolve({'data': {'path': 'x.jsonl'}}, ['train.lr=1e-3']).hash  # logging is not the run
  assert cfg.hash != resolve({'data': {'path': 'x.jsonl'}}).hash


def test_cut_prompt_keeps_bos_and_the_end():
  """A long prompt is answered from its end (the question and the generation prompt), after its BOS."""
  from specjax.train.data import cut_prompt

  assert cut_prompt([2, 10, 11, 12, 13, 14], 4, bos_id=2) == [2, 12, 13, 14]
  assert cut_prompt([10, 11, 12, 13, 14], 3, bos_id=2) == [12, 13, 14]
  assert cut_prompt([2, 10, 11], 4, bos_id=2) == [2, 10, 11]
  assert cut_prompt([2, 10, 11, 12], 4, bos_id=None) == [2, 10, 11, 12]
