"""Quantized experts under the `tiled` kernel (`qlora.QuantizedExperts`, `moe_tiled.frozen_tiled_experts`): one
expert dequantized at a time inside the loop, and the packed int4 storage (`qlora.stored` / `qlora.typed`).

References: `moe.dense_experts` (the einsum over every expert) run on weights dequantized in numpy from qwix's own
quantized values and scales, and the compiled step's memory analysis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.lora import qlora
from hackable_diffusion.model import moe
from test_qlora import numpy_dequantized

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 32, 16, 4, 2, 24
BLOCK = 16


def _routing(seed: int):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
  idx = np.stack([rng.choice(EXPERTS - 1, TOP_K, replace=False) for _ in range(TOKENS)])  # the last expert: unused
  w = jnp.asarray(rng.random((TOKENS, TOP_K)), jnp.float32)
  return x, w, jnp.asarray(idx, jnp.int32)


@pytest.mark.parametrize("mode", ["fp8", "int4"])
def test_tiled_quantized_experts_equal_dense_experts_on_the_dequantized_weights(mode):
  """Forward and the gradients in the input and the routing weights, against the einsum over all experts."""
  with nnx.use_eager_sharding(False):
    experts = moe.Experts(HIDDEN, INTER, EXPERTS, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32,
                          std=0.3, impl="tiled")
  spec = qlora.QuantizationSpec(mode=mode, block_size=BLOCK)
  qarrays = {p: qlora.quantize(getattr(experts, p)[...], spec, in_axis=2, out_axes=(0, 1))
             for p in qlora.EXPERT_PARAMS}
  quantized = qlora.QuantizedExperts(experts, qarrays, mode, jnp.float32)
  gate_up, down = (jnp.asarray(numpy_dequantized(qarrays[p].qvalue, qarrays[p].scale)) for p in qlora.EXPERT_PARAMS)
  x, w, idx = _routing(0)
  probe = jnp.asarray(np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)), jnp.float32)

  def ours(x, w):
    return jnp.sum(quantized(x, w, idx) * probe)

  def reference(x, w):
    return jnp.sum(moe.dense_experts(x, w, idx, gate_up, down) * probe)

  got, want = jax.jit(jax.value_and_grad(ours, (0, 1)))(x, w), jax.value_and_grad(reference, (0, 1))(x, w)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, r in zip(got[1], want[1]):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def _step_temporaries(per_expert: bool, experts: int, hidden: int = 256, inter: int = 1024) -> int:
  """Temporaries of the compiled input gradient of an int4 QuantizedExperts layer (8 tokens, top-2): dequantized
  per expert inside the tiled loop, or the whole layer first (`expert_weights`, then the tiled kernel)."""
  spec = qlora.QuantizationSpec(mode="int4", block_size=64)
  with nnx.use_eager_sharding(False):
    base = nnx.eval_shape(lambda: moe.Experts(hidden, inter, experts, rngs=nnx.Rngs(0), dtype=jnp.float32,
                                              param_dtype=jnp.float32, std=0.02, impl="tiled"))
    layer = nnx.eval_shape(lambda: qlora.QuantizedExperts(
        base, {p: qlora.quantize(jnp.zeros(getattr(base, p).shape), spec, in_axis=2, out_axes=(0, 1))
               for p in qlora.EXPERT_PARAMS}, "int4", jnp.float32))
  graph, state = nnx.split(layer)

  def loss(state, x, w, idx):
    m = nnx.merge(graph, state)
    if per_expert:
      y = m(x, w, idx)
    else:
      y = moe.experts_forward("tiled", x, w, idx, *m.expert_weights(tie=qlora.input_tie(x)))
    return jnp.sum(y ** 2)

  args = (state, jax.ShapeDtypeStruct((8, hidden), jnp.float32), jax.ShapeDtypeStruct((8, 2), jnp.float32),
          jax.ShapeDtypeStruct((8, 2), jnp.int32))
  return jax.jit(jax.grad(loss, 1)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_tiled_quantized_experts_never_hold_the_layer_dense():
  """Per expert the temporaries grow by the kernel's padding rows only (each expert's group is padded to whole
  tiles), not by its dense weights: measured on XLA:CPU 0.13 of an expert's fp32 weights when each is dequantized
  inside the loop, 3.1 (its weights several times over) when the layer is dequantized first."""
  dense_expert = 3 * 1024 * 256 * 4  # one expert's fp32 weights
  grow = {per: (_step_temporaries(per, 32) - _step_temporaries(per, 16)) / 16 for per in (True, False)}
  print(f"temporaries per expert: {grow[True] / dense_expert:.3f} dense experts per expert dequantized in the loop, "
        f"{grow[False] / dense_expert:.3f} dequantized whole")
  assert grow[False] >= dense_expert and grow[True] <= 0.2 * dense_expert


@pytest.mark.parametrize("shape", [(3, 8, 6), (5, 7)])
def test_int4_values_are_stored_two_per_byte(shape):
  """int4 values pack into uint8 along the last axis (kept as int4 when it is odd) and unpack bit for bit."""
  values = jnp.asarray(np.random.default_rng(0).integers(-8, 8, shape), jnp.int4)
  stored = qlora.stored(values, jnp.int4)
  if shape[-1] % 2 == 0:
    assert stored.dtype == jnp.uint8 and stored.shape == (*shape[:-1], shape[-1] // 2)
  else:
    assert stored.dtype == jnp.int4 and stored.shape == shape
  assert qlora.logical_shape(stored, jnp.int4) == shape
  back = qlora.typed(stored, jnp.int4)
  assert back.dtype == jnp.int4
  np.testing.assert_array_equal(np.asarray(back.astype(jnp.int8)), np.asarray(values.astype(jnp.int8)))
