"""Mixture of experts: the top-k router, the experts' 3-D weights, and the kernels that run them.

Every kernel computes the same function, `sum_k weights[t, k] * mlp_{idx[t, k]}(x[t])` with the gated GELU-tanh
expert MLP, on the weights in the Hugging Face layout (`gate_up [E, 2I, H]`, `down [E, H, I]`), so loading,
saving, LoRA and PEFT never see a second layout. `ModelConfig.moe_impl` picks one:

  tiled            expert-sorted tiles, one small matmul per tile in a loop (`tiled_experts`): fastest on XLA:CPU
  dense            every expert on every token, weighted 0 where not selected (`dense_experts`): the reference
  ragged           the token-expert assignments sorted by expert through `jax.lax.ragged_dot_general`, contracting
                   the stored weights' last axis, so no transposed copy of the weights is made (`ragged_experts`).
                   XLA:GPU runs it as a dense product over all experts (see `model/moe_grouped.py`)
  grouped          grouped GEMMs that XLA:GPU does not densify (`model/moe_grouped.py`): tokamax's Pallas kernels
                   where the optional `tokamax` is installed, else plain-XLA batched tiles on GPU/CPU and
                   `ragged` on TPU
  expert_parallel  `ragged` inside `jax.shard_map` over the `expert` mesh axis: each device runs only its own
                   experts on its group's all-gathered tokens (`expert_parallel_experts`)
  all_to_all       the same split of the experts, the assignments sent to their experts' devices and back by
                   ragged all-to-all (`model/moe_all_to_all.py`)
  auto             `choose_moe_impl`: CPU -> tiled; GPU/TPU -> grouped, or, when the active mesh
                   (`sharding.active_mesh`) has an `expert` axis > 1, expert_parallel (axis <= top_k) or
                   all_to_all (axis > top_k). Logged once per distinct choice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from hackable_diffusion.model import layers, moe_all_to_all, moe_grouped
from hackable_diffusion.model.moe_tiled import ExpertSplit, tiled_experts
from hackable_diffusion.sharding.local import gather_whole, row_axes, spec_axes, weight_spec
from hackable_diffusion.sharding.logical import active_mesh, active_rules, logical_to_mesh_spec

Array = jax.Array
_LOG = logging.getLogger(__name__)
EXPERT_AXIS = "expert"


class Router(nnx.Module):
  """Top-k softmax router. Reads the un-normed residual stream.

  `h = rmsnorm_noscale(x) * scale * hidden**-0.5`; `p = softmax(proj h)` in fp32; top-k, renormalised to sum 1,
  times `per_expert_scale[idx]`.
  """

  def __init__(self, hidden: int, num_experts: int, top_k: int, *, eps: float, rngs: nnx.Rngs, dtype, param_dtype,
               std: float):
    self.eps, self.top_k, self.hidden = eps, top_k, hidden
    self.proj = layers.linear(rngs, hidden, num_experts, ("embed", None), dtype=dtype, param_dtype=param_dtype,
                              std=std)
    self.scale = nnx.Param(jnp.ones((hidden,), param_dtype), out_sharding=("embed",))
    self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), param_dtype), out_sharding=(None,))

  def __call__(self, x: Array) -> tuple[Array, Array]:
    """x [T, H] -> (weights [T, K] float32, indices [T, K] int32; a token's K experts are distinct)."""
    h = layers.rms_normalize(x, self.eps).astype(x.dtype)
    h = h * self.scale[...].astype(x.dtype) * jnp.asarray(self.hidden ** -0.5, x.dtype)
    probs = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, self.top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * self.per_expert_scale[...].astype(jnp.float32)[idx]
    return weights, idx.astype(jnp.int32)


class Experts(nnx.Module):
  """Per-expert gated MLPs stored as 3-D tensors in the HF layout.

  `gate_up_proj [E, 2I, H]` (gate rows first, then up), `down_proj [E, H, I]`. `impl`: see the module docstring
  (`ModelConfig.moe_impl`).
  """

  def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: nnx.Rngs, dtype, param_dtype,
               std: float, impl: str, matmul_dtype: str = "auto"):
    init = nnx.initializers.normal(std)
    self.gate_up_proj = layers.param(rngs, init, (num_experts, 2 * intermediate, hidden), param_dtype,
                                     ("expert", "mlp", "embed"))
    self.down_proj = layers.param(rngs, init, (num_experts, hidden, intermediate), param_dtype,
                                  ("expert", "embed", "mlp"))
    self.dtype, self.impl, self.intermediate = dtype, impl, intermediate
    self.matmul_dtype = matmul_dtype  # 'bfloat16': the tiled kernel's products in bf16 (`ModelConfig.matmul_dtype`)

  def weight_shape(self, name: str) -> tuple[int, ...]:
    """The shape of expert tensor `name` ('gate_up_proj' [E, 2I, H] / 'down_proj' [E, H, I]) as the model uses it
    (a quantized subclass may store it packed)."""
    return tuple(getattr(self, name).shape)

  def expert_weights(self) -> tuple[Array, Array]:
    """(gate_up [E, 2I, H], down [E, H, I]) in the compute dtype: the one place the kernels read the weights.

    Subclasses change what is read (LoRA updates, a quantized base dequantized here, inside the layer).
    """
    return self.gate_up_proj[...].astype(self.dtype), self.down_proj[...].astype(self.dtype)

  def __call__(self, x: Array, weights: Array, idx: Array) -> Array:
    """x [T, H], weights/idx [T, K] -> [T, H]."""
    gate_up, down = self.expert_weights()
    return experts_forward(self.impl, x, weights, idx, gate_up, down, self.matmul_dtype)


