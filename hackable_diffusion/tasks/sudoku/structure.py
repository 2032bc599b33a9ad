"""Sudoku attention structure for the canvas: each cell attends to its row, column and box peers (and itself).

Named in a model config by spec: `ModelConfig(attention_structure=PEER_MASK)` with
`PEER_MASK = 'hackable_diffusion.tasks.sudoku.structure:peer_mask'` (what `SudokuTask().attention_structure()`
returns), `PROMPT_PEER_MASK` to restrict the canvas's view of the prompt grid to the same peers,
`OWN_CELL_PEER_MASK` for one head that reads each cell's own prompt character, or
`PER_HEAD_PEER_MASK` for heads that specialise in rows / columns / boxes. See
`hackable_diffusion.model.structure` for how the model applies it.
"""

from __future__ import annotations

import numpy as np

from hackable_diffusion.errors import ConfigError

PEER_MASK = "hackable_diffusion.tasks.sudoku.structure:peer_mask"
PER_HEAD_PEER_MASK = "hackable_diffusion.tasks.sudoku.structure:per_head_peer_mask"
PROMPT_PEER_MASK = "hackable_diffusion.tasks.sudoku.structure:prompt_peer_mask"
OWN_CELL_PEER_MASK = "hackable_diffusion.tasks.sudoku.structure:own_cell_peer_mask"


def peer_matrix() -> np.ndarray:
  """[81, 81] bool: cells i and j share a row, a column or a 3x3 box (a cell is its own peer)."""
  idx = np.arange(81)
  row, col = idx // 9, idx % 9
  box = (row // 3) * 3 + col // 3
  same = lambda a: a[:, None] == a[None, :]  # noqa: E731
  return same(row) | same(col) | same(box)


def check_canvas(config) -> None:
  """A one-line `ConfigError` unless the model's canvas holds exactly one grid (`canvas_length=81`)."""
  if config.canvas_length != 81:
    raise ConfigError(f"the Sudoku attention structure needs canvas_length=81, got {config.canvas_length}")


def peer_mask(config) -> np.ndarray:
  """Every head sees the peers: [1, 81, 81] bool."""
  check_canvas(config)
  return peer_matrix()[None]


def prompt_peer_mask(config) -> np.ndarray:
  """Every head sees the peers, in the prompt too: [1, 81, 81 + 81] bool.

  Cell i reads prompt cells and canvas cells that are its peers. Needs the prompt to be the 81-character grid at
  cache slots 0-80 (the Sudoku data: no BOS, no chat template; `data.max_prompt_length=81`).
  """
  peers = peer_mask(config)[0]
  return np.concatenate([peers, peers], axis=1)[None]


def own_cell_peer_mask(config) -> np.ndarray:
  """Head 0 reads only the cell's own prompt character, the other heads the whole prompt: [heads, 81, 81 + 81] bool.

  Every head sees the canvas peers (as `peer_mask`). Head 0 tells each canvas cell whether it is a given, which a
  head seeing the whole prompt can only learn by matching positions through RoPE. Needs the prompt to be the
  81-character grid at cache slots 0-80 (as `prompt_peer_mask`).
  """
  peers = peer_mask(config)[0]
  own = np.concatenate([np.eye(81, dtype=bool), peers], axis=1)
  whole = np.concatenate([np.ones((81, 81), bool), peers], axis=1)
  return np.stack([own] + [whole] * (config.num_attention_heads - 1))


def per_head_peer_mask(config) -> np.ndarray:
  """Heads cycle through row / column / box / all-peers views: [heads, 81, 81] bool."""
  check_canvas(config)
  idx = np.arange(81)
  row, col = idx // 9, idx % 9
  box = (row // 3) * 3 + col // 3
  views = [a[:, None] == a[None, :] for a in (row, col, box)] + [peer_matrix()]
  return np.stack([views[h % len(views)] for h in range(config.num_attention_heads)])


__all__ = ["OWN_CELL_PEER_MASK", "PEER_MASK", "PER_HEAD_PEER_MASK", "PROMPT_PEER_MASK", "check_canvas",
           "own_cell_peer_mask", "peer_mask", "peer_matrix", "per_head_peer_mask", "prompt_peer_mask"]
