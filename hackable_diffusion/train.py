"""Train (SFT) a DiffusionGemma from an ml_collections config.

  python -m hackable_diffusion.train --config=configs/tiny.py [--workdir=runs/tiny]
      [--config.optimizer.peak_lr=3e-4 --config.train.steps=2000 ...]

A bare config name (`--config=tiny.py`) is looked up in configs/. Rerunning the same command resumes from the
latest checkpoint of the workdir. The workdir gets config.json, tokenizer.model, checkpoints/, metrics.jsonl,
tensorboard/ and eval/ (see docs/training.md).
On a GPU, JAX may reserve 0.95 of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, set to 0.95 unless already set;
JAX's own default 0.75 leaves a quarter of the card unused); set the variable to choose another fraction.
"""

from __future__ import annotations

from hackable_diffusion import hugepages

if __name__ == "__main__":  # before JAX is imported (through cli below): huge pages for malloc
  hugepages.reexec_with_malloc_hugepages()

import os  # noqa: E402

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from hackable_diffusion import cli  # noqa: E402
from hackable_diffusion.errors import ConfigError, TrainingError  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py); override any "
                                          "key with --config.section.key=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config file name>). Reruns resume "
                               "from its latest checkpoint.")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Hide the progress bar.")


def default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path.partition(":")[0]))[0]
  return os.path.join("runs", name)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --name=value")
  if _CONFIG.value is None:
    raise ConfigError("--config is required, e.g. --config=configs/tiny.py")
  from hackable_diffusion.training import trainer  # local: keeps --help fast

  from hackable_diffusion.runs.config import ExperimentConfig

  workdir = _WORKDIR.value or default_workdir(config_flags.get_config_filename(flags.FLAGS["config"]))
  # the config file is trusted (it runs code by design); --trust_remote_code extends that to a run named by
  # model.checkpoint (its config.json)
  cfg = ExperimentConfig.from_config_dict(_CONFIG.value, trust_remote_code=cli.trust_requested())
  try:
    metrics = trainer.train(cfg, workdir, progress=False if _NO_PROGRESS.value else None)
  except KeyboardInterrupt:  # between the trainer's own signal handling (setup, the loop): nothing half-written
    raise TrainingError("interrupted; the last complete checkpoint is kept - rerun the same command to "
                        "resume") from None
  shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
  print(f"done: {workdir} ({shown})")


def run() -> None:
  cli.run_cli(main, flags_parser=cli.make_flags_parser(), joins_job=True)


if __name__ == "__main__":
  run()
