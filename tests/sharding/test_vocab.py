"""`sharding.embed_lookup` (vocabulary-sharded embedding lookup) on 8 fake CPU devices == one device, and XLA's
SPMD partitioner never replicates the table for it.

`tests/sharding/vocab_worker.py` runs in a subprocess (JAX fixes its device count at start-up); this test reads
its stderr, where XLA's partitioner prints `[SPMD] Involuntary full rematerialization ... SPMD will replicate the
tensor` when it cannot split an operation (a plain `jnp.take` on the table does that, in encode and in decode):
- the lookup alone (value and the table's gradient) on five meshes (vocab over tensor, hidden over fsdp, the
  batch over data x fsdp x expert) == `jnp.take` on one device;
- the tiny model's encode + decode logits, parameters in their shards on fsdp 2 x tensor 2 x expert 2 == one
  device, and `hd.generate(..., mesh=)` there == one device (same tokens).
Tolerance: `max |got - want| <= 1e-5 * max(1, max |want|)` (sums in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from device_workers import ROOT, close

WARNING = "Involuntary full rematerialization"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = os.path.join(str(tmp_path_factory.mktemp("vocab")), "out.json")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests/sharding/vocab_worker.py"), out], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    pytest.fail(f"worker exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
  with open(out, encoding="utf-8") as f:
    return json.load(f), proc.stderr


def test_lookup_equals_one_device(results):
  measured, _ = results
  assert measured["devices"] == 8
  for name, c in measured["lookup"].items():
    assert close(c["err"], c["scale"]), (name, c)


def test_model_logits_equal_one_device(results):
  m = results[0]["model"]
  assert m["embed_spec"] == ["tensor", "fsdp"]  # the table really is split both ways
  assert close(m["err"], m["scale"]), m


def test_generate_equals_one_device(results):
  assert results[0]["generate"]["equal"]


def test_no_table_replication(results):
  stderr = results[1]
  program, offending = "", []
  for line in stderr.splitlines():
    if line.startswith("== "):
      program = line[3:]
    elif WARNING in line:
      offending.append(f"{program}: {line[:300]}")
  assert not offending, "\n".join(offending)
