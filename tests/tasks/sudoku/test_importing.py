"""tasks/sudoku/importing.py and scripts/import_sudoku_puzzles.py: published puzzle files (CSV with a header, '.'
blanks, puzzle + solution or puzzle alone, JSON lines with other key names) become the evaluation's records; an
unusable line is one line naming it. Expected values are Wikipedia's puzzle and solution, not the solver's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hackable_diffusion.tasks.sudoku import importing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Wikipedia's "Sudoku" article: the puzzle (30 givens) and its unique solution
PUZZLE = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
PROMPT = PUZZLE.replace(".", "0")
PINNED = "".join("0" if ch == "." else "1" for ch in PUZZLE)
EXPECTED = {"prompt": PROMPT, "completion": SOLUTION, "givens": 30, "pinned": PINNED}


def _read(tmp_path, text, **kwargs):
  path = tmp_path / "puzzles.txt"
  path.write_text(text)
  puzzles, problems = importing.read_puzzles(str(path), **kwargs)
  return list(importing.records(puzzles)), problems, puzzles, str(path)


def test_every_common_layout_gives_the_same_record(tmp_path):
  layouts = [
      f"quizzes,solutions\n{PROMPT},{SOLUTION}\n",  # Kaggle-style CSV
      f"{PUZZLE} {SOLUTION}\n",  # '.' blanks, space separated
      f"# a comment\n\n{PUZZLE}\n",  # no solution: solved on import
      json.dumps({"puzzle": PUZZLE, "solution": SOLUTION}) + "\n",
      json.dumps({"quizzes": PUZZLE.replace(".", "_")}) + "\n",
      f"{PUZZLE[:40]} | {PUZZLE[40:]}\n",  # separators inside a line
      f"\ufeffid,puzzle,solution,clues,difficulty\n0,{PUZZLE},{SOLUTION},30,2.2\n",  # named columns (and a BOM)
      f"id,quizzes,rating\n17,{PUZZLE},1.5\n",  # named puzzle column, no solution: solved on import
  ]
  for text in layouts:
    recs, problems, puzzles, _ = _read(tmp_path, text)
    assert recs == [EXPECTED] and problems == [], text
    assert puzzles[0].solved_here == (SOLUTION not in text), text
  # a named-column file whose line lacks the column
  with pytest.raises(ValueError, match=r"puzzles.txt:2: 1 comma-separated values; the header's puzzle column is "
                                       r"number 2$"):
    _read(tmp_path, f"id,puzzle,solution\n{PUZZLE}\n")


@pytest.mark.parametrize("line, message", [
    ("\n".join(PUZZLE[r * 9:(r + 1) * 9] for r in range(9)), r"9 cells .* expected 81 \(a puzzle\) or 162"),
    ("55" + PUZZLE[2:], r"contradictory givens"),  # two 5s in the first row
    ("5" + "." * 80, r"the puzzle has more than one solution"),
    (PUZZLE + "," + SOLUTION[1] + SOLUTION[0] + SOLUTION[2:], r"the given solution is not valid"),
    ('{"puzzle": 5}', r"no puzzle string under any of"),
    ("{not json", r"invalid JSON"),
])
def test_an_unusable_line_is_one_line_naming_it(tmp_path, line, message):
  text = f"{PUZZLE}\n{line}\n{PUZZLE}\n"
  with pytest.raises(ValueError, match=rf"^{tmp_path / 'puzzles.txt'}:2: {message}"):
    _read(tmp_path, text)
  recs, problems, _, path = _read(tmp_path, text, on_bad="skip")
  assert recs == [EXPECTED, EXPECTED]  # the good lines around it
  assert [p.split(": ")[0] for p in problems] == [f"{path}:{2 + k}" for k in range(line.count("\n") + 1)]


def test_the_script_writes_whole_files_and_keeps_existing_ones(tmp_path):
  src, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
  src.write_text(f"quizzes,solutions\n{PUZZLE},{SOLUTION}\n{PUZZLE}\n")
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "import_sudoku_puzzles.py"), f"--input={src}", f"--out={out}"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "2 puzzles (medium 2); 1 solved here, 0 lines skipped" in done.stdout
  assert [json.loads(line) for line in out.read_text().splitlines()] == [EXPECTED, EXPECTED]
  out.write_text("mine\n")
  again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert again.returncode == 1 and again.stderr.strip().splitlines()[-1].startswith(f"error: --out={out} exists")
  assert out.read_text() == "mine\n"
  src.write_text(f"{PUZZLE}\n{PUZZLE[:80]}\n")
  bad = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1] == (
      f"error: {src}:2: 80 cells (digits 1-9 and blanks '.', '0', '_'); expected 81 (a puzzle) or 162 (a puzzle and "
      f"its solution), one puzzle per line")
  assert out.read_text() == "mine\n"  # nothing written on an error
  src.write_bytes(b"\xc0\xff" + PUZZLE.encode())
  binary = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, timeout=300)
  assert binary.returncode == 1 and binary.stderr.strip().splitlines()[-1] == (
      f"error: {src}: not UTF-8 text (invalid start byte at byte 0)")
