"""Random 9x9 Sudoku puzzles with a unique solution.

A puzzle is made in two steps:

1. A random full grid: the three diagonal boxes get random permutations of 1..9 (they share no row,
   column or box), the solver completes the grid, and a random validity-preserving transform is applied
   (digit relabelling, row/column permutations within bands/stacks, band/stack permutations, transpose).
2. Cells are blanked in a random order, each removal kept only if the puzzle stays uniquely solvable,
   until the target number of givens (drawn uniformly in ``[min_givens, max_givens]``) is reached. If a
   removal would break uniqueness the cell stays, so a target below the puzzle's minimal size ends at
   the lowest count this order reaches; the real number of givens is what gets reported.

Each puzzle has its own ``numpy.random.Generator`` seeded with ``[seed, index, attempt]``, so the
output depends only on ``seed`` and the puzzle's index: never on the number of workers or the chunking.

Difficulty follows the published recipes (docs/reference.md, "Sudoku benchmark"): easy >= 40 givens,
medium 30-39, hard < 30.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from hackable_diffusion.tasks.sudoku import solver

__all__ = [
    'BUCKETS',
    'GeneratorConfig',
    'SudokuDataset',
    'assign_buckets',
    'difficulty_bucket',
    'generate_bucketed',
    'generate_dataset',
    'generate_puzzles',
]

BUCKETS = ('easy', 'medium', 'hard')
_BUCKET_BOUNDS = {'easy': (40, 81), 'medium': (30, 39), 'hard': (17, 29)}  # 17 = fewest possible givens
_ROW_OF, _COL_OF, _BOX_OF = solver.ROW_OF, solver.COL_OF, solver.BOX_OF
_UNITS_OF = tuple(
    (
        tuple(j for j in range(81) if _ROW_OF[j] == _ROW_OF[i] and j != i),
        tuple(j for j in range(81) if _COL_OF[j] == _COL_OF[i] and j != i),
        tuple(j for j in range(81) if _BOX_OF[j] == _BOX_OF[i] and j != i),
    )
    for i in range(81)
)


def difficulty_bucket(num_givens: int) -> str:
  """'easy' (>= 40 givens), 'medium' (30-39) or 'hard' (< 30)."""
  if num_givens >= 40:
    return 'easy'
  if num_givens >= 30:
    return 'medium'
  return 'hard'


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
  """Target givens range per difficulty bucket (inclusive), used by `generate_dataset`.

  Each range must lie inside its bucket. Random minimal puzzles have ~22-27 givens, so hard targets
  below that end at the minimal count; they stay in the hard bucket either way.
  """

  easy_givens: tuple[int, int] = (40, 50)
  medium_givens: tuple[int, int] = (30, 39)
  hard_givens: tuple[int, int] = (22, 29)
  max_attempts: int = 100  # fresh puzzles tried per slot before giving up on landing in its bucket

  def __post_init__(self):
    for bucket in BUCKETS:
      lo, hi = self.givens_range(bucket)
      b_lo, b_hi = _BUCKET_BOUNDS[bucket]
      if not b_lo <= lo <= hi <= b_hi:
        raise ValueError(
            f'{bucket}_givens must be (lo, hi) with {b_lo} <= lo <= hi <= {b_hi}, got ({lo}, {hi})'
        )
    if self.max_attempts < 1:
      raise ValueError(f'max_attempts must be >= 1, got {self.max_attempts}')

  def givens_range(self, bucket: str) -> tuple[int, int]:
    if bucket not in BUCKETS:
      raise ValueError(f'bucket must be one of {BUCKETS}, got {bucket!r}')
    lo, hi = getattr(self, f'{bucket}_givens')
    return int(lo), int(hi)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SudokuDataset:
  """Generated puzzles: ``puzzles``/``solutions`` ``[n, 81]`` int8, ``givens`` ``[n]`` int32."""

  puzzles: np.ndarray
  solutions: np.ndarray
  givens: np.ndarray

  def __len__(self) -> int:
    return int(self.puzzles.shape[0])

  @property
  def buckets(self) -> list[str]:
    return [difficulty_bucket(int(g)) for g in self.givens]


# --------------------------------------------------------------------------------------------------
# One puzzle.


def _random_full_grid(rng: np.random.Generator) -> np.ndarray:
  """A random complete grid, ``[81]`` int8."""
  cells = [0] * 81
  for box in (0, 4, 8):
    digits = rng.permutation(9) + 1
    r0, c0 = (box // 3) * 3, (box % 3) * 3
    for k in range(9):
      cells[(r0 + k // 3) * 9 + c0 + k % 3] = int(digits[k])
  rows, cols, boxes, empties = solver.masks_from_cells(cells)
  solver.search(rows, cols, boxes, empties, 1, cells)  # always solvable: diagonal boxes are independent
  grid = np.asarray(cells, dtype=np.int8).reshape(9, 9)
  # Validity-preserving transforms, so the solver's fixed digit order leaves no visible bias.
  bands = rng.permutation(3)
  row_order = np.concatenate([b * 3 + rng.permutation(3) for b in bands])
  stacks = rng.permutation(3)
  col_order = np.concatenate([s * 3 + rng.permutation(3) for s in stacks])
  grid = grid[row_order][:, col_order]
  if rng.random() < 0.5:
    grid = grid.T
  relabel = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.int8)
  return relabel[grid].reshape(81)


def _stays_unique_without(
    cells: list[int], rows: list[int], cols: list[int], boxes: list[int], empties: list[int], i: int
) -> bool:
  """Whether a unique puzzle stays unique once cell ``i`` is blanked.

  Precondition: ``cells``/masks describe a puzzle with exactly one solution, ``i`` is a given, and the
  masks already have ``i``'s digit removed (``cells[i]`` still holds it, ``empties`` excludes it). The
  puzzle without ``i`` is unique iff no solution puts another digit in ``i`` — the same answer as
  ``count_solutions(puzzle, limit=2) == 1``, but each branch only has to look for *one* solution.
  """
  bit = 1 << (cells[i] - 1)
  r, c, b = _ROW_OF[i], _COL_OF[i], _BOX_OF[i]
  cand = ~(rows[r] | cols[c] | boxes[b]) & solver.ALL_DIGITS
  if cand == bit:  # naked single: the remaining givens force the digit
    return True
  for unit in _UNITS_OF[i]:  # hidden single: no other blank of a unit can take the digit
    for j in unit:
      if cells[j] == 0 and not (rows[_ROW_OF[j]] | cols[_COL_OF[j]] | boxes[_BOX_OF[j]]) & bit:
        break
    else:
      return True
  others = cand ^ bit
  while others:
    d = others & -others
    others ^= d
    rows[r] |= d
    cols[c] |= d
    boxes[b] |= d
    found = solver.search(rows, cols, boxes, empties, 1)
    rows[r] ^= d
    cols[c] ^= d
    boxes[b] ^= d
    if found:
      return False
  return True


def _make_puzzle(rng: np.random.Generator, target_givens: int) -> tuple[np.ndarray, np.ndarray]:
  """``(puzzle, solution)`` ``[81]`` int8 with as close to ``target_givens`` givens as uniqueness allows."""
  solution = _random_full_grid(rng)
  cells = [int(v) for v in solution]
  rows, cols, boxes, empties = solver.masks_from_cells(cells)
  givens = 81
  for i in rng.permutation(81).tolist():
    if givens <= target_givens:
      break
    bit = 1 << (cells[i] - 1)
    r, c, b = _ROW_OF[i], _COL_OF[i], _BOX_OF[i]
    rows[r] ^= bit
    cols[c] ^= bit
    boxes[b] ^= bit
    if _stays_unique_without(cells, rows, cols, boxes, empties, i):
      cells[i] = 0
      empties.append(i)
      givens -= 1
    else:
      rows[r] |= bit
      cols[c] |= bit
      boxes[b] |= bit
  return np.asarray(cells, dtype=np.int8), solution


# A task: (seed, index, lo, hi, accept_lo, accept_hi, max_attempts). The puzzle's target givens is drawn
# in [lo, hi]; results with givens outside [accept_lo, accept_hi] are redrawn (attempt + 1).
_Task = tuple[int, int, int, int, int, int, int]


def _run_task(task: _Task) -> tuple[np.ndarray, np.ndarray]:
  seed, index, lo, hi, accept_lo, accept_hi, max_attempts = task
  for attempt in range(max_attempts):
    rng = np.random.default_rng([seed, index, attempt])
    target = int(rng.integers(lo, hi + 1))
    puzzle, solution = _make_puzzle(rng, target)
    if accept_lo <= int(np.count_nonzero(puzzle)) <= accept_hi:
      return puzzle, solution
  raise RuntimeError(
      f'puzzle {index} (seed {seed}) did not land in [{accept_lo}, {accept_hi}] givens after '
      f'{max_attempts} attempts; widen the givens range'
  )


def _run_chunk(tasks: Sequence[_Task]) -> tuple[np.ndarray, np.ndarray]:
  pairs = [_run_task(t) for t in tasks]
  return np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])


def _run_tasks(
    tasks: Sequence[_Task],
    *,
    workers: int,
    chunk_size: int,
    progress: Callable[[int], None] | None,
    mp_context: str,
) -> tuple[np.ndarray, np.ndarray]:
  if workers < 1:
    raise ValueError(f'workers must be >= 1, got {workers}')
  if chunk_size < 1:
    raise ValueError(f'chunk_size must be >= 1, got {chunk_size}')
  if not tasks:
    empty = np.zeros((0, 81), dtype=np.int8)
    return empty, empty.copy()
  chunks = [tasks[k : k + chunk_size] for k in range(0, len(tasks), chunk_size)]
  results = []
  if workers == 1 or len(chunks) == 1:
    for chunk in chunks:
      results.append(_run_chunk(chunk))
      if progress is not None:
        progress(len(chunk))
  else:
    # 'spawn' by default: forking a process that already runs JAX threads can deadlock.
    ctx = multiprocessing.get_context(mp_context)
    with ctx.Pool(min(workers, len(chunks))) as pool:
      for result in pool.imap(_run_chunk, chunks):
        results.append(result)
        if progress is not None:
          progress(len(result[0]))
  return np.concatenate([p for p, _ in results]), np.concatenate([s for _, s in results])


# --------------------------------------------------------------------------------------------------
# Public API.


def generate_puzzles(
    n: int,
    *,
    seed: int,
    min_givens: int,
    max_givens: int,
    start_index: int = 0,
    workers: int = 1,
    chunk_size: int = 64,
    progress: Callable[[int], None] | None = None,
    mp_context: str = 'spawn',
) -> tuple[np.ndarray, np.ndarray]:
  """``n`` uniquely solvable puzzles and their solutions, each ``[n, 81]`` int8 (0 = blank).

  Puzzle ``k`` is a pure function of ``(seed, start_index + k, min_givens, max_givens)``. Its target
  givens is uniform in ``[min_givens, max_givens]``; when uniqueness stops the removal earlier the
  puzzle keeps more givens (count them with ``np.count_nonzero(puzzles, axis=1)``).

  Args:
    n: number of puzzles.
    seed: non-negative int.
    min_givens, max_givens: inclusive target range, ``17 <= min_givens <= max_givens <= 81``.
    start_index: index of the first puzzle in the seed's stream (to extend an earlier call).
    workers: processes; 1 runs in this process. The output does not depend on it.
    chunk_size: puzzles per task sent to a worker.
    progress: called with the number of puzzles finished after each chunk (e.g. ``tqdm.update``).
    mp_context: multiprocessing start method for ``workers > 1``.
  """
  _check_count(n, seed)
  if not 17 <= min_givens <= max_givens <= 81:
    raise ValueError(
        f'need 17 <= min_givens <= max_givens <= 81, got min_givens={min_givens}, max_givens={max_givens}'
    )
  tasks = [(seed, start_index + k, min_givens, max_givens, 0, 81, 1) for k in range(n)]
  return _run_tasks(tasks, workers=workers, chunk_size=chunk_size, progress=progress, mp_context=mp_context)


def assign_buckets(n: int, *, seed: int, bucket_weights: Mapping[str, float] | None = None) -> list[str]:
  """``n`` bucket names in random order, with counts proportional to ``bucket_weights``.

  Counts are exact (largest remainder rounding), e.g. weights ``{'easy': 1, 'hard': 1}`` and ``n=5``
  give 3 easy and 2 hard (ties go to the bucket listed first in `BUCKETS`). Default: equal thirds.
  """
  _check_count(n, seed)
  weights = dict(bucket_weights) if bucket_weights is not None else {b: 1.0 for b in BUCKETS}
  unknown = sorted(set(weights) - set(BUCKETS))
  if unknown:
    raise ValueError(f'bucket_weights has unknown buckets {unknown}; known: {list(BUCKETS)}')
  w = np.array([float(weights.get(b, 0.0)) for b in BUCKETS])
  if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
    raise ValueError(f'bucket_weights must be finite, >= 0 and not all 0, got {weights}')
  exact = n * w / w.sum()
  counts = np.floor(exact).astype(int)
  remainder = exact - counts
  for k in np.argsort(-remainder, kind='stable')[: n - counts.sum()]:
    counts[k] += 1
  names = [b for b, c in zip(BUCKETS, counts) for _ in range(c)]
  order = np.random.default_rng([seed, 0x5EED]).permutation(n)
  return [names[k] for k in order]


def generate_bucketed(
    buckets: Sequence[str],
    *,
    seed: int,
    start_index: int = 0,
    config: GeneratorConfig = GeneratorConfig(),
    workers: int = 1,
    chunk_size: int = 64,
    progress: Callable[[int], None] | None = None,
    mp_context: str = 'spawn',
) -> SudokuDataset:
  """One puzzle per entry of ``buckets``, each landing in the named difficulty bucket.

  Puzzle ``k`` depends only on ``(seed, start_index + k, buckets[k], config)``; a result outside its
  bucket (a hard target that stopped at a 30+ givens minimal puzzle) is redrawn.
  """
  _check_count(len(buckets), seed)
  tasks = []
  for k, bucket in enumerate(buckets):
    lo, hi = config.givens_range(bucket)
    accept_lo, accept_hi = _BUCKET_BOUNDS[bucket]
    tasks.append((seed, start_index + k, lo, hi, accept_lo, accept_hi, config.max_attempts))
  puzzles, solutions = _run_tasks(
      tasks, workers=workers, chunk_size=chunk_size, progress=progress, mp_context=mp_context
  )
  givens = np.count_nonzero(puzzles, axis=1).astype(np.int32)
  return SudokuDataset(puzzles=puzzles, solutions=solutions, givens=givens)


def generate_dataset(
    n: int,
    *,
    seed: int,
    bucket_weights: Mapping[str, float] | None = None,
    config: GeneratorConfig = GeneratorConfig(),
    workers: int = 1,
    chunk_size: int = 64,
    progress: Callable[[int], None] | None = None,
    mp_context: str = 'spawn',
) -> SudokuDataset:
  """``n`` puzzles with a difficulty mix: exact bucket counts from `assign_buckets`, random order."""
  buckets = assign_buckets(n, seed=seed, bucket_weights=bucket_weights)
  return generate_bucketed(
      buckets,
      seed=seed,
      config=config,
      workers=workers,
      chunk_size=chunk_size,
      progress=progress,
      mp_context=mp_context,
  )


def _check_count(n: int, seed: int) -> None:
  if n < 0:
    raise ValueError(f'n must be >= 0, got {n}')
  if seed < 0:
    raise ValueError(f'seed must be >= 0, got {seed}')
