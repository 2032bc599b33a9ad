"""Small file helpers shared by every layer: one JSON reader, one JSONL reader, one atomic writer that never writes
through a symbolic link.

Readers turn every problem into a one-line error of the caller's class naming the file (and line); writers
write to a temporary file in the same directory and rename it, so a reader never sees a half-written file and a
killed process never leaves one behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from hackable_diffusion.errors import ConfigError, DataError, UnsafePathError


def read_json(path: str | os.PathLike[str], *, error: type[Exception] = ConfigError, missing: str = "no such file",
              expect: type | None = dict) -> Any:
  """The JSON value in `path`; `error(one line)` when it is missing, not UTF-8, not JSON, or not an `expect`."""
  try:
    with open(path, encoding="utf-8-sig") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise error(f"{path}: {missing}") from None
  except IsADirectoryError:
    raise error(f"{path}: is a directory, expected a JSON file") from None
  except UnicodeDecodeError as e:
    raise error(f"{path}: not valid UTF-8 (byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
  if expect is not None and not isinstance(data, expect):
    raise error(f"{path}: expected a JSON {'object' if expect is dict else expect.__name__}, "
                f"got {type(data).__name__}")
  return data


def iter_jsonl(path: str | os.PathLike[str], *, error: type[Exception] = DataError
               ) -> Iterator[tuple[int, Any, str | None]]:
  """`(line number, value, problem)` for every non-blank line of a JSONL file.

  `problem` is None for a line that parses, else a short description ('not valid UTF-8 (byte 3: ...)',
  'invalid JSON (...)') and `value` is None; the caller decides whether to skip or raise. A UTF-8 byte-order mark
  on the first line is ignored. A missing path or a directory raises `error` at once.
  """
  if not os.path.exists(path):
    raise error(f"{path}: data file not found")
  if os.path.isdir(path):
    raise error(f"{path}: is a directory, expected a JSONL file")
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        yield lineno, None, f"not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
        continue
      if lineno == 1 and line.startswith("\ufeff"):
        line = line[1:]
      try:
        yield lineno, json.loads(line), None
      except json.JSONDecodeError as e:
        yield lineno, None, f"invalid JSON ({e.msg} at column {e.colno})"


def check_not_link(path: str | os.PathLike[str]) -> str:
  """`path` (as a str) unless it is a symbolic link: then a one-line `UnsafePathError`. The project never creates
  links in a workdir or an export folder, so one there was put by someone else, and writing through it would
  change the file it points to."""
  path = os.fspath(path)
  if os.path.islink(path):
    raise UnsafePathError(f"{path} is a symbolic link (to {os.readlink(path)}); refusing to write through it - "
                          "remove the link")
  return path


def open_new(path: str | os.PathLike[str], mode: str = "wb", *, perms: int = 0o666, **kwargs: Any):
  """`open(path, mode)` of a file created here: `O_CREAT | O_EXCL | O_NOFOLLOW`, so an existing file or link at
  `path` is never followed or overwritten (`FileExistsError`); permissions `perms` less the umask."""
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
  fd = os.open(path, flags, perms)
  try:
    return os.fdopen(fd, mode, **kwargs)
  except BaseException:
    try:  # not yet owned by a file object (which would have closed it already)
      os.close(fd)
    except OSError:
      pass
    raise


def umask() -> int:
  """The process's umask (read by setting it and setting it back)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def make_readable(path: str | os.PathLike[str]) -> None:
  """Gives a file written by a library that creates it private (0600) the usual permissions: 0666 less the
  umask (0644 under the common umask 022), as `open` would."""
  os.chmod(path, 0o666 & ~umask())


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> str:
  """Writes `data` to `path` through a temporary file and a rename; returns the path.

  The temporary file is created afresh (`open_new`: never through a link); a symbolic link at `path` is refused
  (`check_not_link`, one-line `UnsafePathError`). The file gets the usual permissions (0666 less the umask).
  """
  path = check_not_link(path)
  tmp = f"{path}.tmp-{os.getpid()}"
  if os.path.lexists(tmp):  # left by a killed process of the same pid (or planted): removed, never followed
    os.remove(tmp)
  mode, kwargs = ("wb", {}) if isinstance(data, bytes) else ("w", {"encoding": "utf-8"})
  try:
    with open_new(tmp, mode, **kwargs) as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.lexists(tmp):
      os.remove(tmp)
    raise
  return path


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2, sort_keys: bool = True,
               default: Any = None) -> str:
  """`write_atomic` of `data` as JSON (with a final newline); returns the path."""
  return write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + "\n")


__all__ = ["check_not_link", "iter_jsonl", "make_readable", "open_new", "read_json", "umask", "write_atomic",
           "write_json"]
