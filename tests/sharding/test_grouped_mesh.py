"""The `grouped` MoE kernel on 8 fake CPU devices (fsdp 4 x expert 2) == `dense_experts` on one device, values and
gradients (x, routing weights, gate_up, down): the gathered-tile path and the tokamax wrapper (through tokamax's
'xla' implementation; skipped without tokamax) under `moe.on_local_tokens`, and the wrapper as the grouped matmul
of `expert_parallel`. `tests/sharding/grouped_mesh_worker.py` runs in a subprocess (JAX fixes its device count at
start-up). Tolerance: `max |got - want| <= 1e-5 * max(1, max |want|)` (sums in another order)."""

from __future__ import annotations

import importlib.util

from device_workers import close, run_worker


def test_grouped_on_a_mesh_equals_one_device(tmp_path):
  results = run_worker("tests/sharding/grouped_mesh_worker.py", tmp_path)
  assert results["devices"] == 8
  cases = results["cases"]
  want = {"gathered/local_tokens"}
  if importlib.util.find_spec("tokamax") is not None:
    want |= {"tokamax/local_tokens", "tokamax/expert_parallel"}
  assert set(cases) == want
  for name, c in cases.items():
    assert close(c["err"], c["scale"]), (name, c)
