"""Sudoku as a task: generated data, the cell-identity prompt, digit-only sampling, pinned givens, solved-rate
metrics, peer attention.

Built in as `eval.task='sudoku'` / `data.generator='sudoku'` (see `hackable_diffusion.tasks.base.get_task`); its
attention structure is `SudokuTask().attention_structure()` (`structure.PEER_MASK`) for
`ModelConfig.attention_structure`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks.base import BaseTask, EvalRecord, check_lengths, data_spec_matches, write_data_spec
from hackable_diffusion.tasks.sudoku import dataset, formatting, metrics, plots, solver, structure
from hackable_diffusion.tasks.sudoku.cell_prompt import CELL_TEMPLATE
from hackable_diffusion.tasks.sudoku.checker import SudokuChecker

DIGITS = "123456789"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SudokuTask(BaseTask):
  """Solve 9x9 puzzles: prompt = 81 chars ('0' blank), completion = 81 digits.

  num_train / num_validation / num_test, seed, easy/medium/hard (bucket weights) and workers shape the
  generated data (`make_data`); train_easy/train_medium/train_hard, if any is set, give the training split its own
  mix (unset ones count 0) while validation and test keep easy/medium/hard. At evaluation, `pin_givens` starts the
  canvas from the givens and pins them (the sampler never changes them); `digits_only` restricts sampling to the
  digits 1-9. Its attention structure lets each cell see its row / column / box peers (`structure.peer_mask`).
  """

  num_train: int = 20_000
  num_validation: int = 500
  num_test: int = 500
  seed: int = 0
  easy: float = 0.5
  medium: float = 0.5
  hard: float = 0.0
  train_easy: float | None = None
  train_medium: float | None = None
  train_hard: float | None = None
  workers: int = 2
  pin_givens: bool = True
  digits_only: bool = True
  name: str = "sudoku"
  primary_metric: str = "solved_rate"
  # a reference solution is a valid grid that keeps every given (a hand-made file may hold one that is not)
  reference_scores: ClassVar[Mapping[str, float]] = types.MappingProxyType({"solved_rate": 1.0})

  def __post_init__(self):
    for field in ("num_train", "num_validation", "num_test"):
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"sudoku task {field}={v!r}; expected a positive integer")
    _check_weights(self.easy, self.medium, self.hard, "")
    if self.train_weights() is not None:
      _check_weights(*self.train_weights().values(), "train_")

  def train_weights(self) -> dict[str, float] | None:
    """The training split's bucket weights, or None when it follows easy/medium/hard."""
    given = {"easy": self.train_easy, "medium": self.train_medium, "hard": self.train_hard}
    if all(v is None for v in given.values()):
      return None
    return {k: 0.0 if v is None else float(v) for k, v in given.items()}

  # ---- data --------------------------------------------------------------------------------------------------
  def _spec(self) -> dict[str, Any]:
    return {"task": "sudoku", "num_train": self.num_train, "num_validation": self.num_validation,
            "num_test": self.num_test, "seed": self.seed, "easy": self.easy, "medium": self.medium,
            "hard": self.hard, **({} if self.train_weights() is None else {"train": self.train_weights()})}

  def make_data(self, out_dir: str, progress: bool = True) -> dict[str, str]:
    """Writes train/validation/test JSONL into `out_dir` (once; regenerated if the generation arguments change),
    with a progress bar unless `progress` is False."""
    paths = dataset.dataset_paths(out_dir)
    if not (data_spec_matches(out_dir, self._spec()) and all(p.exists() for p in paths.values())):
      if os.path.isdir(out_dir):
        for p in paths.values():
          if p.exists():
            os.remove(p)
      weights = {"easy": self.easy, "medium": self.medium, "hard": self.hard}
      dataset.write_dataset(out_dir, num_train=self.num_train, num_validation=self.num_validation,
                            num_test=self.num_test, seed=self.seed, bucket_weights=weights,
                            train_bucket_weights=self.train_weights(), workers=self.workers,
                            show_progress=progress)
      write_data_spec(out_dir, self._spec())
    return {split: str(p) for split, p in paths.items()}

  # ---- sampling hooks ------------------------------------------------------------------------------------------
  def allowed_token_ids(self, tokenizer: Any) -> Sequence[int] | None:
    return tokenizer.token_ids_for(DIGITS) if self.digits_only else None

  def seed_canvas(self, records: Sequence[EvalRecord], tokenizer: Any,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Givens at their cells (pinned) and uniform noise elsewhere; without `pin_givens` pure noise, no pins.

    Each record's noise is drawn from its own puzzle (a generator seeded with the prompt's CRC-32), so a puzzle's
    start canvas does not depend on the other records of the call (the evaluation's batch size)."""
    noise = np.zeros((len(records), num_tokens), np.int32)  # [R, num_tokens]
    for i, record in enumerate(records):
      noise[i] = np.random.default_rng(zlib.crc32(record.prompt.encode("utf-8"))).integers(
          0, tokenizer.vocab_size, size=num_tokens)
    pinned = np.zeros((len(records), num_tokens), bool)
    if not self.pin_givens:
      return noise, pinned
    digit_ids = np.asarray(tokenizer.token_ids_for(DIGITS))  # [9]: the ids of 1..9 ('0' need not be a token)
    for i, record in enumerate(records):
      grid = formatting.parse_grid(record.prompt)
      given = grid > 0
      noise[i, :81] = np.where(given, digit_ids[np.maximum(grid, 1) - 1], noise[i, :81])
      pinned[i, :81] = given
    return noise, pinned

  def checker(self, tokenizer: Any) -> SudokuChecker:
    """The rules for the sampler (`checker.SudokuChecker`): non-digits and repeated digits in a row, column or box."""
    return SudokuChecker.for_tokenizer(tokenizer)

  def plot_trajectory(self, trajectory: Mapping[str, Any], path: str) -> str | None:
    return plots.plot_canvas_trajectory(trajectory, path)  # imports matplotlib on first use

  # ---- typed prompts and shown answers (sampling) -----------------------------------------------------------------
  def parse_prompt(self, text: str) -> str:
    """A puzzle in any notation `formatting.parse_puzzle` reads ('.', '0' or '_' blanks; whitespace and '|', '-',
    '+' separators, so a pasted grid works) as the data writes it: 81 cells in row order, '0' for a blank. A
    wrong cell count, a bad character or clashing givens is a one-line `ConfigError`."""
    try:
      grid = formatting.parse_puzzle(text)
    except ValueError as e:
      shown = " ".join(text.split())
      shown = shown if len(shown) <= 40 else shown[:37] + "..."
      raise ConfigError(f"prompt {shown!r} ({len(text)} characters) is not a Sudoku puzzle: {e}; a puzzle is 81 "
                        "cells in row order, a digit 1-9 or a blank ('.', '0' or '_'), separators (whitespace, '|', "
                        "'-', '+') ignored") from None
    return formatting.puzzle_to_prompt(grid)

  def chat_template(self) -> str:
    """The cell-identity prompt (`cell_prompt.CELL_TEMPLATE`): each cell as one character naming the cell and its
    content, which a standard DiffusionGemma learns from (configs/sudoku.py: `data.chat_template='task'`)."""
    return CELL_TEMPLATE

  def prompt_complete(self, text: str) -> bool:
    """A pasted grid spans lines: the prompt is whole once it holds 81 cells (`formatting.count_cells`)."""
    return formatting.count_cells(text) >= solver.NUM_CELLS

  def render(self, completion: str, record: EvalRecord) -> str:
    """The answer as a grid (`formatting.render_grid`), then a line saying whether it solves `record.prompt`'s
    puzzle (`formatting.solution_verdict`: a complete grid with no clash that keeps every given)."""
    answer = metrics.parse_prediction(completion)
    _, verdict = formatting.solution_verdict(answer, formatting.parse_grid(record.prompt))
    return f"{formatting.render_grid(answer)}\n{verdict}"

  def attention_structure(self) -> str | None:
    """Each canvas cell attends to its row / column / box peers: `structure.PEER_MASK`."""
    return structure.PEER_MASK

  # ---- metrics ---------------------------------------------------------------------------------------------------
  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    """Solved rate and blank-cell accuracy, overall and per bucket (easy >= 40 givens, medium 30-39, hard < 30)."""
    check_lengths(predictions, records)
    preds = np.stack([metrics.parse_prediction(p) for p in predictions])
    puzzles = np.stack([formatting.parse_grid(r.prompt) for r in records])
    solutions = np.stack([formatting.parse_grid(r.completion) for r in records])
    return {k: float(v) for k, v in metrics.sudoku_metrics(preds, puzzles, solutions).items()}


def _check_weights(easy: float, medium: float, hard: float, prefix: str) -> None:
  for name, v in (("easy", easy), ("medium", medium), ("hard", hard)):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
      raise ConfigError(f"sudoku task {prefix}{name}={v!r}; expected a finite number >= 0")
  if min(easy, medium, hard) < 0 or easy + medium + hard <= 0:
    raise ConfigError(f"sudoku task bucket weights {prefix}easy={easy}, {prefix}medium={medium}, {prefix}hard={hard} "
                      "must be >= 0 and not all 0")
