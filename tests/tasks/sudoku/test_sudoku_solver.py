"""Bitmask solver vs hand-made puzzles and an independent brute-force solver."""

import numpy as np
import pytest

from hackable_diffusion.tasks.sudoku import generator, solver

# Wikipedia's example puzzle and its (unique) solution.
PUZZLE = '530070000600195000098000060800060003400803001700020006060000280000419005000080079'
SOLUTION = '534678912672195348198342567859761423426853791713924856961537284287419635345286179'
# Arto Inkala's "world's hardest Sudoku" (21 givens) and its published unique solution.
HARD = '800000000003600000070090200050007000000045700000100030001000068008500010090000400'
HARD_SOLUTION = '812753649943682175675491283154237896369845721287169534521974368438526917796318452'
# In SOLUTION, rows 3-4 x columns 5, 8 hold 1 3 / 3 1: blanking them leaves two solutions.
RECTANGLE = (3 * 9 + 5, 3 * 9 + 8, 4 * 9 + 5, 4 * 9 + 8)


def grid(text: str) -> np.ndarray:
  return np.array([int(ch) for ch in text], dtype=np.int8)


def brute_force_count(cells, limit: int = 2) -> int:
  """Independent reference: plain recursion on Python sets, no bitmasks, no propagation."""
  g = [[int(cells[r * 9 + c]) for c in range(9)] for r in range(9)]

  def peers_values(r, c):
    vals = set(g[r]) | {g[k][c] for k in range(9)}
    br, bc = 3 * (r // 3), 3 * (c // 3)
    vals |= {g[br + i][bc + j] for i in range(3) for j in range(3)}
    return vals

  for r in range(9):  # a clash among the givens: no solution
    for c in range(9):
      v = g[r][c]
      if v:
        g[r][c] = 0
        clash = v in peers_values(r, c)
        g[r][c] = v
        if clash:
          return 0

  def rec(limit: int) -> int:
    best = None
    for r in range(9):
      for c in range(9):
        if g[r][c] == 0:
          options = [d for d in range(1, 10) if d not in peers_values(r, c)]
          if best is None or len(options) < len(best[2]):
            best = (r, c, options)
    if best is None:
      return 1
    r, c, options = best
    found = 0
    for d in options:
      g[r][c] = d
      found += rec(limit - found)
      g[r][c] = 0
      if found >= limit:
        break
    return found

  return rec(limit)


def is_complete_valid(cells) -> bool:
  g = np.asarray(cells).reshape(9, 9)
  units = [g[r] for r in range(9)] + [g[:, c] for c in range(9)]
  units += [g[r : r + 3, c : c + 3].ravel() for r in (0, 3, 6) for c in (0, 3, 6)]
  return all(sorted(u.tolist()) == list(range(1, 10)) for u in units)


def test_known_unique_puzzle():
  assert solver.count_solutions(grid(PUZZLE)) == 1
  np.testing.assert_array_equal(solver.solve(grid(PUZZLE)), grid(SOLUTION))
  assert solver.solve(grid(PUZZLE)).dtype == np.int8


def test_hardest_puzzle():
  np.testing.assert_array_equal(solver.solve(grid(HARD)), grid(HARD_SOLUTION))
  assert solver.count_solutions(grid(HARD), limit=5) == 1


def test_puzzle_with_two_solutions():
  puzzle = grid(SOLUTION)
  puzzle[list(RECTANGLE)] = 0
  assert brute_force_count(puzzle, 5) == 2
  assert solver.count_solutions(puzzle, limit=5) == 2
  assert solver.count_solutions(puzzle, limit=2) == 2
  assert solver.count_solutions(puzzle, limit=1) == 1
  sol = solver.solve(puzzle)
  assert is_complete_valid(sol) and np.all(sol[puzzle > 0] == puzzle[puzzle > 0])


def test_full_grid_has_one_solution_and_empty_grid_many():
  assert solver.count_solutions(grid(SOLUTION)) == 1
  assert solver.count_solutions(np.zeros(81, np.int8), limit=7) == 7


@pytest.mark.parametrize(
    'cell, value',
    [
        (2, 5),  # row 0 already holds 5 (cell 0)
        (9 * 7, 5),  # column 0 already holds 5 (cell 0), different box
        (10, 3),  # box 0 already holds 3 (cell 1), different row and column
    ],
)
def test_duplicate_given_has_no_solution(cell, value):
  puzzle = grid(PUZZLE)
  assert puzzle[cell] == 0
  puzzle[cell] = value
  assert brute_force_count(puzzle) == 0
  assert solver.count_solutions(puzzle) == 0
  assert solver.solve(puzzle) is None


def test_unsolvable_without_clashing_givens():
  # Every given is legal, but cell 2 (row 0) has no candidate left: row 0 holds 1-7 elsewhere...
  puzzle = np.zeros(81, np.int8)
  puzzle[[0, 1, 3, 4, 5, 6, 7]] = [1, 2, 3, 4, 5, 6, 7]
  puzzle[9 * 4 + 2] = 8  # ...and column 2 holds 8 and 9.
  puzzle[9 * 7 + 2] = 9
  assert brute_force_count(puzzle) == 0
  assert solver.count_solutions(puzzle) == 0
  assert solver.solve(puzzle) is None


def test_accepts_9x9_and_other_int_dtypes():
  assert solver.count_solutions(grid(PUZZLE).reshape(9, 9).astype(np.int64)) == 1


@pytest.mark.parametrize(
    'bad, message',
    [
        (np.zeros(80, np.int8), r'shape \[81\] or \[9, 9\], got \[80\]'),
        (np.zeros((3, 27), np.int8), r'got \[3, 27\]'),
        (np.full(81, 10, np.int8), r'0\.\.9.*got 10 at cell 0'),
        (np.concatenate([np.zeros(5), [-1], np.zeros(75)]).astype(np.int32), r'got -1 at cell 5'),
        (np.zeros(81, np.float32), r'integer dtype, got float32'),
    ],
)
def test_invalid_input_raises(bad, message):
  with pytest.raises(ValueError, match=message):
    solver.count_solutions(bad)
  with pytest.raises(ValueError, match=message):
    solver.solve(bad)


def test_limit_must_be_positive():
  with pytest.raises(ValueError, match='limit must be >= 1, got 0'):
    solver.count_solutions(grid(PUZZLE), limit=0)


def test_counts_match_brute_force_on_random_blanks():
  # Relabelled copies of SOLUTION with random blanks (unique to many-solution puzzles), every third
  # one with a random digit written into a blank (often no solution).
  rng = np.random.default_rng(0)
  base = grid(SOLUTION)
  counts = []
  for trial in range(30):
    relabel = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.int8)
    puzzle = relabel[base]
    puzzle[rng.choice(81, size=int(rng.integers(30, 56)), replace=False)] = 0
    if trial % 3 == 2:
      puzzle[rng.choice(np.flatnonzero(puzzle == 0))] = rng.integers(1, 10)
    expected = brute_force_count(puzzle, 3)
    assert solver.count_solutions(puzzle, limit=3) == expected, trial
    counts.append(expected)
    sol = solver.solve(puzzle)
    if expected == 0:
      assert sol is None
    else:
      assert is_complete_valid(sol) and np.all(sol[puzzle > 0] == puzzle[puzzle > 0])
  assert {0, 1, 3} <= set(counts), counts  # every regime was exercised


