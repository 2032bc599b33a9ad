"""What a task is: how to score generated text, plus optional data generation, sampler hooks and attention structure.

A `Task` turns the decoded completions of a model into metrics. The evaluation loop
(`hackable_diffusion.evaluation.loop`) and the trainer call:

- `metrics(predictions, records) -> {name: float}` with the decoded texts (after the prompt, EOS and padding
  removed) and the `EvalRecord`s they answer (prompt, reference completion and every other JSON field); when the
  evaluation data are loaded it is also called once with the references as predictions (and `seed_canvas` once),
  so that a record it cannot use is an error naming its line before anything is sampled (`evaluation/checks.py`);
- `allowed_token_ids(tokenizer)` -> ids the sampler may produce (None: all), e.g. digits + EOS for Sudoku;
- `seed_canvas(records, tokenizer, num_tokens)` -> `(seed_ids [B, num_tokens], pinned [B, num_tokens])` or
  None: canvases that start from known tokens, pinned positions never change (e.g. Sudoku givens); the
  evaluation calls it per batch, so a row should depend on its own record only (draw any noise per record);
- `make_data(out_dir[, progress])` -> `{'train': path, 'validation': path, ...}` for tasks that generate their own
  JSONL (`data.generator` in a config; `progress`, if the task takes it: show a progress bar);
- `plot_trajectory(trajectory, path)`: a picture of one example's canvas after every denoising step;
- `attention_structure()` -> the task's own canvas attention structure as a 'package.module:function' spec for
  `ModelConfig.attention_structure` (None: plain attention), e.g. Sudoku's row/column/box peers.

A task whose answers can be checked cheaply may also give the sampler its rules: `checker(tokenizer)` -> a
`sampling.checker.Checker` (`canvas [B, C] -> violations [B, C] bool`, traced inside the denoising loop) or None
(the default); the evaluation re-noises what it flags when `eval.checker` is on (the module function `checker`
gives None for a task without the hook).

Sampling a prompt someone typed (`runs.sampling`, `python -m hackable_diffusion.sample`) uses three more optional
hooks (`parse_prompt`, `prompt_complete`, `render`; module functions of the same names apply their defaults to a
task without them): the typed text as the task writes prompts in its data (a one-line `ConfigError` for one it
could not be), whether an interactive prompt needs more lines, and a completion as shown to a person.

`primary_metric` names the metric plotted against the denoising-step budget. `reference_scores` (optional, `{}` if
absent) are metric values a reference completion must get as its own prediction, e.g. Sudoku's
`{'solved_rate': 1.0}`: a reference that breaks the rules or changes a given is then an error naming its line,
not a skewed score. `BaseTask` gives every optional hook
its default; a task that does not subclass it implements them all. `get_task` builds a task from a built-in name
(`BUILTIN_TASKS`: 'text', 'digits', 'sudoku', 'sudoku_image') or from 'package.module:factory' (a class or function
in any importable module), called with the config's task arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hackable_diffusion import specs
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.files import write_atomic, write_json

if TYPE_CHECKING:
  from hackable_diffusion.sampling.checker import Checker


@dataclasses.dataclass(frozen=True)
class EvalRecord:
  """One evaluation example: the prompt, the reference completion, and the record's other JSON fields."""

  prompt: str
  completion: str
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task(Protocol):
  """The interface the evaluation loop and the trainer use (see the module docstring for each hook)."""

  name: str
  primary_metric: str

  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    """Scores `predictions [B]` (decoded texts) against `records [B]`: `{metric name: value}`."""
    ...

  def allowed_token_ids(self, tokenizer: Any) -> Sequence[int] | None:
    ...

  def seed_canvas(self, records: Sequence[EvalRecord], tokenizer: Any,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    ...

  def plot_trajectory(self, trajectory: Mapping[str, Any], path: str) -> str | None:
    ...

  def make_data(self, out_dir: str) -> dict[str, str]:
    ...

  def attention_structure(self) -> str | None:
    ...


# The hooks `get_task` checks a built task for (a task need not subclass anything).
TASK_METHODS = ("metrics", "allowed_token_ids", "seed_canvas", "plot_trajectory", "make_data", "attention_structure")


class BaseTask:
  """Default hooks of a `Task`: subclass it and override `metrics` (and, as needed, the hooks)."""

  name: str = "task"
  primary_metric: str = "exact_match"
  reference_scores: Mapping[str, float] = types.MappingProxyType({})  # nothing checked beyond `metrics` running

  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    raise NotImplementedError(f"task {self.name!r} defines no metrics()")

  def allowed_token_ids(self, tokenizer: Any) -> Sequence[int] | None:
    """Every token may be sampled."""
    return None

  def seed_canvas(self, records: Sequence[EvalRecord], tokenizer: Any,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """No task-specific start: canvases start from noise (or from the data's pinned tokens, see the loop)."""
    return None

  def plot_trajectory(self, trajectory: Mapping[str, Any], path: str) -> str | None:
    """Draws `trajectory` (`{'prompt', 'target', 'steps': [decoded canvas after each step]}`) into `path`;
    returns the path, or None when the task has no picture for it (the report still holds the texts)."""
    return None

  def make_data(self, out_dir: str) -> dict[str, str]:
    raise ConfigError(f"task {self.name!r} cannot generate data; set data.train_path instead of data.generator")

  def attention_structure(self) -> str | None:
    """Plain attention: the task brings no canvas attention structure."""
    return None

  def checker(self, tokenizer: Any) -> Checker | None:
    """No rules for the sampler to check."""
    return None

  def parse_prompt(self, text: str) -> str:
    """The typed prompt as the task's data writes it: as is."""
    return text

  def chat_template(self) -> str | None:
    """The jinja template that turns the data's prompt into what the model reads (`data.chat_template='task'`):
    none."""
    return None

  def prompt_complete(self, text: str) -> bool:
    """Whether an interactive prompt is whole (False: read another line): one line is."""
    return True

  def render(self, completion: str, record: EvalRecord) -> str:
    """The completion as shown to a person (`record`: the parsed prompt, no reference): as is."""
    return completion


# ---- the optional sampling hooks, with BaseTask's defaults for a task that lacks them ---------------------------
def parse_prompt(task: Task | None, text: str) -> str:
  """`task.parse_prompt(text)` (as is without a task or the hook)."""
  hook = getattr(task, "parse_prompt", None)
  return hook(text) if callable(hook) else text


def prompt_complete(task: Task | None, text: str) -> bool:
  """`task.prompt_complete(text)` (True without a task or the hook)."""
  hook = getattr(task, "prompt_complete", None)
  return bool(hook(text)) if callable(hook) else True


def render(task: Task | None, completion: str, record: EvalRecord) -> str:
  """`task.render(completion, record)` (the completion without a task or the hook)."""
  hook = getattr(task, "render", None)
  return hook(completion, record) if callable(hook) else completion


def chat_template(task: Task | None) -> str | None:
  """`task.chat_template()` (None without a task or the hook)."""
  hook = getattr(task, "chat_template", None)
  return hook() if callable(hook) else None


def checker(task: Task | None, tokenizer: Any) -> Checker | None:
  """`task.checker(tokenizer)` (None without a task or the hook)."""
  hook = getattr(task, "checker", None)
  return hook(tokenizer) if callable(hook) else None


# ---- metric helpers --------------------------------------------------------------------------------------------
def check_lengths(predictions: Sequence[str], records: Sequence[EvalRecord]) -> None:
  """A `ValueError` when there is not exactly one prediction per record."""
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


# ---- generated data on disk --------------------------------------------------------------------------------------
DATA_SPEC_FILE = "data_spec.json"


def data_spec_matches(out_dir: str, spec: Mapping[str, Any]) -> bool:
  """Whether `out_dir/data_spec.json` holds `spec` (as JSON), i.e. the files there were generated from it."""
  try:
    with open(os.path.join(out_dir, DATA_SPEC_FILE), encoding="utf-8") as f:
      return json.load(f) == json.loads(json.dumps(spec))
  except (OSError, ValueError):  # missing, unreadable, not UTF-8 or not JSON: regenerate
    return False


def write_data_spec(out_dir: str, spec: Mapping[str, Any]) -> str:
  """Records `spec` as `out_dir/data_spec.json` (atomically; written after the data files it describes)."""
  return write_json(os.path.join(out_dir, DATA_SPEC_FILE), spec, indent=None)


def write_jsonl_splits(out_dir: str, spec: Mapping[str, Any],
                       splits: Mapping[str, Callable[[], Sequence[Mapping[str, Any]]]]) -> dict[str, str]:
  """Writes `out_dir/<split>.jsonl` for each split unless files made from the same `spec` exist; returns paths.

  `spec` (JSON) is stored as `out_dir/data_spec.json`; a different spec regenerates the files. Every file is
  written atomically (`files.write_atomic`), so a killed run never leaves a partial file.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {split: os.path.join(out_dir, f"{split}.jsonl") for split in splits}
  if data_spec_matches(out_dir, spec) and all(os.path.isfile(p) for p in paths.values()):
    return paths
  for split, make in splits.items():
    write_atomic(paths[split], "".join(json.dumps(record) + "\n" for record in make()))
  write_data_spec(out_dir, spec)
  return paths


# ---- building a task from a config -----------------------------------------------------------------------------
# The built-in task names and the 'module:factory' each stands for (imported on use, like a researcher's own spec).
BUILTIN_TASKS: Mapping[str, str] = types.MappingProxyType({
    "text": "hackable_diffusion.tasks.text:TextTask",
    "digits": "hackable_diffusion.tasks.text:DigitsTask",
    "sudoku": "hackable_diffusion.tasks.sudoku.task:SudokuTask",
    "sudoku_image": "hackable_diffusion.tasks.sudoku.image_task:ImageSudokuTask",
})


def get_task(name: str, args: Mapping[str, Any] | None = None) -> Task:
  """The task `name` (a `BUILTIN_TASKS` name, an installed `hackable_diffusion.tasks` plugin or
  'package.module:factory', see `specs.resolve`) built with `args`.

  A one-line `ConfigError` on any problem: unknown name, unimportable module, missing factory, arguments the
  factory rejects, or a result that lacks one of the `Task` hooks.
  """
  spec = BUILTIN_TASKS.get(name, name)
  factory = specs.resolve("tasks", name, what="task", builtins=BUILTIN_TASKS,
                          unknown=f"unknown task {name!r}; built-in tasks: {sorted(BUILTIN_TASKS)} (or an installed "
                                  "plugin, or give 'module:factory')")
  if not callable(factory):
    raise ConfigError(f"task {name!r}: {spec} is a {type(factory).__name__}, not a class or function")
  args = dict(args or {})
  try:
    task = factory(**args)
  except TypeError as e:
    raise ConfigError(f"task {name!r}: bad task arguments {sorted(args)} ({e})") from None
  missing = [m for m in TASK_METHODS if not callable(getattr(task, m, None))]
  missing += [a for a in ("name", "primary_metric") if not isinstance(getattr(task, a, None), str)]
  if missing:
    raise ConfigError(f"task {name!r}: the factory returned a {type(task).__name__}, which lacks {missing} "
                      "(subclass hackable_diffusion.tasks.base.BaseTask for the default hooks)")
  return task


__all__ = ["BUILTIN_TASKS", "BaseTask", "DATA_SPEC_FILE", "EvalRecord", "TASK_METHODS", "Task", "char_accuracy",
           "check_lengths", "checker", "data_spec_matches", "exact_match", "get_task", "parse_prompt",
           "prompt_complete", "render", "write_data_spec", "write_jsonl_splits"]
