"""Metric writers (JSONL + TensorBoard) and the training progress bar; all silent off process 0.

`metrics.jsonl` holds one JSON object per log step: `{"step": N, "time": unix_seconds, <metric>: float, ...}`.
On resume the writer drops lines logged after the restored step (they belong to the lost part of the run), and
the TensorBoard writer purges those events too, so both read like one uninterrupted run (no step is logged twice).

Failures are errors, never hangs: every write happens in the calling thread (TensorBoard events too - tensorboardX's
`SummaryWriter` writes from a background thread through a bounded queue, and when that thread dies of a full disk
the next `add_scalar` blocks forever), and an `OSError` (ENOSPC, EIO, ...) becomes a one-line `TrainingError` at
once. The JSONL line is flushed per write (one `write` call per line, so a killed process leaves whole lines); the
event file is flushed per log step.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import tqdm

from hackable_diffusion.errors import TrainingError
from hackable_diffusion.files import check_not_link, makedirs_no_link, open_append, open_new
from hackable_diffusion.sharding.mesh import is_main_process

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _to_float(v: Any) -> float:
  return float(np.asarray(v))


def _json_safe(v: float) -> float | str:
  return v if math.isfinite(v) else str(v)  # JSON has no NaN/inf literals


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of `workdir/metrics.jsonl` (empty list when there is none)."""
  path = os.path.join(workdir, METRICS_FILENAME)
  if not os.path.exists(path):
    return []
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue  # a line cut by a crash mid-write
  return out


def _write_error(path: str, e: OSError) -> TrainingError:
  reason = " ".join(f"{e.strerror or e}".split()) + (f" [errno {e.errno}]" if e.errno else "")
  return TrainingError(f"{path}: cannot write metrics ({reason}); stopped - the last complete checkpoint is kept, "
                       f"free disk space (or fix the error) and rerun to resume")


class _EventFile:
  """TensorBoard scalar events written synchronously in the caller's thread, no queue, no worker thread: a failed
  write raises here instead of killing a thread the caller then waits on. The file is created afresh
  (`files.open_new`: never through a symbolic link) and holds tensorboardX's record format (length, masked
  CRC-32C of the length, serialized `Event`, masked CRC-32C of the event)."""

  def __init__(self, logdir: str, *, purge_step: int | None = None):
    from tensorboardX.proto.event_pb2 import Event, SessionLog  # local: only the writing process needs them
    from tensorboardX.record_writer import masked_crc32c

    makedirs_no_link(logdir)
    self._event, self._crc = Event, masked_crc32c
    # pid + counter: two writers of one directory in the same second (a resume in-process) get distinct files
    stem = os.path.join(logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}")
    n = 0
    while True:
      try:
        self._file = open_new(stem + (f"-{n}" if n else ""), "wb")
        break
      except FileExistsError:
        n += 1
    self.path = logdir  # named in error messages
    try:
      self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
      if purge_step is not None:  # TensorBoard hides this file's older events with step >= purge_step
        self._write(Event(step=purge_step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))
      self.flush()
    except BaseException:
      self._file.close()
      raise

  def _write(self, event: Any) -> None:
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))  # TFRecord framing, little-endian
    self._file.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))

  def add_scalars(self, step: int, values: Mapping[str, float]) -> None:
    from tensorboardX.summary import scalar

    for k, v in values.items():
      self._write(self._event(summary=scalar(k, v), step=step, wall_time=time.time()))

  def flush(self) -> None:
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self) -> None:
    try:
      self.flush()
    finally:
      self._file.close()


