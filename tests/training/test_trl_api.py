"""TRL/PEFT conventions of `hd.SFTTrainer` / `hd.SFTConfig` / `hd.LoraConfig`: a TRL-style script (PEFT names,
`peft_config=`, a transformers `TrainerCallback`, `state.log_history`) gives bit-identical losses to the same run
written with the library's own names; settings resolved from the data / model; one-line errors for the rest."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import types

import pytest
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.data.tokenizer import TOKENIZER_FILENAME, train_tokenizer
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.training.sft_api import FINAL_DIR, TrainOutput
from training.test_sft_api import sort_records

pytestmark = pytest.mark.usefixtures("shared_xla_cache")


RECORDS = sort_records(64, 4, seed=2)
CONFIG = dict(canvas_length=6, vocab_size=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
SHARED = dict(max_steps=4, logging_steps=1, eval_at_end=False, learning_rate=1e-2, warmup_steps=1,
              lr_scheduler_type="linear", weight_decay=0.01, seed=3, eval_step_budgets=(2,), eval_max_steps=2,
              eval_num_examples=8, eval_batch_size=8)


def metrics_losses(workdir: str) -> list[float]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8")]
  return [r["train/loss"] for r in rows if "train/loss" in r]


def test_trl_script_matches_the_library_names(tmp_path):
  transformers = pytest.importorskip("transformers")
  module = hd.DiffusionGemma(hd.get_preset("tiny", **CONFIG), rngs=nnx.Rngs(3))

  # the library's own names
  old = hd.SFTConfig(output_dir=str(tmp_path / "old"), batch_size=8, gradient_accumulation_steps=2,
                     max_prompt_length=6, lora=hd.LoraConfig(rank=4, alpha=8, dropout=0.05,
                                                            target_modules=(r"self_attn\.(q|v)_proj$",)), **SHARED)
  with hd.SFTTrainer(model=module, train_dataset=RECORDS, args=old, progress=False) as trainer:
    trainer.train()

  # a TRL script: PEFT names, peft_config=, per-device batch, max_length, a transformers callback, log_history
  class Recorder(transformers.TrainerCallback):
    def __init__(self):
      self.events: list[tuple[str, int]] = []
      self.logs: list[dict] = []
      self.metrics: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
      self.events.append(("step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
      self.events.append(("log", state.global_step))
      self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
      self.metrics.append(dict(metrics))

  recorder = Recorder()
  args = hd.SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      max_length=12, report_to="none", **SHARED)  # 12 = a 6-token prompt + one 6-token canvas
  peft_config = hd.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
  with hd.SFTTrainer(module, args=args, train_dataset=RECORDS, peft_config=peft_config, callbacks=[recorder],
                     progress=False) as trainer:
    assert trainer.args.batch_size == 8 and trainer.config.data.max_prompt_length == 6
    assert trainer.config.lora.rank == 4 and trainer.config.lora.dropout == 0.05
    out = trainer.train()
    history = trainer.state.log_history
    report = trainer.evaluate()
    final = trainer.save_model()

  reference = metrics_losses(str(tmp_path / "old"))
  losses = [e["loss"] for e in history if "loss" in e]
  assert len(reference) == 4 and len(set(reference)) > 1
  assert losses == reference  # bit-identical
  assert metrics_losses(str(tmp_path / "trl")) == reference
  assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]
  assert all(e["learning_rate"] == e["lr"] for e in history if "loss" in e)
  assert isinstance(out, TrainOutput) and out.global_step == 4 and out["loss"] == reference[-1]
  assert out.training_loss == pytest.approx(sum(reference) / 4, rel=1e-12)
  assert out.metrics["train_loss"] == out.training_loss
  assert recorder.events == [e for s in range(1, 5) for e in (("log", s), ("step_end", s))]
  assert [log["loss"] for log in recorder.logs] == reference
  # evaluation: the report's metrics in log_history and on_evaluate
  assert report["runs"] and recorder.metrics and recorder.metrics[-1] == {k: v for k, v in history[-1].items()
                                                                          if k != "step"}
  assert history[-1]["step"] == 4 and any(k.startswith("eval/") for k in history[-1])
  # report_to='none': metrics.jsonl only; save_model(): the PEFT adapter of a LoRA run in output_dir/final
  assert not os.path.exists(tmp_path / "trl" / "tensorboard") and os.path.isdir(tmp_path / "old" / "tensorboard")
  assert final == str(tmp_path / "trl" / FINAL_DIR)
  assert os.path.isfile(os.path.join(final, "adapter_config.json"))


def test_a_callback_stops_training(tmp_path):
  module = hd.DiffusionGemma(hd.get_preset("tiny", **CONFIG), rngs=nnx.Rngs(3))

  class StopAtTwo:  # duck-typed: no transformers base class
    def on_step_end(self, args, state, control, **kwargs):
      control.should_training_stop = state.global_step >= 2

  args = hd.SFTConfig(output_dir=str(tmp_path / "run"), batch_size=8, gradient_accumulation_steps=2,
                      max_prompt_length=6, **SHARED)  # the first test's run: its compiled step is reused
  peft_config = hd.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
  with hd.SFTTrainer(module, args=args, train_dataset=RECORDS, peft_config=peft_config, callbacks=[StopAtTwo()],
                     progress=False) as trainer:
    out = trainer.train()
    assert out.global_step == 2 and trainer.state.global_step == 2
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "2")


def test_settings_resolved_from_data_and_model(tmp_path):
  config = hd.get_preset("tiny", **CONFIG)
  base = dict(output_dir=str(tmp_path / "run"), eval_at_end=False)
  trainer = hd.SFTTrainer(config, args=hd.SFTConfig(num_train_epochs=2.5, per_device_train_batch_size=3,
                                                    gradient_accumulation_steps=2, **base), train_dataset=RECORDS)
  assert trainer.config.train.batch_size == 6 and trainer.config.train.grad_accum_steps == 2
  assert trainer.config.train.steps == math.ceil(2.5 * 64 / 6) == trainer.config.optimizer.decay_steps
  assert trainer.config.optimizer.warmup_steps == math.ceil(2.5 * 64 / 6) // 20
  # max_steps wins over num_train_epochs (as in transformers); keywords are SFTConfig fields on top of args
  trainer = hd.SFTTrainer(config, args=hd.SFTConfig(num_train_epochs=2, max_steps=7, **base), train_dataset=RECORDS,
                          lr_scheduler_type="constant", max_length=10, max_canvases=1, logging_steps=3, save_steps=5,
                          eval_steps=2, seed=4, warmup_steps=2, weight_decay=0.5)
  cfg = trainer.config
  assert (cfg.train.steps, cfg.optimizer.schedule, cfg.data.max_prompt_length) == (7, "constant", 4)
  assert (cfg.train.log_every, cfg.train.checkpoint_every, cfg.train.eval_every, cfg.train.seed) == (3, 5, 2, 4)
  assert (cfg.optimizer.warmup_steps, cfg.optimizer.weight_decay) == (2, 0.5)
  # processing_class: a path, our Tokenizer (saved under output_dir), a transformers tokenizer's local folder
  tok = train_tokenizer([r["prompt"] + r["completion"] for r in RECORDS])
  folder = tmp_path / "tok"
  tok.save(str(folder))
  for processing_class, expected in ((str(folder / TOKENIZER_FILENAME), str(folder / TOKENIZER_FILENAME)),
                                     (types.SimpleNamespace(name_or_path=str(folder)), str(folder)),
                                     (tok, str(tmp_path / "run" / "processing_class" / TOKENIZER_FILENAME))):
    trainer = hd.SFTTrainer(config, args=hd.SFTConfig(max_steps=2, **base), train_dataset=RECORDS,
                            processing_class=processing_class)
    assert trainer.args.tokenizer == expected and trainer.config.tokenizer.path == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(peft_config=hd.LoraConfig(), lora=hd.LoraConfig()), "^SFTTrainer: give peft_config or SFTConfig.lora"),
    (dict(processing_class=types.SimpleNamespace(name_or_path="acme/tok")), "^processing_class=SimpleNamespace: "),
    (dict(data_collator=object()), "^SFTTrainer: data_collator is not supported: "),
    (dict(max_step=3), "^SFTTrainer: unknown setting 'max_step'; did you mean max_steps"),
    (dict(bf16=True), "^SFTTrainer: bf16 is not supported: use dtype='bfloat16'"),
    (dict(dataset_path="x.jsonl"), "^SFTTrainer: give train_dataset or dataset_path, not both"),
    (dict(num_steps=3, max_steps=4), "^SFTTrainer: give max_steps or num_steps, not both"),
    (dict(max_length=6), r"^SFTConfig.max_length=6: leaves no prompt tokens"),
    (dict(per_device_train_batch_size=2, batch_size=8), r"^SFTConfig.batch_size=8: per_device_train_batch_size=2"),
    (dict(report_to="comet_ml"), r"^SFTConfig.report_to='comet_ml': expected one of"),
])
def test_trl_settings_one_line_errors(tmp_path, kwargs, message):
  with pytest.raises(ConfigError, match=message) as info:
    hd.SFTTrainer(hd.get_preset("tiny", **CONFIG), train_dataset=RECORDS, output_dir=str(tmp_path / "r"), **kwargs)
  assert "\n" not in str(info.value)


def test_report_to_wandb_needs_wandb():
  if importlib.util.find_spec("wandb") is not None:
    assert hd.SFTConfig(report_to=["tensorboard", "wandb"]).wandb
  else:
    with pytest.raises(ConfigError, match=r"^SFTConfig.report_to='wandb': wandb is not installed"):
      hd.SFTConfig(report_to="wandb")
  assert not hd.SFTConfig(report_to="none").tensorboard and hd.SFTConfig().tensorboard
