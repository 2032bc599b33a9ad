"""Images as the Gemma 4 vision tower reads them: load, resize, rescale, patchify, 2-D patch positions (numpy + PIL).

The steps and their arithmetic are those of transformers 5.23.0's Gemma 4 image processor (`models/gemma4/
image_processing_pil_gemma4.py`, the PIL backend), which DiffusionGemma checkpoints use through `Gemma4Processor`.
Its torchvision backend (`image_processing_gemma4.py`, which AutoProcessor picks when torchvision is installed;
`backend="pil"` selects this one) resizes with torch's antialiased bicubic kernel, whose uint8 output differs from
PIL's by one or two levels in a small fraction of pixels; every other step is the same. The steps:

  1. load: `PIL.Image.open`, EXIF orientation applied, converted to RGB (as transformers' `load_image`); an
     in-memory PIL image with transparency is composited onto white instead (as its `convert_to_rgb`).
  2. resize, keeping the aspect ratio, to the largest height and width that are multiples of
     `patch_size * pooling_kernel_size` and give at most `max_patches = max_soft_tokens * pooling_kernel_size**2`
     patches (`resized_size`); PIL's bicubic filter on the uint8 image; an image already at that size is kept.
  3. rescale: `float32(float64(pixel) * rescale_factor)`, i.e. [0, 255] -> [0, 1]; Gemma 4 does not normalise
     (`do_normalize` false, mean 0, std 1).
  4. patchify: `patch_size x patch_size` patches in row-major order, each flattened as (row, column, channel).
  5. positions: each patch's `(x, y)` = (patch column, patch row); padding patches (zeros) fill every image up
     to `max_patches`, at position `(-1, -1)`.

An image becomes `num_soft_tokens = patches / pooling_kernel_size**2` soft tokens (the vision tower pools each
`k x k` block of patches into one), 280 at most with the released settings: a 640x480 (width x height) photo is
resized to 912x672 pixels = 57x42 patches = 266 soft tokens; any square image to 768x768 = 256. Small images are
scaled up to the budget too. data/image_prompts.py expands each image placeholder of a prompt into that many
image tokens between the begin- and end-of-image tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Union

import numpy as np
import PIL.Image
import PIL.ImageOps

from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.files import read_json

PROCESSOR_CONFIG_FILENAME = 'processor_config.json'  # {"image_processor": {...}, ...} (transformers 5)
PREPROCESSOR_CONFIG_FILENAME = 'preprocessor_config.json'  # the image processor's keys at the top level
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets Gemma 4's image processor accepts
PADDING_POSITION = -1  # x and y of a padding patch

ImageInput = Union[str, os.PathLike, PIL.Image.Image, np.ndarray]


# ------------------------------------------------------------------------------------------ configuration
@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessorConfig:
  """The image processor's settings; the defaults are the released DiffusionGemma / Gemma 4 checkpoints'
  (`processor_config.json` -> `image_processor`).

  Attributes:
    patch_size: side of a square patch in pixels.
    pooling_kernel_size: the vision tower pools `k x k` patches into one soft token.
    max_soft_tokens: soft tokens per image at most (one of `SUPPORTED_SOFT_TOKENS`).
    resample: PIL resampling filter of the resize (3 = bicubic).
    rescale_factor: multiplies the uint8 pixels (1/255 -> [0, 1]).
    do_resize, do_rescale, do_normalize: which steps run.
    image_mean, image_std: per-channel normalisation, when `do_normalize`.
  """

  patch_size: int = 16
  pooling_kernel_size: int = 3
  max_soft_tokens: int = 280
  resample: int = int(PIL.Image.Resampling.BICUBIC)
  rescale_factor: float = 1 / 255
  do_resize: bool = True
  do_rescale: bool = True
  do_normalize: bool = False
  image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
  image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

  def __post_init__(self):
    for name in ('patch_size', 'pooling_kernel_size'):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ConfigError(f'ImageProcessorConfig.{name} must be a positive int, got {getattr(self, name)!r}')
    if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
      raise ConfigError(f'ImageProcessorConfig.max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, '
                        f'got {self.max_soft_tokens!r}')
    if len(self.image_mean) != 3 or len(self.image_std) != 3:
      raise ConfigError(f'ImageProcessorConfig.image_mean / image_std need 3 values (RGB), got '
                        f'{self.image_mean!r} / {self.image_std!r}')

  @property
  def max_patches(self) -> int:
    """Patches per image after padding (the second dimension of `pixel_values`)."""
    return self.max_soft_tokens * self.pooling_kernel_size ** 2

  @property
  def patch_dim(self) -> int:
    """Values per patch: `patch_size**2 * 3` (the last dimension of `pixel_values`)."""
    return self.patch_size ** 2 * 3

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = 'image processor config') -> 'ImageProcessorConfig':
    """The settings of an image processor's JSON (keys it does not use, e.g. `image_processor_type`, ignored)."""
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
      if field.name in d and d[field.name] is not None:
        value = d[field.name]
        kwargs[field.name] = tuple(float(v) for v in value) if field.name in ('image_mean', 'image_std') else value
    try:
      return cls(**kwargs)
    except (ConfigError, TypeError) as e:
      raise ConfigError(f'{where}: {e}') from None


