"""Uniform-state discrete diffusion: time sampling, noise schedules, corruption, canvas choice.

The forward process of DiffusionGemma's SFT recipes (docs/reference.md, "Training recipe"; the uniform-state process of
Austin et al. 2021 "D3PM", as used by UDLM, Schiff et al. 2024, and Duo, Sahoo et al. 2025):
`q(z_t | x) = alpha_t * onehot(x) + (1 - alpha_t) / V`, i.e. each token is kept with probability
`alpha_t` and otherwise resampled uniformly from the whole vocabulary. `t ~ U(eps, 1 - eps)` per
example (eps = 1e-4 in the gemma JAX recipe; optionally from a floor `t_min`) and `alpha_t = 1 - t` (linear
schedule).

All functions are pure, take explicit `jax.random` keys and are `jit`-friendly (sizes such as
`vocab_size` and `canvas_length` are static Python ints).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def sample_time(key: jax.Array, batch: int, eps: float = 1e-4, t_min: float = 0.0) -> jax.Array:
  """Diffusion times `t ~ U(max(eps, t_min), 1 - eps)`, one per example: `[batch]` float32.

  The eps margin keeps `alpha_t` away from exactly 0 or 1 (gemma JAX recipe: eps = 1e-4). `t_min` > 0 leaves the
  lightly corrupted canvases out of training (times the model has long learnt; docs/sudoku.md).
  """
  if not 0.0 <= eps < 0.5:
    raise ValueError(f'eps must be in [0, 0.5), got {eps!r}')
  if not 0.0 <= t_min < 1.0 - eps:
    raise ValueError(f't_min must be in [0, 1 - eps) = [0, {1.0 - eps}), got {t_min!r}')
  return jax.random.uniform(key, (batch,), jnp.float32, minval=max(eps, t_min), maxval=1.0 - eps)


# ------------------------------------------------------------------------------------------ schedules
@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearSchedule:
  """`alpha_t = 1 - t` (the DiffusionGemma SFT recipes); `dalpha/dt = -1`."""

  name: str = dataclasses.field(default='linear', init=False)

  def alpha(self, t: jax.Array) -> jax.Array:
    """Probability of keeping a clean token at time t: `[...]` -> `[...]`."""
    return 1.0 - t

  def dalpha(self, t: jax.Array) -> jax.Array:
    """`d alpha_t / d t` (negative), for ELBO weightings such as UDLM's: `[...]` -> `[...]`."""
    return -jnp.ones_like(t)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CosineSchedule:
  """`alpha_t = cos(pi/2 * t)` (a cosine keep-probability, cf. Nichol & Dhariwal 2021; MaskGIT)."""

  name: str = dataclasses.field(default='cosine', init=False)

  def alpha(self, t: jax.Array) -> jax.Array:
    return jnp.cos(0.5 * math.pi * t)

  def dalpha(self, t: jax.Array) -> jax.Array:
    return -0.5 * math.pi * jnp.sin(0.5 * math.pi * t)


Schedule = LinearSchedule | CosineSchedule
SCHEDULES = {'linear': LinearSchedule, 'cosine': CosineSchedule}


def get_schedule(name: str) -> Schedule:
  """Schedule by name: one of `SCHEDULES` ('linear', 'cosine')."""
  if name not in SCHEDULES:
    raise ValueError(f'schedule must be one of {sorted(SCHEDULES)}, got {name!r}')
  return SCHEDULES[name]()


# ------------------------------------------------------------------------------------------ corruption
def corrupt_uniform(
    key: jax.Array,
    tokens: jax.Array,
    alpha: jax.Array,
    vocab_size: int,
    *,
    protected_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Uniform-state corruption of a canvas.

  Args:
    key: PRNG key.
    tokens: `[batch, canvas]` int clean tokens.
    alpha: `[batch]` keep probability `alpha_t` per example.
    vocab_size: V; replacements are uniform over `[0, V)` (the whole vocabulary, as in the published recipes).
    protected_mask: optional `[batch, canvas]` bool; True positions are never changed (e.g. pad or
      pinned cells).

  Returns:
    noisy: `[batch, canvas]`, same dtype as `tokens`.
    corrupted_mask: `[batch, canvas]` bool, True where the token was RESAMPLED. A resampled token
      equals the original with probability 1/V; it is still marked (the mask records what the
      process did, not whether the value differs), so `P(mask) = 1 - alpha_t` exactly and
      `P(noisy != clean) = (1 - alpha_t)(1 - 1/V)`.
  """
  if tokens.ndim != 2:
    raise ValueError(f'tokens must be [batch, canvas], got shape {tokens.shape}')
  if alpha.shape != tokens.shape[:1]:
    raise ValueError(f'alpha must be [batch]={tokens.shape[:1]}, got shape {alpha.shape}')
  if protected_mask is not None and protected_mask.shape != tokens.shape:
    raise ValueError(f'protected_mask must have shape {tokens.shape}, got {protected_mask.shape}')
  if vocab_size < 1:
    raise ValueError(f'vocab_size must be >= 1, got {vocab_size!r}')
  keep_key, token_key = jax.random.split(key)
  keep = jax.random.uniform(keep_key, tokens.shape) < alpha[:, None].astype(jnp.float32)
  resample = jnp.logical_not(keep)
  if protected_mask is not None:
    resample = jnp.logical_and(resample, jnp.logical_not(protected_mask.astype(bool)))
  random_tokens = jax.random.randint(token_key, tokens.shape, 0, vocab_size, dtype=tokens.dtype)
  return jnp.where(resample, random_tokens, tokens), resample


# ------------------------------------------------------------------------------------------ canvases
def choose_canvas(key: jax.Array, num_valid_canvases: jax.Array) -> jax.Array:
  """One canvas per example, uniform over `[0, num_valid_canvases)`: `[batch]` -> `[batch]` int32.

  As in the published SFT recipes (docs/reference.md, "Training recipe"): the completion is cut into canvases
  and one valid canvas per example is trained on. Counts below 1 are treated as 1.
  """
  n = jnp.maximum(jnp.asarray(num_valid_canvases, jnp.int32), 1)
  return jax.random.randint(key, n.shape, 0, n, dtype=jnp.int32)


def gather_canvas(
    tokens: jax.Array,
    mask: jax.Array,
    canvas_index: jax.Array,
    canvas_length: int,
) -> tuple[jax.Array, jax.Array]:
  """Cuts canvas `canvas_index[b]` out of each row.

  Args:
    tokens: `[batch, N * C]` completion tokens.
    mask: `[batch, N * C]` validity mask.
    canvas_index: `[batch]` int in `[0, N)`.
    canvas_length: C.

  Returns:
    `([batch, C], [batch, C])`: `tokens[b, i*C:(i+1)*C]` and the same slice of `mask`.
  """
  batch, width = tokens.shape
  if mask.shape != tokens.shape:
    raise ValueError(f'mask shape {mask.shape} must equal tokens shape {tokens.shape}')
  if canvas_length < 1 or width % canvas_length:
    raise ValueError(f'canvas_length={canvas_length} must divide the completion width {width}')
  n = width // canvas_length
  idx = jnp.asarray(canvas_index, jnp.int32)[:, None, None]

  def take(x):
    return jnp.take_along_axis(x.reshape(batch, n, canvas_length), idx, axis=1)[:, 0]

  return take(tokens), take(mask)
