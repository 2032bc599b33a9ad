"""Metrics on hand-made grids."""

import math

import numpy as np
import pytest

from hackable_diffusion.tasks.sudoku import metrics

SOLUTION = '534678912672195348198342567859761423426853791713924856961537284287419635345286179'
# Rows 3-4 x columns 5, 8 of SOLUTION hold 1 3 / 3 1: swapping them gives another valid grid.
RECTANGLE = [3 * 9 + 5, 3 * 9 + 8, 4 * 9 + 5, 4 * 9 + 8]


def grid(text: str) -> np.ndarray:
  return np.array([int(ch) for ch in text], dtype=np.int64)


def puzzle_with_blanks(solution: np.ndarray, blanks) -> np.ndarray:
  puzzle = solution.copy()
  puzzle[list(blanks)] = 0
  return puzzle


SOL = grid(SOLUTION)
EMPTY = np.zeros(81, np.int8)


def test_valid_solution():
  assert metrics.is_valid_solution(SOL, puzzle_with_blanks(SOL, range(0, 81, 2)))
  assert metrics.is_valid_solution(SOL, EMPTY)
  assert metrics.is_valid_solution(SOL.reshape(9, 9).astype(np.int8), SOL)


def test_invalid_rows_only():
  pred = SOL.reshape(9, 9).copy()
  # Swap two cells of column 0 inside box 0: columns and boxes stay permutations, rows 0 and 1 break.
  pred[0, 0], pred[1, 0] = pred[1, 0], pred[0, 0]
  assert sorted(pred[:, 0]) == list(range(1, 10))
  assert not metrics.is_valid_solution(pred.ravel(), EMPTY)


def test_invalid_columns_only():
  pred = SOL.reshape(9, 9).copy()
  # Swap two cells of row 0 inside box 0: rows and boxes stay permutations, columns 0 and 1 break.
  pred[0, 0], pred[0, 1] = pred[0, 1], pred[0, 0]
  assert not metrics.is_valid_solution(pred.ravel(), EMPTY)


def test_invalid_boxes_only():
  # Cyclic shifts: every row and column is a permutation of 1..9, the boxes are not.
  cyclic = np.array([[(r + c) % 9 + 1 for c in range(9)] for r in range(9)])
  assert all(sorted(cyclic[r]) == list(range(1, 10)) for r in range(9))
  assert all(sorted(cyclic[:, c]) == list(range(1, 10)) for c in range(9))
  assert not metrics.is_valid_solution(cyclic.ravel(), EMPTY)
  # Swapping columns 0 and 3 (different stacks) of a valid grid: same story.
  swapped = SOL.reshape(9, 9)[:, [3, 1, 2, 0, 4, 5, 6, 7, 8]]
  assert not metrics.is_valid_solution(swapped.ravel(), EMPTY)


def test_overwritten_given():
  other = SOL.copy()
  other[RECTANGLE] = other[[RECTANGLE[1], RECTANGLE[0], RECTANGLE[3], RECTANGLE[2]]]
  assert not np.array_equal(other, SOL)
  assert metrics.is_valid_solution(other, puzzle_with_blanks(SOL, RECTANGLE))  # both solve it
  assert metrics.is_valid_solution(SOL, puzzle_with_blanks(SOL, RECTANGLE))
  # With the rectangle given, the swapped grid is valid but changes givens.
  assert not metrics.is_valid_solution(other, puzzle_with_blanks(SOL, RECTANGLE[:3]))
  assert not metrics.is_valid_solution(other, SOL)


@pytest.mark.parametrize(
    'pred',
    [
        np.where(np.arange(81) == 40, -1, SOL),
        np.where(np.arange(81) == 40, 0, SOL),
        np.where(np.arange(81) == 40, 10, SOL),
        np.where(np.arange(81) == 40, np.nan, SOL.astype(float)),
        np.where(np.arange(81) == 40, 4.5, SOL.astype(float)),
        np.array([str(v) for v in SOL], dtype=object),
        np.array(['x'] + [str(v) for v in SOL[1:]], dtype=object),
        SOL[:80],
        np.concatenate([SOL, [1]]),
        np.full(81, -1),
    ],
)
def test_garbage_is_never_valid_and_never_raises(pred):
  ok = metrics.is_valid_solution(pred, EMPTY)
  # Only the all-string copy of SOLUTION is a legitimate grid.
  assert ok is (pred.dtype == object and pred[0] != 'x')
  acc = metrics.cell_accuracy_on_blanks(pred, puzzle_with_blanks(SOL, [40, 41]), SOL)
  assert 0.0 <= acc <= 1.0


