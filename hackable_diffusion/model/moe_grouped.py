"""The `grouped` MoE kernel for GPU/TPU: the top-k expert matmuls as grouped GEMMs, never as a dense product.

`jax.lax.ragged_dot_general` (the `ragged` kernel) is what a grouped GEMM should be, but XLA:GPU rewrites its
`ragged-dot` into a dense product over all experts unless the process runs with
`--xla_gpu_experimental_use_ragged_dot_fusion` (the input is broadcast to `[E, M, K]`: E times the expert FLOPs,
128x for DiffusionGemma 26B-A4B). This module runs the same function two ways, picked by `grouped_backend`:

  tokamax   tokamax's `ragged_dot_general` (optional dependency: `pip install -e ".[kernels]"`): a
            Pallas kernel (Triton or Mosaic GPU on GPU, Mosaic on TPU) over `[block_m, block_n]` output tiles, each
            tile computing one group's rows; forward, input gradient and weight gradient are each one kernel call
            with the dimension numbers tokamax implements (`grouped_matmul_tokamax`). Its GPU kernels take the
            forward's weights as `[G, in, out]`, so tokamax transposes them there (one weight-sized copy per
            call); Mosaic TPU contracts the stored layout directly.
  gathered  plain XLA, no extra dependency (`gathered_experts`): the assignments sorted by expert into tiles of
            `t` rows (`moe_tiled.tile_layout`), every tile's expert weights gathered (`[n_tiles, 2I, H]`) and all
            tiles run as one batched matmul. FLOPs: `n_tiles * t` rows, at most `T*K + E*(t-1)`; `t` is chosen so
            that this is <= 1.5 x T*K where the batch allows (`gathered_tile_rows`). The price is bytes: each
            tile reads its own copy of its expert's weights (~ n_tiles / E times the weight bytes).

Both compute `moe.dense_experts`' function on the Hugging Face layout (`gate_up [E, 2I, H]`, `down [E, H, I]`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hackable_diffusion.model import layers
from hackable_diffusion.model.moe_tiled import tile_layout

Array = jax.Array
_LOG = logging.getLogger(__name__)


def tokamax_available() -> bool:
  """Whether the optional `tokamax` kernel library is importable."""
  return importlib.util.find_spec("tokamax") is not None


@functools.lru_cache(maxsize=8)
def grouped_backend(platform: str) -> str:
  """How the `grouped` kernel runs on `platform` ('cpu', 'gpu', 'tpu'): 'tokamax' on GPU/TPU when tokamax is
  installed; else 'ragged' on TPU (XLA:TPU runs `ragged-dot` natively) and 'gathered' on GPU and CPU. Logs one
  note per platform when tokamax is missing on GPU/TPU."""
  if platform in ("gpu", "cuda", "rocm", "tpu"):
    if tokamax_available():
      return "tokamax"
    _LOG.info("MoE grouped kernel: tokamax is not installed (pip install -e '.[kernels]'); "
              "running the %s path on %s", "ragged" if platform == "tpu" else "gathered", platform)
    return "ragged" if platform == "tpu" else "gathered"
  return "gathered"


# ---- tokamax ------------------------------------------------------------------------------------------------------
# x [M, in] . w [G, out, in] -> [M, out] (the stored HF layout; tokamax's TRANS_RHS numbers)
_ROWS_TIMES_W = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# dy [M, out] . w [G, out, in] -> [M, in] (tokamax's default numbers)
_ROWS_TIMES_W_T = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# dy [M, out] . x [M, in] over each group's rows -> [G, out, in] (tokamax's ragged-contracting numbers)
_PER_GROUP_OUTER = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

# tokamax implementations tried in order (the first that does not raise NotImplementedError runs). Never its 'xla'
# one on GPU (that is `jax.lax.ragged_dot` again, densified); on TPU it is the fallback for shapes Mosaic refuses
# (any non-expert dimension < 128), which XLA:TPU runs natively.
KERNEL_IMPLEMENTATIONS = {"gpu": ("mosaic", "triton"), "tpu": ("mosaic", "xla")}


def tokamax_implementations(platform: str) -> tuple[str, ...]:
  """The tokamax implementations tried on `platform`, in order."""
  return KERNEL_IMPLEMENTATIONS["tpu" if platform == "tpu" else "gpu"]


def _mask_rows(y: Array, group_sizes: Array) -> Array:
  covered = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(covered.reshape((-1,) + (1,) * (y.ndim - 1)), y, jnp.zeros((), y.dtype))


def _tokamax_dot(lhs, rhs, group_sizes, numbers, implementation):
  from absl import flags  # tokamax's dependency
  import tokamax  # optional dependency, imported only when used

  if not flags.FLAGS.is_parsed():
    # tokamax reads its options from absl flags and would parse this process's argv (argparse's, or pytest's) on
    # first use, failing on flags it does not know: outside an absl program its options keep their defaults
    flags.FLAGS([sys.argv[0] if sys.argv else "hackable_diffusion"])
  return tokamax.ragged_dot_general(lhs, rhs, group_sizes, numbers, implementation=implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul_tokamax(x: Array, w: Array, group_sizes: Array, implementation=("mosaic", "triton")) -> Array:
  """`moe.grouped_matmul` (x [M, in] grouped by `group_sizes [G]`, times its group's `w[g] [out, in]` -> [M, out];
  rows past the groups give 0) through tokamax kernels; `implementation`: tokamax's names, tried in order ('xla'
  runs `jax.lax.ragged_dot_general`: what the CPU tests use)."""
  return _mask_rows(_tokamax_dot(x, w, group_sizes, _ROWS_TIMES_W, implementation), group_sizes)


def _tokamax_fwd(x, w, group_sizes, implementation):
  return grouped_matmul_tokamax(x, w, group_sizes, implementation), (x, w, group_sizes)


def _tokamax_bwd(implementation, residuals, dy):
  x, w, group_sizes = residuals
  dy = _mask_rows(dy.astype(jnp.result_type(x.dtype, w.dtype)), group_sizes)
  dx = _mask_rows(_tokamax_dot(dy, w, group_sizes, _ROWS_TIMES_W_T, implementation), group_sizes)
  dw = _tokamax_dot(dy, x, group_sizes, _PER_GROUP_OUTER, implementation)  # [G, out, in]
  return dx.astype(x.dtype), dw.astype(w.dtype), None


grouped_matmul_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)


def tokamax_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                    implementation=("mosaic", "triton")) -> Array:
  """`moe.ragged_experts` with every grouped matmul a tokamax kernel call (`grouped_matmul_tokamax`)."""
  tokens, top_k = idx.shape
  flat = idx.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
  mm = functools.partial(grouped_matmul_tokamax, implementation=implementation)
  ys = mm(layers.gated_gelu(mm(x[order // top_k], gate_up, group_sizes)), down, group_sizes)  # [A, H]
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  picked = ys[rank].reshape(tokens, top_k, -1).astype(jnp.float32)
  return jnp.einsum("tkh,tk->th", picked, weights).astype(x.dtype)


# ---- gathered tiles (plain XLA) -----------------------------------------------------------------------------------
def gathered_tile_rows(assignments: int, num_experts: int) -> int:
  """Rows per tile: the largest power of two <= assignments / (2 E), within [8, 128], so the padding
  `E * (t - 1)` stays <= assignments / 2 wherever the batch is large enough (8 rows at least: below that the
  matmuls stop filling the tensor cores)."""
  t = 8
  while t < 128 and 2 * t * 2 * num_experts <= assignments:
    t *= 2
  return t


# the backward pass keeps only the gate/up pre-activations ([R, 2I]) and gathers the tiles' weights again: saving
# the gathered weights ([n_tiles, 2I, H] + [n_tiles, H, I], ~n_tiles / E times the layer's expert weights) would
# hold several copies of the layer's weights until the backward pass
@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("gathered_moe_pre"))
def _tile_mlp(xt: Array, gate_up: Array, down: Array, expert_of_tile: Array) -> Array:
  """xt [N, t, H], tile n through expert `expert_of_tile[n]`'s gated MLP -> [N, t, H] (one batched matmul each)."""
  pre = jnp.einsum("nth,nih->nti", xt, gate_up[expert_of_tile])  # [N, t, 2I]
  pre = checkpoint_name(pre, "gathered_moe_pre")
  return jnp.einsum("nti,nhi->nth", layers.gated_gelu(pre), down[expert_of_tile])  # [N, t, H]


