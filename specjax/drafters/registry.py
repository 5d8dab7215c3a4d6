"""The one place that names each drafter family.

A family registers a `DrafterFamily`: its options dataclass (whose fields are
its settings: CLI flags from their metadata, sweep keys `drafter.<field>`), its
factory, its compatibility check against a target, its depth candidates and
limits, and what the target must load for it. The CLI, the sweep schema,
`policies.candidates_for` and `bench` read this registry; adding a drafter
touches its own file and one registration line (`specjax/drafters/__init__.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

from specjax.errors import SpecjaxError
from specjax.quant.formats import QUANT_CHOICES


def option(default: Any, *flags: str, help: str, type: type | None = None, **extra) -> Any:  # noqa: A002
  """A field of a family's options dataclass, with its CLI flags (the first is canonical) and help."""
  return dataclasses.field(default=default, metadata={'flags': flags, 'help': help, 'type': type, **extra})


def checkpoint_option() -> Any:
  """`--draft-model PATH`: the drafter checkpoint of the families that load one (one flag, one meaning)."""
  return option(
      None,
      '--draft-model',
      '--mtp-model',
      type=str,
      help='the drafter checkpoint: a draft model (draft-model; same forms as -m), an EAGLE-3 head (eagle3), a '
      'DFlash draft (dflash), a Gemma 4 assistant (gemma4-assistant) or a trained MTP head (mtp; the export/ of '
      'specjax train), '
      'as a path or hub id (a loaded object in Python); --mtp-model is the mistral.rs spelling; without '
      '--drafter, a local EAGLE-3, DFlash or Gemma 4 assistant checkpoint selects its family from config.json '
      'architectures',
  )


def quant_option() -> Any:
  """`--draft-quant`: how the families that load a checkpoint quantize its projections (default: as the target)."""
  return option(
      None,
      '--draft-quant',
      type=str,
      help="the drafter's weight quantization: none, int8, int4, or auto (a GGUF draft model's own blocks); "
      "default: the target's (int8 where the target runs a GGUF file's blocks and the drafter is not a GGUF "
      'file); heads quantize their attention and MLP projections, not their embedding or head',
  )


def target_act(target) -> str:
  """The target's activation mode under --quant: 'int8' (its quant string ends ', act int8') or 'float'."""
  return 'int8' if (getattr(target, 'quant', None) or '').endswith(', act int8') else 'float'


def draft_quant_for(target, asked: str | None, *, gguf: bool = False) -> tuple[str | None, int, str]:
  """(quant, int4 group, activation mode) of a drafter: `asked` (`--draft-quant`), else the target's
  quantization; a quantized drafter's activations follow the target's (`--quant-act`)."""
  act = target_act(target)
  if asked == 'none' or (asked is None and not getattr(target, 'quant', None)):
    return None, 32, 'float'
  if asked is not None:
    if asked == 'auto' and not gguf:
      raise SpecjaxError("--draft-quant auto keeps a GGUF draft model's blocks; this drafter is not a GGUF file")
    return asked, 32, act
  base = target.quant.removesuffix(', act int8')
  if base.startswith('int4-g'):
    return 'int4', int(base[len('int4-g') :]), act
  if base.startswith('auto'):
    return ('auto' if gguf else 'int8'), 32, act
  return base, 32, act


def quantize_head(target, params, options) -> Any:
  """A drafter head's `Weight` projections quantized as `--draft-quant` or the target says (in place); a float
  float32 head's MoE experts and routers on the CPU kernel, as a float target's (`float_experts_on_kernel`)."""
  from specjax.quant.params import float_experts_on_kernel, quantize_params, set_act, settle

  quant, group, act = draft_quant_for(target, options.draft_quant)
  if quant is not None:
    quantize_params(params, quant, group=group, embedding=False)
    set_act(params, act)
    settle(params, getattr(target, 'dtype', None) or 'float32')
  else:
    float_experts_on_kernel(params, getattr(target, 'dtype', None), getattr(target, 'mesh', None))
  return params


# A checkpoint's `architectures` -> the family that reads it (mistral.rs picks DFlash from --mtp-model so).
ARCHITECTURE_FAMILIES = {
    'DFlashDraftModel': 'dflash',
    'DFlash2DraftModel': 'dflash',
    'LlamaForCausalLMEagle3': 'eagle3',
    'Eagle3LlamaForCausalLM': 'eagle3',
    'Eagle3Speculator': 'eagle3',
    'Gemma4AssistantForCausalLM': 'gemma4-assistant',
}


