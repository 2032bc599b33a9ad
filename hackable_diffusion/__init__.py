"""hackable_diffusion: fine-tune, sample, evaluate and export DiffusionGemma-style diffusion LMs in JAX.

The public names are imported lazily so that `import hackable_diffusion` stays cheap (and never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ModelConfig": "hackable_diffusion.model.config",
    "DiffusionGemmaConfig": "hackable_diffusion.model.config",
    "RopeConfig": "hackable_diffusion.model.config",
    "VisionConfig": "hackable_diffusion.model.vision_config",
    "get_preset": "hackable_diffusion.model.config",
    "DiffusionGemma": "hackable_diffusion.model.transformer",
    "KVCache": "hackable_diffusion.model.kv_cache",
    "load_pretrained": "hackable_diffusion.interop.hf",
    "save_pretrained": "hackable_diffusion.interop.hf",
    "SamplingConfig": "hackable_diffusion.sampling.config",
    "generate": "hackable_diffusion.sampling.generate",
    "GenerateOutput": "hackable_diffusion.sampling.generate",
    "generate_stream": "hackable_diffusion.sampling.stream",
    "StreamRequest": "hackable_diffusion.sampling.stream",
    "StreamOutput": "hackable_diffusion.sampling.stream",
    "LoraConfig": "hackable_diffusion.lora.adapters",
    "MeshConfig": "hackable_diffusion.sharding.mesh",
    "LossConfig": "hackable_diffusion.diffusion.loss",
    "SFTConfig": "hackable_diffusion.training.sft_config",
    "SFTTrainer": "hackable_diffusion.training.sft_api",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'hackable_diffusion' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__)
