"""The OpenAI-compatible HTTP API over a running `Scheduler`, as a FastAPI app.

Handlers never touch the device: they tokenize, check the request, `scheduler.submit(request, loop=...)` each
choice and read its events with `async for`. Everything a client can get wrong is refused (an OpenAI error
object) before any choice is submitted. A client that goes away cancels its choices (their slots free at the
scheduler's next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import secrets
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator

import fastapi
import pydantic
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specjax.engine.requests import Event, Request, RequestHandle
from specjax.errors import SpecjaxError
from specjax.grammar import compile_constraint
from specjax.sampling import MAX_SEED, SamplingParams
from specjax.serve.metrics import CONTENT_TYPE, ServeMetrics
from specjax.serve.protocol import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    validation_error,
)

if TYPE_CHECKING:
  from specjax.engine.scheduler import Scheduler

_CHECKPOINT_TEMPLATE = object()  # chat_template default: the one the model's checkpoint carries


def app(
    scheduler: Scheduler,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    max_body_bytes: int = 1_000_000,
    chat_template: str | None | object = _CHECKPOINT_TEMPLATE,
) -> fastapi.FastAPI:
  """The ASGI app serving `scheduler` (started by the caller, e.g. `Scheduler(engine).start()`).

  Args:
    scheduler: the running scheduler; the app only submits to it and reads its streams.
    api_key: when set, every route but `/health` needs `Authorization: Bearer <api_key>` (else 401).
    model_name: the `model` clients name (default: the checkpoint's directory or file name).
    max_body_bytes: larger request bodies are refused with 413.
    chat_template: a jinja chat template instead of the checkpoint's (None: chat completions are refused).
  """
  server = _Server(scheduler, model_name, chat_template)
  api = fastapi.FastAPI(title='specjax', version='0.1.0')
  api.state.server = server
  api.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=server.metrics)

  async def api_error(request, e: APIError):
    server.metrics.rejected += e.status < 500
    return JSONResponse(e.body(), status_code=e.status)

  async def http_error(request, e: HTTPException):  # unknown routes, wrong methods
    err = APIError(e.status_code, str(e.detail), code='not_found' if e.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, 'headers', None))

  api.add_exception_handler(APIError, api_error)
  api.add_exception_handler(HTTPException, http_error)

  async def read(request: fastapi.Request, model: type[pydantic.BaseModel]):
    """The body, at most `max_body_bytes`, validated as `model`."""
    data, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > max_body_bytes:
        raise _too_large(max_body_bytes)
      data.append(chunk)
    try:
      return model.model_validate_json(b''.join(data))
    except pydantic.ValidationError as e:
      raise validation_error(e) from None

  @api.get('/health')
  async def health():
    if server.failed():
      return JSONResponse({'status': 'error', 'error': server.failed()}, status_code=503)
    return {'status': 'ok'}

  @api.get('/v1/models')
  async def models():
    return {'object': 'list', 'data': [server.model_card()]}

  @api.get('/v1/models/{name:path}')
  async def model(name: str):
    server.check_model(name)
    return server.model_card()

  @api.get('/metrics')
  async def metrics():
    return Response(server.metrics.render(scheduler.metrics()), media_type=CONTENT_TYPE)

  @api.post('/v1/completions', openapi_extra=_body_schema(CompletionRequest))
  async def completions(request: fastapi.Request):
    body = await read(request, CompletionRequest)
    server.check(body)
    prompts = []
    for p in body.prompts():
      if not p:
        raise bad_request('prompt is empty: give the text (or token ids) to continue', 'prompt')
      try:
        prompts += server.engine.encode([p])
      except SpecjaxError as e:
        raise bad_request(str(e), 'prompt') from None
    return await server.respond(request, body, prompts, body.max_tokens, chat=False)

  @api.post('/v1/chat/completions', openapi_extra=_body_schema(ChatCompletionRequest))
  async def chat_completions(request: fastapi.Request):
    body = await read(request, ChatCompletionRequest)
    server.check(body)
    return await server.respond(request, body, [server.chat_ids(body)], body.token_budget, chat=True)

  return api


class _Server:
  """The state behind the routes: the scheduler, the served name, the chat formatter, the metrics."""

  def __init__(self, scheduler: Scheduler, model_name: str | None, chat_template):
    self.scheduler = scheduler
    self.engine = scheduler.engine
    self.tokenizer = self.engine.model.tokenizer
    source = str(self.engine.model.source)
    self.model_name = model_name or os.path.basename(source.rstrip('/\\')) or source
    self.created = int(time.time())
    self.metrics = ServeMetrics()
    self._template = chat_template
    self._formatter = None

  def model_card(self) -> dict:
    return {
        'id': self.model_name,
        'object': 'model',
        'created': self.created,
        'owned_by': 'specjax',
        'max_model_len': self.scheduler.max_seq_len,
        'drafter': self.engine.drafter.name if self.engine.drafter else None,
    }

  def failed(self) -> str | None:
    """Why the scheduler thread stopped, when it did (the server then answers 503)."""
    error = getattr(self.scheduler, 'error', None)
    return None if error is None else f'{type(error).__name__}: {error}'

  def check_model(self, name: str | None) -> None:
    if name is not None and name != self.model_name:
      raise APIError(
          404,
          f'the model {name!r} does not exist; this server serves {self.model_name!r}',
          param='model',
          code='model_not_found',
      )

  def check(self, body) -> None:
    self.check_model(body.model)
    body.check_supported()

  # -- chat

  def formatter(self):
    if self._formatter is None:
      from specjax.train.data import Formatter, chat_template

      template = self._template
      if template is _CHECKPOINT_TEMPLATE:
        template = chat_template(str(self.engine.model.source))
      if not template:
        raise bad_request(
            'this model has no chat template: use /v1/completions, or serve it with one', 'messages', 'no_chat_template'
        )
      try:
        self._formatter = Formatter(self.tokenizer, template)
      except SpecjaxError as e:
        raise bad_request(str(e), 'messages') from None
    return self._formatter

  def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
    """The messages through the chat template, with the assistant's generation prompt, as token ids."""
    import jinja2

    fmt = self.formatter()
    messages = [('system' if m.role == 'developer' else m.role, m.text()) for m in body.messages]
    try:
      return fmt.encode(fmt.render(messages, generation_prompt=True))[0]
    except (SpecjaxError, jinja2.TemplateError) as e:
      raise bad_request(f'the chat template cannot render these messages: {e}', 'messages') from None

  # -- generation

  def requests(self, body, prompts: list[list[int]], max_tokens: int | None) -> list[Request]:
    """One `Request` per choice (prompt-major: choice index = prompt * n + j, seq_id j), all checked."""
    top_k = 0 if body.top_k == -1 else body.top_k
    seed = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed
    constraint = body.response_format.constraint() if body.response_format else {}
    sampling = SamplingParams(body.temperature, top_k, body.top_p, body.min_p, seed, **constraint)
    try:
      sampling.validate()
    except SpecjaxError as e:
      field = re.match(r'sampling (\w+) ', str(e))
      raise bad_request(str(e), field and field.group(1)) from None
    if sampling.constraint is not None:
      try:
        compile_constraint(self.engine.model, sampling.constraint)
      except SpecjaxError as e:
        raise bad_request(str(e), 'response_format') from None
    num_draft = body.speculative.num_draft_for_request() if body.speculative else None
    if num_draft is not None:
      try:
        self.engine.check_depth(num_draft)
      except SpecjaxError as e:
        raise bad_request(str(e), 'speculative.num_draft') from None
    stops = body.stops()
    if max_tokens is not None and max_tokens < 1:
      raise bad_request(f'max_tokens must be at least 1, got {max_tokens}', 'max_tokens')
    if len(prompts) * body.n > MAX_CHOICES:
      raise bad_request(f'{len(prompts)} prompts x n={body.n} is over {MAX_CHOICES} choices per request', 'n')
    cap, ahead, out = self.scheduler.max_seq_len, getattr(self.scheduler, 'lookahead', 0), []
    for ids in prompts:
      budget = cap - ahead - len(ids) if max_tokens is None else max_tokens
      if budget < 1:
        raise bad_request(
            f'the prompt ({len(ids)} tokens) fills the capacity of one request ({cap} tokens'
            + (f', {ahead} of them draft lookahead)' if ahead else ')'),
            'messages' if isinstance(body, ChatCompletionRequest) else 'prompt',
            'context_length_exceeded',
        )
      if len(ids) + budget + ahead > cap:
        raise bad_request(
            f'prompt ({len(ids)} tokens) + max_tokens ({budget})'
            + (f' + draft lookahead ({ahead})' if ahead else '')
            + f' is over the capacity of one request ({cap} tokens)',
            'max_tokens',
            'context_length_exceeded',
        )
      for j in range(body.n):
        out.append(
            Request(
                prompt=list(ids),
                max_tokens=budget,
                sampling=sampling,
                num_draft=num_draft,
                stop=stops,
                seq_id=j,
                logprobs=body.wants_logprobs,
                ignore_eos=body.ignore_eos,
            )
        )
    check = getattr(self.scheduler, 'check', None)  # the scheduler's own checks, for every choice before any runs
    for r in out if check else ():
      try:
        check(r)
      except SpecjaxError as e:
        raise bad_request(str(e)) from None
    return out

  def submit(self, requests: list[Request]) -> list[RequestHandle]:
    """Submits every choice, or none: a refused one cancels those before it."""
    loop, handles = asyncio.get_running_loop(), []
    if self.failed():
      raise _unavailable(self.failed())
    try:
      for r in requests:
        handles.append(self.scheduler.submit(r, loop=loop))
    except SpecjaxError as e:
      for h in handles:
        h.cancel()
      raise bad_request(str(e)) from None
    return handles

  async def respond(self, request: fastapi.Request, body, prompts, max_tokens, *, chat: bool):
    requests = self.requests(body, prompts, max_tokens)
    handles = self.submit(requests)
    out = _Output(self, body, prompts, handles, chat)
    if body.stream:
      return _EventStream(out)
    gone = asyncio.ensure_future(_disconnect(request))
    collect = asyncio.ensure_future(out.collect())
    try:
      await asyncio.wait({gone, collect}, return_when=asyncio.FIRST_COMPLETED)
      if not collect.done():  # the client went away: nobody reads the answer
        return Response(status_code=499)
      answer = collect.result()
      if any(c['finish_reason'] == 'error' for c in answer['choices']):
        raise _unavailable(self.failed() or 'the request failed')
      return JSONResponse(answer)
    finally:
      for task in (gone, collect):
        task.cancel()
      out.cancel_unfinished()


class _Output:
  """The choices of one response: their events merged, timed, and written as OpenAI objects."""

  def __init__(self, server: _Server, body, prompts, handles: list[RequestHandle], chat: bool):
    self.server, self.body, self.handles, self.chat = server, body, handles, chat
    self.prompt_tokens = sum(len(p) for p in prompts)
    self.id = f'{"chatcmpl" if chat else "cmpl"}-{uuid.uuid4().hex}'
    self.created = int(time.time())
    self.object = 'chat.completion' if chat else 'text_completion'
    self.timers = [server.metrics.timer(h.stats.submitted) for h in handles]
    self.completion_tokens = 0
    self.cancelled = set()  # choices this response cancelled

  def cancel_unfinished(self) -> None:
    for i, h in enumerate(self.handles):
      if not h.done.is_set() and i not in self.cancelled:
        h.cancel()
        self.cancelled.add(i)
        with self.server.metrics.lock:
          self.server.metrics.finished['cancelled'] += 1

  async def events(self) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every choice as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle):
      try:
        async for event in handle:
          queue.put_nowait((i, event))
      except BaseException as e:  # noqa: BLE001 (the reader raises it)
        queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(self.handles)]
    try:
      left = len(tasks)
      while left:
        i, event = await queue.get()
        if isinstance(event, BaseException):
          raise event
        self.timers[i](event)
        self.completion_tokens += len(event.tokens)
        left -= event.finish_reason is not None
        yield i, event
    finally:
      for task in tasks:
        task.cancel()

  def logprobs(self, tokens: list[int], logprobs: list[float] | None, offset: int = 0):
    """The chosen tokens' log-probabilities in the OpenAI shape of this endpoint (None: not asked for)."""
    if not self.body.wants_logprobs:
      return None
    pieces = [self.server.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    values = list(logprobs or [])
    if self.chat:
      return {
          'content': [
              {'token': s, 'logprob': lp, 'bytes': list(s.encode()), 'top_logprobs': []}
              for s, lp in zip(pieces, values)
          ],
          'refusal': None,
      }
    offsets = []
    for s in pieces:
      offsets.append(offset)
      offset += len(s)
    return {'tokens': pieces, 'token_logprobs': values, 'top_logprobs': None, 'text_offset': offsets}

  def usage(self) -> dict:
    return {
        'prompt_tokens': self.prompt_tokens,
        'completion_tokens': self.completion_tokens,
        'total_tokens': self.prompt_tokens + self.completion_tokens,
    }

  async def collect(self) -> dict:
    n = len(self.handles)
    text, tokens, lps, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    async for i, event in self.events():
      text[i].append(event.text)
      tokens[i] += event.tokens
      lps[i] += event.logprobs or []
      reasons[i] = event.finish_reason
    choices = []
    for i in range(n):
      content, logprobs = ''.join(text[i]), self.logprobs(tokens[i], lps[i])
      if self.chat:
        message = {'role': 'assistant', 'content': content}
        choices.append({'index': i, 'message': message, 'logprobs': logprobs, 'finish_reason': reasons[i]})
      else:
        choices.append({'index': i, 'text': content, 'logprobs': logprobs, 'finish_reason': reasons[i]})
    return {
        'id': self.id,
        'object': self.object,
        'created': self.created,
        'model': self.server.model_name,
        'choices': choices,
        'usage': self.usage(),
        'system_fingerprint': None,
    }

  def chunk(self, choices: list[dict], usage=None) -> str:
    obj = {
        'id': self.id,
        'object': 'chat.completion.chunk' if self.chat else 'text_completion',
        'created': self.created,
        'model': self.server.model_name,
        'choices': choices,
        'system_fingerprint': None,
    }
    if self.body.include_usage:
      obj['usage'] = usage
    return f'data: {json.dumps(obj, ensure_ascii=False)}\n\n'

  async def sse(self) -> AsyncIterator[str]:
    """Server-sent events: one chunk per event that carries something, usage last if asked, then [DONE]."""
    try:
      if self.chat:
        for i in range(len(self.handles)):
          delta = {'role': 'assistant', 'content': ''}
          yield self.chunk([{'index': i, 'delta': delta, 'logprobs': None, 'finish_reason': None}])
      offsets = [0] * len(self.handles)
      async for i, event in self.events():
        if not (event.text or event.finish_reason or (self.body.wants_logprobs and event.tokens)):
          continue  # tokens of an unfinished character: their text comes with a later event
        if event.finish_reason == 'error':  # the scheduler stopped: an error object, then the end
          err = _unavailable(self.server.failed() or 'the request failed')
          yield f'data: {json.dumps(err.body())}\n\n'
          break
        logprobs = self.logprobs(event.tokens, event.logprobs, offsets[i])
        offsets[i] += sum(len(s) for s in (logprobs or {}).get('tokens', []))
        if self.chat:
          delta = {'content': event.text} if event.text else {}
          choice = {'index': i, 'delta': delta, 'logprobs': logprobs, 'finish_reason': event.finish_reason}
        else:
          choice = {'index': i, 'text': event.text, 'logprobs': logprobs, 'finish_reason': event.finish_reason}
        yield self.chunk([choice])
      if self.body.include_usage:
        yield self.chunk([], self.usage())
      yield 'data: [DONE]\n\n'
    finally:  # normal end, a client that went away (cancelled or closed), or an error
      self.cancel_unfinished()


class _EventStream(StreamingResponse):
  """The SSE response of one `_Output`; however it ends (done, the client gone, an error), its unfinished
  choices are cancelled. (The generator's own `finally` runs only once it is closed, which a response cancelled
  mid-send leaves to the garbage collector.)"""

  def __init__(self, output: _Output):
    super().__init__(
        output.sse(), media_type='text/event-stream', headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'}
    )
    self.output = output

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.output.cancel_unfinished()


async def _disconnect(request: fastapi.Request) -> None:
  """Returns when the client closes the connection (the body is already read)."""
  while (await request.receive())['type'] != 'http.disconnect':
    pass


def _unavailable(why: str) -> APIError:
  return APIError(503, f'the scheduler stopped: {why}', type='server_error', code='scheduler_stopped')


def _too_large(limit: int) -> APIError:
  return APIError(413, f'the request body is over {limit} bytes', code='request_too_large')


def _body_schema(model: type[pydantic.BaseModel]) -> dict:
  """The body's JSON schema for /docs (the handler reads and validates the body itself)."""
  return {'requestBody': {'content': {'application/json': {'schema': model.model_json_schema()}}, 'required': True}}


class _Guard:
  """ASGI middleware: the API key (every path but /health) and a declared body size over the limit."""

  def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: ServeMetrics):
    self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    headers = {k.lower(): v for k, v in scope['headers']}
    err = None
    if self.api_key and scope['path'] != '/health':
      scheme, _, token = headers.get(b'authorization', b'').decode('latin-1').partition(' ')
      if scheme.lower() != 'bearer' or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
        err = APIError(
            401,
            'missing or wrong API key: send Authorization: Bearer <key>',
            type='authentication_error',
            code='invalid_api_key',
        )
    length = headers.get(b'content-length')
    if err is None and length is not None:
      if not length.strip().isdigit():
        err = bad_request('the Content-Length header is not a number')
      elif int(length) > self.max_body_bytes:
        err = _too_large(self.max_body_bytes)
    if err is None:
      return await self.app(scope, receive, send)
    self.metrics.rejected += 1
    headers = {'WWW-Authenticate': 'Bearer'} if err.status == 401 else None
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)
