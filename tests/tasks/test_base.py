"""The task interface: built-in names and 'module:factory' specs through `get_task`, default hooks, metric helpers,
generated JSONL splits."""

from __future__ import annotations

import json
import os

import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks import base
from hackable_diffusion.tasks.base import (BUILTIN_TASKS, DATA_SPEC_FILE, BaseTask, EvalRecord, char_accuracy,
                                           exact_match, get_task, write_jsonl_splits)
from hackable_diffusion.tasks.sudoku.task import SudokuTask
from hackable_diffusion.tasks.text import TextTask


def test_get_task_builtin_names_and_specs():
  assert isinstance(get_task("text"), TextTask)
  assert get_task("digits", {"op": "reverse"}).op == "reverse"
  assert isinstance(get_task("sudoku"), SudokuTask)  # imported on use, like any spec
  assert sorted(BUILTIN_TASKS) == ["digits", "sudoku", "sudoku_image", "text"]
  assert isinstance(get_task("hackable_diffusion.tasks.text:TextTask", {"allowed_chars": "01"}), TextTask)
  task = get_task("custom_components:OneDigitTask", {"digit": "3"})  # defined in tests/, not in the library
  assert (task.name, task.primary_metric, task.digit) == ("one_digit", "all_digit", "3")


@pytest.mark.parametrize("name,args,match", [
    ("nope", None, "unknown task 'nope'"),
    ("no.such.module:Task", None, "cannot import no.such.module"),
    ("hackable_diffusion.tasks.text:Nope", None, "has no attribute 'Nope'"),
    ("hackable_diffusion.tasks.base:DATA_SPEC_FILE", None, "not a class or function"),
    ("digits", {"bogus": 1}, "bad task arguments"),
    ("custom_components:not_a_task", None, "lacks \\['metrics', 'allowed_token_ids'"),
    (":Task", None, "unknown task"),
])
def test_get_task_errors_are_one_line(name, args, match):
  with pytest.raises(ConfigError, match=match) as err:
    get_task(name, args)
  assert "\n" not in str(err.value)


def test_base_task_default_hooks(tmp_path):
  task = BaseTask()
  assert task.allowed_token_ids(None) is None
  assert task.seed_canvas([EvalRecord("a", "b")], None, 8) is None
  assert task.plot_trajectory({"prompt": "a", "target": "b", "steps": ["b"]}, str(tmp_path / "x.png")) is None
  assert task.attention_structure() is None
  with pytest.raises(ConfigError, match="cannot generate data"):
    task.make_data(str(tmp_path))
  with pytest.raises(NotImplementedError):
    task.metrics(["a"], [EvalRecord("a", "b")])


def test_metric_helpers():
  assert char_accuracy(["12"], ["123"]) == pytest.approx(2 / 3)  # missing characters count as wrong
  assert exact_match([" x"], ["x"], strip=False) == 0.0
  assert exact_match([" x"], ["x"]) == 1.0


def test_write_jsonl_splits_is_atomic_and_reuses_files(tmp_path):
  calls = []

  def make():
    calls.append(1)
    return [{"prompt": "a", "completion": "b"}]

  paths = write_jsonl_splits(str(tmp_path), {"v": 1}, {"train": make})
  assert sorted(os.listdir(tmp_path)) == [DATA_SPEC_FILE, "train.jsonl"]  # no temporary file left behind
  assert open(paths["train"]).read() == '{"prompt": "a", "completion": "b"}\n'
  assert json.load(open(tmp_path / DATA_SPEC_FILE)) == {"v": 1}
  assert write_jsonl_splits(str(tmp_path), {"v": 1}, {"train": make}) == paths and len(calls) == 1  # same spec
  write_jsonl_splits(str(tmp_path), {"v": 2}, {"train": make})
  assert len(calls) == 2  # a different spec regenerates
  (tmp_path / DATA_SPEC_FILE).write_text("{not json")
  write_jsonl_splits(str(tmp_path), {"v": 2}, {"train": make})
  assert len(calls) == 3  # an unreadable spec regenerates



def test_the_sampling_hooks_default_to_the_text_as_is():
  record = EvalRecord(prompt="p", completion="")
  for task in (BaseTask(), None, object()):  # BaseTask's defaults; no task, or one without the hooks: the same
    assert base.parse_prompt(task, "a b\n") == "a b\n"
    assert base.prompt_complete(task, "")
    assert base.render(task, "x\ny", record) == "x\ny"
