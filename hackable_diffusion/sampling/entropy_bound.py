"""The pieces of one entropy-bounded denoising step, as small pure (jittable) functions.

`generate` composes them as: logits -> `apply_allowed_tokens` -> `pin_logits` -> divide by `temperature` ->
`step_statistics` (one fused pass over the logits, vectorised over every row, giving what `sample_tokens`,
`argmax_canvas` and `entropy` give separately: the denoiser canvas, the argmax canvas, the token entropies; plus the
softmax weights for the self-conditioning input) -> an acceptance rule (`accept_entropy_bound`, or
`accept_top_k` / `accept_confidence_threshold`) -> `renoise` the rest -> `stable_and_confident` per-row stopping.
Swap any of them to try another sampler.

Reference behaviour: transformers 5.23 `generation_diffusion_gemma.py` (`LinearTemperatureScheduleLogitsProcessor`,
`EntropyBoundSampler`, `StableAndConfidentStoppingCriteria`); the entropy-bound rule is from "Accelerated
Sampling from Masked Diffusion Models via Entropy Bounded Unmasking" (Ben-Hamu et al., arXiv:2505.24857).
Shapes: logits `[batch, canvas, vocab]`, canvases `[batch, canvas]` int32.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array

# Logit given to tokens outside an allowed set: large, negative and *finite* (as vLLM does), so that after a
# division by a small temperature it stays finite and entropies / softmaxes never see inf - inf.
DISALLOWED_LOGIT = -1e9


# ---- temperature --------------------------------------------------------------------------------------------------
def temperature(step, num_steps, t_min, t_max) -> Array:
  """Linear schedule `T(n) = t_min + (t_max - t_min) * (n / N)` in float32.

  `step` is the number of steps *remaining* (`N` at the first step, 1 at the last), exactly as transformers'
  `LinearTemperatureScheduleLogitsProcessor` uses it: the first step runs at `t_max` and the last one at
  `t_min + (t_max - t_min) / N` (the schedule never reaches `t_min` itself). Evaluated eagerly with Python floats
  the value is bit-identical to transformers'; under `jit` XLA may fuse the multiply-add (and turns `logits / T`
  into `logits * (1 / T)`), which can move results by one float32 ulp.
  """
  frac = jnp.asarray(step, jnp.int32) / jnp.asarray(num_steps, jnp.int32)  # true division -> float32
  return jnp.asarray(t_min + (t_max - t_min) * frac, jnp.float32)


# ---- entropies and tokens -----------------------------------------------------------------------------------------
def entropy(logits: Array) -> Array:
  """Token entropy of `softmax(logits)` in float32: `[..., V] -> [...]` (torch `Categorical(logits).entropy()`).

  Log-probabilities are clamped at the float32 minimum like torch, so `-inf` logits contribute 0, not NaN.
  """
  logits = logits.astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  p = jnp.exp(logp)
  logp = jnp.maximum(logp, jnp.finfo(jnp.float32).min)
  return -jnp.sum(p * logp, axis=-1)


def sample_tokens(key: Array, logits: Array) -> Array:
  """One categorical sample per position from `softmax(logits)` by the Gumbel-max trick -> int32 `[...]`.

  `argmax(logits + Gumbel noise)` is a single fused pass (no softmax, no cumulative sums). It draws from the same
  distribution as transformers' `torch.multinomial(softmax(logits))`, but from a different random stream.
  """
  gumbel = jax.random.gumbel(key, logits.shape, jnp.float32)
  return jnp.argmax(logits.astype(jnp.float32) + gumbel, axis=-1).astype(jnp.int32)


def argmax_canvas(logits: Array) -> Array:
  """The most likely token per position (first index on ties, like torch) -> int32 `[...]`."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _largest_divisor(n: int, limit: int) -> int:
  return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@flax.struct.dataclass
