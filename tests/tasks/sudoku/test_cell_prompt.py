"""The cell-identity prompt: the chat template that turns a puzzle into cell characters, rendered by transformers'
own jinja renderer (what an exported tokenizer's `apply_chat_template` runs) and by ours, against `cell_prompt`;
the tokenizer a run trains with it, and the prompt ids the sampling CLI builds."""

from __future__ import annotations

import json
import os

import pytest

from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs.sampling import encode_prompt
from hackable_diffusion.tasks.sudoku import formatting
from hackable_diffusion.tasks.sudoku.cell_prompt import CELL_BASE, CELL_TEMPLATE, cell_char, cell_prompt

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def _notations() -> list[str]:
  grid = formatting.parse_grid(PUZZLE)
  return [PUZZLE, PUZZLE.replace("0", "."), PUZZLE.replace("0", "_"), formatting.render_grid(grid),
          " ".join(PUZZLE)]


def test_every_cell_and_content_is_its_own_character():
  chars = {cell_char(i, v) for i in range(81) for v in range(10)}
  assert len(chars) == 810 and min(map(ord, chars)) == CELL_BASE and max(map(ord, chars)) == CELL_BASE + 809
  prompt = cell_prompt(formatting.parse_grid(PUZZLE))
  assert len(prompt) == 81
  assert [(ord(c) - CELL_BASE) // 10 for c in prompt] == list(range(81))  # cell i at position i
  assert [(ord(c) - CELL_BASE) % 10 for c in prompt] == [int(c) for c in PUZZLE]  # its content
  with pytest.raises(ValueError, match="cell 81"):
    cell_char(81, 0)


@pytest.mark.parametrize("index", range(5))
def test_transformers_renders_the_template_as_cell_prompt(index):
  from transformers.utils.chat_template_utils import render_jinja_template

  text = _notations()[index]
  rendered, _ = render_jinja_template([[{"role": "user", "content": text}]], chat_template=CELL_TEMPLATE,
                                      add_generation_prompt=True)
  assert rendered == [cell_prompt(formatting.parse_grid(PUZZLE))]


def test_a_run_trains_its_tokenizer_on_the_cells_and_saves_the_template(tmp_path):
  data = tmp_path / "train.jsonl"
  grid = formatting.parse_grid(PUZZLE)
  data.write_text(json.dumps(formatting.to_record(grid, formatting.parse_grid(SOLUTION))) + "\n", encoding="utf-8")
  raw = config_lib.load_config_file("sudoku.py", {"data.train_path": str(data)})
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  tok = run_lib.build_tokenizer(cfg, workdir, str(data))
  prompt_ids = tok.encode(cell_prompt(grid))
  assert len(prompt_ids) == 81 and tok.unk_id not in prompt_ids  # one known token per cell
  assert (tmp_path / "run" / "chat_template.jinja").read_text(encoding="utf-8") == CELL_TEMPLATE  # exported with it
  # the sampling CLI's prompt (a pasted grid, the run's template) is the one training reads
  pasted = formatting.render_grid(grid)
  assert encode_prompt(tok, pasted, cfg) == prompt_ids


def test_the_task_template_is_the_sudoku_tasks_and_needs_a_task_that_has_one():
  cfg = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("sudoku.py"))
  assert cfg.data.chat_template == CELL_TEMPLATE and cfg.raw["data"]["chat_template"] == "task"
  with pytest.raises(ConfigError, match="needs data.generator"):
    config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("sudoku.py", {"data.generator": ""}))
  with pytest.raises(ConfigError, match="task 'digits' has no chat template"):
    config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py", {"data.chat_template": "task"}))


@pytest.mark.parametrize("bad, why", [(PUZZLE[:80], "81 cells, this one 80"), (PUZZLE + "1", "81 cells, this one more"),
                                      (PUZZLE[:40] + "x" + PUZZLE[41:], 'character "x" is not a digit')])
def test_a_puzzle_the_template_cannot_read_is_one_line_naming_the_record(bad, why, tmp_path):
  from transformers.utils.chat_template_utils import render_jinja_template

  with pytest.raises(Exception, match=why):  # transformers' renderer: jinja's TemplateError
    render_jinja_template([[{"role": "user", "content": bad}]], chat_template=CELL_TEMPLATE)
  # training data: the record's file and line, one line, before any step
  data = tmp_path / "train.jsonl"
  line = {"completion": SOLUTION, "pinned": "0" * 81}
  data.write_text("".join(json.dumps(line | {"prompt": p}) + "\n" for p in (PUZZLE, bad)), encoding="utf-8")
  cfg = config_lib.ExperimentConfig.from_config_dict(
      config_lib.load_config_file("sudoku.py", {"data.train_path": str(data)}))
  with pytest.raises(DataError, match=rf"^{data}:2: the chat template \(data.chat_template\) failed: .*{why}") as e:
    run_lib.build_tokenizer(cfg, str(tmp_path), str(data))
  assert "\n" not in str(e.value)
