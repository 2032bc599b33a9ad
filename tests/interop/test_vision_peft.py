"""LoRA on the vision tower and its projector against peft 0.21 on transformers' DiffusionGemma: the PEFT export
carries peft's own module names (`...q_proj.linear`, `embed_vision.embedding_projection`) and gives our logits with
images, reads back into identical adapters, and the merged export loads in plain transformers with our logits."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import vision_reference as vr
from flax import nnx
from safetensors.numpy import load_file

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.interop import export
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.model.transformer import forward

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("shared_xla_cache")
TARGETS = lora.DEFAULT_TARGETS + lora.VISION_TARGETS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vision_peft_ref"))
  vr.reference(path)
  return path, hd.load_pretrained(path)


@pytest.fixture(scope="module")
def adapted(base, tmp_path_factory):
  """Ours with random non-zero adapters on the text attention / MLP, every vision linear and the projector, and its
  PEFT export."""
  path, ours = base
  model = lora.apply_lora(ours, lora.LoraConfig(rank=2, alpha=6, target_modules=TARGETS), rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype)
  out = str(tmp_path_factory.mktemp("vision_peft_export"))
  peft_io.save_adapter(model, out, path)
  return model, out


@pytest.fixture(scope="module")
def inputs():
  """Two prompts without padding: one image of 6 soft tokens, and one of 1 soft token; a random canvas each."""
  rng = np.random.default_rng(1)
  pixels, positions = vr.images(rng, [(4, 6), (2, 2)], max_soft_tokens=8)
  ids = np.asarray([[5, *vr.image_tokens(6), 7], [*vr.image_tokens(1), 8, 9, 10, 11, 12, 13, 14]], np.int64)
  canvas = rng.integers(3, 120, size=(2, vr.CANVAS))
  return ids, canvas, pixels, positions


def _ours(model, inputs) -> np.ndarray:
  ids, canvas, pixels, positions = inputs
  return np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            pixel_values=pixels, image_position_ids=positions.astype(np.int32)))


def _theirs(model, inputs) -> np.ndarray:
  ids, canvas, pixels, positions = inputs
  with torch.no_grad():
    return model.eval()(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                        pixel_values=torch.tensor(pixels), image_position_ids=torch.tensor(positions)).logits.numpy()


def _hf(path: str):
  from transformers import DiffusionGemmaForBlockDiffusion

  return DiffusionGemmaForBlockDiffusion.from_pretrained(path)


def _without_vision_adapters(model):
  """A copy of `model` whose vision adapters are zero (the text adapters kept)."""
  copy = nnx.clone(model)
  for path, v in nnx.to_flat_state(nnx.state(copy, nnx.LoRAParam)):
    if str(path[0]) in ("vision_tower", "embed_vision"):
      v.value = jnp.zeros_like(v.value)
  return copy


def test_export_uses_peft_names_and_gives_our_logits_with_images(base, adapted, inputs):
  path, ours = base
  model, out = adapted
  saved = set(load_file(f"{out}/{peft_io.ADAPTER_WEIGHTS_NAME}"))
  config = json.load(open(f"{out}/{peft_io.ADAPTER_CONFIG_NAME}", encoding="utf-8"))
  # peft, given our target_modules regex, wraps exactly the modules we wrote, under the same names
  wrapped = peft.get_peft_model(_hf(path), peft.LoraConfig(r=2, lora_alpha=6, target_modules=config["target_modules"]))
  assert set(peft.get_peft_model_state_dict(wrapped)) == saved
  vision = sorted(k for k in saved if ".vision_tower." in k or ".embed_vision." in k)
  assert len(vision) == 2 * (2 * 7 + 2)  # 2 layers x 7 projections, input_proj, the projector; A and B, once each
  assert "base_model.model.model.encoder.vision_tower.encoder.layers.1.self_attn.q_proj.linear.lora_A.weight" in vision
  assert "base_model.model.model.encoder.embed_vision.embedding_projection.lora_B.weight" in vision
  assert "base_model.model.model.encoder.vision_tower.patch_embedder.input_proj.lora_A.weight" in vision
  names = [n for n, _ in wrapped.named_modules()]
  adapted_names = {k.rsplit(".lora_", 1)[0][len("base_model.model."):] for k in saved}
  assert {n[len("base_model.model."):] for n in names if re.fullmatch(config["target_modules"],
                                                                      n[len("base_model.model."):])} == adapted_names
  mine = _ours(model, inputs)
  scale = np.abs(mine).max()
  theirs = _theirs(peft.PeftModel.from_pretrained(_hf(path), out), inputs)
  diff = np.abs(mine - theirs).max()
  print(f"peft vs ours, vision + text LoRA: max |diff| {diff:.3g} (logit scale {scale:.3g})")
  assert diff <= 1e-4 * scale
  # the vision adapters take part: without them (text adapters alone) the logits move
  assert np.abs(mine - _ours(_without_vision_adapters(model), inputs)).max() > 1e-2 * scale


def test_export_reads_back_into_identical_adapters(base, adapted):
  _, ours = base
  model, out = adapted
  loaded = peft_io.load_adapter(ours, out)
  want = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  got = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(loaded, nnx.LoRAParam))}
  assert want.keys() == got.keys() and any(str(p[0]) == "embed_vision" for p in got)
  for p in want:
    np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
  assert isinstance(loaded.vision_tower.encoder.layers[0].mlp.up_proj, lora.LoRAClippableLinear)


def test_merged_export_folds_vision_adapters_for_plain_transformers(adapted, inputs, tmp_path):
  model, _ = adapted
  out = str(tmp_path / "merged")
  export.export_merged(model, out, dtype="float32")
  from transformers import DiffusionGemmaForBlockDiffusion

  loaded, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
  assert not any(info.values()), info  # 0 missing / unexpected / mismatched keys
  mine = _ours(model, inputs)
  scale = np.abs(mine).max()
  diff = np.abs(_theirs(loaded, inputs) - mine).max()
  print(f"merged export in transformers vs ours: max |diff| {diff:.3g} (logit scale {scale:.3g})")
  assert diff <= 1e-4 * scale
  assert np.abs(_ours(_without_vision_adapters(model), inputs) - mine).max() > 1e-2 * scale
