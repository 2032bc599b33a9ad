"""Building blocks of the DiffusionGemma backbone: RMSNorm, RoPE, dense MLP, router and experts.

Numerics follow transformers' `modeling_diffusion_gemma.py` (Gemma-4 text blocks): norms in fp32 with a plain
`weight` (initialised to ones, not `1 + weight`), GELU-tanh gated MLPs, a softmax router with renormalised
top-k weights times a per-expert scale. Parameters carry logical axis names (`embed`, `heads`, `kv`, `mlp`,
`vocab`, `expert`) that `hackable_diffusion.sharding` maps to mesh axes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.model.config import RopeConfig

Array = jax.Array


class Buffer(nnx.Variable):
  """A saved, non-trainable tensor (HF buffers such as `layer_scalar`)."""


def param(rngs: nnx.Rngs, init, shape: Sequence[int], dtype, axes: tuple[str | None, ...]) -> nnx.Param:
  """A parameter with logical-axis metadata (`out_sharding`), created without eager sharding."""
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=axes)


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, dtype, param_dtype,
           std: float) -> nnx.Linear:
  """A bias-free projection `x @ kernel` with `kernel: [d_in, d_out]` (HF stores the transpose)."""
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
      kernel_init=nnx.with_partitioning(nnx.initializers.normal(std), axes), rngs=rngs,
  )


def gelu_tanh(x: Array) -> Array:
  return jax.nn.gelu(x, approximate=True)


def rms_normalize(x: Array, eps: float) -> Array:
  """`x * (mean(x^2) + eps) ** -0.5` in fp32 (transformers uses `pow(-0.5)`, not rsqrt)."""
  x32 = x.astype(jnp.float32)
  return x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis; `with_scale=False` has no weight. Output in the input dtype."""

  def __init__(self, dim: int, *, eps: float, with_scale: bool = True, param_dtype=jnp.float32,
               axis_name: str | None = "embed"):
    self.eps = eps
    self.with_scale = with_scale
    if with_scale:
      self.weight = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis_name,))

  def __call__(self, x: Array) -> Array:
    y = rms_normalize(x, self.eps)
    if self.with_scale:
      y = y * self.weight[...].astype(jnp.float32)
    return y.astype(x.dtype)