class StepStatistics:
  """What one denoising step needs from the processed logits `z = logits / T` (`step_statistics`).

  `weights / total[..., None]` is `softmax(z)` up to float rounding (the self-conditioning input is
  `softmax(z) @ embed`, computed as `(weights @ embed) / total` so that no normalised copy is written).
  """

  samples: Array  # [...] int32, one categorical sample per position
  argmax: Array  # [...] int32, first index of the maximum
  entropy: Array  # [...] float32, entropy of softmax(z)
  weights: Array | None  # [..., V] exp(z - max z) in the requested dtype (None when not asked for)
  total: Array  # [...] float32, sum of exp(z - max z)


# Online softmax statistics of a set of tokens (one set per array element): its largest logit `x` and the first
# index of it, the inverse temperature `inv_t` (the same for every token of a row), and relative to the max,
# `s = sum exp(d)` and `t = sum exp(d) d` with `d = (x_i - x) * inv_t`. A single token is `(x, index, inv_t, 1, 0)`.
_Online = tuple[Array, Array, Array, Array, Array]


def _merge(a: _Online, b: _Online) -> _Online:
  """The statistics of the union of two disjoint token sets (flash-attention's rescaling; the index tie-break keeps
  the argmax the first index of the max; a set far below the max, or one of `-inf` logits, adds exactly 0)."""
  (xa, ia, ta_inv, sa, ta), (xb, ib, tb_inv, sb, tb) = a, b
  take_b = (xb > xa) | ((xb == xa) & (ib < ia))
  x, i = jnp.where(take_b, xb, xa), jnp.where(take_b, ib, ia)
  inv_t = jnp.where(take_b, tb_inv, ta_inv)
  s_hi, t_hi = jnp.where(take_b, sb, sa), jnp.where(take_b, tb, ta)
  s_lo, t_lo = jnp.where(take_b, sa, sb), jnp.where(take_b, ta, tb)
  d = (jnp.where(take_b, xa, xb) - x) * inv_t  # <= 0 (NaN when both maxima are -inf)
  scale = jnp.exp(d)
  live = scale > 0
  s = s_hi + jnp.where(live, scale * s_lo, 0.0)
  t = t_hi + jnp.where(live, scale * (t_lo + s_lo * d), 0.0)
  return x, i, inv_t, s, t


def _online_reduce(stats: _Online, axis: int) -> _Online:
  """One variadic reduce of `_merge` along `axis`: each input read once, the exponentials computed inside it."""
  init = (jnp.asarray(-jnp.inf, jnp.float32), jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.int32),
          jnp.asarray(0.0, jnp.float32), jnp.asarray(0.0, jnp.float32), jnp.asarray(0.0, jnp.float32))
  return jax.lax.reduce(stats, init, _merge, (axis,))


