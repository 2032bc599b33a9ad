"""Checks that need 8 devices run as a worker script on 8 fake CPU devices, in a subprocess (JAX fixes its device
count when it first initialises; the test process has one). A worker writes its measurements as JSON; the tests
assert on them. tests/conftest.py puts this directory on `sys.path`; workers insert it themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_fake_cpu_devices(count: int = 8) -> None:
  """Called by a worker before it imports JAX: `count` fake CPU devices, compiled at the lowest XLA optimisation
  level (tiny shapes: compile time dominates) and without the CPU fusion emitters."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""),
      f"--xla_force_host_platform_device_count={count}",
      "--xla_backend_optimization_level=0",
      "--xla_cpu_use_fusion_emitters=false",
  ])


def run_worker(worker: str, out_dir: str) -> dict:
  """Runs `python worker OUT.json` (a path relative to the repository) on the CPU and returns its JSON; a test
  failure with the end of its output if it exits non-zero."""
  import pytest  # noqa: PLC0415 - test-side only

  out = os.path.join(str(out_dir), "out.json")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, worker), out], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  if proc.returncode != 0:
    pytest.fail(f"worker exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
  with open(out, encoding="utf-8") as f:
    return json.load(f)


def close(err: float, scale: float) -> bool:
  """The tolerance of a mesh result against one device: `err <= 1e-5 * max(1, scale)` (sums in another order)."""
  return err <= 1e-5 * max(1.0, scale)


def max_err(got, want) -> float:
  """Largest absolute difference over the leaves of two pytrees of arrays (in float64)."""
  import jax  # noqa: PLC0415 - a worker sets up its devices before importing jax

  return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def scale(tree) -> float:
  """Largest absolute value over the leaves of a pytree of arrays."""
  import jax  # noqa: PLC0415

  return max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(tree))
