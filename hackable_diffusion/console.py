"""Console scripts installed with the package (`pyproject.toml` `[project.scripts]`).

  hd-train --config=sudoku.py            = python -m hackable_diffusion.train --config=sudoku.py
  hd-evaluate / hd-sample / hd-export    = python -m hackable_diffusion.evaluate / .sample / .export
  hd-import-sudoku --input=F --out=J     = python -m hackable_diffusion.tasks.sudoku.import_puzzles

Each entry runs its CLI module as `__main__`, exactly as `python -m` does: the module's own start-up (malloc huge
pages before JAX is imported) runs, and absl lists the module's flags under `--help`.
"""

from __future__ import annotations

import runpy


def launch(module_name: str) -> None:
  """Runs `module_name` as the `__main__` module with this process's arguments (`python -m module_name`)."""
  runpy.run_module(module_name, run_name="__main__", alter_sys=True)


def train() -> None:
  launch("hackable_diffusion.train")


def evaluate() -> None:
  launch("hackable_diffusion.evaluate")


def sample() -> None:
  launch("hackable_diffusion.sample")


def export() -> None:
  launch("hackable_diffusion.export")


def import_sudoku() -> None:
  launch("hackable_diffusion.tasks.sudoku.import_puzzles")


__all__ = ["evaluate", "export", "import_sudoku", "launch", "sample", "train"]
