"""`specjax serve`'s HTTP layer: the OpenAI API over a running scheduler, checked with the official client.

Two uvicorn servers (one module fixture) share one scheduler over the tiny Gemma 3 with the n-gram drafter: an
open one (the model has no chat template; small body limit) and one with an API key and a chat template. Outputs
over HTTP equal `Engine.generate`'s offline outputs for the same seed and request ids.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip('fastapi')
pytest.importorskip('uvicorn')
openai = pytest.importorskip('openai')
httpx = pytest.importorskip('httpx')

from conftest import TINY  # noqa: E402

KEY = 'sk-test-key'
NAME = 'tiny'
PROMPT = 'The capital of France is'
MAX_SEQ_LEN = 128
N = 12  # max_tokens of the requests compared with offline outputs (one offline shape: one compile)
BODY_LIMIT = 20_000
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    '{% if add_generation_prompt %}<assistant>{% endif %}'
)


class _Uvicorn:
  """uvicorn in a background thread on a free port of 127.0.0.1."""

  def __init__(self, app):
    import uvicorn

    self.sock = socket.socket()
    self.sock.bind(('127.0.0.1', 0))
    self.url = f'http://127.0.0.1:{self.sock.getsockname()[1]}'
    self.server = uvicorn.Server(uvicorn.Config(app, log_level='warning'))
    self.thread = threading.Thread(target=self.server.run, kwargs={'sockets': [self.sock]}, daemon=True)
    self.thread.start()
    deadline = time.monotonic() + 30
    while not self.server.started:
      assert time.monotonic() < deadline and self.thread.is_alive(), 'uvicorn did not start'
      time.sleep(0.01)

  def stop(self):
    self.server.should_exit = True
    self.thread.join(timeout=10)
    self.sock.close()


class Served:

  def __init__(self, engine, scheduler, open_url, keyed_url):
    self.engine, self.scheduler, self.open_url, self.keyed_url = engine, scheduler, open_url, keyed_url
    self._offline = {}
    self.client = openai.OpenAI(base_url=f'{open_url}/v1', api_key='unused', max_retries=0, timeout=120)
    self.keyed = openai.OpenAI(base_url=f'{keyed_url}/v1', api_key=KEY, max_retries=0, timeout=120)

  def offline(self, prompt, sampling=None, n=1):
    """`Engine.generate`'s N tokens for `prompt` (text or ids), as choices 0..n-1 (request ids), cached."""
    from specjax.sampling import SamplingParams

    key = (str(prompt), sampling, n)
    if key not in self._offline:
      self._offline[key], _ = self.engine.generate(
          [prompt] * n, max_new_tokens=N, sampling=sampling or SamplingParams(), request_ids=range(n), num_draft=0
      )
    return self._offline[key] if n > 1 else self._offline[key][0]

  def counts(self):
    """What changes when anything is scheduled."""
    m = self.scheduler.metrics()
    keys = ('requests_finished', 'requests_cancelled', 'prompt_tokens', 'steps', 'live_slots', 'waiting')
    return {k: m[k] for k in keys}


@pytest.fixture(scope='module')
def served(tiny_model):
  import specjax
  from specjax import serve
  from specjax.drafters import make_drafter
  from specjax.engine.scheduler import Scheduler

  engine = specjax.Engine(tiny_model, page_size=4, drafter=make_drafter('ngram', tiny_model), max_draft=2)
  scheduler = Scheduler(engine, max_slots=4, max_seq_len=MAX_SEQ_LEN).start()
  servers = []
  try:
    servers.append(_Uvicorn(serve.app(scheduler, model_name=NAME, max_body_bytes=BODY_LIMIT)))
    servers.append(_Uvicorn(serve.app(scheduler, model_name=NAME, api_key=KEY, chat_template=TEMPLATE)))
    yield Served(engine, scheduler, servers[0].url, servers[1].url)
  finally:
    for s in servers:
      s.stop()
    scheduler.stop()


def error_of(response, status):
  assert response.status_code == status, response.text
  err = response.json()['error']
  assert set(err) == {'message', 'type', 'param', 'code'} and err['message']
  return err


# ---------------------------------------------------------------- completions


