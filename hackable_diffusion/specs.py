"""Named components: the one resolver of tasks, data generators, loss terms, acceptance rules, attention structures.

A config names a component by a string, resolved by `resolve(kind, name, ...)` in this order:

1. a built-in name: the caller's fixed table of the project's own components (an immutable mapping, e.g.
   `tasks.BUILTIN_TASKS`); nothing can be added to it at run time;
2. an installed plugin: an entry point named `name` in the group `hackable_diffusion.<kind>` (`KINDS`), declared
   by an installed package (`[project.entry-points."hackable_diffusion.tasks"] my_task = "pkg.mod:factory"`);
3. 'package.module:attribute', imported with `importlib` - arbitrary code, so accepted only from a trusted source
   (or when it is a built-in's own spec, or - for an attention structure, called with the model config only - a
   function of the project's task packages).

Trust is decided where a config enters the process, not at each use: a config `.py` file the user passes runs
code by design and is trusted, and so is a config built in Python; a run's `config.json` and a checkpoint folder
may have been copied from anywhere and are checked by `check_untrusted` when read (`runs.config_files.
config_from_json`): a 'module:attribute' there is refused with one line naming the key, the value and the opt-in
(`--trust_remote_code`, `trust_remote_code=True`). A built-in or installed-plugin name is always accepted.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import ConfigError

# kind -> what it names; the entry-point group of a kind is f"hackable_diffusion.{kind}"
KINDS: Mapping[str, str] = {
    "tasks": "a task or data generator (eval.task, data.generator)",
    "loss_terms": "a loss term (diffusion.loss_variant)",
    "acceptance_rules": "an acceptance rule (eval.sampling.acceptance)",
    "attention_structures": "an attention structure (model.overrides.attention_structure)",
}
TRUST_HINT = "pass --trust_remote_code (Python: trust_remote_code=True) if you trust its source"


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


def _group(kind: str) -> str:
  if kind not in KINDS:
    raise ValueError(f"unknown component kind {kind!r}; expected one of {sorted(KINDS)}")
  return f"hackable_diffusion.{kind}"


def plugins(kind: str) -> dict[str, importlib.metadata.EntryPoint]:
  """The installed plugins of `kind`: entry point name -> entry point (group `hackable_diffusion.<kind>`)."""
  return {ep.name: ep for ep in importlib.metadata.entry_points(group=_group(kind))}


def is_named(kind: str, name: Any, builtins: Mapping[str, Any]) -> bool:
  """Whether `name` is a built-in or installed-plugin name of `kind` (resolving it imports no foreign spec)."""
  return isinstance(name, str) and (name in builtins or name in plugins(kind))


def resolve(kind: str, name: str, *, what: str, builtins: Mapping[str, Any], unknown: str | None = None) -> Any:
  """The object `name` stands for: `builtins[name]` (a 'module:attribute' string there is imported), else the
  installed plugin `name` of `kind`, else the 'package.module:attribute' `name` itself; one-line `ConfigError`
  (starting with `what`, the config key) when it is none of these (`unknown`: that message instead of the
  generic one) or cannot be imported."""
  group = _group(kind)
  if isinstance(name, str) and name in builtins:
    value = builtins[name]
    return import_spec(value, what=what) if isinstance(value, str) else value
  if isinstance(name, str):
    entry = plugins(kind).get(name)
    if entry is not None:
      try:
        return entry.load()
      except Exception as e:  # noqa: BLE001 - a broken plugin is the user's configuration problem, told in one line
        raise ConfigError(f"{what}={name!r}: the installed plugin {entry.value} ({group}) cannot be loaded "
                          f"({type(e).__name__}: {' '.join(str(e).split())})") from None
  if not is_spec(name):
    if unknown is not None:
      raise ConfigError(unknown)
    known = sorted(builtins) + sorted(plugins(kind))
    raise ConfigError(f"{what}={name!r} is unknown: expected one of {known} (built-in or an installed "
                      f"{group} plugin) or 'package.module:attribute'")
  return import_spec(name, what=what)


def builtin_specs(builtins: Mapping[str, Any]) -> set[str]:
  """The 'module:attribute' of every value of a built-in table (a string value is one already)."""
  return {v if isinstance(v, str) else f"{getattr(v, '__module__', '')}:{getattr(v, '__qualname__', '')}"
          for v in builtins.values()}


def check_untrusted(kind: str, value: Any, *, what: str, source: str, builtins: Mapping[str, Any],
                    own_modules: tuple[str, ...] = ()) -> None:
  """A one-line `ConfigError` when `value` (read from the untrusted `source`, e.g. a run's config.json) names code
  to import: a 'package.module:attribute' that is neither a built-in or installed-plugin name of `kind`, nor the
  spelled-out spec of a built-in, nor in a module starting with one of `own_modules` (the project's own code, for
  a kind called without arguments from the config)."""
  if not (isinstance(value, str) and is_spec(value)) or is_named(kind, value, builtins):
    return
  if value in builtin_specs(builtins) or value.partition(":")[0].startswith(own_modules):
    return
  raise ConfigError(f"{what}={value!r} in {source} names code to import, and a run directory or checkpoint "
                    f"folder is not trusted to run code; {TRUST_HINT}")


__all__ = ["KINDS", "TRUST_HINT", "builtin_specs", "check_untrusted", "import_spec", "is_named", "is_spec", "plugins",
           "resolve"]
