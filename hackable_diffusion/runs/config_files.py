"""Config files: finding, running and overriding `configs/*.py`, and the `config.json` a run writes.

`load_config_file(path, overrides)` runs a config file's `get_config()` (a broken file is a one-line `FILE:LINE`
error), `apply_overrides` sets `{'a.b': value}` keys (unknown keys listed), `config_from_json` / `write_config_json`
read and write a run's resolved config. The typed sections built from a loaded config are in `runs.config`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from hackable_diffusion import specs
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.files import read_json, write_json

CONFIG_FILENAME = "config.json"
# the shipped config files: package data (found by bare name from any directory after a plain install); the
# repository's top-level configs/ is a link to this folder
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


# ---- loading, overrides, serialisation -------------------------------------------------------------------------
def config_to_dict(config: ml_collections.ConfigDict | Mapping[str, Any]) -> dict[str, Any]:
  """A plain, JSON-friendly dict (nested ConfigDicts -> dicts, tuples kept)."""
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  return {k: (config_to_dict(v) if isinstance(v, (Mapping, ml_collections.ConfigDict)) else v)
          for k, v in config.items()}


def resolve_config_path(path: str) -> str:
  """A config file path: as given if it exists, else looked up in the cwd's `configs/`, then in the shipped configs
  (package data, `CONFIGS_DIR`); `configs/NAME` works from any directory."""
  if not path:
    raise ConfigError("--config is empty; pass a config file, e.g. --config=configs/tiny.py")
  file, sep, arg = path.partition(":")
  candidates = [file]
  if not os.path.isabs(file):
    name = file[len("configs/"):] if file.startswith("configs/") else file
    for root in (os.path.join(os.getcwd(), "configs"), CONFIGS_DIR):
      candidates += [os.path.join(root, name), os.path.join(root, name + ".py")]
  for c in candidates:
    if os.path.isfile(c):
      return c + sep + arg
  available = sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".py")) if os.path.isdir(CONFIGS_DIR) else []
  raise ConfigError(f"config file {file!r} not found (also looked in ./configs/ and the shipped configs); "
                    f"available: {available}")


def load_config_file(path: str, overrides: Mapping[str, Any] | None = None, *,
                     require_config_dict: bool = False) -> ml_collections.ConfigDict:
  """Runs `get_config()` of a config file (bare names resolve into configs/) and applies `{'a.b': value}`.

  `get_config()` may return a dict (converted here) unless `require_config_dict` (the CLIs: absl's config flags
  need a `ConfigDict`), where anything else is a one-line `ConfigError`.

  A broken file is a one-line ConfigError naming the file and line (`FILE:LINE: SyntaxError: ...`): the source is
  compiled here first, so a syntax error never reaches absl / ml_collections, and an exception raised while the
  file runs or in `get_config()` is reported at the file's own line.
  """
  resolved = resolve_config_path(path)
  file, _, arg = resolved.partition(":")
  module = _exec_config_file(file)
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"{file}: defines no get_config(); a config file returns its ConfigDict from get_config()")
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:  # noqa: BLE001 - a broken config file: say where, in one line
    raise config_file_error(file, e) from e
  if not isinstance(config, ml_collections.ConfigDict) and require_config_dict:
    raise ConfigError(f"{file}: get_config() returned a {type(config).__name__}, not an ml_collections.ConfigDict "
                      "(return ml_collections.ConfigDict(...))")
  if not isinstance(config, ml_collections.ConfigDict):
    try:
      config = ml_collections.ConfigDict(config)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{file}: get_config() returned a {type(config).__name__}, not a ConfigDict or dict "
                        f"({' '.join(str(e).split())})") from None
  config.lock()
  if overrides:
    apply_overrides(config, overrides)
  return config


def check_config_source(file: str) -> Any:
  """Compiles a config file (no code runs); returns the code object or raises `FILE:LINE: SyntaxError: ...`."""
  try:
    with open(file, "rb") as f:
      source = f.read()
  except OSError as e:
    raise ConfigError(f"{file}: cannot read the config file ({e.strerror or type(e).__name__})") from None
  try:
    return compile(source, file, "exec", dont_inherit=True)
  except (SyntaxError, ValueError) as e:  # ValueError: null bytes in the source
    raise config_file_error(file, e) from e


def config_file_error(file: str, e: BaseException) -> ConfigError:
  """One line `FILE:LINE: ExcType: message` for an exception raised compiling or running a config file."""
  line = e.lineno if isinstance(e, SyntaxError) else None
  if line is None:  # the innermost frame in the config file itself
    target = os.path.abspath(file)
    line = next((fr.lineno for fr in reversed(traceback.extract_tb(e.__traceback__))
                 if os.path.abspath(fr.filename) == target), None)
  message = " ".join(str(e.msg if isinstance(e, SyntaxError) else e).split())
  where = f"{file}:{line}" if line else file
  return ConfigError(f"{where}: {type(e).__name__}" + (f": {message}" if message else ""))


def _exec_config_file(file: str) -> Any:
  """The config file run as a module (registered in sys.modules: dataclasses defined in it need that)."""
  code = check_config_source(file)
  module_name = "_hd_config_" + re.sub(r"\W", "_", os.path.abspath(file))
  spec = importlib.util.spec_from_file_location(module_name, file)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module
  try:
    exec(code, module.__dict__)  # noqa: S102 - running the user's config file is the point
  except Exception as e:  # noqa: BLE001 - a broken config file: say where, in one line
    sys.modules.pop(module_name, None)
    raise config_file_error(file, e) from e
  return module


# config keys (at any depth: eval.ablations may repeat them) naming a component -> its kind (`specs.KINDS`)
CODE_KEYS: Mapping[str, str] = {"task": "tasks", "generator": "tasks", "loss_variant": "loss_terms",
                                "acceptance": "acceptance_rules", "attention_structure": "attention_structures"}


# An attention structure is called with the model config only (no arguments from the config): one defined in the
# project's own task packages is accepted from a run's config.json as a built-in would be.
OWN_STRUCTURE_MODULES = ("hackable_diffusion.tasks.",)


def _builtins(kind: str) -> Mapping[str, Any]:
  """The built-in names of `kind` (imported on use: the tables live with their components)."""
  if kind == "tasks":
    from hackable_diffusion.tasks.base import BUILTIN_TASKS
    return BUILTIN_TASKS
  if kind == "loss_terms":
    from hackable_diffusion.diffusion.loss import LOSS_TERMS
    return LOSS_TERMS
  if kind == "acceptance_rules":
    from hackable_diffusion.sampling.rules import BUILTIN_RULES
    return BUILTIN_RULES
  from hackable_diffusion.model.structure import BUILTIN_STRUCTURES
  return BUILTIN_STRUCTURES


def check_untrusted_config(data: Mapping[str, Any], source: str) -> None:
  """A one-line `ConfigError` when the config `data` read from `source` (a run's config.json, not trusted to run
  code) names a component by 'package.module:attribute' rather than by a built-in or installed-plugin name
  (`specs.check_untrusted`)."""

  def walk(node: Any, prefix: str) -> None:
    if not isinstance(node, Mapping):
      return
    for key, value in node.items():
      if isinstance(value, Mapping):
        walk(value, f"{prefix}{key}.")
      elif key in CODE_KEYS:
        kind = CODE_KEYS[key]
        specs.check_untrusted(kind, value, what=f"{prefix}{key}", source=source, builtins=_builtins(kind),
                              own_modules=OWN_STRUCTURE_MODULES if kind == "attention_structures" else ())

  walk(data, "")


def config_from_json(path: str, *, trust_remote_code: bool = False) -> ml_collections.ConfigDict:
  """The `config.json` a run wrote (lists become tuples again, so CLI overrides of them keep working).

  A run directory may come from anywhere: unless `trust_remote_code`, a component named by 'module:attribute'
  (rather than a built-in or installed-plugin name) is refused in one line (`check_untrusted_config`).
  """
  data = read_json(path, missing="no such file (is this a workdir written by hackable_diffusion.train?)")
  if not trust_remote_code:
    check_untrusted_config(data, path)

  def fix(v):
    if isinstance(v, dict):
      return {k: fix(x) for k, x in v.items()}
    return tuple(fix(x) for x in v) if isinstance(v, list) else v

  config = ml_collections.ConfigDict(fix(resolve_data_paths(data, os.path.dirname(os.path.abspath(path)))))
  config.lock()
  return config


def resolve_data_paths(data: dict[str, Any], workdir: str) -> dict[str, Any]:
  """A run's config with a relative `data.train_path` / `data.validation_path` that names no file from the
  current directory but one in `workdir` made to name that one: a path relative to the workdir (runs store
  absolute paths; one written by hand or by an older run may be relative)."""
  section = data.get("data")
  if not isinstance(section, dict):
    return data
  section = dict(section)
  for key in ("train_path", "validation_path"):
    value = section.get(key)
    if isinstance(value, str) and value and not os.path.isabs(value) and not os.path.exists(value):
      inside = os.path.join(workdir, value)
      if os.path.exists(inside):
        section[key] = inside
  return {**data, "data": section}


def check_override_keys(config: ml_collections.ConfigDict, keys: Sequence[str], prefix: str = "config") -> None:
  """Raises a one-line ConfigError for the first `a.b.c` key that is not in `config`, listing the valid ones."""
  for key in keys:
    node: Any = config
    parts = key.split(".")
    for i, part in enumerate(parts):
      if isinstance(node, (ml_collections.ConfigDict, Mapping)) and part in node:
        node = node[part]
        continue
      where = ".".join(parts[:i]) or "<top level>"
      if isinstance(node, (ml_collections.ConfigDict, Mapping)):
        valid = ", ".join(sorted(node.keys()))
        raise ConfigError(f"unknown config key --{prefix}.{key}: {where} has no {part!r}; valid keys: {valid}")
      raise ConfigError(f"unknown config key --{prefix}.{key}: {where} is a value, not a section")


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
  """Sets `{'a.b': value}` in a (locked) config; unknown keys raise a one-line ConfigError."""
  check_override_keys(config, list(overrides))
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    with node.unlocked():
      node[leaf] = value


def write_config_json(config: ml_collections.ConfigDict | Mapping[str, Any], workdir: str) -> str:
  """Writes the resolved config as `workdir/config.json` (atomically); returns the path."""
  os.makedirs(workdir, exist_ok=True)
  return write_json(os.path.join(workdir, CONFIG_FILENAME), config_to_dict(config), default=str)


__all__ = ["CODE_KEYS", "CONFIGS_DIR", "CONFIG_FILENAME", "OWN_STRUCTURE_MODULES", "apply_overrides",
           "check_config_source", "check_override_keys", "check_untrusted_config", "config_file_error",
           "config_from_json", "config_to_dict", "load_config_file", "resolve_config_path", "resolve_data_paths",
           "write_config_json"]
