"""Quantized checkpoints in the compressed-tensors format (the FP8 and NVFP4 checkpoints published for vLLM).

A compressed-tensors checkpoint is a HF checkpoint whose `config.json` has a `quantization_config` with
`quant_method: compressed-tensors`, and whose quantized linear layers `X` are stored as
- FP8 (`float-quantized`, e.g. the "FP8_DYNAMIC" preset): `X.weight` float8_e4m3fn `[out, in]` and `X.weight_scale`
  `[out, 1]` (per channel) or `[1]` (per tensor); dense value `weight * weight_scale`.
- NVFP4 (`nvfp4-pack-quantized`): `X.weight_packed` uint8 `[out, in / 2]` (two FP4 E2M1 codes a byte, the even
  column in the low nibble), `X.weight_scale` float8_e4m3fn `[out, in / 16]` (one scale per 16 columns) and
  `X.weight_global_scale` `[1]`; dense value `fp4 * (weight_scale / weight_global_scale)`.
Activation quantization (`input_activations`: `input_scale`, `input_global_scale`) is a serving-time choice that
a full-precision forward does not reproduce (as transformers' `CompressedTensorsConfig(dequantize=True)`).

Checking (`check_quantized`: shapes and dtypes, before anything is read), reading (`read_quantized`: the stored data
and scales, for a later QLoRA path that keeps them quantized on device) and `dequantize` (to float32; precision in
its docstring: FP8 exact, NVFP4 rounded to bfloat16 as compressed-tensors and transformers do) are separate steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from hackable_diffusion.errors import CheckpointError

FP8 = "fp8"
NVFP4 = "nvfp4"
QUANT_METHOD = "compressed-tensors"
FP8_FORMATS = ("float-quantized", "naive-quantized")
NVFP4_FORMATS = ("nvfp4-pack-quantized",)
FP8_STRATEGIES = ("tensor", "channel")
NVFP4_GROUP_SIZE = 16
# the tensors a quantized linear layer `X` stores besides (or instead of) `X.weight`
WEIGHT_PARTS = ("weight_scale", "weight_packed", "weight_global_scale", "weight_zero_point", "weight_shape")
# activation-quantization parameters: read by a serving stack, not by a full-precision forward
ACTIVATION_PARTS = ("input_scale", "input_global_scale", "input_zero_point", "output_scale", "output_global_scale",
                    "output_zero_point")
# the E2M1 magnitudes of the 3 low bits of an FP4 code (bit 3 is the sign)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# top-level `quantization_config` keys that describe the checkpoint without changing what its weights mean
_INFORMATIVE_KEYS = ("quant_method", "format", "quantization_status", "config_groups", "ignore", "version",
                     "global_compression_ratio")
# keys that must be empty: anything in them changes the weights (sparsity, transforms, KV-cache scales)
_EMPTY_KEYS = ("sparsity_config", "transform_config", "kv_cache_scheme", "moe_sparsity_config")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
  """The supported part of a compressed-tensors `quantization_config`: which kinds (`FP8`, `NVFP4`) its groups use.

  `fp8_strategies`: the FP8 groups' weight strategies ('tensor' / 'channel'). Which layers are quantized is read from
  the stored tensors (a layer with a `weight_scale` is quantized), checked against these kinds.
  """

  kinds: frozenset[str]
  fp8_strategies: frozenset[str] = frozenset()


def _bad(where: str, field: str, value: Any, expected: str) -> CheckpointError:
  return CheckpointError(f"{where}: quantization_config.{field}={value!r} is not supported ({expected})")


def _group_kind(where: str, name: str, group: Mapping[str, Any], default_format: Any) -> tuple[str, str | None]:
  """(kind, FP8 strategy) of one config group; one-line `CheckpointError` naming the first unsupported field."""
  field = f"config_groups.{name}"
  if not isinstance(group, Mapping):
    raise _bad(where, field, group, "expected an object")
  fmt = group.get("format") or default_format
  weights = group.get("weights")
  if not isinstance(weights, Mapping):
    raise _bad(where, f"{field}.weights", weights, "expected weight quantization; activation-only is not supported")
  if group.get("output_activations") is not None:
    raise _bad(where, f"{field}.output_activations", group["output_activations"], "expected null")
  if weights.get("type") != "float":
    raise _bad(where, f"{field}.weights.type", weights.get("type"), "expected 'float': FP8 or NVFP4")
  if weights.get("symmetric") is not True:
    raise _bad(where, f"{field}.weights.symmetric", weights.get("symmetric"), "expected true")
  if weights.get("dynamic") not in (False, None):
    raise _bad(where, f"{field}.weights.dynamic", weights.get("dynamic"), "expected false")
  for key in ("actorder", "block_structure"):
    if weights.get(key) is not None:
      raise _bad(where, f"{field}.weights.{key}", weights[key], "expected null")
  bits, strategy = weights.get("num_bits"), weights.get("strategy")
  if bits == 8:
    if fmt not in FP8_FORMATS:
      raise _bad(where, f"{field}.format", fmt, f"8-bit float weights expect one of {list(FP8_FORMATS)}")
    if strategy not in FP8_STRATEGIES:
      raise _bad(where, f"{field}.weights.strategy", strategy, f"8-bit float weights expect one of "
                 f"{list(FP8_STRATEGIES)}")
    if weights.get("scale_dtype") is not None and "float8" in str(weights["scale_dtype"]):
      raise _bad(where, f"{field}.weights.scale_dtype", weights["scale_dtype"], "expected a float16/32 scale")
    return FP8, strategy
  if bits == 4:
    if fmt not in NVFP4_FORMATS:
      raise _bad(where, f"{field}.format", fmt, f"4-bit float weights expect one of {list(NVFP4_FORMATS)}")
    if strategy != "tensor_group":
      raise _bad(where, f"{field}.weights.strategy", strategy, "4-bit float (NVFP4) weights expect 'tensor_group'")
    if weights.get("group_size") != NVFP4_GROUP_SIZE:
      raise _bad(where, f"{field}.weights.group_size", weights.get("group_size"),
                 f"NVFP4 expects {NVFP4_GROUP_SIZE}")
    return NVFP4, None
  raise _bad(where, f"{field}.weights.num_bits", bits, "expected 8 (FP8) or 4 (NVFP4)")


def parse_quantization_config(config: Mapping[str, Any], where: str) -> QuantizationConfig | None:
  """The `quantization_config` of a config.json dict (`where` names the file in errors); None when it has none.

  Raises a one-line `CheckpointError` naming the first field it does not support: another `quant_method`, a status
  other than 'compressed', integer / asymmetric / block / grouped-FP8 weights, sparsity, transforms, KV-cache or
  output-activation quantization, or an unknown key with a value (an unknown key set to null or empty is allowed).
  """
  qc = config.get("quantization_config")
  if qc is None:
    text = config.get("text_config")
    qc = text.get("quantization_config") if isinstance(text, Mapping) else None
  if qc is None:
    return None
  if not isinstance(qc, Mapping):
    raise CheckpointError(f"{where}: quantization_config={qc!r} is not an object")
  method = qc.get("quant_method")
  if method != QUANT_METHOD:
    raise _bad(where, "quant_method", method, f"expected {QUANT_METHOD!r}")
  status = qc.get("quantization_status", "compressed")
  if status != "compressed":
    raise _bad(where, "quantization_status", status, "expected 'compressed'")
  for key, value in qc.items():
    if key in _EMPTY_KEYS and value:
      raise _bad(where, key, value, "expected null or empty")
    if key not in _EMPTY_KEYS + _INFORMATIVE_KEYS and value not in (None, {}, []):
      raise _bad(where, key, value, "unknown field; it may change what the stored weights mean")
  groups = qc.get("config_groups")
  if not isinstance(groups, Mapping) or not groups:
    raise _bad(where, "config_groups", groups, "expected at least one group")
  kinds, strategies = set(), set()
  for name, group in groups.items():
    kind, strategy = _group_kind(where, name, group, qc.get("format"))
    kinds.add(kind)
    if strategy is not None:
      strategies.add(strategy)
  return QuantizationConfig(kinds=frozenset(kinds), fp8_strategies=frozenset(strategies))


# ---- readers ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """One quantized linear weight as stored (torch layout `[out, in]`), before dequantization.

  FP8: `data` float8_e4m3fn `[out, in]`, `scale` `[out, 1]` or `[1]`. NVFP4: `data` uint8 `[out, in // 2]`
  (packed codes), `scale` float8_e4m3fn `[out, in // 16]`, `global_scale` `[1]`. float8 arrays may also be given
  as their raw bytes (uint8).
  """

  kind: str
  data: np.ndarray
  scale: np.ndarray
  global_scale: np.ndarray | None
  shape: tuple[int, int]  # the dense `[out, in]`


def quantized_kind(parts: Mapping[str, Any]) -> str | None:
  """`FP8`, `NVFP4` or None (a dense weight) from the names of the parts stored for one layer."""
  if "weight_packed" in parts:
    return NVFP4
  if "weight_scale" in parts:
    return FP8
  return None


class StoredPart(NamedTuple):
  """One stored tensor of a layer, as its safetensors header describes it."""

  name: str
  dtype: str  # safetensors dtype: 'F8_E4M3', 'U8', 'BF16', ...
  shape: tuple[int, ...]


def check_quantized(name: str, where: str, parts: Mapping[str, StoredPart],
                    config: QuantizationConfig | None) -> tuple[int, int] | None:
  """Checks the stored parts of one layer (part, e.g. 'weight_scale' -> `StoredPart`) against `config` and each
  other, before anything is read; returns the dense `[out, in]` shape of a quantized weight, None for a dense one.

  `name` is the layer's weight name (`X.weight`, naming parts that are missing), `where` the file holding it.
  Refuses (one-line `CheckpointError` naming the tensor): a float8 or packed weight without its scales, scales
  without `config`, a kind `config` does not declare, zero points, and scale shapes or dtypes that do not fit.
  """
  kind = quantized_kind(parts)
  weight = parts.get("weight")
  missing = lambda part: repr(name[: -len("weight")] + part)  # noqa: E731
  if kind is None:
    extra = sorted(set(parts) - {"weight"})
    if extra:
      raise CheckpointError(f"{where}: tensor {parts[extra[0]].name!r} has no quantized weight beside it")
    if weight is not None and weight.dtype.startswith("F8"):
      raise CheckpointError(f"{where}: tensor {weight.name!r} is stored as {weight.dtype} without a weight_scale "
                            "(a quantized weight needs its scale; refusing to cast it)")
    return None
  scale = parts["weight_scale"] if "weight_scale" in parts else None
  if config is None:
    raise CheckpointError(f"{where}: tensor {(scale or parts['weight_packed']).name!r} is stored but config.json has "
                          "no quantization_config")
  if kind not in config.kinds:
    raise CheckpointError(f"{where}: tensor {(parts.get('weight_packed') or weight).name!r} is {kind} but "
                          f"quantization_config declares only {sorted(config.kinds)}")
  if "weight_zero_point" in parts:
    raise CheckpointError(f"{where}: tensor {parts['weight_zero_point'].name!r}: asymmetric quantization (zero "
                          "points) is not supported")
  if scale is None:
    raise CheckpointError(f"{where}: tensor {missing('weight_scale')} is missing beside its weight_packed")
  if kind == FP8:
    if weight is None or weight.dtype != "F8_E4M3":
      raise CheckpointError(f"{where}: tensor {missing('weight')} should be F8_E4M3 beside its weight_scale, found "
                            f"{weight.dtype if weight else 'no weight'}")
    out, inp = weight.shape
    per_channel = scale.shape == (out, 1) and "channel" in config.fp8_strategies
    per_tensor = int(np.prod(scale.shape, dtype=np.int64)) == 1 and "tensor" in config.fp8_strategies
    if not (per_channel or per_tensor):
      raise CheckpointError(f"{where}: tensor {scale.name!r} has shape {scale.shape}; expected {(out, 1)} (channel) "
                            f"or (1,) (tensor) as quantization_config declares {sorted(config.fp8_strategies)}")
    if scale.dtype not in ("F32", "BF16", "F16"):
      raise CheckpointError(f"{where}: tensor {scale.name!r} has dtype {scale.dtype}; expected F32, BF16 or F16")
    return out, inp
  packed = parts["weight_packed"]
  if weight is not None:
    raise CheckpointError(f"{where}: tensor {weight.name!r} is stored beside {packed.name!r}; expected one")
  if "weight_global_scale" not in parts:
    raise CheckpointError(f"{where}: tensor {missing('weight_global_scale')} is missing beside its weight_packed")
  if "weight_shape" in parts:
    raise CheckpointError(f"{where}: tensor {parts['weight_shape'].name!r}: a stored unpacked shape is not "
                          "supported with NVFP4 (its width is twice the packed width)")
  if packed.dtype != "U8" or len(packed.shape) != 2:
    raise CheckpointError(f"{where}: tensor {packed.name!r} is {packed.dtype} {packed.shape}; expected a 2-D U8 tensor")
  out, inp = packed.shape[0], 2 * packed.shape[1]
  if scale.dtype != "F8_E4M3" or scale.shape != (out, inp // NVFP4_GROUP_SIZE) or inp % NVFP4_GROUP_SIZE:
    raise CheckpointError(f"{where}: tensor {scale.name!r} is {scale.dtype} {scale.shape}; expected F8_E4M3 "
                          f"{(out, inp // NVFP4_GROUP_SIZE)} (one scale per {NVFP4_GROUP_SIZE} columns)")
  global_scale = parts["weight_global_scale"]
  if int(np.prod(global_scale.shape, dtype=np.int64)) != 1:
    raise CheckpointError(f"{where}: tensor {global_scale.name!r} has shape {global_scale.shape}; expected (1,)")
  return out, inp


def read_quantized(parts: Mapping[str, str], read: Callable[[str], np.ndarray]) -> QuantizedWeight:
  """Reads one quantized weight, given its stored names (part -> name; checked by `check_quantized`) and
  `read(stored name) -> array`."""
  if quantized_kind(parts) == FP8:
    data = read(parts["weight"])
    return QuantizedWeight(FP8, data, read(parts["weight_scale"]), None, tuple(data.shape))
  packed = read(parts["weight_packed"])
  return QuantizedWeight(NVFP4, packed, read(parts["weight_scale"]), read(parts["weight_global_scale"]),
                         (packed.shape[0], 2 * packed.shape[1]))


# ---- dequantization -----------------------------------------------------------------------------------------------
def unpack_codes(packed: np.ndarray) -> np.ndarray:
  """uint8 `[..., n]` of two FP4 E2M1 codes each (even column in the low nibble) -> the codes, uint8 `[..., 2n]`."""
  return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
  """uint8 `[..., n]` of two FP4 E2M1 codes each (even column in the low nibble) -> float32 `[..., 2n]`."""
  codes = unpack_codes(packed)
  values = E2M1_VALUES[codes & 0x07]
  return np.where(codes & 0x08, -values, values)


def dequantize(weight: QuantizedWeight, *, nvfp4_rounding: Any = jnp.bfloat16) -> np.ndarray:
  """The dense float32 `[out, in]` value of a quantized weight.

  FP8: `float32(weight) * scale`, exact (the float32 product of a 4-bit and an at most 24-bit significand); equal bit
  for bit to compressed-tensors' decompression in the scale's dtype once cast to it. NVFP4: `fp4 * (weight_scale /
  weight_global_scale)` in float32, then rounded to `nvfp4_rounding` (default bfloat16: compressed-tensors decompresses
  NVFP4 to bfloat16, so the default equals its decompression, and transformers', bit for bit; None keeps the
  unrounded float32 product, within half a bfloat16 ulp of it).
  """
  scale = np.asarray(weight.scale)
  scale = (scale.view(jnp.float8_e4m3fn) if scale.dtype == np.uint8 else scale).astype(np.float32)  # raw fp8 bytes
  if weight.kind == FP8:
    data = np.asarray(weight.data).view(jnp.float8_e4m3fn).astype(np.float32)
    return data * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))
  if weight.kind == NVFP4:
    out, inp = weight.shape
    block = scale / np.asarray(weight.global_scale, np.float32).reshape(())
    values = unpack_fp4(np.asarray(weight.data, np.uint8)).reshape(out, inp // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    dense = (values * block[..., None]).reshape(out, inp)
    return dense if nvfp4_rounding is None else dense.astype(nvfp4_rounding).astype(np.float32)
  raise ValueError(f"unknown quantized kind {weight.kind!r}")


__all__ = ["ACTIVATION_PARTS", "E2M1_VALUES", "FP8", "NVFP4", "NVFP4_GROUP_SIZE", "QuantizationConfig",
           "QuantizedWeight", "StoredPart", "WEIGHT_PARTS", "check_quantized", "dequantize",
           "parse_quantization_config", "quantized_kind", "read_quantized", "unpack_codes", "unpack_fp4"]
