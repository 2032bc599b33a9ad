"""A run's workdir before training starts: preflight checks, the workdir lock, resume compatibility, config.json.

`open_workdir(cfg, workdir)` is what the trainer runs before it writes anything into its workdir:

1. Preflight (every process): the data files of every split exist (`data.train_path`, `data.validation_path`
   when set; a `data.generator` writes its own files and is skipped), the workdir can be created and written
   (a probe file is created and removed), and none of the files a run writes there is a symbolic link
   (`check_no_links`: writing would change the file it points to; the lock file is opened with O_NOFOLLOW).
   Each failure is one line naming the path and the reason (read-only file system, permission denied, a file
   where a directory should be, a link).
2. The workdir lock (process 0 only): an exclusive `fcntl.flock` on `workdir/.lock`, which holds
   `{"pid", "host", "started"}` of its owner. A second run on the same workdir gets a one-line `TrainingError`
   naming the owner's pid and host. The kernel drops a flock when its process dies (even on SIGKILL), so a lock
   left behind by a killed run never blocks: the next run takes it over with a warning. `release()` (the
   trainer's `close()`) deletes the file, so a cleanly finished run leaves no `.lock` behind. A second open
   trainer in the same process is refused too (close the first). Where the file system has no flock (some FUSE
   or old NFS mounts) the run goes on unlocked with a warning; other processes of a multi-host job take no lock,
   but every process learns of process 0's refusal (below) and stops with it.
3. Resume compatibility (every process): when `workdir/checkpoints` holds a checkpoint, the resolved config
   about to be written (`cfg.raw`) is compared with the stored `workdir/config.json`. Changes to the sections
   that define the train state's shapes and structure, or what its tokens mean (`REFUSED_SECTIONS`: model,
   tokenizer, lora; in the optimizer section only turning gradient clipping on or off, which changes the
   optimizer state's structure) are refused with one line `key: old -> new`; every other change (train.steps,
   train.batch_size, eval.*, data.*, mesh.*, diffusion.*, the learning rate and its schedule - e.g. a longer
   `optimizer.decay_steps` to extend a run - the values change from the resume step on, the state's shapes do
   not) is resumable and logged as a warning. Without a checkpoint the config may
   change freely. A stored config.json that is not valid JSON is a one-line error (fix or delete it).
4. config.json (process 0, only after 1-3 passed): when the stored config differs, it is first kept as
   `config.prev.json` (one previous version), then the new one is written atomically. Data paths are stored
   absolute, so `evaluate` / `sample` find the data from any directory. A refused rerun therefore
   leaves every file of the workdir byte for byte as it was.

In a multi-process job the processes agree after 1-2 and again after 3-4 (`sharding.stop_together`): when any of
them failed, all raise there, the failing one its own error, the others one line naming it.

`warn_if_low_disk` (called by the trainer once the train state's shapes are known, before the first step) warns
when the workdir's file system has less free space than two checkpoints need, estimated as the bytes of the
train state (parameters, other variables and optimizer state) - orbax's metadata and any compression are
ignored, so it is a rough estimate.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from absl import logging

from hackable_diffusion.errors import ConfigError, DataError, TrainingError, UnsafePathError
from hackable_diffusion.data.chat import CHAT_TEMPLATE_FILENAME
from hackable_diffusion.data.tokenizer_files import (TOKENIZER_CONFIG_FILENAME, TOKENIZER_FILENAME,
                                                     TOKENIZER_JSON_FILENAME)
from hackable_diffusion.files import check_not_link, read_json, write_atomic
from hackable_diffusion.sharding.mesh import is_main_process, stop_together
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs.checkpoints import CHECKPOINT_DIR
from hackable_diffusion.runs.config import ExperimentConfig

LOCK_FILENAME = ".lock"
PREV_CONFIG_FILENAME = "config.prev.json"
# Sections whose change makes a checkpoint not resumable (state shapes / structure, token ids).
REFUSED_SECTIONS = ("model", "tokenizer", "lora")
# optimizer keys whose None-ness decides the optimizer state's structure (clip_by_global_norm in the chain or not)
_STRUCTURAL_OPTIMIZER_KEYS = ("optimizer.clip_norm",)
_UNSET = "<unset>"


# ---- preflight ----------------------------------------------------------------------------------------------------
def _reason(e: OSError) -> str:
  """A short reason for an OSError ('read-only file system', 'permission denied', ...)."""
  if e.errno in (errno.EACCES, errno.EPERM):
    return "permission denied"
  if e.errno == errno.EROFS:
    return "read-only file system"
  if e.errno == errno.ENOSPC:
    return "no space left on device"
  return (e.strerror or type(e).__name__).lower() if e.errno else " ".join(str(e).split())


def _file_in_the_way(path: str) -> str | None:
  """`path` itself or its first ancestor that exists as something other than a directory, or None."""
  probe = os.path.abspath(path)
  while True:
    if os.path.lexists(probe):
      return None if os.path.isdir(probe) else probe
    parent = os.path.dirname(probe)
    if parent == probe:
      return None
    probe = parent


def check_writable_dir(path: str, *, what: str = "workdir", hint: str = "") -> str:
  """Creates directory `path` if needed and checks a file can be created in it (a probe file, removed again).

  Raises a one-line `ConfigError` naming the path and the reason (a file in the way, read-only file system,
  permission denied, ...), followed by `; {hint}` when given. Returns the absolute path.
  """
  path = os.path.abspath(path)
  hint = f"; {hint}" if hint else ""
  blocker = _file_in_the_way(path)
  if blocker is not None:
    where = "is a file" if blocker == path else f"cannot be created: {blocker} is a file"
    raise ConfigError(f"{what} {path} {where}, not a directory{hint}")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"{what} {path} cannot be created: {_reason(e)}{hint}") from None
  probe = os.path.join(path, f".write-test-{socket.gethostname()}-{os.getpid()}")
  try:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"{what} {path} is not writable: {_reason(e)}{hint}") from None
  return path


# the files a run writes at the top of its workdir (besides `.lock`): a symbolic link under one of these names was
# not made by the project and is refused before anything is written (metrics.jsonl: `training.logging`)
WRITTEN_FILES = (config_lib.CONFIG_FILENAME, PREV_CONFIG_FILENAME, "metrics.jsonl", "metrics.jsonl.tmp",
                 TOKENIZER_FILENAME, TOKENIZER_JSON_FILENAME, TOKENIZER_CONFIG_FILENAME, CHAT_TEMPLATE_FILENAME)


def check_no_links(workdir: str) -> None:
  """A one-line `UnsafePathError` when one of `WRITTEN_FILES` in `workdir` is a symbolic link (writing it would
  change the file the link points to)."""
  for name in WRITTEN_FILES:
    check_not_link(os.path.join(workdir, name))


def check_data_paths(cfg: ExperimentConfig) -> None:
  """One-line `DataError` when a configured data file (train, validation when set) does not exist (with
  `data.generator` too: a path given replaces the generated split; the generated files are not checked here).
  """
  for key, path in (("train_path", cfg.data.train_path), ("validation_path", cfg.data.validation_path)):
    if not path:
      continue
    if not os.path.exists(path):
      raise DataError(f"data.{key}={path}: data file not found")
    if os.path.isdir(path):
      raise DataError(f"data.{key}={path}: is a directory, expected a JSONL file")


def state_bytes(tree: Any) -> int:
  """Bytes of every array (or shape) leaf of `tree`."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
      total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
  return total


