"""Evaluate a trained run: accuracy against the denoising-step budget and with early stopping.

  python -m hackable_diffusion.evaluate --workdir=runs/tiny [--step=N] [--config=configs/tiny.py]
      [--config.eval.num_examples=512 --config.eval.step_budgets="(8,16,32)" ...]

Without --config the run's own workdir/config.json is used (overrides still apply). A run with a `mesh` section
is evaluated on that mesh (`--config.mesh.fsdp=...` to change it): the model is restored straight into its shards
and sampled there (see docs/scaling.md); multi-host, every process runs this command and process 0 writes. Writes
workdir/eval/report_step_{N}.json and workdir/eval/accuracy_vs_steps_step_{N}.png and prints a summary; when that
report exists (training's own, at the end of a finished run) it is kept and this one goes to
workdir/eval/evaluate-N/ unless --replace. The output directory is checked for writability first: a read-only run
is a one-line error before evaluating (pass --out=DIR to write elsewhere). A run's config.json that names code
('module:attribute') is refused unless --trust_remote_code (docs/reliability.md, "Trust model").
On a GPU, JAX may reserve 0.95 of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, set to 0.95 unless already set;
JAX's own default 0.75 leaves a quarter of the card unused); set the variable to choose another fraction.
"""

from __future__ import annotations

from hackable_diffusion import hugepages

if __name__ == "__main__":  # before JAX is imported (through cli below): huge pages for malloc
  hugepages.reexec_with_malloc_hugepages()

import os  # noqa: E402

from absl import flags  # noqa: E402

from hackable_diffusion import cli  # noqa: E402
from hackable_diffusion.errors import CheckpointError, ConfigError  # noqa: E402

# --config is defined by the flags parser: from --config=FILE, or from <workdir>/config.json when absent.
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by hackable_diffusion.train.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Directory for the report and plot (default: <workdir>/eval).")
_REPLACE = flags.DEFINE_bool("replace", False, "Replace a report of the same step in the output directory (e.g. "
                             "the one training wrote); default: keep it and write to <out>/evaluate-N/ instead.")


def report_dir(out_dir: str, step: int, *, replace: bool) -> str:
  """`out_dir`, or when it already holds the report of `step` (training's own, or an earlier evaluation's) and
  not `replace`, the first free `out_dir/evaluate-N` (N = 1, 2, ...): a report is never replaced unasked."""
  from hackable_diffusion.evaluation import report as report_lib

  if replace or not os.path.exists(os.path.join(out_dir, report_lib.REPORT_PATTERN.format(step=step))):
    return out_dir
  n = 1
  while os.path.lexists(os.path.join(out_dir, f"evaluate-{n}")):
    n += 1
  return os.path.join(out_dir, f"evaluate-{n}")


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --name=value")
  if not _WORKDIR.value:
    raise ConfigError("--workdir is required (a directory written by hackable_diffusion.train)")
  if not os.path.isdir(_WORKDIR.value):
    raise ConfigError(f"--workdir={_WORKDIR.value}: no such directory")
  from hackable_diffusion import sharding
  from hackable_diffusion.sharding import is_main_process
  from hackable_diffusion.evaluation import report as report_lib
  from hackable_diffusion.runs import run as run_lib
  from hackable_diffusion.runs.config import ExperimentConfig
  from hackable_diffusion.runs import workdir as workdir_lib

  out_dir = _OUT.value or os.path.join(_WORKDIR.value, run_lib.EVAL_DIR)
  # the report is written at the end: a read-only run (or --out) is a one-line error now, not after evaluating
  workdir_lib.check_writable_dir(out_dir, what="--out directory" if _OUT.value else "eval directory",
                                 hint="" if _OUT.value else "pass --out=DIR to write the report elsewhere")
  cfg = ExperimentConfig.from_config_dict(flags.FLAGS.config, trust_remote_code=cli.trust_requested())
  # the run's mesh (its `mesh` section; joins a multi-host job first): the model is restored into its shards and
  # sampled there, never whole on one device; none (the default section): one device
  mesh = run_lib.make_run_mesh(cfg)
  run = run_lib.load_run(_WORKDIR.value, cfg, _STEP.value, mesh=mesh)
  # multi-process: an evaluation file one host cannot read stops every host before sampling
  data = sharding.agree_on(lambda: run_lib.load_eval_data(run.config, run.model.config, run.tokenizer, run.paths),
                           together=mesh is not None, before="evaluating")
  out_dir = report_dir(out_dir, run.step, replace=_REPLACE.value)
  try:
    report = run_lib.evaluate_model(run.config, run.model, run.tokenizer, data, step=run.step,
                                    out_dir=out_dir if is_main_process() else None, mesh=mesh)
  except OSError as e:  # the report or the plot could not be written (no space left on device, I/O error)
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    raise CheckpointError(f"cannot write the evaluation report to {out_dir}{where}: "
                          f"{e.strerror or ' '.join(str(e).split()) or type(e).__name__}") from None
  if not is_main_process():
    return
  print(f"step {run.step}, task {report['task']}, {report['num_examples']} examples:")
  if report["runs"]:  # the sampler is the run's stored one unless overridden: say which
    sampling = {k: v for k, v in report["runs"][0]["sampling"].items() if v != {}}  # acceptance_args when set
    print("sampler (the run's config.json unless --config.eval.sampling.NAME=VALUE): "
          + "  ".join(f"{k}={v}" for k, v in sampling.items()))
  for line in report_lib.summary_lines(report):
    print(line)
  print(f"report: {os.path.join(out_dir, report_lib.REPORT_PATTERN.format(step=run.step))}")


def run() -> None:
  cli.run_cli(main, flags_parser=cli.make_flags_parser(workdir_default=True), joins_job=True)


if __name__ == "__main__":
  run()