# ---- choosing the kernel ------------------------------------------------------------------------------------------
def choose_moe_impl(requested: str, backend: str, expert_axis: int, num_experts: int, top_k: int = 0) -> str:
  """The kernel `requested` runs as on `backend` ('cpu', 'gpu', 'tpu') under a mesh whose `expert` axis has size
  `expert_axis` (1: no mesh), for `num_experts` experts, `top_k` per token (0: unknown). 'auto': CPU -> 'tiled';
  else, when the experts split evenly over an expert axis > 1, 'all_to_all' if that axis exceeds top_k (the
  all-to-all then moves fewer rows than the all-gather) and 'expert_parallel' otherwise; else 'grouped'.
  'expert_parallel' / 'all_to_all' without an expert axis run as 'ragged'; the other names run as themselves."""
  if requested == "auto":
    if backend == "cpu":
      return "tiled"
    if expert_axis > 1 and num_experts % expert_axis == 0:
      return "all_to_all" if 0 < top_k < expert_axis else "expert_parallel"
    return "grouped"
  if requested in ("expert_parallel", "all_to_all") and expert_axis <= 1:
    return "ragged"
  return requested


@functools.lru_cache(maxsize=32)
def _logged_choice(requested: str, backend: str, expert_axis: int, num_experts: int, top_k: int) -> str:
  """`choose_moe_impl`, logged once per distinct argument tuple (a bounded cache: at most 32 lines)."""
  choice = choose_moe_impl(requested, backend, expert_axis, num_experts, top_k)
  _LOG.info("MoE: moe_impl=%r runs as %r (backend %s, expert mesh axis %d, %d experts, top %d)", requested, choice,
            backend, expert_axis, num_experts, top_k)
  return choice


def resolve_moe_impl(requested: str, num_experts: int, mesh: Mesh | None = None, top_k: int = 0) -> str:
  """`choose_moe_impl` for the active mesh (`sharding.active_mesh()` unless given) and its devices' platform."""
  mesh = active_mesh() if mesh is None else mesh
  if mesh is None:
    backend, expert_axis = jax.default_backend(), 1
  else:
    backend, expert_axis = mesh.devices.flat[0].platform, int(dict(mesh.shape).get(EXPERT_AXIS, 1))
  return _logged_choice(requested, backend, expert_axis, num_experts, top_k)


def experts_forward(impl: str, x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                    matmul_dtype: str = "auto") -> Array:
  """The expert mixture `sum_k weights[t, k] * mlp_{idx[t, k]}(x[t])` by `impl` (any `ModelConfig.moe_impl`).

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. `matmul_dtype` ('auto' /
  'bfloat16', `ModelConfig.matmul_dtype`) applies to the `tiled` kernel; the others compute in the weights' dtype.
  """
  impl = resolve_moe_impl(impl, gate_up.shape[0], top_k=idx.shape[-1])
  if impl in ("expert_parallel", "all_to_all"):
    dispatch = "gather" if impl == "expert_parallel" else "all_to_all"
    return expert_parallel_experts(x, weights, idx, gate_up, down, mesh=active_mesh(), dispatch=dispatch)
  if impl == "ragged":
    return on_local_tokens(ragged_experts, x, weights, idx, (gate_up, down))
  if impl == "grouped":
    return on_local_tokens(grouped_kernel(), x, weights, idx, (gate_up, down))
  if impl == "dense":
    return dense_experts(x, weights, idx, gate_up, down)
  if impl == "tiled":
    kernel = functools.partial(tiled_experts, bf16=matmul_dtype == "bfloat16")
    return on_local_tokens(kernel, x, weights, idx, (gate_up, down), per_expert=True)
  raise ValueError(f"moe_impl={impl!r}; expected auto, tiled, dense, ragged, grouped, expert_parallel or all_to_all")


