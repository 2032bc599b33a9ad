"""SudokuTask: generated data with pinned givens, sampling hooks, metrics through the task interface."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hackable_diffusion.data.tokenizer import train_tokenizer
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks.base import EvalRecord, get_task
from hackable_diffusion.tasks.sudoku import formatting

SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


@pytest.fixture(scope="module")
def tok():
  return train_tokenizer(["0123456789"])


def test_make_data_writes_pinned_givens_and_reuses_files(tmp_path):
  task = get_task("sudoku", dict(num_train=12, num_validation=4, num_test=4, workers=1))
  paths = task.make_data(str(tmp_path))
  assert set(paths) == {"train", "validation", "test"}
  for line in open(paths["test"]):
    rec = json.loads(line)
    pinned = np.array([c == "1" for c in rec["pinned"]])
    np.testing.assert_array_equal(pinned, formatting.parse_grid(rec["prompt"]) > 0)
    assert rec["givens"] == pinned.sum()
  mtime = (tmp_path / "train.jsonl").stat().st_mtime_ns
  task.make_data(str(tmp_path))
  assert (tmp_path / "train.jsonl").stat().st_mtime_ns == mtime  # same spec: not regenerated
  get_task("sudoku", dict(num_train=13, num_validation=4, num_test=4, workers=1)).make_data(str(tmp_path))
  assert sum(1 for _ in open(tmp_path / "train.jsonl")) == 13  # different spec: regenerated


def test_seed_canvas_pins_exactly_the_givens(tok):
  puzzle = "".join(c if i % 3 else "0" for i, c in enumerate(SOLUTION))
  records = [EvalRecord(prompt=puzzle, completion=SOLUTION)]
  seed, pinned = get_task("sudoku").seed_canvas(records, tok, 81)
  given = formatting.parse_grid(puzzle) > 0
  np.testing.assert_array_equal(pinned[0], given)
  assert tok.decode(seed[0][given].tolist()) == "".join(c for c, g in zip(SOLUTION, given) if g)
  _, none = get_task("sudoku", dict(pin_givens=False)).seed_canvas(records, tok, 81)
  assert not none.any()
  assert sorted(tok.decode(get_task("sudoku").allowed_token_ids(tok))) == list("123456789")
  assert get_task("sudoku", dict(digits_only=False)).allowed_token_ids(tok) is None


def test_a_puzzles_start_canvas_does_not_depend_on_the_other_records(tok):
  """The evaluation calls `seed_canvas` per batch of `eval.batch_size` puzzles: a puzzle's noise must not depend on
  which other puzzles share the call (before: one generator seeded with the call's length, so every batch of 25
  drew the same noise and a batch size change changed every start canvas)."""
  # every third cell blank in all three, plus one more blank cell each: most blank cells are shared
  puzzles = ["".join("0" if i % 3 == 0 or i == 1 + 3 * k else c for i, c in enumerate(SOLUTION)) for k in range(3)]
  records = [EvalRecord(prompt=p, completion=SOLUTION) for p in puzzles]
  task = get_task("sudoku")
  together, pins = task.seed_canvas(records, tok, 81)
  for i, record in enumerate(records):
    alone, alone_pins = task.seed_canvas([record], tok, 81)
    np.testing.assert_array_equal(together[i], alone[0])
    np.testing.assert_array_equal(pins[i], alone_pins[0])
  second, _ = task.seed_canvas(records[1:], tok, 81)
  np.testing.assert_array_equal(together[1:], second)
  both = ~pins[0] & ~pins[1]  # blank in both puzzles: only the noise is there
  assert both.sum() >= 27 and (together[0][both] != together[1][both]).any()  # other puzzles, other noise


def test_metrics_score_solved_and_wrong_predictions():
  puzzle = "".join(c if i % 2 else "0" for i, c in enumerate(SOLUTION))  # 40 givens: easy
  records = [EvalRecord(prompt=puzzle, completion=SOLUTION)] * 3
  wrong = SOLUTION[:-2] + SOLUTION[-1] + SOLUTION[-2]  # two cells swapped: rows break
  m = get_task("sudoku").metrics([SOLUTION, wrong, "garbage"], records)
  assert m["solved_rate"] == pytest.approx(1 / 3)
  assert m["easy/count"] == 3 and m["medium/count"] == 0


def test_bad_task_arguments():
  with pytest.raises(ConfigError, match="num_train=0"):
    get_task("sudoku", dict(num_train=0))
  with pytest.raises(ConfigError, match="bucket weights"):
    get_task("sudoku", dict(easy=0.0, medium=0.0, hard=0.0))
  with pytest.raises(ConfigError, match="train_easy=-1"):
    get_task("sudoku", dict(train_easy=-1.0, train_medium=1.0))
  with pytest.raises(ConfigError, match="train_hard=nan"):
    get_task("sudoku", dict(train_medium=1.0, train_hard=float("nan")))
  with pytest.raises(ConfigError, match="medium='half'"):
    get_task("sudoku", dict(medium="half"))


def test_training_mix_is_part_of_the_data_spec(tmp_path):
  args = dict(num_train=10, num_validation=4, num_test=4, workers=1)
  get_task("sudoku", args).make_data(str(tmp_path))
  test_before = (tmp_path / "test.jsonl").read_bytes()
  get_task("sudoku", dict(args, train_medium=1.0, train_hard=1.0)).make_data(str(tmp_path))  # regenerated
  givens = [json.loads(line)["givens"] for line in open(tmp_path / "train.jsonl")]
  assert sorted(g < 30 for g in givens) == [False] * 5 + [True] * 5  # unset train_easy counts 0
  assert min(givens) < 30 <= max(givens) < 40
  assert (tmp_path / "test.jsonl").read_bytes() == test_before


def test_typed_puzzles_and_shown_answers():
  task = get_task("sudoku")
  puzzle = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
  grid = formatting.render_grid(formatting.parse_grid(puzzle), blank="_")  # a pasted grid, '_' blanks
  assert task.parse_prompt(puzzle.replace("0", ".")) == task.parse_prompt(grid) == puzzle
  with pytest.raises(ConfigError, match=r"^prompt '1234' \(4 characters\) is not a Sudoku puzzle: expected 81 cells"):
    task.parse_prompt("1234")
  lines = grid.split("\n")
  assert not task.prompt_complete("\n".join(lines[:5])) and task.prompt_complete(grid)  # read until 81 cells
  solution = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
  shown = task.render(solution, EvalRecord(prompt=puzzle, completion=""))
  assert shown.split("\n")[:11] == formatting.render_grid(formatting.parse_grid(solution)).split("\n")
  assert shown.split("\n")[11].startswith("valid: ")
  wrong = task.render("1" * 81, EvalRecord(prompt=puzzle, completion=""))
  assert wrong.split("\n")[11].startswith("not valid: ")
