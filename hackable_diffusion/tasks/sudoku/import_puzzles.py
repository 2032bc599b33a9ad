r"""Converts a published Sudoku collection into the JSONL the evaluation reads.

  hd-import-sudoku --input=puzzles.csv --out=mine.jsonl [--on_bad=skip]
  python -m hackable_diffusion.tasks.sudoku.import_puzzles --input=puzzles.csv --out=mine.jsonl
  python -m hackable_diffusion.evaluate --workdir=runs/sudoku --out=eval_mine --config.eval.split=validation \
      --config.data.validation_path=mine.jsonl --config.eval.num_examples=1000

One puzzle per line: 81 cells with '.', '0' or '_' blanks (separators ignored), optionally followed by its 81-digit
solution (a CSV `quizzes,solutions` file with its header, or space separated), a CSV whose header names a puzzle
column (`id,puzzle,solution,clues,difficulty`: the other columns ignored), or JSON lines with the puzzle under
one of `prompt` / `puzzle` / `quizzes` / `quiz` / `question` and the solution under `completion` / `solution` /
`solutions` / `answer`. Puzzles without a solution are solved here; every puzzle must have exactly one solution
and no clashing givens, and a given solution must solve it. An unusable line stops the import with one line naming
it (`--on_bad=skip`: left out, counted and listed). The output is written whole or not at all, and an existing
file is kept unless `--overwrite`. Prints the puzzles per bucket (graded by givens, as the evaluation does).
"""

from __future__ import annotations

import collections
import json
import os
import sys

from absl import app, flags

from hackable_diffusion.files import write_atomic
from hackable_diffusion.tasks.sudoku import difficulty_bucket, importing

_INPUT = flags.DEFINE_string("input", None, "The puzzle file (text, CSV or JSON lines).", required=True)
_OUT = flags.DEFINE_string("out", None, "The JSONL file to write.", required=True)
_ON_BAD = flags.DEFINE_enum("on_bad", "error", ["error", "skip"], "An unusable line: stop, or leave it out.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out file.")


def main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not os.path.isfile(_INPUT.value):
    return _fail(f"--input={_INPUT.value}: no such file")
  if os.path.exists(_OUT.value) and not _OVERWRITE.value:
    return _fail(f"--out={_OUT.value} exists; pass --overwrite to replace it")
  try:
    puzzles, problems = importing.read_puzzles(_INPUT.value, on_bad=_ON_BAD.value)
  except UnicodeDecodeError as e:  # a ValueError too: first
    return _fail(f"{_INPUT.value}: not UTF-8 text ({e.reason} at byte {e.start})")
  except ValueError as e:
    return _fail(str(e))
  if not puzzles:
    return _fail(f"{_INPUT.value}: no usable puzzle" + (f" ({len(problems)} lines skipped)" if problems else ""))
  write_atomic(_OUT.value, "".join(json.dumps(r) + "\n" for r in importing.records(puzzles)))
  buckets = collections.Counter(difficulty_bucket(int((p.puzzle > 0).sum())) for p in puzzles)
  solved = sum(p.solved_here for p in puzzles)
  print(f"{_OUT.value}: {len(puzzles)} puzzles ({', '.join(f'{k} {v}' for k, v in sorted(buckets.items()))}); "
        f"{solved} solved here, {len(problems)} lines skipped")
  for line in problems[:20]:
    print(f"  skipped {line}")
  return 0


def _fail(message: str) -> int:
  print(f"error: {message}", file=sys.stderr)
  return 1


def run() -> None:
  app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
  run()
