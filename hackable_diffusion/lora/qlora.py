"""QLoRA's base: linear layers and experts whose frozen weights stay quantized on the device (FP8, int4, NVFP4).

The quantized arrays (modes, qwix's format, packing, dequantization) are `lora.qarrays`'. The modules keep the base
parameter paths: `QuantizedLinear.kernel` holds the values of the `[in, out]` kernel and `kernel_scale` the scales
(`kernel_table`: NVFP4's scale table, else None); `QuantizedExperts.gate_up_proj [E, 2I, H]` / `down_proj
[E, H, I]` the values and `<name>_scale` / `<name>_table` the scales. Values are stored as raw bytes (float8 one per
uint8, int4 / FP4 two per uint8 along the last axis: `[in, out / 2]`, `[E, 2I, H / 2]`). All are `QuantizedBase`
variables, not `nnx.Param`: no optimizer filter selects them and `jax.grad` never sees them. Dequantization happens
inside the layer's forward (`dequantized_kernel`, `expert_weights`; under the `tiled` MoE kernel one expert at a
time inside its loop), so under the model's per-layer remat the dense copy is recomputed in the backward pass, not
kept (`input_tie` keeps XLA from undoing that).

Which modules are quantized: every `nnx.Linear` except the router's projection (tiny, and routing is sensitive),
and every expert tensor; the embedding (the tied LM head), norms and router stay as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora.qarrays import (FP8, INT4, MODES, NONE, NVFP4, QuantizationSpec, dequantize, input_tie,
                                             is_4bit, logical_shape, quantize, quantize_weight, scale_axes,
                                             scale_table, stored, typed)
from hackable_diffusion.model import moe, moe_tiled

Array = jax.Array
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class QuantizedBase(nnx.Variable):
  """A frozen quantized weight's values or scales (not an `nnx.Param`: never trained, never in an optimizer)."""


def _variable(value: Array, axes: tuple[Any, ...] | None) -> QuantizedBase:
  with nnx.use_eager_sharding(False):
    return QuantizedBase(value, out_sharding=axes) if axes is not None else QuantizedBase(value)


def _axes(var: nnx.Variable) -> tuple[Any, ...] | None:
  return var.get_metadata().get("out_sharding")


def _stored_scale(scale: Array) -> Array:
  """Scales as stored: float8 ones (NVFP4's block scales) as their bytes, the others as they are."""
  return stored(scale, scale.dtype) if jnp.dtype(scale.dtype) == jnp.dtype(jnp.float8_e4m3fn) else scale


def _table_variable(value: Array | None, axes: tuple[Any, ...] | None) -> QuantizedBase | None:
  """NVFP4's scale table `[..., G, 256]` as a variable (1 KiB per group: sharded like the experts' leading axis,
  else replicated); None in other modes."""
  if value is None:
    return nnx.data(None)
  lead = (axes[0],) if axes and value.ndim == 3 else (None,) * (value.ndim - 2)
  return _variable(jnp.asarray(value, jnp.float32), (*lead, None, None) if any(lead) else None)


def _value(var: QuantizedBase | None) -> Array | None:
  return None if var is None else var[...]


# ---- modules --------------------------------------------------------------------------------------------------
LINEAR_ATTRS = ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision", "dot_general",
                "promote_dtype", "preferred_element_type")


class QuantizedLinear(nnx.Linear):
  """A bias-free `nnx.Linear` whose `kernel [in, out]` is stored quantized (`kernel` values, `kernel_scale`).

  Built from a dense layer (`QuantizedLinear(base, qarray, mode, table)`; `table [G, 256]`: NVFP4's scale table);
  `x [..., in] -> x @ dequantize(kernel) [..., out]` in the layer's compute dtype. `param_dtype` stays the dense
  layer's (what `dequantize_base` and export restore).
  """

  QUANTIZED_ATTRS = ("kernel_scale", "kernel_table", "qtype", "quantization")

  def __init__(self, base: nnx.Linear, qarray: qwix.QArray, mode: str, table: Array | None = None):
    if base.use_bias:
      raise ValueError("QuantizedLinear: a linear layer with a bias is not supported (the model has none)")
    for name in LINEAR_ATTRS:
      setattr(self, name, getattr(base, name))
    if tuple(qarray.shape) != (self.in_features, self.out_features):
      raise ValueError(f"quantized kernel {qarray.shape} does not fit a [{self.in_features}, {self.out_features}] "
                       "layer")
    axes = _axes(base.kernel)
    self.kernel = _variable(stored(qarray.qvalue, qarray.qtype), axes)
    self.kernel_scale = _variable(_stored_scale(qarray.scale), scale_axes(axes, qarray.scale.shape))
    self.kernel_table = _table_variable(table, None)
    self.bias = nnx.data(None)
    self.qtype, self.quantization = qarray.qtype, mode

  def dequantized_kernel(self, dtype: Any = None, tie: Array | None = None) -> Array:
    """The dense kernel [in, out] in `dtype` (default: the compute dtype, else the dense layer's dtype)."""
    dtype = dtype or self.dtype or self.param_dtype
    return dequantize(self.kernel[...], self.kernel_scale[...], self.qtype, dtype, tie, _value(self.kernel_table))

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    kernel = self.dequantized_kernel(tie=input_tie(inputs))
    inputs, kernel, _ = self.promote_dtype((inputs, kernel, None), dtype=self.dtype)
    kwargs = {"out_sharding": out_sharding}
    if self.preferred_element_type is not None:
      kwargs["preferred_element_type"] = self.preferred_element_type
    return self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision,
                            **kwargs)


