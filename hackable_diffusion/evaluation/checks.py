"""Checks of evaluation records against their task, run before anything is sampled.

A record the task cannot handle (a Sudoku solution of 80 cells, a prompt its `seed_canvas` cannot parse) would
otherwise surface as a traceback from deep inside the task - after minutes of sampling when it is the scoring that
fails. `check_records` calls the task's hooks on the records first and names the file and line of the first record
that fails. A reference that parses but is wrong (a Sudoku "solution" that breaks a rule or changes a given) would
skew every score silently: a task's `reference_scores` (Sudoku: `solved_rate` 1.0) catch it the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hackable_diffusion.errors import DataError
from hackable_diffusion.tasks.base import EvalRecord, Task


def check_records(task: Task, examples: Sequence[EvalRecord], sources: Sequence[tuple[str, int]], tokenizer: Any,
                  num_tokens: int) -> None:
  """Scores every reference completion as a prediction of itself (`task.metrics`) and builds every start canvas
  (`task.seed_canvas` with `num_tokens` tokens): one call each over all `examples [n]`; if one fails, each record
  alone, and a one-line `DataError` names the first failing record's file:line (`sources [n]`) and the error.
  When the task gives `reference_scores` and the references together miss them, the first record whose own
  reference misses them is named the same way."""
  if not examples:  # nothing to check (an evaluation file without records is refused where it is read)
    return
  expected = dict(getattr(task, "reference_scores", None) or {})

  def score(recs: Sequence[EvalRecord]) -> None:
    scores = task.metrics([r.completion for r in recs], recs)
    missed = {k: scores.get(k) for k, v in expected.items() if scores.get(k) != v}
    if missed:
      got = ", ".join(f"{k}={v}" for k, v in missed.items())
      want = ", ".join(f"{k}={expected[k]}" for k in missed)
      raise _WrongReference(f"its reference completion, scored as its own prediction, gives {got}; a correct "
                            f"reference gives {want}")

  hooks: dict[str, Callable[[Sequence[EvalRecord]], Any]] = {
      "metrics": score,
      "seed_canvas": lambda recs: task.seed_canvas(recs, tokenizer, num_tokens),
  }
  for hook, call in hooks.items():
    try:
      call(examples)
      continue
    except Exception:  # noqa: BLE001 - located per record below; re-raised if no single record fails
      pass
    for example, (file, line) in zip(examples, sources):
      try:
        call([example])
      except _WrongReference as e:
        raise DataError(f"{file}:{line}: task {task.name!r} cannot use this record ({e})") from None
      except Exception as e:  # noqa: BLE001 - any error of a task hook on this record is the record's problem
        raise DataError(f"{file}:{line}: task {task.name!r} cannot use this record ({hook}: {type(e).__name__}: "
                        f"{e})") from None
    call(examples)  # fails on the records together only: the task's own error


class _WrongReference(ValueError):
  """A reference that the task scores below its `reference_scores`."""


__all__ = ["check_records"]
