"""bfloat16 products with float32 accumulation (`ModelConfig.matmul_dtype='bfloat16'`, model/matmul.py)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import matmul, moe, scan
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model


def bf16_round(x) -> np.ndarray:
  """x rounded to bfloat16 (round to nearest even), as float64."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def dot_operand_dtypes(hlo: str) -> list[tuple[str, str]]:
  """The element types of every `dot`'s two operands in optimised HLO text."""
  types, dots = {}, []
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", line)
    if m:
      types[m.group(1)] = m.group(2)
    m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[[^\]]*\]\S* dot\(%([^,]+), %([^)]+)\)", line)
    if m:
      dots.append((types.get(m.group(1)), types.get(m.group(2))))
  return dots


@pytest.mark.parametrize("transpose_b", [False, True])
def test_bf16_matmul_and_gradients_match_float64_on_rounded_operands(transpose_b):
  """Forward, input gradient and weight gradient are exact products of the bfloat16-rounded operands (and the
  rounded output gradient), accumulated in float32: checked against float64 numpy."""
  m, k, n = 37, 64, 24
  ka, kb, kg = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(ka, (m, k))
  b = jax.random.normal(kb, (n, k) if transpose_b else (k, n))
  g = jax.random.normal(kg, (m, n))
  out, vjp = jax.vjp(lambda a, b: matmul.bf16_matmul(a, b, transpose_b), a, b)
  da, db = vjp(g)
  a64, b64, g64 = bf16_round(a), bf16_round(b), bf16_round(g)
  bmat = b64.T if transpose_b else b64  # [K, N]
  want_out, want_da, want_db = a64 @ bmat, g64 @ bmat.T, a64.T @ g64  # db in [K, N]
  if transpose_b:
    want_db = want_db.T
  for name, got, want in (("out", out, want_out), ("da", da, want_da), ("db", db, want_db)):
    assert got.dtype == jnp.float32, name
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=name)
  # and they are not the float32 products (the rounding is real): a fp32 matmul is ~1e-2 relative away
  assert np.abs(np.asarray(out) - np.asarray(a) @ np.asarray(bmat.astype(np.float32))).max() > 1e-3


def test_every_product_of_the_gradient_reads_bfloat16():
  """XLA:CPU upcasts a bf16 dot whose left operand contracts its major axis (the weight gradient) to float32;
  `row_major_transpose` prevents that. All three dots of value-and-gradient keep bfloat16 operands."""
  a, b = jnp.ones((96, 32)), jnp.ones((32, 48))
  loss = lambda a, b: jnp.sum(jnp.sin(matmul.bf16_matmul(a, b)))  # noqa: E731
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(a, b).compile().as_text()
  dots = dot_operand_dtypes(hlo)
  assert len(dots) == 3, dots
  assert all(pair == ("bf16", "bf16") for pair in dots), dots


def test_linear_dot_general_keeps_leading_axes_and_dtype():
  x = jax.random.normal(jax.random.key(1), (2, 5, 16))
  w = jax.random.normal(jax.random.key(2), (16, 8))
  y = matmul.bf16_dot_general(x, w, (((2,), (0,)), ((), ())))
  assert y.shape == (2, 5, 8) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), bf16_round(x) @ bf16_round(w), rtol=0, atol=1e-5 * 16)
  with pytest.raises(ValueError, match="only x"):
    matmul.bf16_dot_general(x, w.T, (((2,), (1,)), ((), ())))


def _experts(impl: str, matmul_dtype: str) -> moe.Experts:
  with nnx.use_eager_sharding(False):
    return moe.Experts(32, 16, 4, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32, std=0.3, impl=impl,
                       matmul_dtype=matmul_dtype)


def _experts_value_and_grads(experts: moe.Experts, x, weights, idx):
  graphdef, params = nnx.split(experts)
  probe = jax.random.normal(jax.random.key(7), (x.shape[0], x.shape[1]))

  def loss(params, x):
    out = nnx.merge(graphdef, params)(x, weights, idx)  # [T, H]
    return jnp.sum(out * probe), out  # linear in the output: rounding errors are not amplified

  (_, out), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return [out, g_x, g_params["gate_up_proj"][...], g_params["down_proj"][...]]


