"""Every config file in configs/ builds: typed sections, model config, abstract model, data config, eval task.

Models are built with `nnx.eval_shape` (shapes only), so even the 26B configs cost no memory. Files added to
configs/ later are picked up automatically.
"""

from __future__ import annotations

import glob
import os

import pytest

from hackable_diffusion.evaluation import loop
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.training import config as config_lib
from hackable_diffusion.training import trainer as trainer_lib

CONFIG_FILES = sorted(glob.glob(os.path.join(config_lib.CONFIGS_DIR, "*.py")))


class _StandInTokenizer:
  """The tokenizer a config would train or load: only its size and special ids matter here."""

  vocab_size, pad_id, eos_id, bos_id, unk_id = 32, 0, 1, 2, 3


def test_configs_exist():
  assert any(os.path.basename(f) == "tiny.py" for f in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_builds(path, tmp_path):
  raw = config_lib.load_config_file(path)
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  assert set(cfg.raw) <= set(config_lib.SECTIONS)

  # the resolved config survives the workdir round trip
  config_lib.write_config_json(raw, str(tmp_path))
  again = config_lib.ExperimentConfig.from_config_dict(config_lib.workdir_config(str(tmp_path)))
  assert again.train == cfg.train and again.eval == cfg.eval and again.optimizer == cfg.optimizer

  if cfg.model.checkpoint and not os.path.isdir(cfg.model.checkpoint):
    # A fine-tuning config whose base run is not on this machine: stand in a base workdir (config.json of
    # configs/sudoku.py + an empty checkpoints/ dir), which is all building the model's shapes needs.
    base = tmp_path / "base_run"
    (base / "checkpoints").mkdir(parents=True)
    config_lib.write_config_json(config_lib.load_config_file("sudoku.py"), str(base))
    raw.model.checkpoint = str(base)
    cfg = config_lib.ExperimentConfig.from_config_dict(raw)
    assert trainer_lib.is_run_workdir(str(base))
  model_config = trainer_lib.build_model_config(cfg, _StandInTokenizer())
  assert isinstance(model_config, ModelConfig)
  model, _ = trainer_lib.build_model(cfg, model_config, abstract=True)
  assert model.config == model_config

  data_cfg = trainer_lib.sft_data_config(cfg, model_config, "unused.jsonl", batch_size=cfg.train.batch_size,
                                         shuffle=True, seed=0)
  assert data_cfg.canvas_length == model_config.canvas_length
  task = trainer_lib.eval_task(cfg)
  assert callable(task.metrics)
  trainer_lib.check_eval_tasks(cfg)  # every ablation's task builds
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model_config.canvas_length
  runs = loop.eval_runs(cfg.eval, max_new)
  assert runs[-1].sampling.early_stopping and len(runs) == len(set(cfg.eval.step_budgets)) + 1


def test_bad_ablation_task_argument_fails_before_training(tmp_path):
  raw = config_lib.load_config_file("sudoku.py")
  raw.eval.ablations.no_pins = {"pin_givns": False}
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  with pytest.raises(config_lib.ConfigError, match=r"eval.ablations.no_pins: task 'sudoku': bad task arguments") as e:
    trainer_lib.SFTTrainer(cfg, str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")  # failed before writing anything (no data, no checkpoint)


def test_unknown_and_invalid_keys_are_one_line_errors():
  raw = config_lib.load_config_file("tiny.py")
  with pytest.raises(config_lib.ConfigError, match="valid keys: .*peak_lr") as err:
    config_lib.apply_overrides(raw, {"optimizer.peak_lrr": 1.0})
  assert "\n" not in str(err.value)
  bad = raw.to_dict()
  bad["train"]["stepz"] = 3
  with pytest.raises(config_lib.ConfigError, match=r"unknown key\(s\) \['train.stepz'\]; valid keys of 'train'"):
    config_lib.ExperimentConfig.from_config_dict(bad)
  bad = raw.to_dict()
  bad["diffusion"]["loss_variant"] = "nope"
  with pytest.raises(config_lib.ConfigError, match="diffusion.loss_variant='nope'"):
    config_lib.ExperimentConfig.from_config_dict(bad)
  bad = raw.to_dict()
  bad["model"]["overrides"]["hidden_sise"] = 3
  with pytest.raises(config_lib.ConfigError, match="model.overrides has unknown key"):
    config_lib.ExperimentConfig.from_config_dict(bad)
  bad = raw.to_dict()
  bad["bogus"] = {}
  with pytest.raises(config_lib.ConfigError, match="unknown config section"):
    config_lib.ExperimentConfig.from_config_dict(bad)


def test_config_path_resolution(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # works from anywhere: bare names resolve into the repository's configs/
  tiny = os.path.join(config_lib.CONFIGS_DIR, "tiny.py")
  assert config_lib.resolve_config_path("tiny.py") == tiny
  assert config_lib.resolve_config_path("tiny") == tiny
  assert config_lib.resolve_config_path("configs/tiny.py") == tiny
  with pytest.raises(config_lib.ConfigError, match="not found .* available: .*tiny.py"):
    config_lib.resolve_config_path("nope.py")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "tiny.py").write_text("def get_config():\n  return {'train': {'steps': 1}}\n")
  assert os.path.samefile(config_lib.resolve_config_path("tiny.py"), tmp_path / "configs" / "tiny.py")
  assert config_lib.load_config_file("tiny.py").train.steps == 1  # the cwd's configs/ comes first
