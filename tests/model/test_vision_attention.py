"""Bidirectional image blocks in the encoder (`use_bidirectional_attention="vision"`): the mask equals transformers'
(`create_masks_for_generate` given the processor's `mm_token_type_ids`) on full and sliding layers with left padding;
the banded and query-chunked paths equal the dense one with blocks (also blocks longer than the window, and a pass
at an offset); the config reads and writes the mode; a run of image tokens longer than one image is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import attention, vision
from hackable_diffusion.model.config import SLIDING, FULL, ModelConfig, get_preset
from hackable_diffusion.model.vision_attention import image_blocks
from hackable_diffusion.model.vision_config import VisionConfig

IMAGE = 9
hf_model = pytest.importorskip("transformers.models.diffusion_gemma.modeling_diffusion_gemma")


def _prompts() -> tuple[np.ndarray, np.ndarray]:
  """ids [3, 16] with image runs of 1 to 7 tokens (at the start, after padding, at the end), left padding."""
  x = IMAGE
  ids = np.array([
      [0, 0, 0, 5, x, x, x, x, x, x, x, 6, 7, x, 8, 3],  # a 7-token run (longer than the window), then 1 token
      [x, x, x, 4, 5, 6, 7, 8, x, x, 3, 4, 5, x, x, x],  # runs at the start, in the middle and at the end
      [0, 0, 0, 0, 0, 0, 2, 3, x, x, x, x, 1, x, x, 4],  # adjacent runs separated by one token
  ])
  mask = np.ones_like(ids, bool)
  mask[0, :3] = mask[2, :6] = False
  return ids, mask


@pytest.mark.parametrize("layer", [SLIDING, FULL])
def test_encoder_mask_equals_transformers(layer):
  ids, mask = _prompts()
  window = 3
  cfg = hf_model.DiffusionGemmaConfig(text_config=dict(
      vocab_size=16, hidden_size=8, num_hidden_layers=2, layer_types=[SLIDING, FULL], sliding_window=window,
      num_experts=2, use_bidirectional_attention="vision"))
  cfg.text_config._attn_implementation = "sdpa"  # boolean masks
  masks = hf_model.DiffusionGemmaEncoderModel.create_masks_for_generate(
      config=cfg, inputs_embeds=torch.empty((*ids.shape, 0)), attention_mask=torch.tensor(mask),
      past_key_values=None, position_ids=None, mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)))
  expected = masks[layer][:, 0].numpy()  # [B, L, L]
  start = jnp.zeros(ids.shape[0], jnp.int32)
  blocks = image_blocks(jnp.asarray(ids), jnp.asarray(mask), IMAGE, start, reach=8)
  q_pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  got = np.asarray(attention.encoder_mask(jnp.asarray(mask), q_pos, window if layer == SLIDING else None, blocks))
  np.testing.assert_array_equal(got, expected)
  causal = np.asarray(attention.encoder_mask(jnp.asarray(mask), q_pos, window if layer == SLIDING else None))
  assert (got & ~causal).sum() > 20 and not (causal & ~got).any()  # blocks only add keys


def _pass(rng, start: int, capacity: int, reach: int):
  """One encoder pass of the `_prompts` at slot `start` of a cache of `capacity` (earlier slots valid): q, k, v,
  valid [B, S], start [B] and the pass's blocks."""
  ids, mask = _prompts()
  b, l = ids.shape
  n, nkv, d = 4, 2, 8
  valid = np.zeros((b, capacity), bool)
  valid[:, :start] = True
  valid[:, start:start + l] = mask
  starts = jnp.full((b,), start, jnp.int32)
  blocks = image_blocks(jnp.asarray(ids), jnp.asarray(mask), IMAGE, starts, reach)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  return (normal((b, l, n, d)), normal((b, capacity, nkv, d)), normal((b, capacity, nkv, d)), jnp.asarray(valid),
          starts, blocks)


@pytest.mark.parametrize("start, window", [(0, 3), (21, 3), (5, 9)])
def test_band_and_chunks_equal_dense_with_blocks(monkeypatch, start, window):
  monkeypatch.setattr(attention, "BAND_MIN_CAPACITY", 0)
  rng = np.random.default_rng(start)
  capacity = 96
  q, k, v, valid, starts, blocks = _pass(rng, start, capacity, reach=8)
  l = q.shape[1]
  mask = lambda w: attention.encoder_mask(valid, starts[:, None] + jnp.arange(l)[None, :], w, blocks)  # noqa: E731
  dense = lambda w: attention.attend(q, k, v, mask(w), jnp.float32)  # noqa: E731
  assert attention.band_pays(l, capacity, window, blocks.reach)
  assert not attention.band_pays(l, 2 * attention.band_span(attention.band_chunk(l, window), window) + 1, window,
                                 blocks.reach)  # the span grows with the blocks
  w = np.asarray(mask(window).any(-1))[..., None, None]  # queries that see a key (others: unspecified output)
  banded = attention.encoder_attention(q, k, v, valid, starts, window, jnp.float32, blocks)
  np.testing.assert_allclose(np.asarray(banded) * w, np.asarray(dense(window)) * w, atol=1e-5)
  for win in (window, None):
    chunked = attention.chunked_encoder_attention(q, k.astype(jnp.float32), v, valid, starts, win, jnp.float32, 5,
                                                  blocks)
    np.testing.assert_allclose(np.asarray(chunked) * w, np.asarray(dense(win)) * w, atol=1e-5)
  causal = attention.encoder_attention(q, k, v, valid, starts, window, jnp.float32)
  assert np.abs(np.asarray(causal - banded) * w).max() > 1e-2  # the blocks change the result


