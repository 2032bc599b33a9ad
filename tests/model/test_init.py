"""`init_model`: the parameters of `DiffusionGemma(config, rngs=nnx.Rngs(seed))` (bit for bit as compiled for that seed,
to rounding as run eagerly), from one compiled initialiser per config (reused across seeds and calls), each call an
independent model."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model

CONFIG = get_preset("tiny", num_hidden_layers=2, vocab_size=48, canvas_length=6)


def _params(model) -> dict:
  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_init_model_equals_the_model_built_by_its_constructor_for_every_seed():
  """Against the constructor compiled for that seed alone (bit for bit: the same program with the seed as a
  constant) and run eagerly op by op (to rounding: XLA fuses the initialisers' arithmetic differently)."""
  for seed in (0, 3):  # the second seed runs the first seed's compiled initialiser
    compiled = jax.jit(lambda seed=seed: nnx.split(DiffusionGemma(CONFIG, rngs=nnx.Rngs(seed)))[1])()
    want = _params(nnx.merge(nnx.split(nnx.eval_shape(lambda: DiffusionGemma(CONFIG, rngs=nnx.Rngs(0))))[0],
                             compiled))
    eager = _params(DiffusionGemma(CONFIG, rngs=nnx.Rngs(seed)))
    got = _params(init_model(CONFIG, seed=seed))
    assert got.keys() == want.keys() == eager.keys() and len(want) > 10
    for path, w in want.items():
      np.testing.assert_array_equal(got[path], w, err_msg=str(path))
      np.testing.assert_allclose(got[path], eager[path], rtol=1e-6, atol=1e-8, err_msg=str(path))
  embed = ("embed_tokens",)
  assert not np.array_equal(_params(init_model(CONFIG, 0))[embed], _params(init_model(CONFIG, 3))[embed])


def test_models_from_one_initialiser_are_independent():
  a, b = init_model(CONFIG, seed=1), init_model(CONFIG, seed=1)
  before = _params(b)
  for _, v in nnx.to_flat_state(nnx.state(a, nnx.Param)):
    v.set_value(jnp.zeros_like(v.get_value()))
  assert all(np.abs(x).max() == 0 for x in _params(a).values())
  for path, x in _params(b).items():
    np.testing.assert_array_equal(x, before[path], err_msg=str(path))
  assert jax.tree.structure(nnx.state(a)) == jax.tree.structure(nnx.state(b))


def test_a_second_model_of_a_config_is_not_traced_again():
  """The constructor runs (is traced) for the first model of a config only; another seed reuses the compiled
  initialiser."""
  config = get_preset("tiny", num_hidden_layers=2, vocab_size=40, canvas_length=5)  # a config no other test builds
  calls = []
  real_init = DiffusionGemma.__init__

  def counting_init(self, *args, **kwargs):
    calls.append(1)
    real_init(self, *args, **kwargs)

  with mock.patch.object(DiffusionGemma, "__init__", counting_init):
    init_model(config, seed=0)
    first = len(calls)
    b = init_model(config, seed=4)
  assert first >= 1 and len(calls) == first, (first, len(calls))
  np.testing.assert_array_equal(_params(b)[("embed_tokens",)], _params(init_model(config, seed=4))[("embed_tokens",)])
