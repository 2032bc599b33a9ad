"""Attention that scales with the prompt: banded sliding layers, query-chunked full layers and
`jax.nn.dot_product_attention` blocks equal the original dense attention (kept below as the reference), values and
gradients in fp32; at 8k tokens the banded encoder pass costs close to its band's FLOPs and the chunked full layer
holds one chunk's scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion.model import attention
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma

TOL = 1e-5


# ---- the original implementation (before the banded path), the reference --------------------------------------
def old_encoder_mask(valid, q_pos, window):
  """valid [B, S], q_pos [B, L] -> [B, L, S] bool over the whole cache."""
  slots = jnp.arange(valid.shape[1])[None, None, :]
  q = q_pos[:, :, None]
  mask = valid[:, None, :] & (slots <= q)
  if window is not None:
    mask &= slots > q - window
  return mask


def old_attend(q, k, v, mask, dtype):
  """q [B, L, N, D], k/v [B, S, Nkv, D], mask [B, L, S] or [B, N, L, S]: fp32 scores over every slot."""
  b, l, n, d = q.shape
  nkv = k.shape[2]
  qg = q.reshape(b, l, nkv, n // nkv, d)
  scores = jnp.einsum("blkgd,bskd->bkgls", qg, k).astype(jnp.float32)
  mask = mask[:, None, None] if mask.ndim == 3 else mask.reshape(b, nkv, n // nkv, *mask.shape[2:])
  scores = jnp.where(mask, scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum("bkgls,bskd->blkgd", probs, v).reshape(b, l, n, d)


def old_encoder_attention(q, cache_k, cache_v, valid, start, window, dtype):
  q_pos = start[:, None] + jnp.arange(q.shape[1])[None, :]
  return old_attend(q, cache_k, cache_v, old_encoder_mask(valid, q_pos, window), dtype)


def use_old_attention(monkeypatch):
  """Make the model run the original dense attention everywhere."""
  monkeypatch.setattr(attention, "encoder_attention", old_encoder_attention)
  monkeypatch.setattr(attention, "attend", old_attend)
  monkeypatch.setattr(attention, "prefix_band_pays", lambda capacity, window: False)


@pytest.fixture(autouse=True)
def band_small_caches(monkeypatch):
  """The banded paths at test sizes (by default caches under 1,024 slots stay dense)."""
  monkeypatch.setattr(attention, "BAND_MIN_CAPACITY", 0)


# ---- helpers ------------------------------------------------------------------------------------------------------
def _normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _pass(rng, b, s, lengths_before, l, n, nkv, d, pad):
  """A cache of capacity `s` holding `lengths_before [B]` earlier positions, `l` new tokens (`pad [B]` of them
  left padding) already written: q [B, L, N, D], cache k/v [B, S, kv, D], valid [B, S], start [B], and a [B, L]
  weight that is 0 on queries with no visible key (padding queries: their output is unspecified)."""
  start = jnp.asarray(lengths_before, jnp.int32)
  slots = np.arange(s)[None]
  st, pd = np.asarray(lengths_before)[:, None], np.asarray(pad)[:, None]
  first_prompt = np.where(st > 0, 0, pd)  # earlier blocks: all valid; else the first non-padding slot
  valid = ((slots >= first_prompt) & (slots < st + l)) & ~((slots >= st) & (slots < st + pd))
  weight = np.ones((b, l), np.float32)
  for i in range(b):
    if st[i, 0] == 0:
      weight[i, :pd[i, 0]] = 0.0
  return (_normal(rng, (b, l, n, d)), _normal(rng, (b, s, nkv, d)), _normal(rng, (b, s, nkv, d)),
          jnp.asarray(valid), start, jnp.asarray(weight))


def _value_and_grads(fn, q, k, v, weight, probe):
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * probe * weight[:, :, None, None]), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out * weight[:, :, None, None], grads


def _max_err(a, b):
  """Largest |a - b| over the leaves, relative to max(1, the largest |b| of that leaf): fp32 rounding of scores
  of order sqrt(head_dim) (q/k are RMS-normed and the scale is 1.0) grows with the magnitude."""
  return max(float(jnp.max(jnp.abs(x - y))) / max(1.0, float(jnp.max(jnp.abs(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _grad_err(a, b):
  """Largest |a - b| over all parameter gradients relative to the gradient's scale (its largest entry)."""
  diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return diff / max(1.0, max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b)))