class QuantizedExperts(moe.Experts):
  """`moe.Experts` whose `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` are stored quantized (per expert
  and output channel, or per block along the input axis H / I), dequantized in `expert_weights`. NVFP4: `tables`
  `{name: [E, G, 256]}` (`qarrays.scale_table`; G = 2 for gate and up quantized apart)."""

  QUANTIZED_ATTRS = ("gate_up_proj_scale", "down_proj_scale", "gate_up_proj_table", "down_proj_table", "qtype",
                     "quantization", "param_dtype")

  def __init__(self, base: moe.Experts, qarrays: Mapping[str, qwix.QArray], mode: str, param_dtype: Any,
               tables: Mapping[str, Array] | None = None):
    self.dtype, self.impl, self.intermediate = base.dtype, base.impl, base.intermediate
    self.matmul_dtype = base.matmul_dtype
    qtypes = set()
    for name in EXPERT_PARAMS:
      var, q = getattr(base, name), qarrays[name]
      if tuple(q.shape) != tuple(var.shape):
        raise ValueError(f"quantized {name} {q.shape} does not fit a {tuple(var.shape)} expert tensor")
      axes = _axes(var)
      setattr(self, name, _variable(stored(q.qvalue, q.qtype), axes))
      setattr(self, f"{name}_scale", _variable(_stored_scale(q.scale), scale_axes(axes, q.scale.shape)))
      setattr(self, f"{name}_table", _table_variable((tables or {}).get(name), axes))
      qtypes.add(q.qtype)
    (self.qtype,) = qtypes
    self.quantization, self.param_dtype = mode, jnp.dtype(param_dtype).name

  def dequantized(self, name: str, dtype: Any = None, tie: Array | None = None) -> Array:
    """The dense expert tensor `name` ('gate_up_proj' / 'down_proj') in `dtype` (default: the compute dtype)."""
    return dequantize(getattr(self, name)[...], getattr(self, f"{name}_scale")[...], self.qtype, dtype or self.dtype,
                      tie, _value(getattr(self, f"{name}_table")), out_axis=-2)

  def weight_shape(self, name: str) -> tuple[int, ...]:
    return logical_shape(getattr(self, name)[...], self.qtype)

  def expert_weights(self, *, tie: Array | None = None) -> tuple[Array, Array]:
    """(gate_up [E, 2I, H], down [E, H, I]) dequantized here, inside the layer (recomputed under remat); `tie`:
    `input_tie` of the layer input."""
    return self.dequantized("gate_up_proj", tie=tie), self.dequantized("down_proj", tie=tie)

  def __call__(self, x: Array, weights: Array, idx: Array) -> Array:
    """`moe.Experts.__call__` with the dequantization tied to the input `x` [T, H] (`input_tie`). Under the
    `tiled` kernel one expert is dequantized at a time, inside its loop (forward and backward): a layer's dense
    expert weights never exist at once. The other kernels dequantize the whole layer first."""
    tie = input_tie(x)
    num_experts = self.gate_up_proj.shape[0]
    if type(self).expert_weights is QuantizedExperts.expert_weights and moe.resolve_moe_impl(
        self.impl, num_experts) == "tiled":
      stored_values = tuple((getattr(self, n)[...], getattr(self, f"{n}_scale")[...],
                             _value(getattr(self, f"{n}_table"))) for n in EXPERT_PARAMS)
      ties = jnp.broadcast_to(tie, (num_experts,))  # [E]: scanned with the experts
      decode = functools.partial(_decode_expert, qtype=self.qtype, dtype=self.dtype)
      kernel = functools.partial(moe_tiled.frozen_tiled_experts, decode=decode, num_experts=num_experts)
      return moe.on_local_tokens(kernel, x, weights, idx, (), ((stored_values, ties),))  # each device its tokens
    gate_up, down = self.expert_weights(tie=tie)
    return moe.experts_forward(self.impl, x, weights, idx, gate_up, down, self.matmul_dtype)


