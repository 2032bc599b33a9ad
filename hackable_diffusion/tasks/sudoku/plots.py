"""A picture of one puzzle's canvas converging: the argmax grid after a few denoising steps, side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hackable_diffusion.files import write_figure
from hackable_diffusion.tasks.sudoku import formatting


def _digits(text: str) -> np.ndarray:
  """[81] int: the digit in each cell of a decoded canvas, 0 where the character is not 1-9 (or missing)."""
  cells = [int(c) if c in "123456789" else 0 for c in text[:81]]
  return np.asarray(cells + [0] * (81 - len(cells)), np.int32)


def frame_indices(num_steps: int, max_frames: int) -> list[int]:
  """Up to `max_frames` step indices spread evenly over `num_steps`, always the first and the last."""
  if num_steps <= max_frames:
    return list(range(num_steps))
  return sorted({int(round(i)) for i in np.linspace(0, num_steps - 1, max_frames)})


def plot_canvas_trajectory(trajectory: Mapping[str, Any], path: str, *, max_frames: int = 8) -> str:
  """Draws the grid after selected steps: givens black, blanks green when they match the reference solution, red
  otherwise (grey '?' for a non-digit). `trajectory`: `{'prompt', 'target', 'steps': [decoded canvas per step]}`."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  steps: Sequence[str] = trajectory["steps"]
  if not steps:
    raise ValueError("trajectory has no steps to draw")
  puzzle = formatting.parse_grid(trajectory["prompt"]).reshape(81)
  solution = formatting.parse_grid(trajectory["target"]).reshape(81)
  frames = frame_indices(len(steps), max_frames)
  fig = Figure(figsize=(2.2 * len(frames), 2.5), dpi=100)
  FigureCanvasAgg(fig)
  for j, k in enumerate(frames):
    ax = fig.add_subplot(1, len(frames), j + 1)
    grid = _digits(steps[k])
    for cell in range(81):
      r, c = divmod(cell, 9)
      if puzzle[cell]:
        text, color = str(puzzle[cell]), "black"
      elif grid[cell]:
        text, color = str(grid[cell]), "tab:green" if grid[cell] == solution[cell] else "tab:red"
      else:
        text, color = "?", "grey"
      ax.text(c + 0.5, 8.5 - r, text, ha="center", va="center", fontsize=7, color=color,
              fontweight="bold" if puzzle[cell] else "normal")
    for line in range(10):
      width = 1.5 if line % 3 == 0 else 0.3
      ax.axhline(line, color="black", linewidth=width)
      ax.axvline(line, color="black", linewidth=width)
    blanks = puzzle == 0
    right = int(((grid == solution) & blanks).sum())
    ax.set_title(f"step {k + 1}: {right}/{int(blanks.sum())}", fontsize=8)
    ax.set_xlim(0, 9)
    ax.set_ylim(0, 9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_aspect("equal")
  fig.suptitle("argmax canvas after each denoising step (green: matches the solution, red: does not)", fontsize=8)
  fig.tight_layout()
  write_figure(fig, path)  # never through a symbolic link
  return path
