"""The Gemma 4 vision tower and its projection into the text model (`VisionTower`, `MultimodalEmbedder`).

Inputs, as transformers' Gemma 4 image processor gives them: `pixel_values [N, P, 3 * patch^2]` (each row one
patch, values in [0, 1]) and `image_position_ids [N, P, 2]` (the patch's (x, y) column and row; padding patches at
(-1, -1)). The tower embeds every patch (`2 * (v - 0.5)` through `input_proj`, plus learned x and y position
embeddings), runs the bidirectional encoder layers (`model.vision_layers`), averages each `k x k` block of patches
(`k = pooling_kernel_size`) into one soft token scaled by `sqrt(hidden)`, and the embedder projects
`rmsnorm_noscale(soft)` into the text width. Image `i` gives `num_soft_tokens(positions)[i]` soft tokens, the first
that many of its `P / k^2` output slots (`soft_token_mask`).

Same numbers as transformers 5.23.0 `models/gemma4/modeling_gemma4.py` (`Gemma4VisionModel`,
`Gemma4MultimodalEmbedder`), which returns the valid soft tokens of all images concatenated; here they stay in a
fixed-shape `[N, P / k^2, H]` array with a mask, and `scatter_image_features` places them, in that order, at the
image tokens of the prompt (transformers' `masked_scatter` at `image_token_id`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.model import layers
from hackable_diffusion.model.vision_attention import longest_image_run
from hackable_diffusion.model.vision_config import VisionConfig
from hackable_diffusion.model.vision_layers import ClippableLinear, VisionEncoderLayer, axial_cos_sin

Array = jax.Array


# ---- pooling geometry (numpy and jax share it) --------------------------------------------------------------------
def pooled_slots(positions, kernel: int, length: int, xp=np):
  """positions [N, P, 2] -> the output slot of every patch [N, P]: `x // k + (max_x + 1) // k * (y // k)` over the
  positions with padding clamped to (0, 0) (so padding falls in slot 0, which it does not change: its hidden states
  are zero). `length` = the number of output slots, `P / k^2`."""
  clamped = xp.maximum(positions, 0)
  max_x = clamped[..., 0].max(axis=-1, keepdims=True) + 1
  cells = clamped // kernel
  slots = cells[..., 0] + (max_x // kernel) * cells[..., 1]
  return xp.minimum(slots, length - 1)


def soft_token_mask(positions, config: VisionConfig, xp=np):
  """positions [N, P, 2] -> [N, P / k^2] bool: the output slots holding a soft token (some real patch pools into
  them); an image of padding only (an empty image) has none."""
  n, p, _ = positions.shape
  k = config.pooling_kernel_size
  length = p // (k * k)
  real = ~(positions == -1).all(axis=-1)  # [N, P]
  if length == p:
    return real
  slots = pooled_slots(positions, k, length, xp)
  return (slots[..., None] == xp.arange(length)).any(axis=1) & real.any(axis=1)[:, None]


def num_soft_tokens(positions, config: VisionConfig) -> np.ndarray:
  """[N] int: the soft tokens (image tokens in the prompt) each image gives (computed on the host)."""
  return soft_token_mask(np.asarray(positions), config).sum(-1)


def check_image_inputs(pixel_values, positions, config: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
  """Host checks of one batch of images -> (pixel_values float32, positions int32). One-line `ValueError` naming
  the argument for a wrong rank, patch size, or a patch count that is not a multiple of the pooling kernel^2."""
  pixels = np.asarray(pixel_values)
  pos = np.asarray(positions)
  if pixels.ndim != 3 or pixels.shape[-1] != config.patch_dim:
    raise ValueError(f"pixel_values has shape {pixels.shape}, expected [images, patches, {config.patch_dim}] "
                     f"(3 x patch_size {config.patch_size}^2 values per patch)")
  if not np.issubdtype(pixels.dtype, np.floating):
    raise ValueError(f"pixel_values must be floating point (values in [0, 1]), got dtype {pixels.dtype}")
  if pos.shape != (*pixels.shape[:2], 2) or not np.issubdtype(pos.dtype, np.integer):
    raise ValueError(f"image_position_ids has shape {pos.shape} dtype {pos.dtype}, expected integer "
                     f"{(*pixels.shape[:2], 2)} (the (x, y) of each patch of pixel_values)")
  k2 = config.pooling_kernel_size ** 2
  if pixels.shape[1] % k2:
    raise ValueError(f"pixel_values has {pixels.shape[1]} patches per image, not a multiple of pooling_kernel_size^2 "
                     f"= {k2}")
  if pos.size and pos.max() >= config.position_embedding_size:
    raise ValueError(f"image_position_ids holds position {int(pos.max())} >= position_embedding_size "
                     f"{config.position_embedding_size}")
  return pixels.astype(np.float32), pos.astype(np.int32)


def check_image_tokens(config: Any, input_ids: Any, pixel_values: Any,
                       image_position_ids: Any) -> tuple[np.ndarray, np.ndarray]:
  """Host checks of a prompt's images for the model of `config` (a `ModelConfig`): `check_image_inputs`, and that
  `input_ids` holds exactly one image token per soft token of the images (and, for bidirectional image blocks, no
  run of image tokens longer than one image's soft-token slots) -> (pixel_values float32, positions int32).
  One-line `ValueError`."""
  if config.vision is None:
    raise ValueError("pixel_values were given but the model has no vision tower (its config has no vision)")
  if image_position_ids is None:
    raise ValueError("pixel_values were given without image_position_ids (the (x, y) of every patch)")
  pixels, positions = check_image_inputs(pixel_values, image_position_ids, config.vision)
  soft = int(num_soft_tokens(positions, config.vision).sum())
  tokens = int((np.asarray(input_ids) == config.image_token_id).sum())
  if soft != tokens:
    raise ValueError(f"the prompt holds {tokens} image tokens (id {config.image_token_id}) but its "
                     f"{pixels.shape[0]} images give {soft} soft tokens; expected one image token per soft token")
  slots = positions.shape[1] // config.vision.pooling_kernel_size ** 2  # the band's reach (`image_blocks`)
  run = longest_image_run(input_ids, config.image_token_id) if config.use_bidirectional_attention == "vision" else 0
  if run > slots:
    raise ValueError(f"the prompt holds a run of {run} consecutive image tokens, more than one image's {slots} "
                     "soft-token slots: separate the images with their begin/end-of-image tokens")
  return pixels, positions


# ---- modules ------------------------------------------------------------------------------------------------------
class PatchEmbedder(nnx.Module):
  """pixel patches [N, P, 3 p^2] in [0, 1] -> `input_proj(2 (v - 0.5)) + pos_x[x] + pos_y[y]` [N, P, H] (no
  position embedding on padding patches). A fresh table is all ones (transformers' init: every patch starts with
  the same position embedding), or N(0, position_embedding_init_std^2) when that is set (each patch position starts
  distinct)."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    h = config.hidden_size
    self.dtype = dtype
    self.input_proj = ClippableLinear(config.patch_dim, h, (None, "embed"), clipped=False, rngs=rngs, dtype=dtype,
                                      param_dtype=param_dtype, std=config.initializer_range)
    shape = (2, config.position_embedding_size, h)
    std = config.position_embedding_init_std  # 0: all ones, as transformers initialises the table
    table = std * jax.random.normal(rngs.params(), shape, param_dtype) if std else jnp.ones(shape, param_dtype)
    self.position_embedding_table = nnx.Param(table, out_sharding=(None, None, "embed"))

  def __call__(self, pixel_values: Array, positions: Array, padding: Array) -> Array:
    x = self.input_proj((2.0 * (pixel_values.astype(jnp.float32) - 0.5)).astype(self.dtype))
    table = self.position_embedding_table[...].astype(self.dtype)
    clamped = jnp.maximum(positions, 0)
    pos = table[0][clamped[..., 0]] + table[1][clamped[..., 1]]  # [N, P, H]
    return x + jnp.where(padding[..., None], jnp.zeros((), pos.dtype), pos)


class VisionEncoder(nnx.Module):
  """The stack of bidirectional encoder layers."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    self.config = config
    self.dtype = dtype
    self.layers = nnx.List([VisionEncoderLayer(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                            for _ in range(config.num_hidden_layers)])

  def __call__(self, x: Array, positions: Array, valid: Array) -> Array:
    cos, sin = axial_cos_sin(positions, self.config, self.dtype)
    for layer in self.layers:
      x = layer(x, cos, sin, valid)
    return x


class VisionTower(nnx.Module):
  """The Gemma 4 vision model: patches -> soft tokens `[N, P / k^2, hidden]` (fp32 pooling and scaling, then the
  compute dtype) and their mask."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    self.config = config
    self.dtype = dtype
    self.patch_embedder = PatchEmbedder(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.encoder = VisionEncoder(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    if config.standardize:
      self.std_bias = layers.Buffer(jnp.zeros((config.hidden_size,), param_dtype))
      self.std_scale = layers.Buffer(jnp.ones((config.hidden_size,), param_dtype))

  def pool(self, hidden: Array, positions: Array, padding: Array) -> tuple[Array, Array]:
    """hidden [N, P, H] -> (the average of each k x k block of patches times sqrt(H), fp32 [N, P / k^2, H];
    slot mask [N, P / k^2])."""
    k = self.config.pooling_kernel_size
    n, p, h = hidden.shape
    length = p // (k * k)
    hidden = jnp.where(padding[..., None], jnp.zeros((), hidden.dtype), hidden).astype(jnp.float32)
    if length == p:
      pooled, mask = hidden, ~padding
    else:
      slots = pooled_slots(positions, k, length, jnp)
      weights = jax.nn.one_hot(slots, length, dtype=jnp.float32) / (k * k)  # [N, P, L]
      pooled = jnp.einsum("npl,nph->nlh", weights, hidden, precision=jax.lax.Precision.HIGHEST)
      pooled = pooled.astype(self.dtype).astype(jnp.float32)  # transformers returns the average in the input dtype
      mask = (weights != 0).any(axis=1) & (~padding).any(axis=1)[:, None]  # an empty image gives no soft token
    return pooled * math.sqrt(self.config.hidden_size), mask

  def __call__(self, pixel_values: Array, positions: Array) -> tuple[Array, Array]:
    """pixel_values [N, P, 3 p^2], positions [N, P, 2] -> (soft tokens [N, P / k^2, H], mask [N, P / k^2])."""
    padding = (positions == -1).all(axis=-1)
    x = self.patch_embedder(pixel_values, positions, padding)
    x = self.encoder(x, positions, ~padding)
    soft, mask = self.pool(x, positions, padding)
    if self.config.standardize:
      soft = (soft - self.std_bias[...].astype(jnp.float32)) * self.std_scale[...].astype(jnp.float32)
    return soft.astype(self.dtype), mask


class MultimodalEmbedder(nnx.Module):
  """soft tokens [..., vision hidden] -> `embedding_projection(rmsnorm_noscale(x))` [..., text hidden]."""

  def __init__(self, config: VisionConfig, text_hidden: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float):
    self.embedding_pre_projection_norm = layers.RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                        with_scale=False)
    self.embedding_projection = ClippableLinear(config.hidden_size, text_hidden, (None, "embed"), clipped=False,
                                                rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)

  def __call__(self, x: Array) -> Array:
    return self.embedding_projection(self.embedding_pre_projection_norm(x))


def scatter_image_features(embeds: Array, input_ids: Array, features: Array, mask: Array,
                           image_token_id: int) -> Array:
  """embeds [B, L, H] with its `image_token_id` positions replaced, in row-major order, by the valid soft tokens of
  `features [N, S, H]` (mask [N, S]) taken image by image: transformers' `masked_scatter`. The counts must agree
  (checked on the host: `num_soft_tokens`); surplus image tokens get the last soft token."""
  n, s, h = features.shape
  flat, valid = features.reshape(n * s, h).astype(embeds.dtype), mask.reshape(n * s)
  rank = jnp.cumsum(valid) - 1
  packed = jnp.zeros_like(flat).at[jnp.where(valid, rank, n * s)].set(flat, mode="drop")  # valid ones first
  is_image = input_ids == image_token_id  # [B, L]
  token_rank = (jnp.cumsum(is_image.reshape(-1)) - 1).reshape(is_image.shape)
  picked = packed[jnp.clip(token_rank, 0, n * s - 1)]  # [B, L, H]
  return jnp.where(is_image[..., None], picked, embeds)


__all__ = ["MultimodalEmbedder", "PatchEmbedder", "VisionEncoder", "VisionTower", "check_image_inputs",
           "check_image_tokens", "num_soft_tokens", "pooled_slots", "scatter_image_features", "soft_token_mask"]
