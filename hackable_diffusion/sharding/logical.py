"""Logical-axis sharding: one table maps the model's axis names onto mesh axes; state and batch placement.

The model names the axes of its parameters with a handful of *logical* names (`embed`, `heads`, `kv`, `mlp`,
`vocab`, `expert`; stored as the `out_sharding` metadata of each `nnx.Variable`, see `model/layers.py`).
One table, `LOGICAL_AXIS_RULES`, maps them onto the four *mesh* axes (as in flax's lm1b example):

  mesh axis  what it splits
  ---------  -----------------------------------------------------------------------------------------------
  data       the batch (pure data parallelism: parameters replicated)
  fsdp       the batch, and every parameter along its `embed` dimension (ZeRO-3 / fully sharded data parallel:
             parameters, gradients and optimizer state are split; XLA all-gathers weights per layer)
  tensor     attention heads (`heads`, `kv`), MLP hidden units (`mlp`) and the vocabulary (Megatron-style)
  expert     the experts of every MoE layer (`expert`), and the batch for everything that is not an expert

A dimension whose size is not a multiple of its mesh axes is replicated instead (logged once), so any mesh
runs any model; `sharding.memory.per_device_bytes` reports what that costs. Optimizer state (optax) mirrors the
parameter tree, `nnx.Variable` metadata included, so it is sharded exactly like the parameters.

This module imports nothing else of the project: the model imports it for `constrain`. Nothing here runs at
import time; without a mesh (`activation_sharding` not entered) `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axes it is split over (in this order). One table; pass `rules=` to try another.
LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("expert", ("expert",)),
)

Rules = Sequence[tuple[str, Sequence[str]]]
MeshLike = Mesh | Mapping[str, int]
LogicalAxes = tuple[str | None, ...]

_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.warning("%s", message)


def mesh_axis_sizes(mesh: MeshLike | None) -> dict[str, int] | None:
  """`{axis: size}` of a `Mesh` or of a plain mapping (None stays None)."""
  if mesh is None:
    return None
  if isinstance(mesh, Mesh):
    return dict(mesh.shape)
  return {str(k): int(v) for k, v in mesh.items()}


# ---- logical axes -> mesh axes ----------------------------------------------------------------------------------
def logical_to_mesh_spec(axes: Sequence[str | None] | None, *, rules: Rules = LOGICAL_AXIS_RULES,
                         mesh: MeshLike | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
  """Logical axis names (one per dimension; None = replicated) -> a `PartitionSpec` over mesh axes.

  With `mesh` (a `Mesh` or `{axis: size}`), mesh axes of size 1 or absent from the mesh are dropped; with
  `shape` as well, a dimension not divisible by the product of its mesh axes is replicated (logged once).
  A mesh axis is used at most once per spec (a later dimension asking for it again is replicated there).
  A name that is not in `rules` but is a mesh axis maps to itself; any other unknown name is replicated.
  """
  if not axes:
    return PartitionSpec()
  table = {name: tuple(mesh_axes) for name, mesh_axes in rules}
  sizes = mesh_axis_sizes(mesh)
  used: set[str] = set()
  entries: list[str | tuple[str, ...] | None] = []
  for dim, name in enumerate(axes):
    if name is None:
      entries.append(None)
      continue
    if name in table:
      mesh_axes = table[name]
    elif name in MESH_AXES or (sizes is not None and name in sizes):
      mesh_axes = (name,)
    else:
      _log_once(f"sharding: logical axis {name!r} has no rule; replicated")
      mesh_axes = ()
    mesh_axes = tuple(a for a in mesh_axes if a not in used)
    if sizes is not None:
      mesh_axes = tuple(a for a in mesh_axes if sizes.get(a, 1) > 1)
      n = math.prod(sizes[a] for a in mesh_axes)
      if shape is not None and mesh_axes and shape[dim] % n:
        _log_once(f"sharding: dimension {dim} ({name!r}) of a {tuple(shape)} array is not divisible by mesh axes "
                  f"{mesh_axes} (size {n}); replicated along it")
        mesh_axes = ()
    used.update(mesh_axes)
    entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def variable_axes(var: nnx.Variable) -> LogicalAxes | None:
  """The logical axes of a variable (its `out_sharding` metadata), or None when it has none / they do not fit."""
  axes = var.get_metadata().get("out_sharding")
  if not axes:
    return None
  axes = tuple(axes)
  ndim = len(getattr(var.get_value(), "shape", ()))
  if len(axes) != ndim:
    _log_once(f"sharding: {type(var).__name__} with logical axes {axes} has {ndim} dimensions; replicated")
    return None
  return axes


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _as_tree(tree: Any) -> Any:
  return nnx.state(tree) if isinstance(tree, nnx.Module) else tree


def leaves_with_axes(tree: Any) -> list[tuple[Any, LogicalAxes | None]]:
  """Every array (or `ShapeDtypeStruct`) of a tree with its logical axes (None for arrays outside a Variable)."""
  out = []
  for x in jax.tree.leaves(_as_tree(tree), is_leaf=_is_variable):
    if _is_variable(x):
      out.append((x.get_value(), variable_axes(x)))
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
      out.append((x, None))
  return out


def _map_arrays(fn: Callable[[Any, LogicalAxes | None], Any], tree: Any) -> Any:
  """Applies `fn(array_or_shape, logical_axes)` to every array of a tree; `nnx.Variable`s keep their metadata."""

  def leaf(x):
    if _is_variable(x):
      return x.replace(fn(x.get_value(), variable_axes(x)))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return fn(x, None)
    return x

  return jax.tree.map(leaf, _as_tree(tree), is_leaf=_is_variable)


# ---- state placement ----------------------------------------------------------------------------------------------
def state_shardings(mesh: Mesh, tree: Any, rules: Rules = LOGICAL_AXIS_RULES) -> Any:
  """`NamedSharding`s for every array of `tree`, in the same structure (usable as `jit` in/out shardings).

  `tree`: an `nnx.Module`, an `nnx.State`, a `TrainState` (params, rest, opt_state) or any pytree; arrays may be
  concrete or `ShapeDtypeStruct`s. Variables are sharded by their logical axes; arrays without any (buffers,
  step counters, LoRA adapters without axis metadata) are replicated.
  """

  def one(x, axes):
    return NamedSharding(mesh, logical_to_mesh_spec(axes, rules=rules, mesh=mesh, shape=x.shape))

  return _map_arrays(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def shard_state(state: Any, shardings: Any) -> Any:
  """Copies every array of `state` into its sharding (same structure as `state_shardings`).

  Never aliases `state`'s buffers, so donating the result (the train step does) leaves `state` intact. For one
  process, or arrays that are already global; on several hosts create the state in place instead
  (`training.step.init_train_state_sharded`, `interop.hf.load_pretrained(..., mesh=)`, or a checkpoint restored
  with target shardings).
  """
  # a jitted identity, not `jax.device_put`: device_put may share the source's buffer on a device it already
  # occupies (even with may_alias=False for replicated targets), and donation would then delete the source
  return jax.jit(lambda tree: tree, out_shardings=shardings)(_as_tree(state))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> nnx.Module:
  """Shards a model's variables in place (and returns it): e.g. `generate(shard_model(model, mesh), ...)`."""
  state = nnx.state(model)
  nnx.update(model, shard_state(state, state_shardings(mesh, state, rules)))
  return model


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """`ShapeDtypeStruct`s carrying target shardings (restore targets for orbax, `jit` lowering)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), _as_tree(tree), shardings)


# ---- batches ------------------------------------------------------------------------------------------------------
def batch_sharding(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> NamedSharding:
  """Sharding of every batch array `[batch, ...]`: the batch dimension over the `batch` rule's mesh axes."""
  return NamedSharding(mesh, logical_to_mesh_spec(("batch",), rules=rules, mesh=mesh))


