"""Bitmask backtracking Sudoku solver.

Grids are flat ``[81]`` integer arrays in row-major order, ``0`` for a blank and ``1..9`` for a digit
(a ``[9, 9]`` array is accepted and flattened). Digit ``d`` is bit ``1 << (d - 1)`` of a 9-bit mask;
each row, column and box keeps the mask of digits it already holds, so the candidates of a cell are
``~(row | col | box) & 0x1FF``.

The search propagates naked singles (cells with one candidate) in bulk, then, when many cells are
still blank, hidden singles (a digit with one possible cell in a row, column or box), and only then
branches on the cell with the fewest candidates (most-constrained first). Everything runs on Python
ints and lists: this is the inner loop of the puzzle generator, where numpy's per-call overhead would
dominate.
"""

from __future__ import annotations

import numpy as np

__all__ = ['count_solutions', 'fill_by_singles', 'solve', 'validate_grid']

NUM_CELLS = 81
ALL_DIGITS = 0x1FF

# Static geometry: row, column and box of every cell.
ROW_OF = tuple(i // 9 for i in range(NUM_CELLS))
COL_OF = tuple(i % 9 for i in range(NUM_CELLS))
BOX_OF = tuple((i // 27) * 3 + (i % 9) // 3 for i in range(NUM_CELLS))
# Below this many blanks, hidden-single propagation costs more than the branching it saves.
HIDDEN_SINGLES_MIN_EMPTIES = 40
RCB = tuple(zip(ROW_OF, COL_OF, BOX_OF))
POPCOUNT = tuple(bin(m).count('1') for m in range(ALL_DIGITS + 1))


def validate_grid(grid: np.ndarray, name: str = 'grid') -> np.ndarray:
  """Checks a puzzle grid and returns it as a flat ``[81]`` int8 array.

  Args:
    grid: ``[81]`` or ``[9, 9]`` integer array with values in ``0..9`` (0 = blank).
    name: how the argument is called in error messages.

  Raises:
    ValueError: naming the shape, dtype or out-of-range value that is wrong.
  """
  arr = np.asarray(grid)
  if arr.shape not in ((NUM_CELLS,), (9, 9)):
    raise ValueError(f'{name} must have shape [81] or [9, 9], got {list(arr.shape)}')
  if arr.dtype.kind not in 'iu':
    raise ValueError(f'{name} must have an integer dtype, got {arr.dtype}')
  flat = arr.reshape(NUM_CELLS)
  bad = np.flatnonzero((flat < 0) | (flat > 9))
  if bad.size:
    i = int(bad[0])
    raise ValueError(f'{name} values must be in 0..9 (0 = blank), got {int(flat[i])} at cell {i}')
  return flat.astype(np.int8)


def masks_from_cells(cells: list[int]) -> tuple[list[int], list[int], list[int], list[int]] | None:
  """Builds ``(rows, cols, boxes, empties)`` from 81 ints, or ``None`` if two givens clash."""
  rows = [0] * 9
  cols = [0] * 9
  boxes = [0] * 9
  empties = []
  for i, v in enumerate(cells):
    if v == 0:
      empties.append(i)
      continue
    bit = 1 << (v - 1)
    r, c, b = ROW_OF[i], COL_OF[i], BOX_OF[i]
    if (rows[r] | cols[c] | boxes[b]) & bit:
      return None
    rows[r] |= bit
    cols[c] |= bit
    boxes[b] |= bit
  return rows, cols, boxes, empties


def search(
    rows: list[int],
    cols: list[int],
    boxes: list[int],
    empties: list[int],
    limit: int,
    out: list[int] | None = None,
) -> int:
  """Counts completions of a partial grid, stopping once ``limit`` are found.

  Args:
    rows, cols, boxes: 9 digit masks each; mutated during the search and restored before returning.
    empties: indices of the blank cells (not mutated).
    limit: stop counting at this many solutions.
    out: 81 ints; with ``limit=1``, a found solution's digits are written into its blank cells.

  Returns:
    ``min(#completions, limit)``.
  """
  rcb = RCB
  popcount = POPCOUNT
  placed = []
  total = 0
  while True:
    progress = False
    best_n = 10
    best_i = -1
    best_m = 0
    remaining = []
    for i in empties:
      r, c, b = rcb[i]
      m = ~(rows[r] | cols[c] | boxes[b]) & 0x1FF
      if not m & (m - 1):
        if not m:  # dead end
          best_i = -2
          break
        rows[r] |= m  # naked single: place it now
        cols[c] |= m
        boxes[b] |= m
        placed.append((i, m))
        progress = True
      else:
        remaining.append(i)
        n = popcount[m]
        if n < best_n:
          best_n = n
          best_i = i
          best_m = m
    if best_i == -2:
      break
    if not remaining:
      total = 1
      break
    empties = remaining
    if progress:
      continue
    if len(empties) >= HIDDEN_SINGLES_MIN_EMPTIES:
      remaining = _place_hidden_singles(rows, cols, boxes, empties, placed)
      if remaining is None:
        break
      if not remaining:
        total = 1
        break
      if remaining is not empties:
        empties = remaining
        continue
    # Branch on the most constrained cell.
    empties.remove(best_i)
    r, c, b = rcb[best_i]
    m = best_m
    while m:
      bit = m & -m
      m ^= bit
      rows[r] |= bit
      cols[c] |= bit
      boxes[b] |= bit
      found = search(rows, cols, boxes, empties, limit - total, out)
      rows[r] ^= bit
      cols[c] ^= bit
      boxes[b] ^= bit
      if found and out is not None and total == 0:
        out[best_i] = bit.bit_length()
      total += found
      if total >= limit:
        break
    break
  for i, m in placed:
    if total and out is not None:
      out[i] = m.bit_length()
    r, c, b = rcb[i]
    rows[r] ^= m
    cols[c] ^= m
    boxes[b] ^= m
  return total


def _place_hidden_singles(
    rows: list[int], cols: list[int], boxes: list[int], empties: list[int], placed: list[tuple[int, int]]
) -> list[int] | None:
  """Places every digit that only one blank cell of a unit can take.

  Returns the cells still blank (``empties`` itself when nothing was placed), or ``None`` on a
  contradiction (a digit with no place in a unit, or a cell that would need two digits). Placements are
  appended to ``placed`` so the caller undoes them.
  """
  rcb = RCB
  once = [0] * 27  # units: rows 0..8, columns 9..17, boxes 18..26
  twice = [0] * 27
  for i in empties:
    r, c, b = rcb[i]
    m = ~(rows[r] | cols[c] | boxes[b]) & 0x1FF
    c += 9
    b += 18
    twice[r] |= once[r] & m
    once[r] |= m
    twice[c] |= once[c] & m
    once[c] |= m
    twice[b] |= once[b] & m
    once[b] |= m
  hidden = [0] * 27
  any_hidden = 0
  for u in range(9):
    if (
        (rows[u] | once[u]) != 0x1FF
        or (cols[u] | once[u + 9]) != 0x1FF
        or (boxes[u] | once[u + 18]) != 0x1FF
    ):
      return None
    for v in (u, u + 9, u + 18):
      hidden[v] = h = once[v] & ~twice[v]
      any_hidden |= h
  if not any_hidden:
    return empties
  remaining = []
  for i in empties:
    r, c, b = rcb[i]
    h = (hidden[r] | hidden[c + 9] | hidden[b + 18]) & ~(rows[r] | cols[c] | boxes[b])
    if not h:
      remaining.append(i)
    elif h & (h - 1):
      return None
    else:
      rows[r] |= h
      cols[c] |= h
      boxes[b] |= h
      placed.append((i, h))
  return remaining


def count_solutions(grid: np.ndarray, limit: int = 2) -> int:
  """Number of solutions of a puzzle, counting no further than ``limit``.

  Args:
    grid: ``[81]`` (or ``[9, 9]``) ints in ``0..9``, 0 = blank.
    limit: stop once this many solutions are found; ``limit=2`` answers 'is it unique?'.

  Returns:
    ``min(#solutions, limit)``; 0 for a grid whose givens already clash.
  """
  if limit < 1:
    raise ValueError(f'limit must be >= 1, got {limit}')
  cells = [int(v) for v in validate_grid(grid)]
  state = masks_from_cells(cells)
  if state is None:
    return 0
  rows, cols, boxes, empties = state
  return search(rows, cols, boxes, empties, limit)


def solve(grid: np.ndarray) -> np.ndarray | None:
  """Returns a solution of ``grid`` as ``[81]`` int8, or ``None`` when it has none.

  For a puzzle with several solutions this is the first one the search finds; check uniqueness with
  ``count_solutions(grid) == 1``.
  """
  cells = [int(v) for v in validate_grid(grid)]
  state = masks_from_cells(cells)
  if state is None:
    return None
  rows, cols, boxes, empties = state
  if not search(rows, cols, boxes, empties, 1, cells):
    return None
  return np.asarray(cells, dtype=np.int8)


def fill_by_singles(grid: np.ndarray) -> np.ndarray | None:
  """``grid`` filled by naked singles (a cell with one candidate) and hidden singles (a digit with one place in a
  row, column or box) alone, as ``[81]`` int8; ``None`` when they get stuck or meet a contradiction.

  No guessing: a puzzle it fills is one a person solves by scanning alone; one it cannot fill needs more (pairs,
  chains, trial and error), whatever its givens count.
  """
  cells = [int(v) for v in validate_grid(grid)]
  state = masks_from_cells(cells)
  if state is None:
    return None
  rows, cols, boxes, empties = state
  placed: list[tuple[int, int]] = []
  while empties:
    remaining = []
    for i in empties:
      r, c, b = RCB[i]
      m = ~(rows[r] | cols[c] | boxes[b]) & ALL_DIGITS
      if not m:
        return None
      if m & (m - 1):
        remaining.append(i)
        continue
      rows[r] |= m
      cols[c] |= m
      boxes[b] |= m
      placed.append((i, m))
    if len(remaining) < len(empties):
      empties = remaining
      continue
    hidden = _place_hidden_singles(rows, cols, boxes, empties, placed)
    if hidden is None or hidden is empties:
      return None
    empties = hidden
  for i, m in placed:
    cells[i] = m.bit_length()
  return np.asarray(cells, dtype=np.int8)
