"""Sudoku grids <-> text.

The prompt is the 81-cell puzzle in row-major order with '0' for blanks, the completion is the 81
solution digits (docs/reference.md, "Sudoku benchmark"): both one character per cell, so a character-level
tokenizer gives exactly one token per cell. People write puzzles in other notations ('.' or '_' blanks, spaces,
newlines, box separators); `parse_grid` / `parse_puzzle` read all of them, `render_grid` draws a grid for people.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hackable_diffusion.tasks.sudoku import solver

__all__ = ['BLANKS', 'DIGITS', 'SEPARATORS', 'cell_name', 'check_givens', 'count_cells', 'find_conflict',
           'parse_grid', 'parse_puzzle', 'puzzle_to_prompt', 'render_grid', 'solution_to_completion',
           'solution_verdict', 'to_record']

DIGITS = '123456789'
BLANKS = '0._'  # what a blank cell may be written as
SEPARATORS = '|-+'  # box separators (render_grid's); whitespace is ignored too


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


def to_record(puzzle: np.ndarray, solution: np.ndarray) -> dict[str, Any]:
  """The JSONL record of a puzzle ``[81]`` (0 = blank) and its solution ``[81]``: ``prompt`` (81 characters, '0'
  for a blank), ``completion`` (81 digits), ``givens`` and ``pinned`` ('1' at a given: the data pipeline's
  ``pinned_field``)."""
  return {'prompt': puzzle_to_prompt(puzzle), 'completion': solution_to_completion(solution),
          'givens': int(np.sum(np.asarray(puzzle) > 0)), 'pinned': ''.join('1' if v else '0' for v in puzzle)}


def parse_grid(text: str) -> np.ndarray:
  """81 cells of text -> ``[81]`` int8, in row order; the notations people paste are accepted.

  A cell is a digit 1-9 or a blank: '0', '.' or '_' (`BLANKS`). Whitespace and the box separators '|', '-', '+'
  (`SEPARATORS`, as `render_grid` draws them) are ignored, so '530070000...', '53..7....' and a pasted
  `render_grid` picture give the same grid. Contradictory givens are not checked here (`check_givens`).

  Raises:
    ValueError: naming the first character that is none of these (with its position), or the wrong cell count.
  """
  if not isinstance(text, str):
    raise ValueError(f'parse_grid expects a str, got {type(text).__name__}')
  cells = []
  for pos, ch in enumerate(text):
    if ch.isspace() or ch in SEPARATORS:
      continue
    if ch in BLANKS:
      cells.append(0)
    elif ch in DIGITS:
      cells.append(int(ch))
    else:
      raise ValueError(f"invalid character {ch!r} at position {pos}: expected a digit 1-9, a blank "
                       f"('.', '0' or '_') or a separator (whitespace, '|', '-', '+')")
  if len(cells) != solver.NUM_CELLS:
    raise ValueError(f"expected 81 cells (digits 1-9 and blanks '.', '0' or '_'), got {len(cells)}")
  return np.asarray(cells, dtype=np.int8)


def count_cells(text: str) -> int:
  """How many cells `text` holds so far: its digits and blanks (what `parse_grid` counts), other characters
  skipped (e.g. to read a grid pasted over several lines)."""
  return sum(ch in DIGITS or ch in BLANKS for ch in text)


def cell_name(i: int) -> str:
  """Cell ``i`` (0..80, row order) as 'r{row}c{column}', both 1-based (e.g. cell 10 -> 'r2c2')."""
  return f'r{i // 9 + 1}c{i % 9 + 1}'


def find_conflict(grid: np.ndarray) -> str | None:
  """The first clash in ``grid`` ``[81]`` (0 = blank): the same digit twice in a row, column or box, described
  as "digit 5 at r1c1 and r1c4 (same row 1)"; None when there is none. Values outside 1..9 are skipped."""
  flat = np.asarray(grid).reshape(solver.NUM_CELLS)
  units = (('row', solver.ROW_OF), ('column', solver.COL_OF), ('box', solver.BOX_OF))
  for i in range(solver.NUM_CELLS):
    d = int(flat[i])
    if d not in range(1, 10):
      continue
    for j in range(i + 1, solver.NUM_CELLS):
      if int(flat[j]) != d:
        continue
      for unit, of in units:
        if of[i] == of[j]:
          return f'digit {d} at {cell_name(i)} and {cell_name(j)} (same {unit} {of[i] + 1})'
  return None


def check_givens(grid: np.ndarray) -> np.ndarray:
  """``grid`` as `solver.validate_grid` returns it, when no two givens clash; else a ValueError naming them."""
  flat = solver.validate_grid(grid)
  conflict = find_conflict(flat)
  if conflict is not None:
    raise ValueError(f'contradictory givens: {conflict}')
  return flat


def parse_puzzle(text: str) -> np.ndarray:
  """A puzzle a person typed or pasted (any notation `parse_grid` takes) -> ``[81]`` int8, its givens checked.

  Raises:
    ValueError: one line naming the bad character and its position, the cell count, or the clashing givens.
  """
  return check_givens(parse_grid(text))


def solution_verdict(grid: np.ndarray, puzzle: np.ndarray) -> tuple[bool, str]:
  """Whether ``grid`` ``[81]`` solves ``puzzle`` ``[81]`` (0 = blank), and one line saying why (not).

  Valid: every cell a digit 1-9, no digit twice in a row, column or box, every given kept. Otherwise the line
  names the problems: how many cells are not digits 1-9, the first clash (`find_conflict`), the first changed
  given.
  """
  flat = np.asarray(grid).reshape(solver.NUM_CELLS).astype(np.int64)
  puz = solver.validate_grid(puzzle, 'puzzle').astype(np.int64)
  problems = []
  not_digits = int(np.sum((flat < 1) | (flat > 9)))
  if not_digits:
    problems.append(f'{not_digits} cell(s) not a digit 1-9')
  conflict = find_conflict(flat)
  if conflict is not None:
    problems.append(f'{conflict} clash')
  changed = np.flatnonzero((puz > 0) & (flat != puz))
  if changed.size:
    i = int(changed[0])
    problems.append(f'{changed.size} given(s) changed (first {cell_name(i)}: {puz[i]} -> {flat[i]})')
  if problems:
    return False, 'not valid: ' + '; '.join(problems)
  givens = int(np.sum(puz > 0))
  return True, f'valid: a complete grid with no clash in any row, column or box, keeping all {givens} givens'


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
