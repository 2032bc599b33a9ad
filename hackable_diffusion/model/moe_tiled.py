"""The `tiled` MoE kernel: the token-expert assignments grouped by expert into fixed-size tiles, one small matmul per
tile in a loop, with a written backward (`tile_mlp`). The fastest of the kernels on XLA:CPU (`model.moe` picks
it there); it computes `moe.dense_experts`' function on the same Hugging Face weight layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hackable_diffusion.model import layers, matmul

Array = jax.Array


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

  Chosen on XLA:CPU timings (forward and gradient, hidden 128..512, 4-8 experts, 81..2592 tokens;
  `scripts/benchmark_moe.py`): 64 once the experts are wide (hidden >= 256) and get >= 128 rows each on average,
  else 32 (smaller tiles lose more to per-tile overhead, larger ones to padding: up to `E * (tile - 1)` rows). 128
  once every expert gets >= 1024 rows on average (the Sudoku training step: 5,184 encoder tokens, 4 experts, is
  faster with them).
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


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
  """How each device holds the expert weights inside `jax.shard_map` (`moe.on_local_tokens`): per weight (gate_up,
  down), the mesh axes that split one expert's matrix and the dimension they split (None: held whole).

  `tile_mlp` then gathers one expert's matrix at a time (`all_gather`, forward and backward) and reduce-scatters
  that expert's gradient back to the shard (`psum_scatter`), so a layer's whole weights or gradients never exist
  at once: the FSDP pattern, per expert. The default holds everything whole (no collectives).
  """

  gate_up: tuple[tuple[str, ...], int] | None = None
  down: tuple[tuple[str, ...], int] | None = None

  def gather(self, pair: tuple[Array, Array]) -> tuple[Array, Array]:
    """One expert's (gate_up, down) shards -> whole [2I, H], [H, I]."""
    return tuple(w if s is None else jax.lax.all_gather(w, s[0], axis=s[1], tiled=True)
                 for w, s in zip(pair, (self.gate_up, self.down)))

  def scatter(self, pair: tuple[Array, Array]) -> tuple[Array, Array]:
    """One expert's whole gradients -> this device's shard of their sum over the split axes (`gather`'s
    transpose)."""
    return tuple(g if s is None else jax.lax.psum_scatter(g, s[0], scatter_dimension=s[1], tiled=True)
                 for g, s in zip(pair, (self.gate_up, self.down)))


WHOLE = ExpertSplit()


def _dot(a: Array, b: Array, bf16: bool) -> Array:
  """a [G, K] @ b [K, N] (bf16: bfloat16 operands, float32 result)."""
  return matmul.bf16_dot(a, b) if bf16 else a @ b


def _dot_t(a: Array, b: Array, bf16: bool) -> Array:
  """a [G, K] @ b[N, K]^T."""
  return matmul.bf16_dot(a, b, transpose_b=True) if bf16 else a @ b.T


def _dot_tn(a: Array, b: Array, bf16: bool) -> Array:
  """a[G, M]^T @ b [G, N] (a weight gradient)."""
  return matmul.bf16_dot_tn(a, b) if bf16 else a.T @ b


def _tiles_forward(xs: Array, first_tile: Array, num_tiles: Array, weights, decode: Callable, tile: int,
                   keep_pre: bool, bf16: bool = False):
  """xs [R, H] -> ys [R, H] (and the gate/up pre-activations [R, 2I] when `keep_pre`).

  A scan over experts around a loop over that expert's tiles; tiles past the last expert's are never computed
  (their rows stay zero). `weights`: a pytree whose leaves have a leading expert axis; `decode(expert's slice)` ->
  (gate_up [2I, H], down [H, I]) is called once per expert inside the scan, so only one expert's dense weights
  exist at a time (a quantized base dequantizes there).
  """

  def expert(slabs, inputs):
    stored, first, count = inputs  # one expert's slice of `weights`, tile index, tile count
    w_gate_up, w_down = decode(stored)  # [2I, H], [H, I]

    def one_tile(j, slabs):
      start = (first + j) * tile
      pre = _dot_t(jax.lax.dynamic_slice_in_dim(xs, start, tile), w_gate_up, bf16)  # [G, 2I]
      y = _dot_t(layers.gated_gelu(pre), w_down, bf16)  # [G, H]
      ys = jax.lax.dynamic_update_slice_in_dim(slabs[0], y.astype(slabs[0].dtype), start, 0)
      return ((ys, jax.lax.dynamic_update_slice_in_dim(slabs[1], pre.astype(slabs[1].dtype), start, 0)) if keep_pre
              else (ys,))

    return jax.lax.fori_loop(0, count, one_tile, slabs), None

  gate_up, _ = jax.eval_shape(decode, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), weights))
  compute = jnp.result_type(xs.dtype, gate_up.dtype)
  # zeros_like: inside `jax.shard_map` the slabs vary over the mesh axes the tokens do (`moe.on_local_tokens`)
  slabs = (jnp.zeros_like(xs, compute),)
  if keep_pre:
    slabs += (jnp.zeros_like(xs, compute, shape=(xs.shape[0], gate_up.shape[0])),)
  return jax.lax.scan(expert, slabs, (weights, first_tile, num_tiles))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def tile_mlp(xs: Array, first_tile: Array, num_tiles: Array, gate_up: Array, down: Array, tile: int,
             split: ExpertSplit = WHOLE, bf16: bool = False) -> Array:
  """Each expert's tiles of the slab xs [R, H] through its gated MLP -> [R, H] (see `TileLayout`).

  Differentiable in xs, gate_up [E, 2I, H] and down [E, H, I] by a hand-written backward pass with the same loop
  structure (autodiff would not reverse the dynamic-length tile loop). `split`: the weights are this device's
  shards, gathered one expert at a time (`ExpertSplit`). `bf16`: every product (forward and backward) takes
  bfloat16 operands and accumulates in float32 (`model/matmul.py`).
  """
  return _tiles_forward(xs, first_tile, num_tiles, (gate_up, down), split.gather, tile, False, bf16)[0]