def grouped_kernel(platform: str | None = None) -> Callable:
  """The `grouped` kernel `(x, weights, idx, gate_up, down) -> y` for `platform` (default: the active mesh's
  devices' platform, else the default backend): see `moe_grouped.grouped_backend`."""
  if platform is None:
    mesh = active_mesh()
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
  backend = moe_grouped.grouped_backend(platform)
  if backend == "tokamax":
    return functools.partial(moe_grouped.tokamax_experts,
                             implementation=moe_grouped.tokamax_implementations(platform))
  return ragged_experts if backend == "ragged" else moe_grouped.gathered_experts


def dense_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array) -> Array:
  """Every expert on every token, zero weight for the unselected (the reference the others are tested against)."""
  num_experts = gate_up.shape[0]
  # combine[T, E]: routing weight of each expert for each token (0 when not selected)
  combine = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
  h = layers.gated_gelu(jnp.einsum("th,eih->eti", x, gate_up))  # [E, T, I]
  y = jnp.einsum("eti,ehi->eth", h, down)  # [E, T, H]
  return jnp.einsum("eth,te->th", y.astype(jnp.float32), combine).astype(x.dtype)


# ---- ragged: sorted-token dispatch through ragged_dot_general -----------------------------------------------------
# Rows of `x [M, in]` grouped by `group_sizes [G]`, each group times its `w[g] [out, in]` contracted on `in` (the
# weights' last axis: the HF layout as stored); its two gradients, each again one ragged dot with no transpose.
_ROWS_TIMES_W = jax.lax.RaggedDotDimensionNumbers(  # x [M, in] . w [G, out, in] -> [M, out]
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_ROWS_TIMES_W_T = jax.lax.RaggedDotDimensionNumbers(  # dy [M, out] . w [G, out, in] -> [M, in]
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_PER_GROUP_OUTER = jax.lax.RaggedDotDimensionNumbers(  # dy [M, out] . x [M, in] over each group's rows -> [G, out, in]
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _mask_rows(y: Array, group_sizes: Array) -> Array:
  """Zeros the rows of y [M, ...] past the last group (rows no group covers; backends leave them unspecified)."""
  covered = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(covered.reshape((-1,) + (1,) * (y.ndim - 1)), y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def grouped_matmul(x: Array, w: Array, group_sizes: Array) -> Array:
  """x [M, in] (rows grouped by expert: group g is the `group_sizes[g]` rows after the groups before it) times
  its group's `w[g] [out, in]` -> [M, out]; rows past `sum(group_sizes)` give 0.

  A custom VJP only to choose the gradients' dimension numbers: the input gradient contracts `w`'s `out` axis
  and the weight gradient is produced directly as `[G, out, in]`, so neither the weights nor their gradient is
  ever transposed (`jax.lax.ragged_dot_general`'s own rule computes `[G, in, out]` and transposes it).
  """
  return _mask_rows(jax.lax.ragged_dot_general(x, w, group_sizes, _ROWS_TIMES_W), group_sizes)


def _grouped_matmul_fwd(x, w, group_sizes):
  return grouped_matmul(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_bwd(residuals, dy):
  x, w, group_sizes = residuals
  dy = dy.astype(jnp.result_type(x.dtype, w.dtype))
  dx = _mask_rows(jax.lax.ragged_dot_general(dy, w, group_sizes, _ROWS_TIMES_W_T), group_sizes)
  dw = jax.lax.ragged_dot_general(dy, x, group_sizes, _PER_GROUP_OUTER)  # [G, out, in]
  return dx.astype(x.dtype), dw.astype(w.dtype), None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_mlp(xs: Array, gate_up: Array, down: Array, group_sizes: Array, matmul: Callable | None = None) -> Array:
  """Rows xs [M, H] grouped by expert (`group_sizes [E]`) through their expert's gated MLP -> [M, H].
  `matmul`: the grouped matmul (default `grouped_matmul`; `moe_grouped.grouped_matmul_tokamax` has its contract)."""
  matmul = matmul or grouped_matmul
  return matmul(layers.gated_gelu(matmul(xs, gate_up, group_sizes)), down, group_sizes)


def ragged_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array) -> Array:
  """`dense_experts`' function with the T*K (token, expert) assignments sorted by expert (`grouped_mlp`), then
  put back in token order and summed over k with their routing weights in fp32 (no scatter-add)."""
  tokens, top_k = idx.shape
  flat = idx.reshape(-1)  # [A], A = T*K
  order = jnp.argsort(flat, stable=True)  # [A] assignments in expert order
  group_sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)  # [E]
  ys = grouped_mlp(x[order // top_k], gate_up, down, group_sizes)  # [A, H] in expert order
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))  # inverse permutation
  picked = ys[rank].reshape(tokens, top_k, -1).astype(jnp.float32)  # [T, K, H]
  return jnp.einsum("tkh,tk->th", picked, weights).astype(x.dtype)


# ---- expert parallelism -------------------------------------------------------------------------------------------
def local_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                  matmul: Callable | None = None) -> Array:
  """The share of the mixture computed by the experts `0 .. E_l - 1` of gate_up [E_l, 2I, H] / down [E_l, H, I].

  x [N, H], weights/idx [N, K] (idx relative to this device's first expert; ids outside [0, E_l) belong to other
  devices and are skipped) -> float32 [N, H]. Exact: a token's K experts are distinct, so at most
  `N * min(K, E_l)` assignments are local, the static number of rows computed (nothing is ever dropped).
  `matmul`: the grouped matmul (`grouped_mlp`).
  """
  n, top_k = idx.shape
  num_local = gate_up.shape[0]
  flat = idx.reshape(-1)  # [N*K]
  local = (flat >= 0) & (flat < num_local)
  key = jnp.where(local, flat, num_local)  # non-local assignments sort last
  order = jnp.argsort(key, stable=True)[: n * min(top_k, num_local)]  # [R] the local ones first, by expert
  group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [E_l]
  token_of = order // top_k  # [R]
  ys = grouped_mlp(x[token_of], gate_up, down, group_sizes, matmul)  # [R, H]; rows past the groups are 0
  w = jnp.where(local, weights.reshape(-1), 0.0)[order]  # [R]
  return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(ys.astype(jnp.float32) * w[:, None])


EXPERT_WEIGHT_AXES = (("expert", "mlp", "embed"), ("expert", "embed", "mlp"))  # gate_up [E, 2I, H], down [E, H, I]
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "down_proj")


def on_local_tokens(kernel: Callable, x: Array, weights: Array, idx: Array, experts: tuple[Array, ...],
                    frozen: tuple = (), *, per_expert: bool = False) -> Array:
  """`kernel(x, weights, idx, *experts, *frozen)` run by each device on its own tokens under the active mesh.

  x [T, H], weights/idx [T, K]: split like the batch (`batch` rule). `experts` (gate_up [E, 2I, H], down
  [E, H, I], or none) enter split as their sharding rules say and are gathered whole inside, one layer at a time,
  as FSDP does; their gradients leave reduce-scattered (`sharding.local`). With `per_expert` (the `tiled` kernel)
  the split that the batch axes make stays and the kernel gathers one expert at a time (`kernel(...,
  split=moe_tiled.ExpertSplit)`), so a layer's whole weights or gradients never exist. `frozen`: more arguments
  without gradients (e.g. a quantized base), gathered whole at the boundary.

  The sorting kernels (`tiled`, `ragged`) order all T*K assignments by expert: left to the partitioner, that
  global sort is replicated, so every device would route, gather and run every device's tokens (the 26B-A4B,
  batch 8 per device on fsdp=8: a 3 GiB slab per layer, all-reduced). Outside a mesh, or when the tokens are not
  split, `kernel` runs as is.
  """
  axes = row_axes(x.shape[0])
  if not axes:
    return kernel(x, weights, idx, *experts, *frozen)
  specs = tuple(weight_spec(w, names) for w, names in zip(experts, EXPERT_WEIGHT_AXES))

  def per_device(x, weights, idx, experts, frozen):
    # each gather waits for the layer's input (else XLA may hoist every layer's gathers to the start)
    experts = tuple(jax.lax.optimization_barrier((w, x))[0] for w in experts)
    # per expert: an expert's matrix is split from dimension 1 on ([E, ...] minus the expert axis)
    gathered = [gather_whole(w, spec, axes, keep_from_dim=1 if per_expert else None, name=name)
                for w, spec, name in zip(experts, specs, EXPERT_WEIGHT_NAMES)]
    frozen = jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), frozen)
    more = {}
    if per_expert:
      more["split"] = ExpertSplit(*(None if kept is None else (kept[0], kept[1] - 1) for _, kept in gathered))
    return kernel(x, weights, idx, *(w for w, _ in gathered), *frozen, **more)

  tokens = PartitionSpec(axes)
  return jax.shard_map(per_device, mesh=active_mesh(), in_specs=(tokens, tokens, tokens, specs, PartitionSpec()),
                       out_specs=tokens)(x, weights, idx, tuple(experts), frozen)


