"""Loading the vision tower of a Hugging Face checkpoint: every tensor under its name both ways, the config, a
text-only load on request, and QLoRA keeping the tower dense."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import vision_reference as vr
from safetensors.numpy import load_file

import hackable_diffusion as hd
from hackable_diffusion.errors import CheckpointError, ConfigError
from hackable_diffusion.interop import vision_io
from hackable_diffusion.interop.qlora_load import load_pretrained_quantized
from hackable_diffusion.lora import qlora
from hackable_diffusion.model import vision
from hackable_diffusion.model.config import ModelConfig


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vision_load_ref"))
  return vr.reference(path), path


@pytest.fixture(scope="module")
def ours(reference):
  return hd.load_pretrained(reference[1])


def test_every_vision_tensor_loads_and_names_back(reference, ours):
  ref, path = reference
  stored = {k: v for k, v in load_file(f"{path}/model.safetensors").items() if vision_io.is_vision_name(k)}
  assert any(k.endswith("q_proj.linear.weight") for k in stored) and any(k.endswith("input_min") for k in stored)
  ours_named = vision_io.vision_state_dict(ours)
  assert set(ours_named) == set(stored)  # no vision tensor skipped, none invented
  for name, value in stored.items():
    np.testing.assert_array_equal(ours_named[name], value, err_msg=name)
  # the names are those of transformers' modules (what save_pretrained writes and from_pretrained reads)
  torch_state = {k: v for k, v in ref.state_dict().items() if vision_io.is_vision_name(k)}
  assert set(ours_named) <= set(torch_state)
  assert all(k.endswith("inv_freq") for k in set(torch_state) - set(ours_named))  # rotary buffers, not saved
  assert isinstance(ours.vision_tower, vision.VisionTower)
  assert ours.config.image_token_id == vr.IMAGE and ours.config.boi_token_id == vr.BOI


def test_config_round_trips_through_the_hf_layout(ours):
  config = ours.config
  written = config.to_hf_config(torch_dtype="float32")
  assert written["vision_config"]["num_key_value_heads"] == vr.VISION["num_key_value_heads"]
  assert written["image_token_id"] == vr.IMAGE
  assert ModelConfig.from_hf_config(written) == config
  # transformers builds the same tower from it
  from transformers import DiffusionGemmaConfig

  hf = DiffusionGemmaConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
  assert hf.vision_config.use_clipped_linears and hf.vision_config.pooling_kernel_size == vr.KERNEL
  # a run's config.json holds the vision config as a plain dict
  import dataclasses

  assert ModelConfig(**{**dataclasses.asdict(config), "vision": dataclasses.asdict(config.vision)}) == config
  # a tower this model cannot run is a one-line error, unless the text model alone is asked for
  odd = {**written, "vision_config": {**written["vision_config"], "output_proj_dims": 16}}
  with pytest.raises(ConfigError, match="vision_config.output_proj_dims is not supported"):
    ModelConfig.from_hf_config(odd)
  assert ModelConfig.from_hf_config(odd, vision=None).vision is None


def test_text_only_load_on_request_skips_the_tower_with_a_warning(reference, caplog):
  _, path = reference
  with caplog.at_level(logging.WARNING):
    text_only = hd.load_pretrained(path, vision=None)
  assert not text_only.has_vision and not hasattr(text_only, "vision_tower")
  assert any("skipped" in r.getMessage() and "vision-tower tensors" in r.getMessage() for r in caplog.records)


def test_qlora_keeps_the_vision_tower_dense(reference):
  _, path = reference
  model = load_pretrained_quantized(path, "int4", dtype="bfloat16", block_size=8)
  assert qlora.base_quantization(model) == "int4"
  q = model.vision_tower.encoder.layers[0].self_attn.q_proj
  assert not qlora.is_quantized(q) and q.kernel[...].dtype == jnp.bfloat16
  assert model.embed_vision.embedding_projection.kernel[...].dtype == jnp.bfloat16
  assert qlora.is_quantized(model.layers[0].self_attn.q_proj)


def test_save_round_trips_the_tower_through_transformers(reference, ours, tmp_path):
  """`hd.save_pretrained` writes the model's own tower: plain `from_pretrained` reports no missing or unexpected
  keys and gives transformers' logits with images bit for bit."""
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  ref, src = reference
  out = str(tmp_path / "saved")
  hd.save_pretrained(ours, out, dtype="float32")
  loaded, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
  assert not any(info.values()), info  # 0 missing / unexpected / mismatched keys
  rng = np.random.default_rng(1)
  pixels, positions = vr.images(rng, [(4, 6), (2, 2)], max_soft_tokens=8)
  ids, mask = vr.left_padded([[5, *vr.image_tokens(6), 7], [*vr.image_tokens(1), 8]])
  canvas = rng.integers(3, 120, size=(2, vr.CANVAS))

  def logits(model):
    with torch.no_grad():
      return model.eval()(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                          attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                          image_position_ids=torch.tensor(positions)).logits.numpy()

  np.testing.assert_array_equal(logits(loaded), logits(ref))
  with pytest.raises(CheckpointError, match="its own vision tower"):
    hd.save_pretrained(ours, str(tmp_path / "again"), vision_source=src)