def warn_if_low_disk(workdir: str, checkpoint_bytes: int, *, copies: int = 2) -> bool:
  """Logs a warning (and returns True) when `workdir`'s file system has less free space than `copies`
  checkpoints of `checkpoint_bytes` each (a rough estimate: the train state's bytes)."""
  free = shutil.disk_usage(workdir).free
  need = copies * checkpoint_bytes
  if free >= need:
    return False
  logging.warning("workdir %s: %.1f MB free, but %d checkpoints of this run need about %.1f MB; a save may fail "
                  "with 'no space left on device'", workdir, free / 1e6, copies, need / 1e6)
  return True


# ---- the lock -----------------------------------------------------------------------------------------------------
def _read_owner(fd: int) -> dict[str, Any]:
  try:
    owner = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
  except (OSError, ValueError):
    return {}
  return owner if isinstance(owner, dict) else {}


def _describe(owner: Mapping[str, Any]) -> str:
  if not owner:
    return "pid unknown: the lock is being taken right now"
  return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"


def _unlock(fd: int, path: str, pid: int) -> None:
  """Deletes the lock file (if it is still ours) while holding the lock, then closes the descriptor (unlocks).

  In a forked child (`pid` is the parent's) only the descriptor is closed: the parent still holds the lock.
  """
  try:
    if os.getpid() == pid and os.path.samestat(os.fstat(fd), os.stat(path)):
      os.remove(path)
  except OSError:
    pass
  finally:
    os.close(fd)


