"""Synthetic targets whose next token is an easy function of what a drafter sees: learnability checks.

Each is a Llama checkpoint in the Hugging Face layout (`config.json`,
`model.safetensors`, a tokenizer copied from `tokenizer_from`), so `specjax.load`,
`specjax train` and every drafter read it as they read a real model. Ordinary
tokens are ids 0 .. `ordinary - 1`; the rest (BOS, EOS, added tokens) are never
predicted, so answers run to their length.

- `bigram`: the layers are silenced (o_proj and MLP down are zero), so the final
  residual at t is embed(x_t), and the head is scale * embed[σ⁻¹]ᵀ: the next token
  is σ(x_t) for a fixed random permutation σ of the ordinary tokens.
- `copy`: one attention head attends exactly `k - 1` positions back, through
  RoPE alone (its queries and keys read a constant part of every embedding), and
  writes that token's embedding into the residual with gain `gain`: the next
  token is x_{t + 1 - k} once t >= k - 1.
- `confident`: a random Llama whose `lm_head` is scaled by `scale`, so its
  next-token distributions are peaked (the issue's held-out model).

An EAGLE-3 / MTP head is fed (target state at t, x_{t+1}) and drafts x_{t+2}:
for `bigram` that is σ(x_{t+1}), a lookup of the token it is given; for `copy`
it is a token k - 2 positions before the one it is given. Neither is one matmul
from the tapped state at t, whose own prediction is x_{t+1}, the token the head
is already given.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

KINDS = ('bigram', 'copy', 'confident')
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json')


def _config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, theta: float):
  return {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'attention_bias': False,
      'mlp_bias': False,
      'hidden_act': 'silu',
      'hidden_size': hidden,
      'intermediate_size': ffn,
      'num_hidden_layers': layers,
      'num_attention_heads': heads,
      'num_key_value_heads': kv_heads,
      'head_dim': head_dim,
      'max_position_embeddings': 1024,
      'rms_norm_eps': 1e-5,
      'rope_theta': theta,
      'rope_scaling': None,
      'tie_word_embeddings': False,
      'torch_dtype': 'float32',
      'vocab_size': vocab,
  }


def _random_weights(rng, cfg: dict, std: float) -> dict[str, np.ndarray]:
  d, f, v = cfg['hidden_size'], cfg['intermediate_size'], cfg['vocab_size']
  q, kv = cfg['num_attention_heads'] * cfg['head_dim'], cfg['num_key_value_heads'] * cfg['head_dim']
  normal = lambda *shape, s=std: (rng.standard_normal(shape) * s).astype(np.float32)
  w = {'model.embed_tokens.weight': normal(v, d, s=1.0), 'model.norm.weight': np.ones(d, np.float32)}
  for i in range(cfg['num_hidden_layers']):
    p = f'model.layers.{i}.'
    w.update(
        {
            p + 'input_layernorm.weight': np.ones(d, np.float32),
            p + 'post_attention_layernorm.weight': np.ones(d, np.float32),
            p + 'self_attn.q_proj.weight': normal(q, d),
            p + 'self_attn.k_proj.weight': normal(kv, d),
            p + 'self_attn.v_proj.weight': normal(kv, d),
            p + 'self_attn.o_proj.weight': normal(d, q),
            p + 'mlp.gate_proj.weight': normal(f, d),
            p + 'mlp.up_proj.weight': normal(f, d),
            p + 'mlp.down_proj.weight': normal(d, f),
        }
    )
  w['lm_head.weight'] = normal(v, d)
  return w


def _read_out(embed: np.ndarray, targets: np.ndarray, ordinary: int, scale: float) -> np.ndarray:
  """lm_head [V, D] whose row targets[x] is embed[x] / |embed[x]| * scale: input x scores targets[x] highest."""
  unit = embed[:ordinary] / np.linalg.norm(embed[:ordinary], axis=1, keepdims=True)
  head = np.zeros_like(embed)
  head[targets] = unit * scale
  return head


def _copy_layer(w: dict, cfg: dict, back: int, gain: float, const: int) -> None:
  """Layer 0's head 0 attends `back` positions behind the query and adds gain * embed of that token."""
  d, h, theta = cfg['hidden_size'], cfg['head_dim'], cfg['rope_theta']
  p = 'model.layers.0.self_attn.'
  for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
    w[p + name + '.weight'][...] = 0.0
  # Queries and keys read the constant dims (the last `const` of every embedding, RMS-normed ~ 1 each); with
  # RoPE's rotate-half pairs (i, i + h/2) at frequency theta^(-2i/h), q = R(-back * w) k per pair makes the
  # score cos((t - s - back) * w) summed over pairs, largest at s = t - back.
  half = h // 2
  freqs = theta ** (-np.arange(half) * 2.0 / h)
  sharp = 40.0
  k_vec = np.zeros(h, np.float32)
  k_vec[:half] = 1.0
  angle = -back * freqs
  q_vec = np.concatenate([np.cos(angle), np.sin(angle)]).astype(np.float32) * sharp
  # Every head attends alike: k = k_vec * mean(const dims), q likewise with q_vec.
  heads = cfg['num_attention_heads']
  read_const = np.zeros(d, np.float32)
  read_const[d - const :] = 1.0 / const
  w[p + 'k_proj.weight'][...] = np.tile(k_vec[:, None] * read_const[None], (heads, 1))
  w[p + 'q_proj.weight'][...] = np.tile(q_vec[:, None] * read_const[None], (heads, 1)) * h**0.5  # undo 1/sqrt(h)
  # Values: the token dims as they are (head j carries dims j*h .. (j+1)*h); o_proj adds them back with `gain`.
  token = np.eye(d, dtype=np.float32)
  token[d - const :] = 0.0
  w[p + 'v_proj.weight'][...] = token
  w[p + 'o_proj.weight'][...] = token * gain


