"""TextTask metrics and allowed characters; DigitsTask's generated data."""

from __future__ import annotations

import json
import os

import pytest

from hackable_diffusion.data import train_tokenizer
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks.base import EvalRecord
from hackable_diffusion.tasks.text import DigitsTask, TextTask


def _records(*pairs):
  return [EvalRecord(prompt=p, completion=c) for p, c in pairs]


def test_text_metrics():
  recs = _records(("a", "123"), ("b", "456"), ("c", "789"))
  m = TextTask().metrics(["123", " 456\n", "780"], recs)
  assert m["exact_match"] == pytest.approx(2 / 3)
  assert m["char_accuracy"] == pytest.approx(8 / 9)
  assert m["length_match"] == 1.0
  with pytest.raises(ValueError, match="2 predictions for 3 records"):
    TextTask().metrics(["1", "2"], recs)


def test_text_allowed_chars():
  tok = train_tokenizer(["0123456789"])
  assert TextTask().allowed_token_ids(tok) is None
  ids = TextTask(allowed_chars="10").allowed_token_ids(tok)
  assert sorted(ids) == sorted(tok.token_ids_for("01") + [tok.eos_id])
  with pytest.raises(ConfigError, match="text task allowed_chars"):
    TextTask(allowed_chars="x").allowed_token_ids(tok)


def test_digits_task_data(tmp_path):
  task = DigitsTask(op="sort", length=5, num_train=20, num_validation=4, seed=3)
  train = task.records("train")
  assert len(train) == 20 and all(r["completion"] == "".join(sorted(r["prompt"])) for r in train)
  assert task.records("train") == train  # deterministic
  assert task.records("validation") != train[:4]
  assert DigitsTask(op="reverse").records("validation")[0]["completion"] == \
      DigitsTask(op="reverse").records("validation")[0]["prompt"][::-1]
  paths = task.make_data(str(tmp_path))
  mtime = os.path.getmtime(paths["train"])
  assert task.make_data(str(tmp_path)) == paths and os.path.getmtime(paths["train"]) == mtime  # reused
  with open(paths["validation"]) as f:
    assert [json.loads(line) for line in f] == task.records("validation")
  DigitsTask(op="shift", length=5, num_train=20, num_validation=4, seed=3).make_data(str(tmp_path))
  with open(paths["train"]) as f:  # a different spec regenerates the files
    first = json.loads(f.readline())
  assert first["completion"] == "".join(str((int(c) + 1) % 10) for c in first["prompt"])
  with pytest.raises(ConfigError, match="op='bogus'"):
    DigitsTask(op="bogus")