def _row_uniforms(key: Array, rows: int, group: int) -> Array:
  """One uniform per row `[R]`: the key split into `R / group` keys, `group` uniforms each (the fixed random
  stream of `sample_argmax_entropy`; it once processed rows in groups)."""
  if group == rows:
    return jax.random.uniform(key, (rows,), jnp.float32)
  keys = jax.random.split(key, rows // group)
  return jax.vmap(lambda k: jax.random.uniform(k, (group,), jnp.float32))(keys).reshape(rows)


def _inverse_cdf(u: Array, x: Array, inv_t: Array, xmax: Array, block_sums: Array, block: int) -> Array:
  """Sample by inverting the CDF: pick a block of `block` tokens by the cumulative block masses, then a token inside
  it. u `[R]` uniforms, x `[R, V]` logits, xmax `[R]` their max, block_sums `[R, V / block]` the masses
  `sum exp((x - xmax) * inv_t)` of each block -> `[R]` int32."""
  rows, n_blocks = block_sums.shape
  cum_blocks = jnp.cumsum(block_sums, axis=-1)
  target = u * cum_blocks[:, -1]
  last_block = n_blocks - 1 - jnp.argmax(block_sums[:, ::-1] > 0, axis=-1)
  blk = jnp.minimum(jnp.sum(cum_blocks <= target[:, None], axis=-1), last_block)
  before = jnp.where(blk > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  xb = jnp.take_along_axis(x.reshape(rows, n_blocks, block), blk[:, None, None], axis=1)[:, 0]  # [R, block]
  xb = jax.lax.optimization_barrier(xb)  # a gather of its own: reads R x block logits, not a pass over x
  e = jnp.exp((xb - xmax[:, None]) * inv_t)
  cum = jnp.cumsum(e, axis=-1) + before[:, None]
  last = block - 1 - jnp.argmax(e[:, ::-1] > 0, axis=-1)
  idx = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last)
  return (blk * block + idx).astype(jnp.int32)


def step_statistics(key: Array | None, logits: Array, temperature, *, weights_dtype=None,
                    row_group: int | None = None, uniforms: Array | None = None) -> StepStatistics:
  """Sample, argmax, entropy (and optionally the softmax weights) of `z = logits / temperature`.

  logits `[..., V]` (any float dtype; read as float32). One pass over the `[R, V]` logits, vectorised over all rows
  (no loop over rows): a single variadic reduce gives, per block of 128 tokens, the max, the first index of the max
  and the online-softmax sums `sum e` and `sum e d` with `d = (x - block max) / T`, `e = exp(d)` (computed inside
  the reduction, never written). The `[R, V / 128]` block statistics are then merged the same way into the row's
  max, argmax, `total = sum exp(z - max z)` and entropy `log total - sum e d / total`.

  With `weights_dtype`, a second, elementwise pass writes the softmax numerators `exp(z - max z)` once, for the
  self-conditioning input `softmax(z) @ embed = (weights @ embed) / total` (`denoise.self_conditioning_embeddings`).
  The sample is drawn by one uniform per position and an inverse CDF over the blocks' masses, then inside the chosen
  block (a `[R, 128]` gather). The random stream is that of the row-group sampler of the previous release (kept in
  `tests/sampling/legacy_sampler.py`; `row_group` only selects it: the key is split into `R / group` keys): argmax
  canvases are equal, entropies equal to a few ulps; a sample can differ where the uniform falls within float rounding
  of a token boundary of the cumulative masses, which are summed in another order (see `docs/sampling.md`).

  `temperature` is a scalar or an array broadcastable to the leading shape (a per-row temperature `[B, 1]`);
  `uniforms` (shape `[...]`, in [0, 1)) replaces the draws from `key` (per-row random streams, `denoise_rows`).
  """
  *lead, vocab = logits.shape
  x = logits.reshape(-1, vocab).astype(jnp.float32)  # [R, V]
  rows = x.shape[0]
  inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
  if inv_t.ndim:  # one temperature per position: a column against [R, ...]
    inv_t = jnp.broadcast_to(inv_t, tuple(lead)).reshape(rows, 1)
  block = 128 if vocab > 128 else vocab
  if vocab % block:  # pad the vocabulary with never-chosen tokens
    pad = block - vocab % block
    x = jnp.concatenate([x, jnp.full((rows, pad), DISALLOWED_LOGIT, jnp.float32)], axis=1)
  n_blocks = x.shape[1] // block
  x3 = x.reshape(rows, n_blocks, block)  # [R, n, block]
  # the one pass: per-block online statistics, then (on [R, n]) per row
  inv_t3 = jnp.broadcast_to(inv_t if inv_t.ndim == 0 else inv_t[:, :, None], x3.shape).astype(jnp.float32)
  one, zero = jnp.ones(x3.shape, jnp.float32), jnp.zeros(x3.shape, jnp.float32)
  per_block = _online_reduce((x3, jax.lax.broadcasted_iota(jnp.int32, x3.shape, 1) * block
                              + jax.lax.broadcasted_iota(jnp.int32, x3.shape, 2), inv_t3, one, zero), 2)
  xmax, argmax, _, s, t = _online_reduce(per_block, 1)  # [R] each
  token_entropy = jnp.log(s) - t / s
  block_x, _, _, block_s, _ = per_block  # [R, n]
  block_sums = block_s * jnp.exp((block_x - xmax[:, None]) * inv_t)  # each block's mass relative to the row max
  weights = None
  if weights_dtype is not None:  # pass 2 (elementwise): the softmax numerators, written once in the consumer's dtype
    weights = jnp.exp((x - xmax[:, None]) * inv_t).astype(weights_dtype)[:, :vocab].reshape(*lead, vocab)
  target = row_group if row_group is not None else max(1, (1 << 19) // x.shape[1])
  if uniforms is not None:
    u = jnp.asarray(uniforms, jnp.float32).reshape(rows)
  else:
    u = _row_uniforms(key, rows, _largest_divisor(rows, target))
  samples = _inverse_cdf(u, x, inv_t, xmax, block_sums, block)
  return StepStatistics(samples=samples.reshape(lead), argmax=argmax.astype(jnp.int32).reshape(lead),
                        entropy=token_entropy.reshape(lead), weights=weights, total=s.reshape(lead))


def sample_argmax_entropy(key: Array, logits: Array, temperature, *,
                          row_group: int | None = None) -> tuple[Array, Array, Array]:
  """Sample, argmax and entropy of `softmax(logits / temperature)` in one vectorised pass (`step_statistics`).

  logits `[..., V]`; returns `(samples, argmax, entropy)` of shape `[...]` (int32, int32, float32): equal in
  distribution to `sample_tokens(key, logits / T)`, equal to `argmax_canvas(logits / T)` (ties: the first index)
  and to `entropy(logits / T)` up to float rounding. Instead of a Gumbel draw per vocabulary entry (on a CPU,
  256 x 32k random numbers cost about as much as a forward pass) it draws one uniform per position and inverts the
  CDF over blocks of 128 tokens.
  """
  stats = step_statistics(key, logits, temperature, row_group=row_group)
  return stats.samples, stats.argmax, stats.entropy


# ---- acceptance rules ---------------------------------------------------------------------------------------------
def _ascending_rank(values: Array) -> tuple[Array, Array, Array]:
  """Stable ascending sort along the last axis -> (order, sorted values, rank of each position)."""
  order = jnp.argsort(values, axis=-1, stable=True)
  sorted_values = jnp.take_along_axis(values, order, axis=-1)
  # the inverse permutation by a second sort, not a scatter (XLA:CPU may lower a scatter to a loop over every
  # position, i.e. a trip count that grows with the batch)
  rank = jnp.argsort(order, axis=-1).astype(jnp.int32)
  return order, sorted_values, rank


def accept_entropy_bound(token_entropy: Array, bound) -> Array:
  """Entropy-bounded acceptance: `[B, C]` entropies -> `[B, C]` bool mask of positions to accept.

  Sort the entropies ascending and accept every position whose entropy sum *before* it is within the bound,
  `cumsum(sorted) - sorted <= bound` (so the lowest-entropy position is always accepted). Ties keep position order
  (stable sort); transformers' `torch.sort` on CPU is unstable for rows longer than 16, which only matters when
  exactly equal entropies straddle the bound.
  """
  token_entropy = token_entropy.astype(jnp.float32)
  _, sorted_entropy, rank = _ascending_rank(token_entropy)
  cumulative = jnp.cumsum(sorted_entropy, axis=-1)
  sorted_accept = (cumulative - sorted_entropy) <= bound
  return jnp.take_along_axis(sorted_accept, rank, axis=-1)  # [B, C] back in position order


def accept_top_k(token_entropy: Array, k) -> Array:
  """Accept the `k` lowest-entropy positions of each row (stable on ties) -> `[B, C]` bool."""
  _, _, rank = _ascending_rank(token_entropy.astype(jnp.float32))
  return rank < k


def accept_confidence_threshold(logits: Array, threshold) -> Array:
  """Accept positions whose top probability is `>= threshold`, plus the most confident position of each row
  (so every step makes progress; Fast-dLLM style) -> `[B, C]` bool."""
  logits = logits.astype(jnp.float32)
  top_prob = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
  best = jnp.arange(logits.shape[-2]) == jnp.argmax(top_prob, axis=-1)[..., None]
  return (top_prob >= threshold) | best


# ---- canvases -----------------------------------------------------------------------------------------------------
def initial_canvas(key: Array, batch_size: int, canvas_length: int, vocab_size: int) -> Array:
  """A uniform-random canvas `[B, C]` int32 (transformers' `EntropyBoundSampler.initialize_canvas`)."""
  return jax.random.randint(key, (batch_size, canvas_length), 0, vocab_size, dtype=jnp.int32)


def renoise(key: Array, canvas: Array, accept_mask: Array, vocab_size: int) -> Array:
  """Keep the accepted positions of `canvas [B, C]` and replace every other one by a fresh uniform token."""
  noise = jax.random.randint(key, canvas.shape, 0, vocab_size, dtype=canvas.dtype)
  return jnp.where(accept_mask, canvas, noise)


# ---- stopping -----------------------------------------------------------------------------------------------------
def init_stability_history(stability_threshold: int, batch_size: int, canvas_length: int) -> Array:
  """The fixed-size history of `stable_and_confident`: `[S, B, C]` int32 filled with -1 (never equal a token)."""
  return jnp.full((stability_threshold, batch_size, canvas_length), -1, jnp.int32)


def stable_and_confident(history: Array, argmax: Array, token_entropy: Array,
                         confidence_threshold) -> tuple[Array, Array]:
  """Per-row stop decision of transformers' `StableAndConfidentStoppingCriteria`.

  Args:
    history: `[S, B, C]` the previous `S = stability_threshold` argmax canvases, oldest first (`S = 0`: no check).
    argmax: `[B, C]` this step's argmax canvas.
    token_entropy: `[B, C]` entropies of this step's temperature-scaled logits.
    confidence_threshold: a row is confident when its mean entropy is `< confidence_threshold`.

  Returns:
    (stop `[B]` bool: stable and confident, the new history with `argmax` appended and the oldest dropped).
  """
  stable = jnp.all(history == argmax[None], axis=(0, 2))
  confident = jnp.mean(token_entropy.astype(jnp.float32), axis=-1) < confidence_threshold
  if history.shape[0] == 0:
    return stable & confident, history
  new_history = jnp.concatenate([history[1:], argmax[None].astype(history.dtype)], axis=0)
  return stable & confident, new_history


# ---- infilling ----------------------------------------------------------------------------------------------------
def apply_allowed_tokens(logits: Array, allowed_mask: Array) -> Array:
  """Give every token outside the allowed set the finite `DISALLOWED_LOGIT`.

  logits `[B, C, V]`; allowed_mask `[V]` or `[B, V]` bool (the same set for every canvas position).
  """
  mask = allowed_mask if allowed_mask.ndim == 1 else allowed_mask[:, None, :]
  return jnp.where(mask, logits, jnp.asarray(DISALLOWED_LOGIT, logits.dtype))


def apply_pins(canvas: Array, seed_canvas: Array, pinned: Array) -> Array:
  """Pinned positions (`pinned [B, C]` bool) take their `seed_canvas [B, C]` token."""
  return jnp.where(pinned, seed_canvas.astype(canvas.dtype), canvas)


def pin_logits(logits: Array, seed_canvas: Array, pinned: Array) -> Array:
  """Make pinned positions certain: logits 0 on the seed token, `DISALLOWED_LOGIT` elsewhere.

  A pinned token is then its own sample and argmax, has zero entropy (it never spends entropy budget and is
  always accepted), and is fed to the next step's self-conditioning as a one-hot distribution.
  """
  one_hot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == seed_canvas[..., None].astype(jnp.int32)
  certain = jnp.where(one_hot, jnp.asarray(0.0, logits.dtype), jnp.asarray(DISALLOWED_LOGIT, logits.dtype))
  return jnp.where(pinned[..., None], certain, logits)
