"""Picture Sudoku end to end on a micro version of configs/sudoku_image.py: rendered chat records, a few training
steps with the vision tower, the evaluation with the pictures (solved rate and transcription accuracy), and the
loss depends on the pixels. Plus the task's data files, start canvases and metrics."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.tasks.base import EvalRecord, get_task
from hackable_diffusion.tasks.sudoku import image_task
from hackable_diffusion.training import trainer as trainer_lib

pytestmark = pytest.mark.usefixtures("shared_xla_cache")

SIZES = {"num_train": 8, "num_validation": 2, "num_test": 2, "workers": 1}
MICRO = {  # configs/sudoku_image.py shrunk: the 'tiny' text model, a 1-layer tower, 2 steps of 4 puzzles
    "model.preset": "tiny",
    "model.overrides.vision": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=8, patch_size=16, pooling_kernel_size=1,
                                   position_embedding_size=16),
    **{f"data.generator_args.{k}": v for k, v in SIZES.items()},
    "train.steps": 2, "train.batch_size": 4, "train.log_every": 1, "train.checkpoint_every": 100,
    "eval.num_examples": 2, "eval.batch_size": 2, "eval.step_budgets": (2,), "eval.early_stopping_steps": 2,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sudoku_image"))
  config = config_lib.load_config_file("sudoku_image.py", MICRO)
  with trainer_lib.Trainer(config, workdir, progress=False) as t:
    metrics = t.train()
    report = t.evaluate()
    batch = t.train_data[0]
    model = t.model()
  return workdir, metrics, report, batch, model


def test_micro_run_trains_and_evaluates_with_pictures(trained):
  workdir, metrics, report, batch, _ = trained
  assert np.isfinite(metrics["loss"])
  assert batch.pixel_values.shape == (4, 1, 140, 16 * 16 * 3)  # one picture per record, 81 patches + padding
  assert (batch.image_position_ids[:, 0, :, 0] >= 0).sum(-1).tolist() == [81] * 4
  assert os.path.isfile(os.path.join(workdir, "data", "img", "test", "000001.png"))
  for run in report["runs"]:
    m = run["metrics"]
    assert m["count"] == 2 and 0.0 <= m["solved_rate"] <= 1.0 and 0.0 <= m["transcription_accuracy"] <= 1.0


def test_the_loss_depends_on_the_pixels(trained):
  *_, batch, model = trained
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda s, b: diffusion_loss(nnx.merge(graphdef, s), b, jax.random.key(3),
                                           LossConfig(self_conditioning_prob=0.0))[0])
  real = batch.image_position_ids[..., :1] >= 0
  inverted = batch.replace(pixel_values=np.where(real, 1.0 - batch.pixel_values, 0.0).astype(np.float32))
  loss, other = (float(fn(state, jax.tree.map(jnp.asarray, b))) for b in (batch, inverted))
  assert np.isfinite(loss) and abs(loss - other) > 1e-5 * abs(loss)


def test_records_metrics_and_start_canvases(trained):
  workdir = trained[0]
  with open(os.path.join(workdir, "data", "test.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  task = get_task("sudoku_image")
  records = [EvalRecord(prompt="Solve:", completion=r["messages"][-1]["content"], fields=r) for r in rows]
  assert rows[0]["messages"][0]["content"][0] == {"type": "image", "path": "img/test/000000.png"}
  solutions = [r.completion for r in records]
  perfect = task.metrics(solutions, records)
  assert perfect["solved_rate"] == 1.0 and perfect["transcription_accuracy"] == 1.0
  blanks_wrong = task.metrics(["1" * 81] * len(records), records)
  assert blanks_wrong["solved_rate"] == 0.0 and blanks_wrong["transcription_accuracy"] < 0.5

  class _Tok:
    vocab_size = 20

    def token_ids_for(self, chars):
      return [10 + int(c) for c in chars]

  seed, pinned = task.seed_canvas(records, _Tok(), 81)
  assert not pinned.any() and not np.array_equal(seed[0], seed[1])  # noise per puzzle, nothing pinned
  _, oracle = get_task("sudoku_image", {"pin_givens": True}).seed_canvas(records, _Tok(), 81)
  assert oracle[0].tolist() == [c != "0" for c in rows[0]["puzzle"]]
  assert image_task.image_path("train", 3) == "img/train/000003.png"


def _train_rows(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_transcription_warm_up_opens_the_training_file(tmp_path):
  out = str(tmp_path)
  task = get_task("sudoku_image", {**SIZES, "transcribe": 0.5, "transcribe_first": 3})
  rows = _train_rows(task.make_data(out, progress=False)["train"])
  assert len(rows) == 8 + 4  # every solve record, plus half as many transcription records
  transcribed = [r for r in rows if r["messages"][0]["content"][1]["text"] == "Given:"]
  assert len(transcribed) == 4 and rows[:3] == transcribed[:3]  # the warm-up comes first
  for r in transcribed:  # the answer is the picture's content: its digits, '0' for a blank
    assert r["messages"][-1]["content"] == r["puzzle"] and "0" in r["puzzle"]
    assert os.path.isfile(os.path.join(out, r["messages"][0]["content"][0]["path"]))
  solved = [r for r in rows if r not in transcribed]
  assert len(solved) == 8 and all("0" not in r["messages"][-1]["content"] for r in solved)
  picture = os.path.join(out, "img", "train", "000000.png")
  drawn = os.stat(picture).st_mtime_ns
  plain = _train_rows(get_task("sudoku_image", {**SIZES, "transcribe": 0.5}).make_data(out, progress=False)["train"])
  assert [r["messages"][0]["content"][1]["text"] for r in plain] == ["Solve:"] * 8 + ["Given:"] * 4
  assert os.stat(picture).st_mtime_ns == drawn  # a new mix rewrites the records, not the pictures
  config = config_lib.load_config_file("sudoku_image.py")
  assert config.data.shuffle is False and config.data.generator_args.transcribe_first > 0
  assert config.model.overrides.vision["position_embedding_init_std"] > 0


@pytest.mark.parametrize("args", [{"transcribe": 0.5, "transcribe_instruction": "Read:"},
                                  {"transcribe": 0.5, "transcribe_instruction": "Solve:"},
                                  {"transcribe": -0.1}, {"transcribe": 1.5}, {"transcribe_first": -1}])
def test_transcription_arguments_are_checked(args):
  with pytest.raises(ConfigError):
    get_task("sudoku_image", args)


def test_position_table_init():
  from hackable_diffusion.model.vision import PatchEmbedder
  from hackable_diffusion.model.vision_config import VisionConfig

  small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
               head_dim=8, patch_size=16, pooling_kernel_size=1, position_embedding_size=16)
  with nnx.use_eager_sharding(False):
    default, spread = (PatchEmbedder(VisionConfig(**small, position_embedding_init_std=s), rngs=nnx.Rngs(0),
                                     dtype=jnp.float32, param_dtype=jnp.float32) for s in (0.0, 1.0))
  assert np.all(np.asarray(default.position_embedding_table[...]) == 1.0)  # transformers' init
  table = np.asarray(spread.position_embedding_table[...])
  assert 0.8 < table.std() < 1.2 and abs(table.mean()) < 0.25  # each position its own embedding
  assert "position_embedding_init_std" not in VisionConfig(**small, position_embedding_init_std=1.0).to_hf()
