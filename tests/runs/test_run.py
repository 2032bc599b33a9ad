"""runs/run.py: building a run's model config from a Hugging Face checkpoint keeps the checkpoint's dtype; the
data generator follows the progress flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hackable_diffusion.data import load_records, train_tokenizer
from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs import workdir as workdir_lib


class _StandInTokenizer:
  """Only the size and special ids of the run's tokenizer matter to the model config."""

  vocab_size, pad_id, eos_id, bos_id, unk_id = 32, 0, 1, 2, 3

  def check_model_ids(self, **ids) -> None:  # the real one compares its special ids with the checkpoint's
    del ids


@pytest.fixture(scope="module")
def bf16_checkpoint(hf_factory, tmp_path_factory):
  ref, _ = hf_factory("run_dtype", canvas=6)
  path = tmp_path_factory.mktemp("bf16_checkpoint")
  ref16 = ref.to(torch.bfloat16)
  try:
    ref16.save_pretrained(path)
  finally:
    ref.to(torch.float32)
  return str(path)


def test_a_hub_id_checkpoint_gives_the_run_its_tokenizer(bf16_checkpoint, tmp_path, monkeypatch):
  """model.checkpoint as a Hub id (cached, offline): the tokenizer comes from the resolved snapshot, as from a folder."""
  import os
  import shutil

  tokenizer = train_tokenizer(["1234567", "abcdefg"])
  revision = "0123456789abcdef0123456789abcdef01234567"
  repo = tmp_path / "hub" / "models--acme--dg-tok"
  snapshot = repo / "snapshots" / revision
  shutil.copytree(bf16_checkpoint, snapshot)
  tokenizer.save(str(snapshot))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(revision)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  cfg = _config("acme/dg-tok", **{"tokenizer.path": "checkpoint"})
  workdir = tmp_path / "run"
  workdir.mkdir()
  tok = run_lib.build_tokenizer(cfg, str(workdir), "")
  assert tok.vocab_size == tokenizer.vocab_size and tok.encode("1234567") == tokenizer.encode("1234567")
  assert any(name.startswith("tokenizer") for name in os.listdir(workdir))  # saved for evaluation and export


def _config(checkpoint: str, **overrides):
  return config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file(
      "tiny.py", {"model.preset": "", "model.checkpoint": checkpoint, **overrides}))


def test_checkpoint_dtype_is_the_default(bf16_checkpoint):
  cfg = _config(bf16_checkpoint)
  assert cfg.model.dtype == "auto"
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  assert (model_config.param_dtype, model_config.dtype) == ("bfloat16", "bfloat16")
  # an explicit dtype still wins
  model_config = run_lib.build_model_config(_config(bf16_checkpoint, **{"model.dtype": "float32"}),
                                            _StandInTokenizer())
  assert (model_config.param_dtype, model_config.dtype) == ("float32", "float32")


def test_bad_model_dtype_is_one_line():
  with pytest.raises(ConfigError, match=r"model.dtype='int8'; expected 'auto', 'float32'"):
    _config("/some/checkpoint", **{"model.dtype": "int8"})


def _sudoku_data_config(data_overrides=None, config_file="sudoku.py", **generator_args):
  args = {"num_train": 6, "num_validation": 2, "num_test": 2, "workers": 1, **generator_args}
  overrides = {"data.generator": "sudoku"} | {f"data.generator_args.{k}": v for k, v in args.items()}
  overrides |= {f"data.{k}": v for k, v in (data_overrides or {}).items()}
  return config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file(config_file, overrides))


@pytest.mark.parametrize("progress", [False, True])
def test_generator_progress_bar_follows_the_flag(tmp_path, capfd, progress):
  """`--no_progress` reaches the data generator: no Sudoku bar on stderr when off, one when on; a task whose
  `make_data` takes no `progress` argument is still called."""
  paths = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=progress)
  assert set(paths) >= {"train", "validation", "test"}
  err = capfd.readouterr().err
  assert ("puzzle" in err) == progress, err


