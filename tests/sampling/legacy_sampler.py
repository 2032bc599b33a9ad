"""The row-group sampler of the previous release (the statistics streamed per row group, not vectorised), kept as
the reference for the exact-equality tests (`test_sampler_cost.py`) and the "before" of `scripts/benchmark_sampler.py`.

Frozen: do not edit. `sample_argmax_entropy` here streams the vocabulary in chunks (`lax.scan`) and processes rows
in groups of about 2^19 logits (`lax.map`), i.e. a sequential loop whose trip count grows with the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
DISALLOWED_LOGIT = -1e9


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
