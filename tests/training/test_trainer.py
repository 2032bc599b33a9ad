"""The Trainer end to end on `configs/tiny.py`: learning, workdir layout, exact resume, non-finite loss.

Compile cost dominates on CPU, so the module trains once (module fixture, a short run) and the resume test reuses
the same compiled train step (the trainer memoises it per model graph / optimizer / loss config). The learning
check trains for longer in the slow tier.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.runs import checkpoints
from hackable_diffusion import cli
from hackable_diffusion.errors import DataError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.training import logging as log_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib

STEPS = 100  # the module's run: layout, metrics, checkpoints, resume
LEARNING_STEPS = 500  # the learning check (slow tier)
# Shared by every run of this module so that the compiled train step is reused.
COMMON = {
    "optimizer.decay_steps": STEPS,
    "train.log_every": 20,
    "train.checkpoint_every": 20,
    "eval.num_examples": 64,
    "eval.step_budgets": (2, 8),
    "eval.early_stopping_steps": 8,
}


pytestmark = pytest.mark.usefixtures("shared_xla_cache")  # tests/conftest.py


def tiny_config(**overrides):
  return config_lib.load_config_file("tiny.py", {**COMMON, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  metrics = trainer_lib.train(tiny_config(**{"train.steps": STEPS, "train.eval_every": STEPS // 2}), workdir,
                              progress=False)
  return workdir, metrics


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("tiny_learned"))
  metrics = trainer_lib.train(tiny_config(**{"train.steps": LEARNING_STEPS, "optimizer.decay_steps": LEARNING_STEPS,
                                             "train.checkpoint_every": LEARNING_STEPS}), workdir, progress=False)
  return workdir, metrics


def _report(workdir, step):
  with open(os.path.join(workdir, "eval", f"report_step_{step}.json")) as f:
    return json.load(f)


@pytest.mark.slow  # a 500-step run; test_step.py checks in the default tier that the loss falls
def test_tiny_learns_to_sort_far_above_chance(learned):
  """Sorting 7 random digits: the best input-independent guess (the mode of each order statistic) gets 0.32
  character accuracy and 0.0004 exact match. 500 steps reach about 0.9 / 0.5 here (300 steps: 0.75 / 0.16);
  the thresholds (0.75 / 0.25) leave room for differences between machines while staying far above that
  baseline."""
  workdir, metrics = learned
  assert metrics["loss"] < 1.5
  report = _report(workdir, LEARNING_STEPS)
  runs = {r["name"]: r for r in report["runs"]}
  assert set(runs) == {"steps_2", "steps_8", "early_stopping"}
  best = runs["steps_8"]["metrics"]
  assert best["char_accuracy"] > 0.75, best
  assert best["exact_match"] > 0.25, best
  assert runs["steps_8"]["mean_denoising_steps"] == 8.0
  assert 1.0 <= runs["early_stopping"]["mean_denoising_steps"] <= 8.0
  assert len(report["samples"]) == 8 and {"prompt", "target", "prediction"} <= set(report["samples"][0])


def test_workdir_layout_and_metrics(trained):
  workdir, _ = trained
  for name in ("config.json", "tokenizer.model", "metrics.jsonl", "data/train.jsonl", "data/validation.jsonl",
               f"eval/report_step_{STEPS}.json", f"eval/accuracy_vs_steps_step_{STEPS}.png"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved["train"]["steps"] == STEPS and saved["eval"]["step_budgets"] == [2, 8]
  # the saved config rebuilds the same typed config
  again = config_lib.ExperimentConfig.from_config_dict(cli.workdir_config(workdir))
  assert again.train.steps == STEPS and again.eval.step_budgets == (2, 8)
  records = log_lib.read_metrics(workdir)
  train_steps = [r["step"] for r in records if "train/loss" in r]
  assert train_steps == list(range(20, STEPS + 1, 20))
  losses = [r["train/loss"] for r in records if "train/loss" in r]
  assert losses[-1] < losses[0] * 0.6
  eval_steps = [r["step"] for r in records if "eval/steps_8/char_accuracy" in r]
  assert eval_steps == [STEPS // 2, STEPS]  # train.eval_every=STEPS // 2 and at the end
  assert os.path.exists(os.path.join(workdir, "eval", f"report_step_{STEPS // 2}.json"))
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  assert ckpt.all_steps() == [STEPS - 20, STEPS]  # keep_checkpoints=2
  meta = ckpt.restore_meta()
  assert meta["step"] == STEPS and meta["seed"] == 0 and "next_index" in json.dumps(meta["data_state"])


def test_load_run_restores_the_trained_model(trained):
  workdir, _ = trained
  run = run_lib.load_run(workdir)
  assert run.step == STEPS
  assert run.model.config.vocab_size == run.tokenizer.vocab_size == 14
  with trainer_lib.Trainer(tiny_config(**{"train.steps": STEPS}), workdir, progress=False) as t:
    assert t.step == STEPS  # resumed, nothing left to train
    expected = jax.tree.leaves(t.state.params)
  got = jax.tree.leaves(nnx.state(run.model, nnx.Param))
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _params(workdir, step):
  return run_lib.load_run(workdir, step=step).model


def test_exact_resume(tmp_path):
  """20 steps straight == 10 steps, a new process-like trainer resuming from the checkpoint, 10 more.

  Bitwise: per-step losses and final parameters. On CPU XLA is deterministic for a fixed program and inputs;
  the resumed run uses the same compiled step, the same per-step keys (fold_in(seed, step)) and the same
  batches (grain iterator state stored with the checkpoint)."""
  over = {"train.log_every": 1, "train.checkpoint_every": 10, "train.eval_at_end": False,
          "train.async_checkpointing": True}
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer_lib.train(tiny_config(**over, **{"train.steps": 20}), straight, progress=False)
  trainer_lib.train(tiny_config(**over, **{"train.steps": 10}), resumed, progress=False)
  trainer_lib.train(tiny_config(**over, **{"train.steps": 20}), resumed, progress=False)

  def losses(workdir):
    return {r["step"]: r["train/loss"] for r in log_lib.read_metrics(workdir)}

  a, b = losses(straight), losses(resumed)
  assert sorted(a) == sorted(b) == list(range(1, 21))
  assert a == b
  pa = nnx.state(_params(straight, 20))
  pb = nnx.state(_params(resumed, 20))
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@jax.tree_util.register_pytree_node_class
class _Flag:
  """The step's `finite` flag, recording how the loop reads it: `bool()` of the device array (a blocking
  device->host sync) or of a host copy (after an explicit `jax.device_get`, which maps over this pytree)."""

  reads: list[str] = []

  def __init__(self, value):
    self.value = value

  def __bool__(self):
    self.reads.append("device" if isinstance(self.value, jax.Array) else "host")
    return bool(self.value)

  def tree_flatten(self):
    return (self.value,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def test_training_loop_reads_the_non_finite_flag_only_when_it_logs_or_saves(tmp_path, monkeypatch):
  """No device->host sync per step: the loop feeds the flag back into the next step on the device and reads it
  (explicitly, one copy) only at the log and save steps - here steps 3 and 6 of 6."""
  config = tiny_config(**{"train.steps": 6, "train.log_every": 3, "train.checkpoint_every": 6,
                          "train.eval_at_end": False, "diffusion.self_conditioning_prob": 0.0})
  monkeypatch.setattr(_Flag, "reads", [])
  with trainer_lib.Trainer(config, str(tmp_path / "run"), progress=False) as t:
    original = t.train_step

    def flagged(state, batch, key, healthy):
      state, metrics = original(state, batch, key, healthy.value if isinstance(healthy, _Flag) else healthy)
      return state, dict(metrics, finite=_Flag(metrics["finite"]))

    t.train_step = flagged
    t.train()
    assert t.step == 6
  assert _Flag.reads == ["host", "host"]


def test_non_finite_loss_stops_and_keeps_last_good_state(tmp_path):
  """A huge learning rate blows the weights up after one update; the next step's gradient is NaN. The step
  leaves the state unchanged, the trainer saves it and stops with one line naming the step."""
  workdir = str(tmp_path / "nan")
  config = tiny_config(**{"train.steps": 50, "optimizer.peak_lr": 1e35, "optimizer.warmup_steps": 0,
                          "train.checkpoint_every": 1000, "train.eval_at_end": False,
                          # a smaller graph compiles faster; the failure mode is the same
                          "diffusion.self_conditioning_prob": 0.0})
  with pytest.raises(config_lib.TrainingError) as err:
    trainer_lib.train(config, workdir, progress=False)
  msg = str(err.value)
  assert "\n" not in msg and "non-finite loss at step" in msg and "peak_lr" in msg
  step = int(msg.split("non-finite loss at step ")[1].split(" ")[0])
  assert 0 <= step < 50
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  assert ckpt.latest_step() == step
  model = run_lib.load_run(workdir).model
  leaves = jax.tree.leaves(nnx.state(model))
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  records = log_lib.read_metrics(workdir)
  assert records[-1]["step"] == step and not np.isfinite(float(records[-1]["train/grad_norm"]))


def test_a_bad_evaluation_file_fails_before_training(tmp_path):
  """The evaluation data are read and checked when the trainer is built (they used to be read at the first
  evaluation, after training): a malformed line is a one-line error naming it, and nothing was trained."""
  bad = tmp_path / "validation.jsonl"
  bad.write_text('{"prompt": "3 1 2", "completion": "1 2 3"}\n' * 2 + '{"prompt": "3 1 2", "completion": \n')
  workdir = tmp_path / "run"
  with pytest.raises(DataError, match=rf"^{bad}:3: invalid JSON"):
    trainer_lib.Trainer(tiny_config(**{"train.steps": 4, "data.validation_path": str(bad)}), str(workdir),
                           progress=False)
  assert not os.path.exists(os.path.join(workdir, checkpoints.CHECKPOINT_DIR)) or not os.listdir(
      os.path.join(workdir, checkpoints.CHECKPOINT_DIR))
