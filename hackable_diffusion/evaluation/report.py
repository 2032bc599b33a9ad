"""An evaluation report on disk: `<out_dir>/report_step_{N}.json`, `<out_dir>/accuracy_vs_steps_step_{N}.png` and,
for tasks that can draw it (Sudoku), `<out_dir>/canvas_step_{N}.png` (the first example's canvas converging step by
step); and a short text summary. Nothing is written through a symbolic link."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any

from hackable_diffusion.files import check_not_link, makedirs_no_link, write_figure, write_json
from hackable_diffusion.tasks.base import Task

REPORT_PATTERN = "report_step_{step}.json"
PLOT_PATTERN = "accuracy_vs_steps_step_{step}.png"
CANVAS_PLOT_PATTERN = "canvas_step_{step}.png"


def _json_clean(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _json_clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_clean(v) for v in x]
  if isinstance(x, float) and not math.isfinite(x):
    return None  # strict JSON has no NaN/inf
  return x


def write_report(report: dict[str, Any], out_dir: str, task: Task | None = None) -> str:
  """Writes `report_step_{N}.json` and `accuracy_vs_steps_step_{N}.png` into `out_dir`, and
  `canvas_step_{N}.png` when the report has a trajectory and `task` can draw it; returns the JSON path."""
  makedirs_no_link(out_dir)
  step = report.get("step") or 0
  path = os.path.join(out_dir, REPORT_PATTERN.format(step=step))
  write_json(path, _json_clean(report), sort_keys=False)
  plot_report(report, os.path.join(out_dir, PLOT_PATTERN.format(step=step)))
  if task is not None and report.get("trajectory"):
    _plot_trajectory(task, report["trajectory"], os.path.join(out_dir, CANVAS_PLOT_PATTERN.format(step=step)))
  return path


def _plot_trajectory(task: Task, trajectory: Any, path: str) -> None:
  """`task.plot_trajectory` into a private fresh directory beside `path`, then renamed over it: the task's own
  writer never meets a symbolic link planted at `path` (refused, one line)."""
  check_not_link(path)
  private = tempfile.mkdtemp(prefix=".plot-", dir=os.path.dirname(path))  # 0700, a new name
  try:
    tmp = os.path.join(private, os.path.basename(path))
    if task.plot_trajectory(trajectory, tmp) is not None and os.path.exists(tmp):
      os.replace(tmp, path)
  finally:
    shutil.rmtree(private, ignore_errors=True)


def plot_report(report: dict[str, Any], path: str) -> str:
  """Primary metric (and every other metric in [0, 1]) against the step budget; early stopping as a star at
  its mean denoising steps per canvas. Uses the Agg canvas directly (no global backend change)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fixed = [r for r in report["runs"] if not r["early_stopping"] and not r.get("ablation")]
  early = [r for r in report["runs"] if r["early_stopping"] and not r.get("ablation")]
  ablations = [r for r in report["runs"] if r.get("ablation")]
  primary = report["primary_metric"]
  names = [primary] + sorted({k for r in report["runs"] for k, v in r["metrics"].items()
                              if k != primary and v is not None and 0.0 <= v <= 1.0 and "/" not in k})
  fig = Figure(figsize=(6, 4), dpi=100)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for i, name in enumerate(names):
    color = f"C{i}"
    xs = [r["max_denoising_steps"] for r in fixed if name in r["metrics"]]
    ys = [r["metrics"][name] for r in fixed if name in r["metrics"]]
    ax.plot(xs, ys, marker="o", color=color, label=name, linewidth=2 if name == primary else 1)
    for r in early:
      if name in r["metrics"]:
        ax.plot([r["mean_denoising_steps"]], [r["metrics"][name]], marker="*", markersize=14, color=color,
                linestyle="none", label=f"{name} (early stopping)" if name == primary else None)
  for j, r in enumerate(ablations):
    if r["metrics"].get(primary) is not None:
      ax.plot([r["max_denoising_steps"]], [r["metrics"][primary]], marker="Xdvs^<>"[j % 7], markersize=9,
              color="black", linestyle="none", label=f"{primary}, {r['ablation']}")
  ax.set_xlabel("denoising steps per canvas")
  ax.set_ylabel("metric")
  ax.set_title(f"{report.get('task')} @ step {report.get('step')} ({report.get('num_examples')} examples)")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return write_figure(fig, path)


def summary_lines(report: dict[str, Any]) -> list[str]:
  """A small text table of a report (one line per run)."""
  lines = []
  for r in report["runs"]:
    shown = "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
    lines.append(f"{r['name']:>16}  steps/canvas={r['mean_denoising_steps']:6.1f}  {shown}")
  return lines


__all__ = ["CANVAS_PLOT_PATTERN", "PLOT_PATTERN", "REPORT_PATTERN", "plot_report", "summary_lines", "write_report"]
