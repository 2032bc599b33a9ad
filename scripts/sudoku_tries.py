"""Do independent sampling tries fail on the same Sudoku puzzles? (docs/sudoku.md, "The failures are systematic")

Samples a run's evaluation split once per key with the run's early-stopping evaluation setting, and prints each
try's solved rate, how many puzzles any of the first k tries solves, and the correlation of the tries' failures.
A puzzle counts as solved when the grid is a valid completion of its givens (the rules, not the stored solution).

  python scripts/sudoku_tries.py --workdir=runs/sudoku --seeds=0,1,2
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from hackable_diffusion.errors import ConfigError, HackableDiffusionError
from hackable_diffusion.evaluation import loop
from hackable_diffusion.tasks.sudoku import metrics
from hackable_diffusion.runs import run as run_lib


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--seeds", default="0,1,2", help="comma-separated eval keys, one try each")
  args = parser.parse_args()
  seeds = [int(s) for s in args.seeds.split(",")]
  run = run_lib.load_run(args.workdir)
  data = run_lib.load_eval_data(run.config, run.model.config, run.tokenizer, run.paths)
  task = run_lib.eval_task(run.config)
  if getattr(task, "name", "") != "sudoku":
    raise ConfigError(f"{args.workdir}: the run's evaluation task is {getattr(task, 'name', task)!r}, not 'sudoku'")
  canvas = run.model.config.canvas_length
  early_stopping = loop.eval_runs(run.config.eval, canvas)[-1].sampling
  solved = []
  for seed in seeds:
    texts, stats = loop.generate_texts(run.model, run.tokenizer, data, early_stopping, task,
                                       batch_size=run.config.eval.batch_size, rng=jax.random.key(seed))
    ok = np.array([metrics.is_valid_solution(metrics.parse_prediction(text), np.array([int(c) for c in ex.prompt]))
                   for text, ex in zip(texts, data.examples)])
    solved.append(ok)
    print(f"key {seed}: solved {ok.mean():.4f} at {stats['mean_denoising_steps']:.2f} steps per canvas", flush=True)
  solved = np.stack(solved)  # [tries, examples]
  for k in range(2, len(seeds) + 1):
    print(f"solved by any of the first {k} tries: {solved[:k].any(axis=0).mean():.4f}")
  if len(seeds) > 1:
    print("correlation of failures with the first try:", np.round(np.corrcoef(~solved)[0, 1:], 3).tolist())


if __name__ == "__main__":
  try:
    main()
  except (HackableDiffusionError, OSError) as e:  # a missing workdir, checkpoint or data file: one line
    raise SystemExit(f"error: {e}") from None
