"""Logits -> sampling distribution, and seeded per-row draws.

The speculative verifier applies `transform_logits` / `probs` to the target
and the draft logits alike, so both sides see exactly the same distribution.

Order and semantics follow HF transformers' warpers (temperature, top-k,
top-p, min-p), with masked entries set to -inf:
- top-k keeps every token whose logit is >= the k-th largest (ties kept).
- top-p keeps token x iff the probability mass of tokens ranked strictly
  before it (descending) is < top_p: the smallest top set reaching top_p.
  On exact ties at the boundary all tied tokens are kept (HF keeps whichever
  subset its unstable sort puts first); elsewhere the kept sets agree
  (checked against transformers 5.24, V up to 262144).
- min-p keeps tokens with prob >= min_p * max prob (computed after top-k/p).
The top token always survives. temperature == 0 is greedy (one-hot argmax,
first index on ties).

Draws use the Gumbel-max trick, `argmax(logits + Gumbel noise)`, one typed
PRNG key per row (`jax.random.key`, dtype `key<fry>`; raw uint32 [..., 2] key
data is accepted and wrapped). `row_keys` derives a row's key from (seed,
stream, sequence id, absolute position) with `fold_in`, so a sequence's draws
do not depend on batch composition or padding.
"""

from collections.abc import Callable
import dataclasses
import json
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError

MAX_SEED = 2**31 - 1

# Independent random streams at one position (`row_keys(..., stream)`).
# Drafters draw with STREAM_SAMPLE too ("coupled" drafting: the Gumbel noise a
# plain sampler would use at that position). Exactness of the verifier only
# needs x_i ~ q_i and the accept / residual draws independent of it, which
# holds; in exchange a drafter whose q equals p reproduces autoregressive
# sampling token for token.
STREAM_SAMPLE = 0  # plain sampling, drafts, bonus and match draws
STREAM_ACCEPT = 2  # accept-test uniforms
STREAM_RESIDUAL = 3  # residual draws after a rejection
STREAM_TREE = 4  # children of draft-tree nodes (apart from every draw the verifier makes)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings; hashable, so usable as a static jit argument."""

  temperature: float = 0.0  # 0 = greedy.
  top_k: int = 0  # 0 = off.
  top_p: float = 1.0  # 1 = off.
  min_p: float = 0.0  # 0 = off.
  seed: int = 0
  # Constrained decoding (`specjax.grammar`), at most one: a JSON Schema (a dict or its JSON text), a regex, a
  # Lark grammar (llguidance's dialect; GBNF is converted), or any JSON object. The engine compiles it per request
  # and keeps it out of the jitted step (`unconstrained`).
  json_schema: Any = None
  regex: str | None = None
  grammar: str | None = None
  json_object: bool = False

  def __post_init__(self):
    if isinstance(self.json_schema, dict):  # frozen and hashable: keep the schema as JSON text (key order kept:
      object.__setattr__(self, 'json_schema', json.dumps(self.json_schema))  # properties are generated in it)

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def constraint(self) -> tuple[str, str] | None:
    """(kind, source) of the request's constraint: ('json_schema' | 'regex' | 'grammar', text) or
    ('json_schema', '{"type": "object"}') for `json_object`; None when unconstrained."""
    given = [(k, getattr(self, k)) for k in ('json_schema', 'regex', 'grammar') if getattr(self, k) is not None]
    if self.json_object:
      given.append(('json_schema', '{"type": "object"}'))
    return given[0] if given else None

  def unconstrained(self) -> 'SamplingParams':
    """These settings without the constraint: what the jitted steps take as a static argument."""
    return dataclasses.replace(self, json_schema=None, regex=None, grammar=None, json_object=False)

  def validate(self) -> 'SamplingParams':
    """Returns self, or raises SpecjaxError naming the bad field."""

    def bad(name, want):
      value = getattr(self, name)
      return SpecjaxError(f'sampling {name} must be {want}, got {value!r}')

    for name in ('temperature', 'top_p', 'min_p'):
      value = getattr(self, name)
      if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(name, 'a finite number')
    for name in ('top_k', 'seed'):
      if not isinstance(getattr(self, name), numbers.Integral) or isinstance(getattr(self, name), bool):
        raise bad(name, 'an integer')
    if self.temperature < 0:
      raise bad('temperature', '>= 0 (0 = greedy)')
    if self.top_k < 0:
      raise bad('top_k', '>= 0 (0 = off)')
    if not 0 < self.top_p <= 1:
      raise bad('top_p', 'in (0, 1] (1 = off)')
    if not 0 <= self.min_p < 1:
      raise bad('min_p', 'in [0, 1) (0 = off)')
    if not 0 <= self.seed <= MAX_SEED:
      raise bad('seed', f'in [0, {MAX_SEED}]')
    kinds = [k for k in ('json_schema', 'regex', 'grammar') if getattr(self, k) is not None]
    kinds += ['json_object'] if self.json_object else []
    if len(kinds) > 1:
      raise SpecjaxError(f'one constraint per request: got {" and ".join(kinds)}')
    for name in ('json_schema', 'regex', 'grammar'):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
        raise bad(name, 'text' + (' or a dict' if name == 'json_schema' else ''))
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Each row's own sampling settings, as arrays: a batch that mixes requests (the scheduler's slots).

  Accepted wherever a `SamplingParams` is: the functions below apply row b's
  settings to row b of `logits` (its leading axis). `is_greedy` is static:
  True when every row is greedy (the greedy executables); rows with
  temperature 0 in a mixed batch still draw their argmax.
  """

  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32, 1 = off
  min_p: jax.Array  # [B] float32, 0 = off
  seed: jax.Array  # [B] int32
  is_greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def validate(self) -> 'RowSampling':
    return self  # each request's SamplingParams is validated when it is submitted

  @classmethod
  def of(cls, params: 'list[SamplingParams]', is_greedy: bool = False) -> 'RowSampling':
    """Host arrays for a list of per-row settings (`is_greedy` stays False unless given: states keep it so)."""
    col = lambda name, dtype: np.asarray([getattr(p, name) for p in params], dtype)
    return cls(
        col('temperature', np.float32),
        col('top_k', np.int32),
        col('top_p', np.float32),
        col('min_p', np.float32),
        col('seed', np.int32),
        is_greedy,
    )


def _rows(x: jax.Array, like: jax.Array) -> jax.Array:  # [B] -> [B, 1, ..., 1] (like's rank)
  if x.shape[0] != like.shape[0]:
    raise ValueError(f'per-row settings for {x.shape[0]} rows, logits {like.shape}')
  return x.reshape(x.shape + (1,) * (like.ndim - 1))


def _transform_rows(logits: jax.Array, params: RowSampling) -> jax.Array:
  """`transform_logits` with row b's settings on logits[b]."""
  vocab = logits.shape[-1]
  greedy = _rows(params.temperature, logits) == 0
  top = _keep(logits, jnp.arange(vocab) == argmax(logits)[..., None])
  logits = logits / jnp.where(greedy, 1.0, _rows(params.temperature, logits))
  top_k = jnp.where((params.top_k > 0) & (params.top_k < vocab), params.top_k, vocab)
  cut_k = lambda x: _top_k(x, _rows(top_k, x))
  logits = jax.lax.cond(jnp.any(top_k < vocab), cut_k, lambda x: x, logits)
  top_p = _rows(params.top_p, logits)
  cut_p = lambda x: jnp.where(top_p < 1.0, _top_p(x, top_p), x)
  logits = jax.lax.cond(jnp.any(params.top_p < 1.0), cut_p, lambda x: x, logits)
  min_p = _rows(params.min_p, logits)
  probs_ = jax.nn.softmax(logits, axis=-1)
  logits = _keep(logits, (min_p <= 0.0) | (probs_ >= min_p * probs_.max(-1, keepdims=True)))
  return jnp.where(greedy, top, logits)


