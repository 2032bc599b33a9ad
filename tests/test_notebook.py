"""notebooks/quickstart.ipynb executes end to end (small-size switch), so it cannot rot."""

from __future__ import annotations

import pytest

import os
import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # executes the quickstart notebook (Sudoku training): minutes on 2 cores; excluded from CI (pyproject addopts), run with -m slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  monkeypatch.setenv("HD_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("HD_NOTEBOOK_WORKDIR", str(tmp_path / "run"))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOK.parents[1])}})
  client.execute()
  outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
  assert "cells right:" in outputs and "early stopping: solved" in outputs
  assert (tmp_path / "run" / "eval" / "report_step_30.json").exists()
