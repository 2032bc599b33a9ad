"""'package.module:attribute' strings: how a config names a component that lives outside the library.

A task (`eval.task`, `data.generator`), a task's attention structure (`ModelConfig.attention_structure`) and a loss
term (`diffusion.loss_variant`) can each be the researcher's own code, named by such a string and imported on use
with `importlib`. Nothing is registered anywhere: the string is the whole reference, so it survives in the run's
`config.json` and a fresh process resolves it the same way.
"""

from __future__ import annotations

import importlib
from typing import Any

from hackable_diffusion.errors import ConfigError


def is_spec(value: Any) -> bool:
  """Whether `value` has the form 'package.module:attribute' (both parts non-empty; nothing is imported)."""
  if not isinstance(value, str):
    return False
  module, sep, attr = value.partition(":")
  return bool(sep and module.strip() and attr.strip()) and value == value.strip() and ":" not in attr


def import_spec(spec: str, *, what: str) -> Any:
  """The object `spec` ('package.module:attribute') names; a one-line `ConfigError` starting with `what` (the config
  key, e.g. "diffusion.loss_variant") when `spec` is malformed, its module cannot be imported or lacks the attribute.
  """
  if not is_spec(spec):
    raise ConfigError(f"{what}={spec!r}: expected 'package.module:attribute'")
  module_name, _, attr = spec.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ConfigError(f"{what}={spec!r}: cannot import {module_name} ({reason})") from None
  if not hasattr(module, attr):
    raise ConfigError(f"{what}={spec!r}: {module_name} has no attribute {attr!r}")
  return getattr(module, attr)


__all__ = ["import_spec", "is_spec"]
