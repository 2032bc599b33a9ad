"""Sudoku attention structure for the canvas: each cell attends to its row, column and box peers (and itself)."""

from __future__ import annotations

import numpy as np


def peer_matrix() -> np.ndarray:
  """[81, 81] bool: cells i and j share a row, a column or a 3x3 box (a cell is its own peer)."""
  idx = np.arange(81)
  row, col = idx // 9, idx % 9
  box = (row // 3) * 3 + col // 3
  same = lambda a: a[:, None] == a[None, :]  # noqa: E731
  return same(row) | same(col) | same(box)


def _check(config) -> None:
  if config.canvas_length != 81:
    raise ValueError(f"the Sudoku structure needs canvas_length=81, got {config.canvas_length}")


def peer_mask(config) -> np.ndarray:
  """Every head sees the peers: [1, 81, 81]."""
  _check(config)
  return peer_matrix()[None]


def per_head_peer_mask(config) -> np.ndarray:
  """Heads cycle through row / column / box / all-peers views: [heads, 81, 81]."""
  _check(config)
  idx = np.arange(81)
  row, col = idx // 9, idx % 9
  box = (row // 3) * 3 + col // 3
  views = [a[:, None] == a[None, :] for a in (row, col, box)] + [peer_matrix()]
  return np.stack([views[h % len(views)] for h in range(config.num_attention_heads)])