def make_synthetic_target(
    path: str,
    kind: str,
    *,
    tokenizer_from: str,
    seed: int = 0,
    vocab: int = 512,
    ordinary: int = 501,
    hidden: int = 64,
    layers: int = 3,
    k: int = 4,
    scale: float = 8.0,
    std: float = 0.1,
) -> str:
  """Writes a synthetic Llama target of `kind` (`KINDS`) to `path`; returns `path`.

  `tokenizer_from` is a checkpoint directory whose tokenizer files are copied
  (its vocabulary must be `vocab`). `k` is the copy distance (`copy`: the next
  token is the one k - 1 positions back, k >= 2), `scale` the head's logit scale,
  `std` that of the random weights (Hugging Face's initialiser: 0.02).
  """
  if kind not in KINDS:
    raise ValueError(f'unknown synthetic target {kind!r} (known: {", ".join(KINDS)})')
  rng = np.random.default_rng(seed)
  heads, head_dim = 4, hidden // 4
  theta = 100.0 if kind == 'copy' else 10000.0
  cfg = _config(vocab, hidden, layers, heads, heads, head_dim, 2 * hidden, theta)
  w = _random_weights(rng, cfg, std=std)
  embed = w['model.embed_tokens.weight']
  if kind == 'confident':
    w['lm_head.weight'] *= scale
  else:
    for i in range(layers):  # silence every block; `copy` turns one head back on below
      w[f'model.layers.{i}.self_attn.o_proj.weight'][...] = 0.0
      w[f'model.layers.{i}.mlp.down_proj.weight'][...] = 0.0
    const = hidden // 4
    embed[:, hidden - const :] = 1.0  # a constant part every token shares (the copy head's positional query/key)
    token = embed[:, : hidden - const]  # every token's part the same norm: RMS 1 over all dims, for any token
    embed[:, : hidden - const] = token / np.linalg.norm(token, axis=1, keepdims=True) * np.sqrt(hidden - const)
    if kind == 'bigram':
      targets = np.concatenate([rng.permutation(ordinary)])
    else:
      if k < 2:
        raise ValueError(f'copy needs k >= 2 (the next token k - 1 positions back), got {k}')
      _copy_layer(w, cfg, back=k - 1, gain=8.0, const=const)
      targets = np.arange(ordinary)
    token_part = embed.copy()
    token_part[:, hidden - const :] = 0.0  # the head reads the token dims only
    w['lm_head.weight'] = _read_out(token_part, targets, ordinary, scale)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(cfg, f, indent=2)
  save_file(w, os.path.join(path, 'model.safetensors'))
  for name in _TOKENIZER_FILES:
    if os.path.exists(os.path.join(tokenizer_from, name)):
      shutil.copy(os.path.join(tokenizer_from, name), os.path.join(path, name))
  return path
