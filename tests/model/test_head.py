"""The vocabulary-tiled output head (`hackable_diffusion.model.head`) and the tiled SFT loss.

Values and gradients are compared with plain autodiff of the untiled formulas (log_softmax / softmax over whole
`[B, L, V]` logits), and the compiled loss's temporary memory at the released vocabulary is compared with the
untiled loss's (XLA memory analysis on abstract shapes: nothing is allocated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss, draw_noise, uniform_elbo_integrand
from hackable_diffusion.model import head
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model

B, L, H, V = 3, 11, 16, 40
CAP = 30.0


def _inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(0, 1, (B, L, H)), jnp.float32)
  embed = jnp.asarray(rng.normal(0, 0.8, (V, H)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
  weights = jnp.asarray(rng.uniform(0, 2, (B, L)), jnp.float32)
  return hidden, embed, targets, weights


def _plain_logits(hidden, embed):
  return jnp.tanh((hidden @ embed.T) / CAP) * CAP


@pytest.mark.parametrize("tile", [1, 4, L])  # 4 does not divide L: the last tile is padded
def test_cross_entropy_value_argmax_and_gradients_equal_autodiff(tile):
  hidden, embed, targets, weights = _inputs()
  spec = head.HeadSpec(jnp.dtype("float32"), CAP, tile)

  def tiled(h, w):
    ce, pred = head.cross_entropy(h, w, targets, spec)
    return jnp.sum(ce * weights), pred

  def plain(h, w):
    logp = jax.nn.log_softmax(_plain_logits(h, w), axis=-1)
    ce = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(ce * weights), jnp.argmax(logp, axis=-1)

  (v1, p1), g1 = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1), has_aux=True))(hidden, embed)
  (v2, p2), g2 = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(hidden, embed)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(p1), np.asarray(p2))
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_positionwise_elbo_and_its_gradients_equal_autodiff():
  hidden, embed, targets, weights = _inputs(1)
  noisy = jnp.roll(targets, 1, axis=1)
  alpha = jnp.asarray([0.2, 0.5, 0.9], jnp.float32)
  dalpha = -jnp.ones((B,), jnp.float32)
  spec = head.HeadSpec(jnp.dtype("float32"), CAP, 3)
  per_row = lambda x: jnp.broadcast_to(x[:, None], (B, L))  # noqa: E731

  def tiled(h, w):
    out = head.positionwise(lambda z, c, n, a, d: uniform_elbo_integrand(z, c, n, a[:, 0], d[:, 0]), h, w, spec,
                            targets, noisy, per_row(alpha), per_row(dalpha))
    return jnp.sum(out * weights)

  def plain(h, w):
    return jnp.sum(uniform_elbo_integrand(_plain_logits(h, w), targets, noisy, alpha, dalpha) * weights)

  v1, g1 = jax.value_and_grad(tiled, argnums=(0, 1))(hidden, embed)
  v2, g2 = jax.value_and_grad(plain, argnums=(0, 1))(hidden, embed)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_soft_embeddings_equal_the_models_and_pass_the_embedding_gradient():
  """The self-conditioning input: probabilities from a stopped previous pass; `probs @ embed` keeps the embedding's
  gradient (as `DiffusionGemma.soft_embeddings(stop_gradient(logits))`)."""
  hidden, embed, _, _ = _inputs(2)
  spec = head.HeadSpec(jnp.dtype("float32"), CAP, 4)
  cot = jnp.asarray(np.random.default_rng(5).normal(0, 1, (B, L, H)), jnp.float32)

  def tiled(h, w):
    return jnp.sum(head.soft_embeddings(h, w, spec) * cot)

  def plain(h, w):
    probs = jax.nn.softmax(jax.lax.stop_gradient(_plain_logits(h, w)), axis=-1)
    return jnp.sum((probs @ w) * np.sqrt(H) * cot)

  v1, (gh1, gw1) = jax.value_and_grad(tiled, argnums=(0, 1))(hidden, embed)
  v2, (gh2, gw2) = jax.value_and_grad(plain, argnums=(0, 1))(hidden, embed)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  assert not np.any(np.asarray(gh1)) and not np.any(np.asarray(gh2))
  assert np.abs(np.asarray(gw2)).max() > 0
  np.testing.assert_allclose(np.asarray(gw1), np.asarray(gw2), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(gw2)).max())


def test_tile_positions_bounds_a_tile_of_logits():
  assert head.tile_positions(8, 256, 262_144, 256) == 32  # 8 x 32 x 262144 x 4 B = 256 MiB
  assert head.tile_positions(8, 256, 262_144, 0) == 256  # 0: untiled
  assert head.tile_positions(2, 81, 64, 256) == 81  # a small vocabulary: one tile
  assert head.tile_positions(64, 256, 262_144, 1) == 1  # never below one position


# ---- the whole SFT loss, tiled vs untiled ------------------------------------------------------------------------
C, P, N = 4, 5, 3


def _batch(vocab: int, b: int = 4):
  rng = np.random.default_rng(0)
  prompt_mask = np.arange(P)[None] >= (P - np.array([5, 3, 2, 4][:b]))[:, None]
  comp_mask = np.arange(N * C)[None] < np.array([12, 5, 9, 1][:b])[:, None]
  return SFTBatch(prompt_ids=jnp.asarray(np.where(prompt_mask, rng.integers(3, vocab, (b, P)), 0), jnp.int32),
                  prompt_mask=jnp.asarray(prompt_mask),
                  completion_ids=jnp.asarray(np.where(comp_mask, rng.integers(3, vocab, (b, N * C)), 0), jnp.int32),
                  completion_mask=jnp.asarray(comp_mask))


@pytest.fixture(scope="module")
def small_model():
  return init_model(get_preset("tiny", vocab_size=64, canvas_length=C), seed=0)


@pytest.mark.parametrize("variant", ["flat", pytest.param("elbo", marks=pytest.mark.slow)])  # 'corrupted' = flat's tiled CE, other mask (test_loss.py)
def test_tiled_loss_value_and_gradients_equal_the_untiled_loss(small_model, variant):
  from flax import nnx
  batch = _batch(64)
  graphdef, params = nnx.split(small_model)
  key = jax.random.key(3)
  results = []
  for tile_mib in (0.0, 1e-6):  # untiled; one position per tile
    config = LossConfig(variant=variant, self_conditioning_prob=0.5, encoder_ar_weight=0.7, logits_tile_mib=tile_mib)
    noise = draw_noise(key, batch, C, 64, config)

    def loss(p, noise=noise, config=config):
      return diffusion_loss(nnx.merge(graphdef, p), batch, key, config, noise=noise)

    results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
  ((l0, m0), g0), ((l1, m1), g1) = results
  assert 0 < int(np.asarray(noise.use_sc).sum()) < 4  # both self-conditioning branches
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
  assert float(m1["accuracy"]) == float(m0["accuracy"])
  leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
  scale = max(float(jnp.abs(x).max()) for x in leaves0)
  assert scale > 0
  for a, b in zip(leaves0, leaves1):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6 * scale)


def _compiled_temp_bytes(tile_mib: float) -> int:
  """Temporary bytes of the compiled gradient of the loss at the released vocabulary (262,144), batch 8, canvas 256,
  a 1-layer hidden-64 model (abstract shapes: compiled, never run)."""
  from flax import nnx
  cfg = get_preset("tiny", vocab_size=262_144, canvas_length=256, num_hidden_layers=1,
                   layer_types=("full_attention",))
  abstract = nnx.eval_shape(lambda: DiffusionGemma(cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  config = LossConfig(logits_tile_mib=tile_mib)
  b, p, w = 8, 256, 256
  batch = SFTBatch(prompt_ids=jax.ShapeDtypeStruct((b, p), jnp.int32), prompt_mask=jax.ShapeDtypeStruct((b, p), bool),
                   completion_ids=jax.ShapeDtypeStruct((b, w), jnp.int32),
                   completion_mask=jax.ShapeDtypeStruct((b, w), bool))

  def grads(params, batch, key):
    return jax.grad(lambda q: diffusion_loss(nnx.merge(graphdef, q), batch, key, config)[0])(params)

  compiled = jax.jit(grads).lower(params, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_tiled_loss_needs_under_a_quarter_of_the_untiled_temporaries():
  untiled, tiled = _compiled_temp_bytes(0.0), _compiled_temp_bytes(256.0)
  logits_bytes = 8 * 256 * 262_144 * 4  # one fp32 [B, C, V] tensor: 2 GiB
  assert untiled > 2 * logits_bytes  # the untiled loss keeps several
  assert tiled < 0.25 * untiled, (tiled / 2**20, untiled / 2**20)


def test_models_soft_embeddings_over_tiles_equal_the_plain_computation(small_model):
  """The sampler's self-conditioning input at a large vocabulary: tiles of positions (1e-6 MiB: one position per
  tile) give the plain `softmax(logits) @ embed * sqrt(H)`."""
  z = jnp.asarray(np.random.default_rng(4).normal(0, 3, (2, 5, 64)), jnp.float32)
  plain = small_model.soft_embeddings(z, tile_mib=0.0)
  tiled = small_model.soft_embeddings(z, tile_mib=1e-6)
  w = np.asarray(small_model.embed_tokens[...])
  ref = (np.asarray(jax.nn.softmax(z, axis=-1)) @ w) * np.sqrt(w.shape[1])
  np.testing.assert_allclose(np.asarray(plain), ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(tiled), ref, rtol=1e-5, atol=1e-6)
