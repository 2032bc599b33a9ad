"""Quantized weight arrays for QLoRA's frozen base (`lora.qlora` builds the modules on them).

The format and its (de)quantization are `qwix`'s where it has them (`qwix.QArray`, `qwix.quantize`,
`qwix.dequantize`): a quantized weight is `qvalue` (the weight's shape, 1 byte or half a byte per element) and
`scale` (one per output channel, or per block of input elements and output channel), dense value
`qvalue * scale`. Three modes (`LoraConfig.base_quantization`):

- 'fp8': float8_e4m3fn values, one float32 scale per output channel, `scale = max|row| / 448` (the layout of the
  compressed-tensors FP8 "channel" checkpoints, whose own values and scales are kept as stored).
- 'int4': int4 values in blocks of `block_size` elements along the input axis, one bfloat16 scale per block and
  output channel, `scale = max|block| / 7.5` (qwix's symmetric int4).
- 'nvfp4': FP4 E2M1 values in blocks of 16 input elements, one float8_e4m3fn scale per block and output channel,
  and a float32 `global_scale` per tensor (per expert; per projection for fused gate/up); dense value
  `qvalue * (scale / global_scale)` in float32 - the formula and rounding of compressed-tensors' NVFP4 decompression
  before its bfloat16 cast; an NVFP4 checkpoint's codes and scales are kept as stored. The quotient takes one of
  256 values per tensor (one per float8 code): it is kept as a `[..., G, 256]` table computed on the host with a
  correctly rounded division (`scale_table`; XLA:CPU divides through a reciprocal, off by an ulp in ~40% of cases)
  and looked up by the stored scale bytes. Quantizing a dense weight: `global_scale = 448 * 6 / max|w|`, then
  qwix's 'nvfp4' (block scales rounded to float8) on `w * global_scale`.

Values and float8 scales are stored as raw bytes (`stored` / `typed`): float8 one per uint8, int4 and FP4 two per
uint8 along the last axis (`logical_shape`). Dequantization is tied to the layer input (`input_tie`) so that XLA
neither hoists nor merges it across layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from hackable_diffusion.errors import ConfigError

Array = jax.Array
NONE, FP8, INT4, NVFP4 = "none", "fp8", "int4", "nvfp4"
MODES = (NONE, FP8, INT4, NVFP4)
QTYPES = {FP8: jnp.float8_e4m3fn, INT4: jnp.int4, NVFP4: jnp.float4_e2m1fn}
SCALE_DTYPES = {FP8: jnp.float32, INT4: jnp.bfloat16, NVFP4: jnp.float8_e4m3fn}
NVFP4_BLOCK = 16  # input elements per NVFP4 scale (the format's)
_FP8_MAX, _FP4_MAX = 448.0, 6.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationSpec:
  """How a base weight is quantized. mode: 'fp8', 'int4' or 'nvfp4'; block_size: input elements per int4 scale
  (NVFP4's blocks are 16 elements, `block`)."""

  mode: str
  block_size: int = 64

  def __post_init__(self):
    if self.mode not in QTYPES:
      raise ConfigError(f"base_quantization={self.mode!r} is invalid: expected one of {MODES}")
    if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
      raise ConfigError(f"base_block_size={self.block_size!r} is invalid: expected an integer >= 1")

  @property
  def qtype(self) -> Any:
    return QTYPES[self.mode]

  @property
  def scale_dtype(self) -> Any:
    return SCALE_DTYPES[self.mode]

  @property
  def block(self) -> int | None:
    """Input elements per scale: None for per-channel FP8."""
    return {FP8: None, INT4: self.block_size, NVFP4: NVFP4_BLOCK}[self.mode]


def quantize(w: Array, spec: QuantizationSpec, *, in_axis: int, out_axes: tuple[int, ...],
             name: str = "weight") -> qwix.QArray:
  """A dense weight -> its `qwix.QArray` in 'fp8' (per output channel, `out_axes`) or 'int4' (per block of
  `spec.block_size` elements along `in_axis` and output channel); 'nvfp4' also has global scales:
  `quantize_weight`."""
  if spec.mode == NVFP4:
    raise ValueError("quantize: 'nvfp4' weights carry global scales too; use quantize_weight")
  return quantize_weight(w, spec, in_axis=in_axis, out_axes=out_axes, name=name)[0]


def quantize_weight(w: Array, spec: QuantizationSpec, *, in_axis: int, out_axes: tuple[int, ...],
                    name: str = "weight") -> tuple[qwix.QArray, Array | None]:
  """A dense weight -> (its `qwix.QArray`, the NVFP4 scale table or None), in any mode. The NVFP4 table is
  `scale_table` of one global scale per tensor (`[1, 256]`), or per expert (`[E, 1, 256]`: `out_axes` beyond the
  last are expert axes). One-line ConfigError when the input width is not a multiple of the block size."""
  w = jnp.asarray(w, jnp.float32)
  in_axis, out_axes = in_axis % w.ndim, tuple(a % w.ndim for a in out_axes)
  tiled = {}
  if spec.block is not None:
    width = w.shape[in_axis]
    if width % spec.block:
      what = (f"base_block_size={spec.block}; pick a block size that divides every input width" if spec.mode == INT4
              else f"{spec.block} (NVFP4's block); use 'int4' or 'fp8' for this model")
      raise ConfigError(f"base_quantization={spec.mode!r}: {name} has input width {width}, not a multiple of {what}")
    tiled = {in_axis: spec.block}
  if spec.mode != NVFP4:
    return qwix.quantize(w, spec.qtype, channelwise_axes=out_axes, tiled_axes=tiled,
                         scale_dtype=spec.scale_dtype), None
  lead = tuple(a for a in out_axes if a != out_axes[-1])  # expert axes: one global scale per expert
  amax = jnp.max(jnp.abs(w), axis=tuple(a for a in range(w.ndim) if a not in lead), keepdims=True)
  global_scale = jnp.where(amax > 0, (_FP8_MAX * _FP4_MAX) / jnp.where(amax > 0, amax, 1.0), 1.0)
  q = qwix.quantize(w * global_scale, "nvfp4", channelwise_axes=out_axes, tiled_axes=tiled, scale_dtype=jnp.float32)
  table = scale_table(global_scale.reshape(*(w.shape[a] for a in lead), 1))  # [..., 1, 256]
  return qwix.QArray(q.qvalue, q.scale.astype(jnp.float8_e4m3fn), qtype=jnp.float4_e2m1fn), table


def dequantize(qvalue: Array, scale: Array, qtype: Any, dtype: Any, tie: Array | None = None,
               table: Array | None = None, out_axis: int = -1) -> Array:
  """`qvalue * scale` (scales broadcast over their blocks; qwix's dequantization) in `dtype`; NVFP4 (`table`):
  `qvalue * table[scale]`, the table holding `float8 scale / global scale` for each of the 256 scale bytes
  (`scale_table`; `out_axis`: the scales' output axis, split into the table's G groups).

  The product is formed in float32 (exact for int4 values times bfloat16 scales; one float32 rounding for FP8
  values times float32 scales, as `interop.quantized.dequantize`; NVFP4: a correctly rounded quotient, then the
  product, as compressed-tensors), then rounded once to `dtype`. `qvalue` may be its stored bytes (`stored`).
  `tie`: a float32 zero added to the values and the scales (`input_tie`).
  """
  if table is not None:  # NVFP4: float8 block scales as bytes -> their quotient by the global scale
    scale = _lookup(table, scale, out_axis)
  scale = scale.astype(jnp.float32)
  if tie is not None:
    qvalue, scale = _tied_values(qvalue, tie), scale + tie
  return qwix.dequantize(qwix.QArray(typed(qvalue, qtype), scale, qtype=qtype)).astype(dtype)


def scale_table(global_scale: Any) -> Array:
  """`global_scale [..., G]` -> `[..., G, 256]` float32: every float8_e4m3fn value (by its byte) divided by each
  global scale, correctly rounded (numpy on the host; under tracing, e.g. `nnx.eval_shape`, a traced division of
  the same shape)."""
  codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)  # NaN at 0x7F / 0xFF
  try:
    g = np.asarray(global_scale, np.float32)
  except jax.errors.TracerArrayConversionError:
    return jnp.asarray(codes) / jnp.asarray(global_scale, jnp.float32)[..., None]
  with np.errstate(invalid="ignore"):
    return jnp.asarray(codes / g[..., None])


