"""Command-line plumbing shared by the CLIs (`train`, `evaluate`, `sample`, `export`).

`--config=FILE` is an ml_collections config file (absl `config_flags`); a bare name (`--config=tiny.py`) is looked
up in configs/. `make_flags_parser` resolves it, loads it once itself (a syntax error, an exception while it runs or
a missing `get_config` is a one-line `FILE:LINE: ...` error instead of absl's traceback) and checks every
`--config.a.b=...` key before absl sees them (an unknown key is a one-line error listing the valid ones;
`--config.model.overrides.FIELD=VALUE` may add any ModelConfig field the file does not list);
`run_cli` turns the project's user-facing errors (`hackable_diffusion.errors`) into one line on stderr and exit
code 1, followed by the traceback with `--verbose` (a flag every CLI has).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from hackable_diffusion.errors import USER_ERRORS, ConfigError
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.runs import config as config_lib

_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")
VERBOSE_FLAG = "verbose"
VERBOSE_HELP = "On an error, print its traceback after the one-line message."

TRUST_FLAG = "trust_remote_code"
TRUST_HELP = ("Let a run directory's config.json (or a run named by model.checkpoint) name components by "
              "'package.module:attribute', i.e. import and run that code. Off: only built-in and installed-plugin "
              "names are accepted from it; config files given with --config are always trusted.")

# JAX reserves this fraction of a GPU's memory when its backend starts (read from the environment then; no effect
# on a CPU or TPU). Its own default, 0.75, leaves a quarter of the card to nobody: the CLIs ask for more.
GPU_MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GPU_MEMORY_FRACTION = "0.95"
GPU_MEMORY_HELP = (f"GPU memory: JAX reserves {GPU_MEMORY_FRACTION_ENV} of the card when it starts; the CLIs set "
                   f"{GPU_MEMORY_FRACTION} unless it is set already (JAX's default 0.75 leaves 20 GB of an 80 GB card "
                   f"unused). Set the variable to choose another fraction; no effect on a CPU or TPU.")


def set_gpu_memory_fraction(environ: Any = os.environ) -> str:
  """Sets `GPU_MEMORY_FRACTION_ENV` to `GPU_MEMORY_FRACTION` unless the user set it; returns the value in force.
  Must run before JAX starts its GPU backend (the CLIs call it first)."""
  return environ.setdefault(GPU_MEMORY_FRACTION_ENV, GPU_MEMORY_FRACTION)


if VERBOSE_FLAG not in flags.FLAGS:  # defined once for every CLI (all of them import this module)
  flags.DEFINE_bool(VERBOSE_FLAG, False, VERBOSE_HELP)
if TRUST_FLAG not in flags.FLAGS:
  flags.DEFINE_bool(TRUST_FLAG, False, TRUST_HELP)


def flag_value(argv: Sequence[str], name: str) -> tuple[int, str | None]:
  for i, arg in enumerate(argv):
    m = re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg)
    if m:
      if m.group(1) is not None:
        return i, m.group(2)
      return i, argv[i + 1] if i + 1 < len(argv) else None
  return -1, None


def override_keys(argv: Sequence[str], name: str = "config") -> list[str]:
  """The `a.b` of every `--config.a.b=...` in argv (in order, without duplicates)."""
  keys: list[str] = []
  for arg in argv:
    m = re.match(rf"^--?(no)?{re.escape(name)}\.([^=]+)", arg)
    if m and m.group(2) not in keys:
      keys.append(m.group(2))
  return keys


def prepare_argv(argv: list[str], *, name: str = "config",
                 default_config: ml_collections.ConfigDict | None = None) -> list[str]:
  """Resolves `--config=NAME` into configs/ and checks `--config.a.b` keys before absl parses argv.

  `default_config`: the config used when argv has no `--config` (e.g. a workdir's config.json); override keys
  are checked against it. `--config.model.overrides.FIELD=VALUE` may name any ModelConfig field, also one the
  config file does not list (`split_model_overrides`). Returns the rewritten argv; raises ConfigError (one line).
  """
  return _prepare(argv, name, default_config)[0]


def _prepare(argv: list[str], name: str,
             default_config: ml_collections.ConfigDict | None) -> tuple[list[str], ml_collections.ConfigDict | None]:
  """(prepare_argv's argv, the config the override keys were checked against: None without overrides)."""
  argv = list(argv)
  idx, value = flag_value(argv, name)
  keys = override_keys(argv, name)
  if idx < 0:
    if keys and default_config is None:
      raise ConfigError(f"--{name}.{keys[0]} given without --{name}=FILE")
    if keys:
      _check_keys(default_config, keys, name)
    return argv, default_config
  if value is None:
    raise ConfigError(f"--{name} needs a value, e.g. --{name}=configs/tiny.py")
  resolved = config_lib.resolve_config_path(value)
  if "=" in argv[idx]:
    argv[idx] = f"--{name}={resolved}"
  else:
    argv[idx + 1] = resolved
  # a broken file (or one whose get_config() returns no ConfigDict) fails here in one line, not inside absl
  config = config_lib.load_config_file(resolved, require_config_dict=True)
  if keys:
    _check_keys(config, keys, name)
  return argv, config


_MODEL_OVERRIDES = "model.overrides."


def _new_model_field(config: ml_collections.ConfigDict, key: str) -> str | None:
  """The ModelConfig field `key` ('model.overrides.FIELD') adds to `config`, or None when the config file already
  has the key (or `key` is no model override)."""
  if not key.startswith(_MODEL_OVERRIDES) or "model" not in config:
    return None
  field = key[len(_MODEL_OVERRIDES):]
  present = config.model.get("overrides") or {}
  return None if field in present else field


def _check_keys(config: ml_collections.ConfigDict, keys: list[str], name: str) -> None:
  fields = sorted(f.name for f in dataclasses.fields(ModelConfig))
  for key in keys:
    field = _new_model_field(config, key)
    if field is not None and field not in fields:
      raise ConfigError(f"unknown config key --{name}.{key}: {field!r} is not a ModelConfig field; valid keys: "
                        f"{', '.join(fields)}")
  config_lib.check_override_keys(config, [k for k in keys if _new_model_field(config, k) is None], prefix=name)


def _parse_value(text: str) -> Any:
  """A command-line value as a Python literal (`8`, `0.5`, `(1, 2)`, `True`/`true`), else the string itself."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError):  # TypeError: e.g. `{[1]: 2}` (an unhashable key)
    return text


def split_model_overrides(argv: list[str], config: ml_collections.ConfigDict | None,
                          name: str = "config") -> tuple[list[str], dict[str, Any]]:
  """(argv without the `--config.model.overrides.FIELD=VALUE` flags naming fields `config` lacks, {FIELD: value}).

  absl's config flags only override keys a config file defines; these are set after it parsed the rest."""
  rest, fields = [], {}
  for arg in argv:
    m = re.match(rf"^--?(no)?{re.escape(name)}\.([^=]+)(=(.*))?$", arg)
    field = _new_model_field(config, m.group(2)) if (m and config is not None) else None
    if field is None:
      rest.append(arg)
    elif m.group(1):  # --noconfig.model.overrides.FIELD
      fields[field] = False
    elif m.group(3) is None:
      raise ConfigError(f"--{name}.{m.group(2)} needs a value: --{name}.{m.group(2)}=VALUE")
    else:
      fields[field] = _parse_value(m.group(4))
  return rest, fields


def set_model_overrides(config: ml_collections.ConfigDict, fields: dict[str, Any]) -> None:
  """Adds `fields` to `config.model.overrides` (created if the file has none)."""
  if not fields:
    return
  with config.unlocked():
    if config.model.get("overrides") is None:
      config.model.overrides = ml_collections.ConfigDict()
    with config.model.overrides.unlocked():
      for field, value in fields.items():
        config.model.overrides[field] = value


def workdir_config(workdir: str, *, trust_remote_code: bool = False) -> ml_collections.ConfigDict:
  """The resolved config a run wrote (`workdir/config.json`); a component it names by 'module:attribute' is
  refused in one line unless `trust_remote_code` (`--trust_remote_code`; see `specs`)."""
  path = os.path.join(workdir, config_lib.CONFIG_FILENAME)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such file; pass --config=FILE or a --workdir written by hackable_diffusion.train")
  return config_lib.config_from_json(path, trust_remote_code=trust_remote_code)


def trust_requested(argv: Sequence[str] | None = None) -> bool:
  """Whether `--trust_remote_code` is on (the parsed flag, or with `argv` its last form there)."""
  return _bool_flag(TRUST_FLAG, argv)


def run_cli(main: Callable[[list[str]], Any], *, flags_parser: Callable[[list[str]], Any] | None = None,
            joins_job: bool = False) -> None:
  """`absl.app.run(main)` with the project's input errors printed as one line (`error: ...`) and exit code 1.

  With `--verbose` the traceback follows the line. Errors while parsing the command line (a broken config file,
  an unknown key) are caught the same way, `--verbose` then read from argv itself. `joins_job`: the CLI joins a
  multi-process job when the environment configures one (train, evaluate); an input error before it joined is
  told to the other processes first (`sharding.tell_job_and_leave`), so they stop too. On a GPU JAX may reserve
  0.95 of its memory (`set_gpu_memory_fraction`, unless the environment says otherwise).
  """
  set_gpu_memory_fraction()

  def stop(e: BaseException, verbose: bool) -> None:
    if not (joins_job and os.environ.get("JAX_COORDINATOR_ADDRESS")):  # no job the environment configures
      fail(e, verbose=verbose)
    # the line first: joining waits for every process of the job, and one that was never started means a wait
    # until JAX's initialization timeout aborts this process too
    fail(e, verbose=verbose, exit_=False)
    from hackable_diffusion import sharding  # local: imports jax, which a plain error line does not need

    sharding.tell_job_and_leave(e)
    sys.exit(1)

  for name in (VERBOSE_FLAG, TRUST_FLAG):  # listed by the CLI's --help
    if name in flags.FLAGS:
      flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])

  def wrapped(argv):
    if not flags_were_set("verbosity", "v"):
      logging.set_verbosity(logging.WARNING)  # library INFO chatter off unless asked for (-v 0)
    try:
      return main(argv)
    except USER_ERRORS as e:
      stop(e, verbose_requested())

  def parser(argv):
    try:
      return flags_parser(argv) if flags_parser else _default_parse(argv)
    except USER_ERRORS as e:
      stop(e, verbose_requested(argv))
    except SystemExit:
      if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
        sys.exit(0)  # absl exits with 1 after printing help; asking for help is not an error
      raise

  app.run(wrapped, flags_parser=parser)


