"""The user-facing error classes, in one place at the bottom of the import graph.

Every error a user can cause (a bad config key, a malformed data line, a damaged checkpoint, a run that cannot go
on) is one of these, with a one-line message naming the file, line, key, shape or token id at fault. The CLIs
print such errors as one line (`cli.run`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HackableDiffusionError(ValueError):
  """Base class of the project's user-facing errors (a `ValueError`, so `except ValueError` still catches it)."""


class ConfigError(HackableDiffusionError):
  """A configuration (model, sampler, experiment section, CLI flag) is invalid."""


class DataError(HackableDiffusionError):
  """Training or evaluation data cannot be read (file, line and field named in the message)."""


class CheckpointError(HackableDiffusionError):
  """A checkpoint, run directory or tokenizer file cannot be read or does not match the model."""


class AdapterError(CheckpointError):
  """A LoRA / PEFT adapter cannot be read, written or applied."""


class TrainingError(HackableDiffusionError):
  """Training cannot go on (e.g. the loss became non-finite, or the run was interrupted)."""


class UnsafePathError(HackableDiffusionError):
  """A file the project would write (in a workdir or an export folder) is a symbolic link it did not create:
  writing would follow it to wherever it points, so the write is refused (`files.check_not_link`)."""


# What the CLIs report as one line (FileNotFoundError: a path the user gave does not exist).
USER_ERRORS: tuple[type[BaseException], ...] = (HackableDiffusionError, FileNotFoundError)

__all__ = ["AdapterError", "CheckpointError", "ConfigError", "DataError", "HackableDiffusionError",
           "TrainingError", "USER_ERRORS", "UnsafePathError"]