def _tile_mlp_fwd(xs, first_tile, num_tiles, gate_up, down, tile: int, split: ExpertSplit, bf16: bool):
  # symbolic zeros: each array argument comes as (value, perturbed); frozen expert weights (LoRA) get no gradient,
  # so their [E, 2I, H] / [E, H, I] accumulators are not even built
  weights_trained = () if (gate_up.perturbed or down.perturbed) else None  # static in the residuals' structure
  xs, first_tile, num_tiles, gate_up, down = (a.value for a in (xs, first_tile, num_tiles, gate_up, down))
  ys, pre = _tiles_forward(xs, first_tile, num_tiles, (gate_up, down), split.gather, tile, True, bf16)
  return ys, (xs, first_tile, num_tiles, gate_up, down, pre, weights_trained)


def _tile_mlp_bwd(tile: int, split: ExpertSplit, bf16: bool, residuals, d_ys: Array):
  xs, first_tile, num_tiles, gate_up, down, pre, weights_trained = residuals
  if isinstance(d_ys, jax.custom_derivatives.SymbolicZero):
    d_ys = jnp.zeros_like(residuals[0], d_ys.aval.dtype)  # [R, H] like xs (and its mesh variance)
  if weights_trained is None:
    d_xs = _tile_mlp_bwd_inputs(tile, xs, first_tile, num_tiles, (gate_up, down), split.gather, pre, d_ys, bf16)
    return d_xs, None, None, None, None
  acc = jnp.promote_types(gate_up.dtype, jnp.float32)  # weight gradients accumulate over tiles in fp32

  def expert(d_xs, inputs):
    shard_gate_up, shard_down, first, count = inputs  # this device's [2I, H], [H, I] (whole unless split)
    w_gate_up, w_down = split.gather((shard_gate_up, shard_down))  # [2I, H], [H, I]

    def one_tile(j, carry):
      d_xs, d_gate_up, d_down = carry  # [R, H], [2I, H], [H, I]
      start = (first + j) * tile
      x = jax.lax.dynamic_slice_in_dim(xs, start, tile)  # [G, H]
      dy = jax.lax.dynamic_slice_in_dim(d_ys, start, tile)  # [G, H]
      act, gated_vjp = jax.vjp(layers.gated_gelu, jax.lax.dynamic_slice_in_dim(pre, start, tile))  # [G, I]
      (d_pre,) = gated_vjp(_dot(dy, w_down, bf16).astype(act.dtype))  # [G, 2I]
      d_x = _dot(d_pre, w_gate_up, bf16).astype(d_xs.dtype)  # [G, H]
      return (jax.lax.dynamic_update_slice_in_dim(d_xs, d_x, start, 0),
              d_gate_up + _dot_tn(d_pre, x, bf16).astype(acc), d_down + _dot_tn(dy, act, bf16).astype(acc))

    zeros = (jnp.zeros_like(w_gate_up, acc), jnp.zeros_like(w_down, acc))
    d_xs, d_gate_up, d_down = jax.lax.fori_loop(0, count, one_tile, (d_xs, *zeros))
    d_gate_up, d_down = split.scatter((d_gate_up, d_down))  # the shards' gradients, summed over the split axes
    return d_xs, (d_gate_up.astype(gate_up.dtype), d_down.astype(down.dtype))

  d_xs, (d_gate_up, d_down) = jax.lax.scan(expert, jnp.zeros_like(xs), (gate_up, down, first_tile, num_tiles))
  return d_xs, None, None, d_gate_up, d_down


