"""Folding adapters into the base weights (`merge`) and separating them from it (`split`).

`merge` computes `kernel + scale * lora_a @ lora_b` (and `P[e] + scale * (a[e] @ b[e]).T` for expert tensors) in
float32, casts to the base parameter dtype and returns a plain `DiffusionGemma` (no adapter modules left): the
model to export for serving (vLLM has no LoRA support for DiffusionGemma). Because our encoder and decoder share
one set of weights, each update is added exactly once; PEFT's `merge_and_unload()` on the transformers model,
whose encoder and decoder are separate modules with tied weights, adds it once per mode (see docs/lora.md).
A quantized base (QLoRA, `lora.qlora`) is dequantized in float32 first (values times scales), the update added,
and the sum cast to the dense parameter dtype; quantized modules without adapters are dequantized too, so the
result is always a dense model.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.lora import qlora
from hackable_diffusion.lora.adapters import EXPERT_PARAMS, LoRAExperts, LoRALinear, lora_modules
from hackable_diffusion.model import moe, scan


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
      value = (value.astype(jnp.float32) + src.delta(name)).astype(value.dtype)
    setattr(new, name, var.replace(value))
  return new


def merge(model: nnx.Module) -> nnx.Module:
  """A copy of `model` with every adapter folded into its base weights and the adapter modules removed.

  The result has exactly the variables (paths, dtypes, shapes) of the un-adapted dense model (a quantized base is
  dequantized: `lora.qlora.dequantize_base`). A scanned model (`model.scan`) comes back with its layers unstacked.
  """
  model = nnx.clone(scan.unstack_layers(model))
  for path, module in list(lora_modules(model)):
    plain = _plain_linear(module) if isinstance(module, LoRALinear) else _plain_experts(module)
    qlora.set_module(model, path, plain)
  return qlora.dequantize_base(model)


def split(model: nnx.Module) -> tuple[nnx.State, nnx.State]:
  """(base_state, adapter_state): every non-adapter variable, and the `nnx.LoRAParam`s only.

  `nnx.merge(nnx.graphdef(model), base_state, adapter_state)` rebuilds the model; the adapter state alone is
  what a LoRA checkpoint needs to hold.
  """
  _, adapter, base = nnx.split(model, nnx.LoRAParam, ...)
  return base, adapter


def adapter_num_params(model: nnx.Module) -> int:
  return sum(int(v.size) for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))


__all__ = ["adapter_num_params", "merge", "split"]