def test_greedy_completion_equals_offline(served):
  want = served.offline(PROMPT)
  r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0)
  choice = r.choices[0]
  assert choice.text == want.text
  assert r.usage.completion_tokens == len(want.tokens) and r.usage.prompt_tokens == want.prompt_tokens
  assert choice.finish_reason == ('stop' if want.finish_reason == 'eos' else 'length')
  decode = served.engine.model.tokenizer.decode
  assert choice.logprobs.tokens == [decode([t], skip_special_tokens=False) for t in want.tokens]  # token for token
  assert len(choice.logprobs.token_logprobs) == len(want.tokens)
  assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
  assert r.model == NAME and r.object == 'text_completion'
  # token ids as the prompt, and a batch of prompts (choice index = prompt * n + j)
  ids = served.engine.encode([PROMPT])[0]
  r = served.client.completions.create(model=NAME, prompt=ids, max_tokens=N, temperature=0)
  assert r.choices[0].text == want.text
  r = served.client.completions.create(model=NAME, prompt=[PROMPT, 'def add(a, b):'], max_tokens=N, temperature=0)
  assert [c.index for c in r.choices] == [0, 1]
  assert [c.text for c in r.choices] == [want.text, served.offline('def add(a, b):').text]


def test_seeded_sampling_equals_offline_per_choice(served):
  from specjax.sampling import SamplingParams

  want = served.offline(PROMPT, SamplingParams(temperature=0.9, seed=7), n=2)
  r = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=N, temperature=0.9, seed=7, n=2)
  assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.text for w in want]
  assert r.usage.completion_tokens == sum(len(w.tokens) for w in want)
  assert r.usage.prompt_tokens == want[0].prompt_tokens  # the prompt counts once for its n choices


def test_response_format_constrains_and_equals_offline(served):
  """json_schema, json_object and unconstrained requests in flight together (the n-gram drafter speculating on
  all): each greedy output equals `Engine.generate`'s constrained (or plain) autoregressive output; a bad schema is
  a 400 naming response_format, before anything is scheduled."""
  from specjax.sampling import SamplingParams

  schema = {'type': 'object', 'properties': {'name': {'type': 'string'}, 'n': {'type': 'integer'}}}
  cases = {
      'json_schema': (
          {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}},
          SamplingParams(json_schema=schema),
      ),
      'json_object': ({'type': 'json_object'}, SamplingParams(json_object=True)),
      'text': ({'type': 'text'}, SamplingParams()),
  }
  prompts = {'json_schema': PROMPT, 'json_object': 'def add(a, b):', 'text': PROMPT}
  got = {}

  def ask(name):
    response_format, _ = cases[name]
    r = served.client.completions.create(
        model=NAME, prompt=prompts[name], max_tokens=N, temperature=0, extra_body={'response_format': response_format}
    )
    got[name] = r.choices[0].text

  threads = [threading.Thread(target=ask, args=(name,)) for name in cases]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for name, (_, sampling) in cases.items():
    assert got[name] == served.offline(prompts[name], sampling).text, name
  assert got['json_object'].lstrip().startswith('{')
  before = served.counts()
  bad = {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'foo'}}}
  response = httpx.post(
      f'{served.open_url}/v1/completions',
      json={'prompt': PROMPT, 'max_tokens': 4, 'response_format': bad},
  )
  err = error_of(response, 400)
  assert err['param'] == 'response_format' and 'foo' in err['message']
  assert served.counts() == before


def test_streaming_completion(served):
  want = served.offline(PROMPT)
  stream = served.client.completions.create(
      model=NAME, prompt=PROMPT, max_tokens=N, temperature=0, stream=True, stream_options={'include_usage': True}
  )
  chunks = list(stream)
  assert ''.join(c.choices[0].text for c in chunks if c.choices) == want.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
  # the raw SSE: data lines, [DONE] last
  with httpx.stream(
      'POST',
      f'{served.open_url}/v1/completions',
      json={'prompt': PROMPT, 'max_tokens': N, 'temperature': 0, 'stream': True, 'n': 2},
      timeout=120,
  ) as r:
    assert r.headers['content-type'].startswith('text/event-stream')
    events = [line for line in r.iter_lines() if line]
  assert all(e.startswith('data: ') for e in events) and events[-1] == 'data: [DONE]'
  texts = {0: '', 1: ''}
  for e in events[:-1]:
    for c in json.loads(e[6:])['choices']:
      texts[c['index']] += c['text']
  assert texts[0] == texts[1] == want.text  # greedy: both choices alike