def test_model_banded_encoder_equals_dense_with_images(monkeypatch):
  """A whole encoder pass with images over a cache long enough for the band: the banded sliding layers give the
  dense path's hidden states and cache; the same weights with a causal encoder give other hidden states."""
  from flax import nnx

  from hackable_diffusion.model.transformer import init_model

  tower = VisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2,
                       position_embedding_size=8)
  cfg = get_preset("tiny").replace(vocab_size=16, vision=tower, image_token_id=IMAGE, sliding_window=3,
                                   use_bidirectional_attention="vision")
  model = init_model(cfg, seed=0)
  ids, mask = _prompts()
  counts = np.array([7, 1, 3, 2, 3, 4, 2])  # the images' soft tokens, row by row (8 slots each)
  assert counts.sum() == (ids == IMAGE).sum()
  soft = jnp.asarray(np.random.default_rng(1).standard_normal((7, 8, cfg.hidden_size)), jnp.float32)
  images = (soft, jnp.asarray(np.arange(8)[None, :] < counts[:, None]))

  def encode(model):
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda st: nnx.merge(graphdef, st).encode(jnp.asarray(ids), model.init_cache(ids.shape[0], 64),
                                                           jnp.asarray(mask), images))
    hidden, cache = run(state)
    keys = np.asarray(cache.keys[1])[:, :ids.shape[1]] * mask[..., None, None]  # padding's output is unspecified
    return np.asarray(hidden) * mask[..., None], keys

  monkeypatch.setattr(attention, "BAND_MIN_CAPACITY", 0)
  assert attention.band_pays(ids.shape[1], 64, 3, 8)
  banded, keys_banded = encode(model)
  monkeypatch.setattr(attention, "band_pays", lambda *a: False)
  dense, keys_dense = encode(model)
  np.testing.assert_allclose(banded, dense, atol=1e-5)
  np.testing.assert_allclose(keys_banded, keys_dense, atol=1e-5)
  causal_model = nnx.merge(*nnx.split(model))
  causal_model.config = cfg.replace(use_bidirectional_attention=None)
  causal, _ = encode(causal_model)
  assert np.abs(causal - dense).max() > 1e-2


def test_config_reads_and_writes_the_mode():
  tiny = get_preset("tiny")
  hf = tiny.replace(use_bidirectional_attention="vision").to_hf_config()
  assert hf["text_config"]["use_bidirectional_attention"] == "vision"
  assert ModelConfig.from_hf_config(hf).use_bidirectional_attention == "vision"
  assert tiny.to_hf_config()["text_config"]["use_bidirectional_attention"] is None
  bad = dict(hf, text_config=dict(hf["text_config"], use_bidirectional_attention="images"))
  with pytest.raises(ConfigError, match="use_bidirectional_attention='images'"):
    ModelConfig.from_hf_config(bad)
  with pytest.raises(ConfigError, match="use_bidirectional_attention='all'"):
    tiny.replace(use_bidirectional_attention="all")


def test_image_run_longer_than_one_image_is_refused():
  tower = VisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2,
                       position_embedding_size=8)
  cfg = get_preset("tiny").replace(vision=tower, image_token_id=IMAGE, use_bidirectional_attention="vision")
  positions = np.stack(np.meshgrid(np.arange(4), np.arange(2), indexing="xy"), -1).reshape(1, 8, 2)
  positions = np.repeat(positions, 2, 0)  # two images of 2 soft tokens in 2 slots each
  pixels = np.zeros((2, 8, tower.patch_dim), np.float32)
  ids = np.array([[3, IMAGE, IMAGE, IMAGE, IMAGE, 4]])  # no begin/end-of-image between them: one run of 4
  with pytest.raises(ValueError, match="a run of 4 consecutive image tokens, more than one image's 2") as info:
    vision.check_image_tokens(cfg, ids, pixels, positions)
  assert "\n" not in str(info.value)
  vision.check_image_tokens(cfg.replace(use_bidirectional_attention=None), ids, pixels, positions)  # causal: fine
  ids = np.array([[3, IMAGE, IMAGE, 4, IMAGE, IMAGE]])
  vision.check_image_tokens(cfg, ids, pixels, positions)
