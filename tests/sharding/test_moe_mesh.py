"""Expert parallelism and banded attention on 8 fake CPU devices == one device (fp32).

`tests/sharding/moe_mesh_worker.py` runs in a subprocess (JAX fixes its device count at start-up) and reports
JSON; the assertions live here:
- `moe.expert_parallel_experts` on meshes `expert=8`, `fsdp=2 x expert=4`, `data=2 x fsdp=2 x expert=2` ==
  `dense_experts` on one device, value and gradients (x, routing weights, gate_up, down), with an expert chosen by
  every token and one by none, and (on `fsdp=2 x expert=4`) a token count the batch axes cannot split (tokens
  replicated: the psum path). The compiled programs of the split case really all-gather and reduce-scatter.
- The tiny model (8 experts) with `moe_impl='expert_parallel'` and `'all_to_all'` on `fsdp=2 x expert=4`, parameters
  in their shards, traced under `activation_sharding` == the dense model on one device: logits and every
  parameter gradient.
- QLoRA (fp8, packed int4 and nvfp4 base) with its quantized values and scales in their shards == one device: loss and
  adapter gradients.
- `tiled` / `ragged` on meshes that split the tokens (`moe.on_local_tokens`: each device sorts and runs its own
  tokens; weights gathered per expert / per layer) == one device, and a fraction of one device's temporaries.
- A training step's gradients with scanned layers, remat and linked passes (`scan.link_passes`, one gradient buffer
  for the encoder and decoder passes) and `tiled` experts on fsdp=8 and data2 x fsdp2 x tensor2 == the unrolled
  model on one device.
- Banded sliding-window encoder attention with the batch split over data x fsdp and the heads over tensor ==
  one device (left padding, per-row start offsets).
Tolerance: `max |got - want| <= 1e-5 * max(1, max |want|)` (sums in another order).
"""

from __future__ import annotations

import pytest

from device_workers import close, run_worker

# one 8-device worker compiling every mesh case (minutes); tests/sharding/test_multi_device.py keeps a mesh
# training step, generation and checkpoint restore in the default tier
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return run_worker("tests/sharding/moe_mesh_worker.py", tmp_path_factory.mktemp("moe_mesh"))


def test_expert_parallel_function_equals_one_device(results):
  assert results["devices"] == 8
  cases = results["functions"]
  assert len(cases) == 7
  for name, c in cases.items():
    assert close(c["err"], c["scale"]), (name, c)
    assert c["grad_gate_up_scale"] > 1.0, name  # gradients are compared, not zeros
    if "skewed" in name:
      assert c["min_count"] == 0 and c["max_count"] == int(name.split("/T")[1].split("/")[0]), name
    # tokens split with the batch: gathered over the expert axis, reduce-scattered back
    assert c["all_gather"] == c["reduce_scatter"] == ("/T48/" in name), name


@pytest.mark.parametrize("case", ["expert_parallel/fsdp2_expert4", "all_to_all/fsdp2_expert4"])
def test_expert_parallel_model_equals_one_device(results, case):
  m = results["model"][case]
  assert close(m["logits_err"], m["logits_scale"]), m
  assert close(m["grads_err"], m["grads_scale"]), m
  assert m["runs_as"] == case.split("/")[0], m  # the model really took that path
  assert m["reduce_scatter"], m


@pytest.mark.parametrize("mesh", ["data2_fsdp2_tensor2", "fsdp4_tensor2", "data2_expert4"])
def test_banded_attention_on_a_mesh_equals_one_device(results, mesh):
  a = results["attention"]
  assert a["band_vs_dense_err"] <= 1e-5
  m = a[mesh]
  assert m["devices"] == 8 and m["err"] <= 1e-5, m
  assert m["out_spec"] != "P()"  # the output really is split


