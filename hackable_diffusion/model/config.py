"""Model configuration: `ModelConfig`, presets, and Hugging Face `config.json` conversion.

`ModelConfig` covers every field of transformers' `DiffusionGemmaTextConfig` that changes the text model, plus
the block-diffusion `canvas_length` of `DiffusionGemmaConfig`, its vision tower (`vision`, a `VisionConfig`, with
the image token ids) and our own compute options (dtypes, MoE kernel, task attention structure).
`from_hf_config` / `to_hf_config` convert both ways (reading a `config.json`: `hackable_diffusion.model.hf_config`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.model import hf_config, structure
from hackable_diffusion.model.hf_config import FULL, SLIDING, TINY_VISION_CONFIG
from hackable_diffusion.model.matmul import MATMUL_DTYPES
from hackable_diffusion.model.vision_config import VisionConfig, checked_vision, hf_vision_fields

_LAYER_TYPES = (SLIDING, FULL)
_ROPE_TYPES = ("default", "proportional")
_DTYPES = ("float32", "bfloat16", "float16")
_MOE_IMPLS = ("auto", "tiled", "dense", "ragged", "grouped", "expert_parallel", "all_to_all")
# Rematerialisation of each transformer layer in the backward pass: a `jax.checkpoint_policies` name saying which
# intermediates of a layer are kept ('nothing_saveable': only the layer's input, everything else recomputed), or
# 'none' (no remat: autodiff keeps every residual).
REMAT_POLICIES = ("none", "nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
  """Rotary embedding of one layer type (rotate-half convention).

  `default`: frequencies `theta ** (-2i / d)` over `d = head_dim * partial_rotary_factor`.
  `proportional` (Gemma-4 full layers): the first `int(partial_rotary_factor * head_dim // 2)` frequencies are
  `theta ** (-2i / head_dim)`, the rest are 0 (those dimensions are not rotated); all divided by `factor`.
  """

  rope_type: str = "default"
  theta: float = 10_000.0
  partial_rotary_factor: float = 1.0
  factor: float = 1.0

  def __post_init__(self):
    if self.rope_type not in _ROPE_TYPES:
      raise ConfigError(f"rope_type={self.rope_type!r} is not supported; expected one of {_ROPE_TYPES}")
    if not self.theta > 0:
      raise ConfigError(f"rope theta={self.theta} must be > 0")
    if not 0.0 < self.partial_rotary_factor <= 1.0:
      raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
    if not self.factor > 0:
      raise ConfigError(f"rope factor={self.factor} must be > 0")
    if self.rope_type == "default" and self.partial_rotary_factor != 1.0:
      raise ConfigError("rope_type='default' with partial_rotary_factor != 1 is not supported (use 'proportional')")

  @classmethod
  def from_hf(cls, params: Mapping[str, Any]) -> RopeConfig:
    unknown = set(params) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
    if unknown:
      raise ConfigError(f"rope_parameters has unsupported keys {sorted(unknown)}")
    return cls(
        rope_type=params.get("rope_type", "default"),
        theta=float(params.get("rope_theta", 10_000.0)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        factor=float(params.get("factor", 1.0)),
    )

  def to_hf(self) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
    if self.partial_rotary_factor != 1.0 or self.rope_type == "proportional":
      out["partial_rotary_factor"] = self.partial_rotary_factor
    if self.factor != 1.0:
      out["factor"] = self.factor
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and numerics of a DiffusionGemma text model (HF `DiffusionGemmaTextConfig` + `canvas_length`)."""

  vocab_size: int = 262_144
  hidden_size: int = 2304
  intermediate_size: int = 9216
  num_hidden_layers: int = 30
  num_attention_heads: int = 8
  num_key_value_heads: int = 4
  head_dim: int = 256
  global_head_dim: int = 512
  num_global_key_value_heads: int | None = None  # None: same as num_key_value_heads
  layer_types: tuple[str, ...] | None = None  # None: 5 sliding : 1 full, last layer full
  sliding_window: int = 512
  sliding_rope: RopeConfig = RopeConfig(rope_type="default", theta=10_000.0)
  full_rope: RopeConfig = RopeConfig(rope_type="proportional", theta=1_000_000.0, partial_rotary_factor=0.25)
  rms_norm_eps: float = 1e-6
  final_logit_softcapping: float | None = 30.0
  num_experts: int = 128
  top_k_experts: int = 8
  moe_intermediate_size: int = 704
  pad_token_id: int = 0
  eos_token_id: int | tuple[int, ...] = 1
  bos_token_id: int = 2
  canvas_length: int = 256
  max_position_embeddings: int = 131_072
  initializer_range: float = 0.02
  # The Gemma 4 vision tower (HF `vision_config`; None: a text-only model) and the prompt tokens of an image: its
  # soft tokens replace the `image_token_id` tokens, between `boi_token_id` and `eoi_token_id`.
  vision: VisionConfig | None = None
  image_token_id: int | None = None
  boi_token_id: int | None = None
  eoi_token_id: int | None = None
  # HF `text_config.use_bidirectional_attention`: None (causal encoder) or "vision" (each image's tokens also see each
  # other in the encoder pass; `model.vision_attention`).
  use_bidirectional_attention: str | None = None
  # --- ours (not in the HF config) ---
  dtype: str = "float32"  # compute dtype of activations
  param_dtype: str = "float32"  # storage dtype of parameters
  # How `Experts` computes (the same function each way; see `model/moe.py`): "tiled": expert-sorted tiles in a loop
  # (fastest on CPU); "dense": every expert on every token, the unselected weighted 0; "ragged": sorted tokens through
  # `jax.lax.ragged_dot_general` (XLA:TPU runs it natively; XLA:GPU rewrites it densely); "grouped": grouped GEMMs
  # (tokamax's ragged dot when installed, else expert tiles of 64 rows, `model/moe_grouped.py`); "expert_parallel":
  # inside `shard_map` over the `expert` mesh axis, tokens all-gathered; "all_to_all": the same, assignments sent by
  # ragged all-to-all; "auto": tiled on CPU, grouped on GPU/TPU, under a mesh with expert > 1 expert_parallel
  # (expert <= top_k) or all_to_all.
  moe_impl: str = "auto"
  remat: str = "none"  # per-layer rematerialisation policy, one of REMAT_POLICIES
  # "bfloat16": the projections (attention q/k/v/o, MLPs, tiled experts, the untiled head; not the router or the
  # attention scores) take bfloat16 operands with float32 accumulation, forward and backward (model/matmul.py):
  # AMX or AVX512-BF16 on recent x86 CPUs. "auto": the compute dtype's own products.
  matmul_dtype: str = "auto"
  # Run the layers as one scan over their attention pattern (model/scan.py): a run (trainer, CLIs, hd.SFTTrainer)
  # stacks its model after loading and adding adapters; a model built by hand: `scan.stack_layers(model)`.
  scan_layers: bool = False
  # A task's canvas attention structure: 'package.module:function' returning a [heads|1, C, P + C] bool mask, e.g.
  # 'hackable_diffusion.tasks.sudoku.structure:peer_mask' (see model/structure.py); None = plain attention.
  attention_structure: str | None = None

  def __post_init__(self):
    for name in ("sliding_rope", "full_rope"):  # a plain dict (e.g. read back from a run's config.json)
      value = getattr(self, name)
      if isinstance(value, Mapping):
        object.__setattr__(self, name, RopeConfig(**value))
      elif not isinstance(value, RopeConfig):
        raise ConfigError(f"ModelConfig.{name}={value!r}; expected a RopeConfig or a dict of its fields")
    object.__setattr__(self, "vision", checked_vision(self.vision, self.image_token_id,
                                                      self.use_bidirectional_attention))
    positive = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim global_head_dim sliding_window num_experts top_k_experts moe_intermediate_size canvas_length "
        "max_position_embeddings"
    ).split()
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
    if self.layer_types is None:
      types = tuple(SLIDING if (i + 1) % 6 else FULL for i in range(self.num_hidden_layers))
      object.__setattr__(self, "layer_types", types)
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if len(self.layer_types) != self.num_hidden_layers:
      raise ConfigError(
          f"ModelConfig.layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
      )
    for i, t in enumerate(self.layer_types):
      if t not in _LAYER_TYPES:
        raise ConfigError(f"ModelConfig.layer_types[{i}]={t!r}; expected one of {_LAYER_TYPES}")
    if self.layer_types[-1] != FULL:
      raise ConfigError("ModelConfig.layer_types[-1] must be 'full_attention' (as in transformers, which forces it)")
    if self.num_global_key_value_heads is not None and self.num_global_key_value_heads <= 0:
      raise ConfigError(f"ModelConfig.num_global_key_value_heads={self.num_global_key_value_heads} must be > 0")
    kv_heads = (("num_key_value_heads", self.num_key_value_heads), ("num_global_key_value_heads", self.global_kv_heads))
    for name, kv in kv_heads:
      if self.num_attention_heads % kv:
        raise ConfigError(
            f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of {name}={kv}")
    if self.top_k_experts > self.num_experts:
      raise ConfigError(f"ModelConfig.top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}")
    if self.rms_norm_eps <= 0:
      raise ConfigError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps} must be > 0")
    if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
      raise ConfigError(f"ModelConfig.final_logit_softcapping={self.final_logit_softcapping} must be > 0 or None")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(f"ModelConfig.{name}={getattr(self, name)!r}; expected one of {_DTYPES}")
    if self.moe_impl not in _MOE_IMPLS:
      raise ConfigError(f"ModelConfig.moe_impl={self.moe_impl!r}; expected one of {_MOE_IMPLS}")
    if self.matmul_dtype not in MATMUL_DTYPES:
      raise ConfigError(f"ModelConfig.matmul_dtype={self.matmul_dtype!r}; expected one of {MATMUL_DTYPES}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_POLICIES}")
    if not isinstance(self.scan_layers, bool):
      raise ConfigError(f"ModelConfig.scan_layers={self.scan_layers!r}; expected True or False")
    ids = (self.pad_token_id, self.bos_token_id, *self.eos_token_ids)
    ids += tuple(t for t in (self.image_token_id, self.boi_token_id, self.eoi_token_id) if t is not None)
    for tid in ids:
      if not 0 <= tid < self.vocab_size:
        raise ConfigError(f"special token id {tid} is outside the vocabulary [0, {self.vocab_size})")
    structure.canvas_mask(self)  # imports the structure and checks its mask now, not at the first forward pass

  # ---- derived --------------------------------------------------------------------------------------------------
  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

  @property
  def global_kv_heads(self) -> int:
    return self.num_key_value_heads if self.num_global_key_value_heads is None else self.num_global_key_value_heads

  def layer_head_dim(self, i: int) -> int:
    return self.head_dim if self.layer_types[i] == SLIDING else self.global_head_dim

  def layer_kv_heads(self, i: int) -> int:
    return self.num_key_value_heads if self.layer_types[i] == SLIDING else self.global_kv_heads

  def layer_rope(self, i: int) -> RopeConfig:
    return self.sliding_rope if self.layer_types[i] == SLIDING else self.full_rope

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def num_parameters(self) -> int:
    """Parameter count of the text model (embedding counted once; tied head)."""
    h, n = self.hidden_size, 0
    for i in range(self.num_hidden_layers):
      d, kv = self.layer_head_dim(i), self.layer_kv_heads(i)
      q = self.num_attention_heads * d
      n += h * q * 2 + h * kv * d * (2 if self.layer_types[i] == SLIDING else 1) + 2 * d
      n += 3 * h * self.intermediate_size
      n += h * self.num_experts + h + self.num_experts
      n += self.num_experts * 3 * h * self.moe_intermediate_size
      n += 7 * h + 1
    return n + self.vocab_size * h + h + 3 * h * self.intermediate_size + h

  # ---- Hugging Face conversion ---------------------------------------------------------------------------------
  @classmethod
  def from_hf_config(cls, config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """Builds a config from a HF DiffusionGemma `config.json` dict (top level or its `text_config`). An override of
    `vision` (e.g. `vision=None`: the text model alone) replaces the checkpoint's vision tower unread."""
    kwargs = hf_config.model_fields(config, vision="vision" not in overrides)
    rope = kwargs.pop("rope_parameters")
    if SLIDING in rope:
      kwargs["sliding_rope"] = RopeConfig.from_hf(rope[SLIDING])
    if FULL in rope:
      kwargs["full_rope"] = RopeConfig.from_hf(rope[FULL])
    kwargs.update(overrides)
    return cls(**kwargs)

  def to_hf_text_config(self) -> dict[str, Any]:
    per_layer = {}
    for i, t in enumerate(self.layer_types):
      if t == FULL:
        entry: dict[str, Any] = {"head_dim": self.global_head_dim}
        if self.num_global_key_value_heads is not None:
          entry["num_key_value_heads"] = self.num_global_key_value_heads
        per_layer[str(i)] = entry
    return {
        "model_type": "diffusion_gemma_text",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "per_layer_config": per_layer,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(self.layer_types),
        "sliding_window": self.sliding_window,
        "rope_parameters": {SLIDING: self.sliding_rope.to_hf(), FULL: self.full_rope.to_hf()},
        "rms_norm_eps": self.rms_norm_eps,
        "final_logit_softcapping": self.final_logit_softcapping,
        "num_experts": self.num_experts,
        "top_k_experts": self.top_k_experts,
        "moe_intermediate_size": self.moe_intermediate_size,
        "pad_token_id": self.pad_token_id,
        "eos_token_id": self.eos_token_id if isinstance(self.eos_token_id, int) else list(self.eos_token_id),
        "bos_token_id": self.bos_token_id,
        "max_position_embeddings": self.max_position_embeddings,
        "initializer_range": self.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_bidirectional_attention": self.use_bidirectional_attention,
    }

  def to_hf_config(self, *, torch_dtype: str | None = None) -> dict[str, Any]:
    """A complete `config.json` for `DiffusionGemmaForBlockDiffusion`: the text config and the model's vision tower,
    or for a text-only model a tiny vision stub (`TINY_VISION_CONFIG`, which loads back as text-only)."""
    # transformers always builds a vision tower; a tiny one keeps `from_pretrained` cheap. Its weights are written
    # by `save_pretrained` so that the checkpoint loads without missing keys.
    ids = (self.boi_token_id, self.eoi_token_id, self.image_token_id)
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "text_config": self.to_hf_text_config(),
        **hf_vision_fields(self.vision, ids, self.vocab_size),
        "canvas_length": self.canvas_length,
        "tie_word_embeddings": True,
        "initializer_range": self.initializer_range,
        "dtype": torch_dtype or self.param_dtype,
    }

  # ---- files ----------------------------------------------------------------------------------------------------
  @classmethod
  def from_json_file(cls, path: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except FileNotFoundError:
      raise ConfigError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
      raise ConfigError(f"{path}: expected a JSON object")
    try:
      return cls.from_hf_config(data, **overrides)
    except (ConfigError, TypeError) as e:
      raise ConfigError(f"{path}: {e}") from None

  @classmethod
  def from_pretrained(cls, id_or_path: str | os.PathLike[str], **overrides: Any) -> ModelConfig:
    """The config of a Hugging Face checkpoint: a directory, its config.json, or a Hub id (`owner/name`, resolved
    by `hackable_diffusion.hub`: the local cache first, `HF_HUB_OFFLINE` honoured)."""
    path = resolve_model_path(os.fspath(id_or_path))
    return cls.from_json_file(os.path.join(path, "config.json") if os.path.isdir(path) else path, **overrides)


# The model config under the name of transformers' class (`hd.DiffusionGemmaConfig.from_pretrained(...)`).
DiffusionGemmaConfig = ModelConfig




def _presets() -> dict[str, ModelConfig]:
  tiny = ModelConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
      layer_types=(SLIDING, FULL), sliding_window=8, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
      canvas_length=8,
  )
  sudoku = ModelConfig(
      vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=32, global_head_dim=32, layer_types=(SLIDING, FULL, SLIDING, FULL),
      sliding_window=256, num_experts=4, top_k_experts=2, moe_intermediate_size=128, canvas_length=81,
      final_logit_softcapping=30.0,
  )
  # Public DiffusionGemma 26B-A4B shape (model cards; a real checkpoint's config.json always wins).
  gemma_26b = ModelConfig(
      vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
      num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024,
      num_experts=128, top_k_experts=8, moe_intermediate_size=704, canvas_length=256, param_dtype="bfloat16",
      dtype="bfloat16", moe_impl="auto",
  )
  return {"tiny": tiny, "sudoku": sudoku, "diffusion_gemma_26b_a4b": gemma_26b}


