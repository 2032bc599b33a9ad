"""Per-device memory of a training state under the logical-axis rules: exact bytes, no devices needed.

Shapes come from the real model built abstractly (`nnx.eval_shape`), shardings from the same rules as training,
and a mesh is just its axis sizes, so any mesh shape can be costed on a laptop. This module sits below `model/`
and `lora/`: the caller passes the model (a function building it) and the LoRA target regexes, e.g.

  from hackable_diffusion.lora import DEFAULT_TARGETS
  model_fn = lambda: DiffusionGemma(get_preset("diffusion_gemma_26b_a4b"), rngs=nnx.Rngs(0))
  print(memory_table(model_fn, [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}], lora_targets=DEFAULT_TARGETS))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sharding.logical import (LOGICAL_AXIS_RULES, MESH_AXES, MeshLike, Rules, leaves_with_axes,
                                                 logical_to_mesh_spec, mesh_axis_sizes, variable_axes)
from hackable_diffusion.targets import entry_matches

# a function building the model (traced with `nnx.eval_shape`, never run), a module, or its `nnx.State`
ModelLike = Callable[[], nnx.Module] | nnx.Module | nnx.State


def per_device_bytes(tree: Any, mesh: MeshLike, rules: Rules = LOGICAL_AXIS_RULES) -> int:
  """Exact bytes that every array of `tree` occupies on one device under the rules (shards are equal-sized).

  `tree`: as for `state_shardings` (concrete arrays or `ShapeDtypeStruct`s); `mesh`: a `Mesh` or just its axis
  sizes `{axis: size}` (no devices needed, so any mesh shape can be costed on a laptop).
  """
  sizes = mesh_axis_sizes(mesh)
  return sum(_shard_elements(x.shape, axes, sizes, rules) * jnp.dtype(x.dtype).itemsize
             for x, axes in leaves_with_axes(tree))


per_device_param_bytes = per_device_bytes


def _shard_elements(shape: Sequence[int], axes: Sequence[str | None] | None, sizes: Mapping[str, int],
                    rules: Rules) -> int:
  """Elements of one shard of a `shape` array with logical `axes` on a mesh of axis `sizes`."""
  spec: PartitionSpec = logical_to_mesh_spec(axes, rules=rules, mesh=sizes, shape=shape)
  n = 1
  for dim, size in enumerate(shape):
    entry = spec[dim] if dim < len(spec) else None
    mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    n *= size // math.prod(sizes[a] for a in mesh_axes)
  return n


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of the training state (activations, XLA temporaries and the batch are not included)."""

  mesh: dict[str, int]
  params: int  # every model variable (trainable and frozen), in its own dtype
  adapters: int  # LoRA adapters (0 for full fine-tuning)
  grads: int  # gradients of the trainable variables
  optimizer: int  # Adam's two moments of the trainable variables
  num_params: int  # global counts
  num_trainable: int

  @property
  def total(self) -> int:
    return self.params + self.adapters + self.grads + self.optimizer


def abstract_state(model: ModelLike) -> nnx.State:
  """Every variable of `model` as a state; a function is traced (`nnx.eval_shape`: shapes only, no arrays)."""
  if isinstance(model, nnx.State):
    return model
  if isinstance(model, nnx.Module):
    return nnx.state(model)
  return nnx.state(nnx.eval_shape(model))


