"""SamplingConfig: defaults, validation messages, resolve() and prompt buckets."""

import dataclasses
import math
import types

import pytest

from hackable_diffusion.sampling.config import SamplingConfig


def test_defaults_match_transformers():
  gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
  ref = gen.DiffusionGemmaGenerationConfig._get_default_generation_params()
  cfg = SamplingConfig()
  assert cfg.max_new_tokens == ref["max_new_tokens"]
  assert cfg.max_denoising_steps == ref["max_denoising_steps"]
  assert cfg.entropy_bound == ref["sampler_config"].entropy_bound
  for name in ("t_min", "t_max", "stability_threshold", "confidence_threshold"):
    assert getattr(cfg, name) == ref[name], name
  assert cfg.early_stopping and cfg.prompt_length_buckets[0] == 16


def test_frozen_and_keyword_only():
  cfg = SamplingConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.t_min = 0.1  # type: ignore[misc]
  with pytest.raises(TypeError):
    SamplingConfig(10)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_denoising_steps=-1), "max_denoising_steps"),
        (dict(max_denoising_steps=True), "max_denoising_steps"),
        (dict(entropy_bound=0.0), "entropy_bound"),
        (dict(entropy_bound=math.nan), "entropy_bound"),
        (dict(t_min=-0.1), "t_min"),
        (dict(t_max=0.0, t_min=0.0), "t_max"),
        (dict(t_min=0.9, t_max=0.8), "t_min"),
        (dict(t_max=math.inf), "t_max"),
        (dict(stability_threshold=-1), "stability_threshold"),
        (dict(stability_threshold=1.0), "stability_threshold"),
        (dict(confidence_threshold=0.0), "confidence_threshold"),
        (dict(confidence_threshold=-1.0), "confidence_threshold"),
        (dict(eos_token_id=-3), "eos_token_id"),
        (dict(eos_token_id=()), "eos_token_id"),
        (dict(eos_token_id="1"), "eos_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(canvas_length=0), "canvas_length"),
        (dict(early_stopping=1), "early_stopping"),
        (dict(prompt_length_buckets=(16, 8)), "prompt_length_buckets"),
        (dict(prompt_length_buckets=(0,)), "prompt_length_buckets"),
    ],
)
def test_validation_names_field_and_value(kwargs, field):
  with pytest.raises(ValueError) as info:
    SamplingConfig(**kwargs)
  msg = str(info.value)
  assert f"SamplingConfig.{field}=" in msg
  assert repr(kwargs[field]) in msg or field == "t_max"
  assert "\n" not in msg


def test_accepted_values():
  cfg = SamplingConfig(t_min=0.3, t_max=0.3, entropy_bound=math.inf, stability_threshold=0,
                       eos_token_id=[1, 2], confidence_threshold=1, prompt_length_buckets=[8, 32])
  assert cfg.eos_token_id == (1, 2) and cfg.eos_token_ids == (1, 2)
  assert cfg.prompt_length_buckets == (8, 32)
  assert SamplingConfig(eos_token_id=5).eos_token_ids == (5,)
  assert SamplingConfig().eos_token_ids == ()


def test_resolve_fills_from_model_config():
  model_cfg = types.SimpleNamespace(vocab_size=100, canvas_length=16, pad_token_id=0, eos_token_id=(1, 3))
  cfg = SamplingConfig().resolve(model_cfg)
  assert (cfg.canvas_length, cfg.pad_token_id, cfg.eos_token_id) == (16, 0, (1, 3))
  own = SamplingConfig(canvas_length=8, pad_token_id=7, eos_token_id=9).resolve(model_cfg)
  assert (own.canvas_length, own.pad_token_id, own.eos_token_id) == (8, 7, 9)
  with pytest.raises(ValueError, match="eos_token_id"):
    SamplingConfig(eos_token_id=100).resolve(model_cfg)
  with pytest.raises(ValueError, match="pad_token_id"):
    SamplingConfig(pad_token_id=123).resolve(model_cfg)


def test_num_canvases_and_buckets():
  cfg = SamplingConfig(max_new_tokens=17, canvas_length=8, prompt_length_buckets=(16, 32))
  assert cfg.num_canvases() == 3  # rounded up to whole canvases
  assert SamplingConfig(max_new_tokens=16).num_canvases(8) == 2
  assert [cfg.bucket_prompt_length(n) for n in (1, 16, 17, 32, 33, 70)] == [16, 16, 32, 32, 64, 96]
  assert SamplingConfig(prompt_length_buckets=()).bucket_prompt_length(13) == 13
  with pytest.raises(ValueError, match="canvas_length"):
    SamplingConfig().num_canvases()
