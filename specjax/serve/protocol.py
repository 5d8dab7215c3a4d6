"""The OpenAI-compatible request bodies (pydantic) and error objects of `specjax serve`.

Bodies validate strictly (a string where a number belongs is an error, not a conversion); fields a client may
send that specjax does not implement are accepted when they ask for nothing (`presence_penalty: 0`) and refused
otherwise (`unsupported`). Unknown fields are ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import pydantic

MAX_CHOICES = 128  # n (times the prompts of a batch) a request may ask for


class APIError(Exception):
  """An OpenAI error object: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

  def __init__(self, status: int, message: str, *, type: str = 'invalid_request_error', param=None, code=None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

  def body(self) -> dict:
    return {'error': {'message': self.message, 'type': self.type, 'param': self.param, 'code': self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


class _Body(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra='ignore')


class Speculative(_Body):
  """`speculative`: `{"enabled": false}` decodes without drafts, `{"num_draft": K}` caps the draft depth at K."""

  enabled: bool = True
  num_draft: int | None = pydantic.Field(default=None, ge=0)

  def num_draft_for_request(self) -> int | None:
    """`Request.num_draft`: None (the server's policy), 0 (off) or K."""
    if not self.enabled:
      if self.num_draft:
        raise bad_request('speculative: num_draft > 0 with enabled false', 'speculative.num_draft')
      return 0
    return self.num_draft


class StreamOptions(_Body):
  include_usage: bool = False


class JsonSchemaFormat(_Body):
  name: str | None = None
  description: str | None = None
  schema_: dict[str, Any] | bool | None = pydantic.Field(default=None, alias='schema')
  strict: bool | None = None


class ResponseFormat(_Body):
  """`response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": ...}}` or
  `{"type": "text"}` (unconstrained); constrained decoding through `specjax.grammar`."""

  type: Literal['text', 'json_object', 'json_schema']
  json_schema: JsonSchemaFormat | None = None

  def constraint(self) -> dict[str, Any]:
    """The `SamplingParams` fields it sets."""
    if self.type == 'json_object':
      return {'json_object': True}
    if self.type == 'json_schema':
      if self.json_schema is None or self.json_schema.schema_ is None:
        raise bad_request('response_format json_schema needs json_schema.schema', 'response_format')
      return {'json_schema': json.dumps(self.json_schema.schema_)}
    return {}


class _Sampling(_Body):
  """What completions and chat completions share."""

  model: str | None = None  # None: the served model
  temperature: float = 1.0  # OpenAI's default; 0 is greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 (or -1) = off
  min_p: float = 0.0
  seed: int | None = None  # None: a random seed per request
  n: int = pydantic.Field(default=1, ge=1, le=MAX_CHOICES)
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  ignore_eos: bool = False
  speculative: Speculative | None = None
  response_format: ResponseFormat | None = None
  user: str | None = None
  # OpenAI fields specjax accepts only at their no-op values.
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None

  def stops(self) -> tuple[str, ...]:
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if any(not s for s in stops):
      raise bad_request('stop strings must not be empty', 'stop')
    return tuple(stops)

  def check_supported(self) -> None:
    for name in ('presence_penalty', 'frequency_penalty'):
      if getattr(self, name):
        raise unsupported(name)
    if self.logit_bias:
      raise unsupported('logit_bias')

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


def unsupported(param: str, what: str | None = None) -> APIError:
  return bad_request(f'{what or param} is not supported by specjax serve', param, 'unsupported')


class CompletionRequest(_Sampling):
  """`POST /v1/completions`: `prompt` is a string, token ids, or a batch of either."""

  prompt: str | list[int] | list[str] | list[list[int]]
  max_tokens: int | None = 16  # OpenAI's default; None: what fits in the model's capacity
  logprobs: int | None = pydantic.Field(default=None, ge=0)  # 0: the chosen token's; N > 0 (top-N) is refused
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None

  def check_supported(self) -> None:
    super().check_supported()
    if self.logprobs:
      raise unsupported('logprobs', 'logprobs > 0 (top alternatives; logprobs=0 gives the chosen tokens)')
    if self.echo:
      raise unsupported('echo')
    if self.suffix:
      raise unsupported('suffix')
    if self.best_of not in (None, self.n):
      raise unsupported('best_of', 'best_of other than n')

  @property
  def wants_logprobs(self) -> bool:
    return self.logprobs is not None

  def prompts(self) -> list[str | list[int]]:
    """The batch: one prompt per entry (a string or token ids)."""
    p = self.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
      return [p]
    if not p:
      raise bad_request('prompt is empty', 'prompt')
    return list(p)


class TextPart(_Body):
  type: Literal['text']
  text: str


class Message(_Body):
  role: Literal['system', 'developer', 'user', 'assistant']
  content: str | list[TextPart] | None = None
  name: str | None = None

  def text(self) -> str:
    if isinstance(self.content, list):
      return ''.join(part.text for part in self.content)
    return self.content or ''


class ChatCompletionRequest(_Sampling):
  """`POST /v1/chat/completions`: messages rendered through the model's chat template."""

  messages: list[Message] = pydantic.Field(min_length=1)
  max_tokens: int | None = None  # None: what fits in the model's capacity
  max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(default=None, ge=0)
  tools: list[Any] | None = None
  response_format: dict[str, Any] | None = None

  def check_supported(self) -> None:
    super().check_supported()
    if self.top_logprobs:
      raise unsupported('top_logprobs', 'top_logprobs > 0 (only the chosen token has a logprob)')
    if self.tools:
      raise unsupported('tools')
    if self.response_format and self.response_format.get('type') not in (None, 'text'):
      raise unsupported('response_format', 'response_format other than text')

  @property
  def wants_logprobs(self) -> bool:
    return self.logprobs

  @property
  def token_budget(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_TYPE_TAG = re.compile(r'str|int|float|bool|[A-Z].*|.*[\[\-].*')  # pydantic's names of a union's members


def validation_error(e: pydantic.ValidationError) -> APIError:
  """A pydantic error as a 400: the first problem, with its field as `param`."""
  err = e.errors(include_url=False)[0]
  if err['type'] == 'json_invalid':
    return bad_request(f'the body is not valid JSON: {err["ctx"]["error"] if "ctx" in err else err["msg"]}')
  loc = [str(x) for x in err['loc'] if not _TYPE_TAG.fullmatch(str(x))]  # union members' tags dropped
  param = '.'.join(loc) or None
  if err['type'] == 'missing':
    return bad_request(f'{param} is required', param)
  # A union field: every member failed; name them (str, list[int], ...) rather than the first one's complaint.
  tags = []
  for other in e.errors(include_url=False):
    path = [str(x) for x in other['loc']]
    if [x for x in path if not _TYPE_TAG.fullmatch(x)] == loc or path[: len(loc)] == loc:
      tag = next((x for x in path[len(loc) :] if _TYPE_TAG.fullmatch(x)), None)
      if tag and tag not in tags:
        tags.append(tag)
  if len(tags) > 1:
    return bad_request(f'{param or "body"}: should be one of {", ".join(tags)}', param)
  return bad_request(f'{param or "body"}: {err["msg"]}', param)
