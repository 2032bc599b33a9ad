"""The `grouped` MoE kernel on 8 fake CPU devices, run by `tests/sharding/test_grouped_mesh.py`.
Usage: `python tests/sharding/grouped_mesh_worker.py OUT.json`; writes max errors against `dense_experts` on one
device (value and gradients w.r.t. x, routing weights, gate_up, down) as JSON.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: device_workers
import device_workers  # noqa: E402

device_workers.use_fake_cpu_devices(8)

import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from device_workers import max_err, scale  # noqa: E402
from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.model import moe, moe_all_to_all, moe_grouped  # noqa: E402

E, H, I, T, K = 8, 32, 16, 64, 2


def problem():
  ks = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(ks[0], (T, H))
  gate_up, down = jax.random.normal(ks[1], (E, 2 * I, H)) * 0.3, jax.random.normal(ks[2], (E, H, I)) * 0.3
  weights, idx = jax.lax.top_k(jax.nn.softmax(2 * jax.random.normal(ks[3], (T, E))), K)
  return x, weights, idx.astype(jnp.int32), gate_up, down


def value_and_grads(fn, x, weights, idx, gate_up, down):
  probe = jax.random.normal(jax.random.key(5), (T, H))
  loss = lambda x, w, g, d: jnp.sum(jnp.sin(fn(x, w, idx, g, d)) * probe)  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, weights, gate_up, down)


def run() -> dict:
  args = problem()
  want = value_and_grads(moe.dense_experts, *args)
  mesh = sh.make_mesh(sh.MeshConfig(fsdp=4, expert=2))
  kernels = {"gathered": moe_grouped.gathered_experts}
  if importlib.util.find_spec("tokamax") is not None:  # its 'xla' implementation: the wrapper, on CPU
    kernels["tokamax"] = functools.partial(moe_grouped.tokamax_experts, implementation="xla")
  out = {}
  for name, kernel in kernels.items():
    with sh.activation_sharding(mesh):  # each device its own tokens, weights gathered per layer
      got = value_and_grads(lambda x, w, i, g, d, kernel=kernel: moe.on_local_tokens(kernel, x, w, i, (g, d)), *args)
    out[f"{name}/local_tokens"] = {"err": max_err(got, want), "scale": scale(want)}
  for shape in ((4, 2), (1, 8)):  # all-to-all dispatch: tokens split over fsdp and expert / over expert alone
    fsdp, expert = shape
    a2a_mesh = sh.make_mesh(sh.MeshConfig(fsdp=fsdp, expert=expert))
    with sh.activation_sharding(a2a_mesh):
      got = value_and_grads(lambda x, w, i, g, d, m=a2a_mesh: moe.expert_parallel_experts(
          x, w, i, g, d, mesh=m, dispatch="all_to_all"), *args)
    out[f"all_to_all/fsdp{fsdp}_expert{expert}"] = {"err": max_err(got, want), "scale": scale(want)}
  if "tokamax" in kernels:  # expert parallelism with tokamax's grouped matmul
    moe_grouped.grouped_backend = lambda platform: "tokamax"
    moe_grouped.tokamax_implementations = lambda platform: ("xla",)
    with sh.activation_sharding(mesh):
      got = value_and_grads(lambda x, w, i, g, d: moe.expert_parallel_experts(x, w, i, g, d, mesh=mesh), *args)
    out["tokamax/expert_parallel"] = {"err": max_err(got, want), "scale": scale(want)}
  return out


def ragged_exchange_example() -> list[list[int]]:
  """`moe_all_to_all.ragged_exchange`'s CPU program on the example of `jax.lax.ragged_all_to_all`'s documentation
  (axis of size 2): each device's result."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  per_device = {  # operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
      0: ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
      1: ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1])}
  stacked = [jnp.array([per_device[0][i], per_device[1][i]], jnp.int32) for i in range(6)]  # [2, ...] each

  def f(*args):
    args = [a[0] for a in args]
    return moe_all_to_all.ragged_exchange(*args, axis="x", native=False)[None]

  spec = jax.sharding.PartitionSpec("x")
  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
  placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in stacked]
  return jax.device_get(fn(*placed)).tolist()


if __name__ == "__main__":
  result = {"devices": jax.device_count(), "cases": run(), "ragged_exchange_example": ragged_exchange_example()}
  with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
