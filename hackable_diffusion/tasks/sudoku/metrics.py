"""Sudoku metrics as the published recipes report them (docs/reference.md, "Sudoku benchmark").

- solved: the prediction is a valid complete grid (every row, column and box a permutation of 1..9)
  that keeps every given of the puzzle;
- cell accuracy on blanks: predicted digit == solution digit, over the puzzle's blank cells;

both overall, stratified by givens (easy >= 40, medium 30-39, hard < 30), and over the puzzles that naked and
hidden singles alone do not fill (`beyond_singles/`: they need pairs, chains or trial and error, whatever their
givens; `solver.fill_by_singles`). Predictions may hold
anything (-1 for an unparsable cell, out-of-range ints, floats, NaN): such cells count as wrong and
never raise.
"""

from __future__ import annotations

import numpy as np

from hackable_diffusion.tasks.sudoku import generator, solver

__all__ = ['cell_accuracy_on_blanks', 'is_valid_solution', 'parse_prediction', 'sudoku_metrics']

INVALID = -1
_DIGITS = {str(d): d for d in range(1, 10)}


def parse_prediction(text: str) -> np.ndarray:
  """A model's decoded text -> ``[81]`` int64 grid; never raises.

  Every non-whitespace character is one cell, in order; only the first 81 are kept. '1'..'9' give
  their digit; anything else ('0', '.', letters, punctuation) gives -1, as do cells missing at the end
  of a short text. Non-str input gives all -1.
  """
  out = np.full(solver.NUM_CELLS, INVALID, dtype=np.int64)
  if not isinstance(text, str):
    return out
  k = 0
  for ch in text:
    if k == solver.NUM_CELLS:
      break
    if ch.isspace():
      continue
    out[k] = _DIGITS.get(ch, INVALID)
    k += 1
  return out


def _as_digits(x: np.ndarray) -> np.ndarray:
  """``[..., 81]`` anything -> int64 with every value outside the integers 1..9 replaced by -1."""
  arr = np.asarray(x)
  if arr.dtype.kind in 'iub':
    vals = arr.astype(np.int64)
    return np.where((vals >= 1) & (vals <= 9), vals, INVALID)
  try:
    vals = arr.astype(np.float64)
  except (TypeError, ValueError):
    flat = [_to_digit(v) for v in arr.reshape(-1)]
    return np.asarray(flat, dtype=np.int64).reshape(arr.shape)
  with np.errstate(invalid='ignore'):
    ok = np.isfinite(vals) & (vals >= 1) & (vals <= 9) & (vals == np.round(vals))
  return np.where(ok, np.nan_to_num(vals), INVALID).astype(np.int64)


def _to_digit(v: object) -> int:
  try:
    f = float(v)
  except (TypeError, ValueError):
    return INVALID
  return int(f) if f in range(1, 10) else INVALID


def _check_batch(x: np.ndarray, name: str) -> np.ndarray:
  arr = np.asarray(x)
  if arr.ndim != 2 or arr.shape[1] != solver.NUM_CELLS:
    raise ValueError(f'{name} must have shape [N, 81], got {list(arr.shape)}')
  return arr


def _valid_complete(preds: np.ndarray) -> np.ndarray:
  """``[N, 81]`` digits (-1 for invalid) -> ``[N]`` bool: every row/col/box holds 1..9 exactly once."""
  n = preds.shape[0]
  grids = preds.reshape(n, 9, 9)
  boxes = grids.reshape(n, 3, 3, 3, 3).transpose(0, 1, 3, 2, 4).reshape(n, 9, 9)
  ok = np.ones(n, dtype=bool)
  target = np.arange(1, 10)
  for units in (grids, grids.transpose(0, 2, 1), boxes):
    ok &= np.all(np.sort(units, axis=2) == target, axis=(1, 2))
  return ok


def _solved(preds: np.ndarray, puzzles: np.ndarray) -> np.ndarray:
  """``[N]`` bool: valid complete grid that keeps every given."""
  given = puzzles > 0
  keeps = np.all(~given | (preds == puzzles), axis=1)
  return _valid_complete(preds) & keeps


