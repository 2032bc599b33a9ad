"""The pieces of one entropy-bounded denoising step, as small pure (jittable) functions.

`generate` composes them as: logits -> `apply_allowed_tokens` -> `pin_logits` -> divide by `temperature` ->
`sample_argmax_entropy` (one pass giving what `sample_tokens`, `argmax_canvas` and `entropy` give separately: the
denoiser canvas, the argmax canvas, the token entropies) -> an acceptance rule (`accept_entropy_bound`, or
`accept_top_k` / `accept_confidence_threshold`) -> `renoise` the rest -> `stable_and_confident` per-row stopping.
Swap any of them to try another sampler.

Reference behaviour: transformers 5.23 `generation_diffusion_gemma.py` (`LinearTemperatureScheduleLogitsProcessor`,
`EntropyBoundSampler`, `StableAndConfidentStoppingCriteria`); the entropy-bound rule is from "Accelerated
Sampling from Masked Diffusion Models via Entropy Bounded Unmasking" (Ben-Hamu et al., arXiv:2505.24857).
Shapes: logits `[batch, canvas, vocab]`, canvases `[batch, canvas]` int32.
"""

from __future__ import annotations

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


def _sample_stats_rows(key: Array, x: Array, inv_t: Array, chunk: int, block: int) -> tuple[Array, Array, Array]:
  """`sample_argmax_entropy` on rows `x [R, V]` (V a multiple of `chunk`, itself a multiple of `block`)."""
  rows, vocab = x.shape
  n_chunks, blocks_per_chunk, n_blocks = vocab // chunk, chunk // block, vocab // block
  iota = jnp.arange(chunk, dtype=jnp.int32)

  def scan_chunk(carry, c):
    m, s, t, best = carry  # running max of z = x / T, sum exp(z - m), sum exp(z - m) (z - m), argmax
    xc = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=1)
    xmax = jnp.max(xc, axis=-1)
    first = jnp.min(jnp.where(xc == xmax[:, None], iota, chunk), axis=-1)  # first maximum (exact compare on x)
    d = (xc - xmax[:, None]) * inv_t
    e = jnp.exp(d)
    sc, tc = jnp.sum(e, axis=-1), jnp.sum(e * d, axis=-1)
    block_sums = jnp.sum(e.reshape(rows, blocks_per_chunk, block), axis=-1)
    mc = xmax * inv_t
    new_m = jnp.maximum(m, mc)
    a, b = jnp.exp(m - new_m), jnp.exp(mc - new_m)  # rescale both partial sums to the new max
    t = a * (t + s * (m - new_m)) + b * (tc + sc * (mc - new_m))
    s = a * s + b * sc
    best = jnp.where(mc > m, c * chunk + first, best)  # strict: an earlier chunk keeps ties
    return (new_m, s, t, best), (block_sums, mc)

  init = (jnp.full((rows,), jnp.finfo(jnp.float32).min), jnp.zeros((rows,)), jnp.zeros((rows,)),
          jnp.zeros((rows,), jnp.int32))
  if n_chunks == 1:  # small vocabulary: no loop (cheaper to compile)
    (m, s, t, best), (block_sums, chunk_max) = scan_chunk(init, 0)
    block_sums, chunk_max = block_sums[None], chunk_max[None]
  else:
    (m, s, t, best), (block_sums, chunk_max) = jax.lax.scan(scan_chunk, init, jnp.arange(n_chunks))
  token_entropy = jnp.log(s) - t / s
  # inverse-CDF sample: pick a block by the cumulative block masses, then a token inside it
  block_sums = block_sums * jnp.exp(chunk_max - m[None])[..., None]  # [chunks, R, blocks_per_chunk]
  block_sums = jnp.moveaxis(block_sums, 0, 1).reshape(rows, n_blocks)
  cum_blocks = jnp.cumsum(block_sums, axis=-1)
  target = jax.random.uniform(key, (rows,), jnp.float32) * cum_blocks[:, -1]
  last_block = n_blocks - 1 - jnp.argmax(block_sums[:, ::-1] > 0, axis=-1)
  blk = jnp.minimum(jnp.sum(cum_blocks <= target[:, None], axis=-1), last_block)
  before = jnp.where(blk > 0, jnp.take_along_axis(cum_blocks, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  xb = jnp.take_along_axis(x.reshape(rows, n_blocks, block), blk[:, None, None], axis=1)[:, 0]
  e = jnp.exp(xb * inv_t - m[:, None])
  cum = jnp.cumsum(e, axis=-1) + before[:, None]
  last = block - 1 - jnp.argmax(e[:, ::-1] > 0, axis=-1)
  idx = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last)
  return (blk * block + idx).astype(jnp.int32), best, token_entropy


def sample_argmax_entropy(key: Array, logits: Array, temperature, *, chunk_size: int = 2048,
                          row_group: int | None = None) -> tuple[Array, Array, Array]:
  """Sample, argmax and entropy of `softmax(logits / temperature)` in one streaming pass over the vocabulary.

  logits `[..., V]`; returns `(samples, argmax, entropy)` of shape `[...]` (int32, int32, float32). This is what
  `generate` uses: equal in distribution to `sample_tokens(key, logits / T)`, equal to `argmax_canvas` (ties: the
  first index; computed on `logits`, which has the same order as `logits / T`) and to `entropy(logits / T)` up to
  float rounding. Instead of a Gumbel draw per vocabulary entry (on a CPU, 256 x 32k random numbers cost about as
  much as a forward pass) it draws one uniform per position and inverts the CDF over blocks of 128 tokens. The
  vocabulary is streamed in chunks (online max / sum, like flash attention) so no `[..., V]` temporary is written;
  rows are processed in groups of `row_group` (default: about 2^19 logits per group) to stay in cache.
  """
  *lead, vocab = logits.shape
  x = logits.reshape(-1, vocab).astype(jnp.float32)
  rows = x.shape[0]
  inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
  block = 128 if vocab > 128 else vocab
  if vocab % block:  # pad the vocabulary with never-chosen tokens
    pad = block - vocab % block
    x = jnp.concatenate([x, jnp.full((rows, pad), DISALLOWED_LOGIT, jnp.float32)], axis=1)
  n_blocks = x.shape[1] // block
  chunk = block * _largest_divisor(n_blocks, max(1, chunk_size // block))
  target = row_group if row_group is not None else max(1, (1 << 19) // x.shape[1])
  group = _largest_divisor(rows, target)
  n_groups = rows // group
  if n_groups == 1:
    out = _sample_stats_rows(key, x, inv_t, chunk, block)
  else:
    keys = jax.random.split(key, n_groups)
    out = jax.lax.map(lambda a: _sample_stats_rows(a[0], a[1], inv_t, chunk, block),
                      (keys, x.reshape(n_groups, group, x.shape[1])))
  return tuple(o.reshape(lead) for o in out)


# ---- acceptance rules ---------------------------------------------------------------------------------------------
def _ascending_rank(values: Array) -> tuple[Array, Array, Array]:
  """Stable ascending sort along the last axis -> (order, sorted values, rank of each position)."""
  order = jnp.argsort(values, axis=-1, stable=True)
  sorted_values = jnp.take_along_axis(values, order, axis=-1)
  positions = jnp.broadcast_to(jnp.arange(values.shape[-1], dtype=jnp.int32), values.shape)
  rank = jnp.put_along_axis(jnp.zeros(values.shape, jnp.int32), order, positions, axis=-1, inplace=False)
  return order, sorted_values, rank


def accept_entropy_bound(token_entropy: Array, bound) -> Array:
  """Entropy-bounded acceptance: `[B, C]` entropies -> `[B, C]` bool mask of positions to accept.

  Sort the entropies ascending and accept every position whose entropy sum *before* it is within the bound,
  `cumsum(sorted) - sorted <= bound` (so the lowest-entropy position is always accepted). Ties keep position order
  (stable sort); transformers' `torch.sort` on CPU is unstable for rows longer than 16, which only matters when
  exactly equal entropies straddle the bound.
  """
  token_entropy = token_entropy.astype(jnp.float32)
  order, sorted_entropy, _ = _ascending_rank(token_entropy)
  cumulative = jnp.cumsum(sorted_entropy, axis=-1)
  sorted_accept = (cumulative - sorted_entropy) <= bound
  return jnp.put_along_axis(jnp.zeros(token_entropy.shape, bool), order, sorted_accept, axis=-1, inplace=False)


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
