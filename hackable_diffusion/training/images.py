"""What a fine-tuning run with images needs beyond a text run: the image settings of its data, and the checks that
the model, tokenizer and run can take those images.

The data (data/sft_images.py) reads chat records whose turns before the final assistant turn hold image parts; the
loss (diffusion/loss.py) runs the vision tower on every batch's images. The image processor's settings come from the
checkpoint fine-tuned (`processor_config.json`, else `preprocessor_config.json`), else the released settings with the
model's own patch size and pooling kernel, then `data.image_processor` (runs/images.py `image_processor_config`, which
the evaluation data use too). Which vision weights train is `train.train_vision` (runs/config.py): the
tower and its projection are kept unchanged by default.
"""

from __future__ import annotations

import dataclasses

from hackable_diffusion.data.sft import SFTDataset
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.runs.config import ExperimentConfig
from hackable_diffusion.runs.images import image_data_config, image_processor_config  # re-exported


def check_image_run(cfg: ExperimentConfig, data: SFTDataset, model_config: ModelConfig) -> None:
  """One-line `ConfigError` unless a run whose data has images can train on them: the model has a vision tower whose
  image token is the tokenizer's. (Evaluation samples with the prompts' images: evaluation/images.py.)"""
  images = data.records.images
  if images is None:
    return
  where = f"data.train_path={', '.join(data.config.paths)}"
  if model_config.vision is None:
    raise ConfigError(f"{where} has images but the model has no vision tower (no vision_config in its config); "
                      "fine-tune a checkpoint with one, or use text-only data")
  if model_config.image_token_id != images.image_token_id:
    raise ConfigError(f"{where}: the tokenizer's image token has id {images.image_token_id} but the model's "
                      f"image_token_id is {model_config.image_token_id}")


__all__ = ["check_image_run", "image_data_config", "image_processor_config"]
