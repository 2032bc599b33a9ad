"""`VisionConfig`: the shape of the Gemma 4 vision tower (transformers' `Gemma4VisionConfig`, model_type
`gemma4_vision`) that turns image patches into soft tokens of the text model.

`from_hf` / `to_hf` convert the `vision_config` object of a DiffusionGemma `config.json` both ways, with the
defaults of transformers 5.23.0 `models/gemma4/configuration_gemma4.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import ConfigError

# The placeholder tower a text-only model writes into its `config.json` (transformers always builds a tower); such a
# checkpoint loads back as text-only (`hf_config.is_vision_stub`).
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 4,
    "pooling_kernel_size": 2,
    "position_embedding_size": 64,
}
# `ModelConfig.use_bidirectional_attention` (HF `text_config.use_bidirectional_attention`): None, a causal encoder;
# "vision", the image tokens of one image also see each other in the encoder pass (`model.vision_attention`).
BIDIRECTIONAL_MODES = (None, "vision")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """The Gemma 4 vision encoder: patch embedding, `num_hidden_layers` bidirectional layers with 2-D (axial) RoPE,
  average pooling of `pooling_kernel_size`^2 patches into one soft token, and the projection into the text width.

  An image of `h x w` patches of `patch_size` pixels gives `(h / k) * (w / k)` soft tokens (`k` the pooling kernel).
  `use_clipped_linears`: every projection clamps its input and output to saved bounds. `standardize`: the pooled
  soft tokens become `(x - std_bias) * std_scale` (saved buffers). `position_embedding_init_std`: an initialisation
  choice only (not in `config.json`, no effect on loaded weights): 0 starts the position table at all ones (as
  transformers does), > 0 from N(0, std^2), so a tower trained from scratch gives each patch position its own
  embedding from the first step.
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 16
  num_attention_heads: int = 12
  num_key_value_heads: int = 12
  head_dim: int = 64
  rms_norm_eps: float = 1e-6
  rope_theta: float = 100.0
  pooling_kernel_size: int = 3
  patch_size: int = 16
  position_embedding_size: int = 10 * 1024
  use_clipped_linears: bool = False
  standardize: bool = False
  initializer_range: float = 0.02
  max_position_embeddings: int = 131_072
  position_embedding_init_std: float = 0.0

  def __post_init__(self):
    positive = ("hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
                "pooling_kernel_size patch_size position_embedding_size max_position_embeddings").split()
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"VisionConfig.{name}={value!r} must be a positive integer")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"VisionConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 4:
      raise ConfigError(f"VisionConfig.head_dim={self.head_dim} must be a multiple of 4 (2-D rotary embedding)")
    if not self.position_embedding_init_std >= 0:
      raise ConfigError(f"VisionConfig.position_embedding_init_std={self.position_embedding_init_std} must be >= 0")
    if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
      raise ConfigError(f"VisionConfig.rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be > 0")

  @property
  def patch_dim(self) -> int:
    """Values per patch: 3 channels x patch_size^2 pixels."""
    return 3 * self.patch_size * self.patch_size

  def num_parameters(self, text_hidden: int) -> int:
    """Parameters of the tower and its projection into a text width of `text_hidden`."""
    h, d = self.hidden_size, self.head_dim
    per_layer = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 3 * h * self.intermediate_size
    per_layer += 4 * h + 2 * d
    embed = self.patch_dim * h + 2 * self.position_embedding_size * h
    return embed + self.num_hidden_layers * per_layer + h * text_hidden

  @classmethod
  def from_hf(cls, config: Mapping[str, Any]) -> VisionConfig:
    """From the `vision_config` object of a `config.json` (one-line `ConfigError` for one this model cannot run)."""
    model_type = config.get("model_type", "gemma4_vision")
    if model_type != "gemma4_vision":
      raise ConfigError(f"vision_config.model_type={model_type!r}; expected 'gemma4_vision'")
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
      raise ConfigError(f"vision_config.hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
    if config.get("attention_bias"):
      raise ConfigError("vision_config.attention_bias=true is not supported (the Gemma 4 vision tower has no biases)")
    if config.get("output_proj_dims") is not None:
      raise ConfigError("vision_config.output_proj_dims is not supported")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
      raise ConfigError(f"vision_config.rope_parameters.rope_type={rope.get('rope_type')!r}; expected 'axial'")
    return cls(
        hidden_size=int(config.get("hidden_size", 768)),
        intermediate_size=int(config.get("intermediate_size", 3072)),
        num_hidden_layers=int(config.get("num_hidden_layers", 16)),
        num_attention_heads=int(config.get("num_attention_heads", 12)),
        num_key_value_heads=int(config.get("num_key_value_heads", 12)),
        head_dim=int(config.get("head_dim", 64)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        pooling_kernel_size=int(config.get("pooling_kernel_size", 3)),
        patch_size=int(config.get("patch_size", 16)),
        position_embedding_size=int(config.get("position_embedding_size", 10 * 1024)),
        use_clipped_linears=bool(config.get("use_clipped_linears", False)),
        standardize=bool(config.get("standardize", False)),
        initializer_range=float(config.get("initializer_range", 0.02)),
        max_position_embeddings=int(config.get("max_position_embeddings", 131_072)),
    )

  def to_hf(self) -> dict[str, Any]:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        "pooling_kernel_size": self.pooling_kernel_size,
        "patch_size": self.patch_size,
        "position_embedding_size": self.position_embedding_size,
        "use_clipped_linears": self.use_clipped_linears,
        "standardize": self.standardize,
        "initializer_range": self.initializer_range,
    }


def checked_vision(vision: Any, image_token_id: int | None, use_bidirectional_attention: Any) -> VisionConfig | None:
  """`ModelConfig.vision` as a `VisionConfig` (a dict of its fields is accepted), checked together with the image
  token and the encoder's bidirectional mode. One-line `ConfigError`."""
  if isinstance(vision, Mapping):
    vision = VisionConfig(**vision)
  elif vision is not None and not isinstance(vision, VisionConfig):
    raise ConfigError(f"ModelConfig.vision={vision!r}; expected a VisionConfig, a dict of its fields or None")
  if vision is not None and image_token_id is None:
    raise ConfigError("ModelConfig.vision is set but image_token_id is None: the prompt needs an image token")
  if use_bidirectional_attention not in BIDIRECTIONAL_MODES:
    raise ConfigError(f"ModelConfig.use_bidirectional_attention={use_bidirectional_attention!r}; expected one of "
                      f"{BIDIRECTIONAL_MODES} ('all', a bidirectional encoder, is not supported)")
  return vision


def hf_vision_fields(vision: VisionConfig | None, token_ids: tuple[Any, Any, Any], vocab_size: int) -> dict[str, Any]:
  """The vision keys of a top-level `config.json`: `vision_config` and the (boi, eoi, image) token ids; a text-only
  model gets `TINY_VISION_CONFIG` and the last three ids of its vocabulary (0s for a vocabulary of 8 or fewer)."""
  if vision is not None:
    config, ids = vision.to_hf(), token_ids
  else:
    v = max(4, vocab_size)
    config, ids = dict(TINY_VISION_CONFIG), (v - 3, v - 2, v - 1) if vocab_size > 8 else (0, 0, 0)
  return {"vision_config": config, "boi_token_id": ids[0], "eoi_token_id": ids[1], "image_token_id": ids[2]}


__all__ = ["BIDIRECTIONAL_MODES", "TINY_VISION_CONFIG", "VisionConfig", "checked_vision", "hf_vision_fields"]
