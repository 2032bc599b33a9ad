"""Bidirectional image blocks in the encoder pass (`ModelConfig.use_bidirectional_attention == "vision"`).

transformers 5.23.0 `models/diffusion_gemma/modeling_diffusion_gemma.py` (`create_masks_for_generate`,
`get_block_sequence_ids_for_mask`) gives every maximal run of consecutive image tokens of a prompt (its
`mm_token_type_ids == 1`: Gemma 4's processor marks the image soft tokens only, not begin/end-of-image) a block id,
and `masking_utils.blockwise_overlay` lets a query see every key of its own block in addition to its causal (or
causal sliding-window) keys, on full and sliding layers alike. Padding keys stay hidden.

Here the block of each query is given by the first and last slot of its run (`VisionBlocks`); a token outside any
image is its own block (first = last = its position), which leaves its mask causal. A query `q` of block
`[first, last]` then sees the keys `k <= max(q, last)` that are within its window or `>= first`: the union of its
window `(q - window, q]` and its block, one interval because the block contains `q`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@flax.struct.dataclass
class VisionBlocks:
  """The bidirectional block of each query of an encoder pass: `first`, `last` [B, L] its first and last cache slot
  (the query's own position outside any image). `reach` (static): an upper bound on a block's length, which sets
  how far the banded sliding-window path gathers keys around a query chunk (`attention.band_span`)."""

  first: Array
  last: Array
  reach: int = flax.struct.field(pytree_node=False, default=1)

  def padded(self, length: int) -> VisionBlocks:
    """The blocks of `length >= L` queries, the extra ones (padding of a query chunking, whose outputs are dropped)
    copying the last query's block."""
    pad = lambda a: jnp.pad(a, ((0, 0), (0, length - a.shape[1])), mode="edge")  # noqa: E731
    return self.replace(first=pad(self.first), last=pad(self.last))


def image_blocks(input_ids: Array, mask: Array, image_token_id: int, start: Array, reach: int) -> VisionBlocks:
  """input_ids [B, L], mask [B, L] (False: padding), start [B] (slot of the first token) -> the `VisionBlocks` of
  the pass: each maximal run of non-padding `image_token_id` tokens is one block. `reach`: the longest run allowed
  (one image's soft-token slots: `vision.check_image_tokens` rejects longer runs)."""
  b, l = input_ids.shape
  is_image = (input_ids == image_token_id) & mask  # [B, L]
  pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None, :], (b, l))
  before = jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))  # the token before is an image token
  after = jnp.pad(is_image[:, 1:], ((0, 0), (0, 1)))
  run_start = jax.lax.cummax(jnp.where(is_image & ~before, pos, -1), axis=1)  # [B, L] last run start at or before
  run_end = jax.lax.cummin(jnp.where(is_image & ~after, pos, l), axis=1, reverse=True)  # first run end at or after
  first = jnp.where(is_image, run_start, pos) + start[:, None]
  last = jnp.where(is_image, run_end, pos) + start[:, None]
  return VisionBlocks(first=first, last=last, reach=max(1, int(reach)))


def longest_image_run(input_ids, image_token_id: int) -> int:
  """The longest run of consecutive `image_token_id` tokens in any row of `input_ids [B, L]` (host, numpy)."""
  ids = np.asarray(input_ids) == image_token_id
  best = 0
  for row in ids.reshape(-1, ids.shape[-1]):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
    if edges.size:
      best = max(best, int((edges[1::2] - edges[::2]).max()))
  return best


__all__ = ["VisionBlocks", "image_blocks", "longest_image_run"]
