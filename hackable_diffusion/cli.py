"""Command-line plumbing shared by the CLIs (`train`, `evaluate`, `sample`, `export`).

`--config=FILE` is an ml_collections config file (absl `config_flags`); a bare name (`--config=tiny.py`) is looked
up in configs/. `make_flags_parser` resolves it and checks every `--config.a.b=...` key before absl sees them (an
unknown key is a one-line error listing the valid ones); `run` turns the project's user-facing errors
(`hackable_diffusion.errors`) into one line on stderr and exit code 1.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from hackable_diffusion.errors import USER_ERRORS, ConfigError
from hackable_diffusion.training import config as config_lib

_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


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
  are checked against it. Returns the rewritten argv; raises ConfigError (one line).
  """
  argv = list(argv)
  idx, value = flag_value(argv, name)
  keys = override_keys(argv, name)
  if idx < 0:
    if keys and default_config is None:
      raise ConfigError(f"--{name}.{keys[0]} given without --{name}=FILE")
    if keys:
      config_lib.check_override_keys(default_config, keys, prefix=name)
    return argv
  if value is None:
    raise ConfigError(f"--{name} needs a value, e.g. --{name}=configs/tiny.py")
  resolved = config_lib.resolve_config_path(value)
  if "=" in argv[idx]:
    argv[idx] = f"--{name}={resolved}"
  else:
    argv[idx + 1] = resolved
  if keys:
    config_lib.check_override_keys(config_lib.load_config_file(resolved), keys, prefix=name)
  return argv


def workdir_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run wrote (`workdir/config.json`)."""
  path = os.path.join(workdir, config_lib.CONFIG_FILENAME)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such file; pass --config=FILE or a --workdir written by hackable_diffusion.train")
  return config_lib.config_from_json(path)


def run_cli(main: Callable[[list[str]], Any], *, flags_parser: Callable[[list[str]], Any] | None = None) -> None:
  """`absl.app.run(main)` with the project's input errors printed as one line (`error: ...`) and exit code 1."""
  def wrapped(argv):
    if not flags_were_set("verbosity", "v"):
      logging.set_verbosity(logging.WARNING)  # library INFO chatter off unless asked for (-v 0)
    try:
      return main(argv)
    except USER_ERRORS as e:
      _fail(e)

  def parser(argv):
    try:
      return flags_parser(argv) if flags_parser else _default_parse(argv)
    except USER_ERRORS as e:
      _fail(e)
    except SystemExit:
      if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
        sys.exit(0)  # absl exits with 1 after printing help; asking for help is not an error
      raise

  app.run(wrapped, flags_parser=parser)


def flags_were_set(*names: str) -> bool:
  return any(name in flags.FLAGS and flags.FLAGS[name].present for name in names)


def _default_parse(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise ConfigError(str(e).splitlines()[0]) from None


def _fail(e: BaseException) -> None:
  msg = " ".join(str(e).split()) or type(e).__name__
  if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
    msg = f"{msg}: {e.filename}"
  sys.stderr.write(f"error: {msg}\n")
  sys.stderr.flush()
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
        default = workdir_config(workdir)
    argv = prepare_argv(argv, name=name, default_config=default)
    if name not in flags.FLAGS:
      if default is not None:
        config_flags.DEFINE_config_dict(name, default, "The run's config (default: <workdir>/config.json); "
                                        "override keys with --config.section.key=value.")
      else:
        config_flags.DEFINE_config_file(name, None, CONFIG_HELP)
      flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])  # listed by --help of the CLI
    sys.argv[:] = argv  # config_flags finds the override flags in sys.argv
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      raise ConfigError(str(e).splitlines()[0]) from None
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an override config_flags could not apply
      raise ConfigError(f"bad --{name} override: {' '.join(str(e).split())}") from None

  return parse


__all__ = ["CONFIG_HELP", "flag_value", "flags_were_set", "make_flags_parser", "override_keys", "prepare_argv",
           "run_cli", "workdir_config"]
