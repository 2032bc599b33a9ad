"""LoRA on the vision tower and its projector: selected only by entries naming them, the update added between the
clamps of a clipped projection (peft wrapping transformers' inner `nn.Linear`), folded in by `merge`, and a target
that matches nothing is the usual one-line error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import vision_reference as vr
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.vision_config import VisionConfig
from hackable_diffusion.model.vision_layers import ClippableLinear

pytestmark = pytest.mark.usefixtures("shared_xla_cache")
LAYER_LINEARS = 7  # q/k/v/o and gate/up/down of each vision encoder layer


@pytest.fixture(scope="module")
def model():
  config = get_preset("tiny", vocab_size=vr.VOCAB, vision=VisionConfig.from_hf(vr.VISION), image_token_id=vr.IMAGE,
                      boi_token_id=vr.BOI, eoi_token_id=vr.EOI)
  return hd.DiffusionGemma(config, rngs=nnx.Rngs(0))


def _vision(names) -> list[str]:
  return [n for n in names if n.startswith(("vision_tower.", "embed_vision."))]


def test_vision_targets_are_selected_only_when_named(model):
  layers = model.config.vision.num_hidden_layers
  assert len(_vision(lora.targetable(model))) == layers * LAYER_LINEARS + 2
  for text_only in (lora.DEFAULT_TARGETS, "all-linear", ["q_proj", "v_proj", "down_proj"], [r"self_attn\.q_proj$"]):
    chosen = lora.resolve_targets(model, lora.LoraConfig(target_modules=text_only))
    assert chosen and not _vision(chosen), text_only
  chosen = lora.resolve_targets(model, lora.LoraConfig(target_modules=lora.DEFAULT_TARGETS + lora.VISION_TARGETS))
  assert len(_vision(chosen)) == layers * LAYER_LINEARS + 2
  assert _vision(lora.resolve_targets(model, lora.LoraConfig(target_modules=["embed_vision"]))) == [
      "embed_vision.embedding_projection"]
  assert len(lora.resolve_targets(model, lora.LoraConfig(target_modules=["vision_tower"]))) == layers * 7 + 1


def test_a_target_matching_nothing_is_one_line(model):
  for bad in ([r"^vision_tower\.encoder\.layers\.\d+\.self_attn\.qq_proj$"], ["vision_tower.nothing"]):
    with pytest.raises(ConfigError, match=r"^LoraConfig.target_modules (regex|module name) .* matches no module; "
                                          r"valid paths look like .*vision_tower\.") as info:
      lora.apply_lora(model, lora.LoraConfig(target_modules=bad), rngs=nnx.Rngs(0))
    assert "\n" not in str(info.value)
  text_only = hd.DiffusionGemma(model.config.replace(vision=None), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=r"^LoraConfig.target_modules module name 'embed_vision' matches no module"):
    lora.apply_lora(text_only, lora.LoraConfig(target_modules=["embed_vision"]), rngs=nnx.Rngs(0))


def test_update_is_added_between_the_clamps():
  """peft wraps transformers' inner `nn.Linear`: clip_out(clip_in(x) @ W + scale * clip_in(x) @ A @ B)."""
  with nnx.use_eager_sharding(False):
    base = ClippableLinear(6, 5, (None, None), clipped=True, rngs=nnx.Rngs(0), dtype=jnp.float32,
                           param_dtype=jnp.float32, std=0.5)
  base.input_min[...], base.input_max[...] = jnp.asarray(-0.5), jnp.asarray(0.7)
  base.output_min[...], base.output_max[...] = jnp.asarray(-0.4), jnp.asarray(0.3)
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((6, 2)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32)
  wrapped = lora.LoRAClippableLinear(base, lora_a=jnp.asarray(a), lora_b=jnp.asarray(b), scale=1.5)
  x = 2 * rng.standard_normal((3, 4, 6)).astype(np.float32)
  xc = np.clip(x, -0.5, 0.7)
  want = np.clip(xc @ np.asarray(base.kernel[...]) + 1.5 * xc @ a @ b, -0.4, 0.3)
  got = np.asarray(wrapped(jnp.asarray(x)))
  np.testing.assert_allclose(got, want, atol=1e-5)
  outside = np.clip(xc @ np.asarray(base.kernel[...]), -0.4, 0.3) + 1.5 * xc @ a @ b
  assert np.abs(got - outside).max() > 0.1  # the clamps bind: adding the update after them would differ


def test_merge_folds_vision_adapters_into_plain_layers(model):
  adapted = lora.apply_lora(model, lora.LoraConfig(rank=2, target_modules=lora.VISION_TARGETS), rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)):
    v.value = jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype)
  merged = lora.merge(adapted)
  assert not lora.has_lora(merged) and type(merged.vision_tower.encoder.layers[0].self_attn.q_proj) is ClippableLinear
  assert {p for p, _ in nnx.to_flat_state(nnx.state(merged))} == {p for p, _ in nnx.to_flat_state(nnx.state(model))}
  pixels, positions = vr.images(rng, [(4, 6), (2, 2)], max_soft_tokens=8)
  features = jax.jit(lambda m, p, q: m.image_features(p, q)[0])
  args = jnp.asarray(pixels), jnp.asarray(positions, jnp.int32)
  want, got = np.asarray(features(adapted, *args)), np.asarray(features(merged, *args))
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 1e-5 * scale
  assert np.abs(np.asarray(features(model, *args)) - want).max() > 1e-2 * scale  # the adapters changed the tower
