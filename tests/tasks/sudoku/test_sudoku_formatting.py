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


def test_parse_accepts_every_blank_and_the_rendered_grid():
  """'.', '0', '_' blanks; spaces, newlines and render_grid's '|', '-', '+' separators: all the same puzzle."""
  expected = formatting.parse_grid(PUZZLE)
  rendered = formatting.render_grid(expected)
  assert '|' in rendered and '+' in rendered and '-' in rendered
  for text in (PUZZLE.replace('0', '_'), rendered, formatting.render_grid(expected, blank='_'),
               formatting.render_grid(expected, blank='0'), rendered.replace('\n', ' '),
               PUZZLE[:20].replace('0', '.') + PUZZLE[20:50].replace('0', '_') + PUZZLE[50:]):
    np.testing.assert_array_equal(formatting.parse_grid(text), expected)
    np.testing.assert_array_equal(formatting.parse_puzzle(text), expected)
    assert formatting.count_cells(text) == 81
  assert formatting.count_cells(rendered.split('\n')[0]) == 9  # one line of a pasted grid


@pytest.mark.parametrize(
    'text, message',
    [
        ('55' + PUZZLE[2:], r'contradictory givens: digit 5 at r1c1 and r1c2 \(same row 1\)$'),
        (PUZZLE[:9] + '5' + PUZZLE[10:], r'digit 5 at r1c1 and r2c1 \(same column 1\)$'),
        (PUZZLE[:10] + '5' + PUZZLE[11:], r'digit 5 at r1c1 and r2c2 \(same box 1\)$'),
        (PUZZLE[:80] + '1', r'digit 1 at r5c9 and r9c9 \(same column 9\)$'),
    ],
)
def test_parse_puzzle_names_clashing_givens(text, message):
  formatting.parse_grid(text)  # the notation is fine
  with pytest.raises(ValueError, match=message):
    formatting.parse_puzzle(text)
  assert formatting.find_conflict(formatting.parse_grid(PUZZLE)) is None


def test_solution_verdict():
  puzzle, solution = formatting.parse_grid(PUZZLE), formatting.parse_grid(SOLUTION)
  ok, line = formatting.solution_verdict(solution, puzzle)
  assert ok and line == 'valid: a complete grid with no clash in any row, column or box, keeping all 30 givens'
  ok, line = formatting.solution_verdict(puzzle, puzzle)  # the puzzle itself: blanks left
  assert not ok and line == 'not valid: 51 cell(s) not a digit 1-9'
  swapped = solution.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # 5 3 -> 3 5: rows fine, columns and givens broken
  ok, line = formatting.solution_verdict(swapped, puzzle)
  assert not ok and 'same column 1) clash' in line and '2 given(s) changed (first r1c1: 5 -> 3)' in line
  other = formatting.parse_grid(SOLUTION)  # a valid grid that does not keep this puzzle's givens
  assert formatting.solution_verdict(other, np.where(puzzle > 0, puzzle % 9 + 1, 0).astype(np.int8))[0] is False
  garbage = np.full(81, -1)
  assert formatting.solution_verdict(garbage, puzzle) == (False, 'not valid: 81 cell(s) not a digit 1-9; '
                                                          '30 given(s) changed (first r1c1: 5 -> -1)')


@pytest.mark.parametrize(
    'text, message',
    [
        (PUZZLE[:80], r'expected 81 cells .*got 80'),
        (PUZZLE + '1', r'expected 81 cells .*got 82'),
        ('', r'got 0'),
        (PUZZLE[:10] + 'x' + PUZZLE[11:], r"invalid character 'x' at position 10"),
        (PUZZLE[:5] + '?' + PUZZLE[6:], r"invalid character '\?' at position 5"),
        ('53*' + PUZZLE[3:], r"invalid character '\*' at position 2: expected a digit 1-9, a blank"),
        (PUZZLE[:5] + '-' + PUZZLE[6:], r'expected 81 cells .*got 80'),  # a separator is no cell
        (PUZZLE.replace('0', '.') + '_', r'got 82'),
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
  # The picture reads back as the puzzle (separators ignored).
  assert formatting.parse_grid(text).tolist() == [int(ch) for ch in PUZZLE]
  garbage = np.full(81, 5)
  garbage[0], garbage[1] = -1, 11
  assert formatting.render_grid(garbage).split('\n')[0] == '? ? 5 | 5 5 5 | 5 5 5'
  assert formatting.render_grid(np.zeros(81, np.int8), blank='_').startswith('_ _ _ | ')
  with pytest.raises(ValueError, match='81 cells'):
    formatting.render_grid(np.zeros(10))
