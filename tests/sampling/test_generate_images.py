"""Prompts with images: the whole model's logits and `hd.generate` equal transformers' with `pixel_values`, on a
held-out tiny config (1-2 images per prompt, left padding), also with bidirectional image blocks
(`use_bidirectional_attention="vision"`, transformers given the processor's `mm_token_type_ids`), and the image token
count is checked."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import vision_reference as vr

import hackable_diffusion as hd
from hackable_diffusion.model.transformer import forward
from hackable_diffusion.sampling import programs

hf_gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

CANVASES, STEPS = 2, 5
DET = dict(t_min=1e-4, t_max=2e-4, entropy_bound=1e9)  # deterministic regime (as tests/sampling/test_generate.py)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vision_generate_ref"))
  ref = vr.reference(path)
  return ref, hd.load_pretrained(path)


@pytest.fixture(scope="module")
def inputs():
  """Row 0: two images (6 and 1 soft tokens) among text; row 1: one image (3 soft tokens), left-padded."""
  rng = np.random.default_rng(1)
  pixels, positions = vr.images(rng, [(4, 6), (2, 2), (6, 2)], max_soft_tokens=8)
  rows = [[5, 6, *vr.image_tokens(6), 7, *vr.image_tokens(1), 8, 9], [10, *vr.image_tokens(3), 11, 12]]
  ids, mask = vr.left_padded(rows)
  starts = rng.integers(3, vr.VOCAB - 3, size=(CANVASES, 2, vr.CANVAS))  # the starting canvas of each block
  return ids, mask, pixels, positions, starts, rows


@pytest.fixture(scope="module")
def vision_pair(tmp_path_factory):
  """The same weights with `use_bidirectional_attention="vision"`: each image's tokens attend to each other."""
  path = str(tmp_path_factory.mktemp("vision_blocks_ref"))
  ref = vr.reference(path, use_bidirectional_attention="vision")
  return ref, hd.load_pretrained(path)


def _torch_logits(ref, ids, mask, canvas, pixels, positions, mm_token_type_ids=None) -> np.ndarray:
  """transformers' logits; with `mm_token_type_ids`, the encoder mask built as its `generate` builds it (its
  `forward` given a 2-D mask leaves the encoder causal whatever the config)."""
  decoder_mask = np.concatenate([mask, np.ones_like(canvas)], axis=1)
  encoder_mask = torch.tensor(mask)
  if mm_token_type_ids is not None:
    encoder_mask = ref.model.encoder.create_masks_for_generate(
        config=ref.config, inputs_embeds=torch.empty((*ids.shape, 0)), attention_mask=encoder_mask.bool(),
        past_key_values=None, position_ids=None, mm_token_type_ids=torch.tensor(mm_token_type_ids))
  with torch.no_grad():
    out = ref(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas), attention_mask=encoder_mask,
              decoder_attention_mask=torch.tensor(decoder_mask), pixel_values=torch.tensor(pixels),
              image_position_ids=torch.tensor(positions))
  return out.logits.numpy()


def test_logits_with_images_and_left_padding(pair, inputs):
  ref, ours = pair
  ids, mask, pixels, positions, starts, _ = inputs
  canvas = starts[0]
  expected = _torch_logits(ref, ids, mask, canvas, pixels, positions)
  got = np.asarray(forward(ours, ids.astype(np.int32), canvas.astype(np.int32), attention_mask=mask.astype(bool),
                           pixel_values=pixels, image_position_ids=positions))
  scale = np.abs(expected).max()
  assert scale > 1.0
  assert np.abs(got - expected).max() <= 1e-4 * scale
  # the images matter: the same prompt with other pixels gives other logits
  other = _torch_logits(ref, ids, mask, canvas, 1.0 - pixels, positions)
  assert np.abs(other - expected).max() > 1e-2 * scale


