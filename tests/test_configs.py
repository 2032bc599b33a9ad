"""Every config file in configs/ builds: typed sections, model config, abstract model, data config, eval task.

Models are built with `nnx.eval_shape` (shapes only), so even the 26B configs cost no memory. Files added to
configs/ later are picked up automatically. configs/base.py holds the defaults the others start from; it names no
data, so it is built with a `data.train_path` override.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from hackable_diffusion.evaluation import loop
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion import cli
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib

CONFIG_FILES = sorted(glob.glob(os.path.join(config_lib.CONFIGS_DIR, "*.py")))
BASE_FILE = os.path.join(config_lib.CONFIGS_DIR, "base.py")
BASE_OVERRIDES = {"data.train_path": "train.jsonl"}  # what base.py needs to be a run of its own
DERIVED_FILES = [f for f in CONFIG_FILES if f != BASE_FILE]


class _StandInTokenizer:
  """The tokenizer a config would train or load: only its size and special ids matter here."""

  vocab_size, pad_id, eos_id, bos_id, unk_id = 32, 0, 1, 2, 3


def test_configs_exist():
  assert any(os.path.basename(f) == "tiny.py" for f in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_builds(path, tmp_path):
  raw = config_lib.load_config_file(path, BASE_OVERRIDES if path == BASE_FILE else None)
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  assert set(cfg.raw) <= set(config_lib.SECTIONS)

  # the resolved config survives the workdir round trip
  config_lib.write_config_json(raw, str(tmp_path))
  again = config_lib.ExperimentConfig.from_config_dict(cli.workdir_config(str(tmp_path)))
  assert again.train == cfg.train and again.eval == cfg.eval and again.optimizer == cfg.optimizer

  if cfg.model.checkpoint and not os.path.isdir(cfg.model.checkpoint):
    # A fine-tuning config whose base run is not on this machine: stand in a base workdir (config.json of
    # configs/sudoku.py (the standard architecture, so it stands in for a non-Sudoku config too) + an
    # empty checkpoints/ dir), which is all building the model's shapes needs.
    base = tmp_path / "base_run"
    (base / "checkpoints").mkdir(parents=True)
    stand_in = "sudoku.py"
    config_lib.write_config_json(config_lib.load_config_file(stand_in), str(base))
    raw.model.checkpoint = str(base)
    cfg = config_lib.ExperimentConfig.from_config_dict(raw)
    assert run_lib.is_run_workdir(str(base))
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  assert isinstance(model_config, ModelConfig)
  model, _ = run_lib.build_abstract_model(cfg, model_config)
  assert model.config == model_config

  data_cfg = run_lib.sft_data_config(cfg, model_config, "unused.jsonl", batch_size=cfg.train.batch_size,
                                     shuffle=True, seed=0)
  assert data_cfg.canvas_length == model_config.canvas_length
  task = run_lib.eval_task(cfg)
  assert callable(task.metrics)
  run_lib.check_eval_tasks(cfg)  # every ablation's task builds
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model_config.canvas_length
  runs = loop.eval_runs(cfg.eval, max_new)
  assert runs[-1].sampling.early_stopping and len(runs) == len(set(cfg.eval.step_budgets)) + 1


def _key_paths(tree, prefix=""):
  """Every dotted key of a nested dict, sections included."""
  out = set()
  for k, v in tree.items():
    out |= {prefix + k} | (_key_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else set())
  return out


def test_configs_derive_from_the_base(monkeypatch):
  """Every shipped config calls base.get_config() (a marker added there shows up in each) and keeps every key of
  the base (a config only overrides or adds keys; a section it replaces keeps the base's keys of that section)."""
  from hackable_diffusion.configs import base

  base_keys = _key_paths(config_lib.config_to_dict(base.get_config()))
  original = base.get_config

  def marked():
    config = original()
    config.from_base = True
    return config

  monkeypatch.setattr(base, "get_config", marked)
  assert len(DERIVED_FILES) == len(CONFIG_FILES) - 1
  for path in DERIVED_FILES:
    raw = config_lib.load_config_file(path)
    assert raw.get("from_base") is True, f"{os.path.basename(path)} does not start from base.get_config()"
    missing = base_keys - _key_paths(config_lib.config_to_dict(raw))
    assert not missing, f"{os.path.basename(path)} lacks base keys {sorted(missing)}"


def test_sudoku_main_config_key_settings():
  raw = config_lib.load_config_file("sudoku.py")
  assert raw.model.preset == "sudoku"
  assert "num_attention_heads" not in raw.model.overrides  # the preset's heads: the standard architecture
  assert raw.model.overrides.attention_structure is None
  assert raw.model.overrides.sliding_rope.theta == raw.model.overrides.full_rope.theta == 300.0
  assert raw.data.chat_template == "task"  # the cell-identity prompt
  assert raw.model.overrides.canvas_length == 81
  structured = config_lib.load_config_file("sudoku_structured.py")
  assert structured.model.overrides.num_attention_heads == 6
  assert structured.model.overrides.attention_structure == "hackable_diffusion.tasks.sudoku.structure:own_cell_peer_mask"
  assert raw.data.generator == "sudoku" and raw.data.pinned_field == "pinned"
  assert raw.data.generator_args.num_train == 30_000
  assert raw.train.steps == 2200 and raw.train.batch_size == 32
  assert raw.eval.early_stopping_steps == 32 and tuple(raw.eval.step_budgets) == (8, 16, 32)
  assert raw.eval.split == "test" and raw.eval.num_examples == 300
  assert raw.eval.sampling.confidence_threshold == 0.14
  assert raw.eval.sampling.t_min == 0.4 and raw.eval.sampling.t_max == 2.0


def test_bad_ablation_task_argument_fails_before_training(tmp_path):
  raw = config_lib.load_config_file("sudoku.py")
  raw.eval.ablations.no_pins = {"pin_givns": False}
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  with pytest.raises(config_lib.ConfigError, match=r"eval.ablations.no_pins: task 'sudoku': bad task arguments") as e:
    trainer_lib.Trainer(cfg, str(tmp_path / "run"))
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "run")  # failed before writing anything (no data, no checkpoint)


