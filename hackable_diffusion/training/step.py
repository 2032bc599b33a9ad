"""Pure, jitted train and eval steps: `(state, batch, key) -> (state, metrics)`, on one device or on a mesh.

The model is split once into a graph definition and two states: the trainable variables (a filter, `nnx.Param`
by default; `nnx.LoRAParam` under LoRA, so "train only adapters" is just a filter) and everything else
(frozen weights, buffers such as `layer_scalar`). Only the trainable part has gradients and optimizer state.

On a device mesh (`hackable_diffusion.sharding`) the same step is jitted with explicit shardings:

  graphdef, state, shardings = init_train_state_sharded(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)), tx, mesh)
  step = make_train_step(graphdef, tx, loss_config, mesh=mesh, shardings=shardings)
  state, metrics = step(state, shard_batch(batch, mesh), key)

Master weights (mixed precision for full fine-tuning of a bfloat16 model): `init_train_state(..., master_dtype=
'float32')` keeps the trainable variables in the state as a float32 copy (`master_params`) and creates the optimizer
state from it, so Adam's moments are float32; `make_train_step(..., param_dtypes=model_params)` casts that copy to
the dtypes the model stores (`compute_model`, bfloat16) for the forward/backward and applies the update to the
float32 copy (scanned layers with remat 'nothing_saveable' are cast one layer at a time inside their scan, and the
encoder and decoder passes share one gradient buffer: `scan.link_passes`). The
gradient is taken through the cast (the transpose of a cast is the cast back), so it arrives in float32 with the
bfloat16 backward pass's values (rounded to bfloat16 they are bit-identical; XLA may keep a last
operation's float32 result), and gradient accumulation, clipping and Adam run in float32; an update smaller than
half a bfloat16 unit in the last place accumulates in the master instead of being rounded away.

  model_params = nnx.state(model, nnx.Param)          # only the dtypes are read
  graphdef, state = init_train_state(model, tx, master_dtype="float32")
  step = make_train_step(graphdef, tx, loss_config, param_dtypes=model_params)
  model = state_to_model(graphdef, state, model_params)   # the model in its own dtype (bfloat16)

Checkpoints of such a state hold the float32 master (and float32 moments); restoring only the variables into the
model's own dtypes (`Checkpointer.restore_variables`, `run.load_run`) rounds them to bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss
from hackable_diffusion.lora import adapters as lora_adapters
from hackable_diffusion.model import scan
from hackable_diffusion.sharding.logical import (LOGICAL_AXIS_RULES, Rules, activation_sharding, batch_sharding,
                                                 constrain, replicated, state_shardings)

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: number of applied updates
  params: nnx.State  # trainable variables
  rest: nnx.State  # non-trainable variables
  opt_state: Any


def master_params(params: Any, dtype: Any = "float32") -> Any:
  """The master copy of trainable variables: every floating leaf stored in fewer bits than `dtype` as `dtype`
  (arrays, or ShapeDtypeStructs for an abstract state); the other leaves as they are."""
  dtype = jnp.dtype(dtype)

  def up(x):
    if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < jnp.finfo(dtype).bits):
      return x
    return x.update(dtype=dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)

  return jax.tree.map(up, params)


def _dtypes(param_dtypes: Any) -> tuple[jnp.dtype, ...] | None:
  """The leaf dtypes of a tree like the trainable variables (arrays, ShapeDtypeStructs or dtypes; None stays None)."""
  if param_dtypes is None:
    return None
  return tuple(jnp.dtype(getattr(x, "dtype", x)) for x in jax.tree.leaves(param_dtypes))


def cast_params(params: Any, param_dtypes: Any) -> Any:
  """`params` with each leaf cast to the dtype of the matching leaf of `param_dtypes` (a tree of the same leaves:
  arrays, ShapeDtypeStructs, or the tuple of their dtypes); the compute copy of a master. None: `params`."""
  if param_dtypes is None:
    return params
  dtypes = _dtypes(param_dtypes)
  leaves, treedef = jax.tree.flatten(params)
  if len(leaves) != len(dtypes):
    raise ValueError(f"param_dtypes has {len(dtypes)} leaves, the trainable variables {len(leaves)}")
  return jax.tree.unflatten(treedef, [x.astype(d) for x, d in zip(leaves, dtypes)])


def _scanned_block(path: tuple) -> tuple[int, str] | None:
  """(block j, keystr of the path inside the block) of a variable of stacked layers (`('layers', 'blocks', j,
  ...)`, see `model.scan`); None for any other path."""
  keys = [getattr(k, "key", None) for k in path[:3]]
  if len(path) > 3 and keys[:2] == ["layers", "blocks"] and isinstance(keys[2], int):
    return keys[2], jax.tree_util.keystr(tuple(path[3:]))
  return None


def compute_model(graphdef: nnx.GraphDef, params: Any, rest: Any, param_dtypes: Any = None) -> nnx.Module:
  """The model to run in a step: `params` (a master copy when `param_dtypes` is given) cast to `param_dtypes`.

  Stacked layers (`ModelConfig.scan_layers`) with remat 'nothing_saveable' run linked passes (`scan.link_passes`):
  the encoder and decoder passes add their layer gradients into one buffer, and with `param_dtypes` the layers are
  cast one layer at a time inside their scan, the rest here: the compute copy of the layers never exists whole, and
  their gradients stay in the master's dtype. Otherwise: `nnx.merge(graphdef, params, rest)` with `params` cast.
  """
  model = nnx.merge(graphdef, params, rest)
  linked = scan.is_scanned(model) and getattr(model.config, "remat", None) == "nothing_saveable"
  dtypes = _dtypes(param_dtypes)
  if dtypes is None:
    return scan.link_passes(model) if linked else model
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  if len(flat) != len(dtypes):
    raise ValueError(f"param_dtypes has {len(dtypes)} leaves, the trainable variables {len(flat)}")
  leaves, deferred = [], {}
  for (path, x), d in zip(flat, dtypes):
    where = _scanned_block(path) if linked and x.dtype != d else None
    if where is None:
      leaves.append(x.astype(d))
    else:
      deferred.setdefault(where[0], {})[where[1]] = d
      leaves.append(x)
  model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves), rest)
  return scan.link_passes(model, deferred) if linked else model


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, *, trainable: Any = nnx.Param,
                     master_dtype: Any = None) -> tuple[nnx.GraphDef, TrainState]:
  """`(graphdef, state)`; `master_dtype` (e.g. 'float32'): the state keeps the trainable variables as that master
  copy (`master_params`) and the optimizer state is created from it (see the module docstring)."""
  graphdef, params, rest = nnx.split(model, trainable, ...)
  if master_dtype is not None:
    params = master_params(params, master_dtype)
  opt_state = tx.init(params)
  return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=opt_state)


def abstract_train_state(params: nnx.State, rest: nnx.State | None, tx: optax.GradientTransformation) -> TrainState:
  """The `TrainState` of `params` / `rest` (arrays or shapes, kept as given) with the step counter and the
  optimizer state as shapes (`jax.eval_shape(tx.init, params)`): a restore target, or input to `state_shardings`."""
  return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest,
                    opt_state=jax.eval_shape(tx.init, params))


def train_state_shardings(mesh: Mesh, params: nnx.State, rest: nnx.State | None, tx: optax.GradientTransformation,
                          rules: Rules = LOGICAL_AXIS_RULES) -> TrainState:
  """`NamedSharding`s of the `TrainState` of `params` / `rest` on `mesh` (optimizer state sharded like the params)."""
  return state_shardings(mesh, abstract_train_state(params, rest, tx), rules)


def init_train_state_sharded(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh, *,
                             trainable: Any = nnx.Param, rules: Rules = LOGICAL_AXIS_RULES,
                             master_dtype: Any = None) -> tuple[nnx.GraphDef, TrainState, TrainState]:
  """`(graphdef, state, shardings)`: a `TrainState` created directly in its shards (never whole on one device).

  `model_fn` builds the model (e.g. `lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))`); it is traced, not run
  eagerly, and the compiled initialiser writes each shard on its own device. `master_dtype`: as in
  `init_train_state`.
  """
  graphdef = nnx.split(nnx.eval_shape(model_fn), trainable, ...)[0]  # what init_train_state splits into

  def make():
    return init_train_state(model_fn(), tx, trainable=trainable, master_dtype=master_dtype)[1]

  shardings = state_shardings(mesh, jax.eval_shape(make), rules)
  return graphdef, jax.jit(make, out_shardings=shardings)(), shardings


def state_to_model(graphdef: nnx.GraphDef, state: TrainState, param_dtypes: Any = None) -> nnx.Module:
  """The model of `state`; `param_dtypes` (a state with master weights): its variables cast to those dtypes."""
  return nnx.merge(graphdef, cast_params(state.params, param_dtypes), state.rest)


def _split_microbatches(batch: SFTBatch, k: int) -> SFTBatch:
  def split(x):
    if x.shape[0] % k:
      raise ValueError(f"batch size {x.shape[0]} is not divisible by train.grad_accum_steps={k}")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])
  return jax.tree.map(split, batch)


def make_loss_and_grad(graphdef: nnx.GraphDef, loss_config: LossConfig, param_dtypes: Any = None) -> Callable:
  """`((loss, metrics), grads) = f(params, rest, batch, key)`; `param_dtypes`: `params` is a master copy, cast to
  these dtypes for the model (the gradient is taken through the cast, so it has the master's dtypes)."""
  dtypes = _dtypes(param_dtypes)

  def loss_fn(params, rest, batch, key):
    # LoRA dropout draws from a key carried in the state (a no-op for models without dropout adapters).
    rest = lora_adapters.set_dropout_key(rest, jax.random.fold_in(key, 0x10A))
    return diffusion_loss(compute_model(graphdef, params, rest, dtypes), batch, key, loss_config)

  return jax.value_and_grad(loss_fn, has_aux=True)


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def keep_frozen(new: Any, old: Any, frozen: tuple[str, ...]) -> Any:
  """`new` with every leaf under a module named in `frozen` (a component of its path, e.g. 'router' in
  `layers.3.router.proj.kernel`) taken from `old` (bit for bit); `new` itself when `frozen` is empty."""
  if not frozen:
    return new
  names = set(frozen)

  def pick(path: Any, n: Any, o: Any) -> Any:
    return o if names.intersection(_key_name(k) for k in path) else n

  return jax.tree_util.tree_map_with_path(pick, new, old)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_config: LossConfig, *,
                    grad_accum_steps: int = 1, lr_schedule: Callable | None = None, jit: bool = True,
                    donate: bool = True, mesh: Mesh | None = None, shardings: TrainState | None = None,
                    rules: Rules = LOGICAL_AXIS_RULES, halt_after_non_finite: bool = False,
                    param_dtypes: Any = None, frozen: tuple[str, ...] = ()
                    ) -> Callable[..., tuple[TrainState, Metrics]]:
  """A jitted `(state, batch, key) -> (state, metrics)` (`jit=False`: the pure function, for callers that jit it
  themselves); `donate`: the input state's buffers are reused for the output.

  `halt_after_non_finite`: the step takes a fourth argument, `healthy` (a bool scalar: the previous step's
  `metrics['finite']`), and leaves the state unchanged unless it is True; `metrics['finite']` is then
  `healthy & finite`. Fed back step to step on the device, it freezes the state at the last good one from the first
  non-finite step on, so a trainer can read the flag at its logging interval instead of after every step.

  Gradient accumulation splits the batch into `grad_accum_steps` micro-batches (scanned; keys folded with the
  micro-batch index) and averages their gradients and metrics. A non-finite loss or gradient leaves the state
  unchanged (`metrics['finite'] == False`), so the last good state is what a trainer saves.

  `mesh`: the step for that mesh, with explicit in/out shardings: the state as `shardings` (required; from
  `init_train_state_sharded`, `train_state_shardings` or `sharding.state_shardings`), the batch as
  `sharding.batch_sharding(mesh)`, the key and metrics replicated. The caller passes the state already placed
  (`sharding.shard_state` / `init_train_state_sharded` / a sharded restore) and batches from `sharding.shard_batch`.
  Activations are constrained to the batch sharding where `sharding.constrain` is called (the batch itself here,
  the model's residual stream). Compiles once per batch shape.

  `param_dtypes` (a state with master weights, `init_train_state(master_dtype=...)`): the trainable variables as
  the model stores them (a tree like `state.params` of arrays or ShapeDtypeStructs; only the dtypes are read).
  Each step casts the master to them for the forward/backward and updates the master (see the module docstring).

  `frozen`: module names (e.g. ('router',), `ExperimentConfig.frozen_modules`) whose variables keep their values:
  the optimizer runs over them as over the others (the state's structure does not depend on it) and the step keeps
  the old values (`keep_frozen`).
  """
  if mesh is None and shardings is not None:
    raise ValueError("make_train_step: shardings=... needs mesh=... (the mesh they place the state on)")
  if mesh is not None and shardings is None:
    raise ValueError("make_train_step: mesh=... needs shardings=... (e.g. train_state_shardings(mesh, params, rest, "
                     "tx))")
  grad_fn = make_loss_and_grad(graphdef, loss_config, param_dtypes)

  def gradients(state: TrainState, batch: SFTBatch, key: jax.Array) -> tuple[Any, Metrics]:
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(state.params, state.rest, batch, key)
      return grads, metrics
    micro = _split_microbatches(batch, grad_accum_steps)

    def body(carry, xs):
      i, mb = xs
      (_, m), g = grad_fn(state.params, state.rest, mb, jax.random.fold_in(key, i))
      acc_g, acc_m = carry
      return (jax.tree.map(jnp.add, acc_g, g), jax.tree.map(jnp.add, acc_m, m)), None

    zeros_g = jax.tree.map(jnp.zeros_like, state.params)
    _, m_shape = jax.eval_shape(grad_fn, state.params, state.rest, jax.tree.map(lambda x: x[0], micro), key)[0]
    zeros_m = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape)
    (grads, metrics), _ = jax.lax.scan(body, (zeros_g, zeros_m), (jnp.arange(grad_accum_steps), micro))
    grads = jax.tree.map(lambda g: g / grad_accum_steps, grads)
    return grads, {k: (v if k == "num_tokens" else v / grad_accum_steps) for k, v in metrics.items()}

  def update(state: TrainState, grads: Any) -> TrainState:
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = keep_frozen(optax.apply_updates(state.params, updates), state.params, frozen)
    return TrainState(step=state.step + 1, params=params, rest=state.rest, opt_state=opt_state)

  def step(state: TrainState, batch: SFTBatch, key: jax.Array, *healthy: jax.Array) -> tuple[TrainState, Metrics]:
    if len(healthy) != int(halt_after_non_finite):
      raise TypeError(f"the train step takes {3 + int(halt_after_non_finite)} arguments (halt_after_non_finite="
                      f"{halt_after_non_finite}), got {3 + len(healthy)}")
    grads, metrics = gradients(state, batch, key)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    ok = jnp.logical_and(healthy[0], finite) if healthy else finite
    # a branch, not `where(ok, new, old)` over the state: the update then writes the donated parameters and
    # moments in place (a select keeps the old and the new state alive: ~2 extra copies of the moments)
    new = jax.lax.cond(ok, update, lambda state, _: state, state, grads)
    metrics = dict(metrics, grad_norm=grad_norm, finite=ok)
    if lr_schedule is not None:
      metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    return new, metrics

  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(step, donate_argnums=donate_argnums) if jit else step

  def sharded_step(state: TrainState, batch: SFTBatch, key: jax.Array, *healthy: jax.Array
                   ) -> tuple[TrainState, Metrics]:
    with activation_sharding(mesh, rules):
      batch = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)), batch)
      return step(state, batch, key, *healthy)

  if not jit:
    return sharded_step
  rep = replicated(mesh)
  in_shardings = (shardings, batch_sharding(mesh, rules), rep) + ((rep,) if halt_after_non_finite else ())
  return jax.jit(sharded_step, in_shardings=in_shardings, out_shardings=(shardings, rep),
                 donate_argnums=donate_argnums)


def make_eval_step(graphdef: nnx.GraphDef, loss_config: LossConfig,
                   param_dtypes: Any = None) -> Callable[[TrainState, SFTBatch, jax.Array], Metrics]:
  """A jitted `(state, batch, key) -> metrics` (the training loss on held-out data); `param_dtypes` as in
  `make_train_step`."""
  dtypes = _dtypes(param_dtypes)

  def step(state: TrainState, batch: SFTBatch, key: jax.Array) -> Metrics:
    return diffusion_loss(compute_model(graphdef, state.params, state.rest, dtypes), batch, key, loss_config)[1]

  return jax.jit(step)


__all__ = ["Metrics", "TrainState", "abstract_train_state", "cast_params", "compute_model", "init_train_state",
           "init_train_state_sharded", "keep_frozen", "make_eval_step", "make_loss_and_grad", "make_train_step",
           "master_params", "state_to_model", "train_state_shardings"]