def test_speculative_field(served):
  want = served.offline(PROMPT).text
  before = served.scheduler.metrics()['spec_steps']
  r = served.client.completions.create(
      model=NAME, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={'speculative': {'enabled': False}}
  )
  assert r.choices[0].text == want and served.scheduler.metrics()['spec_steps'] == before
  r = served.client.completions.create(
      model=NAME, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={'speculative': {'num_draft': 2}}
  )
  assert r.choices[0].text == want and served.scheduler.metrics()['spec_steps'] > before
  for bad in ({'num_draft': 3}, {'enabled': False, 'num_draft': 2}, {'num_draft': -1}):
    body = {'prompt': PROMPT, 'max_tokens': 2, 'speculative': bad}
    assert error_of(httpx.post(f'{served.open_url}/v1/completions', json=body), 400)['param'].startswith('speculative')


# ---------------------------------------------------------------- chat


def test_chat_completion_through_the_template(served):
  from specjax.train.data import Formatter

  messages = [{'role': 'system', 'content': 'Be'}, {'role': 'user', 'content': 'Hi'}]  # under 16 tokens: one bucket
  fmt = Formatter(served.engine.model.tokenizer, TEMPLATE)
  ids = fmt.encode(fmt.render([(m['role'], m['content']) for m in messages], generation_prompt=True))[0]
  want = served.offline(ids)
  r = served.keyed.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=N, temperature=0)
  assert r.choices[0].message.content == want.text and r.choices[0].message.role == 'assistant'
  assert r.usage.prompt_tokens == len(ids) and r.object == 'chat.completion'
  stream = served.keyed.chat.completions.create(
      model=NAME, messages=messages, max_tokens=N, temperature=0, stream=True, logprobs=True
  )
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == 'assistant'
  assert ''.join(c.choices[0].delta.content or '' for c in chunks) == want.text
  assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == len(want.tokens)
  with pytest.raises(openai.BadRequestError, match='top_logprobs'):
    served.keyed.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=2)


def test_chat_without_a_template_is_400(served):
  with pytest.raises(openai.BadRequestError, match='no chat template') as e:
    served.client.chat.completions.create(model=NAME, messages=[{'role': 'user', 'content': 'Hi'}], max_tokens=4)
  assert e.value.status_code == 400


# ---------------------------------------------------------------- other routes, security, errors


def test_models_health_metrics(served):
  models = served.client.models.list()
  assert [m.id for m in models.data] == [NAME]
  assert httpx.get(f'{served.open_url}/health').json() == {'status': 'ok'}
  served.client.completions.create(model=NAME, prompt='a b a b a b a b', max_tokens=6, temperature=0)  # it drafts
  text = httpx.get(f'{served.open_url}/metrics').text
  for name in (
      'specjax_time_to_first_token_seconds_bucket{le="+Inf"}',
      'specjax_inter_token_latency_seconds_count',
      'specjax_request_latency_seconds_sum',
      'specjax_generation_tokens_total',
      'specjax_prompt_tokens_total',
      'specjax_generation_tokens_per_second',
      'specjax_tau{drafter="ngram"}',
      'specjax_position_acceptance{drafter="ngram",position="1"}',
      'specjax_position_drafted_total{drafter="ngram",position="2"}',
      'specjax_live_slots',
      'specjax_free_pages',
      'specjax_preemptions_total',
      'specjax_requests_total{finish_reason="length"}',
      'specjax_prefix_cache_hits_total',
      'specjax_prefix_cache_queries_total',
      'specjax_prefix_cache_pages',
      'specjax_prefix_cache_evictions_total',
  ):
    assert name in text, name
  sample = re.compile(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eInf]+')
  for line in text.splitlines():
    assert line.startswith('# ') or sample.fullmatch(line), line