def _rows(*rows: str) -> np.ndarray:
  return grid(''.join(rows).ljust(81, '0'))


# Row 0 misses 1 and 2; column 1 holds a 1 (row 5), so cell 0 is row 0's only place for 1.
HIDDEN_ONE = _rows('003456789', '000000000', '400000000', '300000000', '500000000', '610000000')
# ... and row 1 holds a 2 while column 0 misses 1 and 2: cell 0 is also column 0's only place for 2.
HIDDEN_ONE_AND_TWO = _rows(
    '003456789', '000002000', '400000000', '300000000', '500000000', '610000000', '700000000',
    '800000000', '900000000',
)
# Columns 0 and 1 both hold a 1, so row 0 has no place left for its missing 1.
NO_PLACE_FOR_ONE = _rows(
    '003456789', '000000000', '000000000', '000000000', '000000000', '100000000', '010000000'
)


def test_hidden_single_propagation():
  # The search's hidden-single step, on states built by hand (the search itself usually reaches
  # these contradictions through naked singles first, so check the step directly).
  rows, cols, boxes, empties = solver.masks_from_cells([int(v) for v in HIDDEN_ONE])
  placed = []
  remaining = solver._place_hidden_singles(rows, cols, boxes, empties, placed)
  assert (0, 1 << 0) in placed and 0 not in remaining
  assert len(remaining) + len(placed) == len(empties)
  for puzzle in (HIDDEN_ONE_AND_TWO, NO_PLACE_FOR_ONE):
    state = solver.masks_from_cells([int(v) for v in puzzle])
    assert solver._place_hidden_singles(*state, []) is None
    assert solver.count_solutions(puzzle) == 0 == brute_force_count(puzzle)


def singles_reference(cells):
  """Independent reference for `fill_by_singles`: candidate sets, one naked or hidden single placed at a time."""
  g = [int(v) for v in cells]
  units = [[r * 9 + c for c in range(9)] for r in range(9)] + [[r * 9 + c for r in range(9)] for c in range(9)]
  units += [[(br + r) * 9 + bc + c for r in range(3) for c in range(3)] for br in (0, 3, 6) for bc in (0, 3, 6)]
  peers = [{p for u in units if i in u for p in u} - {i} for i in range(81)]
  while 0 in g:
    cand = {i: set(range(1, 10)) - {g[p] for p in peers[i]} for i in range(81) if g[i] == 0}
    if any(not c for c in cand.values()):
      return None
    move = next(((i, c.pop()) for i, c in cand.items() if len(c) == 1), None)
    if move is None:
      for u, v in ((u, v) for u in units for v in range(1, 10)):
        spots = [i for i in u if i in cand and v in cand[i]]
        if len(spots) == 1 and v not in {g[i] for i in u}:
          move = (spots[0], v)
          break
    if move is None:
      return None
    g[move[0]] = move[1]
  return g


def test_fill_by_singles_matches_a_set_based_reference():
  """Scanning alone fills the Wikipedia puzzle, not Inkala's; on generated puzzles of 22-45 givens (both outcomes
  occur) it agrees with the reference on which it fills, and what it fills is the unique solution."""
  np.testing.assert_array_equal(solver.fill_by_singles(grid(PUZZLE)), grid(SOLUTION))
  assert solver.fill_by_singles(grid(HARD)) is None and singles_reference(grid(HARD)) is None
  puzzles, solutions = generator.generate_puzzles(60, seed=3, min_givens=22, max_givens=45)
  filled = 0
  for puzzle, solution in zip(puzzles, solutions):
    got, want = solver.fill_by_singles(puzzle), singles_reference(puzzle)
    assert (got is None) == (want is None)
    if got is not None:
      filled += 1
      np.testing.assert_array_equal(got, solution)
      assert got.tolist() == want
  assert 0 < filled < 60, filled
