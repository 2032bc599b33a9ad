"""Scanned layers: the decoder layers run under one `jax.lax.scan` over their repeating attention pattern.

Gemma-4 repeats a period of layer types (5 sliding : 1 full). Layer `j` of every period has the same structure, so
`stack_layers(model)` stores layers `j, j + p, j + 2p, ...` as one layer whose arrays carry a leading `[groups]` axis
(`ScannedLayers.blocks[j]`), and the forward runs one period per scan iteration: a 30-layer model compiles one
period (6 layers) instead of 30, and with rematerialisation the backward pass keeps one period's residuals at a time.

The unrolled form (`model.layers[i]`, Hugging Face names `layers.N.*`) stays the public one: loading, LoRA surgery,
PEFT and merged export and the name tables all see it. A run stacks its model after loading and adding adapters
(`ModelConfig.scan_layers`), and `unstack_layers` gives the unrolled model back (exporting a scanned run does it).
Stacked variables keep their sharding metadata with a leading replicated axis (`None`), so the logical-axis rules
shard them as before.

A training step (`training.step.compute_model`, remat 'nothing_saveable') *links* the passes (`link_passes`): each
pass (encoder, decoder) runs through `scan_grad.scan_layers`, whose backward pass recomputes each layer from its
input and adds its weight gradient into one buffer shared by all passes (autodiff would keep one stacked gradient per
pass: two of 10.6 GiB per device for the 26B-A4B's fp32 layers on fsdp=8). With a master copy (fp32 master, bf16
compute) the stacked layers are also cast one layer at a time inside the scan instead of all at once before it: the
compute copy of the layers never exists whole (5.9 GiB per device), and their gradients stay in the master's dtype.

A scanned model's KV cache is stacked the same way (`KVCache.groups`: `keys[j]` is `[groups, B, S, ...]`, made by
`init_cache`), so the scan reads and writes its slices in place: no copy of the cache per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import scan_grad


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _with_axes(var: nnx.Variable, change: Callable[[tuple], tuple]) -> nnx.Variable:
  """`var` with its logical axes (`out_sharding` metadata) changed by `change`; unchanged without them."""
  axes = var.get_metadata().get("out_sharding")
  return var.replace(out_sharding=change(tuple(axes))) if axes else var


def layer_period(config: Any) -> int:
  """The shortest period `p` of `config.layer_types` that divides the number of layers (the layer count itself
  when the pattern does not repeat)."""
  types, n = tuple(config.layer_types), config.num_hidden_layers
  return next(p for p in range(1, n + 1) if n % p == 0 and all(types[i] == types[i % p] for i in range(n)))


class ScannedLayers(nnx.Module):
  """`blocks[j]` holds layers `j, j + period, ...` stacked (`[groups, ...]` arrays); layer `i` is
  `blocks[i % period]` at index `i // period`."""

  def __init__(self, blocks: Sequence[nnx.Module], period: int, groups: int,
               adapter_indices: Sequence[dict[tuple, int]] = ()):
    self.blocks = nnx.List(list(blocks))
    self.period = period
    self.groups = groups
    # per layer: its LoRA adapters' dropout indices (static; restored by `unstack_layers`)
    self.adapter_indices = tuple(tuple(sorted(d.items())) for d in adapter_indices) or ((),) * (period * groups)
    # training (`link_passes`): passes run through `scan_grad.scan_layers` and share one gradient buffer
    self.linked = False
    # per block: ((path of a variable's array in the block's state, dtype name), ...) cast inside the scan
    self.cast_at_use: tuple[tuple[tuple[str, str], ...], ...] = ((),) * period

  def __len__(self) -> int:
    return self.period * self.groups

  def run(self, fn: Callable[[nnx.Module, Any, Any], tuple[Any, Any]], x: Any, per_block: Sequence[Any]
          ) -> tuple[Any, list[Any]]:
    """Runs `x, out_i = fn(layer_i, x, input_i)` for i = 0..N-1 as a scan over groups of `period` layers.

    per_block: one pytree per block `j` (`period` of them) whose arrays stack the per-layer inputs of layers
    `j, j + period, ...` on a leading `[groups]` axis (e.g. a stacked KV cache's `keys[j]`). Returns the final `x`
    and the outputs stacked the same way (one pytree per block).
    """
    p = self.period
    if len(per_block) != p:
      raise ValueError(f"ScannedLayers.run: {len(per_block)} per-block inputs for a period of {p} layers")
    graphdefs, states = zip(*(nnx.split(block) for block in self.blocks))
    casts = [dict(c) for c in self.cast_at_use]

    def layer(j: int, state: Any, carry: Any, inputs: Any) -> tuple[Any, Any]:
      return fn(nnx.merge(graphdefs[j], _cast_paths(state, casts[j]) if casts[j] else state), carry, inputs)

    if self.linked:  # the next pass reads the link: its gradient is handed to this pass's backward scan
      x, outs, link = scan_grad.scan_layers(layer, list(states), x, list(per_block))
      # new blocks over the link (the variables of the old ones may belong to an outer trace)
      self.blocks = nnx.List([nnx.merge(g, state) for g, state in zip(graphdefs, link)])
      return x, outs

    def body(carry, xs):
      group_states, group_inputs = xs
      outs = []
      for j in range(p):
        carry, out = layer(j, group_states[j], carry, group_inputs[j])
        outs.append(out)
      return carry, outs

    return jax.lax.scan(body, x, (list(states), list(per_block)))


def _cast_paths(state: Any, dtypes: dict[str, str]) -> Any:
  """`state` with the arrays at the paths in `dtypes` (`jax.tree_util.keystr` of their path) cast to that dtype."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x.astype(dtypes[jax.tree_util.keystr(path)]) if jax.tree_util.keystr(path) in dtypes else x,
      state)


