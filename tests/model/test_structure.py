"""Attention structure as a mechanism: a mask function named by 'module:function' (here one defined in tests/),
validated when the config is built, and applied to canvas-to-canvas attention by the model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import structure
from hackable_diffusion.model.config import ModelConfig, get_preset
from hackable_diffusion.model.transformer import init_model


def test_a_structure_defined_outside_the_library_changes_the_logits_as_its_mask_says():
  """With 'custom_components:self_only' each canvas position attends only to itself (and the prompt): changing
  one canvas token moves only that position's logits; with plain attention it moves every position's."""
  base = get_preset("tiny", vocab_size=32)
  plain = init_model(base, seed=0)
  masked = init_model(base.replace(attention_structure="custom_components:self_only"), seed=0)
  prompt = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
  canvas = np.asarray([[3, 4, 9, 10, 11, 12, 13, 14]], np.int32)
  other = canvas.copy()
  other[0, 2] = 20

  def change(model):
    a = np.asarray(model(prompt, jnp.asarray(canvas)))
    b = np.asarray(model(prompt, jnp.asarray(other)))
    return np.abs(a - b).max(axis=-1)[0]  # [C]: how much each position's logits moved

  moved = change(masked)
  assert moved[2] > 1e-3
  np.testing.assert_array_less(np.delete(moved, 2), 1e-5)
  assert (np.delete(change(plain), 2) > 1e-4).all()
  # the two models share their parameters (same seed): the mask is the only difference
  mask = structure.canvas_mask(masked.config)
  assert mask.shape == (1, 1, 8, 8) and (mask[0, 0] == np.eye(8, dtype=bool)).all()


def test_a_structure_over_the_prompt_hides_the_prompt_slots_it_masks():
  """'custom_components:self_only_with_prompt_slot': canvas position i sees itself and, for i < 4, prompt slot i.
  The encoder is causal, so changing prompt token 2 changes the cached keys/values of slots 2 and 3 (from the
  second layer on): only canvas positions 2 and 3 move. With the prompt fully visible every position moves."""
  base = get_preset("tiny", vocab_size=32)
  prompt_masked = init_model(base.replace(attention_structure="custom_components:self_only_with_prompt_slot"), seed=0)
  canvas_only = init_model(base.replace(attention_structure="custom_components:self_only"), seed=0)
  canvas = jnp.asarray([[3, 4, 9, 10, 11, 12, 13, 14]], jnp.int32)
  prompt = np.asarray([[5, 6, 7, 8]], np.int32)
  other = prompt.copy()
  other[0, 2] = 20

  def change(model):  # reads `prompt` / `other` when called
    a = np.asarray(model(jnp.asarray(prompt), canvas))
    b = np.asarray(model(jnp.asarray(other), canvas))
    return np.abs(a - b).max(axis=-1)[0]  # [C]

  moved = change(prompt_masked)
  assert (moved[[2, 3]] > 1e-3).all()
  np.testing.assert_array_less(moved[[0, 1, 4, 5, 6, 7]], 1e-5)
  assert (change(canvas_only) > 1e-4).all()
  # slots past the structure's 4 stay visible to every position: a 6-token prompt whose last token changes moves all
  prompt, other = np.asarray([[5, 6, 7, 8, 9, 10]], np.int32), np.asarray([[5, 6, 7, 8, 9, 20]], np.int32)
  assert (change(prompt_masked) > 1e-4).all()
  mask = structure.canvas_mask(prompt_masked.config)
  assert mask.shape == (1, 1, 8, 12) and (mask[0, 0, :, 4:] == np.eye(8, dtype=bool)).all()


def test_a_structure_over_more_prompt_slots_than_the_cache_holds_is_a_one_line_error():
  model = init_model(get_preset("tiny", vocab_size=32, attention_structure="custom_components:self_only_with_prompt_slot"))
  with pytest.raises(ConfigError, match="constrains 4 prompt slots but the cache holds 3") as err:
    model(jnp.asarray([[5, 6, 7]], jnp.int32), jnp.zeros((1, 8), jnp.int32))
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec,match", [
    ("custom_components:empty_row", "leaves a canvas position with no canvas key"),
    ("custom_components:wrong_shape", r"returned shape \(8, 8\); expected \(1 or 4, 8, P \+ 8\)"),
    ("custom_components:NOT_CALLABLE", "is a str, not a function"),
    ("custom_components:nope", "has no attribute 'nope'"),
    ("no_such_module_xyz:mask", "cannot import no_such_module_xyz"),
    ("peers", "expected None or 'package.module:function'"),
])
def test_bad_structures_fail_when_the_config_is_built(spec, match):
  with pytest.raises(ConfigError, match=match) as err:
    get_preset("tiny", attention_structure=spec)
  assert "\n" not in str(err.value) and "ModelConfig.attention_structure" in str(err.value)


def test_no_structure_is_plain_attention():
  assert structure.canvas_mask(ModelConfig()) is None