def test_tiled_experts_in_bfloat16_track_the_float32_reference():
  """The tiled kernel's bf16 products (forward and hand-written backward) stay within bf16 rounding of the dense
  float32 experts, and do differ from them (the bf16 path is the one that ran)."""
  tokens = 45
  logits = jax.random.normal(jax.random.key(3), (tokens, 4)) * 2.0
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), 2)
  x = jax.random.normal(jax.random.key(1), (tokens, 32))
  want = _experts_value_and_grads(_experts("dense", "auto"), x, weights, idx.astype(jnp.int32))
  got = _experts_value_and_grads(_experts("tiled", "bfloat16"), x, weights, idx.astype(jnp.int32))
  for name, g, w in zip(("out", "d_x", "d_gate_up", "d_down"), got, want):
    g, w = np.asarray(g), np.asarray(w)
    scale = np.abs(w).max()
    err = np.abs(g - w).max()
    assert err <= 2e-2 * scale, f"{name}: {err:.3g} at scale {scale:.3g}"
    assert err > 1e-6 * scale, f"{name}: identical to float32 (bf16 path not taken)"


def test_model_in_bfloat16_products_tracks_float32_and_rejects_unknown_values():
  cfg = get_preset("tiny")
  ref = init_model(cfg, seed=0)
  fast = init_model(dataclasses.replace(cfg, matmul_dtype="bfloat16"), seed=0)
  ids = jax.random.randint(jax.random.key(0), (2, cfg.canvas_length), 3, cfg.vocab_size)
  prompt = jax.random.randint(jax.random.key(1), (2, 6), 3, cfg.vocab_size)

  def logits(model):
    cache = model.init_cache(2, 6 + cfg.canvas_length)
    _, cache = model.encode(prompt, cache)
    return np.asarray(model.decode(ids, cache))

  want, got = logits(ref), logits(fast)
  err = np.abs(got - want).max()
  assert err <= 2e-2 * np.abs(want).max(), err
  assert err > 0
  with pytest.raises(ConfigError, match="matmul_dtype='fp8'"):
    dataclasses.replace(cfg, matmul_dtype="fp8")


def test_model_wires_every_projection_but_the_router_and_the_head():
  """Every nnx.Linear but the router's takes the bf16 product, every expert block the bf16 tiled kernel, and the
  untiled tied head is the bf16-rounded product (float64 reference) before the softcap; stacking the layers
  (`scan_layers`) keeps all of it."""
  cfg = dataclasses.replace(get_preset("tiny"), matmul_dtype="bfloat16")
  model = init_model(cfg, seed=0)
  linears = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)]
  assert len(linears) > cfg.num_hidden_layers * 4
  for path, node in linears:
    want = jax.lax.dot_general if "router" in path else matmul.bf16_dot_general
    assert node.dot_general is want, path
  assert all(layer.experts.matmul_dtype == "bfloat16" for layer in model.layers)
  hidden = jax.random.normal(jax.random.key(2), (2, 3, cfg.hidden_size))
  z = bf16_round(hidden).reshape(6, -1) @ bf16_round(model.embed_tokens[...]).T  # [6, V]
  cap = cfg.final_logit_softcapping
  want = (np.tanh(z / cap) * cap).reshape(2, 3, -1)
  np.testing.assert_allclose(np.asarray(model.lm_logits(hidden)), want, rtol=0, atol=1e-5 * np.abs(want).max())
  stacked = scan.stack_layers(init_model(cfg, seed=0))
  ids = jax.random.randint(jax.random.key(0), (2, cfg.canvas_length), 3, cfg.vocab_size)
  prompt = jax.random.randint(jax.random.key(1), (2, 6), 3, cfg.vocab_size)

  def logits(m):
    _, cache = m.encode(prompt, m.init_cache(2, 6 + cfg.canvas_length))
    return np.asarray(m.decode(ids, cache))

  np.testing.assert_array_equal(logits(stacked), logits(model))