def local_config(path: Any) -> dict | None:
  """config.json of a local checkpoint directory, or None (not a directory, unreadable; hub ids are not fetched)."""
  if not isinstance(path, (str, os.PathLike)):
    return None
  try:
    with open(os.path.join(os.path.expanduser(path), 'config.json'), encoding='utf-8') as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return None
  return hf if isinstance(hf, dict) else None


def checkpoint_family(path: Any) -> str | None:
  """The family a local checkpoint's `architectures` name (`ARCHITECTURE_FAMILIES`), or None."""
  archs = (local_config(path) or {}).get('architectures') or []
  return next((ARCHITECTURE_FAMILIES[a] for a in archs if a in ARCHITECTURE_FAMILIES), None)


@dataclasses.dataclass(frozen=True)
class DrafterFamily:
  name: str
  options: type  # frozen dataclass of the family's settings (fields made with `option`)
  build: Callable[[Any, Any], Any]  # (target Model, options) -> Drafter, after `check`
  check: Callable[[Any, Any], None] = lambda target, options: None  # raises SpecjaxError if the target can't serve
  depths: tuple[int, ...] = (2, 4, 6, 8)  # the tuner's candidates (before the cap)
  default_depth: int = 4  # K when none is given
  max_depth: Callable[[Any], int] = lambda options: 16  # the deepest K the family drafts
  # Built-in heads the target loads for it (`specjax.load(..., mtp=True)`), or a function of the options.
  target_heads: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
  label: Callable[[Any], str] | None = None  # a short name for tables, from the options
  help: str = ''

  def make_options(self, **values) -> Any:
    """Options from keyword values (None keeps a field's default); unknown names are refused."""
    fields = {f.name for f in dataclasses.fields(self.options)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise SpecjaxError(
          f'drafter {self.name!r} has no option {", ".join(unknown)} '
          f'(options: {", ".join(sorted(fields)) or "none"})'
      )
    options = self.options(**{k: v for k, v in values.items() if v is not None})
    if getattr(options, 'draft_quant', None) not in (None, *QUANT_CHOICES):
      raise SpecjaxError(f'--draft-quant must be one of {", ".join(QUANT_CHOICES)}, got {options.draft_quant!r}')
    if getattr(options, 'draft_quant', None) == 'auto' and self.name != 'draft-model':
      raise SpecjaxError(
          f"--draft-quant auto keeps a GGUF draft model's blocks; {self.name} heads are not GGUF files "
          '(choose int8, int4 or none)'
      )
    if hasattr(options, 'validate'):
      options.validate()
    return options

  def candidates(self, options: Any = None, *, max_depth: int = 8) -> tuple[int, ...]:
    """Tuner depths, each capped by the family's limit (for these options) and `max_depth`."""
    if max_depth < 1:
      raise SpecjaxError(f'max_depth must be at least 1, got {max_depth}')
    cap = min(max_depth, self.max_depth(options if options is not None else self.options()))
    return tuple(sorted({min(k, cap) for k in self.depths}))

  def heads_for(self, options: Any) -> tuple[str, ...]:
    """The built-in heads the target loads for a drafter with these options."""
    return self.target_heads(options) if callable(self.target_heads) else self.target_heads

  def describe(self, options: Any) -> str:
    return self.label(options) if self.label else self.name


REGISTRY: dict[str, DrafterFamily] = {}


def register(family: DrafterFamily) -> DrafterFamily:
  if family.name in REGISTRY:
    raise ValueError(f'drafter family {family.name!r} is registered twice')
  REGISTRY[family.name] = family
  return family


def names() -> tuple[str, ...]:
  return tuple(REGISTRY)


def get(name: str) -> DrafterFamily:
  family = REGISTRY.get(name)
  if family is None:
    raise SpecjaxError(f'unknown drafter {name!r} (choose from {", ".join(REGISTRY)})')
  return family


def option_fields() -> dict[str, dataclasses.Field]:
  """Every family's option fields by name (a name shared by two families must mean the same)."""
  out = {}
  for family in REGISTRY.values():
    for f in dataclasses.fields(family.options):
      out.setdefault(f.name, f)
  return out


def make_drafter(kind: str, target, options: Any = None, **values):
  """Builds a drafter of family `kind` for `target` (a loaded Model), checking compatibility first.

  `options` is the family's options dataclass; or give its fields as keywords.
  """
  family = get(kind)
  if options is None:
    options = family.make_options(**values)
  elif values:
    raise SpecjaxError('give a drafter options object or keyword options, not both')
  family.check(target, options)
  return family.build(target, options)