def read_image_processor_config(directory: str | os.PathLike[str]) -> ImageProcessorConfig | None:
  """A checkpoint's image processor settings: `processor_config.json`'s `image_processor`, else
  `preprocessor_config.json`; None when it has neither."""
  path = os.path.join(os.fspath(directory), PROCESSOR_CONFIG_FILENAME)
  if os.path.isfile(path):
    section = read_json(path, error=ConfigError).get('image_processor')
    if isinstance(section, dict):
      return ImageProcessorConfig.from_dict(section, f'{path}: image_processor')
  path = os.path.join(os.fspath(directory), PREPROCESSOR_CONFIG_FILENAME)
  if os.path.isfile(path):
    return ImageProcessorConfig.from_dict(read_json(path, error=ConfigError), path)
  return None


# ------------------------------------------------------------------------------------------ sizes
def resized_size(height: int, width: int, config: ImageProcessorConfig = ImageProcessorConfig()) -> tuple[int, int]:
  """`(height, width)` an image is resized to: the aspect ratio kept, both multiples of `patch_size *
  pooling_kernel_size`, at most `max_patches` patches. A side that rounds to 0 (a very long, thin image) gets one
  multiple and the other side `floor(long / short)` multiples, capped at `max_soft_tokens` multiples."""
  if height < 1 or width < 1:
    raise DataError(f'an image must be at least 1x1 pixels, got {height}x{width}')
  side = config.patch_size * config.pooling_kernel_size
  budget = config.max_patches * config.patch_size ** 2  # pixels
  scale = math.sqrt(budget / (height * width))
  new_h = int(math.floor(scale * height / side)) * side
  new_w = int(math.floor(scale * width / side)) * side
  if new_h == 0 and new_w == 0:
    raise DataError(f'a {height}x{width} image resizes to 0x0 pixels (sides must be multiples of {side})')
  longest = config.max_soft_tokens * side
  if new_h == 0:
    new_h, new_w = side, min(int(math.floor(width / height)) * side, longest)
  elif new_w == 0:
    new_h, new_w = min(int(math.floor(height / width)) * side, longest), side
  if new_h * new_w > budget:
    raise DataError(f'a {height}x{width} image resizes to {new_h}x{new_w} pixels, over the budget of '
                    f'{config.max_patches} patches of {config.patch_size} pixels')
  return new_h, new_w