class MetricWriter:
  """Appends scalars to `workdir/metrics.jsonl` and TensorBoard events under `workdir/tensorboard/`.

  Only process 0 writes (`enabled` defaults to `jax.process_index() == 0`). `resume_step`: the step training
  restarts from; JSONL lines and TensorBoard events after it are dropped. Any `OSError` while writing raises a
  one-line `TrainingError` naming the file; after one, `close()` releases the files without raising again.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None,
               tensorboard: bool = True):
    self.enabled = is_main_process() if enabled is None else enabled
    self.path = os.path.join(workdir, METRICS_FILENAME)
    self._tb: _EventFile | None = None
    self._file = None
    self._failed = False
    if not self.enabled:
      return
    tmp = self.path + ".tmp"
    try:
      os.makedirs(workdir, exist_ok=True)
      check_not_link(self.path)  # never read, replace or append through a link someone else put there
      kept = [r for r in read_metrics(workdir) if isinstance(r.get("step"), int) and r["step"] <= resume_step]
      if os.path.lexists(tmp):  # left by a killed process (or planted): removed, never followed
        os.remove(tmp)
      with open_new(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
      os.replace(tmp, self.path)
      self._file = open_append(self.path)
    except OSError as e:
      _remove_quietly(tmp)
      raise _write_error(self.path, e) from None
    if tensorboard:
      logdir = os.path.join(workdir, TENSORBOARD_DIR)
      try:
        self._tb = _EventFile(logdir, purge_step=resume_step + 1 if resume_step else None)
      except OSError as e:
        self._file.close()
        raise _write_error(logdir, e) from None

  def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
    """Writes scalar metrics of one step (values: Python/NumPy/JAX scalars)."""
    if not self.enabled:
      return
    values = {prefix + k: _to_float(v) for k, v in metrics.items()}
    record = {"step": int(step), "time": round(time.time(), 3), **{k: _json_safe(v) for k, v in values.items()}}
    self._guarded(self.path, lambda: (self._file.write(json.dumps(record) + "\n"), self._file.flush()))
    if self._tb is not None:
      # non-finite values stay in the JSONL (TensorBoard would warn about them)
      finite = {k: v for k, v in values.items() if math.isfinite(v)}
      self._guarded(self._tb.path, lambda: (self._tb.add_scalars(int(step), finite), self._tb.flush()))

  def flush(self) -> None:
    if self.enabled:
      self._guarded(self.path, self._file.flush)
      if self._tb is not None:
        self._guarded(self._tb.path, self._tb.flush)

  def close(self) -> None:
    """Flushes and closes both files; raises a `TrainingError` for a failure not reported by an earlier call."""
    if not self.enabled:
      return
    self.enabled = False
    files = [(self.path, self._file)] + ([(self._tb.path, self._tb)] if self._tb is not None else [])
    error: TrainingError | None = None
    for path, f in files:
      try:
        f.close()  # a closed file stays closed even when its final flush fails
      except OSError as e:
        error = error or _write_error(path, e)
    if error is not None and not self._failed:
      self._failed = True
      raise error

  def _guarded(self, path: str, fn: Any) -> None:
    try:
      fn()
    except OSError as e:
      self._failed = True
      raise _write_error(path, e) from None


def _remove_quietly(path: str) -> None:
  try:
    os.remove(path)
  except OSError:
    pass


class Progress:
  """A tqdm bar over optimizer steps showing loss, tokens/s and ETA (disabled off process 0 or on request)."""

  def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None, desc: str = "train"):
    enabled = is_main_process() if enabled is None else enabled
    interactive = sys.stderr.isatty()
    self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled,
                          dynamic_ncols=True, smoothing=0.1, mininterval=0.1 if interactive else 10.0)
    self._last_time = time.perf_counter()
    self._tokens = 0.0

  def update(self, steps: int = 1, *, tokens: float = 0.0) -> None:
    self._tokens += tokens
    self._bar.update(steps)

  def set_metrics(self, loss: float, **extra: float) -> float:
    """Shows `loss`, tokens/s since the last call (returned) and any extra scalars."""
    now = time.perf_counter()
    tok_s = self._tokens / max(now - self._last_time, 1e-9)
    self._last_time, self._tokens = now, 0.0
    self._bar.set_postfix({"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}",
                           **{k: f"{v:.4g}" for k, v in extra.items()}}, refresh=False)
    return tok_s

  def write(self, message: str) -> None:
    self._bar.write(message)

  def close(self) -> None:
    self._bar.close()


__all__ = ["METRICS_FILENAME", "MetricWriter", "Progress", "TENSORBOARD_DIR", "read_metrics"]