def _tile_mlp_bwd_inputs(tile: int, xs, first_tile, num_tiles, weights, decode: Callable, pre, d_ys,
                         bf16: bool = False) -> Array:
  """`_tile_mlp_bwd`'s input gradient alone (the expert weights are frozen; `weights` / `decode` as
  `_tiles_forward`'s, each expert decoded once more here)."""

  def expert(d_xs, inputs):
    stored, first, count = inputs
    w_gate_up, w_down = decode(stored)

    def one_tile(j, d_xs):
      start = (first + j) * tile
      dy = jax.lax.dynamic_slice_in_dim(d_ys, start, tile)
      act, gated_vjp = jax.vjp(layers.gated_gelu, jax.lax.dynamic_slice_in_dim(pre, start, tile))
      (d_pre,) = gated_vjp(_dot(dy, w_down, bf16).astype(act.dtype))
      return jax.lax.dynamic_update_slice_in_dim(d_xs, _dot(d_pre, w_gate_up, bf16).astype(d_xs.dtype), start, 0)

    return jax.lax.fori_loop(0, count, one_tile, d_xs), None

  return jax.lax.scan(expert, jnp.zeros_like(xs), (weights, first_tile, num_tiles))[0]


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def frozen_tile_mlp(xs: Array, first_tile: Array, num_tiles: Array, weights, decode: Callable, tile: int) -> Array:
  """`tile_mlp` for frozen expert weights kept encoded (e.g. quantized): `weights` is a pytree with a leading
  expert axis, `decode(one expert's slice)` -> (gate_up [2I, H], down [H, I]) runs inside the loop over experts,
  in the forward pass and again in the backward pass, so one expert's dense weights are alive at a time.
  Differentiable in xs only (the weights get no gradient)."""
  return _tiles_forward(xs, first_tile, num_tiles, weights, decode, tile, keep_pre=False)[0]


def _frozen_tile_mlp_fwd(xs, first_tile, num_tiles, weights, decode: Callable, tile: int):
  ys, pre = _tiles_forward(xs, first_tile, num_tiles, weights, decode, tile, keep_pre=True)
  return ys, (xs, first_tile, num_tiles, weights, pre)


def _frozen_tile_mlp_bwd(decode: Callable, tile: int, residuals, d_ys: Array):
  xs, first_tile, num_tiles, weights, pre = residuals
  return _tile_mlp_bwd_inputs(tile, xs, first_tile, num_tiles, weights, decode, pre, d_ys), None, None, None


frozen_tile_mlp.defvjp(_frozen_tile_mlp_fwd, _frozen_tile_mlp_bwd)


def tiled_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                  tile_rows: int | None = None, split: ExpertSplit = WHOLE, bf16: bool = False) -> Array:
  """`dense_experts`' function, computing only the selected (token, expert) pairs.

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. The T*K assignments are grouped
  by expert into tiles of `tile_rows` rows (default `moe_tile_rows`), run through `tile_mlp` and gathered back
  with their routing weights. Shapes are static (a slab of `<= T*K + E*(tile_rows-1)` rows); the number of tiles
  computed is not. `split`: inside `jax.shard_map`, the weights are this device's shards (`ExpertSplit`).
  `bf16`: bfloat16 products with float32 accumulation (`tile_mlp`).
  """
  mlp = lambda xs, layout, tile: tile_mlp(xs, layout.first_tile, layout.num_tiles, gate_up, down, tile, split, bf16)
  return _routed(x, weights, idx, gate_up.shape[0], mlp, tile_rows)


def frozen_tiled_experts(x: Array, weights: Array, idx: Array, stored, decode: Callable, num_experts: int,
                         tile_rows: int | None = None) -> Array:
  """`tiled_experts` on frozen expert weights kept encoded: `stored` (a pytree, leading expert axis) decoded one
  expert at a time by `decode` inside the loop (`frozen_tile_mlp`). Differentiable in x (and the routing weights)
  only."""
  mlp = lambda xs, layout, tile: frozen_tile_mlp(xs, layout.first_tile, layout.num_tiles, stored, decode, tile)
  return _routed(x, weights, idx, num_experts, mlp, tile_rows)


def _routed(x: Array, weights: Array, idx: Array, num_experts: int, mlp: Callable, tile_rows: int | None) -> Array:
  """Groups the assignments idx [T, K] into expert tiles, runs `mlp(xs [R, H], layout, tile)` and gathers the
  rows back with their routing weights [T, K] -> [T, H]."""
  tokens, top_k = idx.shape
  hidden = x.shape[-1]
  tile = tile_rows or moe_tile_rows(tokens * top_k, num_experts, hidden)
  layout = tile_layout(idx, num_experts, tile)
  xs = x.at[layout.token_of_row].get(mode="fill", fill_value=0)  # [R, H]
  ys = mlp(xs, layout, tile)  # [R, H]
  picked = ys[layout.dest].reshape(tokens, top_k, hidden).astype(jnp.float32)  # [T, K, H]
  return jnp.einsum("tkh,tk->th", picked, weights).astype(x.dtype)
