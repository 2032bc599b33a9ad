"""Solved rate, decoder forwards and time of a run's evaluation with and without the task's checker in the sampler.

Every setting samples the same puzzles with the same keys (the evaluation's `generate_texts`, early-stopping run of
the run's config) in one process, and the table gives each setting's solved rate, forwards per puzzle (every try
and restart counted), seconds, and their ratios to the first setting. A setting is `+`-joined options:

  default          the run's early-stopping evaluation as configured (no checker)
  checker          the sampler re-noises what the task's checker flags (`generate(checker=...)`)
  confidence       ... and flagged positions count as uncertain (`checker_confidence`: no early stop on a violation)
  forget           ... and flagged positions lose their self-conditioning input (`checker_forget`)
  restarts=R       ... and an invalid row restarts from noise up to R times per canvas (`checker_restarts`)
  budget=F         ... within F decoder forwards per row and canvas (`checker_step_budget`)
  units            the checker flags whole rows / columns / boxes holding a repeat (Sudoku's `units=True`)
  tries=N          up to N independent tries per puzzle, the first valid one kept (`eval.samples_per_prompt`)
  cap=S            the early-stopping step cap (`max_denoising_steps`)
  t_max=X, t_min=X, entropy_bound=X, confidence_threshold=X   the sampler's own fields

  python scripts/benchmark_checker.py --workdir=runs/sudoku --data=hard.jsonl --examples=100 \\
      --settings=default,checker+confidence,checker+confidence+restarts=3,tries=4

Seconds include each setting's compilation unless `--warm` (an untimed pass over one batch first).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import jax
import numpy as np

from hackable_diffusion.errors import ConfigError, HackableDiffusionError
from hackable_diffusion.evaluation import loop as eval_loop
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.tasks.base import checker as task_checker


@dataclasses.dataclass(frozen=True)
class Setting:
  """One sampler setting of the comparison."""

  name: str
  sampling: SamplingConfig
  checker: bool
  tries: int
  units: bool = False


def parse_setting(spec: str, base: SamplingConfig) -> Setting:
  """A `+`-joined setting (see the module docstring) on top of the run's early-stopping sampler `base`."""
  changes: dict[str, Any] = {}
  checker, tries, units = False, 1, False
  floats = ("t_max", "t_min", "entropy_bound", "confidence_threshold")
  for part in spec.split("+"):
    name, _, value = part.partition("=")
    if name == "default" and not value:
      continue
    if name == "checker" and not value:
      checker = True
    elif name == "units" and not value:
      checker = units = True
    elif name in floats and value:
      changes[name] = float(value)
    elif name == "confidence" and not value:
      checker, changes["checker_confidence"] = True, True
    elif name == "forget" and not value:
      checker, changes["checker_forget"] = True, True
    elif name in ("restarts", "budget", "tries", "cap") and value.isdigit():
      if name == "tries":
        tries = int(value)
      elif name == "cap":
        changes["max_denoising_steps"] = int(value)
      else:
        checker = True
        changes["checker_restarts" if name == "restarts" else "checker_step_budget"] = int(value)
    else:
      raise ConfigError(f"--settings: {part!r} in {spec!r} is not one of default, checker, confidence, forget, "
                        f"restarts=R, budget=F, units, tries=N, cap=S, {'=X, '.join(floats)}=X")
  if "checker_step_budget" in changes and "checker_restarts" not in changes:
    changes["checker_restarts"] = 1_000  # the budget decides
  return Setting(spec, base.replace(**changes), checker, tries, units)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="a trained run (e.g. runs/sudoku)")
  parser.add_argument("--data", default="", help="a JSONL file of puzzles (default: the run's evaluation split)")
  parser.add_argument("--examples", type=int, default=100)
  parser.add_argument("--batch", type=int, default=0, help="slots of the sampling loop (0: the run's eval.batch_size)")
  parser.add_argument("--settings", default="default,checker,checker+confidence")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--warm", action="store_true", help="compile each setting on one batch before timing it")
  args = parser.parse_args(argv)
  from hackable_diffusion.runs import run as run_lib

  run = run_lib.load_run(args.workdir)
  cfg, model, tok = run.config, run.model, run.tokenizer
  path = args.data or run.paths.get(cfg.eval.split) or ""
  data_cfg = run_lib.sft_data_config(cfg, model.config, path, batch_size=1, shuffle=False, seed=0)
  data = eval_loop.load_eval_data(path, dataclasses.replace(data_cfg, pinned_field=None), tok, args.examples)
  task = run_lib.eval_task(cfg)
  check = task_checker(task, tok)
  if check is None:
    raise ConfigError(f"task {getattr(task, 'name', task)!r} has no checker")
  unit_check = check.replace(units=True) if hasattr(check, "units") else check
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model.config.canvas_length
  base = eval_loop.eval_runs(cfg.eval, max_new)[-1].sampling
  settings = [parse_setting(s, base) for s in args.settings.split(",")]
  batch = args.batch or cfg.eval.batch_size
  rng = jax.random.key(args.seed)
  print(f"{len(data)} puzzles from {path}, batch {batch}, step cap {base.max_denoising_steps}, "
        f"{jax.devices()[0].device_kind}", flush=True)
  rows = []
  for s in settings:
    in_loop = (unit_check if s.units else check) if s.checker else None
    kwargs = dict(batch_size=batch, rng=rng, checker=in_loop, samples_per_prompt=s.tries, valid=check)
    if args.warm:
      part = eval_loop.EvalData(records=data.records.select(np.arange(min(batch, len(data)))),
                                examples=data.examples[:batch])
      eval_loop.generate_texts(model, tok, part, s.sampling, task, **kwargs)
    t0 = time.perf_counter()
    texts, stats = eval_loop.generate_texts(model, tok, data, s.sampling, task, **kwargs)
    seconds = time.perf_counter() - t0
    solved = task.metrics(texts, data.examples)[task.primary_metric]
    rows.append((s.name, solved, stats["forwards_per_example"], seconds))
    print(f"{s.name}: solved {solved:.3f}, {stats['forwards_per_example']:.1f} forwards/puzzle, "
          f"{stats['tries_per_example']:.2f} tries/puzzle, {seconds:.1f}s", flush=True)
  _, solved0, fwd0, sec0 = rows[0]
  print(f"\n| setting | solved | forwards/puzzle | seconds | solved ratio | forwards ratio | time ratio |")
  print("|---|---|---|---|---|---|---|")
  for name, solved, fwd, sec in rows:
    ratio = f"{solved / solved0:.2f}x" if solved0 else "-"
    print(f"| {name} | {solved:.3f} | {fwd:.1f} | {sec:.1f} | {ratio} | {fwd / fwd0:.2f}x | {sec / sec0:.2f}x |")
  return 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except (HackableDiffusionError, OSError) as e:
    raise SystemExit(f"error: {e}") from None