def expert_parallel_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array, *,
                            mesh: Mesh, axis: str = EXPERT_AXIS, dispatch: str = "gather") -> Array:
  """`dense_experts`' function with the experts split over the mesh axis `axis` (n devices, E/n experts each).

  x [T, H], weights/idx [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H]. Inside `jax.shard_map`: tokens are
  split like the batch (`batch` rule); each device all-gathers the tokens of its `axis` group (n x T_local rows),
  runs its own E/n experts on the assignments routed to them (`local_experts`: exact, no capacity, no drops) and
  a reduce-scatter (`psum_scatter`, fp32) returns each token's sum to the device that holds it. Versus an
  all-to-all of the T_local x K assignments this moves n x T_local rows instead of ~K x T_local (DiffusionGemma:
  K = 8, so equal or less for n <= 8) and needs no capacity factor. Weights enter as `P(axis)` (any FSDP/tensor
  split of them is all-gathered at the boundary, as FSDP does per layer). The grouped matmuls are tokamax's
  kernels where `moe_grouped.grouped_backend` picks them, else `jax.lax.ragged_dot_general` (densified by
  XLA:GPU: on GPU without tokamax prefer `grouped` without an expert axis).

  `dispatch='all_to_all'`: the assignments travel to their experts' devices and back by ragged all-to-all
  (`moe_all_to_all`: ~2 x K x T_local rows moved instead of 2 x n x T_local); used when the tokens are split over
  `axis` (else every device of the group holds all tokens and the gather path has nothing to gather).
  """
  if dispatch not in ("gather", "all_to_all"):
    raise ValueError(f"expert_parallel: dispatch={dispatch!r}; expected 'gather' or 'all_to_all'")
  n, num_experts = int(dict(mesh.shape)[axis]), gate_up.shape[0]
  if num_experts % n:
    raise ValueError(f"expert_parallel: {num_experts} experts do not split over mesh axis {axis!r} of size {n}")
  token_spec = logical_to_mesh_spec(("batch", None), rules=active_rules(), mesh=mesh, shape=x.shape)  # like the batch
  token_axes = spec_axes(token_spec[0] if len(token_spec) else None)
  gathered = axis in token_axes  # tokens split over `axis` too: gather them, scatter the sums back
  other_axes = tuple(a for a in token_axes if a != axis)  # tokens differ along these; weights do not
  platform = mesh.devices.flat[0].platform
  matmul = None  # jax.lax.ragged_dot_general, unless tokamax's kernels are there (`moe_grouped`)
  if moe_grouped.grouped_backend(platform) == "tokamax":
    matmul = functools.partial(moe_grouped.grouped_matmul_tokamax,
                               implementation=moe_grouped.tokamax_implementations(platform))

  def per_device(x, weights, idx, gate_up, down):
    if gathered and dispatch == "all_to_all":
      if other_axes:
        gate_up, down = (jax.lax.pcast(w, other_axes, to="varying") for w in (gate_up, down))
      mlp = functools.partial(grouped_mlp, matmul=matmul)
      return moe_all_to_all.all_to_all_experts(x, weights, idx, gate_up, down, axis=axis, mlp=mlp,
                                               native=platform != "cpu")
    if gathered:
      x, weights, idx = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, weights, idx))
    else:  # every device of the group holds all tokens; what each computes from them differs
      x, weights, idx = (jax.lax.pcast(a, (axis,), to="varying") for a in (x, weights, idx))
    if other_axes:  # the weights' gradients then vary along the token axes; their transpose sums them (psum)
      gate_up, down = (jax.lax.pcast(w, other_axes, to="varying") for w in (gate_up, down))
    first = jax.lax.axis_index(axis) * gate_up.shape[0]
    y = local_experts(x, weights, idx - first, gate_up, down, matmul)  # [N, H] float32, this device's experts
    return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True) if gathered else jax.lax.psum(y, axis)

  tokens = PartitionSpec(*token_spec) if len(token_spec) else PartitionSpec(None)
  experts = PartitionSpec(axis)
  y = jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts),
                    out_specs=tokens)(x, weights, idx, gate_up, down)
  return y.astype(x.dtype)
