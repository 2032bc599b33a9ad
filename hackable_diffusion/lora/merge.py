"""Folding adapters into the base weights (`merge`) and separating them from it (`split`).

`merge` computes `kernel + scale * lora_a @ lora_b` (and `P[e] + scale * (a[e] @ b[e]).T` for expert tensors) in
float32, casts to the base parameter dtype and returns a plain `DiffusionGemma` (no adapter modules left): the
model to export for serving (vLLM has no LoRA support for DiffusionGemma). Because our encoder and decoder share
one set of weights, each update is added exactly once; PEFT's `merge_and_unload()` on the transformers model,
whose encoder and decoder are separate modules with tied weights, adds it once per mode (see docs/lora.md).
A quantized base (QLoRA, `lora.qlora`) is dequantized in float32 first (values times scales), the update added,
and the sum cast to the dense parameter dtype; quantized modules without adapters are dequantized too, so the
result is always a dense model.

`merged_parts` yields the same merged variables a part at a time, so that a writer never holds a merged copy of
the whole model: on the host one tensor at a time (the base read in place), elsewhere one layer at a time (each layer
sliced out of a stacked model, merged, handed over and dropped).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.lora import qlora
from hackable_diffusion.lora.adapters import (EXPERT_PARAMS, AdapterModule, LoRAClippableLinear, LoRADropoutKey,
                                              LoRAExperts, LoRALinear, lora_modules)
from hackable_diffusion.model import moe, scan
from hackable_diffusion.model.vision_layers import ClippableLinear


def _plain_linear(src: LoRALinear) -> nnx.Linear:
  if isinstance(src, qlora.QuantizedLinear):
    return qlora.plain_module(src, {None: src.delta()})
  kernel = src.kernel[...]
  merged = (kernel.astype(jnp.float32) + src.delta()).astype(kernel.dtype)
  lin = nnx.eval_shape(lambda: nnx.Linear(
      src.in_features, src.out_features, use_bias=src.use_bias, dtype=src.dtype, param_dtype=src.param_dtype,
      precision=src.precision, dot_general=src.dot_general, promote_dtype=src.promote_dtype,
      preferred_element_type=src.preferred_element_type, rngs=nnx.Rngs(0)))
  lin.kernel = src.kernel.replace(merged)
  if src.use_bias:
    lin.bias = src.bias.replace(src.bias[...])
  return lin


def _plain_clippable(src: LoRAClippableLinear) -> ClippableLinear:
  """The vision `ClippableLinear` of `src` with its update folded into the kernel (its bounds kept)."""
  kernel = src.kernel[...]
  merged = (kernel.astype(jnp.float32) + src.delta()).astype(kernel.dtype)
  axes = src.kernel.get_metadata().get("out_sharding") or (None, None)
  with nnx.use_eager_sharding(False):
    plain = nnx.eval_shape(lambda: ClippableLinear(src.in_features, src.out_features, tuple(axes),
                                                   clipped=src.clipped, rngs=nnx.Rngs(0), dtype=src.dtype,
                                                   param_dtype=kernel.dtype, std=0.02))
  plain.kernel = src.kernel.replace(merged)
  if src.clipped:  # the wrapped layer's own bound Variables
    plain.input_min, plain.input_max = src.input_min, src.input_max
    plain.output_min, plain.output_max = src.output_min, src.output_max
  return plain


def _plain(src: AdapterModule) -> nnx.Module:
  """The adapter-free module of one adapter module, its update folded in."""
  if isinstance(src, LoRAClippableLinear):
    return _plain_clippable(src)
  return _plain_linear(src) if isinstance(src, LoRALinear) else _plain_experts(src)


def _plain_experts(src: LoRAExperts) -> moe.Experts:
  if isinstance(src, qlora.QuantizedExperts):
    return qlora.plain_module(src, {name: src.delta(name) for name in src.targets})
  e, two_i, h = src.gate_up_proj.shape
  with nnx.use_eager_sharding(False):
    new = nnx.eval_shape(lambda: moe.Experts(h, two_i // 2, e, rngs=nnx.Rngs(0), dtype=src.dtype,
                                                param_dtype=src.gate_up_proj.dtype, std=0.02, impl=src.impl,
                                                matmul_dtype=src.matmul_dtype))
  for name in EXPERT_PARAMS:
    var = getattr(src, name)
    value = var[...]
    if name in src.targets:
      value = _merged_experts(src, name, value)
    setattr(new, name, var.replace(value))
  return new


# One float32 copy of the experts merged in one step (its temporaries: a few such copies). Not much smaller: blocks
# of this size are allocated and returned to the system one by one (glibc's mmap threshold tops out at 32 MiB),
# while many small ones fragment the heap and raise the peak.
MERGE_CHUNK_BYTES = 32 << 20


# The host merge's float32 chunk (a few such temporaries exist beside the merged tensor): small, since numpy's
# temporaries come and go without the device allocator's pooling.
HOST_CHUNK_BYTES = 2 << 20


def _merged_experts(src: LoRAExperts, name: str, value: jax.Array) -> jax.Array:
  """`value + delta` of expert tensor `name` [E, out, in] in float32, cast back, a few experts at a time: the float32
  temporaries stay near `MERGE_CHUNK_BYTES` instead of several copies of the whole tensor (the values are the same
  as in one step: each expert's update is its own matrix product)."""
  e = value.shape[0]
  step = max(1, min(e, MERGE_CHUNK_BYTES // max(1, 4 * (value.size // max(e, 1)))))
  pieces = [(value[i:i + step].astype(jnp.float32) + src.delta(name, slice(i, i + step))).astype(value.dtype)
            for i in range(0, e, step)]
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def merge(model: nnx.Module) -> nnx.Module:
  """A copy of `model` with every adapter folded into its base weights and the adapter modules removed.

  The result has exactly the variables (paths, dtypes, shapes) of the un-adapted dense model (a quantized base is
  dequantized: `lora.qlora.dequantize_base`). A scanned model (`model.scan`) comes back with its layers unstacked.
  """
  model = nnx.clone(scan.unstack_layers(model))
  for path, module in list(lora_modules(model)):
    qlora.set_module(model, path, _plain(module))
  return qlora.dequantize_base(model)


def _merged_module(module: nnx.Module) -> nnx.Module:
  """`module` (a fresh copy, changed in place) with its adapters folded in and its quantized base dequantized."""
  for path, sub in list(lora_modules(module)):
    plain = _plain(sub)
    if not path:
      return plain
    qlora.set_module(module, path, plain)
  if qlora.is_quantized(module):
    return qlora.plain_module(module)
  return qlora.dequantize_base(module)


def layer_module(model: nnx.Module, i: int, *, adapters_only: bool = False) -> nnx.Module:
  """Layer `i` of `model` as a module of its own, sharing nothing that merging changes: a copy of the graph of an
  unrolled layer (its arrays shared), or for stacked layers (`model.scan`) a module holding the `i`-th slices (one
  layer's arrays, copied on the device the stack lives on). `adapters_only`: only the `nnx.LoRAParam`s are sliced,
  every other variable of a stacked layer holds its shape (`jax.ShapeDtypeStruct`), never read: what reading the
  adapters needs, also of a model whose base was never loaded (its variables shapes only)."""
  layers = model.layers
  if not scan.is_scanned(model):
    return nnx.clone(layers[i])
  graphdef, state = nnx.split(layers.blocks[i % layers.period])
  k = i // layers.period

  def one(a: Any, sliced: bool) -> Any:
    return a[k] if sliced else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)

  def take(v: nnx.Variable) -> nnx.Variable:
    axes = v.get_metadata().get("out_sharding")
    sliced = not adapters_only or isinstance(v, nnx.LoRAParam)
    v = v.replace(jax.tree.map(lambda a: one(a, sliced), v.get_value()))
    return v.replace(out_sharding=tuple(axes)[1:]) if axes else v

  return nnx.merge(graphdef, jax.tree.map(take, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


VariablePath = tuple[Any, ...]


def on_host(model: nnx.Module) -> bool:
  """Every array of `model` lives whole on one CPU device of this process: numpy reads it without a copy."""
  for _, v in nnx.to_flat_state(nnx.state(model)):
    for a in jax.tree.leaves(v.get_value()):
      if isinstance(a, jax.Array) and (len(a.devices()) != 1 or next(iter(a.devices())).platform != "cpu"):
        return False
  return True


def _host_layer(model: nnx.Module, i: int) -> Iterator[tuple[VariablePath, np.ndarray]]:
  """Layer `i` of `merge(model)` for a dense base on the host, variable by variable: each base array is read in
  place (a numpy view of the stacked array's slice), the update computed by the adapter module's own `delta` and
  added in float32 (a few experts at a time), then cast back: the same float32 sums and casts as `merge`, so the
  same values, while only one merged tensor exists at a time."""
  layers = model.layers
  if scan.is_scanned(model):
    block, k = layers.blocks[i % layers.period], i // layers.period
  else:
    block, k = layers[i], None
  owners = dict(lora_modules(layer_module(model, i, adapters_only=True)))
  for path, var in nnx.to_flat_state(nnx.state(block)):
    if isinstance(var, (nnx.LoRAParam, LoRADropoutKey)):
      continue
    host = np.asarray(var.get_value())
    base = host if k is None else host[k]
    owner, name = owners.get(tuple(path[:-1])), path[-1]
    if isinstance(owner, LoRALinear) and name == "kernel":
      base = (base.astype(np.float32) + np.asarray(owner.delta())).astype(base.dtype)
    elif isinstance(owner, LoRAExperts) and name in owner.targets:
      base = _host_merged_experts(owner, name, base)
    yield ("layers", i, *path), base


def _host_merged_experts(src: LoRAExperts, name: str, value: np.ndarray) -> np.ndarray:
  """`_merged_experts` with the base read in place on the host: float32 temporaries near `HOST_CHUNK_BYTES`."""
  e = value.shape[0]
  step = max(1, min(e, HOST_CHUNK_BYTES // max(1, 4 * (value.size // max(e, 1)))))
  out = np.empty_like(value)
  for i in range(0, e, step):
    chunk = value[i:i + step].astype(np.float32)
    out[i:i + step] = np.add(chunk, np.asarray(src.delta(name, slice(i, i + step))), out=chunk)
  return out


def merged_parts(model: nnx.Module, *, whole_layers: bool = False
                 ) -> Iterator[list[tuple[VariablePath, jax.Array | np.ndarray]]]:
  """The variables of `merge(model)` (same paths and values), one part at a time; an unrolled layer's paths start
  `('layers', i)` whatever the model's form. A part's arrays are released once the caller drops them.

  A dense (not quantized) base whose arrays live on this process's CPU is merged on the host one tensor at a time
  (`_host_layer`: each part is one numpy array, or one layer if `whole_layers`): peak memory is the model as it is
  plus one merged tensor. Otherwise (a device, a mesh, a quantized base) each layer is merged where its weights are,
  as a module: the model plus one merged layer. Other top-level modules and variables are a part each.
  """
  tops: list[Any] = []
  for path, _ in nnx.to_flat_state(nnx.state(model)):
    if path[0] not in tops:
      tops.append(path[0])
  host = qlora.base_quantization(model) == "none" and on_host(model)
  for top in tops:
    if top == "layers":
      for i in range(len(model.layers)):  # nothing of layer i is referenced here while layer i + 1 is merged
        if not host:
          yield _variables(("layers", i), _merged_module(layer_module(model, i)))
        elif whole_layers:
          yield list(_host_layer(model, i))
        else:
          yield from ([item] for item in _host_layer(model, i))
      continue
    node = getattr(model, top)
    if isinstance(node, nnx.Variable):
      yield [((top,), node[...])]
    else:
      yield _variables((top,), _merged_module(nnx.clone(node)))


def _variables(prefix: VariablePath, module: nnx.Module) -> list[tuple[VariablePath, jax.Array]]:
  return [((*prefix, *p), v[...]) for p, v in nnx.to_flat_state(nnx.state(module))]


def split(model: nnx.Module) -> tuple[nnx.State, nnx.State]:
  """(base_state, adapter_state): every non-adapter variable, and the `nnx.LoRAParam`s only.

  `nnx.merge(nnx.graphdef(model), base_state, adapter_state)` rebuilds the model; the adapter state alone is
  what a LoRA checkpoint needs to hold.
  """
  _, adapter, base = nnx.split(model, nnx.LoRAParam, ...)
  return base, adapter


def adapter_num_params(model: nnx.Module) -> int:
  return sum(int(v.size) for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))


__all__ = ["HOST_CHUNK_BYTES", "MERGE_CHUNK_BYTES", "VariablePath", "adapter_num_params", "layer_module", "merge",
           "merged_parts", "on_host", "split"]