def is_valid_solution(pred: np.ndarray, puzzle: np.ndarray) -> bool:
  """Whether ``pred`` ``[81]`` is a valid complete grid keeping every given of ``puzzle`` ``[81]``.

  A ``pred`` of the wrong size or with values outside 1..9 is simply not valid.
  """
  puz = solver.validate_grid(puzzle, 'puzzle').astype(np.int64)
  arr = np.asarray(pred)
  if arr.size != solver.NUM_CELLS:
    return False
  digits = _as_digits(arr.reshape(1, solver.NUM_CELLS))
  return bool(_solved(digits, puz[None])[0])


def cell_accuracy_on_blanks(pred: np.ndarray, puzzle: np.ndarray, solution: np.ndarray) -> float:
  """Fraction of ``puzzle``'s blank cells where ``pred`` equals ``solution`` (all ``[81]``).

  NaN for a puzzle without blanks; a ``pred`` of the wrong size scores 0.
  """
  puz = solver.validate_grid(puzzle, 'puzzle')
  sol = solver.validate_grid(solution, 'solution')
  blanks = puz == 0
  if not blanks.any():
    return float('nan')
  arr = np.asarray(pred)
  if arr.size != solver.NUM_CELLS:
    return 0.0
  digits = _as_digits(arr.reshape(solver.NUM_CELLS))
  return float(np.mean(digits[blanks] == sol[blanks]))


def sudoku_metrics(preds: np.ndarray, puzzles: np.ndarray, solutions: np.ndarray) -> dict[str, float | int]:
  """Solved rate and cell accuracy, overall and per difficulty bucket.

  Args:
    preds: ``[N, 81]`` predicted grids; any values (invalid ones count as wrong).
    puzzles: ``[N, 81]`` puzzles, 0 = blank; their givens count sets each row's bucket.
    solutions: ``[N, 81]`` solutions.

  Returns:
    Flat dict: ``solved_rate``, ``cell_accuracy``, ``count`` and the same under ``easy/``, ``medium/``,
    ``hard/`` (e.g. ``'hard/solved_rate'``) and ``beyond_singles/``. ``cell_accuracy`` pools all blank cells of
    the group (micro average). Rates of an empty group are NaN with ``count`` 0.
  """
  preds = _check_batch(preds, 'preds')
  puzzles = _check_batch(puzzles, 'puzzles')
  solutions = _check_batch(solutions, 'solutions')
  if not preds.shape[0] == puzzles.shape[0] == solutions.shape[0]:
    raise ValueError(
        f'preds, puzzles and solutions need the same N, got {preds.shape[0]}, {puzzles.shape[0]}, '
        f'{solutions.shape[0]}'
    )
  for name, arr in (('puzzles', puzzles), ('solutions', solutions)):
    if arr.dtype.kind not in 'iu' or arr.size and (arr.min() < 0 or arr.max() > 9):
      raise ValueError(f'{name} must hold ints in 0..9')
  puzzles = puzzles.astype(np.int64)
  solutions = solutions.astype(np.int64)
  digits = _as_digits(preds)
  solved = _solved(digits, puzzles)
  blanks = puzzles == 0
  correct = (digits == solutions) & blanks
  givens = np.count_nonzero(puzzles, axis=1)
  groups = {'': np.ones(len(givens), dtype=bool)}
  bucket_of = np.array([generator.difficulty_bucket(int(g)) for g in givens], dtype=object)
  for bucket in generator.BUCKETS:
    groups[f'{bucket}/'] = bucket_of == bucket
  groups['beyond_singles/'] = np.array([solver.fill_by_singles(p) is None for p in puzzles], dtype=bool)
  out = {}
  for prefix, sel in groups.items():
    count = int(sel.sum())
    num_blanks = int(blanks[sel].sum())
    out[f'{prefix}solved_rate'] = float(solved[sel].mean()) if count else float('nan')
    out[f'{prefix}cell_accuracy'] = float(correct[sel].sum() / num_blanks) if num_blanks else float('nan')
    out[f'{prefix}count'] = count
  return out
