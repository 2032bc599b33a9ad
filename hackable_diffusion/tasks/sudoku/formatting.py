"""Sudoku grids <-> text.

The prompt is the 81-cell puzzle in row-major order with '0' for blanks, the completion is the 81
solution digits (REFERENCE.md §4): both one character per cell, so a character-level tokenizer gives
exactly one token per cell.
"""

from __future__ import annotations

import numpy as np

from hackable_diffusion.tasks.sudoku import solver

__all__ = ['parse_grid', 'puzzle_to_prompt', 'render_grid', 'solution_to_completion']


def puzzle_to_prompt(grid: np.ndarray) -> str:
  """``[81]`` ints in 0..9 -> 81 characters, '0' for blanks."""
  flat = solver.validate_grid(grid)
  return ''.join(str(int(v)) for v in flat)


def solution_to_completion(grid: np.ndarray) -> str:
  """A complete ``[81]`` grid (digits 1..9, no blanks) -> 81 digits."""
  flat = solver.validate_grid(grid)
  blanks = np.flatnonzero(flat == 0)
  if blanks.size:
    raise ValueError(
        f'a completion needs a complete grid, got {blanks.size} blank cells (first at cell {int(blanks[0])})'
    )
  return ''.join(str(int(v)) for v in flat)


def parse_grid(text: str) -> np.ndarray:
  """81 cells of text -> ``[81]`` int8; '0' or '.' is a blank, whitespace is ignored.

  Raises:
    ValueError: naming the first character that is not a digit or '.', or the wrong cell count.
  """
  if not isinstance(text, str):
    raise ValueError(f'parse_grid expects a str, got {type(text).__name__}')
  cells = []
  for pos, ch in enumerate(text):
    if ch.isspace():
      continue
    if ch == '.':
      cells.append(0)
    elif ch in '0123456789':
      cells.append(int(ch))
    else:
      raise ValueError(f"invalid character {ch!r} at position {pos}: expected a digit 0-9 or '.'")
  if len(cells) != solver.NUM_CELLS:
    raise ValueError(f'expected 81 cells (digits or \'.\'), got {len(cells)}')
  return np.asarray(cells, dtype=np.int8)


def render_grid(grid: np.ndarray, blank: str = '.') -> str:
  """A 9x9 grid drawn with box separators, ``blank`` for 0, for CLIs and notebooks.

  Values outside 1..9 (e.g. -1 for a cell a model got wrong) are drawn as '?'.

  ```
  5 3 . | . 7 . | . . .
  6 . . | 1 9 5 | . . .
  ...
  ------+-------+------
  ```
  """
  arr = np.asarray(grid)
  if arr.size != solver.NUM_CELLS:
    raise ValueError(f'grid must have 81 cells, got shape {list(arr.shape)}')
  flat = arr.reshape(solver.NUM_CELLS)
  lines = []
  for r in range(9):
    if r and r % 3 == 0:
      lines.append('------+-------+------')
    chars = []
    for c in range(9):
      v = flat[r * 9 + c]
      if v == 0:
        chars.append(blank)
      elif v in range(1, 10):
        chars.append(str(int(v)))
      else:
        chars.append('?')
    lines.append(' | '.join(' '.join(chars[k : k + 3]) for k in (0, 3, 6)))
  return '\n'.join(lines)
