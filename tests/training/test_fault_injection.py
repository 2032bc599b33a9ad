"""Fault injection: a tiny `train` run SIGKILLed at random moments and resumed each time.

`python -m hackable_diffusion.train --config=tiny.py ...` is killed with SIGKILL `kills` times - at moments drawn
from a fixed-seed numpy generator, cycling through three kinds: a random log step (plus a random delay), the
moment a checkpoint's temporary directory appears (mid-save), and a random delay after a log step where
evaluation starts (the save and evaluation that follow it) - and rerun with the same command after each kill.
After every kill: every complete checkpoint restores (never a corrupt one), metrics.jsonl is valid JSON line by
line with no step logged twice, and the rerun says it resumes from the latest complete checkpoint. At the end the
run finishes and its final parameters and per-step training losses equal those of an uninterrupted run of the same
command (exact resume).

Each process start costs seconds of imports and compilation (more on a loaded machine), so the count is a module
constant: CI runs `KILLS_CI` (3) kills; the full `KILLS_FULL` (20) version is marked
`slow` (excluded by the default `-m 'not slow ...'`; run it with `pytest -m slow -k fault`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import jax
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.runs import run as run_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLS_CI = 3
KILLS_FULL = 20
SEED = 0
KINDS = ("log_step", "mid_save", "evaluation")
START_TIMEOUT_S = 300  # one process start + the steps up to a kill target (compilation on a loaded machine)


@dataclass
class Plan:
  steps: int
  checkpoint_every: int = 10
  log_every: int = 5
  eval_every: int = 20
  kills: int = KILLS_CI
  seen: list[str] = field(default_factory=list)  # what each kill hit, for the failure message

  def args(self, workdir: str) -> list[str]:
    return [sys.executable, "-m", "hackable_diffusion.train", "--config=tiny.py", f"--workdir={workdir}",
            f"--config.train.steps={self.steps}", "--config.optimizer.decay_steps=500",
            f"--config.train.checkpoint_every={self.checkpoint_every}", f"--config.train.log_every={self.log_every}",
            f"--config.train.eval_every={self.eval_every}", "--config.train.keep_checkpoints=2",
            "--config.eval.num_examples=16", "--config.eval.batch_size=16", "--config.eval.step_budgets=(2,)",
            "--config.eval.early_stopping_steps=2", "--no_progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.getbasetemp() / "xla_cache"
  cache.mkdir(exist_ok=True)
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), PYTHONPATH=path,
              PYTHONUNBUFFERED="1")


def _start(plan: Plan, workdir: str, env: dict[str, str], log: str) -> subprocess.Popen:
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    return subprocess.Popen(plan.args(workdir), env=env, cwd=os.path.dirname(workdir), stdout=out, stderr=err)


def _metric_lines(workdir: str) -> list[str]:
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      return f.read().splitlines()
  except FileNotFoundError:
    return []


def _metrics_inode(workdir: str) -> int | None:
  try:
    return os.stat(os.path.join(workdir, "metrics.jsonl")).st_ino
  except FileNotFoundError:
    return None


def _last_logged_step(workdir: str, stale_inode: int | None) -> int:
  """The last step in metrics.jsonl once this process has rewritten it (before: lines of the killed run)."""
  if _metrics_inode(workdir) == stale_inode:
    return -1
  steps = [0]
  for line in _metric_lines(workdir):
    try:
      steps.append(int(json.loads(line)["step"]))
    except (ValueError, KeyError):
      pass  # a line being written
  return max(steps)


def _checkpoint_entries(workdir: str) -> list[str]:
  try:
    return os.listdir(os.path.join(workdir, "checkpoints"))
  except FileNotFoundError:
    return []


def _complete_steps(workdir: str) -> list[int]:
  return sorted(int(n) for n in _checkpoint_entries(workdir) if n.isdigit())


def _wait_for(proc: subprocess.Popen, condition, timeout: float = START_TIMEOUT_S) -> bool:
  """Polls `condition()` until true (returns True) or the process ends by itself (returns False)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return True
    if proc.poll() is not None:
      return False
    time.sleep(0.005)
  raise AssertionError(f"no kill moment within {timeout}s")