def test_a_prompt_structure_refuses_a_prompt_width_it_does_not_read():
  # The structured Sudoku config's own-cell head reads prompt slots 0-80 as the grid: a longer (left-padded) prompt
  # would shift the grid out of place silently, so the data config refuses it in one line.
  raw = config_lib.load_config_file("sudoku_structured.py")
  raw.data.max_prompt_length = 82
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  model_config = run_lib.build_model_config(cfg, _StandInTokenizer())
  with pytest.raises(config_lib.ConfigError, match=r"first 81 cache slots, but data.max_prompt_length=82") as e:
    run_lib.sft_data_config(cfg, model_config, "unused.jsonl", batch_size=8, shuffle=False, seed=0)
  assert "\n" not in str(e.value)


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
  # the model a fresh init will build is checked when the config is read (before data or tokenizer exist)
  for overrides, match in (({"top_k_experts": 9}, r"model.overrides: ModelConfig.top_k_experts=9 exceeds"),
                           ({"vocab_size": 16, "pad_token_id": 20}, r"model.overrides: special token id 20"),
                           ({"matmul_dtype": "fp8"}, r"model.overrides: ModelConfig.matmul_dtype='fp8'")):
    bad = raw.to_dict()
    bad["model"]["overrides"].update(overrides)
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.ExperimentConfig.from_config_dict(bad)
  bad = raw.to_dict()
  bad["model"]["preset"] = "tinyy"
  with pytest.raises(config_lib.ConfigError, match=r"model.preset: unknown model preset 'tinyy'"):
    config_lib.ExperimentConfig.from_config_dict(bad)
  fine = raw.to_dict()  # special ids the tokenizer will supply are not judged against the preset's vocabulary
  fine["model"]["overrides"].update(pad_token_id=5000)
  assert config_lib.ExperimentConfig.from_config_dict(fine).model.overrides["pad_token_id"] == 5000
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


