"""Sweep plots (matplotlib, Agg backend): one PNG per view, one panel per setting."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from specjax.sweep.analytics import ALL  # noqa: E402

PLOTS = (
    'tau_vs_k.png',
    'speedup_vs_k.png',
    'position_acceptance.png',
    'predicted_vs_measured.png',
    'policy_trajectories.png',
)


def _settings(analysis: dict) -> list[str]:
  return sorted({g['setting'] for g in analysis['groups']})


def _panels(n: int, title: str):
  fig, axes = plt.subplots(1, max(n, 1), figsize=(5.2 * max(n, 1), 4.0), squeeze=False)
  fig.suptitle(title)
  return fig, axes[0]


def _fixed(group: dict) -> list[dict]:
  return sorted((r for r in group['rows'] if r['policy_name'] == 'fixed'), key=lambda r: r['k'])


def _empty(ax, text: str = 'no data') -> None:
  ax.text(0.5, 0.5, text, ha='center', va='center', transform=ax.transAxes, color='gray')


def _by_k(analysis: dict, title: str, measured: str, predicted: str, ylabel: str, path: str, hline=None) -> None:
  settings = _settings(analysis)
  fig, axes = _panels(len(settings), title)
  for ax, setting in zip(axes, settings):
    drawn = False
    for group in (g for g in analysis['groups'] if g['setting'] == setting):
      rows = [r for r in _fixed(group) if r[measured] is not None]
      if not rows:
        continue
      style = {'linewidth': 2.5, 'color': 'black'} if group['category'] == ALL else {}
      (line,) = ax.plot([r['k'] for r in rows], [r[measured] for r in rows], 'o-', label=group['category'], **style)
      pred = [(r['k'], r[predicted]) for r in rows if r[predicted] is not None]
      if pred:
        ax.plot(*zip(*pred), '--', color=line.get_color(), alpha=0.6)
      drawn = True
    if hline is not None:
      ax.axhline(hline, color='gray', linewidth=0.8)
    ax.set_title(setting, fontsize=9)
    ax.set_xlabel('draft depth K')
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:
      ax.legend(fontsize=7)
    else:
      _empty(ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _position(analysis: dict, path: str) -> None:
  settings = _settings(analysis)
  fig, axes = _panels(len(settings), 'P(draft i accepted), deepest fixed K')
  for ax, setting in zip(axes, settings):
    drawn = False
    for group in (g for g in analysis['groups'] if g['setting'] == setting and g['category'] != ALL):
      rows = _fixed(group) or group['rows']
      curve = rows[-1]['position_acceptance'] if rows else []
      if curve:
        ax.plot(range(1, len(curve) + 1), curve, 'o-', label=group['category'])
        drawn = True
    ax.set_title(setting, fontsize=9)
    ax.set_xlabel('draft position i')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel('acceptance')
    ax.set_ylim(0, 1.02)
    if drawn:
      ax.legend(fontsize=7)
    else:
      _empty(ax)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _predicted_vs_measured(analysis: dict, path: str) -> None:
  fig, ax = plt.subplots(figsize=(5.2, 4.6))
  points = []
  for group in analysis['groups']:
    if group['category'] == ALL:
      continue
    for r in group['rows']:
      if r['predicted'] is not None and r['speedup'] is not None:
        points.append((r['predicted'], r['speedup'], group['setting']))
  for setting in sorted({p[2] for p in points}):
    xs, ys = zip(*[(p[0], p[1]) for p in points if p[2] == setting])
    ax.scatter(xs, ys, label=setting, s=18)
  if points:
    hi = max(max(p[0], p[1]) for p in points) * 1.05
    ax.plot([0, hi], [0, hi], color='gray', linewidth=0.8)
    ax.legend(fontsize=7)
  else:
    _empty(ax)
  ax.set_xlabel('predicted speedup')
  ax.set_ylabel('measured speedup')
  ax.set_title('predicted vs measured speedup (one point per category, policy)', fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _trajectories(analysis: dict, path: str) -> None:
  """K per step: one row per category, one column per adaptive (setting, policy); dotted lines part requests."""
  panels = {}
  for group in analysis['groups']:
    if group['category'] == ALL:
      continue
    for r in group['rows']:
      if r['policy_name'] != 'fixed':
        panels[(group['setting'], r['policy'], group['category'])] = r
  columns = sorted({(s, p) for s, p, _ in panels})
  categories = sorted({c for _, _, c in panels})
  if not columns:
    fig, ax = plt.subplots(figsize=(5.2, 3.0))
    _empty(ax, 'no adaptive policy in this sweep')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return
  fig, axes = plt.subplots(
      len(categories),
      len(columns),
      figsize=(6.0 * len(columns), 1.5 * len(categories) + 0.8),
      squeeze=False,
      sharey=True,
  )
  fig.suptitle('K chosen per step (dotted: the next request starts with a fresh policy state)')
  top = max(max(r['candidates']) for r in panels.values())
  for j, (setting, policy) in enumerate(columns):
    axes[0, j].set_title(f'{policy} — {setting}', fontsize=9)
    for i, category in enumerate(categories):
      ax = axes[i, j]
      row = panels.get((setting, policy, category))
      start = 0
      for _, ks in (row['trajectories'] if row else []):
        ax.step(range(start, start + len(ks)), ks, where='post', color='C0')
        start += len(ks)
        ax.axvline(start, color='gray', linestyle=':', linewidth=0.8)
      ax.set_ylim(0.5, top + 0.5)
      ax.yaxis.set_major_locator(MaxNLocator(integer=True))
      ax.set_ylabel(category, fontsize=8)
      ax.tick_params(labelsize=7)
    axes[-1, j].set_xlabel('step')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_plots(analysis: dict, out_dir: str) -> list[str]:
  """Writes every plot into `out_dir`; returns their file names."""
  join = lambda name: os.path.join(out_dir, name)
  _by_k(
      analysis,
      'τ vs draft depth (dashed: predicted from the acceptance fit)',
      'tau',
      'tau_predicted',
      'τ',
      join('tau_vs_k.png'),
  )
  _by_k(
      analysis,
      'speedup over autoregressive vs K (dashed: predicted)',
      'speedup',
      'predicted',
      'speedup',
      join('speedup_vs_k.png'),
      hline=1.0,
  )
  _position(analysis, join('position_acceptance.png'))
  _predicted_vs_measured(analysis, join('predicted_vs_measured.png'))
  _trajectories(analysis, join('policy_trajectories.png'))
  return list(PLOTS)