def _keep(logits: jax.Array, keep: jax.Array) -> jax.Array:
  return jnp.where(keep, logits, -jnp.inf)


def argmax(x: jax.Array) -> jax.Array:  # [..., V] -> [...] int32
  """First index of the max; ~4x faster than jnp.argmax on XLA:CPU."""
  vocab = x.shape[-1]
  index = jnp.where(x == x.max(-1, keepdims=True), jnp.arange(vocab, dtype=jnp.int32), vocab - 1)
  return index.min(-1)


def _ordered_bits(x: jax.Array) -> jax.Array:
  """Maps float32 to uint32 so that x < y iff bits(x) < bits(y)."""
  x = jnp.where(x == 0, 0.0, x)  # -0.0 and 0.0 tie as floats; make them one.
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _bisect(done_at: Callable[[jax.Array], jax.Array], shape) -> jax.Array:
  """Smallest uint32 t with done_at(t) true; done_at must be monotone."""

  def step(_, lo_hi):
    lo, hi = lo_hi
    mid = lo + ((hi - lo) >> 1)
    done = done_at(mid)
    return jnp.where(done, lo, mid + 1), jnp.where(done, mid, hi)

  lo = jnp.zeros(shape, jnp.uint32)
  hi = jnp.full(shape, 0xFFFFFFFF, jnp.uint32)
  return jax.lax.fori_loop(0, 32, step, (lo, hi))[1]


# Top-k and top-p find their threshold by bisection over the float32 bit
# order: 32 vectorised counting passes. At V = 262144 on XLA:CPU this costs a
# few ms a row, where jax.lax.top_k and jnp.sort cost ~60-70 ms.


def _top_k(logits: jax.Array, k: int) -> jax.Array:
  """Keeps logits >= the k-th largest (ties at the boundary kept)."""
  bits = _ordered_bits(logits)
  # The k-th largest is the largest t with count(bits >= t) >= k, i.e. one
  # below the smallest t with count(bits >= t) < k.
  too_high = lambda t: jnp.sum(bits >= t, -1, keepdims=True) < k
  threshold = _bisect(too_high, logits.shape[:-1] + (1,)) - 1
  return _keep(logits, bits >= threshold)


