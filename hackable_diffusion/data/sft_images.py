"""The images of chat SFT records: their image tokens in the prompt at load time, their pixels per batch.

A chat record's user (or system/tool) turns may hold `{"type": "image", "path": ...}` parts; the path is a local file
relative to the JSONL file's folder and must lie inside it (data/image_prompts.py `image_paths`). The final assistant
turn, the one trained on, may not hold images.

At load time (data/sft_records.py) only each image's header is read: its size gives its soft-token count
(data/images.py `num_soft_tokens`), and the chat template's i-th image placeholder in the prompt text becomes
`boi + image_token * count + eoi` (`expand_image_placeholders`), as transformers' processor writes it. Nothing of the
image is kept but the record's image count; the batch pipeline (`RecordImages.batch`, in the grain map) reads the
record's line again by its byte offset, loads and preprocesses its images, and pads every example to `max_images`
images with empty ones (zero pixels, every patch at (-1, -1): no soft tokens). So memory stays flat in the number of
records, and a batch holds

  pixel_values [B, max_images, max_patches, 3 * patch^2] float32, image_position_ids [B, max_images, max_patches, 2]
  int32,

which the loss flattens to `[B * max_images, ...]` for the vision tower (diffusion/loss.py `batch_image_features`):
the valid soft tokens of example b's images fill example b's image tokens, in order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import PIL.Image

from absl import logging

from hackable_diffusion.data.chat import image_parts
from hackable_diffusion.data.image_prompts import expand_image_placeholders, image_paths, image_tokens
from hackable_diffusion.data.images import PADDING_POSITION, ImageProcessorConfig, num_soft_tokens, preprocess_images
from hackable_diffusion.data.sft_data_config import AUTO_MAX_IMAGES, SFTDataConfig
from hackable_diffusion.data.special_tokens import ImageTokens
from hackable_diffusion.data.text_records import RecordIndex, TextRecord
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import DataError

_EXIF_ORIENTATION = 0x0112  # EXIF tag; values 5-8 turn the image a quarter, swapping its height and width


def record_image_paths(record: TextRecord) -> list[str]:
  """The image files of a chat record's turns before the final assistant turn (none for other records); a one-line
  `DataError` naming file and line for an image part in the final assistant turn, a path outside the JSONL file's
  folder, a missing file or a URL."""
  if record.messages is None:
    return []
  where = f'{record.source[0]}:{record.source[1]}'
  if image_parts(record.messages[-1:]):
    raise DataError(f'{where}: the final assistant turn holds an image part; images may only be in the turns '
                    f'before it (the completion trained on is text)')
  return image_paths(record.messages[:-1], os.path.dirname(os.path.abspath(record.source[0])), where)


def image_size(path: str) -> tuple[int, int]:
  """`(height, width)` of an image file as it is upright (EXIF orientation applied), from its header only; a
  one-line `DataError` naming the file when it cannot be read."""
  try:
    with PIL.Image.open(path) as image:
      width, height = image.size
      orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
  except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
    reason = ' '.join(str(e).split()) or type(e).__name__
    raise DataError(f'{path}: cannot read the image ({reason})') from None
  return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def soft_token_counts(paths: Sequence[str], processor: ImageProcessorConfig, where: str) -> list[int]:
  """The soft tokens (image tokens in the prompt) of each image file, from its size."""
  counts = []
  for path in paths:
    try:
      counts.append(num_soft_tokens(*image_size(path), processor))
    except DataError as e:
      raise DataError(f'{where}: {e}') from None
  return counts


def empty_images(count: int, processor: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
  """`count` padding images: pixel_values zeros, every patch at (-1, -1) (no soft tokens)."""
  return (np.zeros((count, processor.max_patches, processor.patch_dim), np.float32),
          np.full((count, processor.max_patches, 2), PADDING_POSITION, np.int32))


@dataclasses.dataclass(frozen=True)
class RecordImages:
  """How each record's images are found and turned into batch arrays (nothing of an image is held).

  index: where each record's JSONL line is (the record is read again for its image paths).
  num_images: [R] int32 images per record.
  max_images: images per example in a batch (>= num_images.max()).
  processor: the image processor's settings (`max_patches` patches per image).
  image_token_id: the id the prompt's image tokens have.
  """

  index: RecordIndex
  num_images: np.ndarray
  max_images: int
  processor: ImageProcessorConfig
  image_token_id: int

  def select(self, indices) -> RecordImages:
    idx = np.asarray(indices, dtype=np.int64)
    return dataclasses.replace(self, index=self.index.select(idx), num_images=self.num_images[idx])

  def example(self, i: int, prompt_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Record `i`'s images padded to `max_images`: (pixel_values [M, P, D] float32, positions [M, P, 2] int32).
    One-line `DataError` naming file and line when an image cannot be read or its soft tokens no longer match the
    prompt's image tokens (`prompt_ids`, the record's row)."""
    record = self.index.record(i)
    where = '{}:{}'.format(*record.source)
    paths = record_image_paths(record)
    try:
      images = preprocess_images(paths, self.processor)
    except DataError as e:
      raise DataError(f'{where}: {e}') from None
    tokens = int(np.sum(prompt_ids == self.image_token_id))
    if tokens != sum(images.num_soft_tokens) or len(images) != int(self.num_images[i]):
      raise DataError(f'{where}: the prompt holds {tokens} image tokens but its {len(images)} image(s) give '
                      f'{sum(images.num_soft_tokens)} soft tokens (did an image or the file change after loading?)')
    pad_pixels, pad_positions = empty_images(self.max_images - len(images), self.processor)
    pixels = np.concatenate([images.pixel_values.astype(np.float32), pad_pixels])
    positions = np.concatenate([images.image_position_ids.astype(np.int32), pad_positions])
    return pixels, positions

  def batch(self, indices, prompt_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows `indices` (with their prompt rows `prompt_ids [B, P]`) -> `pixel_values [B, M, P, D]` float32 and
    `image_position_ids [B, M, P, 2]` int32."""
    pairs = [self.example(int(i), row) for i, row in zip(indices, prompt_ids)]
    return {'pixel_values': np.stack([p for p, _ in pairs]), 'image_position_ids': np.stack([q for _, q in pairs])}


# ---- load time (data/sft_records.py) ----------------------------------------------------------------------------
class LazyImageTokens:
  """The tokenizer's image tokens, resolved at the first record with images (a text tokenizer needs none)."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.tokens: ImageTokens | None = None

  def __call__(self) -> ImageTokens:
    if self.tokens is None:
      self.tokens = image_tokens(self.tokenizer)
    return self.tokens


def expand_record_images(r: TextRecord, prompt: str, processor: ImageProcessorConfig, tokens: LazyImageTokens,
                         where: str) -> tuple[str, int]:
  """(the prompt text with its image placeholders expanded, the number of images) of a record."""
  paths = record_image_paths(r)
  if not paths:
    return prompt, 0
  return expand_image_placeholders(prompt, soft_token_counts(paths, processor, where), tokens(), where), len(paths)


def check_record_image_tokens(pt: list[int], ct: list[int], num_images: int, tokens: LazyImageTokens,
                              source: tuple[str, int]) -> None:
  """A one-line `DataError` when a record with images has image tokens in its completion, or a record without
  images has image tokens in its prompt (tokens written as text: no pixels would fill them)."""
  if tokens.tokens is None:  # no record with images so far: the ids are not looked up
    return
  image_id = tokens.tokens.image_id
  f, n = source
  if image_id in ct:
    raise DataError(f'{f}:{n}: the completion holds {ct.count(image_id)} image token(s) {tokens.tokens.image!r}; '
                    f'images may only be in the prompt, as image parts of the turns before the final one')
  if not num_images and image_id in pt:
    raise DataError(f'{f}:{n}: the prompt holds {pt.count(image_id)} image token(s) {tokens.tokens.image!r} but the '
                    f'record has no image parts; give each image as {{"type": "image", "path": ...}}')


def record_images(config: SFTDataConfig, index: RecordIndex, num_images: np.ndarray,
                  tokens: LazyImageTokens) -> RecordImages | None:
  """The records' `RecordImages` (None when the examples take no images: `max_images` 0, or -1 and no record has
  images); a one-line `DataError` naming the first record with more images than `max_images`."""
  most = int(num_images.max(initial=0))
  max_images = most if config.max_images == AUTO_MAX_IMAGES else config.max_images
  if most > max_images:
    first = int(np.argmax(num_images > max_images))
    f, n = index.source(first)
    raise DataError(f'{f}:{n}: the record has {int(num_images[first])} images, more than max_images={max_images}; '
                    f'raise max_images (-1: the most any record has)')
  if max_images == 0:
    return None
  logging.info('SFT data %s: %d images in all, %d per example (%d records without images)', ', '.join(config.paths),
               int(num_images.sum()), max_images, int(np.sum(num_images == 0)))
  return RecordImages(index=index, num_images=num_images, max_images=max_images,
                      processor=config.image_processor or ImageProcessorConfig(), image_token_id=tokens().image_id)


__all__ = ['LazyImageTokens', 'RecordImages', 'check_record_image_tokens', 'empty_images', 'expand_record_images',
           'image_size', 'record_image_paths', 'record_images', 'soft_token_counts']