def link_passes(model: nnx.Module, dtypes: dict[int, dict[str, str]] | None = None) -> nnx.Module:
  """Makes the stacked layers of a traced `model` (inside a training step) run each pass through
  `scan_grad.scan_layers`, in place: the layers are recomputed in the backward pass (the 'nothing_saveable' policy;
  the model's own per-layer remat is then off) and all passes of the step add into one gradient buffer.

  dtypes: `{block j: {keystr of a path in block j's state: dtype name}}` (paths as `nnx.split(block)` gives them,
  i.e. a trainable variable's path in the model minus its leading `('layers', 'blocks', j)`): the scan reads these
  arrays (a master copy) and casts each layer's slice where it is used.
  """
  layers = model.layers
  if not isinstance(layers, ScannedLayers):
    raise ValueError("link_passes: the model's layers are not stacked (scan.stack_layers)")
  dtypes = dtypes or {}
  bad = sorted(set(dtypes) - set(range(layers.period)))
  if bad:
    raise ValueError(f"link_passes: blocks {bad} do not exist (the layer period is {layers.period})")
  layers.linked = True
  layers.cast_at_use = tuple(tuple(sorted((path, str(jnp.dtype(d))) for path, d in dtypes.get(j, {}).items()))
                             for j in range(layers.period))
  return model


def is_linked(layers: Any) -> bool:
  """Whether `layers` (a model's `layers`) run linked passes (`link_passes`), which rematerialise on their own."""
  return isinstance(layers, ScannedLayers) and layers.linked


def _unused_indices(layer: nnx.Module) -> dict[tuple, int]:
  """`{path: dropout_index}` of the LoRA adapters in `layer` (their per-module dropout seeds, which make otherwise
  equal layers differ in structure), reset to 0 here; a `ConfigError` if an adapter has dropout on (its masks would
  need a per-layer seed inside the scan)."""
  out = {}
  for path, module in nnx.iter_graph(layer):
    if isinstance(module, nnx.Module) and hasattr(module, "dropout_index"):
      if getattr(module, "dropout_rate", 0.0) > 0:
        raise ConfigError("scanned layers (ModelConfig.scan_layers) do not support LoRA dropout; set "
                          "lora.dropout=0 or scan_layers=False")
      out[tuple(path)] = module.dropout_index
      module.dropout_index = 0
  return out