def _decode_expert(stored_expert, *, qtype: Any, dtype: Any) -> tuple[Array, Array]:
  """One expert's ((values, scale, NVFP4 table or None) of gate_up, the same of down), tie) -> its dense (gate_up
  [2I, H], down [H, I]) in `dtype` (`frozen_tiled_experts`' decode)."""
  ((gu, gu_scale, gu_table), (dn, dn_scale, dn_table)), tie = stored_expert
  return (dequantize(gu, gu_scale, qtype, dtype, tie, gu_table, out_axis=-2),
          dequantize(dn, dn_scale, qtype, dtype, tie, dn_table, out_axis=-2))


def quantize_linear(base: nnx.Linear, spec: QuantizationSpec, name: str = "kernel") -> QuantizedLinear:
  """A dense bias-free linear layer -> its `QuantizedLinear` (kernel [in, out]: blocks along axis 0)."""
  qarray, table = quantize_weight(base.kernel[...], spec, in_axis=0, out_axes=(1,), name=name)
  return QuantizedLinear(base, qarray, spec.mode, table)


def quantize_experts(base: moe.Experts, spec: QuantizationSpec, name: str = "experts") -> QuantizedExperts:
  """Dense experts -> `QuantizedExperts` ([E, out, in] tensors: scales per expert and output channel)."""
  done = {p: quantize_weight(getattr(base, p)[...], spec, in_axis=2, out_axes=(0, 1), name=f"{name}.{p}")
          for p in EXPERT_PARAMS}
  tables = {p: t for p, (_, t) in done.items() if t is not None}
  return QuantizedExperts(base, {p: q for p, (q, _) in done.items()}, spec.mode, base.gate_up_proj.dtype,
                          tables or None)


# ---- whole models ---------------------------------------------------------------------------------------------
def _sort_key(path: tuple[Any, ...]) -> tuple[Any, ...]:
  return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)


def module_at(node: Any, path: tuple[Any, ...]) -> Any:
  """The submodule of `node` at `path` (e.g. `('layers', 0, 'mlp', 'up_proj')`)."""
  for p in path:
    node = node[p] if isinstance(p, int) else getattr(node, p)
  return node