@pytest.mark.parametrize("case", ["fp8/data2_fsdp2_tensor2", "fp8/fsdp2_expert4", "int4/data2_fsdp2_tensor2",
                                  "int4/fsdp2_expert4", "nvfp4/data2_fsdp2_tensor2", "nvfp4/fsdp2_expert4"])
def test_quantized_base_on_a_mesh_equals_one_device(results, case):
  """QLoRA with the quantized values and scales in their shards (int4 packed two per byte): the loss and the
  adapter gradients equal one device's. Measured: loss within 2e-7 relative everywhere; the largest adapter
  gradient error relative to the largest gradient is 2e-5 for int4 (as the dense base's 7e-5), 6e-5 for fp8 on
  fsdp2_expert4 but 7e-4 for fp8 on data2_fsdp2_tensor2; nvfp4 1.5e-5 and 4e-6
  (its 1 KiB scale tables stay replicated: 40 and 44 of its 60 quantized arrays are split). The fp8 case is the
  test point's conditioning, not the mesh: on one device, scaling every adapter by `1 + eps * N(0, 1)` moves the fp8
  model's adapter gradients by up to 5.3e-3 / 6.3e-2 / 0.69 (worst array, relative to its largest entry) for
  eps = 1e-6 / 1e-5 / 1e-4 (linear: a gain of ~5,000), the int4 model's by 3.6e-4 / 3.3e-3 / 3.4e-2 (a gain of
  ~350), so one fp32 rounding (1.2e-7) in another summation order is expected to move them by ~6e-4 and ~4e-5, as
  measured. Each quantized layer alone is bit for bit one device's on that mesh. Tolerance: 2e-3 relative, far below what a misplaced shard gives (errors of the gradients' own size)."""
  m = results["qlora"][case]
  assert close(m["loss_err"], abs(m["loss"])), m
  assert m["grads_err"] <= 2e-3 * m["grads_scale"], m
  assert m["grads_scale"] > 1e-3  # gradients are compared, not zeros
  assert m["quantized_split"] >= m["quantized_vars"] // 2, m  # most quantized arrays are really split


def test_sorting_kernels_run_each_devices_own_tokens(results):
  """`tiled` / `ragged` with the tokens split like the batch and the expert weights by their rules (fsdp, data x
  fsdp, tensor, expert) == the dense kernel on one device, value and gradients; on fsdp=8 each device's compiled
  gradient keeps a fraction of one device's temporaries for the same 2,048 tokens (before `moe.on_local_tokens`
  the partitioner replicated the global sort: every device routed every token, as much as one device) and the
  weight gradients leave reduce-scattered."""
  cases = results["local_tokens"]
  assert len(cases) == 11
  for name, c in cases.items():
    assert close(c["err"], c["scale"]), (name, c)
    assert c["grad_gate_up_scale"] > 1.0 and c["weights_split"], (name, c)
  big = cases["tiled/fsdp8/T2048"]
  assert big["temporaries"] < 0.4 * big["one_device_temporaries"], big
  assert big["reduce_scatter"], big
  # weight-heavy experts on few tokens: gathered one expert at a time, the temporaries stay below the experts'
  # whole bytes (3.4 of 6 MiB; gathered whole per layer: 17 MiB)
  heavy = cases["tiled/fsdp8/weights"]
  assert heavy["temporaries"] < 0.75 * heavy["whole_expert_bytes"], heavy


@pytest.mark.parametrize("mesh", ["fsdp8", "data2_fsdp2_tensor2"])
def test_linked_training_gradients_on_a_mesh_equal_one_device(results, mesh):
  """Loss and every parameter gradient (layer by layer, unstacked) of the scanned, rematerialised, linked training
  loss with each device running its own tokens == the unrolled model without remat on one device."""
  m = results["linked"][mesh]
  assert m["same_tree"] and m["q_split"], m
  assert abs(m["loss"] - m["ref_loss"]) <= 1e-6 * abs(m["ref_loss"]), m
  assert m["scale"] > 0 and close(m["err"], m["scale"]), m
