"""The `grouped` MoE kernel on 8 fake CPU devices (fsdp 4 x expert 2) == `dense_experts` on one device, values and
gradients (x, routing weights, gate_up, down): expert parallelism by all-to-all dispatch, the gathered-tile path and the tokamax wrapper (through tokamax's
'xla' implementation; skipped without tokamax) under `moe.on_local_tokens`, and the wrapper as the grouped matmul
of `expert_parallel`. `tests/sharding/grouped_mesh_worker.py` runs in a subprocess (JAX fixes its device count at
start-up). Tolerance: `max |got - want| <= 1e-5 * max(1, max |want|)` (sums in another order)."""

from __future__ import annotations

import importlib.util

import pytest
from device_workers import close, run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return run_worker("tests/sharding/grouped_mesh_worker.py", tmp_path_factory.mktemp("grouped_mesh"))


def test_grouped_on_a_mesh_equals_one_device(results):
  assert results["devices"] == 8
  cases = results["cases"]
  want = {"gathered/local_tokens", "all_to_all/fsdp4_expert2", "all_to_all/fsdp1_expert8"}
  if importlib.util.find_spec("tokamax") is not None:
    want |= {"tokamax/local_tokens", "tokamax/expert_parallel"}
  assert set(cases) == want
  for name, c in cases.items():
    assert close(c["err"], c["scale"]), (name, c)


def test_the_cpu_ragged_exchange_gives_the_documented_example(results):
  """XLA:CPU has no ragged all-to-all: the all-to-all dispatch runs an equivalent program there. It must give what
  `jax.lax.ragged_all_to_all`'s documentation says the collective gives on its example."""
  assert results["ragged_exchange_example"] == [[1, 3, 0, 0], [2, 2, 4, 0]]