def test_logits_with_bidirectional_image_blocks(vision_pair, inputs):
  ref, ours = vision_pair
  ids, mask, pixels, positions, starts, _ = inputs
  assert ours.config.use_bidirectional_attention == "vision"
  canvas = starts[0]
  expected = _torch_logits(ref, ids, mask, canvas, pixels, positions, vr.mm_token_type_ids(ids))
  got = np.asarray(forward(ours, ids.astype(np.int32), canvas.astype(np.int32), attention_mask=mask.astype(bool),
                           pixel_values=pixels, image_position_ids=positions))
  scale = np.abs(expected).max()
  assert scale > 1.0
  assert np.abs(got - expected).max() <= 1e-4 * scale
  # the blocks matter: the causal encoder (no mm_token_type_ids) gives other logits
  causal = _torch_logits(ref, ids, mask, canvas, pixels, positions)
  assert np.abs(causal - expected).max() > 1e-2 * scale


def _hf_generate(ref, ids, mask, pixels, positions, starts, monkeypatch, **kwargs):
  """transformers' generate with images, canvas k starting from starts[k] (seed for k = 0, a patched init after)."""
  block = {"k": 0}
  original = hf_gen.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs

  def prepare(self, *args, **kw):
    out = original(self, *args, **kw)
    block["k"] += 1
    return out

  def initialize_canvas(self, batch_size, device):
    return torch.tensor(starts[min(block["k"], len(starts) - 1)])

  monkeypatch.setattr(hf_gen.DiffusionGemmaGenerationMixin, "_prepare_denoiser_inputs", prepare)
  monkeypatch.setattr(hf_gen.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
  kwargs = dict(kwargs)
  bound = kwargs.pop("entropy_bound")
  outs = []
  for seed in (0, 1):  # near-ties of the top logits would make the draw depend on torch's seed: the inputs have none
    torch.manual_seed(seed)
    block["k"] = 0
    with torch.no_grad():
      outs.append(ref.generate(
          torch.tensor(ids), attention_mask=torch.tensor(mask), decoder_input_ids=torch.tensor(starts[0]),
          pixel_values=torch.tensor(pixels), image_position_ids=torch.tensor(positions),
          sampler_config=hf_gen.EntropyBoundSamplerConfig(entropy_bound=float(bound)), **kwargs))
  monkeypatch.undo()
  np.testing.assert_array_equal(outs[0].sequences.numpy(), outs[1].sequences.numpy())
  return outs[0].sequences.numpy(), outs[0].tokens_per_forward.numpy()


def test_generate_with_images_matches_transformers(pair, inputs, monkeypatch):
  ref, ours = pair
  ids, mask, pixels, positions, starts, _ = inputs
  common = dict(max_new_tokens=CANVASES * vr.CANVAS, max_denoising_steps=STEPS, pad_token_id=0, eos_token_id=1, **DET)
  expected, expected_tpf = _hf_generate(ref, ids, mask, pixels, positions, starts, monkeypatch, **common)
  before = programs.trace_counts()["encode"]
  out = hd.generate(ours, ids, hd.SamplingConfig(**common), rng=jax.random.key(0), attention_mask=mask,
                    seed_canvas=np.concatenate(list(starts), axis=1), pixel_values=pixels,
                    image_position_ids=positions)
  got = np.asarray(out.sequences)
  assert got.shape == expected.shape == (2, ids.shape[1] + CANVASES * vr.CANVAS)
  np.testing.assert_array_equal(got, expected)
  np.testing.assert_allclose(np.asarray(out.tokens_per_forward), expected_tpf, rtol=1e-6)
  # one prompt encoding with the vision tower, one plain encoding of the committed canvas: two programs traced
  assert programs.trace_counts()["encode"] - before <= 2


def test_generate_with_bidirectional_image_blocks_matches_transformers(vision_pair, pair, inputs, monkeypatch):
  ref, ours = vision_pair
  ids, mask, pixels, positions, starts, _ = inputs
  common = dict(max_new_tokens=CANVASES * vr.CANVAS, max_denoising_steps=STEPS, pad_token_id=0, eos_token_id=1, **DET)
  expected, expected_tpf = _hf_generate(ref, ids, mask, pixels, positions, starts, monkeypatch,
                                        mm_token_type_ids=torch.tensor(vr.mm_token_type_ids(ids)), **common)
  run = lambda model: hd.generate(model, ids, hd.SamplingConfig(**common), rng=jax.random.key(0),  # noqa: E731
                                  attention_mask=mask, seed_canvas=np.concatenate(list(starts), axis=1),
                                  pixel_values=pixels, image_position_ids=positions)
  out = run(ours)
  np.testing.assert_array_equal(np.asarray(out.sequences), expected)
  np.testing.assert_allclose(np.asarray(out.tokens_per_forward), expected_tpf, rtol=1e-6)
  # the causal model (same weights) answers differently on these prompts
  assert (np.asarray(run(pair[1]).sequences) != expected).any()


@pytest.mark.parametrize("change, message", [
    ("drop_token", "the prompt holds 9 image tokens (id 127) but its 3 images give 10 soft tokens"),
    ("no_positions", "pixel_values were given without image_position_ids"),
    ("positions_only", "image_position_ids was given without pixel_values"),
])
def test_image_token_count_is_checked(pair, inputs, change, message):
  _, ours = pair
  ids, mask, pixels, positions, _, _ = inputs
  ids = ids.copy()
  kwargs = dict(pixel_values=pixels, image_position_ids=positions)
  if change == "drop_token":
    ids[1, np.flatnonzero(ids[1] == vr.IMAGE)[0]] = 5
  elif change == "no_positions":
    kwargs["image_position_ids"] = None
  else:
    kwargs["pixel_values"] = None
  with pytest.raises(ValueError) as info:
    hd.generate(ours, ids, hd.SamplingConfig(max_new_tokens=vr.CANVAS), rng=jax.random.key(0), attention_mask=mask,
                **kwargs)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_text_only_model_refuses_images(hf_factory, inputs):
  _, path = hf_factory("sampling_generate_images_text_only", vocab=vr.VOCAB, canvas=vr.CANVAS)
  text_only = hd.load_pretrained(path)  # the placeholder tower of a text-only checkpoint is not loaded
  assert not text_only.has_vision
  ids, mask, pixels, positions, _, _ = inputs
  with pytest.raises(ValueError, match="the model has no vision tower"):
    hd.generate(text_only, ids, hd.SamplingConfig(max_new_tokens=vr.CANVAS), rng=jax.random.key(0),
                attention_mask=mask, pixel_values=pixels, image_position_ids=positions)


def test_stream_with_images_equals_generate(pair, inputs):
  # three requests (two images, one image, none) through two slots: each row as `generate` gives it with its key
  _, ours = pair
  _, _, pixels, positions, _, rows = inputs
  rows = [*rows, [3, 4, 5, 6]]
  images = [(pixels[:2], positions[:2]), (pixels[2:], positions[2:]), (None, None)]
  ids, mask = vr.left_padded(rows)
  cfg = hd.SamplingConfig(max_new_tokens=CANVASES * vr.CANVAS, max_denoising_steps=STEPS, pad_token_id=0,
                          eos_token_id=1, **DET)
  keys = jax.random.split(jax.random.key(3), 3)
  requests = [hd.StreamRequest(input_ids=row, key=key, pixel_values=p, image_position_ids=q)
              for row, key, (p, q) in zip(rows, keys, images)]
  streamed = {o.index: o.sequence for o in hd.generate_stream(ours, requests, cfg, rng=jax.random.key(0),
                                                               batch_size=2, prompt_length=ids.shape[1])}
  batch = np.asarray(hd.generate(ours, ids, cfg, rng=keys, attention_mask=mask, pixel_values=pixels,
                                 image_position_ids=positions).sequences)
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(streamed[i], np.concatenate([row, batch[i, ids.shape[1]:]]))
