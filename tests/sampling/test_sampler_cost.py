"""The sampler's statistics: equal to the streamed implementation they replaced, and their compiled cost.

Equality: `entropy_bound.step_statistics` / `sample_argmax_entropy` against the row-group sampler of the previous
release (a frozen copy in `legacy_sampler.py`) on random logits with several keys (ties, temperatures, allowed-token
masks, pinned cells, several chunks and row groups): argmax canvases bit for bit; samples bit for bit
up to a vocabulary of 2048 and in >= 99% of positions at 32k (the block masses are summed in another order, and at
a large vocabulary a token's mass is near the rounding of their cumulative sum); entropies within a few float32 ulps
and the acceptance masks they give identical (at near-zero temperature the previous entropies carried cancellation
noise of ~ulp(x / T), ~1e-2 at T = 1e-4; the new ones are ~0). Given the uniforms, samples equal a float64
inverse CDF computed here (away from float32 rounding of a token boundary).

Cost (compile only, abstract shapes, nothing allocated): one sampler step at B=8, C=256, V=262,144 as the denoising
loop runs it after the model head (statistics + softmax weights, acceptance, re-noising, the self-conditioning
input) read through XLA's `cost_analysis()` / `memory_analysis()` and the optimized HLO's while loops.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import legacy_sampler  # tests/sampling/: the previous implementation, frozen
import numpy as np
import pytest

from hackable_diffusion.sampling import denoise
from hackable_diffusion.sampling import entropy_bound as eb


def _logits(seed: int, shape: tuple[int, ...], ties: bool) -> np.ndarray:
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=shape) * 3).astype(np.float32)
  if ties:  # many exact ties, including a tie for the maximum across chunks
    x = np.round(x)
    x[..., -1] = x.max(axis=-1)
  return x


def _cases(shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
  """Plain, tied, allowed-token-restricted and pinned logits of one shape."""
  b, c, v = shape
  plain, tied = _logits(seed, shape, False), _logits(seed + 1, shape, True)
  rng = np.random.default_rng(seed + 2)
  allowed = rng.random((b, v)) < 0.3
  allowed[:, 0] = True
  restricted = np.asarray(eb.apply_allowed_tokens(jnp.asarray(plain), jnp.asarray(allowed)))
  seed_canvas = jnp.asarray(rng.integers(0, v, (b, c)), jnp.int32)
  pinned = jnp.asarray(rng.random((b, c)) < 0.4)
  pins = np.asarray(eb.pin_logits(jnp.asarray(tied), seed_canvas, pinned))
  return [plain, tied, restricted, pins]


# (shape, chunk_size, row_group): one chunk; several chunks and row groups; a padded vocabulary; the default
# chunking at a vocabulary of 32k-like width (16 chunks of 2048 here)
SHAPES = [((2, 5, 7), 2048, None), ((3, 17, 300), 256, 3), ((2, 6, 1280), 256, 4), ((2, 8, 32768), 2048, None)]


@pytest.mark.parametrize("shape,chunk_size,row_group", SHAPES)
def test_statistics_equal_the_previous_implementation(shape, chunk_size, row_group):
  before = jax.jit(lambda k, x, t: legacy_sampler.sample_argmax_entropy(k, x, t, chunk_size=chunk_size,
                                                                        row_group=row_group))
  after = jax.jit(lambda k, x, t: eb.sample_argmax_entropy(k, x, t, row_group=row_group))
  differ = total = 0
  for case, logits in enumerate(_cases(shape, seed=sum(shape))):
    for seed in range(3):
      for temp in (0.8, 0.4, 1e-4):
        key, t = jax.random.key(seed), jnp.float32(temp)
        s0, a0, e0 = (np.asarray(o) for o in before(key, logits, t))
        s1, a1, e1 = (np.asarray(o) for o in after(key, logits, t))
        where = f"case {case}, key {seed}, T {temp}"
        np.testing.assert_array_equal(a1, a0, err_msg=where)
        if shape[-1] <= 2048:
          np.testing.assert_array_equal(s1, s0, err_msg=where)
        differ, total = differ + int((s1 != s0).sum()), total + s1.size
        if temp < 1e-3:
          # near-zero temperature: z = x / T ~ 1e5, whose ulp (~1e-2) the previous combination's cancellation
          # turned into entropies of +-4e-3 (negative ones too); the block-wise sums give ~0
          assert (np.abs(e1 - e0) <= 1e-2).all() and (e1 >= -1e-6).all(), where
          continue
        np.testing.assert_allclose(e1, e0, rtol=4e-6, atol=2e-6, err_msg=where)
        for bound in (0.1, 1.0):
          np.testing.assert_array_equal(np.asarray(eb.accept_entropy_bound(e1, bound)),
                                        np.asarray(eb.accept_entropy_bound(e0, bound)), err_msg=where)
  # at a large vocabulary one token's mass (~1/V) is near the float32 rounding of the cumulative block masses, which
  # are now summed in another order (one fused reduction): rarely, the uniform falls on the other side of a boundary
  assert differ <= 0.01 * total, (differ, total)


def test_weights_are_the_softmax_and_give_the_self_conditioning_input():
  logits = jnp.asarray(_logits(3, (2, 4, 300), False))
  temp = jnp.float32(0.6)
  stats = jax.jit(lambda x: eb.step_statistics(jax.random.key(0), x, temp, weights_dtype=jnp.float32))(logits)
  probs = jax.nn.softmax(logits / temp, axis=-1)
  assert stats.weights.shape == logits.shape and stats.weights.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(stats.weights / stats.total[..., None]), np.asarray(probs), rtol=2e-5,
                             atol=1e-7)
  embed = jnp.asarray(np.random.default_rng(0).normal(size=(300, 16)).astype(np.float32))
  soft = denoise.self_conditioning_embeddings(embed, jnp.float32, stats.weights, stats.total)
  np.testing.assert_allclose(np.asarray(soft), np.asarray(probs @ embed * 4.0), rtol=2e-5, atol=1e-5)
  assert stats.weights is not None
  assert eb.step_statistics(jax.random.key(0), logits, temp).weights is None


@pytest.mark.parametrize("shape", [(2, 6, 100), (3, 9, 300), (2, 4, 40_000)])
def test_samples_invert_the_float64_cdf(shape):
  """Given the uniforms, the sample is the token whose float64 CDF interval holds `u` (an independent computation);
  also with a per-row temperature, disallowed tokens and exact ties. Only a uniform within float32 rounding of a
  token boundary may land on the neighbour."""
  b, c, v = shape
  rng = np.random.default_rng(v)
  checked = 0
  for case, logits in enumerate(_cases(shape, seed=v)):
    temp = rng.uniform(0.2, 1.5, size=(b, 1)).astype(np.float32)
    u = rng.random((b, c)).astype(np.float32)
    stats = jax.jit(lambda x, t, u: eb.step_statistics(None, x, t, uniforms=u))(logits, temp, u)
    z = logits.astype(np.float64) * (1.0 / temp[..., None]).astype(np.float32)
    p = np.exp(z - z.max(-1, keepdims=True))
    cum = np.cumsum(p, axis=-1)
    target = u.astype(np.float64) * cum[..., -1]
    expected = np.minimum((cum <= target[..., None]).sum(-1), v - 1)
    got = np.asarray(stats.samples)
    gap = np.abs(cum - target[..., None]).min(-1) / cum[..., -1]  # distance to the nearest token boundary
    near = gap < 1e-5
    np.testing.assert_array_equal(got[~near], expected[~near], err_msg=f"case {case}")
    assert (np.abs(got[near] - expected[near]) <= 1).all(), f"case {case}"
    assert (p[np.arange(b)[:, None], np.arange(c), got] > 0).all()  # never a token of zero mass
    checked += int((~near).sum())
  assert checked >= 0.9 * 4 * b * c


# ---- compiled cost at the released vocabulary -------------------------------------------------------------------
C, V, H = 256, 262_144, 256  # H: a small embedding width (its [V, H] read is reported apart)
_SHAPE_RE = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}


def _gather_overcharge(hlo: str) -> int:
  """`cost_analysis` charges a gather its whole operand; the sampler's one gather of 128 logits per row from the
  [R, V] logits is charged 2 GiB at B=8. -> the bytes charged beyond the gathered slices (operand - output)."""
  sizes = {}
  for name, dtype, dims in _SHAPE_RE.findall(hlo):
    sizes[name] = _BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  over = 0
  for line in hlo.splitlines():
    m = re.search(r"%([\w.\-]+) = \w+\[[\d,]*\]\S* gather\(%([\w.\-]+),", line)
    if m:
      over += sizes[m.group(2)] - sizes[m.group(1)]
  return over


def _analyse(fn, *args) -> dict:
  compiled = jax.jit(fn).lower(*args).compile()
  cost, memory, hlo = compiled.cost_analysis(), compiled.memory_analysis(), compiled.as_text()
  written = cost.get("bytes accessedout{}", 0.0)
  return dict(reads=cost["bytes accessed"] - written, written=written, gather_overcharge=_gather_overcharge(hlo),
              temp=memory.temp_size_in_bytes,
              trips=sorted(int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', hlo)),
              whiles=hlo.count(" while("))


def _sampler_step(logits, sc_prev, done, key, temp, embed):
  """What `sampling.denoise` does per step after the model head (without pins / allowed tokens / callbacks)."""
  sample_key, noise_key = jax.random.split(key)
  stats = eb.step_statistics(sample_key, logits, temp, weights_dtype=embed.dtype)
  accept = eb.accept_entropy_bound(stats.entropy, 0.1)
  canvas = eb.renoise(noise_key, stats.samples, accept, logits.shape[-1])
  soft = denoise.self_conditioning_embeddings(embed, jnp.float32, stats.weights, stats.total)
  return canvas, stats.argmax, jnp.where(done[:, None, None], sc_prev, soft)


def _step_args(batch: int):
  s = jax.ShapeDtypeStruct
  return (s((batch, C, V), jnp.float32), s((batch, C, H), jnp.float32), s((batch,), bool), jax.random.key(0),
          s((), jnp.float32), s((V, H), jnp.float32))


def test_sampler_step_cost_at_the_released_vocabulary():
  logits_bytes = 8 * C * V * 4  # one fp32 logits tensor: 2 GiB
  a = _analyse(_sampler_step, *_step_args(8))
  embed_bytes = V * H * 4
  # reads: the logits once for the statistics (one fused reduce) and once more for the softmax weights, which the
  # self-conditioning product reads once; plus the [V, H] embedding and the [R, V / 128] block statistics
  reads = a["reads"] - a["gather_overcharge"]
  assert a["gather_overcharge"] <= 1.01 * logits_bytes  # the [R, 128] gather (and a [R] one from [R, V / 128])
  assert reads <= 4.0 * logits_bytes, a  # at most four reads of the logits' size, the embedding included
  assert reads - embed_bytes <= 3.2 * logits_bytes, a
  # without the self-conditioning product (the model's input, not part of `decode`): the statistics
  # and the softmax weights read the logits twice; bytes written: the weights once, plus the [R, V / 128] block
  # statistics (five arrays of 1/128 the logits' elements, written and read about twice)
  stats_only = _analyse(lambda x, k, t: eb.step_statistics(k, x, t, weights_dtype=jnp.float32),
                        _step_args(8)[0], jax.random.key(0), jax.ShapeDtypeStruct((), jnp.float32))
  assert stats_only["reads"] - stats_only["gather_overcharge"] <= 2.2 * logits_bytes, stats_only
  assert stats_only["written"] <= 1.1 * logits_bytes, stats_only
  # the statistics alone (no weights asked for): a single pass
  single = _analyse(lambda x, k, t: eb.sample_argmax_entropy(k, x, t), _step_args(8)[0], jax.random.key(0),
                    jax.ShapeDtypeStruct((), jnp.float32))
  assert single["reads"] - single["gather_overcharge"] <= 1.15 * logits_bytes, single  # + the block statistics
  # temporaries: the softmax weights are the only [B, C, V] buffer beside the logits
  assert a["temp"] <= 1.1 * logits_bytes, a


def test_sampler_step_has_no_loop_over_rows():
  small, large = _analyse(_sampler_step, *_step_args(8)), _analyse(_sampler_step, *_step_args(16))
  assert small["trips"] == large["trips"], (small["trips"], large["trips"])  # nothing grows with the batch
  assert max(small["trips"], default=0) <= V // 2048, small["trips"]  # no loop over the vocabulary's chunks either
  # the previous implementation: one loop over row pairs (1024 at B=8, 2048 at B=16) around a loop over chunks
  before = jax.jit(lambda k, x: legacy_sampler.sample_argmax_entropy(k, x, 0.5))
  hlo = before.lower(jax.random.key(0), _step_args(8)[0]).compile().as_text()
  assert 8 * C // 2 in [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', hlo)]
