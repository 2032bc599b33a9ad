"""The SFT loss against an independent computation with transformers' model on the same weights and noise."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion import corruption
from hackable_diffusion.diffusion.loss import (LOSS_TERMS, CorruptedCrossEntropy, FlatCrossEntropy, LossConfig,
                                               UniformStateELBO, cross_entropy, diffusion_loss, draw_noise,
                                               masked_mean, top1_correct, uniform_elbo_integrand)
from hackable_diffusion.errors import ConfigError

C, P, N = 4, 5, 3  # canvas, prompt width, canvases per completion


@pytest.fixture(scope="module")
def setup(hf_factory):
  ref, path = hf_factory("loss_model", canvas=C, vocab=64,
                         layer_types=["sliding_attention", "full_attention", "full_attention"])
  ours = hd.load_pretrained(path)
  rng = np.random.default_rng(0)
  prompt_len = np.array([5, 3, 2, 4])
  comp_len = np.array([12, 5, 9, 1])
  b = len(prompt_len)
  prompt_mask = np.arange(P)[None] >= (P - prompt_len)[:, None]  # left padded
  comp_mask = np.arange(N * C)[None] < comp_len[:, None]
  prompt_ids = np.where(prompt_mask, rng.integers(3, 60, (b, P)), 0)
  comp_ids = np.where(comp_mask, rng.integers(3, 60, (b, N * C)), 0)
  batch = SFTBatch(prompt_ids=jnp.asarray(prompt_ids, jnp.int32), prompt_mask=jnp.asarray(prompt_mask),
                   completion_ids=jnp.asarray(comp_ids, jnp.int32), completion_mask=jnp.asarray(comp_mask))
  return ref, ours, batch


def _reference_loss(ref, batch: SFTBatch, noise, variant: str, ar_weight: float, sc_passes: int = 1):
  """Per example with transformers: encoder over prompt + clean completion; decoder over the noisy canvas, its
  self-conditioning input from `sc_passes` decoder passes (each later one self-conditioned on the one before)."""
  prompt_ids = torch.tensor(np.asarray(batch.prompt_ids), dtype=torch.long)
  prompt_mask = torch.tensor(np.asarray(batch.prompt_mask), dtype=torch.long)
  comp_ids = torch.tensor(np.asarray(batch.completion_ids), dtype=torch.long)
  comp_mask = torch.tensor(np.asarray(batch.completion_mask), dtype=torch.long)
  cap = ref.config.text_config.final_logit_softcapping
  # AR term: encoder hidden at t predicts token t+1 over the completion.
  ids = torch.cat([prompt_ids, comp_ids], 1)
  mask = torch.cat([prompt_mask, comp_mask], 1)
  with torch.no_grad():
    hidden = ref.model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = torch.tanh(ref.lm_head(hidden).float() / cap) * cap
  ar_logits = logits[:, P - 1: P + N * C - 1]
  ar_ce = F.cross_entropy(ar_logits.reshape(-1, ar_logits.shape[-1]), comp_ids.reshape(-1), reduction="none")
  ar = float((ar_ce * comp_mask.reshape(-1)).sum() / comp_mask.sum())
  # Diffusion term.
  ces, weights = [], []
  for i in range(ids.shape[0]):
    k = int(noise.canvas_index[i])
    prefix = ids[i: i + 1, : P + k * C]
    prefix_mask = mask[i: i + 1, : P + k * C]
    canvas = torch.tensor(np.asarray(noise.noisy[i: i + 1]), dtype=torch.long)
    dec_mask = torch.cat([prefix_mask, torch.ones(1, C, dtype=torch.long)], 1)
    with torch.no_grad():
      first = ref(input_ids=prefix, attention_mask=prefix_mask, decoder_input_ids=canvas,
                  decoder_attention_mask=dec_mask).logits
      for _ in range(sc_passes - 1):
        first = ref(input_ids=prefix, attention_mask=prefix_mask, decoder_input_ids=canvas,
                    decoder_attention_mask=dec_mask, self_conditioning_logits=first).logits
      sc = first if bool(noise.use_sc[i]) else None
      out = ref(input_ids=prefix, attention_mask=prefix_mask, decoder_input_ids=canvas,
                decoder_attention_mask=dec_mask, self_conditioning_logits=sc).logits
    clean = torch.tensor(np.asarray(noise.clean[i]), dtype=torch.long)
    ce = F.cross_entropy(out[0], clean, reduction="none").numpy()
    w = np.asarray(noise.valid[i])
    if variant == "corrupted":
      w = w & np.asarray(noise.corrupted[i])
    ces.append(ce)
    weights.append(w)
  ces, weights = np.stack(ces), np.stack(weights).astype(np.float64)
  diff = float((ces * weights).sum() / max(weights.sum(), 1.0))
  return diff, ar, diff + ar_weight * ar


# tile_mib=1e-6: one position per tile (the vocabulary-tiled head, hackable_diffusion.model.head); 0: untiled
# sc_passes: decoder passes computing the self-conditioning input (diffusion.self_conditioning_passes)
@pytest.mark.parametrize("variant,ar_weight,tile_mib,sc_passes", [
    ("flat", 0.7, 0.0, 1), ("corrupted", 0.7, 1e-6, 1), ("flat", 0.0, 0.0, 3), ("flat", 0.0, 1e-6, 2),
    # each option above in another combination: compiled again, no new path
    *(pytest.param(*p, marks=pytest.mark.slow) for p in [("corrupted", 0.7, 0.0, 1), ("flat", 0.0, 0.0, 1),
                                                         ("flat", 0.7, 1e-6, 1)])])
def test_loss_equals_transformers_computation(setup, variant, ar_weight, tile_mib, sc_passes):
  ref, ours, batch = setup
  # more passes: every row self-conditioned, where the passes' effect on this model is large (checked below)
  config = LossConfig(variant=variant, self_conditioning_prob=0.5 if sc_passes == 1 else 1.0,
                      encoder_ar_weight=ar_weight, logits_tile_mib=tile_mib, self_conditioning_passes=sc_passes)
  assert (ours.head_spec(4, C, tile_mib).tile == 1) == (tile_mib > 0)
  key = jax.random.key(3)
  noise = draw_noise(key, batch, C, 64, config)
  # the draw exercises several canvases, both self-conditioning branches, and corrupted + clean positions
  assert len(set(np.asarray(noise.canvas_index).tolist())) > 1
  assert 0 < int(np.asarray(noise.use_sc).sum()) < 4 if sc_passes == 1 else bool(np.asarray(noise.use_sc).all())
  loss, metrics = jax.jit(lambda b, n: diffusion_loss(ours, b, key, config, noise=n))(batch, noise)
  diff, ar, total = _reference_loss(ref, batch, noise, variant, ar_weight, sc_passes)
  if ar_weight:
    assert abs(float(metrics["ar_loss"]) - ar) <= 1e-4
  assert abs(float(metrics["diffusion_loss"]) - diff) <= 1e-4
  assert abs(float(loss) - total) <= 2e-4
  if sc_passes > 1:  # the tolerance separates the recipes: one pass fewer gives another loss
    assert abs(_reference_loss(ref, batch, noise, variant, ar_weight, sc_passes - 1)[0] - diff) > 1e-2


def test_canvas_choice_respects_completion_length(setup):
  _, _, batch = setup
  counts = np.zeros((4, N), int)
  for s in range(200):
    noise = draw_noise(jax.random.key(s), batch, C, 64, LossConfig())
    counts[np.arange(4), np.asarray(noise.canvas_index)] += 1
  # completion lengths 12, 5, 9, 1 -> 3, 2, 3, 1 valid canvases of 4
  np.testing.assert_array_equal(counts > 0, [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_the_time_floor_reaches_the_drawn_noise(setup):
  _, _, batch = setup
  ts = np.concatenate([np.asarray(draw_noise(jax.random.key(s), batch, C, 64, LossConfig(time_min=0.6)).t)
                       for s in range(50)])
  assert ts.min() >= 0.6 and ts.max() < 1.0
  # the same draws without a floor would fall below it about 60% of the time
  free = np.concatenate([np.asarray(draw_noise(jax.random.key(s), batch, C, 64, LossConfig()).t) for s in range(50)])
  assert (free < 0.6).mean() > 0.4


def _posterior(s: float, t: float, z: int, x: np.ndarray, n: int) -> np.ndarray:
  """q(z_s | z_t = z, x) for the uniform process with alpha = 1 - t, x a probability vector (brute force)."""
  a_s, a_t = 1 - s, 1 - t
  trans = (a_t / a_s) * np.eye(n) + (1 - a_t / a_s) / n  # q(z_t | z_s), rows z_s
  prior = a_s * x + (1 - a_s) / n
  num = trans[:, z] * prior
  return num / num.sum()


def test_elbo_integrand_is_the_continuous_time_kl_rate():
  """The ELBO integrand equals lim KL(q(z_s|z_t,x) || q(z_s|z_t,x_theta)) / (t - s), by finite differences."""
  jax.config.update("jax_enable_x64", True)
  try:
    rng = np.random.default_rng(0)
    n = 6
    cases = [(0, 0), (2, 2), (1, 4), (5, 3), (3, 0)]  # (clean, noisy) incl. noisy == clean
    for clean, noisy in cases:
      t = float(rng.uniform(0.05, 0.95))
      logits = 2.0 * rng.standard_normal(n)
      p = np.exp(logits) / np.exp(logits).sum()
      dt = 1e-6
      q_true = _posterior(t - dt, t, noisy, np.eye(n)[clean], n)
      q_model = _posterior(t - dt, t, noisy, p, n)
      rate = float(np.sum(q_true * np.log(q_true / q_model)) / dt)
      got = uniform_elbo_integrand(jnp.asarray(logits)[None, None], jnp.array([[clean]]), jnp.array([[noisy]]),
                                   jnp.array([1 - t]), jnp.array([-1.0]))
      assert abs(float(got[0, 0]) - rate) <= 1e-4 * max(1.0, rate), (clean, noisy, rate, float(got[0, 0]))
    # a perfect model has zero loss
    perfect = jnp.full((1, 1, n), -1e4).at[0, 0, 2].set(1e4)
    zero = uniform_elbo_integrand(perfect, jnp.array([[2]]), jnp.array([[4]]), jnp.array([0.5]), jnp.array([-1.0]))
    assert abs(float(zero[0, 0])) < 1e-6
  finally:
    jax.config.update("jax_enable_x64", False)


def test_elbo_variant_trains_a_finite_loss(setup):
  _, ours, batch = setup
  loss, metrics = jax.jit(lambda b: diffusion_loss(ours, b, jax.random.key(0), LossConfig(variant="elbo")))(batch)
  assert np.isfinite(float(loss)) and float(metrics["diffusion_loss"]) > 0


def test_loss_config_validation():
  for kwargs, match in (({"variant": "mse"}, "loss_variant='mse'; expected one of"),
                        ({"variant": "no_such_module_xyz:Term"}, "cannot import no_such_module_xyz"),
                        ({"variant": "custom_components:Nope"}, "has no attribute 'Nope'"),
                        ({"variant": "custom_components:NOT_CALLABLE"}, "is a str, not a class or function"),
                        ({"variant": "custom_components:not_a_task"}, "must return a LossTerm"),
                        ({"schedule": "cubic"}, "diffusion.schedule='cubic'"),
                        ({"time_min": 1.0}, "diffusion.time_min=1.0; expected a value in"),
                        ({"time_min": -0.2}, "diffusion.time_min=-0.2; expected a value in"),
                        ({"time_min": "0.3"}, "diffusion.time_min='0.3'; expected a number"),
                        ({"time_eps": None}, "diffusion.time_eps=None; expected a number"),
                        ({"self_conditioning_prob": 1.5}, "self_conditioning_prob=1.5"),
                        ({"self_conditioning_passes": 0}, "self_conditioning_passes=0; expected an integer"),
                        ({"encoder_gradients": "no"}, "encoder_gradients='no'; expected True or False"),
                        ({"encoder_gradients": False, "encoder_ar_weight": 0.5},
                         "encoder_gradients=False with encoder_ar_weight=0.5")):
    with pytest.raises(ConfigError, match=match) as err:
      LossConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_without_encoder_gradients_the_encoder_cache_is_a_constant(setup):
  """encoder_gradients=False: the gradient is the one of a loss whose encoder output was computed beforehand (a
  constant), and the loss value is unchanged. Compiled, as a training step runs it: the programs differ, so leaves
  compare relative to their largest entry (the tied embedding's gradient is ~1e8 here)."""
  _, ours, batch = setup
  key = jax.random.key(3)
  on, off = LossConfig(encoder_ar_weight=0.0), LossConfig(encoder_ar_weight=0.0, encoder_gradients=False)
  noise = draw_noise(key, batch, C, ours.config.vocab_size, on)
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)

  def value_and_grad(config):
    f = lambda p: diffusion_loss(nnx.merge(graphdef, p, rest), batch, key, config, noise)[0]
    return jax.jit(jax.value_and_grad(f))(params)

  encoded = {}
  real_encode = hd.DiffusionGemma.encode

  def frozen_encode(self, ids, cache, mask):  # the encoder's output as a constant, computed outside the gradient
    if "out" not in encoded:
      encoded["out"] = real_encode(ours, ids, cache, mask)
    return encoded["out"]

  def worst_relative(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

  loss_on, grad_on = value_and_grad(on)
  loss_off, grad_off = value_and_grad(off)
  with mock.patch.object(hd.DiffusionGemma, "encode", frozen_encode):
    loss_ref, grad_ref = value_and_grad(on)
  assert float(loss_off) == pytest.approx(float(loss_on), rel=1e-6) == pytest.approx(float(loss_ref), rel=1e-6)
  assert worst_relative(grad_off, grad_ref) < 3e-5  # measured 6.4e-6; the encoder's gradient left in: 1.9
  # and the encoder's backward does contribute when it is on
  assert worst_relative(grad_on, grad_off) > 1e-2


def test_builtin_terms_are_the_documented_formulas(setup):
  """Each built-in variant selects its `LossTerm`, which computes the formula of the module docstring."""
  assert {name: type(LossConfig(variant=name).term) for name in LOSS_TERMS} == {
      "flat": FlatCrossEntropy, "corrupted": CorruptedCrossEntropy, "elbo": UniformStateELBO}
  _, _, batch = setup
  noise = draw_noise(jax.random.key(1), batch, C, 64, LossConfig(time_eps=0.3))
  logits = jax.random.normal(jax.random.key(2), (*noise.clean.shape, 64)) * 3
  schedule = corruption.get_schedule("linear")
  free = np.asarray(noise.valid) & ~np.asarray(noise.pinned)
  ce = np.asarray(cross_entropy(logits, noise.clean))
  np.testing.assert_allclose(float(FlatCrossEntropy()(logits, noise, schedule)), ce[free].mean(), rtol=1e-6)
  hit = free & np.asarray(noise.corrupted)
  np.testing.assert_allclose(float(CorruptedCrossEntropy()(logits, noise, schedule)), ce[hit].mean(), rtol=1e-6)
  integrand = uniform_elbo_integrand(logits, noise.clean, noise.noisy, 1 - noise.t, -jnp.ones_like(noise.t))
  np.testing.assert_allclose(float(UniformStateELBO()(logits, noise, schedule)),
                             float(masked_mean(integrand, noise.free)), rtol=1e-6)


def test_a_loss_term_defined_outside_the_library_is_selected_by_spec(setup):
  """'custom_components:DoubledFlat' (tests/custom_components.py) replaces the diffusion term: twice 'flat'."""
  _, ours, batch = setup
  noise = draw_noise(jax.random.key(3), batch, C, 64, LossConfig())

  def diffusion_term(variant):
    config = LossConfig(variant=variant, encoder_ar_weight=0.0)
    return float(diffusion_loss(ours, batch, jax.random.key(0), config, noise=noise)[1]["diffusion_loss"])

  flat = diffusion_term("flat")
  assert flat > 0
  np.testing.assert_allclose(diffusion_term("custom_components:DoubledFlat"), 2 * flat, rtol=1e-6)


def test_pinned_tokens_are_never_corrupted_and_not_in_the_loss(setup):
  _, ours, batch = setup
  pinned = np.zeros(batch.completion_ids.shape, bool)
  pinned[:, ::2] = True
  pinned_batch = batch.replace(completion_pinned=jnp.asarray(pinned))
  config = LossConfig(time_eps=0.4)  # heavy noise: most free positions resampled
  for s in range(5):
    noise = draw_noise(jax.random.key(s), pinned_batch, C, 64, config)
    pin = np.asarray(noise.pinned)
    assert pin.any()
    np.testing.assert_array_equal(np.asarray(noise.noisy)[pin], np.asarray(noise.clean)[pin])
    assert not np.asarray(noise.corrupted)[pin].any()
  # the diffusion loss ignores pinned positions: changing their logits' targets does not matter
  noise = draw_noise(jax.random.key(0), pinned_batch, C, 64, config)
  other = noise.__class__(**{**noise.__dict__, "clean": jnp.where(noise.pinned, 7, noise.clean)})
  f = jax.jit(lambda n: diffusion_loss(ours, pinned_batch, jax.random.key(0), LossConfig(encoder_ar_weight=0.0),
                                       noise=n)[1]["diffusion_loss"])
  assert float(f(noise)) == float(f(other))
  unpinned = noise.__class__(**{**noise.__dict__, "pinned": jnp.zeros_like(noise.pinned)})
  assert float(f(unpinned)) != float(f(noise))


def test_cross_entropy_value_and_gradient_equal_torch():
  """`cross_entropy` has a hand-written gradient (softmax - onehot): value and gradient against torch autograd,
  with large logits (stability) and per-position weights (the upstream gradient is not all ones)."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 4, (3, 7, 50)).astype(np.float32)
  logits[0, 0, 5] = 80.0  # a saturated row
  targets = rng.integers(0, 50, (3, 7))
  weights = rng.uniform(0, 2, (3, 7)).astype(np.float32)

  def ours(x):
    return jnp.sum(cross_entropy(x, jnp.asarray(targets)) * weights)

  value, grad = jax.value_and_grad(ours)(jnp.asarray(logits))
  x = torch.tensor(logits, requires_grad=True)
  ce = F.cross_entropy(x.reshape(-1, 50), torch.tensor(targets).reshape(-1), reduction="none")
  ref = (ce * torch.tensor(weights).reshape(-1)).sum()
  ref.backward()
  np.testing.assert_allclose(float(value), ref.item(), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(ours))(jnp.asarray(logits))), x.grad.numpy(), rtol=1e-5,
                             atol=1e-6)
  # bf16 logits: the gradient comes back in bf16 (a custom VJP must return the primal's dtype)
  bf16 = jax.grad(ours)(jnp.asarray(logits, jnp.bfloat16))
  assert bf16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16, np.float32), x.grad.numpy(), atol=0.05)


def test_top1_correct_is_argmax_equal_target_without_a_pass_of_its_own():
  """The accuracy metric: `top1_correct` equals `argmax(logits) == target` (a tie with the maximum counts as
  correct), and beside the cross-entropy it adds no reduction over the vocabulary (XLA reuses the CE's maximum)."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(3, 5, 17)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 17, (3, 5)), jnp.int32)
  targets = targets.at[0, :2].set(jnp.argmax(logits[0, :2], axis=-1))  # some rows right, most wrong
  want = np.asarray(jnp.argmax(logits, axis=-1) == targets)
  assert want.any() and not want.all()
  np.testing.assert_array_equal(np.asarray(top1_correct(logits, targets)), want)
  assert bool(top1_correct(jnp.zeros((1, 17)), jnp.asarray([5])).all())  # a tie with the maximum: correct

  def reductions(fn) -> tuple[int, int]:
    """(reductions over the vocabulary, of which index-valued: an argmax) in the compiled program."""
    hlo = jax.jit(fn).lower(logits, targets).compile().as_text()
    over_vocab = re.findall(r"= (\(?[fs]32\[3,5\].*?) reduce\(.*dimensions=\{2\}", hlo)
    return len(over_vocab), sum("s32" in shape for shape in over_vocab)

  def ce_only(z, t):
    return jax.value_and_grad(lambda z: cross_entropy(z, t).sum())(z)

  def with_metric(z, t):
    return ce_only(z, t), top1_correct(z, t).mean()

  def with_argmax(z, t):
    return ce_only(z, t), (jnp.argmax(z, axis=-1) == t).mean()

  ce_count, ce_argmax = reductions(ce_only)
  assert ce_count >= 2 and ce_argmax == 0  # the maximum and the exponential sum
  assert reductions(with_metric) == (ce_count, 0)
  assert reductions(with_argmax)[1] == 1  # what an argmax metric adds: an index-valued pass over the logits
