"""The numerical reference of the parity tests and scripts: a random transformers DiffusionGemma from a text config.

    from hf_reference import make_hf_model   # scripts/ on sys.path (tests/conftest.py puts it there)
    ref = make_hf_model(text_config, canvas=8, seed=0)

`perturb`: norms and scales moved away from 1 and layer scalars drawn in [0.5, 1.5], so that every weight takes
part in a comparison; `embed_scale` multiplies the embedding (logits of order 1-10 make a wrong detail show).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the smallest vision tower transformers accepts (the text model never uses it)
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   intermediate_size=64, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)


def hf_config(text_config: Mapping[str, Any], canvas: int):
  """`DiffusionGemmaConfig` of a text config (image token ids at the top of the vocabulary)."""
  from transformers import DiffusionGemmaConfig

  vocab = text_config["vocab_size"]
  return DiffusionGemmaConfig(text_config=dict(text_config), vision_config=dict(TINY_VISION),
                              boi_token_id=vocab - 3, eoi_token_id=vocab - 2, image_token_id=vocab - 1,
                              canvas_length=canvas)


def make_hf_model(text_config: Mapping[str, Any], canvas: int, seed: int = 0, *, perturb: bool = True,
                  embed_scale: float = 1.0):
  """A random `DiffusionGemmaForBlockDiffusion` (eval mode, fp32), seeded."""
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  torch.manual_seed(seed)
  model = DiffusionGemmaForBlockDiffusion(hf_config(text_config, canvas)).eval()
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "vision" in name:
        continue
      if perturb and ("norm" in name or name.endswith("scale") or "per_expert_scale" in name):
        p.add_(0.3 * torch.randn(p.shape, generator=gen))
      if embed_scale != 1.0 and "embed_tokens" in name:
        p.mul_(embed_scale)
    if perturb:
      for name, b in model.named_buffers():
        if "layer_scalar" in name:
          b.copy_(0.5 + torch.rand(b.shape, generator=gen))
  return model
