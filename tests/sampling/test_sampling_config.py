"""SamplingConfig: defaults, validation messages, resolve() and prompt buckets."""

import dataclasses
import math
import types

import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import rules
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
        (dict(self_conditioning="no"), "self_conditioning"),
        (dict(prompt_length_buckets=(16, 8)), "prompt_length_buckets"),
        (dict(prompt_length_buckets=(0,)), "prompt_length_buckets"),
        (dict(acceptance="nope"), "acceptance"),
        (dict(acceptance=3), "acceptance"),
        (dict(acceptance="no_such_module_xyz:Rule"), "acceptance"),
        (dict(acceptance="math:NoSuchRule"), "acceptance"),
        (dict(acceptance="math:pi"), "acceptance"),  # not callable
        (dict(acceptance="builtins:dict"), "acceptance"),  # returns something that is not a rule
        (dict(acceptance="top_k", acceptance_args={"kk": 2}), "acceptance_args"),
        (dict(acceptance="top_k", acceptance_args={"k": 0}), "acceptance_args"),
        (dict(acceptance="confidence_threshold", acceptance_args={"threshold": 1.5}), "acceptance_args"),
        (dict(acceptance_args={"bound": -1.0}), "acceptance_args"),
        (dict(acceptance_args={"bound": {"a": 1}}), "acceptance_args"),  # unhashable value
        (dict(acceptance_args=[1, 2]), "acceptance_args"),
    ],
)
def test_validation_names_field_and_value(kwargs, field):
  with pytest.raises(ConfigError) as info:  # a ValueError
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


def test_acceptance_rule_from_the_config():
  assert SamplingConfig().acceptance_rule() == rules.EntropyBound(0.1)  # transformers' setting, by its name
  assert SamplingConfig(entropy_bound=0.5).acceptance_rule() == rules.EntropyBound(0.5)
  assert SamplingConfig(acceptance_args={"bound": 0.2}).acceptance_rule() == rules.EntropyBound(0.2)
  cfg = SamplingConfig(acceptance="top_k", acceptance_args={"k": 3})
  assert cfg.acceptance_rule() == rules.TopK(3) and cfg.acceptance_args == (("k", 3),)
  assert cfg == SamplingConfig(acceptance="top_k", acceptance_args=(("k", 3),)) and hash(cfg) == hash(
      SamplingConfig(acceptance="top_k", acceptance_args=(("k", 3),)))  # frozen, hashable: a dict is stored sorted
  assert SamplingConfig(acceptance="confidence_threshold").acceptance_rule() == rules.ConfidenceThreshold(0.9)
  spec = SamplingConfig(acceptance="hackable_diffusion.sampling.rules:TopK", acceptance_args={"k": 2})
  assert spec.acceptance_rule() == rules.TopK(2)
  with pytest.raises(ConfigError, match=r"^SamplingConfig.acceptance_args=\{\} is invalid for acceptance='top_k'"):
    SamplingConfig(acceptance="top_k")  # k is required
  assert hash(rules.TopK(3)) == hash(rules.TopK(3)) and rules.TopK(3) != rules.TopK(4)  # by value


def test_from_dict():
  values = dict(max_new_tokens=64, max_denoising_steps=16, entropy_bound=0.2, t_min=0.1, t_max=0.5,
                stability_threshold=2, confidence_threshold=0.01, early_stopping=False, canvas_length=32,
                eos_token_id=[1, 106], pad_token_id=0, prompt_length_buckets=[32, 64], acceptance="top_k",
                acceptance_args={"k": 4})
  cfg = SamplingConfig.from_dict(values)
  assert cfg.eos_token_id == (1, 106) and cfg.prompt_length_buckets == (32, 64)
  assert cfg.acceptance_rule() == rules.TopK(4)
  assert SamplingConfig.from_dict({}) == SamplingConfig()
  with pytest.raises(ConfigError, match=r"unknown key\(s\) \['bogus', 'temperature'\]") as info:
    SamplingConfig.from_dict(dict(temperature=1.0, bogus=1, t_min=0.1))
  assert "\n" not in str(info.value) and "max_new_tokens" in str(info.value)
  with pytest.raises(ConfigError, match="SamplingConfig.t_min="):
    SamplingConfig.from_dict(dict(t_min=-1.0))
