"""Loading a Hugging Face checkpoint with its base quantized tensor by tensor (QLoRA, `lora.qlora`).

    model = load_pretrained_quantized("path/or/hub-id", "int4")          # or "fp8", "nvfp4"
    model = lora.apply_lora(model, lora.LoraConfig(rank=8, base_quantization="int4"), rngs=nnx.Rngs(0))

The same plan as `hd.load_pretrained` (`interop.load_plan`: every name, shape, dtype and scale checked before any
tensor is read); the difference is what happens to the weights `lora.qlora` quantizes (every linear layer but the
router, and the experts): each is read alone, quantized on the host CPU (`qwix`, `lora.qlora.quantize`) and only its
values and scales are put on the device, so the device never holds a dense copy of the model (peak: the quantized
model plus one dense tensor in host memory). In 'fp8' mode the FP8 weights of a compressed-tensors checkpoint
(float8_e4m3fn + per-channel or per-tensor `weight_scale`; `interop.quantized`) are kept as stored - values and
scales as they are, never rounded through bf16 (the dense value is bit for bit the dequantizing loader's); in
'nvfp4' mode its NVFP4 weights are (FP4 codes, float8 block scales, global scale: the dense value is bit for bit
compressed-tensors' float32 product before its bfloat16 cast). Any other weight is dequantized to float32 and
quantized (an NVFP4 weight read in 'int4' mode is rounded a second time, onto the int4 grid). Every other variable
(embedding, norms, router, buffers, and the whole vision tower, whose projections are not `nnx.Linear`s and stay
dense in `dtype`: bfloat16 for the released checkpoints) is loaded as `hd.load_pretrained` loads it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.interop import load_plan, placement, quantized
from hackable_diffusion.interop.hf import abstract_model
from hackable_diffusion.interop.placement import place_in_shards, place_on_host
from hackable_diffusion.lora import qlora
from hackable_diffusion.model import moe
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.sharding.logical import LOGICAL_AXIS_RULES, Rules, logical_to_mesh_spec, variable_axes

Path = tuple[Any, ...]


def _host():
  """Quantize on the host CPU (a dense tensor never reaches the accelerator); the default device without one."""
  try:
    return jax.default_device(jax.local_devices(backend="cpu")[0])
  except RuntimeError:
    return contextlib.nullcontext()


def _targets(model: nnx.Module) -> dict[Path, tuple[Path, str | None]]:
  """Variable path of every weight `lora.qlora` quantizes -> (module path, expert tensor name or None)."""
  out: dict[Path, tuple[Path, str | None]] = {}
  for path, module in qlora.quantization_targets(model):
    if isinstance(module, moe.Experts):
      for name in qlora.EXPERT_PARAMS:
        out[(*path, name)] = (path, name)
    else:
      out[(*path, "kernel")] = (path, None)
  return out


_KINDS = {qlora.FP8: quantized.FP8, qlora.NVFP4: quantized.NVFP4}  # modes that keep a checkpoint's own weights


def _as_qarray(raw: tuple[np.ndarray, ...], kind: str, kernel: bool,
               groups: int = 1) -> tuple[qwix.QArray, jax.Array | None]:
  """Stored parts (`load_plan.stored_quantized`, output axis first) -> (QArray, NVFP4 scale table or None) in our
  layout: a kernel `[in, out]` (transposed), expert tensors `[E, out, in]` as stored (`groups`: tensors
  concatenated along out, each with its own global scale: 2 for gate and up)."""
  swap = (lambda x: x.T) if kernel else (lambda x: x)  # noqa: E731
  if kind == quantized.FP8:
    values, scales = raw
    return qwix.QArray(swap(values), swap(scales), qtype=jnp.float8_e4m3fn), None
  codes, block, global_scale = raw  # global_scale [(E,) out, 1]: each tensor's repeated over its rows
  values = np.ascontiguousarray(swap(codes)).view(jnp.float4_e2m1fn)  # one code a byte -> its FP4 value
  rows = global_scale.shape[-2]
  table = qlora.scale_table(global_scale[..., ::rows // groups, 0])  # [(E,) G, 256]
  return qwix.QArray(values, np.ascontiguousarray(swap(block)), qtype=jnp.float4_e2m1fn), table


def _stored(key: str, plan: load_plan.LoadPlan, var: nnx.Variable, param: str | None, mode: str,
            finite_in: str | None) -> tuple[qwix.QArray, jax.Array | None] | None:
  """The checkpoint's own quantized values and scales of one weight in our layout (FP8 in 'fp8' mode, NVFP4 in
  'nvfp4' mode), or None when it is stored otherwise. `finite_in`: the file named when a stored part (values,
  scales, global scale; FP4 codes cannot be) holds a NaN or an inf, one reduction each; None: not checked."""
  kind = _KINDS.get(mode)
  if kind is None:
    return None
  grouped = plan.grouped
  if param is None:
    raw = load_plan.stored_quantized(grouped.layers[key], plan.where, kind) if key in grouped.layers else None
  elif key in grouped.experts:
    raw = load_plan.stacked_quantized(key, grouped.experts[key], grouped.layers, plan.where, var.shape[0], kind)
  else:
    return None  # a fused expert tensor: stored dense (compressed-tensors quantizes nn.Linear modules only)
  if raw is None:
    return None
  if finite_in is not None:
    for part in raw:
      placement.check_finite(part, finite_in, key)
  groups = 2 if param == "gate_up_proj" else 1  # gate and up stored apart, each with its own global scale
  return _as_qarray(raw, kind, kernel=param is None, groups=groups)


def _quantize(value: np.ndarray, spec: qlora.QuantizationSpec, param: str | None,
              name: str) -> tuple[qwix.QArray, jax.Array | None]:
  with _host():
    if param is None:  # kernel [in, out]
      return qlora.quantize_weight(value, spec, in_axis=0, out_axes=(1,), name=name)
    return qlora.quantize_weight(value, spec, in_axis=2, out_axes=(0, 1), name=name)  # [E, out, in]


def load_weights_quantized(model: nnx.Module, path: str, spec: qlora.QuantizationSpec, *, mesh: Mesh | None = None,
                           rules: Rules = LOGICAL_AXIS_RULES, check_finite: bool = True) -> nnx.Module:
  """Fills the abstract dense `model` (`nnx.eval_shape`) from the checkpoint at `path` and returns it with its
  quantization targets replaced by `lora.qlora` modules holding the quantized weights. `mesh`: every array goes
  straight into its shards. Errors (and `check_finite`, here also for the values and scales of weights kept as
  stored) as `interop.hf.load_weights`."""
  plan = load_plan.prepare_load(model, path)
  targets = _targets(model)
  place = place_on_host if mesh is None else place_in_shards(mesh, rules)
  qarrays: dict[Path, dict[str | None, tuple[qwix.QArray, Any]]] = {}
  kept = 0
  for file, key, var, source in plan.read(check_finite=check_finite):
    var_path, _ = plan.names[key]
    if var_path not in targets:
      var.set_value(place(source, var))
      continue
    module_path, param = targets[var_path]
    q = _stored(key, plan, var, param, spec.mode, file if check_finite else None)
    if q is None:
      q = _quantize(source.read(), spec, param, key)
    else:
      kept += 1
    qarrays.setdefault(module_path, {})[param] = q
  if kept:
    logging.info("%s: kept %d %s weights with their stored scales (no dequantization)", path, kept,
                 spec.mode.upper())
  for module_path, parts in qarrays.items():
    base = qlora.module_at(model, module_path)
    if isinstance(base, moe.Experts):
      tables = {p: t for p, (_, t) in parts.items() if t is not None}
      new = qlora.QuantizedExperts(base, {p: q for p, (q, _) in parts.items()}, spec.mode, base.gate_up_proj.dtype,
                                   tables or None)
    else:
      new = qlora.QuantizedLinear(base, parts[None][0], spec.mode, parts[None][1])
    qlora.set_module(model, module_path, new)
  _place_quantized(model, mesh, rules)
  return model


def _place_quantized(model: nnx.Module, mesh: Mesh | None, rules: Rules) -> None:
  """Moves the quantized values and scales (built on the host) to the default device, or into their shards."""
  for _, var in nnx.to_flat_state(nnx.state(model, qlora.QuantizedBase)):
    value = var.get_value()
    if mesh is None:
      var.set_value(jax.device_put(value, jax.devices()[0]))
    else:
      spec = logical_to_mesh_spec(variable_axes(var), rules=rules, mesh=mesh, shape=value.shape)
      var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))


def load_pretrained_quantized(path: str, base_quantization: str, dtype: Any = "auto", *, block_size: int = 64,
                              compute_dtype: Any = None, mesh: Mesh | None = None, rules: Rules = LOGICAL_AXIS_RULES,
                              check_finite: bool = True, **config_overrides: Any) -> DiffusionGemma:
  """`hd.load_pretrained` with the base quantized tensor by tensor: `base_quantization` 'fp8', 'int4' or 'nvfp4'
  (`block_size`: input elements per int4 scale). `dtype`: the dense parameters' dtype (the embedding, norms, router;
  what the quantized weights dequantize back to on export), 'auto' = the checkpoint's; `compute_dtype`: the
  forward's (default `dtype`). `check_finite`: a tensor holding a NaN or an inf is refused (one-line
  `CheckpointError` naming it and its file), as by `hd.load_pretrained`. Then
  `lora.apply_lora(model, LoraConfig(..., base_quantization=<same mode>))`.
  """
  spec = qlora.QuantizationSpec(mode=base_quantization, block_size=block_size)
  path = resolve_model_path(path)
  model = abstract_model(path, dtype, compute_dtype, **config_overrides)
  return load_weights_quantized(model, path, spec, mesh=mesh, rules=rules, check_finite=check_finite)


__all__ = ["load_pretrained_quantized", "load_weights_quantized"]