# ---- encoder mode -------------------------------------------------------------------------------------------------
ENCODER_CASES = {
    # name: (capacity, lengths_before, new tokens, left padding, window)
    "padded_window_shorter_than_prompt": (96, [0, 0], 40, [0, 7], 8),
    "window_longer_than_prompt": (128, [0, 0], 30, [3, 0], 40),
    "window_not_multiple_of_4": (64, [0, 0], 29, [0, 5], 7),
    "second_block_per_row_start": (96, [40, 33], 12, [0, 0], 8),  # two-block encoding, rows at different lengths
    "second_block_near_capacity": (64, [50, 9], 14, [0, 0], 16),  # spans clamped at the end of the cache
    "short_prompt_dense": (24, [0, 0], 20, [4, 0], 16),  # capacity < 2 x span: today's dense path
}


@pytest.mark.parametrize("case", list(ENCODER_CASES))
def test_encoder_attention_equals_old(case):
  s, before, l, pad, window = ENCODER_CASES[case]
  b, n, nkv, d = 2, 4, 2, 16
  rng = np.random.default_rng(0)
  q, k, v, valid, start, weight = _pass(rng, b, s, before, l, n, nkv, d, pad)
  probe = _normal(rng, q.shape)
  banded = attention.band_pays(l, s, window)
  assert banded == (case != "short_prompt_dense")
  new = jax.jit(lambda q, k, v: attention.encoder_attention(q, k, v, valid, start, window, jnp.float32))
  old = jax.jit(lambda q, k, v: old_encoder_attention(q, k, v, valid, start, window, jnp.float32))
  out_new, g_new = _value_and_grads(new, q, k, v, weight, probe)
  out_old, g_old = _value_and_grads(old, q, k, v, weight, probe)
  assert _max_err(out_new, out_old) <= TOL
  assert _max_err(g_new, g_old) <= TOL
  assert float(jnp.max(jnp.abs(out_old))) > 0.1  # not trivially zero


def test_full_layers_and_wide_heads_equal_old():
  """No window (full layers) and head_dim 512 (> 256: the einsum path) are unchanged."""
  rng = np.random.default_rng(1)
  q, k, v, valid, start, weight = _pass(rng, 2, 64, [0, 0], 40, 4, 1, 512, [0, 9])
  probe = _normal(rng, q.shape)
  for window in (None, 8):
    new = lambda q, k, v: attention.encoder_attention(q, k, v, valid, start, window, jnp.float32)
    old = lambda q, k, v: old_encoder_attention(q, k, v, valid, start, window, jnp.float32)
    out_new, g_new = _value_and_grads(jax.jit(new), q, k, v, weight, probe)
    out_old, g_old = _value_and_grads(jax.jit(old), q, k, v, weight, probe)
    assert _max_err(out_new, out_old) <= TOL and _max_err(g_new, g_old) <= TOL


@pytest.mark.parametrize("window", [None, 24])
def test_query_chunked_full_attention_equals_old(monkeypatch, window):
  """Long prompts on full layers (and sliding layers whose band does not pay): queries in chunks (here 8, L=37,
  so the last chunk is padded), left padding and a second block at per-row starts."""
  monkeypatch.setattr(attention, "FULL_QUERY_CHUNK", 8)
  rng = np.random.default_rng(4)
  q, k, v, valid, start, weight = _pass(rng, 2, 48, [0, 0], 37, 4, 2, 16, [0, 6])
  probe = _normal(rng, q.shape)
  assert not attention.band_pays(37, 48, window)
  new = lambda q, k, v: attention.encoder_attention(q, k, v, valid, start, window, jnp.float32)
  old = lambda q, k, v: old_encoder_attention(q, k, v, valid, start, window, jnp.float32)
  out_new, g_new = _value_and_grads(jax.jit(new), q, k, v, weight, probe)
  out_old, g_old = _value_and_grads(jax.jit(old), q, k, v, weight, probe)
  assert _max_err(out_new, out_old) <= TOL and _max_err(g_new, g_old) <= TOL