class WorkdirLock:
  """An exclusive lock on a workdir: `fcntl.flock` on `workdir/.lock`, which records the owner's pid/host.

  `acquire()` raises a one-line `TrainingError` naming the owner when another process (or another open trainer
  of this process) holds it. `release()` (also at garbage collection and interpreter exit) deletes the file and
  unlocks; a process that dies unlocks too (the kernel closes its descriptors), leaving a stale file that the
  next `acquire()` takes over with a warning.
  """

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILENAME)
    self._finalizer: weakref.finalize | None = None

  @property
  def held(self) -> bool:
    return self._finalizer is not None and self._finalizer.alive

  def acquire(self) -> WorkdirLock:
    if self.held:
      return self
    for _ in range(100):  # retried only when a releasing owner deleted the file between our open and our flock
      try:  # O_NOFOLLOW: a link planted as the lock file is never followed (its target would be overwritten)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     0o644)
      except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(self.path):
          raise UnsafePathError(f"workdir {self.workdir}: the lock file {self.path} is a symbolic link; refusing to "
                                "write through it - remove the link") from None
        raise TrainingError(f"workdir {self.workdir}: cannot create the lock file {self.path}: {_reason(e)}") from None
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        owner = _read_owner(fd)
        os.close(fd)
        this = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
        hint = ("close the other trainer of this process first (trainer.close() or a with-block)" if this else
                "wait for it to finish or use another --workdir")
        raise TrainingError(f"workdir {self.workdir} is in use by another training run ({_describe(owner)}); "
                            f"{hint}") from None
      except OSError as e:  # a file system without flock support: run unlocked rather than not at all
        os.close(fd)
        logging.warning("workdir %s: cannot lock %s (%s); a second run on this workdir would not be detected",
                        self.workdir, self.path, _reason(e))
        return self
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if not same:
        os.close(fd)
        continue
      stale = _read_owner(fd)
      if stale:
        logging.warning("workdir %s: taking over the lock of a run that did not exit cleanly (%s)", self.workdir,
                        _describe(stale))
      owner = {"pid": os.getpid(), "host": socket.gethostname(),
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(owner) + "\n").encode("utf-8"), 0)
      self._finalizer = weakref.finalize(self, _unlock, fd, self.path, os.getpid())
      return self
    raise TrainingError(f"workdir {self.workdir}: cannot take the lock {self.path} (it keeps being replaced)")

  def release(self) -> None:
    if self._finalizer is not None:
      self._finalizer()

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


# ---- resume compatibility and config.json -------------------------------------------------------------------------
def _as_json(raw: Mapping[str, Any]) -> dict[str, Any]:
  """`raw` as `config.json` stores it (tuples -> lists, other values as written by `write_config_json`)."""
  return json.loads(json.dumps(config_lib.config_to_dict(raw), default=str))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out: dict[str, Any] = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """`(dotted key, old value, new value)` of every leaf whose JSON form differs (`'<unset>'` for a missing key),
  sorted by key."""
  a, b = _flatten(_as_json(old)), _flatten(_as_json(new))
  return [(k, a.get(k, _UNSET), b.get(k, _UNSET)) for k in sorted(set(a) | set(b)) if a.get(k, _UNSET) != b.get(
      k, _UNSET)]


def _show(value: Any) -> str:
  return value if value is _UNSET else json.dumps(value)


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
  return "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in changes)


def is_refused(key: str, old: Any = None, new: Any = None) -> bool:
  """Whether changing `key` from `old` to `new` makes the workdir's checkpoint unusable (`_UNSET`: the default)."""
  if key in _STRUCTURAL_OPTIMIZER_KEYS:
    return (old is None) != (new is None)
  return key.split(".", 1)[0] in REFUSED_SECTIONS


def checkpoint_steps(workdir: str) -> list[int]:
  """The complete checkpoint steps in `workdir/checkpoints` (numeric directories; orbax's temporaries excluded)."""
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit() and os.path.isdir(os.path.join(directory, d)))