def _set_indices(layer: nnx.Module, indices: dict[tuple, int]) -> None:
  for path, module in nnx.iter_graph(layer):
    if tuple(path) in indices:
      module.dropout_index = indices[tuple(path)]


def _stack_block(layers: Sequence[nnx.Module], numbers: Sequence[int], donate: bool) -> nnx.Module:
  """One module whose arrays are the `layers`' arrays (model layers `numbers`) stacked on a new leading axis (the
  layers must share one structure); `donate`: each source array is deleted once stacked (peak memory: one stacked
  array more)."""
  graphdef, first = nnx.split(layers[0])
  signature = [(a.shape, a.dtype) for a in jax.tree.leaves(first)]
  states = [first]
  for layer, number in zip(layers[1:], numbers[1:]):
    other, state = nnx.split(layer)
    if other != graphdef or [(a.shape, a.dtype) for a in jax.tree.leaves(state)] != signature:
      raise ConfigError(f"stack_layers: layer {number} differs in structure from layer {numbers[0]} (same place "
                        "in the layer period); cannot scan")
    states.append(state)

  def stack(*variables: nnx.Variable) -> nnx.Variable:
    values = [v.get_value() for v in variables]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *values)
    if donate:
      for a in jax.tree.leaves(values):
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and not a.is_deleted():
          a.delete()
    return _with_axes(variables[0].replace(stacked), lambda axes: (None, *axes))

  state = jax.tree.map(stack, *states, is_leaf=_is_variable)
  return nnx.merge(graphdef, state)


def stack_layers(model: nnx.Module, *, donate: bool = False) -> nnx.Module:
  """Replaces `model.layers` (a list of layers) by `ScannedLayers` over the config's layer period, in place.

  `donate`: delete each per-layer array once it is stacked (the model's old layers become unusable; what a trainer
  does to keep one copy of the weights). A model already stacked is returned as is.
  """
  if isinstance(model.layers, ScannedLayers):
    return model
  layers = list(model.layers)
  p = layer_period(model.config)
  g = len(layers) // p
  indices = tuple(_unused_indices(layer) for layer in layers)
  blocks = [_stack_block(layers[j::p], range(j, len(layers), p), donate) for j in range(p)]
  model.layers = ScannedLayers(blocks, p, g, indices)
  return model


def _unstack_block(block: nnx.Module, groups: int, on_host: bool) -> list[nnx.Module]:
  graphdef, state = nnx.split(block)
  if on_host:  # one transfer per stacked array; every layer's array is then a view of it
    state = jax.tree.map(np.asarray, state)

  def take(k: int) -> Callable[[nnx.Variable], nnx.Variable]:
    def one(v: nnx.Variable) -> nnx.Variable:
      return _with_axes(v.replace(jax.tree.map(lambda a: a[k], v.get_value())), lambda axes: axes[1:])
    return one

  return [nnx.merge(graphdef, jax.tree.map(take(k), state, is_leaf=_is_variable)) for k in range(groups)]


def unstack_layers(model: nnx.Module, *, on_host: bool = False) -> nnx.Module:
  """The inverse of `stack_layers`: a new model (sharing every array outside the layers) whose `layers` is the list
  of per-layer modules again, their arrays slices of the stacked ones (copies on the device; `on_host`: numpy
  views of the stacked arrays copied to the host, no device memory: what writing a checkpoint needs). An unrolled
  model is returned as is."""
  scanned = model.layers
  if not isinstance(scanned, ScannedLayers):
    return model
  model = nnx.merge(*nnx.split(model))
  per_block = [_unstack_block(block, scanned.groups, on_host) for block in scanned.blocks]
  layers = [per_block[i % scanned.period][i // scanned.period] for i in range(len(scanned))]
  for layer, indices in zip(layers, scanned.adapter_indices):
    _set_indices(layer, dict(indices))
  model.layers = nnx.List(layers)
  return model


def is_scanned(model: Any) -> bool:
  """Whether `model.layers` is stacked (`stack_layers`)."""
  return isinstance(getattr(model, "layers", None), ScannedLayers)


__all__ = ["ScannedLayers", "is_linked", "is_scanned", "layer_period", "link_passes", "stack_layers", "unstack_layers"]