# ---- whole model: encoder + decoder (sliding prefix), canvas masks, two blocks ------------------------------------
def _model(window, heads_kv=(4, 2), head_dim=16):
  config = get_preset("tiny", num_hidden_layers=3, layer_types=("sliding_attention", "sliding_attention",
                                                                 "full_attention"),
                      sliding_window=window, num_attention_heads=heads_kv[0], num_key_value_heads=heads_kv[1],
                      head_dim=head_dim, global_head_dim=2 * head_dim, dtype="float32", param_dtype="float32")
  return DiffusionGemma(config, rngs=nnx.Rngs(0))


def _model_run(model, prompt, mask, block, canvas, canvas_mask, capacity):
  """Encode the prompt, then a second block; decode the canvas with a canvas mask -> logits and the encoder's
  hidden states on the non-padding positions (summed into one loss for the gradient)."""
  cache = model.init_cache(prompt.shape[0], capacity)
  h1, cache = model.encode(prompt, cache, mask)
  h2, cache = model.encode(block, cache)
  logits = model.decode(canvas, cache, canvas_attention_mask=canvas_mask)
  return logits, h1 * mask[..., None], h2


@pytest.mark.slow  # the whole model twice; the transformers parity tests cover the same paths
def test_model_equals_old_attention(monkeypatch):
  """Left-padded prompt longer than the window, a second encoded block, a decoder canvas with a per-head task
  mask, every sliding layer banded: logits, hidden states and parameter gradients equal the dense original."""
  window = 6
  model = _model(window)
  b, p, c, capacity = 2, 30, 8, 96
  rng = np.random.default_rng(2)
  vocab = model.config.vocab_size
  prompt = jnp.asarray(rng.integers(3, vocab, (b, p)), jnp.int32)
  mask = jnp.asarray(np.arange(p)[None] >= np.array([[0], [11]]))
  block = jnp.asarray(rng.integers(3, vocab, (b, 10)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, vocab, (b, c)), jnp.int32)
  canvas_mask = jnp.asarray(rng.random((1, model.config.num_attention_heads, c, c)) < 0.5) | jnp.eye(c, dtype=bool)
  assert attention.band_pays(p, capacity, window) and attention.prefix_band_pays(capacity, window)
  graphdef, params = nnx.split(model)
  probes = [_normal(rng, (b, c, vocab)), _normal(rng, (b, p, model.config.hidden_size)),
            _normal(rng, (b, 10, model.config.hidden_size))]

  def run(params):
    outs = _model_run(nnx.merge(graphdef, params), prompt, mask, block, canvas, canvas_mask, capacity)
    return sum(jnp.sum(o * pr) for o, pr in zip(outs, probes)), outs

  (_, outs_new), g_new = jax.jit(jax.value_and_grad(run, has_aux=True))(params)
  use_old_attention(monkeypatch)
  (_, outs_old), g_old = jax.jit(jax.value_and_grad(run, has_aux=True))(params)
  print(f"window {window}: outputs {_max_err(outs_new, outs_old):.2e}, gradients {_grad_err(g_new, g_old):.2e}")
  assert _max_err(outs_new, outs_old) <= TOL
  assert _grad_err(g_new, g_old) <= TOL


def test_sliding_prefix_covers_the_visible_slots():
  """`sliding_prefix` keeps every visible slot (also near both ends of the cache and for empty rows)."""
  s, window = 32, 6
  rng = np.random.default_rng(3)
  valid = jnp.asarray(rng.random((5, s)) < 0.8)
  length = jnp.asarray([0, 3, 17, 31, 32], jnp.int32)
  prefix = attention.decoder_prefix_mask(valid, length, window)
  keys = jnp.broadcast_to(jnp.arange(s, dtype=jnp.float32)[None, :, None, None], (5, s, 1, 1))
  for span in (window - 1, window):  # the decoder takes one more slot when that makes the key length even
    k, _, m = attention.sliding_prefix(keys, keys, prefix, window, span)
    assert k.shape[1] == span
    for row in range(5):
      want = set(np.flatnonzero(np.asarray(prefix[row])))
      got = set(np.asarray(k[row, :, 0, 0])[np.asarray(m[row])].astype(int))
      assert got == want


