"""The Python API (`hd.SFTConfig`, `hd.SFTTrainer`, `hd.DiffusionGemmaConfig`): the README snippet on a local
checkpoint, the same losses as the config-file path, records as data, and one-line errors for every setting."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from conftest import max_abs_diff

import hackable_diffusion as hd
from hackable_diffusion.data.tokenizer import train_tokenizer
from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib
from hackable_diffusion.training.sft_api import BASE_MODEL_DIR
from hackable_diffusion.training.sft_config import SFTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("shared_xla_cache")


def sort_records(n: int, length: int, seed: int = 0) -> list[dict[str, str]]:
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    s = "".join(rng.choice("0123456789") for _ in range(length))
    out.append({"prompt": s, "completion": "".join(sorted(s))})
  return out


# ---- SFTConfig --------------------------------------------------------------------------------------------------
BAD_VALUES = {
    "output_dir": "", "max_steps": 0, "learning_rate": -1.0, "lr_scheduler_type": "step", "warmup_steps": -1,
    "end_lr_ratio": 1.5, "weight_decay": -0.1, "adam_beta1": 1.0, "adam_beta2": -0.5, "max_grad_norm": 0.0,
    "batch_size": 2.5, "gradient_accumulation_steps": 0, "seed": "0", "lora": {"rank": 8}, "lora_seed": 1.5,
    "dtype": "int8", "master_weights": "yes", "tokenizer": 3, "add_bos": "no", "prompt_field": "",
    "completion_field": None, "messages_field": 3, "chat_template": "<user>", "max_prompt_length": 0, "max_canvases": -2,
    "logging_steps": 0, "save_steps": 0, "save_total_limit": 0, "eval_steps": -5, "eval_at_end": 1, "freeze_router": "yes",
    "eval_num_examples": 0, "eval_batch_size": 0, "eval_step_budgets": (0,), "eval_max_steps": 0,
    "sampling": {"t_min": 0.1}, "loss": "flat", "mesh": {"data": 2}, "model_overrides": {"hidden": 3},
    "num_train_epochs": 0, "per_device_train_batch_size": 0, "max_length": 0, "report_to": "x",
    "max_images": -2, "train_vision": "tower",
}


def test_every_sft_config_field_has_a_one_line_error():
  assert set(BAD_VALUES) == {f.name for f in dataclasses.fields(SFTConfig)}  # a new field needs a case here
  for name, value in BAD_VALUES.items():
    with pytest.raises(ConfigError) as info:
      SFTConfig(**{name: value})
    msg = str(info.value)
    assert msg.startswith(f"SFTConfig.{name}=") and "\n" not in msg, (name, msg)


def test_sft_config_cross_field_errors_and_schedule():
  with pytest.raises(ConfigError, match=r"^SFTConfig.warmup_steps=50: longer than max_steps=20$"):
    SFTConfig(max_steps=20, warmup_steps=50)
  with pytest.raises(ConfigError, match="gradient_accumulation_steps=3: does not divide batch_size=8"):
    SFTConfig(batch_size=8, gradient_accumulation_steps=3)
  sections = SFTConfig(max_steps=300, learning_rate=2e-4).experiment_sections()
  assert sections["optimizer"]["decay_steps"] == 300 and sections["train"]["steps"] == 300  # schedule = the run
  assert sections["optimizer"]["warmup_steps"] == 15 and SFTConfig(max_steps=5000).warmup_steps == 100
  assert sections["optimizer"]["peak_lr"] == 2e-4
  # replace() derives the derived fields again (a keyword on top of args=); given ones are kept
  assert SFTConfig().replace(max_steps=40).warmup_steps == 2 and SFTConfig(warmup_steps=7).replace(max_steps=40
                                                                                                  ).warmup_steps == 7
  assert SFTConfig(per_device_train_batch_size=2).replace(gradient_accumulation_steps=4).batch_size == 8
  assert SFTConfig().replace(num_train_epochs=2).with_num_records(80).max_steps == 20
  cfg = config_lib.ExperimentConfig.from_config_dict({**sections, "model": {"preset": "tiny"},
                                                     "data": {**sections["data"], "train_path": "x.jsonl"}})
  assert cfg.optimizer.decay_steps == 300 and cfg.lora is None and cfg.model.dtype == "auto"


def test_sft_config_defaults_are_the_sections_defaults():
  """Every SFTConfig field that is a section key defaults to the section's typed default, except the documented
  DIFFERENT_DEFAULTS (each with a reason, named in its field's comment); and the mapping is what
  experiment_sections() writes."""
  from hackable_diffusion.training import sft_config

  defaults = config_lib.ExperimentConfig.from_config_dict({"data": {"train_path": "x.jsonl"}})
  ours = SFTConfig()

  def section_value(cfg, section, key):
    if section == "lora":
      return cfg.lora_seed
    return getattr(cfg, section) if key is None else getattr(getattr(cfg, section), key)

  source = open(sft_config.__file__, encoding="utf-8").read()
  for name, (section, key) in sft_config.SECTION_KEYS.items():
    expected, got = section_value(defaults, section, key), getattr(ours, name)
    if name in sft_config.DIFFERENT_DEFAULTS:
      assert got != expected and len(sft_config.DIFFERENT_DEFAULTS[name]) > 20, name
      assert re.search(rf"\n  {name}: .*# DIFFERENT_DEFAULTS", source), f"{name}: the field comment must say so"
    else:
      assert got == expected, f"SFTConfig.{name}={got!r} but {section}.{key}={expected!r}: undocumented difference"
  unmapped = {f.name for f in dataclasses.fields(SFTConfig)} - set(sft_config.SECTION_KEYS)
  assert unmapped == {"output_dir", "num_train_epochs", "per_device_train_batch_size", "max_length", "report_to",
                      "lora"}
  sections = ours.experiment_sections()
  built = config_lib.ExperimentConfig.from_config_dict({**sections, "model": {"preset": "tiny"},
                                                       "data": {**sections["data"], "train_path": "x.jsonl"}})
  for name, (section, key) in sft_config.SECTION_KEYS.items():
    if name not in ("tokenizer", "add_bos"):  # set by hd.SFTTrainer from the model
      assert section_value(built, section, key) == getattr(ours, name), name


# ---- the README snippet -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_checkpoint(hf_factory, tmp_path_factory):
  """A tiny HF DiffusionGemma folder with a SentencePiece tokenizer (pad 0, eos 1, bos 2) and JSONL data."""
  _, path = hf_factory("api_base")
  folder = tmp_path_factory.mktemp("api_model")
  for name in os.listdir(path):
    shutil.copy(os.path.join(path, name), folder / name)
  records = sort_records(48, 4)
  train_tokenizer([r["prompt"] for r in records] + [r["completion"] for r in records]).save(str(folder))
  data = folder.parent / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(folder), str(data)


def readme_snippet() -> str:
  text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  m = re.search(r"<!-- api-snippet[^>]*-->\n```python\n(.*?)```", text, re.S)
  assert m, "README.md lost its Python API snippet"
  return m.group(1)


def test_readme_snippet_runs_on_a_local_folder(local_checkpoint, tmp_path, monkeypatch):
  import peft
  import torch
  from conftest import make_hf_model

  folder, data = local_checkpoint
  code = readme_snippet()
  # 3 steps, evaluated by the snippet's `trainer.evaluate()` alone (the end-of-run evaluation is the same loop:
  # tests/training/test_trainer.py), with one short step budget (the budgets are one loop each: tests/evaluation)
  for old, new in (("path/to/diffusiongemma", folder), ("train.jsonl", data),
                   ("max_steps=200", "max_steps=3, eval_at_end=False, eval_step_budgets=(4,), eval_max_steps=4")):
    assert old in code
    code = code.replace(old, new)
  monkeypatch.chdir(tmp_path)  # runs/ and exports/ land here
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the documented snippet itself
  trainer = scope["trainer"]
  assert trainer.trainer.step == 3 and scope["report"]["runs"]
  assert trainer.config.model.dtype == "auto" and trainer.config.data.add_bos  # bos from the tokenizer
  assert hd.DiffusionGemmaConfig.from_pretrained(folder) == hd.load_pretrained(folder).config
  # the adapter loads with peft onto transformers' model and gives our trained model's logits
  trained = run_lib.load_run(str(tmp_path / "runs" / "my_sft")).model
  ids = np.array([[2, 5, 7, 9, 4]], np.int64)
  canvas = np.array([[6, 5, 8, 11, 3, 1]], np.int64)
  ours = np.asarray(trained(jax.numpy.asarray(ids), jax.numpy.asarray(canvas)))
  base = np.asarray(hd.load_pretrained(folder)(jax.numpy.asarray(ids), jax.numpy.asarray(canvas)))
  assert max_abs_diff(ours, base) > 1e-5  # three LoRA steps changed something
  adapter = str(tmp_path / "exports" / "adapter")
  ref = peft.PeftModel.from_pretrained(make_hf_model(0), adapter).eval()
  with torch.no_grad():
    theirs = ref(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.numpy()
  assert max_abs_diff(theirs, ours) <= 1e-4
  # adapter_path= is load_pretrained's adapter= under transformers' name; the merged export matches as well
  np.testing.assert_allclose(np.asarray(hd.load_pretrained(folder, adapter_path=adapter)(
      jax.numpy.asarray(ids), jax.numpy.asarray(canvas))), ours, atol=1e-5)
  merged = hd.load_pretrained(str(tmp_path / "exports" / "merged"), dtype="float32")
  assert max_abs_diff(np.asarray(merged(jax.numpy.asarray(ids), jax.numpy.asarray(canvas))), ours) <= 0.1  # bf16
  with pytest.raises(ConfigError, match="disagree"):
    hd.load_pretrained(folder, adapter="a", adapter_path="b")


# ---- the same trainer as the config file ------------------------------------------------------------------------
def test_api_and_config_file_give_the_same_first_losses(tmp_path):
  overrides = {"train.steps": 5, "train.log_every": 1, "train.eval_at_end": False, "optimizer.decay_steps": 5,
               "optimizer.warmup_steps": 2, "data.generator_args.num_train": 256,
               "data.generator_args.num_validation": 8, "train.async_checkpointing": False}
  cli_dir = tmp_path / "cli"
  trainer_lib.train(config_lib.load_config_file("tiny.py", overrides), str(cli_dir), progress=False)
  cli_cfg = run_lib.as_experiment_config(config_lib.config_from_json(str(cli_dir / "config.json")))
  tok = run_lib.load_run_tokenizer(str(cli_dir))
  model_config = run_lib.build_model_config(cli_cfg, tok)
  opt = cli_cfg.optimizer
  args = hd.SFTConfig(output_dir=str(tmp_path / "api"), max_steps=5, warmup_steps=2, learning_rate=opt.peak_lr,
                      end_lr_ratio=opt.end_lr_ratio, weight_decay=opt.weight_decay, adam_beta1=opt.b1,
                      adam_beta2=opt.b2, max_grad_norm=opt.clip_norm, batch_size=cli_cfg.train.batch_size,
                      logging_steps=1, eval_at_end=False, max_prompt_length=cli_cfg.data.max_prompt_length,
                      tokenizer=str(cli_dir / "tokenizer.model"), loss=cli_cfg.diffusion)
  with hd.SFTTrainer(model=model_config, train_dataset=str(cli_dir / "data" / "train.jsonl"), args=args,
                     progress=False) as api:
    api.train()
    assert api.trainer.model_config == model_config

  def losses(workdir):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r["train/loss"] for r in rows if "train/loss" in r]

  cli_losses, api_losses = losses(cli_dir), losses(tmp_path / "api")
  assert len(cli_losses) == 5 and len(set(cli_losses)) > 1
  np.testing.assert_allclose(api_losses, cli_losses, rtol=1e-6)


# ---- models and data given as objects ---------------------------------------------------------------------------
def test_records_and_module_inputs(tmp_path):
  import grain

  records = sort_records(64, 4, seed=1)
  config = hd.get_preset("tiny", canvas_length=6, vocab_size=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
  module = hd.DiffusionGemma(config, rngs=nnx.Rngs(3))
  args = hd.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=2, batch_size=8, eval_at_end=False,
                      max_prompt_length=6, lora=hd.LoraConfig(rank=2), learning_rate=1e-2)
  source = grain.MapDataset.source(records)
  with hd.SFTTrainer(model=module, train_dataset=source, args=args, progress=False) as trainer:
    trainer.train()
    written = trainer.config.data.train_path
    assert os.path.dirname(written) == str(tmp_path / "run" / "data")
    assert [json.loads(line) for line in open(written)] == records  # the records, in order
    # the module's weights are the base: saved once, then loaded as the frozen weights of the LoRA run
    base = hd.load_pretrained(str(tmp_path / "run" / BASE_MODEL_DIR))
    np.testing.assert_array_equal(np.asarray(base.embed_tokens[...]),
                                  np.asarray(module.embed_tokens[...]))
  # a list of the same records is the same file (named by content); another module config is refused
  again = hd.SFTTrainer(model=module, train_dataset=records, args=args)
  assert again.config.data.train_path == written
  other = hd.DiffusionGemma(config.replace(hidden_size=48), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="base model of an earlier run"):
    hd.SFTTrainer(model=other, train_dataset=records, args=args)
  bad = records[:3] + [{"prompt": "12"}]
  with pytest.raises(DataError, match=r"^train_dataset\[3\]\['completion'\] is missing"):
    hd.SFTTrainer(model=config, train_dataset=bad, args=args)
  with pytest.raises(DataError, match="no such file"):
    hd.SFTTrainer(model=config, train_dataset=str(tmp_path / "nope.jsonl"), args=args)
  with pytest.raises(ConfigError, match="expected a hd.SFTConfig"):
    hd.SFTTrainer(model=config, train_dataset=records, args={"max_steps": 3})


def test_hub_id_resolves_from_the_local_cache_offline(hf_factory, tmp_path, monkeypatch):
  """A Hub id resolves through huggingface_hub's cache layout (models--owner--name/snapshots/<rev>), offline."""
  from hackable_diffusion.errors import CheckpointError
  from hackable_diffusion.hub import resolve_model_path

  _, path = hf_factory("api_base")
  revision = "0123456789abcdef0123456789abcdef01234567"
  repo = tmp_path / "hub" / "models--acme--tiny-dg"
  snapshot = repo / "snapshots" / revision
  snapshot.mkdir(parents=True)
  for name in os.listdir(path):
    shutil.copy(os.path.join(path, name), snapshot / name)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(revision)
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
  assert os.path.samefile(resolve_model_path("acme/tiny-dg"), snapshot)
  loaded = hd.load_pretrained("acme/tiny-dg")
  direct = hd.load_pretrained(path)
  np.testing.assert_array_equal(np.asarray(loaded.embed_tokens[...]),
                                np.asarray(direct.embed_tokens[...]))
  assert hd.DiffusionGemmaConfig.from_pretrained("acme/tiny-dg") == direct.config
  with pytest.raises(CheckpointError, match=r"^acme/missing: not in the local Hugging Face cache and HF_HUB_OFFLINE"):
    resolve_model_path("acme/missing")
  with pytest.raises(CheckpointError, match="no such checkpoint directory"):
    hd.load_pretrained(str(tmp_path / "not_there"))


# ---- the keyword form -------------------------------------------------------------------------------------------
def sudoku_like_records(n: int, seed: int = 0) -> list[dict[str, str]]:
  """81-character grids: the prompt with '.' blanks, the completion every cell filled."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    grid = "".join(rng.choice("123456789") for _ in range(81))
    out.append({"prompt": "".join(c if rng.random() < 0.4 else "." for c in grid), "completion": grid})
  return out


@pytest.mark.slow  # a whole training run; test_readme_snippet_runs_on_a_local_folder trains through the same API
def test_keyword_form_runs(hf_factory, tmp_path, monkeypatch):
  """`SFTTrainer(model=DiffusionGemmaConfig.from_pretrained(DIR), dataset_path=..., batch_size=8,
  learning_rate=1e-4, num_steps=N).train()`: keywords mapped onto SFTConfig (dataset_path = train_dataset,
  num_steps = max_steps), a fresh init of the checkpoint's config, output in runs/sft."""
  from hackable_diffusion.training.sft_api import SFTTrainer
  from hackable_diffusion.model.config import DiffusionGemmaConfig

  _, DIR = hf_factory("sudoku_canvas96", canvas=96)
  monkeypatch.chdir(tmp_path)
  records = sudoku_like_records(8)
  assert all(len(r["prompt"]) == 81 and "." in r["prompt"] for r in records)
  with open("sudoku_81char.jsonl", "w", encoding="utf-8") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
  out = SFTTrainer(model=DiffusionGemmaConfig.from_pretrained(DIR), dataset_path="sudoku_81char.jsonl", batch_size=8,
                   learning_rate=1e-4, num_steps=2).train()
  assert out.global_step == 2 and np.isfinite(out.training_loss)
  stored = json.load(open(tmp_path / "runs" / "sft" / "config.json", encoding="utf-8"))
  assert stored["train"]["steps"] == 2 and stored["train"]["batch_size"] == 8
  assert stored["optimizer"]["peak_lr"] == 1e-4


def test_the_evaluation_batch_follows_the_training_micro_batch():
  """SFTConfig's evaluation batch defaults to the training micro-batch (a batch the memory plan already fits), at
  most 64; `replace` derives it again, and a given value is kept."""
  assert SFTConfig().eval_batch_size == SFTConfig().batch_size < 64
  assert SFTConfig(batch_size=16, gradient_accumulation_steps=8).eval_batch_size == 2
  assert SFTConfig(batch_size=512).eval_batch_size == 64
  assert SFTConfig(batch_size=8).replace(batch_size=4).eval_batch_size == 4
  assert SFTConfig(batch_size=8, eval_batch_size=5).replace(batch_size=4).eval_batch_size == 5
  assert SFTConfig(batch_size=16, gradient_accumulation_steps=8).experiment_sections()["eval"]["batch_size"] == 2