DATA_PATH_KEYS = ("train_path", "validation_path")


def with_absolute_data_paths(raw: Mapping[str, Any]) -> dict[str, Any]:
  """`raw` with `data.train_path` / `data.validation_path` made absolute (from the current directory): the run's
  config.json then names the same files for `evaluate` and `sample` started from any other directory."""
  out = dict(raw)
  data = dict(out.get("data") or {})
  for key in DATA_PATH_KEYS:
    if isinstance(data.get(key), str) and data[key]:
      data[key] = os.path.abspath(data[key])
  if "data" in out:
    out["data"] = data
  return out


def check_resume(raw: Mapping[str, Any], workdir: str) -> list[tuple[str, Any, Any]]:
  """Compares the config about to be written with the stored `workdir/config.json` when there is a checkpoint.

  Raises a one-line `ConfigError` listing `key: old -> new` for changes in `REFUSED_SECTIONS`; logs the other
  changes as a warning. Returns the changes (empty without a checkpoint or a stored config).
  """
  steps = checkpoint_steps(workdir)
  path = os.path.join(workdir, config_lib.CONFIG_FILENAME)
  if not steps or not os.path.isfile(path):
    return []
  # data paths compared as absolute (stored relative by older runs, launched from this same directory)
  changes = config_changes(with_absolute_data_paths(read_json(path)), with_absolute_data_paths(raw))
  refused = [c for c in changes if is_refused(*c)]
  if refused:
    raise ConfigError(
        f"workdir {workdir} has a checkpoint (step {steps[-1]}) of a different run; these changes do not fit it: "
        f"{format_changes(refused)} - rerun with the stored config ({path}) or use another --workdir "
        f"(model.checkpoint={workdir} starts a new run from its weights)")
  if changes:
    logging.warning("resuming %s (step %d) with a changed config: %s", workdir, steps[-1], format_changes(changes))
  return changes


def write_config(raw: Mapping[str, Any], workdir: str) -> str:
  """Writes `workdir/config.json` (atomically); a stored config that differs is first kept as config.prev.json.

  Nothing is written when the stored config is the same. Returns the path of config.json.
  """
  path = check_not_link(os.path.join(workdir, config_lib.CONFIG_FILENAME))
  if os.path.isfile(path):
    with open(path, "rb") as f:
      stored = f.read()
    try:
      same = json.loads(stored.decode("utf-8-sig")) == _as_json(raw)
    except ValueError:  # unreadable: keep it as the previous version all the same
      same = False
    if same:
      return path
    write_atomic(os.path.join(workdir, PREV_CONFIG_FILENAME), stored)
  return config_lib.write_config_json(raw, workdir)


def open_workdir(cfg: ExperimentConfig, workdir: str) -> WorkdirLock | None:
  """Preflight, lock (process 0), resume check, then config.json (process 0); see the module docstring.

  Returns the held lock (None on other processes); the caller releases it when the run ends. Nothing is written
  into the workdir when a check fails (the lock file is removed again). In a multi-process job the processes
  agree twice, after the preflight and lock and after the resume check and config.json: when one fails, all stop
  there (`sharding.stop_together`).
  """
  main = is_main_process()
  lock, error = None, None
  try:
    check_data_paths(cfg)
    workdir = check_writable_dir(workdir)
    check_no_links(workdir)
    lock = WorkdirLock(workdir).acquire() if main else None
  except Exception as e:  # noqa: BLE001 - told to the other processes, then raised
    error = e
  stop_together(error, cleanup=None if lock is None else lock.release)
  try:
    raw = with_absolute_data_paths(cfg.raw)
    check_resume(raw, workdir)
    if main:
      write_config(raw, workdir)
  except Exception as e:  # noqa: BLE001 - as above
    error = e
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  stop_together(error, cleanup=None if lock is None else lock.release)
  return lock


__all__ = ["DATA_PATH_KEYS", "LOCK_FILENAME", "PREV_CONFIG_FILENAME", "REFUSED_SECTIONS", "WRITTEN_FILES",
           "WorkdirLock", "check_data_paths", "check_no_links",
           "check_resume", "check_writable_dir", "checkpoint_steps", "config_changes", "format_changes",
           "is_refused", "open_workdir", "state_bytes", "warn_if_low_disk", "with_absolute_data_paths",
           "write_config"]
