"""Writing FP8 and NVFP4 checkpoints in the compressed-tensors format (what `interop.quantized` reads back).

Four modes (`QUANTIZE_MODES`), two weight formats times two expert layouts:

| mode | linear layers | experts | for |
|---|---|---|---|
| `fp8` | FP8 | FP8, one tensor per expert and projection | vLLM |
| `nvfp4` | NVFP4 | NVFP4, one tensor per expert and projection | vLLM |
| `fp8-linear` | FP8 | dense, fused (`experts.gate_up_proj`) | transformers + compressed-tensors, and vLLM |
| `nvfp4-linear` | NVFP4 | dense, fused | transformers + compressed-tensors, and vLLM |

The quantized linear layers are the text model's attention projections (q/k/v/o) and dense MLP (gate/up/down).
Dense in every mode: the embedding (= the tied LM head), the norms and scalars, the router projection and the
self-conditioning MLP (vLLM 0.33.0 builds both without a quantization config: `Gemma4Router.proj` is a
`GateLinear` without `quant_config` in `model_executor/models/gemma4.py`, `DiffusionGemmaSelfConditioning` holds
plain `nn.Linear`s in `model_executor/models/diffusion_gemma.py`, so a `weight_scale` there is an unexpected
tensor), and the vision tower. `ignore` in the config lists them.

Stored layout of a quantized `[out, in]` weight `X` (compressed-tensors 0.20.1's own layout, checked bit for bit
against it in tests/interop/test_fp8_export.py and tests/interop/test_nvfp4_export.py):
- FP8 (per output channel, activations quantized per token at run time): `X.weight` float8_e4m3fn `[out, in]`,
  `X.weight_scale` `[out, 1]` in the checkpoint's dtype, `scale = max|row| / 448`; dense value `weight * scale`.
- NVFP4 (weights only, "NVFP4A16": activations stay in the serving dtype): `X.weight_packed` uint8 `[out, in/2]`
  (two E2M1 codes a byte, the even column in the low nibble), `X.weight_scale` float8_e4m3fn `[out, in/16]`,
  `X.weight_global_scale` float32 `[1]` = `448 * 6 / max|w|`; dense value `fp4 * weight_scale / global_scale`.
  Weights that vLLM fuses into one matrix share one global scale (its NVFP4 kernels take one per fused matrix:
  `process_weights_after_loading` of `schemes/compressed_tensors_w4a4_nvfp4.py` and of
  `compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py`): q/k/v of a layer, the dense MLP's gate/up, and
  each expert's gate/up.
- Experts (`fp8`, `nvfp4`): `model.decoder.layers.L.experts.N.{gate,up,down}_proj.<parts>`, the per-expert names
  vLLM's `RoutedExperts.load_weights` maps (`fused_moe/routed_experts.py`, `build_expert_params_mapping`).
  transformers 5.23 has no loader for quantized DiffusionGemma experts (its experts are fused `nn.Parameter`s,
  not `nn.Linear`, and the model has no checkpoint conversion mapping), hence the `-linear` modes.
- Encoder copies (`-linear` modes): transformers ties `model.encoder.language_model.*` to `model.decoder.*` by
  name patterns that cover `weight` but not `weight_scale` / `weight_packed` / `weight_global_scale`
  (`DiffusionGemmaModel._tied_weights_keys`), so every part of a quantized layer is also written under the
  encoder's name, as compressed-tensors' own save does. vLLM maps both names to the same parameter.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.interop.names import DECODER, ENCODER_TEXT, is_vision
from hackable_diffusion.interop.quantized import E2M1_VALUES, NVFP4_GROUP_SIZE

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP4_MAX = 6.0  # the largest E2M1 value
QUANTIZE_MODES = ("fp8", "nvfp4", "fp8-linear", "nvfp4-linear")
# the compressed-tensors format version whose layout this writes (the one the tests compare it with)
FORMAT_VERSION = "0.20.1"
# decoder-side names of the quantized linear layers (HF names, `[out, in]` weights)
LINEAR_TARGETS = re.compile(r"^model\.decoder\.layers\.(?P<layer>\d+)\."
                            r"(?P<module>self_attn\.(?P<attn>[qkvo])_proj|mlp\.(?P<mlp>gate|up|down)_proj)\.weight$")
FUSED_EXPERTS = re.compile(r"^model\.decoder\.layers\.(?P<layer>\d+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
# what stays dense (compressed-tensors `ignore` patterns; vLLM matches them after its own renaming)
IGNORE = ["lm_head", "re:.*vision.*", "re:.*router.*", "re:.*self_conditioning.*"]
IGNORE_EXPERTS = "re:.*experts.*"


@dataclasses.dataclass(frozen=True)
class Scheme:
  """What one `--quantize` mode writes: `kind` ('fp8' / 'nvfp4'), whether the experts are quantized (per expert),
  and whether the quantized layers are also written under the encoder's names."""

  mode: str
  kind: str
  experts: bool
  encoder_copies: bool


