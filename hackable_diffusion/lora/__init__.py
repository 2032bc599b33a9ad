"""LoRA: wrap a DiffusionGemma with adapters without editing model code; merge them back or split them off.

    model = lora.apply_lora(model, lora.LoraConfig(rank=8, alpha=16), rngs=nnx.Rngs(0))
    graphdef, state = init_train_state(model, tx, trainable=nnx.LoRAParam)   # train only the adapters
    plain = lora.merge(model)                                                # fold into the base weights

Adapter dropout (`LoraConfig.dropout`) needs an explicit key per step: `rest = lora.set_dropout_key(rest, key)`.

The vision tower and its projector get adapters only when asked: `target_modules=DEFAULT_TARGETS + VISION_TARGETS`
(or entries naming `vision_tower` / `embed_vision`).

QLoRA: `lora.LoraConfig(..., base_quantization='fp8' | 'int4' | 'nvfp4')` quantizes the frozen base on the device
(`lora.qlora`; a checkpoint loaded quantized tensor by tensor: `hackable_diffusion.interop.qlora_load`).

PEFT files (adapter_model.safetensors + adapter_config.json) are in `hackable_diffusion.interop.peft`.
"""

from hackable_diffusion.lora import qlora
from hackable_diffusion.lora.adapters import (ALL_LINEAR, DEFAULT_TARGETS, VISION_TARGETS, LoRAClippableLinear,
                                              LoRADropoutKey, LoRAExperts, LoRALinear, LoraConfig, QLoRAExperts,
                                              QLoRALinear, apply_lora, has_lora, lora_modules, resolve_targets,
                                              set_dropout_key, targetable)
from hackable_diffusion.lora.merge import adapter_num_params, merge, split

__all__ = ["ALL_LINEAR", "DEFAULT_TARGETS", "LoRAClippableLinear", "LoRADropoutKey", "LoRAExperts", "LoRALinear",
           "LoraConfig", "QLoRAExperts", "QLoRALinear", "VISION_TARGETS", "qlora",
           "adapter_num_params", "apply_lora", "has_lora", "lora_modules", "merge", "resolve_targets",
           "set_dropout_key", "split", "targetable"]