PRESETS: dict[str, ModelConfig] = _presets()


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


def config_from_any(value: ModelConfig | Mapping[str, Any] | str) -> ModelConfig:
  """A `ModelConfig` from a config, a preset name, a config.json path, or a plain dict of fields."""
  if isinstance(value, ModelConfig):
    return value
  if isinstance(value, str):
    if value in PRESETS:
      return PRESETS[value]
    path = os.path.join(value, "config.json") if os.path.isdir(value) else value
    return ModelConfig.from_json_file(path)
  if "model_type" in value:
    return ModelConfig.from_hf_config(value)
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = set(value) - fields
  if unknown:
    raise ConfigError(f"unknown ModelConfig keys {sorted(unknown)}; valid keys: {sorted(fields)}")
  return ModelConfig(**value)


def dims_str(config: ModelConfig) -> str:
  return (
      f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_experts} experts top-"
      f"{config.top_k_experts}, vocab {config.vocab_size}, ~{config.num_parameters() / 1e6:.1f}M params"
  )


__all__ = [
    "ConfigError", "DiffusionGemmaConfig", "RopeConfig", "ModelConfig", "VisionConfig", "PRESETS", "get_preset",
    "config_from_any",
    "SLIDING", "FULL",
    "TINY_VISION_CONFIG", "dims_str",
]