def verbose_requested(argv: Sequence[str] | None = None) -> bool:
  """Whether `--verbose` is on: the parsed flag, or (`argv` given: before or after a failed parse) its last form
  in `argv` (`--verbose`, `--verbose=true`, `--noverbose`)."""
  return _bool_flag(VERBOSE_FLAG, argv)


def _bool_flag(name: str, argv: Sequence[str] | None) -> bool:
  if argv is None:
    return name in flags.FLAGS and flags.FLAGS.is_parsed() and bool(flags.FLAGS[name].value)
  value = False
  for arg in argv[1:]:
    if arg == "--":
      break
    m = re.match(rf"^--?(no)?{name}(=(.*))?$", arg)
    if m:
      value = not m.group(1) and (m.group(3) is None or m.group(3).lower() in ("1", "true", "t", "yes", "y"))
  return value


def flags_were_set(*names: str) -> bool:
  return any(name in flags.FLAGS and flags.FLAGS[name].present for name in names)


def _default_parse(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None


def error_line(e: BaseException) -> str:
  """The one line a CLI prints for a user-facing error: `error: message` (whitespace folded)."""
  msg = " ".join(str(e).split()) or type(e).__name__
  if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
    msg = f"{msg}: {e.filename}"
  return f"error: {msg}"


def fail(e: BaseException, *, verbose: bool = False, exit_: bool = True) -> None:
  """Prints `error_line(e)` (then, if `verbose`, the traceback) to stderr and exits with code 1 (`exit_=False`:
  returns after printing)."""
  sys.stderr.write(error_line(e) + "\n")
  if verbose:
    sys.stderr.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
  sys.stderr.flush()
  if exit_:
    sys.exit(1)


CONFIG_HELP = "Experiment config file (configs/*.py); override any key with --config.section.key=value."


def make_flags_parser(*, name: str = "config", workdir_default: bool = False):
  """An absl `flags_parser`: resolves `--config`, checks override keys, then parses with absl.

  If the `--config` flag is not defined yet it is defined here: from the file given on the command line or,
  with `workdir_default` and no `--config`, from `--workdir`'s config.json (`config_flags.DEFINE_config_dict`),
  so CLI overrides work in both cases. sys.argv is rewritten too (config_flags reads the overrides there).
  """
  def parse(argv: list[str]) -> list[str]:
    default = None
    if workdir_default and flag_value(argv, name)[0] < 0:
      _, workdir = flag_value(argv, "workdir")
      if workdir:
        default = workdir_config(workdir, trust_remote_code=trust_requested(argv))
    argv, config = _prepare(argv, name, default)
    argv, model_fields = split_model_overrides(argv, config, name)
    if name not in flags.FLAGS:
      if default is not None:
        config_flags.DEFINE_config_dict(name, default, "The run's config (default: <workdir>/config.json); "
                                        "override keys with --config.section.key=value.")
      else:
        config_flags.DEFINE_config_file(name, None, CONFIG_HELP)
      flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])  # listed by --help of the CLI
    sys.argv[:] = argv  # config_flags finds the override flags in sys.argv
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      raise ConfigError(str(e).splitlines()[0]) from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an override config_flags could not apply
      raise ConfigError(f"bad --{name} override: {' '.join(str(e).split())}") from None
    set_model_overrides(flags.FLAGS[name].value, model_fields)
    return rest

  return parse


__all__ = ["CONFIG_HELP", "GPU_MEMORY_FRACTION", "GPU_MEMORY_FRACTION_ENV", "GPU_MEMORY_HELP", "TRUST_FLAG",
           "VERBOSE_FLAG", "error_line", "fail", "flag_value", "flags_were_set", "make_flags_parser", "override_keys",
           "prepare_argv", "run_cli", "set_gpu_memory_fraction", "set_model_overrides", "split_model_overrides",
           "trust_requested", "verbose_requested", "workdir_config"]
