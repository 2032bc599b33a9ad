"""The Gemma 4 vision tower: soft tokens equal to transformers' on a held-out tiny config, pooling geometry,
scattering into the prompt, and the tower kept out of QLoRA and (unless named, tests/lora/test_vision_lora.py) LoRA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import vision_reference as vr
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora import adapters, qlora
from hackable_diffusion.model import vision
from hackable_diffusion.model.vision_config import VisionConfig

GRIDS = [(4, 6), (2, 2), (6, 2), (8, 8)]  # (rows, columns) of patches; the last one fills all its patches
MAX_SOFT = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vision_ref"))
  ref = vr.reference(path)
  return ref, hd.load_pretrained(path), path


@pytest.fixture(scope="module")
def inputs():
  return vr.images(np.random.default_rng(0), GRIDS, MAX_SOFT)


@nnx.jit
def _features(model, pixels, positions):
  return model.image_features(pixels, positions)


def _reference(ref, pixels, positions) -> np.ndarray:
  with torch.no_grad():
    out = ref.model.encoder.get_image_features(torch.tensor(pixels), torch.tensor(positions))
  return out.pooler_output.numpy()


def test_image_features_match_transformers(pair, inputs):
  ref, ours, _ = pair
  pixels, positions = inputs
  expected = _reference(ref, pixels, positions)  # [soft tokens of all images, text hidden]
  features, mask = _features(ours, jnp.asarray(pixels), jnp.asarray(positions))
  got = np.asarray(features)[np.asarray(mask)]
  assert got.shape == expected.shape == (6 + 1 + 3 + 16, vr.TEXT["hidden_size"])
  scale = np.abs(expected).max()
  assert scale > 0.1
  assert np.abs(got - expected).max() <= 1e-4 * scale
  np.testing.assert_array_equal(vision.num_soft_tokens(positions, ours.config.vision), [6, 1, 3, 16])
  # the standardization takes part: dropping its bias changes the features
  tower = ours.vision_tower
  bias = tower.std_bias[...]
  tower.std_bias[...] = jnp.zeros_like(bias)
  try:
    changed = np.asarray(_features(ours, jnp.asarray(pixels), jnp.asarray(positions))[0])[np.asarray(mask)]
  finally:
    tower.std_bias[...] = bias
  assert np.abs(changed - expected).max() > 1e-3 * scale


def test_padding_patches_change_nothing(pair, inputs):
  _, ours, _ = pair
  pixels, positions = inputs
  noisy = pixels.copy()
  noisy[positions[..., 0] < 0] = 7.0  # garbage in the padding patches
  a, mask = _features(ours, jnp.asarray(pixels), jnp.asarray(positions))
  b, _ = _features(ours, jnp.asarray(noisy), jnp.asarray(positions))
  m = np.asarray(mask)
  assert np.abs(np.asarray(a)[m] - np.asarray(b)[m]).max() <= 1e-6


def test_an_empty_image_gives_no_soft_token(pair, inputs):
  """An image of padding patches only (how a batch pads its number of images) has no soft token, on the host and in
  the tower's mask; the real images keep theirs."""
  _, ours, _ = pair
  pixels, positions = inputs
  pixels, positions = pixels.copy(), positions.copy()
  pixels[1], positions[1] = 0.0, -1
  np.testing.assert_array_equal(vision.num_soft_tokens(positions, ours.config.vision), [6, 0, 3, 16])
  _, mask = _features(ours, jnp.asarray(pixels), jnp.asarray(positions))
  np.testing.assert_array_equal(np.asarray(mask).sum(-1), [6, 0, 3, 16])


def test_scatter_places_soft_tokens_in_row_major_order():
  # two rows, three images (image 0 and 1 in row 0): soft tokens are taken image by image, valid slots only
  features = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)
  mask = jnp.asarray([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], bool)
  ids = jnp.asarray([[5, 9, 9, 5, 9, 0], [9, 9, 9, 5, 5, 5]])
  embeds = jnp.full((2, 6, 2), -1.0)
  out = np.asarray(vision.scatter_image_features(embeds, ids, features, mask, image_token_id=9))
  valid = np.asarray(features).reshape(-1, 2)[np.asarray(mask).reshape(-1)]
  np.testing.assert_array_equal(out[ids == 9], valid)
  assert (out[np.asarray(ids) != 9] == -1.0).all()


def test_vision_tower_is_no_default_lora_target_and_no_qlora_target(pair):
  _, ours, _ = pair
  for targets in (adapters.DEFAULT_TARGETS, "all-linear", ["q_proj", "v_proj"]):
    assert not [p for p in adapters.resolve_targets(ours, adapters.LoraConfig(target_modules=targets)) if "vision" in p]
  assert not [p for p, _ in qlora.quantization_targets(ours) if "vision" in str(p[0])]


def test_vision_config_round_trips_and_rejects_bad_values():
  config = VisionConfig.from_hf(vr.VISION)
  assert VisionConfig.from_hf(config.to_hf()) == config
  assert config.use_clipped_linears and config.standardize and config.patch_dim == vr.PATCH_DIM
  with pytest.raises(ConfigError, match="head_dim=6 must be a multiple of 4"):
    VisionConfig(head_dim=6)
  with pytest.raises(ConfigError, match="rope_type='default'"):
    VisionConfig.from_hf({**vr.VISION, "rope_parameters": {"rope_type": "default"}})


def test_tower_follows_the_model_dtypes(pair):
  _, ours, _ = pair
  config = ours.config.replace(param_dtype="bfloat16", dtype="bfloat16")
  abstract = nnx.eval_shape(lambda: hd.DiffusionGemma(config, rngs=nnx.Rngs(0)))
  assert abstract.vision_tower.encoder.layers[0].self_attn.q_proj.kernel.dtype == jnp.bfloat16
  assert abstract.embed_vision.embedding_projection.kernel.dtype == jnp.bfloat16
  assert ours.vision_tower.patch_embedder.position_embedding_table.dtype == jnp.float32


def test_image_inputs_are_checked():
  config = VisionConfig.from_hf(vr.VISION)
  pixels, positions = vr.images(np.random.default_rng(1), [(2, 2)], 4)
  with pytest.raises(ValueError, match=r"pixel_values has shape \(1, 16, 5\)"):
    vision.check_image_inputs(pixels[..., :5], positions, config)
  with pytest.raises(ValueError, match="not a multiple of pooling_kernel_size"):
    vision.check_image_inputs(pixels[:, :15], positions[:, :15], config)
  with pytest.raises(ValueError, match="image_position_ids has shape"):
    vision.check_image_inputs(pixels, positions[:, :8], config)
  far = positions.copy()
  far[0, 0] = (16, 0)
  with pytest.raises(ValueError, match="position_embedding_size 16"):
    vision.check_image_inputs(pixels, far, config)