def test_a_task_without_a_progress_argument_still_makes_data(tmp_path, monkeypatch):
  calls = []

  class OldTask:  # the protocol before `progress`: make_data(out_dir)
    def make_data(self, out_dir):
      calls.append(out_dir)
      return {"train": "t.jsonl"}

  monkeypatch.setattr(run_lib, "get_task", lambda name, args: OldTask())
  paths = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=False)
  assert paths == {"train": "t.jsonl", "validation": ""} and len(calls) == 1


def test_a_given_path_replaces_the_generated_split(tmp_path):
  """`data.validation_path` with a generator: evaluation reads that file (e.g. a run's own hard puzzles), not the
  generated validation split, which was silently used before; the other splits stay generated. A path that does not
  exist is a one-line error before anything is written."""
  mine = tmp_path / "mine.jsonl"
  mine.write_text('{"prompt": "1", "completion": "2"}\n')
  generated = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=False)
  paths = run_lib.data_paths(_sudoku_data_config({"validation_path": str(mine)}), str(tmp_path / "run"),
                             progress=False)
  assert paths == generated | {"validation": str(mine)} and generated["validation"] != str(mine)
  missing = _sudoku_data_config({"validation_path": str(tmp_path / "nope.jsonl")})
  with pytest.raises(DataError, match=r"^data.validation_path=.*nope.jsonl: data file not found$"):
    workdir_lib.check_data_paths(missing)


def test_a_structured_model_needs_prompts_as_wide_as_its_structure(tmp_path):
  """The structured Sudoku config's own-cell structure reads the 81 prompt slots: a puzzle written with '.' blanks (unknown to
  the digit tokenizer; a run of them becomes one unk token) is a one-line error naming the file and line, not a
  prompt left-padded out of place (or an error deep in the sampler); an 81-digit puzzle loads."""
  digits = ("1234567890" * 9)[:81]
  line = {"completion": "5" * 81, "pinned": "0" * 81}
  path = tmp_path / "mine.jsonl"
  path.write_text(json.dumps(line | {"prompt": digits}) + "\n" + json.dumps(line | {"prompt": "." * 9 + digits[9:]})
                  + "\n")
  cfg = _sudoku_data_config(config_file="sudoku_structured.py")
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  data_cfg = run_lib.sft_data_config(cfg, model_config, str(path), batch_size=1, shuffle=False, seed=0)
  assert data_cfg.min_prompt_length == data_cfg.max_prompt_length == 81
  tok = train_tokenizer(["0123456789"])
  with pytest.raises(DataError, match=rf"^{path}:2: prompt is 73 tokens \(1 of its tokens are unk.*"
                                      r"min_prompt_length=81 \(.*attention structure"):
    load_records(None, data_cfg, tok)
  assert load_records(None, dataclasses.replace(data_cfg, min_prompt_length=73), tok).prompts[0] == digits
  # a grid written with line breaks: too long, and the usual advice (raise max_prompt_length) would not fit it
  path.write_text(json.dumps(line | {"prompt": "\n".join(digits[i:i + 9] for i in range(0, 81, 9))}) + "\n")
  with pytest.raises(DataError, match=rf"^{path}:1: prompt is 89 tokens, longer than max_prompt_length=81; the "
                                      r"model's attention structure reads exactly that many prompt tokens"):
    load_records(None, data_cfg, tok)


