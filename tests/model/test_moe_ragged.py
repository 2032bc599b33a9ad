"""`moe.ragged_experts` (sorted-token dispatch through `jax.lax.ragged_dot_general` on the stored HF layout) ==
`tiled_experts` == `dense_experts` (values and gradients, fp32, 1e-5), with uneven loads and an expert no token
chose; the program XLA gets for GPU/TPU reads the expert weights without any transposed copy (forward and
gradient); and `moe_impl='auto'`'s decision table and its one log line.

The no-copy check reads the HLO lowered for 'cuda' and 'tpu' (cross-platform lowering runs on CPU): the ragged
dots there are what those backends execute. XLA:CPU cannot show it: it has no ragged-dot kernel and jax lowers
`ragged_dot_general` on CPU to a dense masked dot over all experts, which transposes the weights for any layout
whose contracting axes are not adjacent (the swapaxes version and this one both measure 3.17x the weight bytes
for a 4-layer forward on CPU; see docs/scaling.md).
"""

from __future__ import annotations

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.model import layers, moe
from hackable_diffusion.model.config import ModelConfig, get_preset
from test_moe_tiled import H, I, assert_close, make_experts, random_routing, skewed_routing, value_and_grads


@pytest.mark.parametrize("routing", ["skewed", "random"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_ragged_equals_tiled_equals_dense(routing, top_k):
  num_experts, tokens = 8, 45
  weights, idx = (skewed_routing if routing == "skewed" else random_routing)(tokens, top_k, num_experts, seed=top_k)
  counts = np.bincount(np.asarray(idx).ravel(), minlength=num_experts)
  assert counts.max() > counts.min()  # uneven loads
  if routing == "skewed":
    assert counts[0] == tokens and counts[-1] == 0  # one expert chosen by every token, one by none
  x = jax.random.normal(jax.random.key(1), (tokens, H))
  dense = value_and_grads(make_experts(num_experts, "dense"), x, weights, idx)
  tiled = value_and_grads(make_experts(num_experts, "tiled"), x, weights, idx)
  ragged = value_and_grads(make_experts(num_experts, "ragged"), x, weights, idx)
  assert float(jnp.max(jnp.abs(dense[0]))) > 0.1
  assert float(jnp.max(jnp.abs(dense[3]))) > 0.1  # the weight gradients are not trivially zero
  for name, want, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), dense, tiled, ragged):
    assert_close(a, want, f"tiled {name}")
    assert_close(b, want, f"ragged {name}")