def test_float_grid_of_integers_is_valid():
  assert metrics.is_valid_solution(SOL.astype(np.float32), EMPTY)


def test_cell_accuracy_on_blanks():
  puzzle = puzzle_with_blanks(SOL, range(10))  # 10 blanks: cells 0..9
  pred = SOL.copy()
  pred[[0, 1, 2]] = [-1, 0, (SOL[2] % 9) + 1]  # three blanks wrong (garbage, blank, wrong digit)
  pred[50] = -1  # a wrong given does not count: only blanks are scored
  assert metrics.cell_accuracy_on_blanks(pred, puzzle, SOL) == pytest.approx(0.7)
  assert metrics.cell_accuracy_on_blanks(SOL, puzzle, SOL) == 1.0
  assert metrics.cell_accuracy_on_blanks(np.full(81, -1), puzzle, SOL) == 0.0
  assert metrics.cell_accuracy_on_blanks(SOL[:20], puzzle, SOL) == 0.0
  assert math.isnan(metrics.cell_accuracy_on_blanks(SOL, SOL, SOL))


def test_sudoku_metrics_overall_and_per_bucket():
  easy = puzzle_with_blanks(SOL, range(36))  # 45 givens
  medium = puzzle_with_blanks(SOL, range(46))  # 35 givens
  hard = puzzle_with_blanks(SOL, range(56))  # 25 givens
  medium2 = puzzle_with_blanks(SOL, range(51))  # 30 givens
  pred_medium = SOL.copy()
  pred_medium[[0, 1]] = -1  # 2 of 46 blanks wrong -> not solved
  pred_hard = SOL.copy()
  preds = np.stack([SOL, pred_medium, pred_hard, np.full(81, 99)])
  puzzles = np.stack([easy, medium, hard, medium2]).astype(np.int8)
  solutions = np.stack([SOL] * 4).astype(np.int8)
  out = metrics.sudoku_metrics(preds, puzzles, solutions)
  assert out['count'] == 4
  assert out['solved_rate'] == pytest.approx(2 / 4)
  assert out['cell_accuracy'] == pytest.approx((36 + 44 + 56 + 0) / (36 + 46 + 56 + 51))
  assert (out['easy/count'], out['medium/count'], out['hard/count']) == (1, 2, 1)
  assert out['easy/solved_rate'] == 1.0 and out['easy/cell_accuracy'] == 1.0
  assert out['medium/solved_rate'] == 0.0
  assert out['medium/cell_accuracy'] == pytest.approx(44 / (46 + 51))
  assert out['hard/solved_rate'] == 1.0 and out['hard/cell_accuracy'] == 1.0


def test_sudoku_metrics_empty_bucket_is_nan():
  out = metrics.sudoku_metrics(SOL[None], puzzle_with_blanks(SOL, range(20))[None], SOL[None])
  assert out['easy/count'] == 1 and out['hard/count'] == 0
  assert math.isnan(out['hard/solved_rate']) and math.isnan(out['hard/cell_accuracy'])


def test_sudoku_metrics_matches_single_puzzle_functions():
  rng = np.random.default_rng(0)
  puzzles = np.stack([puzzle_with_blanks(SOL, rng.choice(81, k, replace=False)) for k in (20, 45, 55)])
  preds = np.stack([SOL, SOL, SOL])
  preds[1, rng.choice(81, 5, replace=False)] = rng.integers(-3, 12, 5)
  preds[2, :3] = [SOL[1], SOL[0], SOL[2]]
  out = metrics.sudoku_metrics(preds, puzzles, np.stack([SOL] * 3))
  solved = [metrics.is_valid_solution(p, q) for p, q in zip(preds, puzzles)]
  assert out['solved_rate'] == pytest.approx(np.mean(solved))