def test_evaluating_own_puzzles_needs_no_pinned_field(tmp_path):
  """The Sudoku task pins the givens from the prompt, so a puzzle file without the `pinned` field (e.g. a user's
  own puzzles) evaluates with the run's config as is (it needed `--config.data.pinned_field=` before); a task
  without start canvases of its own still reads the field, and a file without it is the one-line error."""
  generated = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=False)
  lines = [json.loads(line) for line in open(generated["validation"])]
  assert all("pinned" in line for line in lines)
  mine = tmp_path / "mine.jsonl"
  mine.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "pinned"}) + "\n" for line in lines))
  cfg = _sudoku_data_config({"validation_path": str(mine)})
  cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, split="validation"))
  assert cfg.data.pinned_field == "pinned"
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  tok = train_tokenizer(["0123456789"])
  paths = run_lib.data_paths(cfg, str(tmp_path / "run"), progress=False)
  data = run_lib.load_eval_data(cfg, model_config, tok, paths)
  assert [e.prompt for e in data.examples] == [line["prompt"] for line in lines]
  assert data.records.completion_pinned is None
  text_task = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, task="text", task_args={}, ablations={}))
  with pytest.raises(DataError, match=rf"^{mine}:1: missing field 'pinned' \(pinned_field; set data.pinned_field=''"):
    run_lib.load_eval_data(text_task, model_config, tok, paths)
  # the generated split (with its pins) loads the same examples either way
  pinned = run_lib.load_eval_data(dataclasses.replace(text_task, data=dataclasses.replace(
      cfg.data, validation_path="")), model_config, tok, generated)
  assert pinned.records.completion_pinned is not None and len(pinned) == len(lines)


def test_a_record_the_task_cannot_score_fails_when_the_data_are_loaded(tmp_path):
  """A solution one cell short used to fail in the Sudoku metrics, after sampling every puzzle, with a traceback;
  the evaluation data's loader now names its line before anything is sampled."""
  generated = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=False)
  lines = [json.loads(line) for line in open(generated["validation"])]
  lines[1]["completion"] = lines[1]["completion"][:80]
  mine = tmp_path / "mine.jsonl"
  mine.write_text("".join(json.dumps(line) + "\n" for line in lines))
  cfg = _sudoku_data_config({"validation_path": str(mine)})
  cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, split="validation"))
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  paths = run_lib.data_paths(cfg, str(tmp_path / "run"), progress=False)
  with pytest.raises(DataError, match=rf"^{mine}:2: task 'sudoku' cannot use this record \(metrics: ValueError: "
                                      r"expected 81 cells.*got 80\)$"):
    run_lib.load_eval_data(cfg, model_config, train_tokenizer(["0123456789"]), paths)


def test_a_wrong_reference_or_a_record_an_ablation_cannot_use_fails_when_the_data_are_loaded(tmp_path):
  """A Sudoku reference that parses but breaks the rules (two cells swapped) is named by its line; so is a record
  that only an ablation's task cannot use, when the ablations run (`eval.ablation_steps` > 0), and not otherwise."""
  generated = run_lib.data_paths(_sudoku_data_config(), str(tmp_path / "run"), progress=False)
  lines = [json.loads(line) for line in open(generated["validation"])]
  tok = train_tokenizer(["0123456789"])

  def load(lines, **eval_overrides):
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = _sudoku_data_config({"validation_path": str(mine)})
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, split="validation", **eval_overrides))
    paths = run_lib.data_paths(cfg, str(tmp_path / "run"), progress=False)
    return run_lib.load_eval_data(cfg, run_lib.build_model_config(cfg, _StandInTokenizer()), tok, paths), mine

  swapped = dict(lines[1], completion=lines[1]["completion"][1] + lines[1]["completion"][0]
                 + lines[1]["completion"][2:])
  assert swapped["completion"] != lines[1]["completion"]
  with pytest.raises(DataError, match=r":2: task 'sudoku' cannot use this record \(its reference completion, "
                                      r"scored as its own prediction, gives solved_rate=0.0"):
    load([lines[0], swapped])
  task = dict(task="custom_components:OneDigitTask", task_args={})
  ablations = {"strict": {"refuse": lines[1]["prompt"]}}  # the ablation's task refuses the second puzzle
  assert len(load(lines, **task, ablations=ablations, ablation_steps=0)[0]) == 2
  with pytest.raises(DataError, match=r"mine.jsonl:2: task 'one_digit' cannot use this record \(seed_canvas: "
                                      r"ValueError: prompt holds '\d{81}'\)$"):
    load(lines, **task, ablations=ablations, ablation_steps=8)