def num_soft_tokens(height: int, width: int, config: ImageProcessorConfig = ImageProcessorConfig()) -> int:
  """Soft tokens (image tokens in the prompt) of a `height x width` image."""
  h, w = resized_size(height, width, config) if config.do_resize else (height, width)
  return (h // config.patch_size) * (w // config.patch_size) // config.pooling_kernel_size ** 2


# ------------------------------------------------------------------------------------------ loading
def load_image(path: str | os.PathLike[str]) -> PIL.Image.Image:
  """The image at a local path, upright (EXIF orientation applied) and in RGB; a one-line `DataError` naming the
  path when it does not exist or cannot be decoded."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise DataError(f'{path}: image file not found' if not os.path.exists(path) else f'{path}: not a file')
  try:
    with PIL.Image.open(path) as image:
      image.load()
      return PIL.ImageOps.exif_transpose(image).convert('RGB')
  except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
    reason = ' '.join(str(e).split()) or type(e).__name__
    raise DataError(f'{path}: cannot read the image ({reason})') from None


def to_rgb_array(image: ImageInput, where: str = 'image') -> np.ndarray:
  """An image as `[height, width, 3]` uint8 RGB: a path (`load_image`), a PIL image (transparency composited onto
  white, as transformers does), or a uint8 array `[H, W]` / `[H, W, 1]` (grey) / `[H, W, 3]` (RGB)."""
  if isinstance(image, (str, os.PathLike)):
    return np.asarray(load_image(image))
  if isinstance(image, PIL.Image.Image):
    if 'A' in image.getbands() or image.info.get('transparency') is not None:
      white = PIL.Image.new('RGBA', image.size, (255, 255, 255, 255))
      return np.asarray(PIL.Image.alpha_composite(white, image.convert('RGBA')).convert('RGB'))
    return np.asarray(image.convert('RGB'))
  if isinstance(image, np.ndarray):
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[-1] not in (1, 3)):
      raise DataError(f'{where}: an image array must be uint8 [H, W], [H, W, 1] or [H, W, 3], '
                      f'got {image.dtype} {list(image.shape)}')
    grey = image if image.ndim == 2 else image[..., 0] if image.shape[-1] == 1 else None
    return np.repeat(grey[..., None], 3, axis=-1) if grey is not None else image
  raise DataError(f'{where}: expected a path, a PIL image or a uint8 array, got {type(image).__name__}')


# ------------------------------------------------------------------------------------------ pixels -> patches
def resize_and_rescale(rgb: np.ndarray, config: ImageProcessorConfig = ImageProcessorConfig()) -> np.ndarray:
  """`[H, W, 3]` uint8 -> `[3, h, w]` pixels (float32 after rescaling) at `resized_size`, channels first."""
  height, width = rgb.shape[:2]
  if config.do_resize:
    new_h, new_w = resized_size(height, width, config)
    if (new_h, new_w) != (height, width):
      rgb = np.asarray(PIL.Image.fromarray(rgb).resize((new_w, new_h), resample=config.resample))
  pixels = np.moveaxis(rgb, -1, 0)  # [3, h, w]
  if config.do_rescale:
    pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
  if config.do_normalize:
    pixels = pixels.astype(np.float32) if not np.issubdtype(pixels.dtype, np.floating) else pixels
    mean = np.asarray(config.image_mean, pixels.dtype)[:, None, None]
    std = np.asarray(config.image_std, pixels.dtype)[:, None, None]
    pixels = (pixels - mean) / std
  return pixels


def patchify(pixels: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """`[3, h, w]` -> patches `[n, patch_size**2 * 3]` (row-major over the patch grid, each flattened as row, column,
  channel) and their positions `[n, 2]` int64 `(x, y)` = (patch column, patch row)."""
  channels, height, width = pixels.shape
  rows, cols = height // patch_size, width // patch_size
  if rows * patch_size != height or cols * patch_size != width:
    raise DataError(f'an image of {height}x{width} pixels is not a whole number of {patch_size}-pixel patches')
  grid = pixels.reshape(channels, rows, patch_size, cols, patch_size).transpose(1, 3, 2, 4, 0)
  patches = grid.reshape(rows * cols, patch_size * patch_size * channels)
  ys, xs = np.divmod(np.arange(rows * cols, dtype=np.int64), cols)
  return patches, np.stack([xs, ys], axis=-1)


@dataclasses.dataclass(frozen=True)
class ImageBatch:
  """Images ready for the vision tower, as transformers' Gemma 4 processor returns them.

  Attributes:
    pixel_values: [num_images, max_patches, patch_size**2 * 3] float32; padding patches are 0.
    image_position_ids: [num_images, max_patches, 2] int64 `(x, y)` per patch; padding patches are (-1, -1).
    num_soft_tokens: soft tokens per image (the image tokens each image takes in the prompt).
  """

  pixel_values: np.ndarray
  image_position_ids: np.ndarray
  num_soft_tokens: tuple[int, ...]

  def __len__(self) -> int:
    return len(self.num_soft_tokens)


def preprocess_images(images: Sequence[ImageInput],
                      config: ImageProcessorConfig = ImageProcessorConfig()) -> ImageBatch:
  """Paths, PIL images or uint8 arrays -> an `ImageBatch` equal to transformers' Gemma 4 image processor output
  (`pixel_values`, `image_position_ids`, `num_soft_tokens_per_image`) for the same images and settings."""
  if isinstance(images, (str, os.PathLike, PIL.Image.Image, np.ndarray)):
    images = [images]
  values, positions, counts = [], [], []
  for i, image in enumerate(images):
    where = os.fspath(image) if isinstance(image, (str, os.PathLike)) else f'image {i}'
    rgb = to_rgb_array(image, where)
    try:
      patches, xy = patchify(resize_and_rescale(rgb, config), config.patch_size)
    except DataError as e:  # a size the settings cannot handle: name the image
      raise DataError(f'{where}: {e}') from None
    if len(patches) > config.max_patches:
      raise DataError(f'{where}: {len(patches)} patches, more than max_patches={config.max_patches}')
    pad = config.max_patches - len(patches)
    values.append(np.pad(patches, ((0, pad), (0, 0))))
    positions.append(np.pad(xy, ((0, pad), (0, 0)), constant_values=PADDING_POSITION))
    counts.append(len(patches) // config.pooling_kernel_size ** 2)
  if not values:
    dtype = np.float32 if config.do_rescale or config.do_normalize else np.uint8
    return ImageBatch(np.zeros((0, config.max_patches, config.patch_dim), dtype),
                      np.zeros((0, config.max_patches, 2), np.int64), ())
  return ImageBatch(np.stack(values), np.stack(positions), tuple(counts))


__all__ = ['ImageBatch', 'ImageInput', 'ImageProcessorConfig', 'PADDING_POSITION', 'PREPROCESSOR_CONFIG_FILENAME',
           'PROCESSOR_CONFIG_FILENAME', 'SUPPORTED_SOFT_TOKENS', 'load_image', 'num_soft_tokens', 'patchify',
           'preprocess_images', 'read_image_processor_config', 'resize_and_rescale', 'resized_size',
           'to_rgb_array']
