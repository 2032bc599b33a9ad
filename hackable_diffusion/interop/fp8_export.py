"""Writing an FP8 checkpoint in the compressed-tensors format (what vLLM serves as "FP8 dynamic").

The layout is the one `compressed-tensors` itself writes for its `FP8_DYNAMIC` preset (checked against it in
tests/interop/test_fp8_export.py): every linear layer of the text model - attention q/k/v/o, the dense MLP, the
router projection and the self-conditioning MLP - stores `X.weight` as float8_e4m3fn `[out, in]` and
`X.weight_scale` `[out, 1]` (one scale per output channel, in the checkpoint's dtype), dense value
`weight * weight_scale`; activations are quantized per token at run time by the server (`dynamic`). The embedding
(the tied LM head), the norms, the fused experts (not `nn.Linear` modules: the library leaves them dense too) and
the vision tower stay in the checkpoint's dtype. `config.json` gets the `quantization_config` below.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# HF names of the weights quantized (the text model's nn.Linear layers)
FP8_TARGETS = re.compile(r"^model\.decoder\.(layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|router\.proj)"
                         r"|self_conditioning\.(gate|up|down)_proj)\.weight$")
# the compressed-tensors format version whose layout this writes (the one the tests load it with)
FORMAT_VERSION = "0.20.1"


def is_fp8_target(name: str) -> bool:
  return bool(FP8_TARGETS.match(name))


def quantize_fp8(weight: np.ndarray, scale_dtype: Any) -> tuple[np.ndarray, np.ndarray]:
  """`[out, in]` weight -> (float8_e4m3fn `[out, in]`, scale `[out, 1]` in `scale_dtype`), per output channel.

  scale = max |row| / 448, rounded to `scale_dtype` first (the stored scale is the one the weights are divided by,
  so the dequantized value is exactly `fp8 * stored scale`); an all-zero row gets scale 1. The quotient is rounded
  to the nearest float8_e4m3fn (ties to even) after clipping to +-448.
  """
  w = np.asarray(weight, np.float32)
  amax = np.max(np.abs(w), axis=1, keepdims=True)
  scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.dtype(scale_dtype))
  q = np.clip(w / scale.astype(np.float32), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return q, scale


def fp8_quantization_config() -> dict[str, Any]:
  """`config.json`'s `quantization_config` of an FP8 (per-channel weights, dynamic per-token activations) export."""
  fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
  return {
      "quant_method": "compressed-tensors",
      "format": "float-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {
          "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
          "weights": {**fp8, "strategy": "channel", "dynamic": False},
          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
      # the tied LM head and the vision tower stay dense (the experts are not Linear modules)
      "ignore": ["lm_head", "re:.*vision.*"],
      "kv_cache_scheme": None,
      "sparsity_config": {},
      "transform_config": {},
      "global_compression_ratio": None,
      "version": FORMAT_VERSION,
  }


__all__ = ["FORMAT_VERSION", "FP8_MAX", "FP8_TARGETS", "fp8_quantization_config", "is_fp8_target", "quantize_fp8"]
