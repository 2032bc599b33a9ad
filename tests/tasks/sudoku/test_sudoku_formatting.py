"""Grid <-> text round trips and error messages."""

import numpy as np
import pytest

from hackable_diffusion.tasks.sudoku import formatting

PUZZLE = '530070000600195000098000060800060003400803001700020006060000280000419005000080079'
SOLUTION = '534678912672195348198342567859761423426853791713924856961537284287419635345286179'


def test_round_trips():
  puzzle = formatting.parse_grid(PUZZLE)
  assert puzzle.shape == (81,) and puzzle.dtype == np.int8
  assert puzzle[:3].tolist() == [5, 3, 0] and puzzle[-1] == 9
  assert formatting.puzzle_to_prompt(puzzle) == PUZZLE
  solution = formatting.parse_grid(SOLUTION)
  assert formatting.solution_to_completion(solution) == SOLUTION
  assert formatting.puzzle_to_prompt(puzzle.reshape(9, 9)) == PUZZLE


def test_parse_accepts_dots_and_whitespace():
  dotted = PUZZLE.replace('0', '.')
  spaced = '\n'.join(' '.join(dotted[r * 9 : r * 9 + 9]) for r in range(9)) + '\n'
  expected = np.array([int(ch) for ch in PUZZLE], dtype=np.int8)
  np.testing.assert_array_equal(formatting.parse_grid(dotted), expected)
  np.testing.assert_array_equal(formatting.parse_grid(spaced), expected)
  np.testing.assert_array_equal(formatting.parse_grid('\t' + PUZZLE[:40] + ' \n' + PUZZLE[40:]), expected)


@pytest.mark.parametrize(
    'text, message',
    [
        (PUZZLE[:80], r'expected 81 cells .*got 80'),
        (PUZZLE + '1', r'expected 81 cells .*got 82'),
        ('', r'got 0'),
        (PUZZLE[:10] + 'x' + PUZZLE[11:], r"invalid character 'x' at position 10"),
        ('|' + PUZZLE, r"invalid character '\|' at position 0"),
        (PUZZLE[:5] + '-' + PUZZLE[6:], r"invalid character '-' at position 5"),
    ],
)
def test_parse_errors(text, message):
  with pytest.raises(ValueError, match=message):
    formatting.parse_grid(text)


def test_parse_rejects_non_str():
  with pytest.raises(ValueError, match='expects a str, got bytes'):
    formatting.parse_grid(PUZZLE.encode())


def test_completion_needs_a_complete_grid():
  with pytest.raises(ValueError, match=r'complete grid, got 51 blank cells \(first at cell 2\)'):
    formatting.solution_to_completion(formatting.parse_grid(PUZZLE))


def test_prompt_validates_grid():
  with pytest.raises(ValueError, match='got 12 at cell 3'):
    bad = formatting.parse_grid(PUZZLE).astype(np.int32)
    bad[3] = 12
    formatting.puzzle_to_prompt(bad)
  with pytest.raises(ValueError, match=r'shape \[81\] or \[9, 9\]'):
    formatting.puzzle_to_prompt(np.zeros(80, np.int8))


def test_render_grid():
  text = formatting.render_grid(formatting.parse_grid(PUZZLE))
  lines = text.split('\n')
  assert len(lines) == 11
  assert lines[0] == '5 3 . | . 7 . | . . .'
  assert lines[3] == lines[7] == '------+-------+------'
  assert lines[10] == '. . . | . 8 . | . 7 9'
  # Digits read back in order give the puzzle again.
  assert formatting.parse_grid(text.replace('|', '').replace('-', '').replace('+', '')).tolist() == [
      int(ch) for ch in PUZZLE
  ]
  garbage = np.full(81, 5)
  garbage[0], garbage[1] = -1, 11
  assert formatting.render_grid(garbage).split('\n')[0] == '? ? 5 | 5 5 5 | 5 5 5'
  assert formatting.render_grid(np.zeros(81, np.int8), blank='_').startswith('_ _ _ | ')
  with pytest.raises(ValueError, match='81 cells'):
    formatting.render_grid(np.zeros(10))