# ---- cost ---------------------------------------------------------------------------------------------------------
def _flops(fn, *shapes):
  return jax.jit(fn).lower(*shapes).compile().cost_analysis()["flops"]


def test_default_threshold_keeps_short_prompts_dense(monkeypatch):
  monkeypatch.setattr(attention, "BAND_MIN_CAPACITY", 1024)
  assert not attention.band_pays(512, 512, 128) and not attention.prefix_band_pays(512, 128)
  assert attention.band_pays(8192, 8192, 1024) and attention.prefix_band_pays(8192, 1024)
  assert attention.band_pays(32, 4096, 1024)  # a committed canvas appended to a long cache
  assert not attention.band_pays(8192, 8192, None)  # full layers


def test_sliding_encoder_flops_close_to_band_at_8k():
  """Encoder pass of one sliding layer at prompt 8,192 and window 1,024 (the default 8 heads, 4 kv heads,
  head_dim 256; B=1; attention core from q and the written cache to the attention output, no projections):
  XLA's FLOPs within 1.5x of the band's 2 matmuls of L x window x D per head (4 L W D N), 8x fewer than dense."""
  b, l, n, nkv, d, window = 1, 8192, 8, 4, 256, 1024
  f32 = jnp.float32
  shapes = (jax.ShapeDtypeStruct((b, l, n, d), f32), jax.ShapeDtypeStruct((b, l, nkv, d), f32),
            jax.ShapeDtypeStruct((b, l, nkv, d), f32), jax.ShapeDtypeStruct((b, l), bool),
            jax.ShapeDtypeStruct((b,), jnp.int32))
  band = 4 * l * window * d * n
  new = _flops(lambda q, k, v, valid, st: attention.encoder_attention(q, k, v, valid, st, window, f32), *shapes)
  old = _flops(lambda q, k, v, valid, st: old_encoder_attention(q, k, v, valid, st, window, f32), *shapes)
  print(f"band {band:.3e}  banded {new:.3e} ({new / band:.3f}x)  dense {old:.3e} ({old / band:.3f}x)")
  assert new <= 1.5 * band
  assert old >= 7 * band


def test_full_layer_encoder_memory_at_8k():
  """A full layer's encoder pass at prompt 8,192 (8 heads, 1 kv head, head_dim 512, B=1): the compiled forward's
  temporaries, and its gradient's, hold a few buffers of one query chunk's fp32 scores (8 x 1,024 x 8,192 x 4 B =
  256 MiB) instead of the whole `[B, kv, group, L, S]` (2 GiB)."""
  b, l, n, nkv, d = 1, 8192, 8, 1, 512
  f32 = jnp.float32
  shapes = (jax.ShapeDtypeStruct((b, l, n, d), f32), jax.ShapeDtypeStruct((b, l, nkv, d), f32),
            jax.ShapeDtypeStruct((b, l, nkv, d), f32), jax.ShapeDtypeStruct((b, l), bool),
            jax.ShapeDtypeStruct((b,), jnp.int32))

  def temp(attn, grad):
    fn = jax.grad(lambda *a: jnp.sum(attn(*a)), argnums=(0, 1, 2)) if grad else attn  # grad: chunks recomputed
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  chunk_scores = n * 1024 * l * 4
  for grad in (False, True):
    new = temp(lambda q, k, v, valid, st: attention.encoder_attention(q, k, v, valid, st, None, f32), grad)
    old = temp(lambda q, k, v, valid, st: old_encoder_attention(q, k, v, valid, st, None, f32), grad)
    print(f"temporaries (grad={grad}): chunked {new / 2**20:.0f} MiB, dense {old / 2**20:.0f} MiB")
    assert old >= 8 * chunk_scores  # all the dense scores
    assert new <= 4 * chunk_scores  # a few chunk-sized buffers (scores, probabilities, ...)
