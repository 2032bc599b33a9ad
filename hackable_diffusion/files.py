"""Small file helpers shared by every layer: one JSON reader, one JSONL reader (streaming, with byte offsets to read a
line again), and writers that never write through a symbolic link.

Readers turn every problem into a one-line error of the caller's class naming the file (and line); `write_atomic`
(and `write_json`, `write_figure`) write to a temporary file in the same directory and rename it, so a reader never
sees a half-written file and a killed process never leaves one behind. `open_new` (a file created here),
`open_append` and `makedirs_no_link` refuse a link they did not create with a one-line `UnsafePathError`.
Permissions are 0666 less the umask, which `umask()` reads without setting it (thread-safe).
"""

from __future__ import annotations

import errno
import io
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
  for lineno, _, value, problem in iter_jsonl_at(path, error=error):
    yield lineno, value, problem


def iter_jsonl_at(path: str | os.PathLike[str], *, error: type[Exception] = DataError
                  ) -> Iterator[tuple[int, int, Any, str | None]]:
  """`iter_jsonl` with each line's byte offset: `(line number, offset, value, problem)`; one line at a time is in
  memory, and `read_jsonl_line(path, offset)` parses that line again later (an index of offsets, not records)."""
  if not os.path.exists(path):
    raise error(f"{path}: data file not found")
  if os.path.isdir(path):
    raise error(f"{path}: is a directory, expected a JSONL file")
  with open(path, "rb") as f:
    offset = 0
    for lineno, raw in enumerate(f, start=1):
      start, offset = offset, offset + len(raw)
      if raw.strip():
        yield (lineno, start, *_parse_line(raw, first=lineno == 1))


def read_jsonl_line(path: str | os.PathLike[str], offset: int) -> tuple[Any, str | None]:
  """`(value, problem)` of the JSONL line starting at byte `offset` of `path` (as `iter_jsonl_at` gave it)."""
  with open(path, "rb") as f:
    f.seek(offset)
    return _parse_line(f.readline(), first=offset == 0)


def _parse_line(raw: bytes, *, first: bool) -> tuple[Any, str | None]:
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return None, f"not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
  if first and line.startswith("\ufeff"):
    line = line[1:]
  try:
    return json.loads(line), None
  except json.JSONDecodeError as e:
    return None, f"invalid JSON ({e.msg} at column {e.colno})"


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


def open_append(path: str | os.PathLike[str], *, encoding: str = "utf-8"):
  """A text file opened for appending (created when missing, 0666 less the umask) that is never a symbolic link:
  `O_NOFOLLOW`, so a link planted at `path` is a one-line `UnsafePathError` and its target is left unchanged."""
  flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
  try:
    fd = os.open(path, flags, 0o666)
  except OSError as e:
    if e.errno == errno.ELOOP or os.path.islink(path):
      check_not_link(path)
    raise
  try:
    return os.fdopen(fd, "a", encoding=encoding)
  except BaseException:
    os.close(fd)
    raise


def makedirs_no_link(path: str | os.PathLike[str]) -> str:
  """`os.makedirs(path, exist_ok=True)` that refuses (one-line `UnsafePathError`) when `path` is a symbolic link:
  files written under a linked directory would land wherever it points."""
  path = check_not_link(path)
  os.makedirs(path, exist_ok=True)
  return path


def write_figure(fig: Any, path: str | os.PathLike[str], **savefig_kwargs: Any) -> str:
  """Saves a matplotlib figure as `write_atomic` does (rendered in memory, never through a link); the format
  follows the file's extension."""
  buf = io.BytesIO()
  fmt = os.path.splitext(os.fspath(path))[1].lstrip(".") or "png"
  fig.savefig(buf, format=fmt, **savefig_kwargs)
  return write_atomic(path, buf.getvalue())


def _umask_from_proc() -> int | None:
  """The calling process's umask from `/proc/self/status` (Linux 4.7+), or None where that is not available."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  return None


def _umask_by_setting() -> int:
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


# read once at import (single-threaded then) for systems without /proc: setting the umask to read it is a
# process-wide change another thread creating a file at that moment would see
_UMASK_AT_IMPORT = _umask_from_proc()
if _UMASK_AT_IMPORT is None:
  _UMASK_AT_IMPORT = _umask_by_setting()


def umask() -> int:
  """The process's umask, read without changing it (thread-safe): `/proc/self/status`, else the value at import."""
  mask = _umask_from_proc()
  return _UMASK_AT_IMPORT if mask is None else mask


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


__all__ = ["check_not_link", "iter_jsonl", "iter_jsonl_at", "make_readable", "makedirs_no_link", "open_append",
           "open_new", "read_json", "read_jsonl_line", "umask", "write_atomic", "write_figure", "write_json"]
