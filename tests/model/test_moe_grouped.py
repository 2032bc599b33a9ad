"""`moe_impl='grouped'` (`model/moe_grouped.py`): the plain-XLA gathered-tile path and the tokamax wrapper (run
through tokamax's 'xla' implementation on CPU; skipped without tokamax) equal `tiled` and `dense` (values and
gradients, fp32, 1e-5); the program lowered for 'cuda' at the DiffusionGemma 26B-A4B expert shape has no
`ragged-dot` (which XLA:GPU densifies) and its matmul FLOPs stay within 1.5x of the active experts' FLOPs."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from hackable_diffusion.model import moe, moe_grouped
from test_moe_tiled import H, assert_close, make_experts, random_routing, skewed_routing, value_and_grads


def _compare(routing, top_k, kernel_impl, num_experts=8, tokens=45):
  weights, idx = (skewed_routing if routing == "skewed" else random_routing)(tokens, top_k, num_experts, seed=top_k)
  x = jax.random.normal(jax.random.key(1), (tokens, H))
  dense = value_and_grads(make_experts(num_experts, "dense"), x, weights, idx)
  tiled = value_and_grads(make_experts(num_experts, "tiled"), x, weights, idx)
  got = value_and_grads(make_experts(num_experts, kernel_impl), x, weights, idx)
  assert float(jnp.max(jnp.abs(dense[3]))) > 0.1
  for name, want, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), dense, tiled, got):
    assert_close(a, want, f"tiled {name}")
    assert_close(b, a, f"{kernel_impl} {name} vs tiled")


@pytest.mark.parametrize("routing", ["skewed", "random"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_grouped_on_cpu_is_gathered_and_equals_tiled(routing, top_k):
  assert moe.grouped_kernel("cpu") is moe_grouped.gathered_experts
  _compare(routing, top_k, "grouped")


@pytest.mark.parametrize("tile_rows", [8, 16])
def test_gathered_tile_sizes(tile_rows):
  weights, idx = random_routing(45, 3, 8, seed=0)
  x = jax.random.normal(jax.random.key(1), (45, H))
  e = make_experts(8, "dense")
  gate_up, down = e.expert_weights()
  want = moe.dense_experts(x, weights, idx, gate_up, down)
  assert_close(moe_grouped.gathered_experts(x, weights, idx, gate_up, down, tile_rows=tile_rows), want)


def test_tokamax_wrapper_equals_tiled(monkeypatch):
  pytest.importorskip("tokamax")
  monkeypatch.setattr(moe, "grouped_kernel", lambda platform=None: jax.tree_util.Partial(
      moe_grouped.tokamax_experts, implementation="xla"))
  _compare("skewed", 3, "grouped")


def test_backend_choice_without_tokamax(monkeypatch, caplog):
  moe_grouped.grouped_backend.cache_clear()
  monkeypatch.setattr(moe_grouped, "tokamax_available", lambda: False)
  try:
    with caplog.at_level("INFO", logger=moe_grouped.__name__):
      assert moe_grouped.grouped_backend("gpu") == "gathered"
      assert moe_grouped.grouped_backend("tpu") == "ragged"
      assert moe_grouped.grouped_backend("cpu") == "gathered"
    assert any("tokamax is not installed" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(moe_grouped, "tokamax_available", lambda: True)
    moe_grouped.grouped_backend.cache_clear()
    assert moe_grouped.grouped_backend("gpu") == "tokamax"
    assert moe_grouped.grouped_backend("cpu") == "gathered"
  finally:
    moe_grouped.grouped_backend.cache_clear()


def dot_flops(jaxpr) -> int:
  """2 * M * N * K summed over every dot_general of a jaxpr, its sub-jaxprs (custom VJPs, remat) included."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    for p in eqn.params.values():
      for j in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          total += dot_flops(inner)
  return total


def test_gathered_cuda_program_at_the_26b_shape():
  e, i, h, k, t = 128, 704, 2816, 8, 2048  # 26B-A4B experts; batch 8 x canvas 256 tokens
  bf16 = jnp.bfloat16
  args = (jax.ShapeDtypeStruct((t, h), bf16), jax.ShapeDtypeStruct((t, k), jnp.float32),
          jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((e, 2 * i, h), bf16),
          jax.ShapeDtypeStruct((e, h, i), bf16))
  active = 2 * t * k * (2 * i * h + h * i)  # forward matmul FLOPs of the selected experts

  def loss(*a):
    return jnp.sum(moe_grouped.gathered_experts(*a).astype(jnp.float32) ** 2)

  for fn, passes in ((loss, 1), (jax.grad(loss, argnums=(0, 3, 4)), 3)):
    flops = dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)
    assert flops <= 1.5 * passes * active, flops / (passes * active)
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    assert "ragged-dot(" not in hlo
    # nothing the size of the sorted rows broadcast over the experts ([E, T*K, H]: the densified ragged dot)
    largest = max(math.prod(int(d) for d in m.group(1).split(",") if d)
                  for m in re.finditer(r"\b(?:bf16|f32|s32|pred)\[([\d,]*)\]", hlo))
    assert largest < e * t * k * h, largest
