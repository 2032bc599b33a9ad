"""What `evaluate` and `export` write, and their one-line errors when they cannot: a second evaluation keeps the
first report of the same step (`eval/evaluate-N/` unless `--replace`), a full disk while writing the report or the
exported weights is one `error:` line (the writer monkeypatched to raise ENOSPC), and a model too large for the
available memory is refused before anything is allocated.

One tiny 2-step run (module fixture) is evaluated and exported through the CLIs as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {
    "train.steps": 2, "train.batch_size": 8, "train.log_every": 1, "train.eval_at_end": False,
    "train.async_checkpointing": False, "data.generator_args.num_train": 64,
    "data.generator_args.num_validation": 8, "data.prefetch_batches": 0,
    "eval.num_examples": 4, "eval.batch_size": 4, "eval.step_budgets": (2,), "eval.early_stopping_steps": 2,
}


def _env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0",
              PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))


def _python(code: str, cwd) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], env=_env(), cwd=cwd, capture_output=True, text=True,
                        timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("outputs") / "run")
  trainer_lib.train(config_lib.load_config_file("tiny.py", SMALL), workdir, progress=False)
  return workdir


# runs a CLI in-process after `patch` (Python statements) replaced a writer
_RUN_CLI = """
import errno, sys, types
def full(*args, **kwargs):
  raise OSError(errno.ENOSPC, "No space left on device", "the_file")
{patch}
from hackable_diffusion import {module} as cli_module
sys.argv = ["{module}"] + {args!r}
cli_module.run()
"""


def _one_line(res: subprocess.CompletedProcess) -> str:
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
  return lines[0]


# the CLI run twice in one process (the second evaluation reuses the first one's compiled programs)
_RUN_CLI_TWICE = """
import sys
from hackable_diffusion import {module} as cli_module
for _ in range(2):
  sys.argv = ["{module}"] + {args!r}
  try:
    cli_module.run()
  except SystemExit as e:
    if e.code:
      raise
"""


def test_a_second_evaluation_keeps_the_first_report(trained, tmp_path):
  res = _python(_RUN_CLI_TWICE.format(module="evaluate", args=[f"--workdir={trained}"]), tmp_path)
  assert res.returncode == 0, res.stderr[-3000:]
  eval_dir = os.path.join(trained, "eval")
  assert os.path.isfile(os.path.join(eval_dir, "report_step_2.json"))
  assert os.path.isfile(os.path.join(eval_dir, "evaluate-1", "report_step_2.json"))
  assert "evaluate-1" in res.stdout


def test_a_full_disk_while_evaluating_or_exporting_is_one_line(trained, tmp_path):
  out = str(tmp_path / "report")
  code = _RUN_CLI.format(patch="from hackable_diffusion.runs import run\nrun.evaluate_model = full",
                         module="evaluate", args=[f"--workdir={trained}", f"--out={out}"])
  line = _one_line(_python(code, tmp_path))
  assert line == f"error: cannot write the evaluation report to {out} (the_file): No space left on device", line
  out = str(tmp_path / "exported")
  code = _RUN_CLI.format(
      # the disk fills up after the header, while the first tensor is written
      patch="from hackable_diffusion.interop import safetensors_io\nsafetensors_io._OpenFile.write = full",
      module="export", args=[f"--workdir={trained}", "--format=merged", f"--out={out}"])
  line = _one_line(_python(code, tmp_path))
  assert line == f"error: cannot write {out}/model.safetensors: No space left on device", line
  assert not os.path.isdir(out) or not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_a_model_larger_than_the_memory_is_refused_before_allocating(monkeypatch):
  huge = {"embed": jax.ShapeDtypeStruct((10_000_000_000, 32), jnp.float32)}
  with pytest.raises(ConfigError, match=r"^the model's parameters need an estimated 1192\.1 GiB > available "
                                        r"[0-9.]+ GiB \(.*\); check model\.preset"):
    run_lib.check_fits_memory(huge)
  monkeypatch.setattr(run_lib, "available_memory", lambda: (2**40, "test"))
  assert run_lib.check_fits_memory({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}) == 64


def test_the_train_cli_refuses_a_mistyped_vocabulary_size_in_one_line(tmp_path):
  code = _RUN_CLI.format(patch="", module="train",
                         args=["--config=tiny.py", f"--workdir={tmp_path / 'w'}",
                               "--config.model.overrides.vocab_size=10000000000"])
  line = _one_line(_python(code, tmp_path))
  assert "GiB > available" in line, line
