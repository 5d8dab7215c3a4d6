"""Training curves from metrics.jsonl: loss, per-position agreement, expected τ (one PNG)."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402


def write_curves(metrics_path: str, png_path: str) -> list[str]:
  """curves.png: training loss and lr; agreement per draft position (train, eval); expected τ. [] without data."""
  if not os.path.isfile(metrics_path):
    return []
  with open(metrics_path, encoding='utf-8') as f:
    records = [json.loads(line) for line in f if line.strip()]
  train = [r for r in records if r.get('type') == 'train']
  evals = [r for r in records if r.get('type') == 'eval']
  if not train:
    return []
  fig, (loss_ax, agree_ax, tau_ax) = plt.subplots(1, 3, figsize=(15, 4))
  steps = [r['step'] for r in train]
  loss_ax.plot(steps, [r['loss'] for r in train], color='black')
  loss_ax.set(title='loss', xlabel='step', yscale='log')
  lr_ax = loss_ax.twinx()
  lr_ax.plot(steps, [r['lr'] for r in train], color='tab:gray', alpha=0.5, linewidth=0.8)
  lr_ax.set_ylabel('lr', color='tab:gray')
  for i in range(len(train[-1]['agree'])):
    (line,) = agree_ax.plot(steps, [r['agree'][i] for r in train], label=f'position {i + 1}', alpha=0.8)
    if evals:
      agree_ax.plot([r['step'] for r in evals], [r['agree'][i] for r in evals], 'o--', color=line.get_color())
  agree_ax.set(title='top-1 agreement with the target (lines: train, dots: eval)', xlabel='step', ylim=(0, 1))
  agree_ax.legend(fontsize=7)
  tau_ax.plot(steps, [r['tau_train'] for r in train], label='train')
  if evals:
    tau_ax.plot([r['step'] for r in evals], [r['tau'] for r in evals], 'o-', label='eval')
  tau_ax.set(title='expected τ = 1 + Σ_k Π_{i≤k} a_i', xlabel='step')
  tau_ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=90)
  plt.close(fig)
  return [png_path]
