"""Published Sudoku puzzles -> the task's JSONL records, to evaluate a run on puzzles it did not generate.

Puzzle collections come as one puzzle per line: 81 cells with '.', '0' or '_' for a blank, often followed by the
solution (CSV `quizzes,solutions` with a header, or space separated), sometimes as JSON lines with other key names,
often without solutions. `read_puzzles` reads any of these: the cells of a line (digits and blanks, separators
ignored) are a puzzle (81) or a puzzle and its solution (162); a JSON line gives them under `PUZZLE_KEYS` /
`SOLUTION_KEYS`; a first line without digits is a header, and a CSV header naming a puzzle column (e.g.
`id,puzzle,solution,clues,difficulty`) selects the columns of the lines below. Every puzzle is checked (no clashing
givens, exactly one solution); a given solution must solve it, a missing one is found by the solver. `records`
gives the lines the evaluation reads: `{"prompt", "completion", "givens", "pinned"}` as the generated splits have
them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hackable_diffusion.tasks.sudoku import formatting, solver

PUZZLE_KEYS = ("prompt", "puzzle", "quizzes", "quiz", "question")
SOLUTION_KEYS = ("completion", "solution", "solutions", "answer")
_CELL_CHARS = set(formatting.DIGITS) | set(formatting.BLANKS)


@dataclasses.dataclass(frozen=True)
class ImportedPuzzle:
  """One puzzle: `puzzle` / `solution` `[81]` int8 (0 = blank), and the line it came from."""

  puzzle: np.ndarray
  solution: np.ndarray
  source: tuple[str, int]
  solved_here: bool  # the file gave no solution: the solver's


def _cells_of_text(text: str) -> str:
  return "".join(ch for ch in text if ch in _CELL_CHARS)


def header_columns(line: str) -> tuple[int, int | None] | None:
  """(puzzle column, solution column or None) of a CSV header that names them (`PUZZLE_KEYS` / `SOLUTION_KEYS`,
  any case), e.g. `id,puzzle,solution,clues,difficulty`; None when the line names no puzzle column."""
  names = [name.strip().strip('"').lower() for name in line.split(",")]
  puzzle = next((names.index(k) for k in PUZZLE_KEYS if k in names), None)
  if puzzle is None:
    return None
  return puzzle, next((names.index(k) for k in SOLUTION_KEYS if k in names), None)


def _fields(line: str, columns: tuple[int, int | None] | None = None) -> tuple[str, str | None]:
  """(puzzle cells, solution cells or None) of one line (`columns`: those of a CSV header); ValueError naming what
  is wrong."""
  if columns is not None:
    values = [v.strip().strip('"') for v in line.split(",")]
    puzzle, solution = columns
    if len(values) <= puzzle:
      raise ValueError(f"{len(values)} comma-separated values; the header's puzzle column is number {puzzle + 1}")
    given = solution is not None and solution < len(values) and values[solution]  # an empty solution: solve it
    return values[puzzle], values[solution] if given else None
  if line.lstrip().startswith("{"):
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    puzzle = next((obj[k] for k in PUZZLE_KEYS if k in obj), None)
    if not isinstance(puzzle, str):
      raise ValueError(f"no puzzle string under any of {list(PUZZLE_KEYS)} (keys: {sorted(obj)})")
    solution = next((obj[k] for k in SOLUTION_KEYS if k in obj), None)
    if solution is not None and not isinstance(solution, str):
      raise ValueError(f"the solution is a {type(solution).__name__}, not a string")
    return puzzle, solution
  cells = _cells_of_text(line)
  n = solver.NUM_CELLS
  if len(cells) == n:
    return cells, None
  if len(cells) == 2 * n:
    return cells[:n], cells[n:]
  raise ValueError(f"{len(cells)} cells (digits 1-9 and blanks '.', '0', '_'); expected {n} (a puzzle) or "
                   f"{2 * n} (a puzzle and its solution), one puzzle per line")


def parse_puzzle_line(line: str, source: tuple[str, int],
                      columns: tuple[int, int | None] | None = None) -> ImportedPuzzle:
  """One line -> an `ImportedPuzzle`; ValueError (one line, without the source) when it is not a usable puzzle.
  `columns`: the puzzle / solution columns of a CSV header (`header_columns`)."""
  puzzle_text, solution_text = _fields(line, columns)
  puzzle = formatting.parse_puzzle(puzzle_text)  # cell count, characters, clashing givens
  found = solver.count_solutions(puzzle, limit=2)
  if found != 1:
    raise ValueError("the puzzle has no solution" if found == 0 else "the puzzle has more than one solution")
  if solution_text is None:
    return ImportedPuzzle(puzzle, solver.solve(puzzle).astype(np.int8), source, solved_here=True)
  solution = formatting.parse_grid(solution_text)
  valid, why = formatting.solution_verdict(solution, puzzle)
  if not valid:
    raise ValueError(f"the given solution is {why}")
  return ImportedPuzzle(puzzle, solution, source, solved_here=False)


def read_puzzles(path: str, *, on_bad: str = "error") -> tuple[list[ImportedPuzzle], list[str]]:
  """(puzzles, problems) of the file at `path`. `on_bad='error'`: the first unusable line raises a one-line
  ValueError `PATH:LINE: ...`; 'skip': it is left out and its `PATH:LINE: ...` line added to `problems`. Blank
  lines, '#' comments and a first line without digits (a header) are skipped."""
  if on_bad not in ("error", "skip"):
    raise ValueError(f"on_bad={on_bad!r}; expected 'error' or 'skip'")
  puzzles, problems = [], []
  columns = None
  with open(path, encoding="utf-8-sig") as f:
    for number, line in enumerate(f, start=1):
      text = line.strip()
      if number == 1 and not any(ch.isdigit() for ch in text):  # a header; columns when it names them
        columns = header_columns(text)
        continue
      if not text or text.startswith("#"):
        continue
      try:
        puzzles.append(parse_puzzle_line(text, (path, number), columns))
      except ValueError as e:
        message = f"{path}:{number}: {e}"
        if on_bad == "error":
          raise ValueError(message) from None
        problems.append(message)
  return puzzles, problems


def records(puzzles: Sequence[ImportedPuzzle]) -> Iterator[dict[str, Any]]:
  """The evaluation's JSONL records of `puzzles`, in the generated splits' format."""
  for p in puzzles:
    yield formatting.to_record(p.puzzle, p.solution)


__all__ = ["ImportedPuzzle", "PUZZLE_KEYS", "SOLUTION_KEYS", "header_columns", "parse_puzzle_line", "read_puzzles",
           "records"]
