"""The sampler's pure functions against transformers' DiffusionGemma sampler pieces on identical inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.sampling import entropy_bound as eb

torch = pytest.importorskip("torch")
gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")


def _logits(seed, batch, canvas, vocab, ties=False):
  """Random logits with per-position peakiness from flat (scale 0.05) to near one-hot (scale 40)."""
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.uniform(np.log(0.05), np.log(40.0), size=(batch, canvas, 1)))
  logits = rng.normal(size=(batch, canvas, vocab)) * scale
  if ties:  # copies of other positions (equal entropies) and exactly flat rows
    for b in range(batch):
      src = rng.integers(0, canvas, size=canvas // 3)
      dst = rng.integers(0, canvas, size=canvas // 3)
      logits[b, dst] = logits[b, src]
      logits[b, rng.integers(0, canvas, size=2)] = 0.0
  return np.tanh(logits / 30.0).astype(np.float32) * 30.0


def _torch_accept_mask(logits, bound):
  sampler = gen.EntropyBoundSampler(
      gen.EntropyBoundSamplerConfig(entropy_bound=float(bound)), canvas_length=logits.shape[1],
      vocab_size=logits.shape[2], max_denoising_steps=10)
  current = torch.zeros(logits.shape[:2], dtype=torch.long)
  denoiser = torch.ones(logits.shape[:2], dtype=torch.long)
  accepted = sampler.accept_canvas(current, denoiser, torch.from_numpy(logits), cur_step=3)
  mask = sampler.accepted_token_mask.numpy()
  np.testing.assert_array_equal(accepted.numpy(), mask.astype(np.int64))  # denoiser where accepted
  return sampler, mask


def _torch_stable_accept_mask(logits, bound):
  """transformers' rule with a *stable* sort (what we implement)."""
  ent = torch.distributions.Categorical(logits=torch.from_numpy(logits)).entropy()
  s, idx = torch.sort(ent, dim=-1, stable=True)
  sel = torch.cumsum(s, dim=-1) - s <= bound
  return torch.zeros_like(sel).scatter(-1, idx, sel).numpy()


# ---- temperature ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t_min,t_max", [(0.4, 0.8), (0.0, 1.0), (1e-4, 2e-4), (0.33, 0.77)])
@pytest.mark.parametrize("num_steps", [1, 7, 48])
def test_temperature_matches_linear_schedule_processor(t_min, t_max, num_steps):
  proc = gen.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max, max_denoising_steps=num_steps)
  scores = _logits(0, 2, 5, 11)
  jitted = jax.jit(lambda x, n: x / eb.temperature(n, num_steps, t_min, t_max))
  for step in range(num_steps, 0, -1):
    ref = proc(None, torch.from_numpy(scores), torch.tensor(step, dtype=torch.int32)).numpy()
    t_ref = t_min + (t_max - t_min) * (torch.tensor(step, dtype=torch.int32) / num_steps)
    assert float(eb.temperature(step, num_steps, t_min, t_max)) == t_ref.item()  # eager: bit-identical
    np.testing.assert_array_equal(scores / np.asarray(eb.temperature(step, num_steps, t_min, t_max)), ref)
    # under jit XLA fuses the multiply-add and divides via a reciprocal: at most a couple of ulps
    np.testing.assert_allclose(np.asarray(jitted(scores, step)), ref, rtol=3e-7, atol=0)
  assert float(eb.temperature(num_steps, num_steps, t_min, t_max)) == pytest.approx(t_max)  # first step: t_max


# ---- entropy and acceptance ----------------------------------------------------------------------------------------
def test_entropy_matches_categorical():
  logits = _logits(1, 3, 16, 50)
  ref = torch.distributions.Categorical(logits=torch.from_numpy(logits)).entropy().numpy()
  np.testing.assert_allclose(np.asarray(jax.jit(eb.entropy)(logits)), ref, rtol=2e-5, atol=2e-6)
  # -inf logits (torch clamps) and the finite DISALLOWED_LOGIT both give finite entropies
  masked = logits.copy()
  masked[..., 10:] = -np.inf
  ref = torch.distributions.Categorical(logits=torch.from_numpy(masked)).entropy().numpy()
  np.testing.assert_allclose(np.asarray(eb.entropy(masked)), ref, rtol=2e-5, atol=2e-6)
  allowed = np.zeros(50, bool)
  allowed[:10] = True
  ent = eb.entropy(eb.apply_allowed_tokens(jnp.asarray(logits), jnp.asarray(allowed)) / 1e-4)
  assert np.isfinite(np.asarray(ent)).all()