def set_module(root: Any, path: tuple[Any, ...], value: Any) -> None:
  """Replaces the submodule of `root` at `path` by `value`."""
  parent = module_at(root, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def is_router(path: tuple[Any, ...]) -> bool:
  return "router" in [str(p) for p in path]


def quantization_targets(model: nnx.Module) -> Iterator[tuple[tuple[Any, ...], nnx.Module]]:
  """(path, module) of every module the base quantization replaces (quantized or not yet), in model order:
  every `nnx.Linear` except the router's projection, and every `moe.Experts`."""
  for path, node in sorted(nnx.iter_graph(model), key=lambda pn: _sort_key(pn[0])):
    if (isinstance(node, nnx.Linear) and not is_router(tuple(path))) or isinstance(node, moe.Experts):
      yield tuple(path), node


def is_quantized(module: Any) -> bool:
  return isinstance(module, (QuantizedLinear, QuantizedExperts))


def base_quantization(model: nnx.Module) -> str:
  """'none', or the mode of the model's quantized modules (ValueError if they mix modes)."""
  modes = {m.quantization for _, m in quantization_targets(model) if is_quantized(m)}
  if len(modes) > 1:
    raise ValueError(f"the model mixes base quantization modes {sorted(modes)}")
  return modes.pop() if modes else NONE


def quantize_base(model: nnx.Module, spec: QuantizationSpec) -> nnx.Module:
  """`model` (changed in place and returned) with every quantization target quantized by `spec`.

  Targets already quantized in `spec.mode` are left as they are; one-line ConfigError for a model quantized in
  another mode, or a layer the mode cannot quantize (an input width not a multiple of the int4 block size).
  Adapter-carrying modules (apply LoRA after quantizing) are refused.
  """
  current = base_quantization(model)
  if current not in (NONE, spec.mode):
    raise ConfigError(f"base_quantization={spec.mode!r}: the model's base is already quantized as {current!r}")
  for path, module in list(quantization_targets(model)):
    if is_quantized(module):
      continue
    if nnx.state(module, nnx.LoRAParam):
      raise ValueError("quantize_base: the model already has LoRA adapters; quantize the base before apply_lora")
    where = ".".join(str(p) for p in path)
    new = quantize_experts(module, spec, where) if isinstance(module, moe.Experts) else quantize_linear(
        module, spec, where)
    set_module(model, path, new)
  return model


def _plain_linear(src: QuantizedLinear, kernel: Array) -> nnx.Linear:
  lin = nnx.eval_shape(lambda: nnx.Linear(
      src.in_features, src.out_features, use_bias=False, dtype=src.dtype, param_dtype=src.param_dtype,
      precision=src.precision, dot_general=src.dot_general, promote_dtype=src.promote_dtype,
      preferred_element_type=src.preferred_element_type, rngs=nnx.Rngs(0)))
  axes = _axes(src.kernel)
  with nnx.use_eager_sharding(False):
    lin.kernel = nnx.Param(kernel.astype(src.param_dtype), **({"out_sharding": axes} if axes else {}))
  return lin


def _plain_experts(src: QuantizedExperts, values: Mapping[str, Array]) -> moe.Experts:
  e, two_i, h = values["gate_up_proj"].shape
  with nnx.use_eager_sharding(False):
    new = nnx.eval_shape(lambda: moe.Experts(h, two_i // 2, e, rngs=nnx.Rngs(0), dtype=src.dtype,
                                                param_dtype=src.param_dtype, std=0.02, impl=src.impl,
                                                matmul_dtype=src.matmul_dtype))
    for name in EXPERT_PARAMS:
      axes = _axes(getattr(src, name))
      setattr(new, name, nnx.Param(values[name].astype(src.param_dtype), **({"out_sharding": axes} if axes else {})))
  return new


def plain_module(src: QuantizedLinear | QuantizedExperts, deltas: Mapping[str | None, Array] | None = None
                 ) -> nnx.Linear | moe.Experts:
  """The dense module of a quantized one: weights dequantized in float32, `deltas` added (float32, the kernel's /
  expert tensor's layout; key None for a linear kernel), cast to the dense parameter dtype."""
  deltas = deltas or {}
  if isinstance(src, QuantizedLinear):
    kernel = src.dequantized_kernel(jnp.float32)
    return _plain_linear(src, kernel + deltas[None] if None in deltas else kernel)
  values = {}
  for name in EXPERT_PARAMS:
    value = src.dequantized(name, jnp.float32)
    values[name] = value + deltas[name] if name in deltas else value
  return _plain_experts(src, values)


def dequantize_base(model: nnx.Module) -> nnx.Module:
  """`model` (changed in place and returned) with every quantized module replaced by its dense module (the
  quantized values times their scales in float32, cast to the dense parameter dtype). Adapters are untouched
  only if none sits on a quantized module: merge those with `lora.merge`."""
  for path, module in list(quantization_targets(model)):
    if is_quantized(module):
      if type(module) not in (QuantizedLinear, QuantizedExperts):
        raise ValueError("dequantize_base: a quantized module carries adapters; use lora.merge")
      set_module(model, path, plain_module(module))
  return model


def quantized_nbytes(model: nnx.Module) -> int:
  """Bytes of the quantized base (values + scales), unpacked 4-bit values counted at half a byte."""
  total = 0
  for _, var in nnx.to_flat_state(nnx.state(model, QuantizedBase)):
    four_bit = is_4bit(var.dtype) or jnp.dtype(var.dtype) == jnp.dtype(jnp.uint4)
    total += int(np.prod(var.shape)) * (4 if four_bit else 8 * jnp.dtype(var.dtype).itemsize) // 8
  return total


__all__ = ["EXPERT_PARAMS", "FP8", "INT4", "MODES", "NONE", "NVFP4", "QuantizationSpec", "QuantizedBase",
           "QuantizedExperts", "QuantizedLinear", "base_quantization", "dequantize", "dequantize_base", "input_tie",
           "is_quantized", "logical_shape", "module_at", "plain_module", "quantization_targets", "quantize",
           "quantize_base", "quantize_experts", "quantize_linear", "quantize_weight", "quantized_nbytes", "scale_axes",
           "scale_table", "set_module", "stored", "typed"]