def scheme(mode: str) -> Scheme:
  if mode not in QUANTIZE_MODES:
    raise ConfigError(f"quantize={mode!r}; expected None or one of {QUANTIZE_MODES}")
  kind, _, variant = mode.partition("-")
  return Scheme(mode, kind, experts=variant != "linear", encoder_copies=variant == "linear")


# ---- FP8 ----------------------------------------------------------------------------------------------------------
def quantize_fp8(weight: np.ndarray, scale_dtype: Any) -> tuple[np.ndarray, np.ndarray]:
  """`[..., out, in]` weight -> (float8_e4m3fn `[..., out, in]`, scale `[..., out, 1]` in `scale_dtype`).

  scale = max |row| / 448, rounded to `scale_dtype` first (the stored scale is the one the weights are divided by,
  so the dequantized value is exactly `fp8 * stored scale`); an all-zero row gets scale 1. The quotient is rounded
  to the nearest float8_e4m3fn (ties to even) after clipping to +-448.
  """
  w = np.asarray(weight, np.float32)
  amax = np.max(np.abs(w), axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.dtype(scale_dtype))
  q = np.clip(w / scale.astype(np.float32), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return q, scale


# ---- NVFP4 --------------------------------------------------------------------------------------------------------
def nvfp4_global_scale(amax: float | np.ndarray) -> np.ndarray:
  """float32 `[1]` global scale `448 * 6 / amax`, 1 where that is not finite (an all-zero weight).

  Computed as compressed-tensors' `generate_gparam` does in torch (`2688 / t` is `t.reciprocal() * 2688` there, two
  float32 roundings), so that the stored scales equal the library's bit for bit.
  """
  amax = np.maximum(np.float32(amax), np.finfo(np.float32).tiny)
  with np.errstate(over="ignore"):
    scale = (np.float32(1) / amax) * np.float32(FP8_MAX * FP4_MAX)
  return np.asarray([scale if np.isfinite(scale) else 1.0], np.float32)


def fp4_codes(x: np.ndarray) -> np.ndarray:
  """float32 values (already divided by their scale) -> E2M1 codes uint8 (bit 3: the sign), the nearest value, ties
  to the even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); beyond 6 -> 6."""
  a = np.abs(x)
  # thresholds between consecutive E2M1 magnitudes; `right` picks the side a tie goes to
  mag = np.zeros(a.shape, np.uint8)
  for code, (edge, inclusive) in enumerate(((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                                            (3.5, True), (5.0, False)), start=1):
    mag = np.where(a >= edge if inclusive else a > edge, np.uint8(code), mag)
  # the sign bit of every negative value, also of one that rounds to zero (compressed-tensors packs it as -0)
  return (mag | np.where(np.signbit(x), np.uint8(8), np.uint8(0))).astype(np.uint8)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
  """uint8 codes `[..., 2n]` -> `[..., n]`, two a byte, the even column in the low nibble."""
  return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def quantize_nvfp4(weight: np.ndarray, global_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`[..., out, in]` weight and its float32 `[1]` global scale -> (packed uint8 `[..., out, in/2]`, block scales
  float8_e4m3fn `[..., out, in/16]`), compressed-tensors' NVFP4 recipe: block scale = `global * max|block| / 6`
  rounded to float8 (clipped to +-448; a zero scale becomes 0.125, float8's epsilon), codes = the nearest E2M1 value
  of `w / (block scale / global)`."""
  w = np.asarray(weight, np.float32)
  *lead, out, inp = w.shape
  if inp % NVFP4_GROUP_SIZE:
    raise ConfigError(f"NVFP4 needs an input width divisible by {NVFP4_GROUP_SIZE}; got a weight of shape {w.shape}")
  g = np.float32(np.asarray(global_scale, np.float32).reshape(()))
  blocks = w.reshape(*lead, out, inp // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
  scale = g * (np.max(np.abs(blocks), axis=-1) / np.float32(FP4_MAX))
  scale = np.clip(scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  scale = np.where(scale.astype(np.float32) == 0, np.float32(0.125), scale.astype(np.float32)).astype(
      jnp.float8_e4m3fn)
  step = scale.astype(np.float32) / g
  codes = fp4_codes(blocks / step[..., None]).reshape(*lead, out, inp)
  return pack_fp4(codes), scale


def nvfp4_values(packed: np.ndarray) -> np.ndarray:
  """Packed codes -> their E2M1 values float32 (for tests and error measurements)."""
  codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
  values = E2M1_VALUES[codes & 0x07]
  return np.where(codes & 0x08, -values, values)


# ---- the config ----------------------------------------------------------------------------------------------------
def quantization_config(mode: str) -> dict[str, Any]:
  """`config.json`'s `quantization_config` of an export in `mode` (the fields compressed-tensors 0.20.1 writes)."""
  s = scheme(mode)
  if s.kind == "fp8":
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    fmt = "float-quantized"
    group = {"weights": {**fp8, "strategy": "channel", "dynamic": False},
             "input_activations": {**fp8, "strategy": "token", "dynamic": True}}
  else:
    fmt = "nvfp4-pack-quantized"
    group = {"weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": NVFP4_GROUP_SIZE,
                         "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
             "input_activations": None}
  return {
      "quant_method": "compressed-tensors",
      "format": fmt,
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "output_activations": None, **group}},
      "ignore": IGNORE + ([] if s.experts else [IGNORE_EXPERTS]),
      "kv_cache_scheme": None,
      "sparsity_config": {},
      "transform_config": {},
      "global_compression_ratio": None,
      "version": FORMAT_VERSION,
  }


# ---- which tensors, and how -------------------------------------------------------------------------------------
COMPONENTS = ("embedding", "attention", "dense MLP", "experts", "router", "self-conditioning", "norms and scalars",
              "vision")


def component(name: str) -> str:
  """The part of the model a stored tensor belongs to (for the sizes table)."""
  if is_vision(name):
    return "vision"
  if name.endswith("embed_tokens.weight"):
    return "embedding"
  if ".self_attn." in name and "_proj." in name:
    return "attention"
  if ".mlp." in name:
    return "dense MLP"
  if ".experts." in name:
    return "experts"
  if ".router.proj." in name:
    return "router"
  if "self_conditioning." in name and "_proj." in name:
    return "self-conditioning"
  return "norms and scalars"


def fused_group(name: str) -> str | None:
  """The vLLM fused matrix a decoder linear weight joins (q/k/v -> qkv_proj, gate/up -> gate_up_proj), else None."""
  m = LINEAR_TARGETS.match(name)
  if m is None or m["attn"] == "o" or m["mlp"] == "down":
    return None
  return f"{DECODER}layers.{m['layer']}." + ("self_attn.qkv_proj" if m["attn"] else "mlp.gate_up_proj")


def is_quantized(name: str, s: Scheme) -> bool:
  return bool(LINEAR_TARGETS.match(name)) or (s.experts and bool(FUSED_EXPERTS.match(name)))


def _parts(prefix: str, weight: np.ndarray, s: Scheme, dtype: str,
           global_scale: np.ndarray | None) -> Iterator[tuple[str, np.ndarray]]:
  """The stored parts of one quantized `[out, in]` weight named `prefix + 'weight'`."""
  if s.kind == "fp8":
    q, scale = quantize_fp8(weight, dtype)
    yield prefix + "weight", q
    yield prefix + "weight_scale", scale
  else:
    g = nvfp4_global_scale(np.max(np.abs(weight))) if global_scale is None else global_scale
    packed, scale = quantize_nvfp4(weight, g)
    yield prefix + "weight_packed", packed
    yield prefix + "weight_scale", scale
    yield prefix + "weight_global_scale", g


def quantized_tensors(name: str, value: np.ndarray, s: Scheme, dtype: str,
                      group_amax: dict[str, float]) -> Iterator[tuple[str, np.ndarray]]:
  """The stored tensors of one quantized HF tensor (`is_quantized(name, s)`; `value` in HF layout, any float dtype:
  computed in float32, an expert tensor one expert at a time, so that no float32 copy of it is held whole).

  `group_amax`: max |w| of each vLLM fused matrix (`fused_group`), for NVFP4's shared global scales.
  """
  m = FUSED_EXPERTS.match(name)
  if m is None:
    group = fused_group(name)
    g = nvfp4_global_scale(group_amax[group]) if s.kind == "nvfp4" and group else None
    parts = list(_parts(name[: -len("weight")], np.asarray(value, np.float32), s, dtype, g))
    yield from parts
    if s.encoder_copies:
      for part, array in parts:
        yield ENCODER_TEXT + part[len(DECODER):], array
    return
  prefix = name[: -len(m["proj"])]  # 'model.decoder.layers.L.experts.'
  for e in range(value.shape[0]):
    expert = np.asarray(value[e], np.float32)
    if m["proj"] == "down_proj":
      yield from _parts(f"{prefix}{e}.down_proj.", expert, s, dtype, None)
      continue
    half = value.shape[1] // 2
    g = nvfp4_global_scale(np.max(np.abs(expert))) if s.kind == "nvfp4" else None
    yield from _parts(f"{prefix}{e}.gate_proj.", expert[:half], s, dtype, g)
    yield from _parts(f"{prefix}{e}.up_proj.", expert[half:], s, dtype, g)


def stored_shapes(name: str, shape: tuple[int, ...], s: Scheme | None,
                  dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
  """(stored name, shape, dtype) of what the writer stores for one HF tensor, from its shape alone (no data): the
  rules of `quantized_tensors`, for sizes and layout checks."""
  if s is None or not is_quantized(name, s):
    return [(name, shape, dtype)]

  def parts(prefix: str, out: int, inp: int) -> list[tuple[str, tuple[int, ...], str]]:
    if s.kind == "fp8":
      return [(prefix + "weight", (out, inp), "float8_e4m3fn"), (prefix + "weight_scale", (out, 1), dtype)]
    return [(prefix + "weight_packed", (out, inp // 2), "uint8"),
            (prefix + "weight_scale", (out, inp // NVFP4_GROUP_SIZE), "float8_e4m3fn"),
            (prefix + "weight_global_scale", (1,), "float32")]

  m = FUSED_EXPERTS.match(name)
  if m is None:
    out = parts(name[: -len("weight")], *shape)
    if s.encoder_copies:
      out += [(ENCODER_TEXT + n[len(DECODER):], sh, dt) for n, sh, dt in out]
    return out
  prefix, (num, rows, cols) = name[: -len(m["proj"])], shape
  out = []
  for e in range(num):
    if m["proj"] == "down_proj":
      out += parts(f"{prefix}{e}.down_proj.", rows, cols)
    else:
      out += parts(f"{prefix}{e}.gate_proj.", rows // 2, cols) + parts(f"{prefix}{e}.up_proj.", rows // 2, cols)
  return out


def nbytes(shape: tuple[int, ...], dtype: str) -> int:
  return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize


__all__ = ["COMPONENTS", "FORMAT_VERSION", "FP4_MAX", "FP8_MAX", "FUSED_EXPERTS", "IGNORE", "IGNORE_EXPERTS",
           "LINEAR_TARGETS", "QUANTIZE_MODES", "Scheme", "component", "fp4_codes", "fused_group", "is_quantized",
           "nbytes", "nvfp4_global_scale", "nvfp4_values", "pack_fp4", "quantization_config", "quantize_fp8",
           "quantize_nvfp4", "quantized_tensors", "scheme", "stored_shapes"]
