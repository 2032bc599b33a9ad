"""What a fine-tuning run with images needs beyond a text run: the image settings of its data, and the checks that
the model, tokenizer and run can take those images.

The data (data/sft_images.py) reads chat records whose turns before the final assistant turn hold image parts; the
loss (diffusion/loss.py) runs the vision tower on every batch's images. The image processor's settings come from the
checkpoint fine-tuned (`processor_config.json`, else `preprocessor_config.json`), else the released settings with the
model's own patch size and pooling kernel. Which vision weights train is `train.train_vision` (runs/config.py): the
tower and its projection are kept unchanged by default.
"""

from __future__ import annotations

import dataclasses

from hackable_diffusion.data.images import ImageProcessorConfig, read_image_processor_config
from hackable_diffusion.data.sft import SFTDataConfig, SFTDataset
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.runs.config import ExperimentConfig
from hackable_diffusion.runs.run import is_run_workdir


def image_processor_config(cfg: ExperimentConfig, model_config: ModelConfig) -> ImageProcessorConfig | None:
  """The run's image processor settings (None for a model without a vision tower); a one-line `ConfigError` when the
  checkpoint's settings do not fit its vision tower."""
  vision = model_config.vision
  if vision is None:
    return None
  processor = None
  if cfg.model.checkpoint and not is_run_workdir(cfg.model.checkpoint):
    processor = read_image_processor_config(resolve_model_path(cfg.model.checkpoint))
  if processor is None:
    return ImageProcessorConfig(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size)
  for name in ("patch_size", "pooling_kernel_size"):
    if getattr(processor, name) != getattr(vision, name):
      raise ConfigError(f"{cfg.model.checkpoint}: the image processor's {name}={getattr(processor, name)} but the "
                        f"vision tower's is {getattr(vision, name)} (config.json vision_config)")
  return processor


def image_data_config(cfg: ExperimentConfig, data_cfg: SFTDataConfig, model_config: ModelConfig) -> SFTDataConfig:
  """`data_cfg` with the run's `data.max_images` and image processor."""
  return dataclasses.replace(data_cfg, max_images=cfg.data.max_images,
                             image_processor=image_processor_config(cfg, model_config))


def check_image_run(cfg: ExperimentConfig, data: SFTDataset, model_config: ModelConfig, *,
                    evaluating: bool = False) -> None:
  """One-line `ConfigError` unless a run whose data has images can train on them: the model has a vision tower whose
  image token is the tokenizer's, and evaluation (which samples from text prompts) is off (`evaluating`: it is
  asked for now)."""
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
  if evaluating or cfg.train.eval_at_end or cfg.train.eval_every:
    raise ConfigError(f"{where} has images, but evaluation during training samples from text prompts only; set "
                      "train.eval_at_end=False and train.eval_every=0 (SFTConfig eval_at_end=False, eval_steps=0)")


__all__ = ["check_image_run", "image_data_config", "image_processor_config"]