def _kill_at_random_moment(proc: subprocess.Popen, plan: Plan, workdir: str, kind: str,
                           rng: np.random.Generator, stale_inode: int | None) -> bool:
  """Waits for a moment of `kind` (after the resume point) and SIGKILLs; False if the run finished first."""
  start = max(_complete_steps(workdir) or [0])
  logged = lambda: _last_logged_step(workdir, stale_inode)  # noqa: E731
  if kind == "mid_save":
    base = {n for n in _checkpoint_entries(workdir)}
    hit = _wait_for(proc, lambda: any(".orbax-checkpoint-tmp" in n and n not in base
                                      for n in _checkpoint_entries(workdir)))
  elif kind == "evaluation" and start + plan.eval_every <= plan.steps:
    target = (start // plan.eval_every + 1) * plan.eval_every
    hit = _wait_for(proc, lambda: logged() >= target)
    time.sleep(rng.uniform(0.0, 2.0))  # the save, then the evaluation (compiling its sampler first)
  else:  # a log step at most 3 log steps past the checkpoint resumed from: kills spread over the whole run
    target = start + plan.log_every * int(rng.integers(1, 4))
    hit = _wait_for(proc, lambda: logged() >= min(target, plan.steps))
    time.sleep(rng.uniform(0.0, 0.3))
  if proc.poll() is not None:
    return False
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  plan.seen.append(f"{kind}@{logged()}" + ("" if hit else "(end)"))
  return True


def _check_workdir(workdir: str, context: str) -> int | None:
  """After a kill: every complete checkpoint restores; metrics.jsonl is valid JSON, no step logged twice."""
  steps = _complete_steps(workdir)
  for step in steps:
    loaded = run_lib.load_run(workdir, step=step)  # raises a CheckpointError on a damaged checkpoint
    assert loaded.step == step, context
  seen: set[tuple[int, str]] = set()
  train_steps = []
  for i, line in enumerate(_metric_lines(workdir)):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      raise AssertionError(f"{context}: metrics.jsonl line {i + 1} is not valid JSON: {line!r}") from None
    for key in set(record) - {"step", "time"}:  # each evaluation run logs its own line at the same step
      assert (record["step"], key) not in seen, f"{context}: {key} logged twice at step {record['step']}"
      seen.add((record["step"], key))
    if "train/loss" in record:
      train_steps.append(record["step"])
  assert train_steps == sorted(train_steps), f"{context}: training steps out of order: {train_steps}"
  return steps[-1] if steps else None


def _params(workdir: str) -> list[np.ndarray]:
  run = run_lib.load_run(workdir)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(run.model))]


def _losses(workdir: str) -> dict[int, float]:
  out = {}
  for line in _metric_lines(workdir):
    record = json.loads(line)
    if "train/loss" in record:
      out[record["step"]] = record["train/loss"]
  return out


def run_fault_injection(plan: Plan, tmp_path, env: dict[str, str]) -> None:
  rng = np.random.default_rng(SEED)
  reference = str(tmp_path / "reference")
  workdir = str(tmp_path / "killed")
  ref_proc = _start(plan, reference, env, str(tmp_path / "reference"))  # runs alongside the killed runs
  try:
    for i in range(plan.kills):
      latest = max(_complete_steps(workdir) or [0])
      stale_inode = _metrics_inode(workdir)
      log = str(tmp_path / f"run{i}")
      proc = _start(plan, workdir, env, log)
      try:
        killed = _kill_at_random_moment(proc, plan, workdir, KINDS[i % len(KINDS)], rng, stale_inode)
      finally:
        if proc.poll() is None:
          proc.kill()
          proc.wait()
      with open(log + ".out") as f:
        out = f.read()
      if latest:  # the rerun resumed from the latest complete checkpoint of the previous kill
        assert f"resuming from step {latest}" in out, (plan.seen, out[-2000:])
      context = f"after kill {i + 1} ({plan.seen})"
      assert killed, f"{context}: the run finished before kill {i + 1}; raise Plan.steps"
      _check_workdir(workdir, context)
    log = str(tmp_path / "final")
    proc = _start(plan, workdir, env, log)
    assert proc.wait(timeout=START_TIMEOUT_S) == 0, open(log + ".err").read()[-3000:]
    assert ref_proc.wait(timeout=START_TIMEOUT_S) == 0, open(str(tmp_path / "reference.err")).read()[-3000:]
  finally:
    if ref_proc.poll() is None:
      ref_proc.kill()
      ref_proc.wait()
  print(f"kills: {plan.seen}")  # shown with -s / on failure
  _check_workdir(workdir, f"at the end ({plan.seen})")
  assert max(_complete_steps(workdir)) == plan.steps
  assert _losses(workdir) == _losses(reference), plan.seen
  for a, b in zip(_params(workdir), _params(reference), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=str(plan.seen))


@pytest.mark.slow  # repeated CLI runs; tests/test_cli.py keeps a SIGKILL-then-resume run in the default tier
def test_sigkill_at_random_moments_resumes_exactly(tmp_path, env):
  """KILLS_CI kills (one of each kind) of a 120-step run; the full version is test_fault_injection_full."""
  run_fault_injection(Plan(steps=120, kills=KILLS_CI), tmp_path, env)


@pytest.mark.slow
def test_fault_injection_full(tmp_path, env):
  """`KILLS_FULL` kills (minutes: one process start per kill)."""
  run_fault_injection(Plan(steps=400, eval_every=30, kills=KILLS_FULL), tmp_path, env)
