"""`Experts(impl='tiled')` (`moe.tiled_experts`) is the dense path's function: forward and gradients, under jit
and vmap, with uneven routing (an expert chosen by every token, one chosen by none)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.model import moe, moe_tiled
from hackable_diffusion.model.transformer import init_model

H, I = 32, 16  # hidden, moe_intermediate


def assert_close(got, want, name: str = "") -> None:
  """max |got - want| <= 1e-5 * max(1, max |want|): fp32 rounding of sums taken in another order."""
  got, want = np.asarray(got), np.asarray(want)
  err, scale = float(np.max(np.abs(got - want))), max(1.0, float(np.max(np.abs(want))))
  assert err <= 1e-5 * scale, f"{name}: max abs error {err:.3g} at scale {scale:.3g}"


def make_experts(num_experts: int, impl: str) -> moe.Experts:
  """Same parameters for every impl (seeded), large enough for O(1) outputs."""
  with nnx.use_eager_sharding(False):
    return moe.Experts(H, I, num_experts, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32,
                          std=0.3, impl=impl)


def skewed_routing(tokens: int, top_k: int, num_experts: int, seed: int) -> tuple[jax.Array, jax.Array]:
  """(weights [T, K], idx [T, K]): every token picks expert 0, no token picks expert E-1, the other slots random
  distinct experts in [1, E-2]."""
  rng = np.random.default_rng(seed)
  idx = np.zeros((tokens, top_k), np.int32)
  for t in range(tokens):
    idx[t, 1:] = rng.permutation(np.arange(1, num_experts - 1))[: top_k - 1]
  idx = idx[:, rng.permutation(top_k)]  # expert 0 not always in slot 0
  weights = rng.uniform(0.1, 1.5, (tokens, top_k)).astype(np.float32)
  return jnp.asarray(weights), jnp.asarray(idx)


def random_routing(tokens: int, top_k: int, num_experts: int, seed: int) -> tuple[jax.Array, jax.Array]:
  """Top-k of random logits (softmax weights): roughly balanced, still uneven."""
  logits = jax.random.normal(jax.random.key(seed), (tokens, num_experts)) * 2.0
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), top_k)
  return weights, idx.astype(jnp.int32)


def dense_reference(x: jax.Array, weights: jax.Array, idx: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
  """`moe.dense_experts`: every expert on every token (gate_up [E, 2I, H], down [E, H, I])."""
  return moe.dense_experts(x, weights, idx, gate_up, down)


def value_and_grads(experts: moe.Experts, x: jax.Array, weights: jax.Array, idx: jax.Array):
  """(out [T, H], grads w.r.t. x, weights, gate_up_proj, down_proj) of a non-linear function of the output, jitted."""
  graphdef, params = nnx.split(experts)
  probe = jax.random.normal(jax.random.key(7), (x.shape[0], H))

  def loss(params, x, weights):
    out = nnx.merge(graphdef, params)(x, weights, idx)
    return jnp.sum(jnp.sin(out) * probe), out

  (_, out), (g_params, g_x, g_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      params, x, weights)
  return out, g_x, g_w, g_params["gate_up_proj"][...], g_params["down_proj"][...]


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("routing", ["skewed", "random"])
def test_tiled_matches_dense(num_experts, top_k, routing):
  tokens = 45  # not a multiple of the tile size
  weights, idx = (skewed_routing if routing == "skewed" else random_routing)(tokens, top_k, num_experts, seed=top_k)
  if routing == "skewed":
    counts = np.bincount(np.asarray(idx).ravel(), minlength=num_experts)
    assert counts[0] == tokens and counts[-1] == 0
  x = jax.random.normal(jax.random.key(1), (tokens, H))
  dense = value_and_grads(make_experts(num_experts, "dense"), x, weights, idx)
  tiled = value_and_grads(make_experts(num_experts, "tiled"), x, weights, idx)
  assert float(jnp.max(jnp.abs(dense[0]))) > 0.1  # a meaningful comparison
  for name, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), dense, tiled):
    assert_close(b, a, name)


@pytest.mark.parametrize("tile_rows", [1, 4, 8, 64])
def test_tile_sizes(tile_rows):
  """Several tiles per expert, one partial tile, and one tile larger than every group all give the same function."""
  num_experts, top_k, tokens = 4, 2, 37
  weights, idx = skewed_routing(tokens, top_k, num_experts, seed=0)
  x = jax.random.normal(jax.random.key(2), (tokens, H))
  experts = make_experts(num_experts, "dense")
  gate_up, down = experts.gate_up_proj[...], experts.down_proj[...]  # [E, 2I, H], [E, H, I]

  def f(x, weights, gate_up, down, tiled):
    if tiled:
      out = moe.tiled_experts(x, weights, idx, gate_up, down, tile_rows=tile_rows)
    else:
      out = dense_reference(x, weights, idx, gate_up, down)
    return jnp.sum(out ** 2)

  grad_fn = jax.value_and_grad(f, argnums=(0, 1, 2, 3))
  ref = jax.jit(grad_fn, static_argnums=4)(x, weights, gate_up, down, False)
  got = jax.jit(grad_fn, static_argnums=4)(x, weights, gate_up, down, True)
  assert_close(got[0], ref[0], "loss")
  for name, a, b in zip(("d_x", "d_weights", "d_gate_up", "d_down"), ref[1], got[1]):
    assert_close(b, a, name)


def test_default_tile_rows_on_large_groups_match_dense():
  """At the size where `moe_tile_rows` picks 128-row tiles (every expert >= 1,024 rows on average: the Sudoku
  training step), the default tiled path still equals the dense function (value and gradients)."""
  num_experts, top_k, tokens = 4, 2, 2100
  assert moe_tiled.moe_tile_rows(tokens * top_k, num_experts, H) == 128
  assert moe_tiled.moe_tile_rows(2000 * top_k, num_experts, H) == 32  # below the threshold: the small-hidden default
  weights, idx = skewed_routing(tokens, top_k, num_experts, seed=3)
  x = jax.random.normal(jax.random.key(4), (tokens, H))
  dense = value_and_grads(make_experts(num_experts, "dense"), x, weights, idx)
  tiled = value_and_grads(make_experts(num_experts, "tiled"), x, weights, idx)
  for name, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), dense, tiled):
    assert_close(b, a, name)


def test_layout():
  """Each expert's group starts a tile; the slab has the static bound; padding rows read the out-of-range token."""
  tokens, top_k, num_experts, tile = 13, 2, 4, 4
  _, idx = skewed_routing(tokens, top_k, num_experts, seed=3)
  layout = jax.jit(moe_tiled.tile_layout, static_argnums=(1, 2))(idx, num_experts, tile)
  rows = (tokens * top_k + num_experts * (tile - 1)) // tile * tile
  assert layout.token_of_row.shape == (rows,)
  dest = np.asarray(layout.dest)
  assert len(set(dest.tolist())) == dest.size  # one row per assignment
  token_of_row = np.asarray(layout.token_of_row)
  np.testing.assert_array_equal(token_of_row[dest], np.arange(tokens * top_k) // top_k)
  assert np.sum(token_of_row == tokens) == rows - tokens * top_k
  counts = np.bincount(np.asarray(idx).ravel(), minlength=num_experts)
  np.testing.assert_array_equal(np.asarray(layout.num_tiles), -(-counts // tile))
  for e, d in zip(np.asarray(idx).ravel(), dest):  # an assignment lies within its expert's tiles
    first = int(layout.first_tile[e])
    assert first * tile <= d < (first + int(layout.num_tiles[e])) * tile


def test_vmap():
  """vmapped over a leading batch (different routing per row) = the function row by row, gradients included."""
  num_experts, top_k, tokens, batch = 8, 2, 20, 3
  experts = make_experts(num_experts, "tiled")
  gate_up, down = experts.gate_up_proj[...], experts.down_proj[...]
  routes = [random_routing(tokens, top_k, num_experts, seed=s) for s in range(batch)]
  weights = jnp.stack([r[0] for r in routes])
  idx = jnp.stack([r[1] for r in routes])
  x = jax.random.normal(jax.random.key(3), (batch, tokens, H))

  def loss(x, gate_up, weights, idx, impl):
    return jnp.sum(jnp.tanh(impl(x, weights, idx, gate_up, down)))

  grad = jax.grad(loss, argnums=(0, 1))
  got_x, got_gu = jax.jit(jax.vmap(lambda *a: grad(*a, moe.tiled_experts), in_axes=(0, None, 0, 0)))(
      x, gate_up, weights, idx)
  for b in range(batch):
    ref_x, ref_gu = grad(x[b], gate_up, weights[b], idx[b], dense_reference)
    assert_close(got_x[b], ref_x, "d_x")
    assert_close(got_gu[b], ref_gu, "d_gate_up")


def test_model_default_matches_dense():
  """The tiny model with the default moe_impl ('auto': 'tiled' on CPU) gives the dense model's logits and parameter
  gradients."""
  from hackable_diffusion.model.config import get_preset

  cfg = get_preset("tiny")
  assert cfg.moe_impl == "auto" and moe.resolve_moe_impl(cfg.moe_impl, cfg.num_experts) == "tiled"
  ids = jax.random.randint(jax.random.key(4), (2, 6), 3, cfg.vocab_size)
  canvas = jax.random.randint(jax.random.key(5), (2, cfg.canvas_length), 3, cfg.vocab_size)

  def logits_and_grads(impl):
    graphdef, params, rest = nnx.split(init_model(cfg.replace(moe_impl=impl)), nnx.Param, ...)

    def loss(params):
      logits = nnx.merge(graphdef, params, rest)(ids, canvas)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads

  dense_logits, dense_grads = logits_and_grads("dense")
  tiled_logits, tiled_grads = logits_and_grads("tiled")
  np.testing.assert_allclose(tiled_logits, dense_logits, rtol=1e-5, atol=1e-4)
  for a, b in zip(jax.tree.leaves(dense_grads), jax.tree.leaves(tiled_grads)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
