"""The images of evaluation prompts, as sampling takes them.

An evaluation example that is a chat record with image parts keeps, in its `SFTRecords.images`, where its images are
(data/sft_images.py: nothing of an image is held in memory); here its files are read and preprocessed when it is
sampled, and handed to `generate` / `StreamRequest` as `pixel_values` and `image_position_ids` (the arrays of
`hd.generate(..., pixel_values=..., image_position_ids=...)`): the example's own images only, without the empty
images that pad a training batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hackable_diffusion.data.sft import SFTRecords


def example_images(records: SFTRecords, i: int) -> tuple[np.ndarray | None, np.ndarray | None]:
  """Record `i`'s own images: (pixel_values [N, patches, 3 p^2] float32, image_position_ids [N, patches, 2] int32),
  read and preprocessed from its files now; (None, None) for a record without images. A one-line `DataError`
  naming file and line when an image cannot be read or no longer fits the prompt's image tokens."""
  images = records.images
  count = 0 if images is None else int(images.num_images[i])
  if not count:
    return None, None
  pixels, positions = images.example(i, records.prompt_ids[i])
  return pixels[:count], positions[:count]


def batch_images(records: SFTRecords, indices: Sequence[int]) -> dict[str, np.ndarray]:
  """The images of records `indices` (repeats allowed) in row order, as one `generate` call takes them
  (`pixel_values`, `image_position_ids`); {} when none has an image."""
  pairs = [example_images(records, int(i)) for i in indices]
  given = [(p, q) for p, q in pairs if p is not None]
  if not given:
    return {}
  return {"pixel_values": np.concatenate([p for p, _ in given]),
          "image_position_ids": np.concatenate([q for _, q in given])}


__all__ = ["batch_images", "example_images"]