@pytest.mark.parametrize("bound", [1e-3, 0.1, 1.0, 5.0, 1e9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accept_entropy_bound_matches_sampler(bound, seed):
  logits = _logits(seed, 4, 32, 64)
  _, ref = _torch_accept_mask(logits, bound)
  ours = np.asarray(jax.jit(lambda x: eb.accept_entropy_bound(eb.entropy(x), bound))(logits))
  np.testing.assert_array_equal(ours, ref)
  assert ours.sum(-1).min() >= 1  # the lowest-entropy position is always accepted


@pytest.mark.parametrize("bound", [0.05, 0.5, 3.0])
def test_accept_entropy_bound_ties(bound):
  # rows of <= 16 positions: torch's CPU sort is stable there, so masks agree exactly even with ties
  logits = _logits(3, 6, 16, 40, ties=True)
  _, ref = _torch_accept_mask(logits, bound)
  np.testing.assert_array_equal(np.asarray(eb.accept_entropy_bound(eb.entropy(logits), bound)), ref)
  # longer rows: torch.sort (stable=False) orders equal values arbitrarily; we equal the stable-sort rule, and
  # can differ from transformers only at positions whose entropy is tied with another position of the row
  logits = _logits(4, 6, 64, 40, ties=True)
  ours = np.asarray(eb.accept_entropy_bound(eb.entropy(logits), bound))
  np.testing.assert_array_equal(ours, _torch_stable_accept_mask(logits, bound))
  _, ref = _torch_accept_mask(logits, bound)
  ent = torch.distributions.Categorical(logits=torch.from_numpy(logits)).entropy().numpy()
  tied = (ent[:, :, None] == ent[:, None, :]).sum(-1) > 1
  assert not ((ours != ref) & ~tied).any()
  assert ours.sum(-1).tolist() == ref.sum(-1).tolist()  # the count accepted never depends on tie order


def test_renoise_mask_matches_sampler():
  logits = _logits(5, 3, 24, 32)
  sampler, accepted = _torch_accept_mask(logits, 0.5)
  sentinel = -7
  sampler.initialize_canvas = lambda batch_size, device: torch.full((batch_size, 24), sentinel)
  accepted_canvas = torch.full((3, 24), 5)
  ref_renoised = sampler.renoise_canvas(accepted_canvas, cur_step=3).numpy() == sentinel
  # vocab_size=1 makes every fresh token 0, so renoised positions are the ones that turned 0
  ours = np.asarray(eb.renoise(jax.random.key(0), jnp.full((3, 24), 5, jnp.int32), jnp.asarray(accepted), 1)) == 0
  np.testing.assert_array_equal(ours, ref_renoised)
  np.testing.assert_array_equal(ours, ~accepted)
  canvas = eb.renoise(jax.random.key(1), jnp.full((3, 24), 5, jnp.int32), jnp.asarray(accepted), 1000)
  assert (np.asarray(canvas)[accepted] == 5).all() and (np.asarray(canvas) < 1000).all()


def test_accept_top_k_and_confidence():
  logits = _logits(6, 2, 16, 20)
  ent = eb.entropy(logits)
  for k in (1, 5, 16):
    mask = np.asarray(eb.accept_top_k(ent, k))
    assert (mask.sum(-1) == k).all()
    e = np.asarray(ent)
    for b in range(2):
      assert e[b][mask[b]].max() <= e[b][~mask[b]].min() if k < 16 else True
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1)).max(-1)
  mask = np.asarray(eb.accept_confidence_threshold(logits, 0.9))
  np.testing.assert_array_equal(mask | (probs == probs.max(-1, keepdims=True)), mask)
  np.testing.assert_array_equal(mask[probs < 0.9], (probs == probs.max(-1, keepdims=True))[probs < 0.9])
  assert np.asarray(eb.accept_confidence_threshold(logits, 2.0)).sum(-1).tolist() == [1, 1]


# ---- stopping ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stability_threshold", [0, 1, 2, 3])
def test_stable_and_confident_matches_criteria(stability_threshold):
  batch, canvas, vocab, steps = 5, 12, 16, 9
  rng = np.random.default_rng(stability_threshold)
  threshold = 0.005
  ref = gen.StableAndConfidentStoppingCriteria(stability_threshold=stability_threshold,
                                               confidence_threshold=threshold)
  history = eb.init_stability_history(stability_threshold, batch, canvas)
  step_fn = jax.jit(lambda h, a, e: eb.stable_and_confident(h, a, e, threshold))
  argmax = rng.integers(0, vocab, size=(batch, canvas))
  seen_stop = np.zeros(batch, bool)
  for step in range(steps):
    # row 0 changes every step, rows 1-2 freeze early (2 with flat logits: stable but never confident),
    # row 3 freezes late, row 4 alternates between two canvases.
    change = np.array([True, step < 2, step < 2, step < 5, True])
    new = rng.integers(0, vocab, size=(batch, canvas))
    argmax = np.where(change[:, None], new, argmax)
    if step % 2 == 0:
      argmax[4] = argmax[4] * 0 + 3
    peak = np.array([60.0, 60.0, 0.5, 60.0, 60.0])[:, None, None] * (1 + 0.5 * (step % 3))
    logits = (rng.normal(size=(batch, canvas, vocab)) * 0.01).astype(np.float32)
    np.put_along_axis(logits, argmax[..., None], peak.repeat(canvas, 1), axis=-1)
    logits = logits.astype(np.float32)
    expected = ref(torch.from_numpy(argmax), torch.from_numpy(logits)).numpy()
    stop, history = step_fn(history, jnp.asarray(argmax, jnp.int32), eb.entropy(logits))
    np.testing.assert_array_equal(np.asarray(stop), expected, err_msg=f"step {step}")
    seen_stop |= expected
  assert seen_stop[1] and not seen_stop[2]  # the criteria were exercised both ways