def memory_estimate(model: ModelLike, mesh: MeshLike, *, lora_rank: int | None = None,
                    lora_targets: Sequence[str] = (), adapter_dtype: str = "float32", grad_dtype: str | None = None,
                    moment_dtype: str = "float32", rules: Rules = LOGICAL_AXIS_RULES) -> MemoryEstimate:
  """Per-device memory of fine-tuning `model` on a mesh of the given axis sizes.

  `model`: e.g. `lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))` (traced, not run; pass `abstract_state(...)`
  to cost several meshes without tracing again). Parameter dtypes are the model's (build it with the
  `param_dtype` to cost).
  Full fine-tuning (`lora_rank=None`): every `nnx.Param` is trainable; gradients in `grad_dtype` (default: each
  parameter's dtype) and two Adam moments in `moment_dtype` share the parameters' sharding.
  LoRA: the base model is frozen; every `[d_in, d_out]` kernel whose dotted module path (`layers.0.self_attn.
  q_proj`) an entry of `lora_targets` selects (as `LoraConfig.target_modules`, `targets.entry_matches`) gets
  `A [d_in, r]` and `B [r, d_out]` in `adapter_dtype`, sharded like the kernel's input / output axis (as
  `lora.adapters` annotates them); gradients (default: `adapter_dtype`) and moments are those of the adapters.
  """
  sizes = mesh_axis_sizes(mesh)
  state = abstract_state(model)
  variables = list(nnx.to_flat_state(state))
  params = per_device_bytes(state, sizes, rules)
  num_params = sum(math.prod(x.shape) for x, _ in leaves_with_axes(state))
  trainable = [(tuple(str(p) for p in path), var) for path, var in variables if isinstance(var, nnx.Param)]
  if lora_rank is None:
    per_dev = grads = num_trainable = 0
    for _, var in trainable:
      n = _shard_elements(var.shape, variable_axes(var), sizes, rules)
      per_dev += n
      grads += n * jnp.dtype(grad_dtype or var.dtype).itemsize
      num_trainable += math.prod(var.shape)
    adapters = 0
  else:
    if not lora_targets:
      raise ConfigError(f"memory_estimate: lora_rank={lora_rank} needs lora_targets (e.g. lora.DEFAULT_TARGETS)")
    matched: set[str] = set()
    num_trainable = per_dev = 0
    for names, var in trainable:
      module = ".".join(names[:-1])
      hits = {t for t in lora_targets if entry_matches(t, module)}
      if names[-1] != "kernel" or len(var.shape) != 2 or not hits:
        continue
      matched |= hits
      d_in, d_out = var.shape
      axes = variable_axes(var) or (None, None)
      num_trainable += lora_rank * (d_in + d_out)
      # as `lora.adapters` creates them: A [d_in, r] keeps the kernel's input axis, B [r, d_out] its output axis
      per_dev += _shard_elements((d_in, lora_rank), (axes[0], None), sizes, rules)
      per_dev += _shard_elements((lora_rank, d_out), (None, axes[1]), sizes, rules)
    unmatched = [t for t in lora_targets if t not in matched]
    if unmatched:
      raise ConfigError(f"memory_estimate: lora_targets entry {unmatched[0]!r} matches no 2-D kernel of the model")
    grads = per_dev * jnp.dtype(grad_dtype or adapter_dtype).itemsize
    adapters = per_dev * jnp.dtype(adapter_dtype).itemsize
  return MemoryEstimate(mesh=dict(sizes), params=params, adapters=adapters, grads=grads,
                        optimizer=2 * per_dev * jnp.dtype(moment_dtype).itemsize, num_params=num_params,
                        num_trainable=num_trainable)


def memory_table(model: ModelLike, meshes: Sequence[Mapping[str, int]], *, lora_ranks: Sequence[int] = (8, 16),
                 **kwargs: Any) -> str:
  """A markdown table of `memory_estimate` (GiB per device) for full fine-tuning and LoRA on each mesh.

  `model` is traced once; `kwargs` go to `memory_estimate` (`lora_targets` is needed when `lora_ranks` is set).
  """
  state = abstract_state(model)
  gib = 1024 ** 3
  rows = ["| mesh (data x fsdp x tensor x expert) | devices | method | params | adapters | grads | Adam moments "
          "| total |", "|---|---|---|---|---|---|---|---|"]
  for m in meshes:
    sizes = {a: int(m.get(a, 1)) for a in MESH_AXES}
    label = " x ".join(str(sizes[a]) for a in MESH_AXES)
    methods = [("full", None)] + [(f"LoRA r{r}", r) for r in lora_ranks]
    for name, rank in methods:
      e = memory_estimate(state, sizes, lora_rank=rank, **kwargs)
      rows.append(f"| {label} | {math.prod(sizes.values())} | {name} | {e.params / gib:.2f} | "
                  f"{e.adapters / gib:.3f} | {e.grads / gib:.3f} | {e.optimizer / gib:.3f} | {e.total / gib:.2f} |")
  return "\n".join(rows)


__all__ = ["MemoryEstimate", "ModelLike", "abstract_state", "memory_estimate", "memory_table", "per_device_bytes",
           "per_device_param_bytes"]
