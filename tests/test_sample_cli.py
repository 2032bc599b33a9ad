"""`hackable_diffusion.sample` on a Sudoku run: the run's task applies as in evaluation.

A tiny Sudoku run (the 'tiny' preset at canvas 81 with the peer attention structure, 2 training steps) is enough:
a model that has learned almost nothing fills the blank cells near-randomly, so

- the CLI's grid equals `evaluate`'s (`evaluation.loop.generate_texts`, the early-stopping run) for the same
  puzzle only if it reproduces evaluation's per-batch key, start canvas and allowed tokens;
- every given comes back at its cell only because the givens are pinned (a near-random model would overwrite
  ~30 of them), and only digits 1-9 appear only because sampling is restricted to them ('0', pad and the other
  tokens are in the vocabulary).

The CLI runs in-process (`main` after absl parses its flags; `run()` for the exit code): like
tests/test_cli_errors.py this module imports `hackable_diffusion.sample` in-process, whose flags would clash with
`train` / `export`'s (those run as subprocesses elsewhere).
"""

from __future__ import annotations

import os
import re
import sys

import jax

import numpy as np
import pytest
from absl import flags

from hackable_diffusion.evaluation import loop as eval_loop
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs import sampling
from hackable_diffusion.tasks.sudoku import formatting, metrics
from hackable_diffusion.training import trainer as trainer_lib

STEPS = 2
OVERRIDES = {
    "model.preset": "tiny",
    "data.generator_args.num_train": 16, "data.generator_args.num_validation": 2,
    "data.generator_args.num_test": 2, "data.generator_args.easy": 1.0, "data.generator_args.medium": 0.0,
    "data.generator_args.train_easy": 1.0, "data.generator_args.train_medium": 0.0,
    "data.generator_args.workers": 1, "data.prefetch_batches": 1,
    "train.steps": STEPS, "train.batch_size": 4, "optimizer.decay_steps": STEPS, "optimizer.warmup_steps": 1,
    "train.log_every": 1, "train.checkpoint_every": STEPS, "train.async_checkpointing": False,
    "train.eval_at_end": False,
    "eval.num_examples": 2, "eval.batch_size": 1, "eval.step_budgets": (8,), "eval.early_stopping_steps": 8,
    "eval.ablation_steps": 0, "eval.seed": 3,
}


@pytest.fixture(scope="module")
def sudoku_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sudoku_run"))
  trainer_lib.train(config_lib.load_config_file("sudoku.py", OVERRIDES), workdir, progress=False)
  return workdir


@pytest.fixture(scope="module")
def loaded_run(sudoku_run):
  return run_lib.load_run(sudoku_run)


@pytest.fixture()
def sample_cli():
  """Runs `hackable_diffusion.sample` in-process: `call(*args)` parses the flags and runs `main` (stdout as
  captured by capsys); flags are reset afterwards."""
  from hackable_diffusion import sample as sample_lib

  def call(*args: str, entry: str = "main") -> None:
    flags.FLAGS.unparse_flags()
    argv = ["hackable_diffusion.sample", *args]
    if entry == "run":  # the real entry point: absl parsing, one error line, sys.exit
      old = sys.argv
      sys.argv = argv
      try:
        sample_lib.run()
      finally:
        sys.argv = old
      return
    flags.FLAGS(argv)
    sample_lib.main(argv[:1])

  yield call
  flags.FLAGS.unparse_flags()


def test_sample_solves_a_dotted_puzzle_as_evaluation_does(sudoku_run, loaded_run, sample_cli, capsys, monkeypatch):
  run = loaded_run
  cfg = run.config
  data = run_lib.load_eval_data(cfg, run.model.config, run.tokenizer, run.paths)
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * run.model.config.canvas_length
  early = eval_loop.eval_runs(cfg.eval, max_new)[-1]  # the early-stopping run: the CLI's default sampler
  assert early.name == "early_stopping"
  texts, _ = eval_loop.generate_texts(run.model, run.tokenizer, data, early.sampling, run_lib.eval_task(cfg),
                                      batch_size=cfg.eval.batch_size, rng=jax.random.key(cfg.eval.seed))
  expected = [metrics.parse_prediction(t) for t in texts]
  assert not np.array_equal(expected[0], expected[1])

  b = 1  # evaluation's second example: key fold_in(key(eval.seed), 1)
  puzzle = formatting.parse_grid(data.examples[b].prompt)
  dotted = data.examples[b].prompt.replace("0", ".")
  assert "." in dotted and "0" not in dotted
  capsys.readouterr()
  sample_cli(f"--workdir={sudoku_run}", f"--prompt={dotted}", f"--seed={cfg.eval.seed}", f"--example_index={b}",
             "--live")
  out, err = capsys.readouterr()
  lines = out.rstrip("\n").split("\n")
  assert len(lines) == 12, out
  grid_text, verdict = "\n".join(lines[:11]), lines[11]
  assert grid_text == formatting.render_grid(expected[b]), (out, texts[b])  # the same grid as evaluate
  answer = formatting.parse_grid(grid_text)  # a full grid of digits 1-9 (no '?', no blank)
  assert (answer >= 1).all() and (answer <= 9).all(), grid_text
  given = puzzle > 0
  assert given.sum() >= 40 and np.array_equal(answer[given], puzzle[given]), grid_text  # the givens are pinned
  ok = metrics.is_valid_solution(answer, puzzle)
  assert verdict.startswith("valid: " if ok else "not valid: "), verdict
  assert "[canvas 0 step   1]" in err  # --live printed the canvas converging

  # the library function under the CLI, called from Python: the same answer, rendered by the task as printed
  task = sampling.resolve_task(cfg)
  samples = sampling.sample(run.model, run.tokenizer, [dotted], cfg, seed=cfg.eval.seed, example_index=b)
  assert samples.prompts == [data.examples[b].prompt]  # the task's parse_prompt: '0' blanks, as in the data
  assert np.array_equal(metrics.parse_prediction(samples.completions[0]), expected[b])
  assert sampling.render(task, samples) == "\n".join(lines)

  # interactive, the other batch's key: the puzzle pasted as a rendered grid with '_' blanks (11 lines, read until
  # they hold 81 cells), then an empty line: evaluation's first answer
  pasted = formatting.render_grid(formatting.parse_grid(data.examples[0].prompt), blank="_").split("\n")
  lines = iter(pasted + [""])
  monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
  capsys.readouterr()
  sample_cli(f"--workdir={sudoku_run}", f"--seed={cfg.eval.seed}", "--example_index=0")
  out = capsys.readouterr().out
  assert out.startswith(formatting.render_grid(expected[0]) + "\n"), (out, texts[0])
  assert next(lines, None) is None  # every line was read


