"""Metric writers (JSONL + TensorBoard) and the training progress bar; all silent off process 0.

`metrics.jsonl` holds one JSON object per log step: `{"step": N, "time": unix_seconds, <metric>: float, ...}`.
On resume the writer drops lines logged after the restored step (they belong to the lost part of the run), and
the TensorBoard writer purges those events too, so both read like one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tqdm

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def is_main_process() -> bool:
  return jax.process_index() == 0


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


class MetricWriter:
  """Appends scalars to `workdir/metrics.jsonl` and TensorBoard events under `workdir/tensorboard/`.

  Only process 0 writes (`enabled` defaults to `jax.process_index() == 0`). `resume_step`: the step training
  restarts from; JSONL lines and TensorBoard events after it are dropped.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, enabled: bool | None = None,
               tensorboard: bool = True):
    self.enabled = is_main_process() if enabled is None else enabled
    self.path = os.path.join(workdir, METRICS_FILENAME)
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    kept = [r for r in read_metrics(workdir) if isinstance(r.get("step"), int) and r["step"] <= resume_step]
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for r in kept:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, self.path)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter  # local: only the writing process needs it

      self._tb = SummaryWriter(logdir=os.path.join(workdir, TENSORBOARD_DIR),
                               purge_step=resume_step + 1 if resume_step else None, flush_secs=30)

  def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
    """Writes scalar metrics of one step (values: Python/NumPy/JAX scalars)."""
    if not self.enabled:
      return
    values = {prefix + k: _to_float(v) for k, v in metrics.items()}
    record = {"step": int(step), "time": round(time.time(), 3), **{k: _json_safe(v) for k, v in values.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in values.items():
        if math.isfinite(v):  # non-finite values stay in the JSONL (TensorBoard would warn about them)
          self._tb.add_scalar(k, v, int(step))

  def flush(self) -> None:
    if self.enabled:
      self._file.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      if self._tb is not None:
        self._tb.close()
      self.enabled = False


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


__all__ = ["METRICS_FILENAME", "MetricWriter", "Progress", "TENSORBOARD_DIR", "is_main_process", "read_metrics"]
