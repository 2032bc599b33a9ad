"""Generator: uniqueness (checked by an independent brute force), determinism, buckets."""

import numpy as np
import pytest

from hackable_diffusion.tasks.sudoku import generator, solver


def brute_force_count(cells, limit: int = 2) -> int:
  """Independent reference: plain recursion on Python sets, no bitmasks, no propagation."""
  g = [[int(cells[r * 9 + c]) for c in range(9)] for r in range(9)]

  def peers_values(r, c):
    vals = set(g[r]) | {g[k][c] for k in range(9)}
    br, bc = 3 * (r // 3), 3 * (c // 3)
    return vals | {g[br + i][bc + j] for i in range(3) for j in range(3)}

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


def bucket_of(givens: int) -> str:  # docs/reference.md "Sudoku benchmark", written out independently
  return 'easy' if givens >= 40 else ('medium' if givens >= 30 else 'hard')


@pytest.mark.parametrize('lo, hi', [(40, 50), (30, 39), (22, 29)])
def test_puzzles_are_unique_and_match_their_solution(lo, hi):
  puzzles, solutions = generator.generate_puzzles(4, seed=7, min_givens=lo, max_givens=hi)
  assert puzzles.shape == solutions.shape == (4, 81)
  assert puzzles.dtype == solutions.dtype == np.int8
  for puzzle, solution in zip(puzzles, solutions):
    assert is_complete_valid(solution)
    given = puzzle > 0
    np.testing.assert_array_equal(puzzle[given], solution[given])
    assert brute_force_count(puzzle, 2) == 1
    np.testing.assert_array_equal(solver.solve(puzzle), solution)
    givens = int(given.sum())
    assert givens <= hi  # removal always gets down to hi; hard targets may stop above lo
    if lo >= 30:
      assert givens >= lo
    else:
      assert bucket_of(givens) == 'hard'


def test_unreachable_target_stops_at_a_minimal_puzzle():
  puzzles, solutions = generator.generate_puzzles(1, seed=3, min_givens=17, max_givens=17)
  puzzle = puzzles[0]
  givens = np.flatnonzero(puzzle)
  assert 17 < len(givens) < 30  # real count reported, not the target
  assert solver.count_solutions(puzzle) == 1
  for i in givens:  # minimal: removing any remaining given breaks uniqueness
    reduced = puzzle.copy()
    reduced[i] = 0
    assert solver.count_solutions(reduced) == 2
  assert brute_force_count(puzzle) == 1


def test_target_range_is_covered():
  puzzles, _ = generator.generate_puzzles(40, seed=0, min_givens=40, max_givens=44)
  givens = np.count_nonzero(puzzles, axis=1)
  assert set(givens.tolist()) == {40, 41, 42, 43, 44}


def test_same_seed_same_output_different_seed_different():
  a = generator.generate_puzzles(5, seed=11, min_givens=30, max_givens=45)
  b = generator.generate_puzzles(5, seed=11, min_givens=30, max_givens=45)
  c = generator.generate_puzzles(5, seed=12, min_givens=30, max_givens=45)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.any(np.all(a[1] == c[1], axis=1))  # no shared solution grid
  assert len({p.tobytes() for p in a[1]}) == 5  # distinct grids within a call


def test_output_independent_of_workers_chunking_and_start():
  kwargs = dict(seed=5, min_givens=24, max_givens=45)
  serial = generator.generate_puzzles(8, **kwargs, chunk_size=64)
  parallel = generator.generate_puzzles(8, **kwargs, workers=2, chunk_size=3)
  np.testing.assert_array_equal(serial[0], parallel[0])
  np.testing.assert_array_equal(serial[1], parallel[1])
  tail = generator.generate_puzzles(3, **kwargs, start_index=5)
  np.testing.assert_array_equal(serial[0][5:], tail[0])


def test_full_grids_are_diverse():
  _, solutions = generator.generate_puzzles(30, seed=1, min_givens=50, max_givens=50)
  # No fixed pattern leaks through: across 30 grids every cell takes many different digits.
  per_cell = [len(set(solutions[:, i].tolist())) for i in range(81)]
  assert min(per_cell) >= 5


def test_generate_dataset_bucket_counts():
  data = generator.generate_dataset(
      12, seed=2, bucket_weights={'easy': 1, 'medium': 0, 'hard': 2}, chunk_size=5
  )
  givens = np.count_nonzero(data.puzzles, axis=1)
  np.testing.assert_array_equal(data.givens, givens)
  buckets = [bucket_of(int(g)) for g in givens]
  assert buckets.count('easy') == 4 and buckets.count('hard') == 8 and buckets.count('medium') == 0
  assert data.buckets == buckets
  assert buckets != ['easy'] * 4 + ['hard'] * 8  # shuffled, not in blocks
  for puzzle, solution in zip(data.puzzles, data.solutions):
    assert is_complete_valid(solution)
    assert solver.count_solutions(puzzle) == 1


def test_generate_dataset_respects_bucket_ranges():
  config = generator.GeneratorConfig(easy_givens=(41, 42), medium_givens=(33, 33), hard_givens=(28, 29))
  data = generator.generate_dataset(9, seed=4, config=config)
  for g, b in zip(data.givens.tolist(), data.buckets):
    assert g in {'easy': (41, 42), 'medium': (33,), 'hard': (28, 29)}[b]
  assert sorted(data.buckets) == ['easy'] * 3 + ['hard'] * 3 + ['medium'] * 3


@pytest.mark.parametrize(
    'n, weights, expected',
    [
        (5, {'easy': 1, 'hard': 1}, {'easy': 3, 'medium': 0, 'hard': 2}),
        (10, None, {'easy': 4, 'medium': 3, 'hard': 3}),
        (7, {'medium': 0.2, 'hard': 0.8}, {'easy': 0, 'medium': 1, 'hard': 6}),
        (0, None, {'easy': 0, 'medium': 0, 'hard': 0}),
    ],
)
def test_assign_buckets_exact_counts(n, weights, expected):
  names = generator.assign_buckets(n, seed=0, bucket_weights=weights)
  assert {b: names.count(b) for b in generator.BUCKETS} == expected


def test_difficulty_bucket_boundaries():
  assert [generator.difficulty_bucket(g) for g in (81, 40, 39, 30, 29, 17)] == [
      'easy', 'easy', 'medium', 'medium', 'hard', 'hard'
  ]


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(easy_givens=(35, 45)), r'easy_givens must be .* 40 <= lo <= hi <= 81, got \(35, 45\)'),
        (dict(medium_givens=(39, 30)), r'medium_givens .* got \(39, 30\)'),
        (dict(hard_givens=(16, 25)), r'hard_givens .* got \(16, 25\)'),
        (dict(max_attempts=0), 'max_attempts must be >= 1, got 0'),
    ],
)
def test_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    generator.GeneratorConfig(**kwargs)


def test_argument_validation():
  with pytest.raises(ValueError, match='min_givens=30, max_givens=20'):
    generator.generate_puzzles(1, seed=0, min_givens=30, max_givens=20)
  with pytest.raises(ValueError, match='n must be >= 0, got -1'):
    generator.generate_puzzles(-1, seed=0, min_givens=30, max_givens=40)
  with pytest.raises(ValueError, match='workers must be >= 1, got 0'):
    generator.generate_puzzles(1, seed=0, min_givens=30, max_givens=40, workers=0)
  with pytest.raises(ValueError, match=r"unknown buckets \['extreme'\]"):
    generator.assign_buckets(3, seed=0, bucket_weights={'extreme': 1})
  with pytest.raises(ValueError, match='not all 0'):
    generator.assign_buckets(3, seed=0, bucket_weights={'easy': 0})
  with pytest.raises(ValueError, match='not all 0'):
    generator.assign_buckets(3, seed=0, bucket_weights={'easy': -1, 'hard': 2})
  empty_puzzles, empty_solutions = generator.generate_puzzles(0, seed=0, min_givens=30, max_givens=40)
  assert empty_puzzles.shape == empty_solutions.shape == (0, 81)