def test_sudoku_metrics_shape_errors():
  with pytest.raises(ValueError, match=r'preds must have shape \[N, 81\], got \[81\]'):
    metrics.sudoku_metrics(SOL, SOL[None], SOL[None])
  with pytest.raises(ValueError, match='same N, got 2, 1, 1'):
    metrics.sudoku_metrics(np.stack([SOL, SOL]), SOL[None], SOL[None])
  with pytest.raises(ValueError, match='puzzles must hold ints in 0..9'):
    metrics.sudoku_metrics(SOL[None], np.full((1, 81), -1), SOL[None])


def test_parse_prediction():
  np.testing.assert_array_equal(metrics.parse_prediction(SOLUTION), SOL)
  spaced = '\n'.join(' '.join(SOLUTION[r * 9 : r * 9 + 9]) for r in range(9))
  np.testing.assert_array_equal(metrics.parse_prediction(spaced), SOL)
  short = metrics.parse_prediction(SOLUTION[:70])
  np.testing.assert_array_equal(short[:70], SOL[:70])
  assert (short[70:] == -1).all()
  noisy = metrics.parse_prediction('x0.' + SOLUTION[3:] + '<eos>garbage')
  assert noisy[:3].tolist() == [-1, -1, -1]
  np.testing.assert_array_equal(noisy[3:], SOL[3:])
  assert noisy.shape == (81,)
  assert (metrics.parse_prediction('') == -1).all()
  assert (metrics.parse_prediction(None) == -1).all()
  assert (metrics.parse_prediction('١٢٣' * 30) == -1).all()  # non-ASCII digits are not cells' digits
  assert metrics.is_valid_solution(metrics.parse_prediction(spaced), EMPTY)


# Two generated puzzles, classified by a separate set-based singles solver (not the code under test): 23 givens that
# scanning fills, and 39 givens that it does not; the group follows the technique, not the givens count.
SCANNED_23 = ('000180704000000000802000000000006203010040006030000078050600090000310000904200000',
              '396185724571462389842937561485796213217843956639521478153674892728319645964258137')
BEYOND_39 = ('000201300391800000020000409006009041005017890009402035000005903050908124984003560',
             '467291358391854672528736419736589241245317896819462735172645983653978124984123567')


def test_beyond_singles_group_follows_the_technique_not_the_givens():
  out = metrics.sudoku_metrics(*(np.stack([grid(p[i]) for p in (SCANNED_23, BEYOND_39)]) for i in (1, 0, 1)))
  assert out['beyond_singles/count'] == 1 and out['hard/count'] == 1 and out['medium/count'] == 1
  wrong = np.stack([grid(SCANNED_23[1]), grid(SCANNED_23[1])])  # the 39-given puzzle answered wrong
  out = metrics.sudoku_metrics(wrong, np.stack([grid(SCANNED_23[0]), grid(BEYOND_39[0])]),
                               np.stack([grid(SCANNED_23[1]), grid(BEYOND_39[1])]))
  assert out['beyond_singles/solved_rate'] == 0.0 and out['hard/solved_rate'] == 1.0


def test_beyond_singles_group_holds_the_puzzles_scanning_cannot_fill():
  """Wikipedia's example puzzle falls to naked and hidden singles, Inkala's (21 givens) does not: only the latter is
  in `beyond_singles/`, which is scored like the difficulty buckets."""
  wiki = grid('530070000600195000098000060800060003400803001700020006060000280000419005000080079')
  wiki_solution = grid('534678912672195348198342567859761423426853791713924856961537284287419635345286179')
  inkala = grid('800000000003600000070090200050007000000045700000100030001000068008500010090000400')
  inkala_solution = grid('812753649943682175675491283154237896369845721287169534521974368438526917796318452')
  puzzles, solutions = np.stack([wiki, inkala]), np.stack([wiki_solution, inkala_solution])
  out = metrics.sudoku_metrics(solutions, puzzles, solutions)
  assert out['beyond_singles/count'] == 1 and out['beyond_singles/solved_rate'] == 1.0
  wrong = solutions.copy()
  wrong[1, 1] = wrong[1, 2]  # Inkala's cell 1 is blank: a repeated digit, not solved
  out = metrics.sudoku_metrics(wrong, puzzles, solutions)
  assert out['beyond_singles/solved_rate'] == 0.0 and out['solved_rate'] == 0.5
  assert out['beyond_singles/cell_accuracy'] == pytest.approx(59 / 60)