def _top_p(logits: jax.Array, top_p: float) -> jax.Array:
  """Keeps token x iff the mass of tokens above x is < top_p (ties kept)."""
  bits = _ordered_bits(logits)
  probs_ = jax.nn.softmax(logits, axis=-1)
  mass_above = lambda t: jnp.sum(jnp.where(bits > t, probs_, 0.0), -1, keepdims=True)
  threshold = _bisect(lambda t: mass_above(t) < top_p, logits.shape[:-1] + (1,))
  return _keep(logits, bits >= threshold)


def transform_logits(
    logits: jax.Array,  # [..., V]
    params: SamplingParams,
) -> jax.Array:  # [..., V] float32, removed tokens = -inf
  """Temperature, then top-k, top-p and min-p; greedy keeps only the argmax."""
  params.validate()
  logits = logits.astype(jnp.float32)
  if isinstance(params, RowSampling):
    return _transform_rows(logits, params)
  vocab = logits.shape[-1]
  if params.is_greedy:
    top = argmax(logits)[..., None]
    return _keep(logits, jnp.arange(vocab) == top)
  if params.temperature != 1.0:
    logits = logits / params.temperature
  if 0 < params.top_k < vocab:
    logits = _top_k(logits, params.top_k)
  if params.top_p < 1.0:
    logits = _top_p(logits, params.top_p)
  if params.min_p > 0.0:
    probs_ = jax.nn.softmax(logits, axis=-1)
    logits = _keep(logits, probs_ >= params.min_p * probs_.max(-1, keepdims=True))
  return logits


def probs(
    logits: jax.Array,  # [..., V]
    params: SamplingParams,
) -> jax.Array:  # [..., V] float32
  """The distribution `sample` draws from (one-hot argmax when greedy)."""
  if params.validate().is_greedy:
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(transform_logits(logits, params), axis=-1)


def _as_typed_keys(keys: jax.Array) -> jax.Array:
  if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
    return keys
  return jax.random.wrap_key_data(keys)


def gumbel_argmax(
    logits: jax.Array,  # [..., V] unnormalised log-weights, -inf = excluded
    keys: jax.Array,  # [...] typed keys (or uint32 [..., 2] key data)
) -> jax.Array:  # [...] int32
  """One draw per row from softmax(logits): argmax(logits + Gumbel(key))."""
  keys = _as_typed_keys(keys)
  if keys.shape != logits.shape[:-1]:
    raise ValueError(f'keys shape {keys.shape} != logits batch shape {logits.shape[:-1]}')
  vocab = logits.shape[-1]

  def draw(row):  # One row at a time: [B, V] noise would spill the caches.
    row_logits, key = row
    noise = jax.random.gumbel(key, (vocab,), jnp.float32)
    return argmax(row_logits.astype(jnp.float32) + noise)

  tokens = jax.lax.map(draw, (logits.reshape(-1, vocab), keys.reshape(-1)))
  return tokens.reshape(keys.shape)


def sample(
    logits: jax.Array,  # [..., V]
    params: SamplingParams,
    keys: jax.Array,  # [...] typed keys, one per row (see `row_keys`)
) -> jax.Array:  # [...] int32
  """Draws one token per row from `probs(logits, params)`; greedy = argmax."""
  if params.validate().is_greedy:
    return argmax(logits)
  return gumbel_argmax(transform_logits(logits, params), keys)


def row_keys(
    seed: int | jax.Array,  # scalar, or per-row seeds broadcastable to [...]
    seq_ids: jax.Array,  # [...] int
    positions: jax.Array,  # [...] absolute position of the token drawn
    stream: int = STREAM_SAMPLE,
) -> jax.Array:  # [...] typed keys (broadcast shape of the three)
  """Per-(seed, sequence, position) keys; `stream` separates independent uses.

  Callers needing several independent draws at one position (drafting,
  accept uniforms, residual, bonus) use distinct `stream` values.
  """
  seed = jnp.asarray(seed, jnp.int32)
  if seed.ndim and seed.ndim < jnp.ndim(seq_ids):  # per-row seeds [B] with [B, 1] ids
    seed = seed.reshape(seed.shape + (1,) * (jnp.ndim(seq_ids) - seed.ndim))
  seed, seq_ids, positions = jnp.broadcast_arrays(
      seed, jnp.asarray(seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32)
  )

  def fold(seed, seq_id, position):
    key = jax.random.fold_in(jax.random.key(seed), stream)
    return jax.random.fold_in(jax.random.fold_in(key, seq_id), position)

  keys = jax.vmap(fold)(seed.reshape(-1), seq_ids.reshape(-1), positions.reshape(-1))
  return keys.reshape(seq_ids.shape)