def _lookup(table: Array, codes: Array, out_axis: int) -> Array:
  """`table [*lead, G, 256]`, scale bytes `codes [*lead, ...]` (uint8) -> float32 `table[..., group, code]`, where
  the group is the position along `out_axis` of `codes` split into G equal parts."""
  if codes.dtype != jnp.uint8:  # float8 scales given as such
    codes = jax.lax.bitcast_convert_type(codes.astype(jnp.float8_e4m3fn), jnp.uint8)
  *lead, groups, _ = table.shape
  out = codes.shape[out_axis]
  shape = [1] * codes.ndim
  shape[out_axis] = out
  group = (jnp.arange(out, dtype=jnp.int32) // (out // groups)).reshape(shape)
  index = group * 256 + codes.astype(jnp.int32)  # [*lead, ...]
  flat = table.reshape(*lead, groups * 256)
  if not lead:
    return jnp.take(flat, index)
  return jnp.take_along_axis(flat, index.reshape(*lead, -1), axis=-1).reshape(codes.shape)


def stored(values: Array, qtype: Any) -> Array:
  """The stored form of quantized values: raw bytes (uint8). float8: one byte per value, same shape; int4 / FP4: two
  values per byte along the last axis (`[..., n] -> [..., n / 2]`, the even element in the low nibble; kept
  unpacked when n is odd)."""
  if values.dtype == jnp.uint8:
    return values
  if jnp.dtype(qtype) == jnp.dtype(jnp.float8_e4m3fn):
    return jax.lax.bitcast_convert_type(values, jnp.uint8)
  if is_4bit(qtype) and values.shape[-1] % 2 == 0:
    return jax.lax.bitcast_convert_type(values.reshape(*values.shape[:-1], values.shape[-1] // 2, 2), jnp.uint8)
  return values


def typed(values: Array, qtype: Any) -> Array:
  """Stored values (`stored`) as `qtype`, in their logical shape; bit for bit."""
  if values.dtype != jnp.uint8 or jnp.dtype(qtype) == jnp.dtype(jnp.uint8):
    return values
  out = jax.lax.bitcast_convert_type(values, qtype)  # 4-bit: [..., n / 2, 2]
  return out.reshape(*values.shape[:-1], -1) if is_4bit(qtype) else out


def logical_shape(values: Array, qtype: Any) -> tuple[int, ...]:
  """The shape of the weight whose stored values (`stored`) are `values`."""
  if values.dtype == jnp.uint8 and is_4bit(qtype):
    return (*values.shape[:-1], 2 * values.shape[-1])
  return tuple(values.shape)


def is_4bit(qtype: Any) -> bool:
  return jnp.dtype(qtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.float4_e2m1fn))


def _tied_values(qvalue: Array, tie: Array) -> Array:
  """Stored values with `tie` (a zero) added: an integer add on their bytes (`stored`), so the very first
  operation on the values depends on the tie. Bit for bit the values. (An add in the values' own dtype does not
  do: XLA:CPU first converts float8 / int4 to a wider type, and that conversion of the values alone is a loop
  invariant it hoists, keeping 2 / 1 bytes per parameter of every layer; a bitcast of a float8 or int4 variable to
  uint8 is hoisted as a copy, hence the uint8 storage.)"""
  if qvalue.dtype == jnp.uint8:
    return qvalue + tie.astype(jnp.uint8)
  return qvalue + tie.astype(qvalue.dtype)  # 4-bit with an odd last axis (stored unpacked)


def input_tie(x: Array) -> Array:
  """A float32 zero that depends on the layer input `x` (`0 * x[0]`, which XLA does not fold for floats).

  Added to the quantized values and the scales, it ties a layer's dequantization to its input, so that XLA can
  neither hoist it out of the loop over micro-batches (a loop invariant) nor merge the backward pass's
  recomputation (remat, whose inputs are tied to the cotangent: `model.remat`) into the forward pass: either keeps
  every layer's dense weights alive at once (without it, the 26B-A4B FP8 step compiled on CPU kept 96 GiB of
  float32 weights; tests/lora/test_qlora.py measures a toy). The value is unchanged for finite inputs.
  """
  return jnp.zeros((), jnp.float32) * x.reshape(-1)[0].astype(jnp.float32)


def scale_axes(axes: tuple[Any, ...] | None, scale_shape: tuple[int, ...]) -> tuple[Any, ...] | None:
  """Logical axes of a scale: the weight's, replicated where the scale has one entry."""
  if axes is None:
    return None
  return tuple(a if n > 1 else None for a, n in zip(axes, scale_shape))


__all__ = ["FP8", "INT4", "MODES", "NONE", "NVFP4", "NVFP4_BLOCK", "QTYPES", "QuantizationSpec", "SCALE_DTYPES",
           "dequantize", "input_tie", "is_4bit", "logical_shape", "quantize", "quantize_weight", "scale_axes",
           "scale_table", "stored", "typed"]
