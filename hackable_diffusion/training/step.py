"""Pure, jitted train and eval steps: `(state, batch, key) -> (state, metrics)`, on one device or on a mesh.

The model is split once into a graph definition and two states: the trainable variables (a filter, `nnx.Param`
by default; `nnx.LoRAParam` under LoRA, so "train only adapters" is just a filter) and everything else
(frozen weights, buffers such as `layer_scalar`). Only the trainable part has gradients and optimizer state.

On a device mesh (`hackable_diffusion.sharding`) the same step is jitted with explicit shardings:

  graphdef, state, shardings = init_train_state_sharded(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)), tx, mesh)
  step = make_train_step(graphdef, tx, loss_config, mesh=mesh, shardings=shardings)
  state, metrics = step(state, shard_batch(batch, mesh), key)
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
from hackable_diffusion.sharding.logical import (LOGICAL_AXIS_RULES, Rules, activation_sharding, batch_sharding,
                                                 constrain, replicated, state_shardings)

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: number of applied updates
  params: nnx.State  # trainable variables
  rest: nnx.State  # non-trainable variables
  opt_state: Any


def init_train_state(model: nnx.Module, tx: optax.GradientTransformation, *,
                     trainable: Any = nnx.Param) -> tuple[nnx.GraphDef, TrainState]:
  graphdef, params, rest = nnx.split(model, trainable, ...)
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
                             trainable: Any = nnx.Param,
                             rules: Rules = LOGICAL_AXIS_RULES) -> tuple[nnx.GraphDef, TrainState, TrainState]:
  """`(graphdef, state, shardings)`: a `TrainState` created directly in its shards (never whole on one device).

  `model_fn` builds the model (e.g. `lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))`); it is traced, not run
  eagerly, and the compiled initialiser writes each shard on its own device.
  """
  graphdef = nnx.split(nnx.eval_shape(model_fn), trainable, ...)[0]  # what init_train_state splits into

  def make():
    return init_train_state(model_fn(), tx, trainable=trainable)[1]

  shardings = state_shardings(mesh, jax.eval_shape(make), rules)
  return graphdef, jax.jit(make, out_shardings=shardings)(), shardings


def state_to_model(graphdef: nnx.GraphDef, state: TrainState) -> nnx.Module:
  return nnx.merge(graphdef, state.params, state.rest)


def _split_microbatches(batch: SFTBatch, k: int) -> SFTBatch:
  def split(x):
    if x.shape[0] % k:
      raise ValueError(f"batch size {x.shape[0]} is not divisible by train.grad_accum_steps={k}")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])
  return jax.tree.map(split, batch)


def _select(pred: jax.Array, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def make_loss_and_grad(graphdef: nnx.GraphDef, loss_config: LossConfig) -> Callable:
  def loss_fn(params, rest, batch, key):
    # LoRA dropout draws from a key carried in the state (a no-op for models without dropout adapters).
    rest = lora_adapters.set_dropout_key(rest, jax.random.fold_in(key, 0x10A))
    model = nnx.merge(graphdef, params, rest)
    return diffusion_loss(model, batch, key, loss_config)

  return jax.value_and_grad(loss_fn, has_aux=True)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_config: LossConfig, *,
                    grad_accum_steps: int = 1, lr_schedule: Callable | None = None, jit: bool = True,
                    donate: bool = True, mesh: Mesh | None = None, shardings: TrainState | None = None,
                    rules: Rules = LOGICAL_AXIS_RULES, halt_after_non_finite: bool = False
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
  """
  if mesh is None and shardings is not None:
    raise ValueError("make_train_step: shardings=... needs mesh=... (the mesh they place the state on)")
  if mesh is not None and shardings is None:
    raise ValueError("make_train_step: mesh=... needs shardings=... (e.g. train_state_shardings(mesh, params, rest, "
                     "tx))")
  grad_fn = make_loss_and_grad(graphdef, loss_config)

  def step(state: TrainState, batch: SFTBatch, key: jax.Array) -> tuple[TrainState, Metrics]:
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(state.params, state.rest, batch, key)
    else:
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
      metrics = {k: (v if k == "num_tokens" else v / grad_accum_steps) for k, v in metrics.items()}
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    new = TrainState(step=state.step + 1, params=params, rest=state.rest, opt_state=opt_state)
    new = _select(finite, new, state)
    metrics = dict(metrics, grad_norm=grad_norm, finite=finite)
    if lr_schedule is not None:
      metrics["lr"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    return new, metrics

  def halting_step(state: TrainState, batch: SFTBatch, key: jax.Array,
                   healthy: jax.Array) -> tuple[TrainState, Metrics]:
    new, metrics = step(state, batch, key)
    ok = jnp.logical_and(healthy, metrics["finite"])
    return _select(ok, new, state), dict(metrics, finite=ok)

  body = halting_step if halt_after_non_finite else step
  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(body, donate_argnums=donate_argnums) if jit else body

  def sharded_step(state: TrainState, batch: SFTBatch, key: jax.Array, *healthy: jax.Array
                   ) -> tuple[TrainState, Metrics]:
    with activation_sharding(mesh, rules):
      batch = jax.tree.map(lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1)), batch)
      return body(state, batch, key, *healthy)

  if not jit:
    return sharded_step
  rep = replicated(mesh)
  in_shardings = (shardings, batch_sharding(mesh, rules), rep) + ((rep,) if halt_after_non_finite else ())
  return jax.jit(sharded_step, in_shardings=in_shardings, out_shardings=(shardings, rep),
                 donate_argnums=donate_argnums)


def make_eval_step(graphdef: nnx.GraphDef,
                   loss_config: LossConfig) -> Callable[[TrainState, SFTBatch, jax.Array], Metrics]:
  """A jitted `(state, batch, key) -> metrics` (the training loss on held-out data)."""

  def step(state: TrainState, batch: SFTBatch, key: jax.Array) -> Metrics:
    model = nnx.merge(graphdef, state.params, state.rest)
    return diffusion_loss(model, batch, key, loss_config)[1]

  return jax.jit(step)


__all__ = ["Metrics", "TrainState", "abstract_train_state", "init_train_state", "init_train_state_sharded",
           "make_eval_step", "make_loss_and_grad", "make_train_step", "state_to_model", "train_state_shardings"]
