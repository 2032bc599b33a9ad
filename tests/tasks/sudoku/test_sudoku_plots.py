"""The canvas-convergence picture: which steps it shows, and that it draws a PNG from a real trajectory."""

from __future__ import annotations

import pytest

from hackable_diffusion.tasks.sudoku import plots
from hackable_diffusion.tasks.sudoku.task import SudokuTask


@pytest.mark.parametrize("n,k", [(1, 8), (5, 8), (8, 8), (9, 8), (64, 8), (30, 2)])
def test_frame_indices_keep_first_and_last(n, k):
  idx = plots.frame_indices(n, k)
  assert idx[0] == 0 and idx[-1] == n - 1 and len(idx) == min(n, k)
  assert idx == sorted(set(idx)) and all(0 <= i < n for i in idx)


def test_sudoku_task_draws_the_trajectory(tmp_path):
  solution = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
  prompt = "".join(c if i % 3 else "0" for i, c in enumerate(solution))
  steps = ["x" * 81, solution[:40] + "1" * 41, solution]  # noise, half right, solved
  path = SudokuTask().plot_trajectory({"prompt": prompt, "target": solution, "steps": steps},
                                      str(tmp_path / "c.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert plots._digits("x" * 81).sum() == 0 and (plots._digits(solution[:5]) > 0).sum() == 5
  with pytest.raises(ValueError, match="no steps"):
    plots.plot_canvas_trajectory({"prompt": prompt, "target": solution, "steps": []}, str(tmp_path / "d.png"))
