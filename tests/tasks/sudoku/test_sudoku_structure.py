"""The Sudoku attention structure: peer masks, named by spec from the task, applied by a Sudoku-sized model."""

from __future__ import annotations

import numpy as np
import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import structure as model_structure
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.tasks.base import get_task
from hackable_diffusion.tasks.sudoku import structure


def test_peer_matrix_counts_20_peers_plus_self():
  peers = structure.peer_matrix()
  assert peers.shape == (81, 81) and (peers == peers.T).all()
  assert (peers.sum(axis=1) == 21).all()  # 8 in the row, 8 in the column, 4 more in the box, and the cell
  assert peers[0, 8] and peers[0, 72] and peers[0, 20] and not peers[0, 30]


def test_the_task_names_its_structure_and_the_model_applies_it():
  spec = get_task("sudoku").attention_structure()
  assert spec == structure.PEER_MASK == "hackable_diffusion.tasks.sudoku.structure:peer_mask"
  config = get_preset("sudoku", attention_structure=spec)
  mask = model_structure.canvas_mask(config)
  assert mask.shape == (1, 1, 81, 81) and (mask[0, 0] == structure.peer_matrix()).all()
  per_head = model_structure.canvas_mask(get_preset("sudoku", attention_structure=structure.PER_HEAD_PEER_MASK))
  assert per_head.shape == (1, 4, 81, 81)
  rows = np.arange(81)[:, None] // 9 == np.arange(81)[None] // 9
  assert (per_head[0, 0] == rows).all() and (per_head[0, 3] == structure.peer_matrix()).all()


def test_the_prompt_peer_mask_shows_each_cell_its_peers_in_the_prompt_grid_and_the_canvas():
  mask = model_structure.canvas_mask(get_preset("sudoku", attention_structure=structure.PROMPT_PEER_MASK))
  assert mask.shape == (1, 1, 81, 162)
  peers = structure.peer_matrix()
  assert (mask[0, 0, :, :81] == peers).all() and (mask[0, 0, :, 81:] == peers).all()
  assert mask[0, 0, 0, 72] and not mask[0, 0, 0, 30]  # cell 0 sees prompt cell 72 (its column), not cell 30


def test_the_own_cell_mask_gives_head_0_the_cells_own_prompt_character_and_the_others_the_whole_prompt():
  mask = model_structure.canvas_mask(get_preset("sudoku", attention_structure=structure.OWN_CELL_PEER_MASK))
  assert mask.shape == (1, 4, 81, 162)
  peers = structure.peer_matrix()
  assert (mask[0, 0, :, :81] == np.eye(81, dtype=bool)).all()
  assert mask[0, 1:, :, :81].all()
  assert all((mask[0, h, :, 81:] == peers).all() for h in range(4))


def test_wrong_canvas_and_bare_names_are_one_line_errors():
  for spec in (structure.PEER_MASK, structure.PROMPT_PEER_MASK, structure.OWN_CELL_PEER_MASK):
    with pytest.raises(ConfigError, match="needs canvas_length=81, got 8"):
      get_preset("tiny", attention_structure=spec)
  for bare in ("sudoku_peers", "sudoku_peers_per_head"):  # a bare name is no spec: one line saying what to write
    with pytest.raises(ConfigError, match=r"expected None or 'package.module:function'.*attention_structure") as err:
      get_preset("sudoku", attention_structure=bare)
    assert "\n" not in str(err.value)
