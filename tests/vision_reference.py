"""The reference of the image tests: a tiny random transformers DiffusionGemma with a real (non-stub) vision tower.

tests/conftest.py puts this directory on `sys.path`. `reference(path)` builds the model (transformers 5.23.0, fp32,
eval mode) and saves it with `save_pretrained` into `path`; its norms, scalars, position table, clipping bounds and
standardization buffers are all moved away from their defaults, so that every vision weight takes part. `images()`
makes `pixel_values` / `image_position_ids` with the layout of transformers' Gemma 4 image processor: each image's
patches row by row, then padding patches (zeros, at (-1, -1)) up to `max_soft_tokens * k^2`.
"""

from __future__ import annotations

import numpy as np

VOCAB, CANVAS = 128, 6
BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
# a held-out tiny tower: grouped-query attention, 2 layers, clipped projections and standardized soft tokens
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, patch_size=2, pooling_kernel_size=2, position_embedding_size=16, use_clipped_linears=True,
              standardize=True)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
            num_experts=4, top_k_experts=2, moe_intermediate_size=16, initializer_range=0.1,
            layer_types=["sliding_attention", "full_attention", "full_attention"])
PATCH_DIM = 3 * VISION["patch_size"] ** 2
KERNEL = VISION["pooling_kernel_size"]


def _perturb(model, seed: int) -> None:
  import torch

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("scale") or "per_expert_scale" in name:
        p.add_(0.3 * torch.randn(p.shape, generator=gen))
      if "position_embedding_table" in name:
        p.copy_(torch.randn(p.shape, generator=gen))
      if "embed_tokens" in name:
        p.mul_(10.0)
    for name, b in model.named_buffers():
      if "layer_scalar" in name:
        b.copy_(0.5 + torch.rand(b.shape, generator=gen))
      elif name.endswith(("input_min", "output_min")):
        b.fill_(-float(1.0 + torch.rand(1, generator=gen)))
      elif name.endswith(("input_max", "output_max")):
        b.fill_(float(1.0 + torch.rand(1, generator=gen)))
      elif name.endswith("std_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=gen))
      elif name.endswith("std_scale"):
        b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))


def reference(path: str, use_bidirectional_attention: str | None = None):
  """The transformers model, saved with `save_pretrained` into the directory `path`. `use_bidirectional_attention`:
  its text config's value ("vision": bidirectional image blocks in the encoder; the weights do not depend on it)."""
  import torch
  from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

  torch.manual_seed(0)
  text = dict(TEXT, use_bidirectional_attention=use_bidirectional_attention)
  config = DiffusionGemmaConfig(text_config=text, vision_config=dict(VISION), boi_token_id=BOI,
                                eoi_token_id=EOI, image_token_id=IMAGE, canvas_length=CANVAS)
  model = DiffusionGemmaForBlockDiffusion(config).eval()
  _perturb(model, 1)
  model.save_pretrained(path)
  return model


def images(rng: np.random.Generator, grids: list[tuple[int, int]], max_soft_tokens: int):
  """(pixel_values [N, P, 3 p^2] float32, image_position_ids [N, P, 2] int64) of random images of `grids` (rows,
  columns) patches, padded to P = max_soft_tokens * k^2 patches."""
  patches = max_soft_tokens * KERNEL * KERNEL
  pixels = np.zeros((len(grids), patches, PATCH_DIM), np.float32)
  positions = -np.ones((len(grids), patches, 2), np.int64)
  for i, (rows, cols) in enumerate(grids):
    n = rows * cols
    pixels[i, :n] = rng.random((n, PATCH_DIM))
    gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    positions[i, :n] = np.stack([gx, gy], -1).reshape(n, 2)
  return pixels, positions


def mm_token_type_ids(ids: np.ndarray) -> np.ndarray:
  """What Gemma 4's processor returns as `mm_token_type_ids` for `ids`: 1 on the image soft tokens, 0 elsewhere
  (begin/end-of-image included; transformers 5.23.0 `processing_utils.ProcessorMixin.create_mm_token_type_ids`)."""
  return (ids == IMAGE).astype(np.int64)


def image_tokens(n: int) -> list[int]:
  """The prompt tokens of one image of `n` soft tokens: begin-of-image, `n` image tokens, end-of-image."""
  return [BOI] + [IMAGE] * n + [EOI]


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  """(ids [B, P] int64 with pad 0, attention mask [B, P] int64) of prompts left-padded to the longest."""
  width = max(len(r) for r in rows)
  ids = np.zeros((len(rows), width), np.int64)
  mask = np.zeros((len(rows), width), np.int64)
  for i, row in enumerate(rows):
    ids[i, width - len(row):] = row
    mask[i, width - len(row):] = 1
  return ids, mask