def gathered_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                     tile_rows: int | None = None) -> Array:
  """`moe.dense_experts`' function as batched matmuls over expert-sorted tiles with per-tile gathered weights.

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. Static shapes: the slab holds
  `n_tiles = (T*K + E*(t-1)) // t` tiles; tiles past the last expert's read zeros (padding rows read token T,
  filled with 0, and the gated MLP maps 0 to 0). Differentiable by autodiff (the weight gather's transpose
  sums each tile's gradient into its expert's; `_tile_mlp` saves only the pre-activations).
  """
  tokens, top_k = idx.shape
  num_experts, hidden = gate_up.shape[0], x.shape[-1]
  tile = tile_rows or gathered_tile_rows(tokens * top_k, num_experts)
  layout = tile_layout(idx, num_experts, tile)
  xs = x.at[layout.token_of_row].get(mode="fill", fill_value=0)  # [R, H]
  n_tiles = xs.shape[0] // tile
  # expert of each tile: tiles [first_tile[e], first_tile[e] + num_tiles[e]) are expert e's; unused tiles -> E-1
  ends = jnp.cumsum(layout.num_tiles)  # [E]
  expert_of_tile = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_tiles), side="right"), num_experts - 1)
  ys = _tile_mlp(xs.reshape(n_tiles, tile, hidden), gate_up, down, expert_of_tile).reshape(-1, hidden)
  picked = ys[layout.dest].reshape(tokens, top_k, hidden).astype(jnp.float32)  # [T, K, H]
  return jnp.einsum("tkh,tk->th", picked, weights).astype(x.dtype)