def test_api_key(served):
  body = {'prompt': PROMPT, 'max_tokens': 2}
  before = served.counts()
  for headers in ({}, {'Authorization': 'Bearer wrong'}, {'Authorization': KEY}):
    r = httpx.post(f'{served.keyed_url}/v1/completions', json=body, headers=headers)
    assert error_of(r, 401)['type'] == 'authentication_error'
  assert httpx.get(f'{served.keyed_url}/metrics').status_code == 401
  assert httpx.get(f'{served.keyed_url}/v1/models').status_code == 401
  assert httpx.get(f'{served.keyed_url}/health').status_code == 200
  bad = openai.OpenAI(base_url=f'{served.keyed_url}/v1', api_key='wrong', max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    bad.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
  assert served.counts() == before
  assert served.keyed.models.list().data[0].id == NAME


def test_bad_requests_schedule_nothing(served):
  url = f'{served.open_url}/v1/completions'
  before = served.counts()
  r = httpx.post(url, content=b'{"prompt": "x", "max_tokens": ', headers={'Content-Type': 'application/json'})
  assert 'JSON' in error_of(r, 400)['message']
  assert error_of(httpx.post(url, json={'prompt': 'x', 'max_tokens': 'ten'}), 400)['param'] == 'max_tokens'
  assert error_of(httpx.post(url, json={'prompt': 3}), 400)['param'] == 'prompt'
  assert error_of(httpx.post(url, json={'max_tokens': 3}), 400)['param'] == 'prompt'
  assert error_of(httpx.post(url, json={'prompt': ''}), 400)['param'] == 'prompt'
  assert error_of(httpx.post(url, json={'prompt': [1, 99999]}), 400)['param'] == 'prompt'
  assert error_of(httpx.post(url, json={'prompt': 'x', 'max_tokens': 0}), 400)['param'] == 'max_tokens'
  with pytest.raises(openai.BadRequestError, match='temperature') as e:
    served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=-1, n=3)
  assert e.value.body['param'] == 'temperature'
  for field in ({'top_p': 0.0}, {'seed': -5}, {'stop': ['']}, {'logprobs': 2}, {'presence_penalty': 0.5}):
    assert error_of(httpx.post(url, json={'prompt': 'x', **field}), 400)['param'] == next(iter(field))
  with pytest.raises(openai.BadRequestError, match='capacity') as e:
    served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_SEQ_LEN, n=2)
  assert e.value.body['code'] == 'context_length_exceeded'
  with pytest.raises(openai.NotFoundError) as e:
    served.client.completions.create(model='gpt-4o', prompt=PROMPT, max_tokens=2)
  assert e.value.body['code'] == 'model_not_found'
  assert error_of(httpx.post(url, content=b'x' * (BODY_LIMIT + 1)), 413)['code'] == 'request_too_large'
  chunked = (b'{"prompt": "' + b'x' * 1000 for _ in range(BODY_LIMIT // 1000 + 1))  # no Content-Length
  assert error_of(httpx.post(url, content=chunked), 413)['code'] == 'request_too_large'
  assert error_of(httpx.get(f'{served.open_url}/v1/nothing'), 404)
  assert served.counts() == before


def test_disconnect_mid_stream_frees_the_slot(served):
  before = served.scheduler.metrics()['requests_cancelled']
  body = {'prompt': PROMPT, 'max_tokens': MAX_SEQ_LEN - 16, 'temperature': 0, 'ignore_eos': True, 'stream': True}
  body['n'] = 2
  with httpx.stream('POST', f'{served.open_url}/v1/completions', json=body, timeout=120) as r:
    next(r.iter_lines())  # the first chunk: both choices are running
  deadline = time.monotonic() + 5
  while time.monotonic() < deadline:
    m = served.scheduler.metrics()
    if m['live_slots'] == 0 and m['requests_cancelled'] == before + 2:
      break
    time.sleep(0.02)
  assert m['live_slots'] == 0 and m['waiting'] == 0
  assert m['requests_cancelled'] == before + 2  # cut short, not finished


# ---------------------------------------------------------------- the command


def test_serve_command(capsys):
  from specjax import cli

  assert cli.main(['serve', '-m', TINY, '--no-spec', '--drafter', 'ngram']) == 2
  assert capsys.readouterr().err.startswith('error: --no-spec')
  sock = socket.socket()
  sock.bind(('127.0.0.1', 0))
  port = sock.getsockname()[1]
  sock.close()
  env = {**os.environ, 'SPECJAX_API_KEY': KEY}
  cmd = [sys.executable, '-m', 'specjax.cli', 'serve', '-m', TINY, '--port', str(port), '--max-seq-len', '64']
  proc = subprocess.Popen(
      cmd + ['--page-size', '4', '--no-prefix-cache', '--max-slots', '2'],  # warms up every executable of 2 slots
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      env=env,
      text=True,
  )
  try:
    line = proc.stdout.readline()
    assert f'http://127.0.0.1:{port}/v1' in line, (line, proc.stderr.read() if proc.poll() is not None else '')
    assert 'prefix cache off' in line, line
    deadline = time.monotonic() + 30
    while True:
      try:
        r = httpx.get(f'http://127.0.0.1:{port}/v1/models', headers={'Authorization': f'Bearer {KEY}'})
        break
      except httpx.ConnectError:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    assert r.json()['data'][0]['id'] == TINY  # the served name defaults to -m as given
    assert httpx.get(f'http://127.0.0.1:{port}/v1/models').status_code == 401  # the key from SPECJAX_API_KEY
    proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn stops, then the scheduler
    assert proc.wait(timeout=30) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
