"""Evaluation tasks: how to score generated text, plus optional data generation and sampler hooks.

A `Task` turns the decoded completions of a model into metrics. The evaluation loop
(`hackable_diffusion.evaluation.loop`) calls:

- `metrics(predictions, records) -> {name: float}` with the decoded texts (after the prompt, EOS and padding
  removed) and the `EvalRecord`s they answer (prompt, reference completion and every other JSON field);
- `allowed_token_ids(tokenizer)` -> ids the sampler may produce (None: all), e.g. digits + EOS for Sudoku;
- `seed_canvas(records, tokenizer, num_tokens)` -> `(seed_ids [B, num_tokens], pinned [B, num_tokens])` or
  None: canvases that start from known tokens, pinned positions never change (e.g. Sudoku givens);
- `make_data(out_dir)` -> `{'train': path, 'validation': path}` for tasks that generate their own JSONL
  (`data.generator` in a config);
- `plot_trajectory(trajectory, path)`: a picture of one example's canvas after every denoising step (optional).

`primary_metric` names the metric plotted against the denoising-step budget. Tasks are looked up by name in
`TASKS` (values are classes or lazy 'module:attr' strings) or given directly as 'package.module:factory'; the
factory is called with the config's `task_args`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hackable_diffusion.model.config import ConfigError


@dataclasses.dataclass(frozen=True)
class EvalRecord:
  """One evaluation example: the prompt, the reference completion, and the record's other JSON fields."""

  prompt: str
  completion: str
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task:
  """Base class: override `metrics` (and, as needed, the hooks). See the module docstring."""

  name: str = "task"
  primary_metric: str = "exact_match"

  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    raise NotImplementedError

  def allowed_token_ids(self, tokenizer: Any) -> Sequence[int] | None:
    return None

  def seed_canvas(self, records: Sequence[EvalRecord], tokenizer: Any,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    return None

  def plot_trajectory(self, trajectory: Mapping[str, Any], path: str) -> str | None:
    """Draws `trajectory` (`{'prompt', 'target', 'steps': [decoded canvas after each step]}`) into `path`;
    returns the path, or None when the task has no picture for it (the report still holds the texts)."""
    return None

  def make_data(self, out_dir: str) -> dict[str, str]:
    raise ConfigError(f"task {self.name!r} cannot generate data; set data.train_path instead of data.generator")


def _check_lengths(predictions: Sequence[str], records: Sequence[EvalRecord]) -> None:
  if len(predictions) != len(records):
    raise ValueError(f"{len(predictions)} predictions for {len(records)} records")


def exact_match(predictions: Sequence[str], targets: Sequence[str], *, strip: bool = True) -> float:
  """Fraction of predictions equal to their target (whitespace-stripped at both ends by default)."""
  if not targets:
    return float("nan")
  norm = (lambda s: s.strip()) if strip else (lambda s: s)  # noqa: E731
  return float(np.mean([norm(p) == norm(t) for p, t in zip(predictions, targets)]))


def char_accuracy(predictions: Sequence[str], targets: Sequence[str], *, strip: bool = True) -> float:
  """Position-wise character accuracy over the targets' characters (missing characters count as wrong)."""
  norm = (lambda s: s.strip()) if strip else (lambda s: s)  # noqa: E731
  correct = total = 0
  for p, t in zip(predictions, targets):
    p, t = norm(p), norm(t)
    correct += sum(a == b for a, b in zip(p, t))
    total += len(t)
  return correct / total if total else float("nan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextTask(Task):
  """Generic text task: exact match and character accuracy of the completion.

  allowed_chars: if set, the sampler may only produce these characters (and EOS).
  strip: compare with surrounding whitespace removed.
  """

  allowed_chars: str = ""
  strip: bool = True
  name: str = "text"
  primary_metric: str = "exact_match"

  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    _check_lengths(predictions, records)
    targets = [r.completion for r in records]
    return {
        "exact_match": exact_match(predictions, targets, strip=self.strip),
        "char_accuracy": char_accuracy(predictions, targets, strip=self.strip),
        "length_match": float(np.mean([len(p.strip()) == len(t.strip()) for p, t in zip(predictions, targets)]))
        if targets else float("nan"),
    }

  def allowed_token_ids(self, tokenizer: Any) -> Sequence[int] | None:
    if not self.allowed_chars:
      return None
    try:
      ids = tokenizer.token_ids_for(sorted(set(self.allowed_chars)))
    except ValueError as e:
      raise ConfigError(f"{self.name} task allowed_chars: {e}") from None
    return sorted(set(ids) | ({tokenizer.eos_id} if tokenizer.eos_id >= 0 else set()))


_DIGIT_OPS: dict[str, Callable[[str], str]] = {
    "sort": lambda s: "".join(sorted(s)),
    "reverse": lambda s: s[::-1],
    "shift": lambda s: "".join(str((int(c) + 1) % 10) for c in s),
    "copy": lambda s: s,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsTask(TextTask):
  """Toy task for smoke tests and `configs/tiny.py`: map a random digit string to `op(string)`.

  op: 'sort' (default; ascending digits), 'reverse', 'shift' (each digit + 1 mod 10) or 'copy'.
  length: digits per example. num_train / num_validation: records generated; seed: the data seed.
  The best input-independent guess scores about 0.32 character accuracy and 0.0004 exact match on 'sort' with
  length 7 (the mode of each order statistic), 0.1 / 1e-7 on the other ops.
  """

  op: str = "sort"
  length: int = 7
  num_train: int = 5000
  num_validation: int = 256
  seed: int = 0
  allowed_chars: str = ""
  name: str = "digits"

  def __post_init__(self):
    if self.op not in _DIGIT_OPS:
      raise ConfigError(f"digits task op={self.op!r}; expected one of {sorted(_DIGIT_OPS)}")
    for field in ("length", "num_train", "num_validation"):
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"digits task {field}={v!r}; expected a positive integer")

  def records(self, split: str) -> list[dict[str, str]]:
    """The generated `{'prompt', 'completion'}` records of 'train' or 'validation' (deterministic)."""
    n = self.num_train if split == "train" else self.num_validation
    rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
    digits = rng.integers(0, 10, size=(n, self.length))
    fn = _DIGIT_OPS[self.op]
    out = []
    for row in digits:
      s = "".join(map(str, row))
      out.append({"prompt": s, "completion": fn(s)})
    return out

  def make_data(self, out_dir: str) -> dict[str, str]:
    spec = {"task": self.name, "op": self.op, "length": self.length, "num_train": self.num_train,
            "num_validation": self.num_validation, "seed": self.seed}
    return write_jsonl_splits(out_dir, spec, {split: (lambda s=split: self.records(s))
                                              for split in ("train", "validation")})


def write_jsonl_splits(out_dir: str, spec: Mapping[str, Any],
                       splits: Mapping[str, Callable[[], Sequence[Mapping[str, Any]]]]) -> dict[str, str]:
  """Writes `out_dir/<split>.jsonl` for each split unless files made from the same `spec` exist; returns paths.

  `spec` (JSON) is stored as `out_dir/data_spec.json`; a different spec regenerates the files. Files are
  written under temporary names and renamed, so a killed run never leaves a partial file.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {split: os.path.join(out_dir, f"{split}.jsonl") for split in splits}
  spec_path = os.path.join(out_dir, "data_spec.json")
  try:
    with open(spec_path, encoding="utf-8") as f:
      same = json.load(f) == json.loads(json.dumps(spec))
  except (OSError, json.JSONDecodeError):
    same = False
  if same and all(os.path.isfile(p) for p in paths.values()):
    return paths
  for split, make in splits.items():
    tmp = paths[split] + f".tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
      for record in make():
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, paths[split])
  tmp = spec_path + f".tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(spec, f, sort_keys=True)
  os.replace(tmp, spec_path)
  return paths


# Names usable in configs. A string value 'module:attr' is imported on first use, so tasks living in other
# packages (e.g. Sudoku) plug in without this module importing them.
TASKS: dict[str, type[Task] | Callable[..., Task] | str] = {
    "text": TextTask,
    "digits": DigitsTask,
    "sudoku": "hackable_diffusion.tasks.sudoku.task:SudokuTask",
}


def _import(spec: str) -> Callable[..., Task]:
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise ConfigError(f"task {spec!r}: expected a registered name {sorted(TASKS)} or 'package.module:factory'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"task {spec!r}: cannot import {module_name} ({e})") from None
  if not hasattr(module, attr):
    raise ConfigError(f"task {spec!r}: {module_name} has no attribute {attr!r}")
  return getattr(module, attr)


def get_task(name: str, args: Mapping[str, Any] | None = None) -> Task:
  """A task by registered name or 'module:factory', built with `args` (a ConfigError on any problem)."""
  factory = TASKS.get(name, name)
  if isinstance(factory, str):
    if ":" not in factory:
      raise ConfigError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)} (or give 'module:factory')")
    factory = _import(factory)
  try:
    task = factory(**dict(args or {}))
  except TypeError as e:
    raise ConfigError(f"task {name!r}: bad task arguments {sorted(dict(args or {}))} ({e})") from None
  if not callable(getattr(task, "metrics", None)):
    raise ConfigError(f"task {name!r}: the factory returned {type(task).__name__}, which has no metrics()")
  return task


__all__ = ["DigitsTask", "EvalRecord", "TASKS", "Task", "TextTask", "char_accuracy", "exact_match", "get_task",
           "write_jsonl_splits"]
