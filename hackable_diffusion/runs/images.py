"""The image settings of a run: the tokens a trained tokenizer reserves for images, and the image processor that
training and evaluation data read pictures with (`image_processor_config`: the checkpoint's settings, else the
released ones at the tower's patch and pooling sizes, then `data.image_processor`)."""

from __future__ import annotations

import dataclasses

from hackable_diffusion.data.images import ImageProcessorConfig, read_image_processor_config
from hackable_diffusion.data.sft import SFTDataConfig
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.runs.checkpoints import is_run_workdir
from hackable_diffusion.runs.config import ExperimentConfig

# The image tokens of a tokenizer trained for a model with a vision tower (Gemma 4's): after the four special ids, so
# boi, eoi and the image token are ids 4, 5 and 6 (`model.overrides` names them: `boi_token_id=4`, ...).
TRAINED_IMAGE_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>"}


def image_processor_config(cfg: ExperimentConfig, model_config: ModelConfig) -> ImageProcessorConfig | None:
  """The run's image processor settings (None for a model without a vision tower): the checkpoint's
  (`processor_config.json`), else the released ones at the tower's patch and pooling sizes, then `data.image_processor`
  replacing fields; a one-line `ConfigError` when they do not fit the tower."""
  vision = model_config.vision
  if vision is None:
    return None
  processor = None
  if cfg.model.checkpoint and not is_run_workdir(cfg.model.checkpoint):
    processor = read_image_processor_config(resolve_model_path(cfg.model.checkpoint))
  where = cfg.model.checkpoint or "data.image_processor"
  if processor is None:
    processor = ImageProcessorConfig(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size)
  if cfg.data.image_processor:
    fields = {f.name for f in dataclasses.fields(ImageProcessorConfig)}
    unknown = sorted(set(cfg.data.image_processor) - fields)
    if unknown:
      raise ConfigError(f"data.image_processor: unknown key(s) {unknown}; expected fields of {sorted(fields)}")
    processor = ImageProcessorConfig.from_dict({**dataclasses.asdict(processor), **cfg.data.image_processor},
                                               "data.image_processor")
    where = "data.image_processor"
  for name in ("patch_size", "pooling_kernel_size"):
    if getattr(processor, name) != getattr(vision, name):
      raise ConfigError(f"{where}: the image processor's {name}={getattr(processor, name)} but the vision tower's is "
                        f"{getattr(vision, name)} (config.json vision_config)")
  return processor


def image_data_config(cfg: ExperimentConfig, data_cfg: SFTDataConfig, model_config: ModelConfig) -> SFTDataConfig:
  """`data_cfg` with the run's `data.max_images` and image processor (`image_processor_config`)."""
  return dataclasses.replace(data_cfg, max_images=cfg.data.max_images,
                             image_processor=image_processor_config(cfg, model_config))


__all__ = ["TRAINED_IMAGE_TOKENS", "image_data_config", "image_processor_config"]