def num_batch_shards(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> int:
  """How many ways the batch is split (the global batch size must be a multiple of this)."""
  spec = batch_sharding(mesh, rules).spec
  axes = () if not spec or spec[0] is None else (spec[0],) if isinstance(spec[0], str) else spec[0]
  return math.prod(mesh.shape[a] for a in axes)


def process_batch_shard(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> tuple[int, int]:
  """`(index, count)`: this process's devices hold block `index` of `count` equal, contiguous blocks of the batch.

  What a per-process data loader reads (`make_sft_dataset(..., shard_index=index, shard_count=count)`, with
  `global batch / count` rows per process). One process: `(0, 1)`. Processes whose devices hold the same rows
  (the batch replicated over hosts, e.g. tensor parallelism across hosts) get the same index and must read the
  same data.
  """
  shards = num_batch_shards(mesh, rules)
  rows = set()
  for index in batch_sharding(mesh, rules).addressable_devices_indices_map((shards,)).values():
    rows.update(range(shards)[index[0]] if index else range(shards))
  rows = sorted(rows)
  count = shards // len(rows)
  if shards % len(rows) or rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] % len(rows):
    raise ValueError(f"process {jax.process_index()} holds batch rows {rows} of {shards} on mesh {dict(mesh.shape)}, "
                     "not one aligned contiguous block; order the mesh devices by host")
  return rows[0] // len(rows), count


def shard_batch(batch: Any, mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Any:
  """Places a host batch (pytree of `[batch, ...]` arrays) on the mesh, split along the batch dimension.

  Multi-host: each process passes its *own* block of the global batch (what a per-process data loader yields
  for `process_batch_shard`); the global batch is their concatenation in block order
  (`jax.make_array_from_process_local_data`). The global batch must be a multiple of `num_batch_shards`.
  """
  sharding = batch_sharding(mesh, rules)
  shards = num_batch_shards(mesh, rules)
  _, blocks = process_batch_shard(mesh, rules) if jax.process_count() > 1 else (0, 1)

  def put(x):
    x = np.asarray(x)
    if x.ndim == 0 or (x.shape[0] * blocks) % shards:
      raise ValueError(f"batch array of shape {x.shape} ({jax.process_count()} process(es)): the global batch "
                       f"{x.shape[0] * blocks if x.ndim else 0} must be a multiple of {shards} (the batch is split "
                       f"{shards} ways over mesh {dict(mesh.shape)})")
    return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * blocks,) + x.shape[1:])

  return jax.tree.map(put, batch)


