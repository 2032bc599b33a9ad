"""Reading a Hugging Face DiffusionGemma `config.json`: its text-model keys (and its vision tower's, when it has a
real one) as `ModelConfig` fields.

Pure dict-to-dict translation with the defaults and checks of transformers' `DiffusionGemmaTextConfig`; building the
`ModelConfig` (and the `RopeConfig`s) is `ModelConfig.from_hf_config`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model.vision_config import BIDIRECTIONAL_MODES, TINY_VISION_CONFIG, VisionConfig

SLIDING = "sliding_attention"
FULL = "full_attention"


def is_vision_stub(vision: VisionConfig) -> bool:
  """Whether a vision config is `TINY_VISION_CONFIG`, the placeholder tower a text-only model writes (transformers
  always builds a tower): such a checkpoint loads as a text-only model."""
  return vision == VisionConfig.from_hf(TINY_VISION_CONFIG)


def vision_fields(config: Mapping[str, Any]) -> dict[str, Any]:
  """The vision keyword arguments of `ModelConfig` from a top-level `config.json` dict: `vision` (a `VisionConfig`)
  and the image token ids, or {} for a text-only config (no `vision_config`, or the placeholder stub)."""
  raw = config.get("vision_config") if config.get("model_type") == "diffusion_gemma" else None
  if not isinstance(raw, Mapping):
    return {}
  try:
    vision = VisionConfig.from_hf(raw)
  except ConfigError as e:
    raise ConfigError(f"config.json {e}") from None
  if is_vision_stub(vision):
    return {}
  out: dict[str, Any] = {"vision": vision}
  for key, default in (("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882)):
    value = config.get(key, default)
    out[key] = None if value is None else int(value)
  return out


def model_fields(config: Mapping[str, Any], *, vision: bool = True) -> dict[str, Any]:
  """`ModelConfig` keyword arguments from a `config.json` dict (top level or its `text_config`); the key
  `rope_parameters` holds the raw per-layer-type RoPE dicts (`{SLIDING: {...}, FULL: {...}}`, either may be missing).
  `vision`: also read the vision tower (`vision_fields`; False: the text model alone, its vision config unread).
  A one-line `ConfigError` for a config this model cannot run."""
  model_type = config.get("model_type")
  if model_type == "diffusion_gemma":
    text = config.get("text_config")
    if not isinstance(text, Mapping):
      raise ConfigError("config.json of model_type 'diffusion_gemma' has no 'text_config' object")
    canvas = config.get("canvas_length", 256)
  elif model_type == "diffusion_gemma_text":
    text, canvas = config, config.get("canvas_length", 256)
  else:
    raise ConfigError(
        f"config.json has model_type={model_type!r}; expected 'diffusion_gemma' (or 'diffusion_gemma_text')"
    )
  act = text.get("hidden_activation", "gelu_pytorch_tanh")
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ConfigError(f"text_config.hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
  if text.get("attention_bias", False):
    raise ConfigError("text_config.attention_bias=true is not supported (DiffusionGemma has no biases)")
  bidirectional = text.get("use_bidirectional_attention")
  if bidirectional == "all":
    raise ConfigError("text_config.use_bidirectional_attention='all' is not supported (the encoder is causal)")
  if bidirectional not in BIDIRECTIONAL_MODES:
    raise ConfigError(f"text_config.use_bidirectional_attention={bidirectional!r}; expected null or 'vision'")
  if text.get("num_experts") in (None, 0):
    raise ConfigError("text_config.num_experts is missing: DiffusionGemma layers always have experts")
  n_layers = int(text.get("num_hidden_layers", 30))
  layer_types = text.get("layer_types")
  if layer_types is not None:
    layer_types = list(layer_types)
    if layer_types and layer_types[-1] != FULL:
      layer_types[-1] = FULL  # transformers forces this too (with a warning)
  head_dim = int(text.get("head_dim", 256))
  kv_heads = int(text.get("num_key_value_heads", 4))
  resolved_types = layer_types or [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
  if "per_layer_config" in text:
    # transformers applies `global_head_dim` / `num_global_key_value_heads` only when `per_layer_config` is absent;
    # when present (even empty or null) full layers keep the base shape unless an entry overrides it
    global_head_dim, global_kv = head_dim, None
  else:
    global_head_dim, global_kv = int(text.get("global_head_dim", 512)), text.get("num_global_key_value_heads")
  per_layer = text.get("per_layer_config")
  if per_layer:
    seen: set[tuple[str, Any]] = set()
    for key, override in per_layer.items():
      idx = int(key) if str(key).isdigit() else None
      ltype = resolved_types[idx] if idx is not None and idx < n_layers else key
      extra = set(override) - {"head_dim", "num_key_value_heads"}
      if extra:
        raise ConfigError(f"per_layer_config[{key!r}] has unsupported keys {sorted(extra)}")
      if ltype == FULL:
        global_head_dim = int(override.get("head_dim", head_dim))
        global_kv = override.get("num_key_value_heads")
        seen.add(("hd", global_head_dim))
        seen.add(("kv", global_kv))
      elif override.get("head_dim", head_dim) != head_dim or override.get("num_key_value_heads", kv_heads) != kv_heads:
        raise ConfigError(f"per_layer_config[{key!r}] overrides a sliding layer, which is not supported")
    if len({v for k, v in seen if k == "hd"}) > 1 or len({v for k, v in seen if k == "kv"}) > 1:
      raise ConfigError("per_layer_config gives full-attention layers different shapes; not supported")
  rope = text.get("rope_parameters") or {}
  eos = text.get("eos_token_id", 1)
  kwargs: dict[str, Any] = dict(
      vocab_size=int(text.get("vocab_size", 262_144)),
      hidden_size=int(text.get("hidden_size", 2304)),
      intermediate_size=int(text.get("intermediate_size", 9216)),
      num_hidden_layers=n_layers,
      num_attention_heads=int(text.get("num_attention_heads", 8)),
      num_key_value_heads=kv_heads,
      head_dim=head_dim,
      global_head_dim=global_head_dim,
      num_global_key_value_heads=None if global_kv is None else int(global_kv),
      layer_types=None if layer_types is None else tuple(layer_types),
      sliding_window=int(text.get("sliding_window", 512)),
      rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
      final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
      num_experts=int(text["num_experts"]),
      top_k_experts=int(text.get("top_k_experts") or 1),
      moe_intermediate_size=int(text.get("moe_intermediate_size") or 1),
      pad_token_id=int(text.get("pad_token_id", 0) if text.get("pad_token_id") is not None else 0),
      eos_token_id=eos if isinstance(eos, int) else tuple(int(e) for e in eos),
      bos_token_id=int(text.get("bos_token_id", 2) if text.get("bos_token_id") is not None else 2),
      canvas_length=int(canvas),
      max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
      initializer_range=float(text.get("initializer_range", 0.02)),
      use_bidirectional_attention=bidirectional,
  )
  kwargs["rope_parameters"] = rope
  if vision:
    kwargs.update(vision_fields(config))
  return kwargs


__all__ = ["FULL", "SLIDING", "TINY_VISION_CONFIG", "is_vision_stub", "model_fields", "vision_fields"]
