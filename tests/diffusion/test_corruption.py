"""Tests for hackable_diffusion.diffusion.corruption (statistical checks use fixed keys and bounds
derived from the sample size, so they are deterministic and would fail for a wrong distribution)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.diffusion import corruption as C


def chi_square_uniform(counts):
  counts = np.asarray(counts, np.float64)
  expected = counts.sum() / counts.size
  stat = ((counts - expected) ** 2 / expected).sum()
  df = counts.size - 1
  return stat, df + 6 * math.sqrt(2 * df)  # statistic and a ~6-sigma bound


# ------------------------------------------------------------------------------------------ time
def test_sample_time_range_shape_and_mean():
  t = C.sample_time(jax.random.key(0), 20000, eps=1e-4)
  assert t.shape == (20000,) and t.dtype == jnp.float32
  assert float(t.min()) >= 1e-4 and float(t.max()) <= 1 - 1e-4
  assert abs(float(t.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / 20000)
  t = C.sample_time(jax.random.key(1), 1000, eps=0.4)
  assert float(t.min()) >= 0.4 and float(t.max()) <= 0.6
  np.testing.assert_array_equal(C.sample_time(jax.random.key(2), 8), C.sample_time(jax.random.key(2), 8))
  with pytest.raises(ValueError, match='eps'):
    C.sample_time(jax.random.key(0), 4, eps=0.5)


def test_a_time_floor_draws_uniformly_above_it():
  t = C.sample_time(jax.random.key(0), 20000, eps=1e-4, t_min=0.3)
  assert float(t.min()) >= 0.3 and float(t.max()) <= 1 - 1e-4
  assert abs(float(t.mean()) - 0.65) < 6 * math.sqrt(0.7 ** 2 / 12 / 20000)
  stat, bound = chi_square_uniform(np.histogram(np.asarray(t), bins=14, range=(0.3, 1.0))[0])
  assert stat < bound
  for bad in (-0.1, 1 - 1e-4, 1.0):
    with pytest.raises(ValueError, match='t_min'):
      C.sample_time(jax.random.key(0), 4, t_min=bad)


# ------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize('name,alpha_fn', [
    ('linear', lambda t: 1 - t),
    ('cosine', lambda t: np.cos(np.pi / 2 * t)),
])
def test_schedules_alpha_and_derivative(name, alpha_fn):
  sched = C.get_schedule(name)
  assert sched.name == name
  t = jnp.linspace(0.01, 0.99, 7)
  np.testing.assert_allclose(sched.alpha(t), alpha_fn(np.asarray(t)), rtol=1e-6, atol=1e-6)
  grad = jax.vmap(jax.grad(lambda s: sched.alpha(s)))(t)
  np.testing.assert_allclose(sched.dalpha(t), grad, rtol=1e-5, atol=1e-6)
  assert float(sched.alpha(jnp.float32(0.0))) == pytest.approx(1.0)
  assert float(sched.alpha(jnp.float32(1.0))) == pytest.approx(0.0, abs=1e-6)


def test_get_schedule_unknown_name():
  with pytest.raises(ValueError, match="'nope'"):
    C.get_schedule('nope')


# ------------------------------------------------------------------------------------------ corruption
B, L, V = 64, 512, 16


def test_kept_fraction_matches_alpha_within_binomial_tolerance():
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, V, dtype=jnp.int32)
  alpha = jnp.linspace(0.02, 0.98, B)
  noisy, corrupted = C.corrupt_uniform(jax.random.key(1), tokens, alpha, V)
  a = np.asarray(alpha, np.float64)
  kept = np.asarray(~corrupted).sum(1)
  # per row: kept ~ Binomial(L, alpha)
  sigma = np.sqrt(L * a * (1 - a))
  assert np.all(np.abs(kept - L * a) <= 5 * sigma + 1), (kept, L * a)
  # overall
  assert abs(kept.sum() - L * a.sum()) <= 5 * math.sqrt((L * a * (1 - a)).sum())
  # unresampled positions are untouched, resampled ones differ with probability 1 - 1/V
  n, t = np.asarray(noisy), np.asarray(tokens)
  cm = np.asarray(corrupted)
  np.testing.assert_array_equal(n[~cm], t[~cm])
  changed = (n != t).sum()
  p = 1 - 1 / V
  assert abs(changed - cm.sum() * p) <= 5 * math.sqrt(cm.sum() * p * (1 - p))


def test_replacement_tokens_uniform_over_vocab():
  tokens = jnp.full((B, L), 3, jnp.int32)  # the original value must be as likely as any other
  noisy, corrupted = C.corrupt_uniform(jax.random.key(2), tokens, jnp.full((B,), 0.25), V)
  replaced = np.asarray(noisy)[np.asarray(corrupted)]
  assert replaced.size > 0.7 * B * L
  counts = np.bincount(replaced, minlength=V)
  assert counts.size == V  # nothing outside [0, V)
  stat, bound = chi_square_uniform(counts)
  assert stat < bound, counts


def test_protected_positions_never_change():
  tokens = jax.random.randint(jax.random.key(3), (B, L), 0, V, dtype=jnp.int32)
  protected = jax.random.bernoulli(jax.random.key(4), 0.3, (B, L))
  noisy, corrupted = C.corrupt_uniform(jax.random.key(5), tokens, jnp.zeros((B,)), V,
                                       protected_mask=protected)
  p, n, t, cm = map(np.asarray, (protected, noisy, tokens, corrupted))
  np.testing.assert_array_equal(n[p], t[p])
  assert not cm[p].any()
  assert cm[~p].all()  # alpha = 0: every unprotected position is resampled


def test_alpha_one_keeps_everything():
  tokens = jax.random.randint(jax.random.key(3), (4, 32), 0, V, dtype=jnp.int32)
  noisy, corrupted = C.corrupt_uniform(jax.random.key(0), tokens, jnp.ones((4,)), V)
  np.testing.assert_array_equal(noisy, tokens)
  assert not np.asarray(corrupted).any()


def test_corruption_determinism_shapes_dtypes_and_jit():
  tokens = jax.random.randint(jax.random.key(3), (4, 32), 0, 1000, dtype=jnp.int32)
  alpha = jnp.full((4,), 0.5)
  f = jax.jit(functools.partial(C.corrupt_uniform, vocab_size=1000))
  n1, m1 = f(jax.random.key(7), tokens, alpha)
  n2, m2 = C.corrupt_uniform(jax.random.key(7), tokens, alpha, 1000)
  n3, _ = C.corrupt_uniform(jax.random.key(8), tokens, alpha, 1000)
  np.testing.assert_array_equal(n1, n2)
  np.testing.assert_array_equal(m1, m2)
  assert not np.array_equal(n1, n3)
  assert n1.shape == (4, 32) and n1.dtype == jnp.int32 and m1.dtype == jnp.bool_
  with pytest.raises(ValueError, match='alpha'):
    C.corrupt_uniform(jax.random.key(0), tokens, jnp.ones((3,)), 10)
  with pytest.raises(ValueError, match='protected_mask'):
    C.corrupt_uniform(jax.random.key(0), tokens, alpha, 10, protected_mask=jnp.ones((4, 3), bool))


# ------------------------------------------------------------------------------------------ canvases
def test_choose_canvas_valid_and_uniform():
  per_group = 4000
  valid = np.repeat(np.array([1, 2, 3, 5], np.int32), per_group)
  idx = np.asarray(C.choose_canvas(jax.random.key(0), jnp.asarray(valid)))
  assert idx.dtype == np.int32 and idx.shape == valid.shape
  assert np.all(idx >= 0) and np.all(idx < valid)
  for n in (2, 3, 5):
    counts = np.bincount(idx[valid == n], minlength=n)
    assert counts.size == n and counts.min() > 0
    stat, bound = chi_square_uniform(counts)
    assert stat < bound, (n, counts)
  np.testing.assert_array_equal(C.choose_canvas(jax.random.key(1), jnp.array([0, 0])), [0, 0])
  np.testing.assert_array_equal(C.choose_canvas(jax.random.key(9), jnp.asarray(valid)),
                                C.choose_canvas(jax.random.key(9), jnp.asarray(valid)))


def test_gather_canvas_matches_numpy_loop():
  rng = np.random.default_rng(0)
  b, n, c = 5, 4, 3
  tokens = rng.integers(0, 100, (b, n * c)).astype(np.int32)
  mask = rng.random((b, n * c)) < 0.5
  index = np.array([0, 3, 1, 2, 3], np.int32)
  got_t, got_m = jax.jit(C.gather_canvas, static_argnums=3)(tokens, mask, index, c)
  for i in range(b):
    np.testing.assert_array_equal(got_t[i], tokens[i, index[i] * c:(index[i] + 1) * c])
    np.testing.assert_array_equal(got_m[i], mask[i, index[i] * c:(index[i] + 1) * c])
  assert got_t.shape == (b, c) and got_t.dtype == jnp.int32 and got_m.dtype == jnp.bool_
  with pytest.raises(ValueError, match='canvas_length'):
    C.gather_canvas(tokens, mask, index, 5)