# ---- rotary embeddings -------------------------------------------------------------------------------------------
def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Array:
  """Inverse frequencies `[head_dim // 2]` (zeros where a `proportional` rope leaves dimensions unrotated)."""
  if rope.rope_type == "default":
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv = 1.0 / (rope.theta ** exponents)
  else:  # proportional
    rotated = int(rope.partial_rotary_factor * head_dim // 2)
    exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim
    inv = jnp.concatenate([1.0 / (rope.theta ** exponents), jnp.zeros((head_dim // 2 - rotated,), jnp.float32)])
  return inv / rope.factor


def rope_cos_sin(positions: Array, inv_freq: Array, dtype) -> tuple[Array, Array]:
  """positions [B, L] int -> cos, sin [B, L, head_dim] (rotate-half layout: frequencies repeated twice)."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x [B, L, N, D]; cos/sin [B, L, D]. Rotate-half convention (not interleaved)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def tokens_2d(x: Array) -> Array:
  """x [..., D] -> [tokens, D].

  Projections run on 2-D token matrices: the weight gradient of a projection applied to a 3-D `[B, L, D]` input
  contracts two axes, which XLA:CPU lowers with a separate transposing copy of the activation gradient (measured
  4-10x slower than the 2-D form, whose transposition the matmul absorbs).
  """
  return x.reshape(-1, x.shape[-1])


# ---- feed-forward -----------------------------------------------------------------------------------------------
class MLP(nnx.Module):
  """Gated GELU-tanh MLP: `down(gelu_tanh(gate x) * up x)`."""

  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float):
    kw = dict(dtype=dtype, param_dtype=param_dtype, std=std)
    self.gate_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.up_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.down_proj = linear(rngs, intermediate, hidden, ("mlp", "embed"), **kw)

  def __call__(self, x: Array) -> Array:
    """x [..., H] -> [..., H] (computed on the flattened `[tokens, H]` matrix, see `tokens_2d`)."""
    flat = tokens_2d(x)
    return self.down_proj(gelu_tanh(self.gate_proj(flat)) * self.up_proj(flat)).reshape(x.shape)


class Router(nnx.Module):
  """Top-k softmax router. Reads the un-normed residual stream.

  `h = rmsnorm_noscale(x) * scale * hidden**-0.5`; `p = softmax(proj h)` in fp32; top-k, renormalised to sum 1,
  times `per_expert_scale[idx]`.
  """

  def __init__(self, hidden: int, num_experts: int, top_k: int, *, eps: float, rngs: nnx.Rngs, dtype, param_dtype,
               std: float):
    self.eps, self.top_k, self.hidden = eps, top_k, hidden
    self.proj = linear(rngs, hidden, num_experts, ("embed", None), dtype=dtype, param_dtype=param_dtype, std=std)
    self.scale = nnx.Param(jnp.ones((hidden,), param_dtype), out_sharding=("embed",))
    self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), param_dtype), out_sharding=(None,))

  def __call__(self, x: Array) -> tuple[Array, Array]:
    """x [T, H] -> (weights [T, K] float32, indices [T, K] int32)."""
    h = rms_normalize(x, self.eps).astype(x.dtype)
    h = h * self.scale[...].astype(x.dtype) * jnp.asarray(self.hidden ** -0.5, x.dtype)
    probs = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, self.top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * self.per_expert_scale[...].astype(jnp.float32)[idx]
    return weights, idx.astype(jnp.int32)


class Experts(nnx.Module):
  """Per-expert gated MLPs stored as 3-D tensors in the HF layout.

  `gate_up_proj [E, 2I, H]` (gate rows first, then up), `down_proj [E, H, I]`. `impl` (the same function, three
  ways; see `ModelConfig.moe_impl`): "tiled" (`tiled_experts`: each token through its top-k experts only),
  "dense" (every expert on every token, zero weight for the unselected), "ragged" (`jax.lax.ragged_dot`).
  """

  def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: nnx.Rngs, dtype, param_dtype,
               std: float, impl: str):
    init = nnx.initializers.normal(std)
    self.gate_up_proj = param(rngs, init, (num_experts, 2 * intermediate, hidden), param_dtype,
                              ("expert", "mlp", "embed"))
    self.down_proj = param(rngs, init, (num_experts, hidden, intermediate), param_dtype, ("expert", "embed", "mlp"))
    self.dtype, self.impl, self.intermediate = dtype, impl, intermediate

  def expert_weights(self) -> tuple[Array, Array]:
    """(gate_up [E, 2I, H], down [E, H, I]) in the compute dtype: the one place the kernels read the weights.

    Subclasses change what is read (LoRA updates, a quantized base dequantized here, inside the layer).
    """
    return self.gate_up_proj[...].astype(self.dtype), self.down_proj[...].astype(self.dtype)

  def __call__(self, x: Array, weights: Array, idx: Array) -> Array:
    """x [T, H], weights/idx [T, K] -> [T, H]."""
    gate_up, down = self.expert_weights()
    return experts_forward(self.impl, x, weights, idx, gate_up, down)


def experts_forward(impl: str, x: Array, weights: Array, idx: Array, gate_up: Array, down: Array) -> Array:
  """The expert mixture `sum_k weights[t, k] * mlp_{idx[t, k]}(x[t])` by `impl` ("tiled", "dense", "ragged").

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H].
  """
  if impl == "ragged":
    return ragged_experts(x, weights, idx, gate_up, down)
  if impl == "dense":
    return dense_experts(x, weights, idx, gate_up, down)
  return tiled_experts(x, weights, idx, gate_up, down)


def dense_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array) -> Array:
  """Every expert on every token, zero weight for the unselected (the reference the others are tested against)."""
  num_experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
  # combine[T, E]: routing weight of each expert for each token (0 when not selected)
  combine = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
  h = jnp.einsum("th,eih->eti", x, gate_up)  # [E, T, 2I]
  h = gelu_tanh(h[..., :intermediate]) * h[..., intermediate:]
  y = jnp.einsum("eti,ehi->eth", h, down)  # [E, T, H]
  return jnp.einsum("eth,te->th", y.astype(jnp.float32), combine).astype(x.dtype)


def ragged_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array) -> Array:
  """The (token, expert) pairs sorted by expert through `jax.lax.ragged_dot`."""
  tokens, top_k = idx.shape
  num_experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
  flat_expert = idx.reshape(-1)  # [T*K]
  order = jnp.argsort(flat_expert, stable=True)
  token_of = order // top_k
  group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
  xs = x[token_of]  # [T*K, H] sorted by expert
  h = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), group_sizes)  # [T*K, 2I]
  h = gelu_tanh(h[:, :intermediate]) * h[:, intermediate:]
  y = jax.lax.ragged_dot(h, jnp.swapaxes(down, 1, 2), group_sizes).astype(jnp.float32)  # [T*K, H]
  y = y * weights.reshape(-1)[order][:, None]
  return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


# ---- sparse experts: expert-sorted tiles ---------------------------------------------------------------------
class TileLayout(NamedTuple):
  """Where each (token, k) assignment goes in a slab of `R = n_tiles * tile` rows grouped by expert.

  Each expert's assignments fill whole tiles (its group padded to a multiple of `tile`, in expert order), so every
  tile belongs to one expert. Padding rows read token `T` (zeros) and are never read back.
  """

  dest: Array  # [T*K] slab row of assignment t*K + k
  token_of_row: Array  # [R] token read by each slab row (T: padding)
  first_tile: Array  # [E] first tile of each expert
  num_tiles: Array  # [E] tiles of each expert (0 for an expert no token chose)


def moe_tile_rows(assignments: int, num_experts: int, hidden: int) -> int:
  """Static rows per tile for `assignments = T*K` routed rows over `num_experts` experts of width `hidden`.

  Measured on XLA:CPU (forward and gradient, hidden 128..512, 4-8 experts, 81..2592 tokens): 64 once the experts
  are wide (hidden >= 256) and get >= 128 rows each on average, else 32 (smaller tiles lose more to per-tile
  overhead, larger ones to padding: up to `E * (tile - 1)` rows). 128 once every expert gets >= 1024 rows on
  average (the Sudoku training step: 5,184 encoder tokens, 4 experts; its step time 1.03 s -> 0.93 s).
  """
  if assignments >= 1024 * num_experts:
    return 128
  return 64 if hidden >= 256 and assignments >= 128 * num_experts else 32


def tile_layout(idx: Array, num_experts: int, tile: int) -> TileLayout:
  """idx [T, K] expert ids -> the slab layout; the slab has the static size `(T*K + E*(tile-1)) // tile` tiles."""
  tokens, top_k = idx.shape
  n_rows = (tokens * top_k + num_experts * (tile - 1)) // tile * tile
  flat_expert = idx.reshape(-1)  # [A], A = T*K
  onehot = jax.nn.one_hot(flat_expert, num_experts, dtype=jnp.int32)  # [A, E]
  rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [A] position within its expert's group
  num_tiles = (jnp.sum(onehot, axis=0) + tile - 1) // tile  # [E]
  first_tile = jnp.cumsum(num_tiles) - num_tiles  # [E]
  dest = first_tile[flat_expert] * tile + rank  # [A]
  token = jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k  # [A]
  token_of_row = jnp.full((n_rows,), tokens, jnp.int32).at[dest].set(token, unique_indices=True)  # [R]
  return TileLayout(dest, token_of_row, first_tile, num_tiles)


def _gated(pre: Array) -> Array:
  """pre [..., 2I] (gate, then up) -> `gelu_tanh(gate) * up` [..., I], as in `Experts._dense`."""
  half = pre.shape[-1] // 2
  return gelu_tanh(pre[..., :half]) * pre[..., half:]


def _tiles_forward(xs: Array, first_tile: Array, num_tiles: Array, gate_up: Array, down: Array, tile: int,
                   keep_pre: bool):
  """xs [R, H] -> ys [R, H] (and the gate/up pre-activations [R, 2I] when `keep_pre`).

  A scan over experts (each expert's weights sliced once) around a loop over that expert's tiles; tiles past the
  last expert's are never computed (their rows stay zero).
  """

  def expert(slabs, inputs):
    w_gate_up, w_down, first, count = inputs  # [2I, H], [H, I], tile index, tile count

    def one_tile(j, slabs):
      start = (first + j) * tile
      pre = jax.lax.dynamic_slice_in_dim(xs, start, tile) @ w_gate_up.T  # [G, 2I]
      y = _gated(pre) @ w_down.T  # [G, H]
      ys = jax.lax.dynamic_update_slice_in_dim(slabs[0], y.astype(slabs[0].dtype), start, 0)
      return (ys, jax.lax.dynamic_update_slice_in_dim(slabs[1], pre, start, 0)) if keep_pre else (ys,)

    return jax.lax.fori_loop(0, count, one_tile, slabs), None

  compute = jnp.result_type(xs.dtype, gate_up.dtype)
  slabs = (jnp.zeros(xs.shape, compute),)
  if keep_pre:
    slabs += (jnp.zeros((xs.shape[0], gate_up.shape[1]), compute),)
  return jax.lax.scan(expert, slabs, (gate_up, down, first_tile, num_tiles))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def tile_mlp(xs: Array, first_tile: Array, num_tiles: Array, gate_up: Array, down: Array, tile: int) -> Array:
  """Each expert's tiles of the slab xs [R, H] through its gated MLP -> [R, H] (see `TileLayout`).

  Differentiable in xs, gate_up [E, 2I, H] and down [E, H, I] by a hand-written backward pass with the same loop
  structure (autodiff would not reverse the dynamic-length tile loop).
  """
  return _tiles_forward(xs, first_tile, num_tiles, gate_up, down, tile, keep_pre=False)[0]


def _tile_mlp_fwd(xs, first_tile, num_tiles, gate_up, down, tile: int):
  # symbolic zeros: each array argument comes as (value, perturbed); frozen expert weights (LoRA) get no gradient,
  # so their [E, 2I, H] / [E, H, I] accumulators are not even built
  weights_trained = () if (gate_up.perturbed or down.perturbed) else None  # static in the residuals' structure
  xs, first_tile, num_tiles, gate_up, down = (a.value for a in (xs, first_tile, num_tiles, gate_up, down))
  ys, pre = _tiles_forward(xs, first_tile, num_tiles, gate_up, down, tile, keep_pre=True)
  return ys, (xs, first_tile, num_tiles, gate_up, down, pre, weights_trained)


def _tile_mlp_bwd(tile: int, residuals, d_ys: Array):
  xs, first_tile, num_tiles, gate_up, down, pre, weights_trained = residuals
  if isinstance(d_ys, jax.custom_derivatives.SymbolicZero):
    d_ys = jnp.zeros(d_ys.aval.shape, d_ys.aval.dtype)
  if weights_trained is None:
    return _tile_mlp_bwd_inputs(tile, xs, first_tile, num_tiles, gate_up, down, pre, d_ys), None, None, None, None
  acc = jnp.promote_types(gate_up.dtype, jnp.float32)  # weight gradients accumulate over tiles in fp32

  def expert(d_xs, inputs):
    w_gate_up, w_down, first, count = inputs  # [2I, H], [H, I], tile index, tile count

    def one_tile(j, carry):
      d_xs, d_gate_up, d_down = carry  # [R, H], [2I, H], [H, I]
      start = (first + j) * tile
      x = jax.lax.dynamic_slice_in_dim(xs, start, tile)  # [G, H]
      dy = jax.lax.dynamic_slice_in_dim(d_ys, start, tile)  # [G, H]
      act, gated_vjp = jax.vjp(_gated, jax.lax.dynamic_slice_in_dim(pre, start, tile))  # [G, I]
      (d_pre,) = gated_vjp((dy @ w_down).astype(act.dtype))  # [G, 2I]
      d_x = (d_pre @ w_gate_up).astype(d_xs.dtype)  # [G, H]
      return (jax.lax.dynamic_update_slice_in_dim(d_xs, d_x, start, 0), d_gate_up + (d_pre.T @ x).astype(acc),
              d_down + (dy.T @ act).astype(acc))

    zeros = (jnp.zeros(w_gate_up.shape, acc), jnp.zeros(w_down.shape, acc))
    d_xs, d_gate_up, d_down = jax.lax.fori_loop(0, count, one_tile, (d_xs, *zeros))
    return d_xs, (d_gate_up.astype(gate_up.dtype), d_down.astype(down.dtype))

  d_xs, (d_gate_up, d_down) = jax.lax.scan(expert, jnp.zeros_like(xs), (gate_up, down, first_tile, num_tiles))
  return d_xs, None, None, d_gate_up, d_down


def _tile_mlp_bwd_inputs(tile: int, xs, first_tile, num_tiles, gate_up, down, pre, d_ys) -> Array:
  """`_tile_mlp_bwd`'s input gradient alone (the expert weights are frozen)."""

  def expert(d_xs, inputs):
    w_gate_up, w_down, first, count = inputs

    def one_tile(j, d_xs):
      start = (first + j) * tile
      dy = jax.lax.dynamic_slice_in_dim(d_ys, start, tile)
      act, gated_vjp = jax.vjp(_gated, jax.lax.dynamic_slice_in_dim(pre, start, tile))
      (d_pre,) = gated_vjp((dy @ w_down).astype(act.dtype))
      return jax.lax.dynamic_update_slice_in_dim(d_xs, (d_pre @ w_gate_up).astype(d_xs.dtype), start, 0)

    return jax.lax.fori_loop(0, count, one_tile, d_xs), None

  return jax.lax.scan(expert, jnp.zeros_like(xs), (gate_up, down, first_tile, num_tiles))[0]


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd, symbolic_zeros=True)


def tiled_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                  tile_rows: int | None = None) -> Array:
  """`dense_experts`' function, computing only the selected (token, expert) pairs.

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. The T*K assignments are grouped
  by expert into tiles of `tile_rows` rows (default `moe_tile_rows`), run through `tile_mlp` and gathered back
  with their routing weights. Shapes are static (a slab of `<= T*K + E*(tile_rows-1)` rows); the number of tiles
  computed is not.
  """
  tokens, top_k = idx.shape
  num_experts, hidden = gate_up.shape[0], x.shape[-1]
  tile = tile_rows or moe_tile_rows(tokens * top_k, num_experts, hidden)
  layout = tile_layout(idx, num_experts, tile)
  xs = x.at[layout.token_of_row].get(mode="fill", fill_value=0)  # [R, H]
  ys = tile_mlp(xs, layout.first_tile, layout.num_tiles, gate_up, down, tile)  # [R, H]
  picked = ys[layout.dest].reshape(tokens, top_k, hidden).astype(jnp.float32)  # [T, K, H]
  return jnp.einsum("tkh,tk->th", picked, weights).astype(x.dtype)
