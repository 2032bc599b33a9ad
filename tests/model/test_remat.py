"""Per-layer rematerialisation (`ModelConfig.remat`): same gradients as no remat, smaller compiled temporaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss, draw_noise
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora.adapters import LoraConfig, apply_lora, set_dropout_key
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model

LAYERS = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")


def _config(remat: str, layer_types=LAYERS, **kw):
  return get_preset("tiny", num_hidden_layers=len(layer_types), layer_types=layer_types, remat=remat, **kw)


def _batch(b, p, w, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, vocab, (b, p)), jnp.int32),
                  prompt_mask=jnp.ones((b, p), bool),
                  completion_ids=jnp.asarray(rng.integers(3, vocab, (b, w)), jnp.int32),
                  completion_mask=jnp.asarray(np.arange(w)[None] < rng.integers(1, w + 1, (b, 1))))


def _grad_fn(graphdef, config, batch, key, noise=None):
  def loss(params):
    return diffusion_loss(nnx.merge(graphdef, params), batch, key, config, noise=noise)[0]
  return jax.value_and_grad(loss)


@pytest.mark.slow  # remat gradients stay in the default tier through tests/model/test_scan.py's linked passes
def test_remat_gradients_equal_no_remat_with_lora_dropout():
  """'nothing_saveable' (recomputed in the backward pass) gives the loss and gradients of the plain model, also
  through LoRA adapters with dropout (an integer key in the layer state)."""
  out = {}
  batch = _batch(3, 5, 8, 64)
  key = jax.random.key(1)
  loss_cfg = LossConfig()
  noise = draw_noise(key, batch, 4, 64, loss_cfg)
  for remat in ("none", "nothing_saveable"):
    model = init_model(_config(remat, LAYERS[2:], vocab_size=64, canvas_length=4), seed=0)
    model = apply_lora(model, LoraConfig(rank=2, dropout=0.3), rngs=nnx.Rngs(0))
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    rest = set_dropout_key(rest, jax.random.key(7))

    def loss(lora, rest=rest, graphdef=graphdef):
      return diffusion_loss(nnx.merge(graphdef, lora, rest), batch, key, loss_cfg, noise=noise)[0]

    out[remat] = jax.jit(jax.value_and_grad(loss))(lora)
  (l0, g0), (l1, g1) = out["none"], out["nothing_saveable"]
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0))
  assert scale > 0
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):  # fp32 rounding of a differently fused recompute
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * scale)


def _temp_bytes(remat: str) -> int:
  cfg = _config(remat, vocab_size=256, canvas_length=32, hidden_size=128, intermediate_size=256,
                moe_intermediate_size=64)
  graphdef, params = nnx.split(nnx.eval_shape(lambda: DiffusionGemma(cfg, rngs=nnx.Rngs(0))))
  b, p, w = 2, 32, 64
  batch = SFTBatch(prompt_ids=jax.ShapeDtypeStruct((b, p), jnp.int32), prompt_mask=jax.ShapeDtypeStruct((b, p), bool),
                   completion_ids=jax.ShapeDtypeStruct((b, w), jnp.int32),
                   completion_mask=jax.ShapeDtypeStruct((b, w), bool))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  fn = lambda params, batch, key: _grad_fn(graphdef, LossConfig(), batch, key)(params)  # noqa: E731
  return jax.jit(fn).lower(params, batch, key).compile().memory_analysis().temp_size_in_bytes


def test_remat_shrinks_the_compiled_temporaries():
  """Compiled on this CPU (whose XLA drops `jax.checkpoint`'s barriers: see model/remat.py): the 4-layer model's
  gradient keeps far less with per-layer recomputation."""
  none, full = _temp_bytes("none"), _temp_bytes("nothing_saveable")
  assert full < 0.6 * none, (full, none)


def test_unknown_policy_is_a_config_error():
  with pytest.raises(ConfigError, match="remat='everything'"):
    _config("everything")
