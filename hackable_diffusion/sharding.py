"""Device meshes and logical-axis sharding: data, FSDP, tensor and expert parallelism, multi-host ready.

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
runs any model; `per_device_param_bytes` reports what that costs. Optimizer state (optax) mirrors the
parameter tree, `nnx.Variable` metadata included, so it is sharded exactly like the parameters.

Typical use (one process per host; on one host just skip `maybe_initialize_distributed`):

  cfg = MeshConfig(data=-1, fsdp=8)           # -1: whatever devices are left
  maybe_initialize_distributed(cfg)            # multi-host: before any other JAX call
  mesh = make_mesh(cfg)
  graphdef, state, shardings = init_train_state_sharded(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)), tx, mesh)
  step = make_sharded_train_step(graphdef, tx, loss_config, mesh, state)
  state, metrics = step(state, shard_batch(batch, mesh), key)

Nothing here runs at import time; without a mesh the rest of the library runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

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


# ---- configuration --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Shape of the device mesh and (optionally) how to join a multi-host job.

  Axis sizes: positive integers, or -1 on one axis for "all remaining devices". Their product must equal the
  number of devices (`jax.device_count()`, all hosts together).

  Multi-host (`maybe_initialize_distributed`): `coordinator_address` ("host:port" of process 0),
  `num_processes` and `process_id`, each falling back to the env vars `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; or `auto_distributed=True` to let JAX detect the cluster (Cloud TPU
  pods, SLURM, Open MPI).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto_distributed: bool = False

  def __post_init__(self):
    for name in MESH_AXES:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise ValueError(f"mesh.{name}={value!r}; expected a positive integer or -1 (all remaining devices)")
    rest = [name for name in MESH_AXES if getattr(self, name) == -1]
    if len(rest) > 1:
      raise ValueError(f"mesh axes {rest} are all -1; at most one axis may take the remaining devices")
    if self.num_processes is not None and self.num_processes < 1:
      raise ValueError(f"mesh.num_processes={self.num_processes!r}; expected >= 1")
    if self.process_id is not None and self.process_id < 0:
      raise ValueError(f"mesh.process_id={self.process_id!r}; expected >= 0")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> MeshConfig:
    """From a plain mapping (e.g. `config.mesh` of an ml_collections config); unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ValueError(f"unknown mesh config keys {unknown}; valid keys: {sorted(fields)}")
    return cls(**dict(values))

  def shape(self, num_devices: int | None = None) -> dict[str, int]:
    """Axis sizes `{data, fsdp, tensor, expert}` for `num_devices` (default: `jax.device_count()`)."""
    n = jax.device_count() if num_devices is None else int(num_devices)
    sizes = {name: getattr(self, name) for name in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    for name, value in sizes.items():
      if value == -1:
        if n % fixed:
          raise ValueError(f"mesh {desc}: the fixed axes use {fixed} devices, which does not divide the {n} "
                           f"available devices (jax.device_count()={n})")
        sizes[name] = n // fixed
    if math.prod(sizes.values()) != n:
      raise ValueError(f"mesh {desc} needs {math.prod(sizes.values())} devices but {n} are available "
                       f"(jax.device_count()={n}); set one axis to -1 to use all remaining devices")
    return sizes


def make_mesh(cfg: MeshConfig | None = None, *, devices: Sequence[Any] | None = None) -> Mesh:
  """A `Mesh` with axes `("data", "fsdp", "tensor", "expert")` over `devices` (default: all, every host).

  Axes are `AxisType.Auto` (XLA's sharding propagation; shardings are given at `jit` boundaries and by
  `with_sharding_constraint`). `jax.make_mesh` orders devices for the physical topology (TPU torus, NVLink):
  the last axes vary fastest, so keep the chattiest axis (`tensor`, then `expert`, then `fsdp`) within a host.
  """
  cfg = cfg or MeshConfig()
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.shape(len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def maybe_initialize_distributed(cfg: MeshConfig | None = None) -> bool:
  """Joins a multi-process JAX job when one is configured; returns True when running distributed.

  Must run before any other JAX call in the process (JAX's rule). Configured means: `cfg.auto_distributed`
  (JAX detects TPU pods / SLURM / Open MPI), or a coordinator address in `cfg` or `$JAX_COORDINATOR_ADDRESS`
  (then `num_processes` / `process_id` come from `cfg` or `$JAX_NUM_PROCESSES` / `$JAX_PROCESS_ID`).
  Otherwise nothing happens (single process). Calling it again is a no-op.
  """
  if jax.distributed.is_initialized():
    return True
  cfg = cfg or MeshConfig()
  address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
  if not cfg.auto_distributed and address is None:
    if num not in (None, 1):
      raise ValueError(f"mesh.num_processes={num} but no coordinator address: set mesh.coordinator_address "
                       "(or $JAX_COORDINATOR_ADDRESS), or mesh.auto_distributed=True on a TPU pod / SLURM / MPI")
    return False
  if not cfg.auto_distributed and (num is None or pid is None):
    missing = "num_processes" if num is None else "process_id"
    raise ValueError(f"mesh.coordinator_address={address!r} is set but mesh.{missing} is not (nor "
                     f"$JAX_{missing.upper()}); every process needs both")
  if num is not None and pid is not None and not 0 <= pid < num:
    raise ValueError(f"mesh.process_id={pid} is outside [0, num_processes={num})")
  jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
  logging.info("joined distributed JAX job: process %d of %d, %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"${name}={value!r}; expected an integer") from None


# ---- logical axes -> mesh axes ----------------------------------------------------------------------------------
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
  if message not in _LOGGED:
    _LOGGED.add(message)
    logging.warning("%s", message)


def _mesh_sizes(mesh: MeshLike | None) -> dict[str, int] | None:
  if mesh is None:
    return None
  if isinstance(mesh, Mesh):
    return dict(mesh.shape)
  return {str(k): int(v) for k, v in mesh.items()}


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
  sizes = _mesh_sizes(mesh)
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


def variable_axes(var: nnx.Variable) -> tuple[str | None, ...] | None:
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


def _map_arrays(fn: Callable[[Any, tuple[str | None, ...] | None], Any], tree: Any) -> Any:
  """Applies `fn(array_or_shape, logical_axes)` to every array of a tree; `nnx.Variable`s keep their metadata."""

  def leaf(x):
    if _is_variable(x):
      return x.replace(fn(x.get_value(), variable_axes(x)))
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return fn(x, None)
    return x

  return jax.tree.map(leaf, _as_tree(tree), is_leaf=_is_variable)


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


def shard_state(state: Any, shardings: Any) -> Any:
  """Copies every array of `state` into its sharding (same structure as `state_shardings`).

  Never aliases `state`'s buffers, so donating the result (the train step does) leaves `state` intact. For one
  process, or arrays that are already global; on several hosts create the state in place instead
  (`init_train_state_sharded`, `load_pretrained_sharded`, or a checkpoint restored with target shardings).
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


# ---- sharded initialisation and train step ------------------------------------------------------------------------
def init_train_state_sharded(model_fn: Callable[[], nnx.Module], tx: Any, mesh: Mesh, *, trainable: Any = nnx.Param,
                             rules: Rules = LOGICAL_AXIS_RULES) -> tuple[nnx.GraphDef, Any, Any]:
  """`(graphdef, state, shardings)`: a `TrainState` created directly in its shards (never whole on one device).

  `model_fn` builds the model (e.g. `lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))`); it is traced, not run
  eagerly, and the compiled initialiser writes each shard on its own device.
  """
  from hackable_diffusion.training.step import init_train_state  # local: keeps `import sharding` light

  graphdef = nnx.split(nnx.eval_shape(model_fn), trainable, ...)[0]  # what init_train_state splits into

  def make():
    return init_train_state(model_fn(), tx, trainable=trainable)[1]

  shardings = state_shardings(mesh, jax.eval_shape(make), rules)
  return graphdef, jax.jit(make, out_shardings=shardings)(), shardings


def make_sharded_train_step(graphdef: nnx.GraphDef, tx: Any, loss_config: Any, mesh: Mesh, state: Any, *,
                            grad_accum_steps: int = 1, lr_schedule: Callable | None = None, donate: bool = True,
                            rules: Rules = LOGICAL_AXIS_RULES, shardings: Any = None) -> Callable:
  """`training.step.make_train_step`'s pure step, jitted for `mesh`: `(state, batch, key) -> (state, metrics)`.

  In/out shardings are explicit: the state as `state_shardings(mesh, state)` (or `shardings`), the batch as
  `batch_sharding(mesh)`, the key and metrics replicated; the state is donated. The caller passes `state`
  already placed (`shard_state` / `init_train_state_sharded` / a sharded restore) and batches from
  `shard_batch`. Activations are constrained to the batch sharding where `constrain` is called (the batch
  itself here, the model's hooks when present). Compiles once per batch shape.
  """
  from hackable_diffusion.training.step import make_train_step  # local: keeps `import sharding` light

  shardings = state_shardings(mesh, state, rules) if shardings is None else shardings
  batch_s = batch_sharding(mesh, rules)
  inner = make_train_step(graphdef, tx, loss_config, grad_accum_steps=grad_accum_steps, lr_schedule=lr_schedule,
                          jit=False)

  def step(state, batch, key):
    with activation_sharding(mesh, rules):
      batch = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)), batch)
      return inner(state, batch, key)

  rep = replicated(mesh)
  return jax.jit(step, in_shardings=(shardings, batch_s, rep), out_shardings=(shardings, rep),
                 donate_argnums=(0,) if donate else ())


# ---- memory arithmetic --------------------------------------------------------------------------------------------
def per_device_bytes(tree: Any, mesh: MeshLike, rules: Rules = LOGICAL_AXIS_RULES) -> int:
  """Exact bytes that every array of `tree` occupies on one device under the rules (shards are equal-sized).

  `tree`: as for `state_shardings` (concrete arrays or `ShapeDtypeStruct`s); `mesh`: a `Mesh` or just its axis
  sizes `{axis: size}` (no devices needed, so any mesh shape can be costed on a laptop).
  """
  sizes = _mesh_sizes(mesh)
  total = 0
  for x, axes in _leaves_with_axes(tree):
    spec = logical_to_mesh_spec(axes, rules=rules, mesh=sizes, shape=x.shape)
    total += _shard_elements(x.shape, spec, sizes) * jnp.dtype(x.dtype).itemsize
  return total


per_device_param_bytes = per_device_bytes


def _leaves_with_axes(tree: Any) -> list[tuple[Any, tuple[str | None, ...] | None]]:
  """Every array (or shape) of a tree with its logical axes (None for arrays outside a Variable)."""
  out = []
  for x in jax.tree.leaves(_as_tree(tree), is_leaf=_is_variable):
    if _is_variable(x):
      out.append((x.get_value(), variable_axes(x)))
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
      out.append((x, None))
  return out


def _shard_elements(shape: Sequence[int], spec: PartitionSpec, sizes: Mapping[str, int]) -> int:
  n = 1
  for dim, size in enumerate(shape):
    entry = spec[dim] if dim < len(spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    n *= size // math.prod(sizes[a] for a in axes)
  return n


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of the training state (activations, XLA temporaries and the batch are not included)."""

  mesh: dict[str, int]
  params: int  # every model variable (trainable and frozen), in the parameter dtype
  adapters: int  # LoRA adapters (0 for full fine-tuning)
  grads: int  # gradients of the trainable variables
  optimizer: int  # Adam's two moments of the trainable variables
  num_params: int  # global counts
  num_trainable: int

  @property
  def total(self) -> int:
    return self.params + self.adapters + self.grads + self.optimizer


@functools.lru_cache(maxsize=4)
def _abstract_states(config: Any) -> tuple[nnx.State, nnx.State]:
  """(all variables, trainable `nnx.Param`s) of a model as shapes only (cached: a 26B model takes seconds)."""
  from hackable_diffusion.model.transformer import DiffusionGemma  # local: avoids an import cycle

  abstract = nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))
  return nnx.state(abstract), nnx.state(abstract, nnx.Param)


def memory_estimate(config: Any, mesh: MeshLike, *, lora_rank: int | None = None,
                    lora_targets: Sequence[str] = LORA_TARGETS, param_dtype: str | None = None,
                    adapter_dtype: str = "float32", grad_dtype: str | None = None, moment_dtype: str = "float32",
                    rules: Rules = LOGICAL_AXIS_RULES) -> MemoryEstimate:
  """Per-device memory of fine-tuning `config` (a `ModelConfig`) on a mesh of the given axis sizes.

  Full fine-tuning (`lora_rank=None`): every `nnx.Param` is trainable; gradients in `grad_dtype` (default: the
  parameter dtype) and two Adam moments in `moment_dtype` share the parameters' sharding.
  LoRA: the base model is frozen; every `[d_in, d_out]` kernel of a layer named in `lora_targets` (attention
  `q/k/v/o_proj` and the dense-MLP `gate/up/down_proj` by default, as `lora.adapters.DEFAULT_TARGETS`; the
  router, experts and embedding are not adapted) gets `A [d_in, r]` and `B [r, d_out]` in `adapter_dtype`,
  sharded like the kernel's input / output axis (as `lora.adapters` annotates them); gradients and moments are
  those of the adapters.
  Shapes come from the real model (`nnx.eval_shape`), shardings from the same rules as training.
  """
  sizes = _mesh_sizes(mesh)
  if param_dtype is not None:
    config = config.replace(param_dtype=param_dtype)
  state, trainable_state = _abstract_states(config)
  params = per_device_bytes(state, sizes, rules)
  num_params = sum(math.prod(x.shape) for x, _ in _leaves_with_axes(state))
  if lora_rank is None:
    grad_size = jnp.dtype(grad_dtype or config.param_dtype).itemsize
    per_dev = sum(_shard_elements(x.shape, logical_to_mesh_spec(a, rules=rules, mesh=sizes, shape=x.shape), sizes)
                  for x, a in _leaves_with_axes(trainable_state))
    num_trainable = sum(math.prod(x.shape) for x, _ in _leaves_with_axes(trainable_state))
    adapters = 0
  else:
    num_trainable = per_dev = 0
    for path, var in nnx.to_flat_state(trainable_state):
      names = [str(p) for p in path]
      if names[-1] == "kernel" and len(names) >= 2 and names[-2] in lora_targets and names[0] == "layers":
        d_in, d_out = var.shape
        axes = variable_axes(var) or (None, None)
        num_trainable += lora_rank * (d_in + d_out)
        # as `lora.adapters` creates them: A [d_in, r] keeps the kernel's input axis, B [r, d_out] its output axis
        for shape, ax in (((d_in, lora_rank), (axes[0], None)), ((lora_rank, d_out), (None, axes[1]))):
          per_dev += _shard_elements(shape, logical_to_mesh_spec(ax, rules=rules, mesh=sizes, shape=shape), sizes)
    grad_size = jnp.dtype(grad_dtype or adapter_dtype).itemsize
    adapters = per_dev * jnp.dtype(adapter_dtype).itemsize
  return MemoryEstimate(mesh=dict(sizes), params=params, adapters=adapters, grads=per_dev * grad_size,
                        optimizer=2 * per_dev * jnp.dtype(moment_dtype).itemsize, num_params=num_params,
                        num_trainable=num_trainable)


def memory_table(config: Any, meshes: Sequence[Mapping[str, int]], *, lora_ranks: Sequence[int] = (8, 16),
                 **kwargs: Any) -> str:
  """A markdown table of `memory_estimate` (GiB per device) for full fine-tuning and LoRA on each mesh."""
  gib = 1024 ** 3
  rows = ["| mesh (data x fsdp x tensor x expert) | devices | method | params | adapters | grads | Adam moments "
          "| total |", "|---|---|---|---|---|---|---|---|"]
  for m in meshes:
    sizes = {a: int(m.get(a, 1)) for a in MESH_AXES}
    label = " x ".join(str(sizes[a]) for a in MESH_AXES)
    methods = [("full", None)] + [(f"LoRA r{r}", r) for r in lora_ranks]
    for name, rank in methods:
      e = memory_estimate(config, sizes, lora_rank=rank, **kwargs)
      rows.append(f"| {label} | {math.prod(sizes.values())} | {name} | {e.params / gib:.2f} | "
                  f"{e.adapters / gib:.3f} | {e.grads / gib:.3f} | {e.optimizer / gib:.3f} | {e.total / gib:.2f} |")
  return "\n".join(rows)


# ---- Hugging Face checkpoints straight into shards -----------------------------------------------------------------
def load_pretrained_sharded(path: str, mesh: Mesh, dtype: Any = jnp.float32, *, compute_dtype: Any = None,
                            rules: Rules = LOGICAL_AXIS_RULES, **config_overrides: Any) -> nnx.Module:
  """`interop.hf.load_pretrained`, but every tensor goes straight into its `NamedSharding` on `mesh`.

  Tensors are read one at a time, and each device reads only its own slice of it from the safetensors file
  (`jax.make_array_from_callback`), so neither the model nor a whole large tensor is ever gathered on one
  host buffer or device. Multi-host: every process reads the slices its devices hold. Same errors as
  `load_pretrained` (`CheckpointError` naming the tensor).
  """
  from hackable_diffusion.interop import hf  # local: keeps `import sharding` light
  from hackable_diffusion.model.transformer import DiffusionGemma

  dtype = jnp.dtype(dtype)
  compute = jnp.dtype(compute_dtype) if compute_dtype is not None else dtype
  config = hf.load_config(path, param_dtype=dtype.name, dtype=compute.name, **config_overrides)
  model = nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))
  names = hf.hf_tensor_names(model)
  variables = dict(nnx.to_flat_state(nnx.state(model)))
  variables = {tuple(p): v for p, v in variables.items()}
  stored = {name for _, name, _ in hf.iter_tensors(path)}  # headers only
  loaded: set[str] = set()
  skipped_vision = 0
  for file, name, handle in hf.iter_tensors(path):
    if name.startswith(hf._VISION_PREFIXES):
      skipped_vision += 1
      continue
    key = name
    if name not in names and name.startswith(hf._ENCODER_LAYERS):
      key = hf._DEC + name[len(hf._ENCODER_LAYERS):]
      if key in stored:
        continue
    if key not in names:
      raise hf.CheckpointError(f"{file}: unexpected tensor {name!r} (not part of a DiffusionGemma text model)")
    var_path, transpose = names[key]
    var = variables[var_path]
    tensor = handle.get_slice(name)
    stored_shape = tuple(tensor.get_shape())
    shape = stored_shape[::-1] if transpose else stored_shape
    if shape != tuple(var.shape):
      expected = tuple(var.shape[::-1]) if transpose else tuple(var.shape)
      raise hf.CheckpointError(f"{file}: tensor {name!r} has shape {stored_shape}, expected {expected}")
    spec = logical_to_mesh_spec(variable_axes(var), rules=rules, mesh=mesh, shape=shape)
    var.set_value(_read_sharded(tensor, shape, NamedSharding(mesh, spec), transpose, var.dtype, name, file))
    loaded.add(key)
  missing = sorted(set(names) - loaded)
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise hf.CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}")
  if skipped_vision:
    logging.warning("%s: skipped %d vision-tower tensors (hackable_diffusion is text-only)", path, skipped_vision)
  return model


def _read_sharded(tensor: Any, shape: tuple[int, ...], sharding: NamedSharding, transpose: bool, dtype: Any,
                  name: str, file: str) -> jax.Array:
  from hackable_diffusion.interop.hf import CheckpointError

  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    try:
      block = tensor[index[::-1]] if transpose else tensor[index]
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for truncated data
      raise CheckpointError(f"{file}: cannot read tensor {name!r} ({str(e).splitlines()[0]})") from None
    block = np.asarray(block)
    return (block.T if transpose else block).astype(dtype)

  return jax.make_array_from_callback(shape, sharding, read)


__all__ = [
    "MESH_AXES", "LOGICAL_AXIS_RULES", "LORA_TARGETS", "MeshConfig", "MemoryEstimate", "make_mesh",
    "maybe_initialize_distributed", "logical_to_mesh_spec", "variable_axes", "state_shardings", "replicated",
    "batch_sharding", "num_batch_shards", "process_batch_shard", "shard_batch", "shard_state", "shard_model",
    "abstract_with_shardings", "activation_sharding", "constrain", "init_train_state_sharded",
    "make_sharded_train_step", "per_device_bytes", "per_device_param_bytes", "memory_estimate", "memory_table",
    "load_pretrained_sharded",
]