def test_sections_are_the_library_dataclasses():
  """eval.sampling is a SamplingConfig, mesh a MeshConfig, lora a LoraConfig: validated by them at start."""
  from hackable_diffusion import lora
  from hackable_diffusion.sampling.config import SamplingConfig
  from hackable_diffusion.sharding.mesh import MeshConfig

  raw = config_lib.load_config_file("tiny.py", {"eval.sampling.t_min": 0.3, "mesh.fsdp": 1})
  with raw.unlocked():
    raw.lora = dict(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj"], seed=3)
  cfg = config_lib.ExperimentConfig.from_config_dict(raw)
  assert isinstance(cfg.eval.sampling, SamplingConfig) and cfg.eval.sampling.t_min == 0.3
  assert isinstance(cfg.mesh, MeshConfig) and not config_lib.mesh_requested(cfg.mesh)
  assert cfg.lora == lora.LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",)) and cfg.lora_seed == 3
  with raw.unlocked():
    raw.lora.enabled = False
  assert config_lib.ExperimentConfig.from_config_dict(raw).lora is None
  cases = [({"lora": dict(enabled=True, rnak=2)}, r"unknown key\(s\) \['lora.rnak'\]; valid keys of 'lora': .*rank"),
           ({"lora": dict(enabled=False, rank=0)}, r"^lora.rank=0 is invalid"),
           ({"mesh": dict(fsdp=0)}, r"^mesh.fsdp=0"),
           ({"eval": dict(sampling=dict(t_min=0.9, t_max=0.1))}, r"^eval.sampling.t_min=0.9"),
           ({"eval": dict(sampling=dict(entropy_bound=0.0))}, r"^eval.sampling.entropy_bound=0.0"),
           ({"eval": dict(sampling=dict(tmin=0.9))}, r"unknown key\(s\) \['eval.sampling.tmin'\]")]
  for section, pattern in cases:
    bad = config_lib.config_to_dict(config_lib.load_config_file("tiny.py"))
    bad.update(section)
    with pytest.raises(config_lib.ConfigError, match=pattern) as err:
      config_lib.ExperimentConfig.from_config_dict(bad)
    assert "\n" not in str(err.value)


def test_lora_section_applies_its_seed():
  """`lora.seed` initialises the adapters: two seeds give different adapter A matrices, one seed the same."""
  from flax import nnx

  from hackable_diffusion.model.config import get_preset
  from hackable_diffusion.model.transformer import DiffusionGemma

  base = config_lib.config_to_dict(config_lib.load_config_file("tiny.py"))

  def adapters(seed):
    cfg = config_lib.ExperimentConfig.from_config_dict({**base, "lora": dict(enabled=True, rank=2, seed=seed)})
    model, trainable = run_lib.apply_lora(cfg, DiffusionGemma(get_preset("tiny"), rngs=nnx.Rngs(0)))
    assert trainable is nnx.LoRAParam
    return [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]

  a, b, c = adapters(0), adapters(0), adapters(1)
  assert len(a) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))
  assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_schedule_follows_train_steps_and_checkpoint_needs_no_preset():
  """decay_steps 0 or unset spans the run (a `--config.train.steps` override moves the schedule with it); a model
  section with only a checkpoint needs no `preset=''`; both set is a one-line error."""
  base = {"data": {"train_path": "x.jsonl"}}
  cfg = config_lib.ExperimentConfig.from_config_dict({**base, "train": {"steps": 123}})
  assert cfg.optimizer.decay_steps == 123 and cfg.model.preset == "tiny"
  cfg = config_lib.ExperimentConfig.from_config_dict({**base, "train": {"steps": 50},
                                                     "optimizer": {"decay_steps": 0}})
  assert cfg.optimizer.decay_steps == 50
  assert config_lib.ExperimentConfig.from_config_dict(
      {**base, "optimizer": {"decay_steps": 77}}).optimizer.decay_steps == 77  # explicit: kept
  shipped = config_lib.load_config_file("sudoku.py", {"train.steps": 40})
  assert config_lib.ExperimentConfig.from_config_dict(shipped).optimizer.decay_steps == 40
  cfg = config_lib.ExperimentConfig.from_config_dict({**base, "model": {"checkpoint": "some/dir"}})
  assert cfg.model.preset == "" and cfg.model.checkpoint == "some/dir"
  with pytest.raises(config_lib.ConfigError, match=r"set exactly one .* set model.preset=''$"):
    config_lib.ExperimentConfig.from_config_dict({**base, "model": {"preset": "tiny", "checkpoint": "some/dir"}})
