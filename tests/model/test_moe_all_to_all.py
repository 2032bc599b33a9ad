"""The all-to-all expert dispatch as GPUs and TPUs get it: lowered for `cuda` and `tpu` on an abstract mesh of 8
devices (no accelerator needed), forward and gradients. The tokens' rows move only through ragged all-to-alls
(never an all-gather of rows, which is the CPU program's way), and the receive buffer has the dropless size.
Values and gradients against `dense_experts` on 8 fake CPU devices: tests/sharding/test_grouped_mesh.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from hackable_diffusion.model import moe, moe_all_to_all

E, H, I, T, K, N = 16, 64, 32, 128, 2, 8  # experts, hidden, expert width, tokens, top-k, devices


def _program(platform: str, grad: bool) -> str:
  mesh = AbstractMesh((N,), ("expert",), axis_types=(AxisType.Explicit,))
  spec = PartitionSpec("expert")

  def per_device(x, weights, idx, gate_up, down):
    return moe_all_to_all.all_to_all_experts(x, weights, idx, gate_up, down, axis="expert", mlp=moe.grouped_mlp,
                                             native=True)

  mixture = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
  split = NamedSharding(mesh, spec)
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=split) for shape, dtype in (
      ((T, H), jnp.float32), ((T, K), jnp.float32), ((T, K), jnp.int32), ((E, 2 * I, H), jnp.float32),
      ((E, H, I), jnp.float32))]
  fn = mixture
  if grad:
    def fn(x, weights, idx, gate_up, down):
      loss = lambda x, w, g, d: jnp.sum(mixture(x, w, idx, g, d) ** 2)  # noqa: E731
      return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weights, gate_up, down)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
def test_rows_travel_by_ragged_all_to_all_only(platform, grad):
  hlo = _program(platform, grad)
  exchanges = re.findall(r"custom_call @ragged_all_to_all\([^)]*\).*?: \(tensor<((?:\d+x)*)([a-z]\w*)>", hlo)
  float_rows = [shape.rstrip("x") for shape, dtype in exchanges if dtype.startswith("f")]
  # forward: rows there and outputs back (+ the expert ids, int32); the gradients add the two transposes
  assert len(float_rows) == (4 if grad else 2), exchanges
  tokens_here, capacity = T // N * K, N * (T // N) * min(K, E // N)
  assert sorted(float_rows) == sorted([f"{tokens_here}x{H}", f"{capacity}x{H}"] * (2 if grad else 1))
  gathers = re.findall(r"stablehlo\.all_gather\"[^\n]*-> tensor<(?:\d+x)*([a-z]\w*)>", hlo)
  assert gathers and all(dtype == "i32" for dtype in gathers), gathers  # only the n x n send sizes