def test_grouped_matmul_uncovered_rows_are_zero():
  """Rows past the last group give 0 and get no gradient from garbage (what the expert-parallel path relies on)."""
  x = jax.random.normal(jax.random.key(0), (7, 4))
  w = jax.random.normal(jax.random.key(1), (3, 5, 4))
  sizes = jnp.array([2, 0, 3], jnp.int32)  # rows 5, 6 uncovered
  y = moe.grouped_matmul(x, w, sizes)
  want = np.concatenate([x[:2] @ w[0].T, x[2:5] @ w[2].T, np.zeros((2, 5))])
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)

  def reference(x, w):  # the groups by hand
    return jnp.concatenate([x[:2] @ w[0].T, x[2:5] @ w[2].T, jnp.zeros((2, 5))])

  grads = jax.grad(lambda x, w: jnp.sum(jnp.sin(moe.grouped_matmul(x, w, sizes))), argnums=(0, 1))(x, w)
  ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(reference(x, w))), argnums=(0, 1))(x, w)
  dx, dw = grads
  np.testing.assert_allclose(dx, ref[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dw, ref[1], rtol=1e-6, atol=1e-6)
  assert not np.any(np.asarray(dw[1])) and not np.any(np.asarray(dx[5:]))


# ---- the program for GPU/TPU: no transposed copy of the expert weights -------------------------------------------
E, BIG_I, BIG_H, T, K = 8, 256, 64, 4, 2  # weights (1.5 MiB fp32) dominate: a decode-sized step


def swapaxes_ragged(x, weights, idx, gate_up, down):
  """The previous `ragged_experts`: `jax.lax.ragged_dot` on per-call transposes of the weights (the check must
  catch it)."""
  tokens, top_k = idx.shape
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
  h = layers.gated_gelu(jax.lax.ragged_dot(x[order // top_k], jnp.swapaxes(gate_up, 1, 2), group_sizes))
  y = jax.lax.ragged_dot(h, jnp.swapaxes(down, 1, 2), group_sizes).astype(jnp.float32)
  y = y * weights.reshape(-1)[order][:, None]
  return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[order // top_k].add(y).astype(x.dtype)


def weight_copy_bytes(hlo: str, weight_shapes: set[tuple[int, ...]]) -> int:
  """Bytes moved by transposes / copies of a weight-sized array in an HLO module's text (read + write)."""
  sizes = {math.prod(s) for s in weight_shapes}
  moved = 0
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?\S+ = f32\[([\d,]*)\]\S* (?:transpose|copy)\(", line)
    if m and math.prod(int(d) for d in m.group(1).split(",") if d) in sizes:
      moved += 2 * 4 * math.prod(int(d) for d in m.group(1).split(",") if d)
  return moved


@pytest.fixture(scope="module")
def step_programs():
  """{(impl, 'fwd'|'grad', platform): HLO text} of one MoE step lowered for GPU and TPU."""
  gate_up = jax.random.normal(jax.random.key(0), (E, 2 * BIG_I, BIG_H))
  down = jax.random.normal(jax.random.key(1), (E, BIG_H, BIG_I))
  x = jax.random.normal(jax.random.key(2), (T, BIG_H))
  weights, idx = random_routing(T, K, E, seed=0)
  out = {}
  for name, fn in (("ragged", moe.ragged_experts), ("swapaxes", swapaxes_ragged)):
    def loss(x, gate_up, down, fn=fn):
      return jnp.sum(fn(x, weights, idx, gate_up, down) ** 2)

    for mode, f in (("fwd", loss), ("grad", jax.grad(loss, argnums=(0, 1, 2)))):
      traced = jax.jit(f).trace(x, gate_up, down)
      for platform in ("cuda", "tpu"):
        out[name, mode, platform] = traced.lower(lowering_platforms=(platform,)).as_text(dialect="hlo")
  return out, {gate_up.shape, down.shape}, (gate_up.size + down.size) * 4


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("mode", ["fwd", "grad"])
def test_ragged_step_reads_weights_without_copy(step_programs, platform, mode):
  programs, shapes, weight_bytes = step_programs
  hlo = programs["ragged", mode, platform]
  assert hlo.count("ragged-dot(") == (2 if mode == "fwd" else 6)  # the kernels really are ragged dots
  assert weight_copy_bytes(hlo, shapes) == 0
  # the weights are operands of the ragged dots as they are stored: [E, 2I, H] contracted on their last axis
  assert re.search(r"ragged-dot\([^)]*\), lhs_contracting_dims=\{1\}, rhs_contracting_dims=\{2\}", hlo)
  # and the check bites: the previous version's program moves >= 2x the weights' bytes in transposes
  assert weight_copy_bytes(programs["swapaxes", mode, platform], shapes) >= 2 * weight_bytes


# ---- moe_impl='auto' --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("requested, backend, expert_axis, want", [
    ("auto", "cpu", 1, "tiled"),
    ("auto", "cpu", 8, "tiled"),
    ("auto", "gpu", 1, "grouped"),
    ("auto", "tpu", 1, "grouped"),
    ("auto", "gpu", 4, "expert_parallel"),
    ("auto", "tpu", 8, "expert_parallel"),
    ("auto", "gpu", 3, "grouped"),  # 8 experts do not split 3 ways
    ("auto", "tpu", 5, "grouped"),  # 8 experts do not split 5 ways: the weights are replicated, grouped
    ("auto", "gpu", 16, "grouped"),  # 8 experts do not split 16 ways
    ("expert_parallel", "gpu", 1, "ragged"),  # no expert axis: nothing to split
    ("all_to_all", "tpu", 1, "ragged"),
    ("all_to_all", "cpu", 2, "all_to_all"),
    ("expert_parallel", "cpu", 2, "expert_parallel"),
    ("tiled", "gpu", 8, "tiled"),  # an explicit kernel is kept
    ("dense", "tpu", 1, "dense"),
    ("ragged", "cpu", 1, "ragged"),
])
def test_auto_decision_table(requested, backend, expert_axis, want):
  assert moe.choose_moe_impl(requested, backend, expert_axis, num_experts=8) == want


@pytest.mark.parametrize("expert_axis, top_k, want", [
    (8, 8, "expert_parallel"),  # the all-gather moves n = 8 rows per token, the all-to-all ~K = 8: the simpler one
    (16, 8, "all_to_all"),  # 16 devices: the all-to-all moves half the rows
    (16, 0, "expert_parallel"),  # top_k unknown
    (4, 2, "all_to_all"),
])
def test_auto_picks_the_all_to_all_when_the_expert_axis_exceeds_top_k(expert_axis, top_k, want):
  assert moe.choose_moe_impl("auto", "gpu", expert_axis, num_experts=128, top_k=top_k) == want


def test_auto_is_the_default_and_logged_once(caplog):
  assert ModelConfig.__dataclass_fields__["moe_impl"].default == "auto"
  hf = get_preset("tiny").to_hf_config()
  assert ModelConfig.from_hf_config(hf).moe_impl == "auto"
  moe._logged_choice.cache_clear()
  with caplog.at_level(logging.INFO, logger=moe.__name__):
    for _ in range(3):
      assert moe.resolve_moe_impl("auto", 4) == "tiled"
  lines = [r.getMessage() for r in caplog.records if r.name == moe.__name__]
  assert lines == ["MoE: moe_impl='auto' runs as 'tiled' (backend cpu, expert mesh axis 1, 4 experts, top 0)"]
  assert moe._logged_choice.cache_info().maxsize == 32  # bounded


def test_unknown_impl_is_one_line_error():
  x = jnp.zeros((2, H))
  w, idx = random_routing(2, 1, 4, seed=0)
  with pytest.raises(ValueError, match="moe_impl='sparse'; expected auto"):
    moe.experts_forward("sparse", x, w, idx, jnp.zeros((4, 2 * I, H)), jnp.zeros((4, H, I)))
