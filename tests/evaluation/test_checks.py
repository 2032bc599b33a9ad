"""evaluation/checks.py: a record the task cannot score or start is a one-line error naming its file and line,
found before anything is sampled."""

from __future__ import annotations

import pytest

from hackable_diffusion.data import train_tokenizer
from hackable_diffusion.errors import DataError
from hackable_diffusion.evaluation.checks import check_records
from hackable_diffusion.tasks.base import BaseTask, EvalRecord
from hackable_diffusion.tasks.sudoku.task import SudokuTask

# Wikipedia's puzzle and its solution
PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
SOURCES = [("puzzles.jsonl", 1), ("puzzles.jsonl", 2), ("puzzles.jsonl", 3)]


@pytest.fixture(scope="module")
def tok():
  return train_tokenizer(["0123456789"])


def test_usable_records_pass(tok):
  records = [EvalRecord(PUZZLE, SOLUTION)] * 3
  check_records(SudokuTask(), records, SOURCES, tok, 82)


@pytest.mark.parametrize("bad, hook, message", [
    (EvalRecord(PUZZLE, SOLUTION[:80]), "metrics", "expected 81 cells"),  # a solution one cell short
    (EvalRecord(PUZZLE.replace("0", "x", 1), SOLUTION), "metrics", "invalid character 'x'"),
])
def test_the_first_record_the_task_cannot_use_is_named(tok, bad, hook, message):
  records = [EvalRecord(PUZZLE, SOLUTION), bad, bad]
  with pytest.raises(DataError, match=rf"^puzzles.jsonl:2: task 'sudoku' cannot use this record \({hook}: "
                                      rf"ValueError: .*{message}"):
    check_records(SudokuTask(), records, SOURCES, tok, 82)


class _StartFails(BaseTask):
  """Scores anything; its start canvases fail on a prompt 'boom'."""

  name = "starts"

  def metrics(self, predictions, records):
    return {}

  def seed_canvas(self, records, tokenizer, num_tokens):
    if any(r.prompt == "boom" for r in records):
      raise KeyError("boom")
    return None


class _FailsTogether(_StartFails):
  """Every record alone is fine, all of them together not: the task's own error, not a record's."""

  def metrics(self, predictions, records):
    if len(records) > 1:
      raise RuntimeError("needs one record at a time")
    return {}


def test_a_start_canvas_failure_names_the_record_and_a_batch_failure_is_the_tasks_own(tok):
  records = [EvalRecord("a", "b"), EvalRecord("c", "d"), EvalRecord("boom", "d")]
  with pytest.raises(DataError, match=r"^puzzles.jsonl:3: task 'starts' cannot use this record \(seed_canvas: "
                                      r"KeyError: 'boom'\)$"):
    check_records(_StartFails(), records, SOURCES, tok, 4)
  with pytest.raises(RuntimeError, match="needs one record at a time"):
    check_records(_FailsTogether(), records[:2], SOURCES, tok, 4)


@pytest.mark.parametrize("wrong", [
    SOLUTION[1] + SOLUTION[0] + SOLUTION[2:],  # two cells swapped: a row keeps its digits, two columns break
    "1" + SOLUTION[1:],  # the first cell's given 5 changed (and its row, column and box broken)
])
def test_a_wrong_reference_solution_is_named(tok, wrong):
  """A reference that parses (81 digits) but is not a solution of its puzzle: named, not scored."""
  records = [EvalRecord(PUZZLE, SOLUTION), EvalRecord(PUZZLE, SOLUTION), EvalRecord(PUZZLE, wrong)]
  with pytest.raises(DataError, match=r"^puzzles.jsonl:3: task 'sudoku' cannot use this record \(its reference "
                                      r"completion, scored as its own prediction, gives solved_rate=0.0; a correct "
                                      r"reference gives solved_rate=1.0\)$"):
    check_records(SudokuTask(), records, SOURCES, tok, 82)


def test_a_task_without_reference_scores_accepts_any_reference(tok):
  """Tasks that do not declare `reference_scores` (a Protocol implementation need not) are only run, not judged."""

  class Scores(BaseTask):
    name = "scores"

    def metrics(self, predictions, records):
      return {"exact_match": 0.0}

  class Bare:  # no BaseTask: no reference_scores attribute at all
    name = "bare"
    metrics = Scores.metrics

    def seed_canvas(self, records, tokenizer, num_tokens):
      return None

  for task in (Scores(), Bare()):
    check_records(task, [EvalRecord("a", "b")] * 3, SOURCES, tok, 4)