def test_malformed_puzzles_are_one_error_line(sudoku_run, sample_cli, capsys):
  puzzle = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
  cases = [
      (puzzle[:-2], r"\(79 characters\) is not a Sudoku puzzle: expected 81 cells .*got 79"),
      (puzzle.replace("0", ".") + "5", r"expected 81 cells .*got 82"),
      (puzzle[:40] + "x" + puzzle[41:], r"invalid character 'x' at position 40"),
      ("55" + puzzle[2:], r"contradictory givens: digit 5 at r1c1 and r1c2 \(same row 1\)"),
      (puzzle[:10] + "5" + puzzle[11:], r"contradictory givens: digit 5 at r1c1 and r2c2 \(same box 1\)"),
  ]
  for text, pattern in cases:
    for source in ([f"--workdir={sudoku_run}"], ["--checkpoint=/no/such/dir", "--task=sudoku"]):
      capsys.readouterr()
      with pytest.raises(SystemExit) as exit_:
        sample_cli(*source, f"--prompt={text}", entry="run")
      assert exit_.value.code == 1
      err = capsys.readouterr().err.strip().splitlines()
      assert len(err) == 1 and err[0].startswith("error: prompt "), (text, err)
      assert re.search(pattern, err[0]), (pattern, err[0])
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_:
    sample_cli(f"--workdir={sudoku_run}", f"--prompt={puzzle}", "--dtype=bfloat16", entry="run")
  assert exit_.value.code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: --dtype=bfloat16 applies to --checkpoint"), err


def test_checkpoint_with_task_sudoku_and_dtype(sudoku_run, loaded_run, sample_cli, capsys, tmp_path):
  """`--checkpoint=HF_DIR --task=sudoku --dtype=bfloat16`: a HF directory (a fresh model with the run's vocabulary,
  plain attention: the peer structure cannot be exported) loads in bfloat16 and samples with the Sudoku hooks."""
  import dataclasses

  from flax import nnx

  import hackable_diffusion as hd

  config = dataclasses.replace(loaded_run.model.config, attention_structure=None)
  hd.save_pretrained(hd.DiffusionGemma(config, rngs=nnx.Rngs(0)), str(tmp_path / "hf"))
  puzzle = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
  capsys.readouterr()
  sample_cli(f"--checkpoint={tmp_path / 'hf'}", f"--tokenizer={os.path.join(sudoku_run, 'tokenizer.model')}",
             "--task=sudoku", "--dtype=bfloat16", f"--prompt={puzzle}", "--max_new_tokens=81", "--steps=4")
  out, err = capsys.readouterr()
  assert "(bfloat16)" in err, err
  answer = formatting.parse_grid("\n".join(out.split("\n")[:11]))  # a grid of digits 1-9 only
  given = formatting.parse_grid(puzzle)
  assert (answer >= 1).all() and np.array_equal(answer[given > 0], given[given > 0]), out  # givens pinned


def test_infilling_keeps_the_pinned_text(sudoku_run, sample_cli, capsys):
  """`--task=text --seed_canvas=...`: the pinned characters come back at their places, the placeholders filled."""
  capsys.readouterr()
  sample_cli(f"--workdir={sudoku_run}", "--task=text", "--prompt=" + "0" * 81, "--seed_canvas=" + "1" * 40 + "_" * 41,
             "--steps=4")
  out = capsys.readouterr().out.strip()
  assert out.startswith("1" * 40), out  # a free position could be sampled as EOS: only the pinned start is sure


def test_moe_impl_flag_reaches_the_model(sudoku_run, sample_cli, monkeypatch):
  """--moe_impl sets the model's `moe_impl` for a --workdir (default: the run's own)."""
  seen = []

  def spy(workdir, cfg, step=None, **kwargs):
    seen.append(run_lib.build_model_config(cfg, run_lib.load_run_tokenizer(workdir)).moe_impl)
    raise KeyboardInterrupt  # stop before loading the weights

  monkeypatch.setattr(run_lib, "load_run", spy)
  for args in ((), ("--moe_impl=dense",)):
    with pytest.raises(KeyboardInterrupt):
      sample_cli(f"--workdir={sudoku_run}", "--prompt=" + "0" * 81, *args)
  assert seen == ["auto", "dense"]
