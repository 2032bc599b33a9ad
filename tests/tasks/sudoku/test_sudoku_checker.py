"""The Sudoku checker (`tasks/sudoku/checker.py`) against a brute-force rule check written here with loops."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hackable_diffusion.data.tokenizer import train_tokenizer
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks import base
from hackable_diffusion.tasks.sudoku.checker import SudokuChecker
from hackable_diffusion.tasks.sudoku.task import SudokuTask

DIGIT_IDS = np.array([17, 3, 9, 21, 5, 30, 11, 2, 26])  # ids of '1'..'9' in a made-up vocabulary of 32
VOCAB = 32


def brute_force(canvas: np.ndarray) -> np.ndarray:
  """`[B, C]` bool: cell (r, c) of the first 81 positions is flagged when its token is no digit id or another cell of
  its row, column or box holds the same token."""
  out = np.zeros(canvas.shape, bool)
  for b in range(canvas.shape[0]):
    grid = canvas[b, :81].reshape(9, 9)
    for r in range(9):
      for c in range(9):
        token = grid[r, c]
        if token not in DIGIT_IDS:
          out[b, r * 9 + c] = True
          continue
        for rr in range(9):
          for cc in range(9):
            same_unit = rr == r or cc == c or (rr // 3 == r // 3 and cc // 3 == c // 3)
            if (rr, cc) != (r, c) and same_unit and grid[rr, cc] == token:
              out[b, r * 9 + c] = True
  return out


def _solutions(n: int, seed: int) -> np.ndarray:
  """`[n, 81]` valid grids (digits 1-9): the pattern `(3 r + r // 3 + c) % 9`, its digits relabelled and its rows
  (columns) shuffled inside their bands (stacks)."""
  rng = np.random.default_rng(seed)
  r, c = np.divmod(np.arange(81), 9)
  base_grid = ((3 * r + r // 3 + c) % 9).reshape(9, 9)
  out = []
  for _ in range(n):
    rows = np.concatenate([3 * b + rng.permutation(3) for b in range(3)])
    cols = np.concatenate([3 * b + rng.permutation(3) for b in range(3)])
    out.append((rng.permutation(9)[base_grid[rows][:, cols]] + 1).reshape(81))
  return np.stack(out)


def test_the_checker_matches_a_brute_force_check_on_random_grids():
  rng = np.random.default_rng(0)
  grids = _solutions(4, seed=3)  # [4, 81] digits 1-9
  canvases = []
  for grid in grids:
    canvases.append(DIGIT_IDS[grid - 1])  # a valid grid: nothing flagged
    broken = grid.copy()  # a few cells changed to other digits: clashes
    cells = rng.choice(81, size=3, replace=False)
    broken[cells] = rng.integers(1, 10, size=3)
    canvases.append(DIGIT_IDS[broken - 1])
    swapped = DIGIT_IDS[grid - 1].copy()  # a non-digit token in one cell
    swapped[rng.integers(81)] = 0
    canvases.append(swapped)
  canvases.append(DIGIT_IDS[rng.integers(0, 9, size=81)])  # random digits: many clashes
  canvases.append(rng.integers(0, VOCAB, size=81))  # random tokens
  canvas = np.stack(canvases).astype(np.int32)  # [B, 81]
  canvas = np.concatenate([canvas, rng.integers(0, VOCAB, size=(len(canvas), 15))], axis=1)  # positions >= 81
  got = np.asarray(jax.jit(lambda c: SudokuChecker(digit_ids=DIGIT_IDS)(c))(canvas))
  want = brute_force(canvas)
  np.testing.assert_array_equal(got, want)
  assert not got[0].any() and got[1].any() and got[2].sum() == 1  # the cases are what they claim to be
  assert not got[:, 81:].any()


def test_the_task_builds_it_from_its_tokenizer():
  tok = train_tokenizer(["0123456789"])
  task = SudokuTask()
  checker = base.checker(task, tok)
  np.testing.assert_array_equal(np.asarray(checker.digit_ids), tok.token_ids_for("123456789"))
  grid = _solutions(1, seed=5)[0]
  ids = np.asarray(tok.token_ids_for("0123456789"))[grid][None]  # [1, 81] a valid grid
  assert not np.asarray(checker(ids)).any()
  ids[0, 0] = ids[0, 1]  # a repeated digit in row 0: both cells flagged
  flagged = np.asarray(checker(ids))[0]
  assert flagged[0] and flagged[1]
  assert base.checker(base.BaseTask(), tok) is None and base.checker(None, tok) is None


def test_bad_inputs_are_one_line_errors():
  class TwoTokenDigits:
    def token_ids_for(self, chars):
      return [1, 2]

  with pytest.raises(ConfigError, match="one token per digit"):
    SudokuChecker.for_tokenizer(TwoTokenDigits())
  with pytest.raises(ValueError, match="canvas of 80 positions"):
    SudokuChecker(digit_ids=DIGIT_IDS)(np.zeros((1, 80), np.int32))
