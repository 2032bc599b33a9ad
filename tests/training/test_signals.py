"""SIGINT and SIGTERM at any moment of a `train` run: one `error:` line, exit code 1, the workdir lock released, a
consistent checkpoint (parameters and data-iterator state of the same step) or none - and the rerun of the same
command ends with per-step training losses bit-identical to an uninterrupted run's.

Three interrupted runs of `python -m hackable_diffusion.train --config=tiny.py` (logging every step) beside one
uninterrupted reference: SIGTERM after the first metrics line; SIGINT as soon as the workdir is locked (setup:
nothing saved); SIGINT while the first step compiles (stops after that step); two SIGTERMs in a row (the second
exits at once, without damaging anything a rerun needs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 120  # long enough that a signal sent after the first metrics line lands before the end
TIMEOUT_S = 300


def _args(workdir: str) -> list[str]:
  return [sys.executable, "-m", "hackable_diffusion.train", "--config=tiny.py", f"--workdir={workdir}",
          f"--config.train.steps={STEPS}", "--config.train.log_every=1", "--config.train.checkpoint_every=1000",
          "--config.train.eval_at_end=False", "--config.train.batch_size=8",
          "--config.data.generator_args.num_train=256", "--config.data.generator_args.num_validation=8",
          "--no_progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  cache = tmp_path_factory.getbasetemp() / "xla_cache_signals"
  cache.mkdir(exist_ok=True)
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), PYTHONPATH=path,
              PYTHONUNBUFFERED="1")


def _start(workdir: str, env) -> subprocess.Popen:
  return subprocess.Popen(_args(workdir), env=env, cwd=os.path.dirname(workdir), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _losses(workdir: str) -> dict[int, float]:
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if "train/loss" in record:
        out[record["step"]] = record["train/loss"]
  return out


def _wait_for(proc: subprocess.Popen, condition) -> None:
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline:
    if condition():
      return
    assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()[1][-2000:]}"
    time.sleep(0.005)
  raise AssertionError("no signal moment within the timeout")


def _logged(workdir: str) -> bool:
  try:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
      return '"train/loss"' in f.read()
  except FileNotFoundError:
    return False


def _finish(workdir: str, env) -> None:
  res = subprocess.run(_args(workdir), env=env, cwd=os.path.dirname(workdir), capture_output=True, text=True,
                       timeout=TIMEOUT_S)
  assert res.returncode == 0, res.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
  workdir = str(tmp_path_factory.mktemp("signals") / "reference")
  _finish(workdir, env)
  return _losses(workdir)


def _interrupt(workdir: str, env, sig: int, when, count: int = 1) -> tuple[int, str]:
  proc = _start(workdir, env)
  try:
    _wait_for(proc, when)
    for _ in range(count):
      proc.send_signal(sig)
      time.sleep(0.05)
    _, err = proc.communicate(timeout=TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
  return proc.returncode, err


def _compiling(workdir: str) -> bool:
  """metrics.jsonl exists (the loop has started) but holds no line yet: the first step is being compiled."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return False
  time.sleep(0.3)  # past the few lines between the metrics file and the loop's signal handlers
  return True


@pytest.mark.parametrize("sig,moment", [(signal.SIGTERM, "after_first_metrics_line"),
                                        # the other moments of the same handler: slow tier
                                        pytest.param(signal.SIGINT, "when_locked", marks=pytest.mark.slow),
                                        pytest.param(signal.SIGINT, "first_compile", marks=pytest.mark.slow)])
def test_a_signal_saves_a_consistent_checkpoint_or_none_and_resume_is_exact(tmp_path, env, reference, sig, moment):
  workdir = str(tmp_path / "run")
  lock = os.path.join(workdir, ".lock")
  when = {"after_first_metrics_line": lambda: _logged(workdir), "when_locked": lambda: os.path.exists(lock),
          "first_compile": lambda: _compiling(workdir)}[moment]
  rc, err = _interrupt(workdir, env, sig, when)
  name = signal.Signals(sig).name
  lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
  assert rc == 1, err[-3000:]
  assert len(lines) == 1 and lines[0].startswith(f"error: {name} "), err[-3000:]
  assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
  assert not os.path.exists(lock)
  steps = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()) \
      if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
  if moment == "after_first_metrics_line":
    assert steps and 0 < steps[-1] < STEPS, (steps, err[-2000:])
    assert f"at step {steps[-1]};" in lines[0]
    assert max(_losses(workdir)) == steps[-1]  # the interrupted step's metrics line is written, none after it
  _finish(workdir, env)
  assert _losses(workdir) == reference  # bit for bit (the JSON floats round-trip exactly)


@pytest.mark.slow  # a third training run of the handler (the SIGTERM test above stays in the default tier)
def test_a_second_signal_exits_at_once_and_the_rerun_is_still_exact(tmp_path, env, reference):
  workdir = str(tmp_path / "run")
  rc, err = _interrupt(workdir, env, signal.SIGTERM, lambda: _logged(workdir), count=2)
  assert rc != 0, err[-3000:]
  assert "Fatal Python error" not in err, err[-3000:]
  _finish(workdir, env)
  assert _losses(workdir) == reference