# ---- sampling and infilling helpers --------------------------------------------------------------------------------
def test_sample_tokens_distribution_and_argmax():
  probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0], np.float32)
  logits = jnp.log(jnp.asarray(probs))[None, None].repeat(4000, axis=1)
  samples = np.asarray(jax.jit(eb.sample_tokens)(jax.random.key(0), logits))
  freq = np.bincount(samples.ravel(), minlength=5) / samples.size
  assert (np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / samples.size) + 1e-4).all()  # 5 sigma
  assert freq[4] == 0
  peaked = jnp.asarray(_logits(7, 2, 16, 30)) / 1e-4
  np.testing.assert_array_equal(eb.sample_tokens(jax.random.key(1), peaked), eb.argmax_canvas(peaked))
  ties = jnp.zeros((1, 1, 6)).at[0, 0, 2:4].set(1.0)
  assert int(eb.argmax_canvas(ties)[0, 0]) == 2  # first maximum, like torch.argmax


def test_allowed_tokens_and_pins():
  logits = jnp.asarray(_logits(8, 2, 6, 10))
  allowed = jnp.zeros((2, 10), bool).at[0, 3].set(True).at[1, 5:8].set(True)
  out = eb.apply_allowed_tokens(logits, allowed)
  assert np.isfinite(np.asarray(out)).all()
  samples = np.asarray(eb.sample_tokens(jax.random.key(0), out / 0.5))
  assert (samples[0] == 3).all() and ((samples[1] >= 5) & (samples[1] < 8)).all()
  assert float(eb.apply_allowed_tokens(logits, allowed[0])[1, 0, 3]) == float(logits[1, 0, 3])  # [V] mask
  seed = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 10
  pinned = jnp.zeros((2, 6), bool).at[:, ::2].set(True)
  pinned_logits = eb.pin_logits(logits / 1e-3, seed, pinned)
  np.testing.assert_array_equal(np.asarray(eb.argmax_canvas(pinned_logits))[np.asarray(pinned)],
                                np.asarray(seed)[np.asarray(pinned)])
  assert (np.asarray(eb.entropy(pinned_logits))[np.asarray(pinned)] == 0).all()
  canvas = eb.apply_pins(jnp.full((2, 6), 9, jnp.int32), seed, pinned)
  np.testing.assert_array_equal(np.asarray(canvas), np.where(np.asarray(pinned), np.asarray(seed), 9))
  assert math.isfinite(eb.DISALLOWED_LOGIT) and eb.DISALLOWED_LOGIT < -1e6


@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 3, 128), (2, 4, 300), (3, 81, 32), (1, 4, 1280)])
def test_fused_sample_argmax_entropy_matches_separate_functions(shape):
  logits = jnp.asarray(_logits(9, *shape))
  temp = 0.7
  fn = jax.jit(lambda k, x: eb.sample_argmax_entropy(k, x, temp, row_group=3))
  samples, argmax, ent = fn(jax.random.key(0), logits)
  np.testing.assert_array_equal(np.asarray(argmax), np.asarray(eb.argmax_canvas(logits / temp)))
  np.testing.assert_allclose(np.asarray(ent), np.asarray(eb.entropy(logits / temp)), rtol=1e-4, atol=1e-5)
  assert samples.shape == shape[:2] and samples.dtype == jnp.int32
  assert ((np.asarray(samples) >= 0) & (np.asarray(samples) < shape[-1])).all()
  # near-zero temperature: the sample is the argmax (the deterministic regime of the parity tests)
  cold, cold_argmax, cold_ent = fn(jax.random.key(1), logits / 1e-4 * temp)
  np.testing.assert_array_equal(np.asarray(cold), np.asarray(cold_argmax))
  assert np.isfinite(np.asarray(cold_ent)).all()


def test_fused_sampler_distribution_and_disallowed_tokens():
  rng = np.random.default_rng(10)
  probs = rng.dirichlet(np.full(300, 0.3)).astype(np.float32)
  probs[[5, 130, 299]] = 0.0  # never sampled, in the first, a middle and the last (padded) block
  probs /= probs.sum()
  logits = jnp.where(jnp.asarray(probs) > 0, jnp.log(jnp.asarray(probs)), eb.DISALLOWED_LOGIT)
  logits = jnp.broadcast_to(logits, (4, 5000, 300))
  samples, argmax, ent = jax.jit(lambda k, x: eb.sample_argmax_entropy(k, x, 1.0))(jax.random.key(2), logits)
  freq = np.bincount(np.asarray(samples).ravel(), minlength=300) / samples.size
  assert (np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / samples.size) + 1e-4).all()  # 5 sigma
  assert freq[[5, 130, 299]].sum() == 0
  assert int(argmax[0, 0]) == int(np.argmax(probs))
  np.testing.assert_allclose(float(ent[0, 0]), -(probs[probs > 0] * np.log(probs[probs > 0])).sum(), rtol=1e-4)