# ---- activation sharding hook ------------------------------------------------------------------------------------
_ACTIVATIONS: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("hd_activation_sharding",
                                                                                        default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
  """While tracing inside this context, `constrain` pins activations to the mesh (else it is a no-op)."""
  token = _ACTIVATIONS.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATIONS.reset(token)


def active_mesh() -> Mesh | None:
  """The mesh of the enclosing `activation_sharding` (what the model is being traced for), or None."""
  ctx = _ACTIVATIONS.get()
  return None if ctx is None else ctx[0]


def active_rules() -> Rules:
  """The axis rules of the enclosing `activation_sharding` (`LOGICAL_AXIS_RULES` outside one)."""
  ctx = _ACTIVATIONS.get()
  return LOGICAL_AXIS_RULES if ctx is None else ctx[1]


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint(x, logical axes)` under `activation_sharding`; the identity otherwise.

  For model code: e.g. `x = constrain(x, ("batch", None, None))` on the residual stream `[B, L, H]` keeps XLA
  from resharding activations along a weight's FSDP axis.
  """
  ctx = _ACTIVATIONS.get()
  if ctx is None:
    return x
  mesh, rules = ctx
  spec = logical_to_mesh_spec(tuple(axes), rules=rules, mesh=mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


__all__ = [
    "LOGICAL_AXIS_RULES", "MESH_AXES", "LogicalAxes", "MeshLike", "Rules", "abstract_with_shardings",
    "activation_sharding", "active_mesh", "active_rules", "batch_sharding", "constrain", "leaves_with_axes",
    "logical_to_mesh_spec", "mesh_axis_sizes", "num_batch_shards", "process_batch_shard", "replicated", "shard_batch",
    "shard_model", "shard_state", "state_shardings", "variable_axes",
]
