"""Attention with a fixed-capacity KV cache, in the two DiffusionGemma modes.

*Encoder mode* (causal; writes the cache): the new tokens' keys/values are written at each row's `cache.length`
and every query attends to the cache slots at or before its own position (sliding layers: the last
`sliding_window` positions, itself included).
*Decoder mode* (bidirectional; reads the cache): the canvas attends to the valid cached prefix and to the whole
canvas. On sliding layers only the last `sliding_window - 1` cached positions are visible, which is what
transformers' sliding cache keeps (transformers `DynamicSlidingWindowLayer`).

Cost scales with the prompt: when the cache is at least twice a sliding layer's key span (and of at least
`BAND_MIN_CAPACITY` slots), the encoder computes that layer over the band only (`banded_encoder_attention`: query
chunks of `window // 4`, each against its own `chunk + window - 1` gathered slots rounded up to even, O(L x window)
instead of O(L x S)) and the decoder reads only the `window - 1` prefix slots (`sliding_prefix`; one more when
that makes the key length even: cuDNN's condition). Full layers stay O(L x S) in FLOPs; for long prompts they run
one query chunk at a time (`chunked_encoder_attention`), so their scores need O(chunk x S) memory. Blocks with
head_dim <= 256 run through `jax.nn.dot_product_attention` (cuDNN flash attention on an NVIDIA GPU in bf16/fp16,
`attention_implementation`; XLA elsewhere), wider heads through `attend_einsum`. All paths compute the same
function within fp32 rounding (tests/model/test_attention.py keeps the original dense implementation as the
reference).

With `ModelConfig.use_bidirectional_attention == "vision"` the encoder's queries also see the keys of their own
image block (`VisionBlocks`, `model.vision_attention`), in every path: `encoder_mask`, the band (its key span
widened by the longest block) and the query chunks.

Slot `j` of the cache holds position `j` (prompt positions are a plain `arange`, also with left padding), so
positions and slots coincide and a per-row `length` lets one batch hold prefixes of different lengths (training
decodes a different canvas per example).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import layers
from hackable_diffusion.model.kv_cache import write_rows
from hackable_diffusion.model.config import SLIDING, ModelConfig
from hackable_diffusion.model.vision_attention import VisionBlocks

Array = jax.Array
_NEG = -1e30  # masked score; a row with no visible key (a padding query) becomes uniform


def _visible(valid: Array, slots: Array, q_pos: Array, window: int | None, first: Array | None = None,
             last: Array | None = None) -> Array:
  """valid/slots [..., S] (a key's flag and slot), q_pos [..., L] -> [..., L, S] bool: causal (+ sliding window).
  first/last [..., L]: each query's bidirectional block (`VisionBlocks`), whose keys it sees as well."""
  k, q = slots[..., None, :], q_pos[..., :, None]
  end = q if last is None else jnp.maximum(q, last[..., :, None])
  mask = valid[..., None, :] & (k <= end)
  if window is not None:
    near = k > q - window
    mask &= near if first is None else near | (k >= first[..., :, None])
  return mask


def encoder_mask(valid: Array, q_pos: Array, window: int | None, blocks: VisionBlocks | None = None) -> Array:
  """valid [B, S], q_pos [B, L] -> [B, L, S] bool: causal (+ sliding window of `window` keys incl. itself), and the
  keys of each query's own block where `blocks` [B, L] are given."""
  first, last = (None, None) if blocks is None else (blocks.first, blocks.last)
  return _visible(valid, jnp.arange(valid.shape[1])[None, :], q_pos, window, first, last)


def decoder_prefix_mask(valid: Array, length: Array, window: int | None) -> Array:
  """valid [B, S], length [B] -> [B, S] bool: the cached prefix a canvas sees (sliding: last `window - 1`)."""
  slots = jnp.arange(valid.shape[1])[None, :]
  mask = valid & (slots < length[:, None])
  if window is not None:
    mask &= slots >= length[:, None] - (window - 1)
  return mask


# Blocks whose head_dim fits cuDNN's flash attention (<= 256) go through `jax.nn.dot_product_attention` (cuDNN on
# GPU where `attention_implementation` allows); wider heads (the 512-dim full layers) through the einsum below.
# Both are the same XLA computation on CPU.
FUSED_MAX_HEAD_DIM = 256


def attend_einsum(q: Array, k: Array, v: Array, mask: Array, dtype) -> Array:
  """Grouped-query attention with scaling 1.0 (q/k norms replace 1/sqrt(d)), fp32 scores and softmax.

  q [B, L, N, D], k/v [B, S, Nkv, D], mask [B, L, S] or [B, N, L, S] bool -> [B, L, N, D].
  A row with no visible key attends uniformly to all S keys (only queries at padding positions have none).
  """
  b, l, n, d = q.shape
  nkv = k.shape[2]
  qg = q.reshape(b, l, nkv, n // nkv, d)  # [B, L, kv, group, D]
  scores = jnp.einsum("blkgd,bskd->bkgls", qg, k).astype(jnp.float32)  # [B, kv, group, L, S]
  if mask.ndim == 3:  # [B, L, S]
    mask = mask[:, None, None]
  else:  # [B, N, L, S]
    mask = mask.reshape(b, nkv, n // nkv, *mask.shape[2:])
  scores = jnp.where(mask, scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
  return out.reshape(b, l, n, d)


def attention_implementation(platform: str, dtype, head_dim: int, q_len: int, kv_len: int,
                             compute_capability: float | None = None) -> str:
  """`jax.nn.dot_product_attention`'s `implementation` for one block: 'cudnn' (flash attention) on an NVIDIA GPU
  (`platform` 'gpu') with bf16/fp16 inputs, a head_dim that is a multiple of 8 and <= 256 (<= 128 before Hopper,
  `compute_capability` < 9; None: assume Hopper or later) and even query / key lengths (cuDNN's condition for a
  masked training pass); 'xla' otherwise (the 512-dim full layers, fp32, CPU, TPU)."""
  max_head_dim = 256 if compute_capability is None or compute_capability >= 9.0 else 128
  fits = head_dim <= max_head_dim and head_dim % 8 == 0 and q_len % 2 == 0 and kv_len % 2 == 0
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return "cudnn" if platform == "gpu" and half and fits else "xla"


def _device_compute_capability() -> float | None:
  """The first device's CUDA compute capability (e.g. 9.0), None where it has none (CPU, TPU, ROCm)."""
  value = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return float(value) if value is not None else None
  except (TypeError, ValueError):
    return None


@functools.lru_cache(maxsize=64)
def warn_cudnn_refused(q_shape: tuple[int, ...], k_shape: tuple[int, ...], reason: str) -> None:
  """One warning per refused block shape (the cache keeps a repeated trace quiet)."""
  logging.warning("cuDNN attention refused q %s, k %s (%s); the XLA path runs instead", q_shape, k_shape, reason)


def attend(q: Array, k: Array, v: Array, mask: Array, dtype) -> Array:
  """`attend_einsum`'s function, through `jax.nn.dot_product_attention` where the head_dim allows (fp32 softmax,
  scale 1.0, GQA by its kv-head grouping; its mask is `[B, 1 or N, L, S]`), with cuDNN flash attention where
  `attention_implementation` says it applies; where cuDNN refuses the block when it is traced (a shape or a cuDNN
  build it does not support), the XLA path runs instead, with one warning per block shape. Float64 compute (the
  float64 parity checks, scripts/float64_parity.py) takes the einsum: `dot_product_attention` computes its softmax
  in float32."""
  if q.shape[-1] > FUSED_MAX_HEAD_DIM or jnp.dtype(dtype).itemsize > 4:
    return attend_einsum(q, k, v, mask, dtype)
  platform = jax.default_backend()
  impl = attention_implementation(platform, dtype, q.shape[-1], q.shape[1], k.shape[1],
                                  _device_compute_capability() if platform == "gpu" else None)
  if impl != "cudnn":  # jax's XLA path: the same computation, slower than ours on CPU
    return attend_einsum(q, k, v, mask, dtype)
  try:
    out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                       mask=mask[:, None] if mask.ndim == 3 else mask, scale=1.0, implementation=impl)
  except (ValueError, NotImplementedError, RuntimeError) as e:  # cuDNN refused this shape or build at trace time
    warn_cudnn_refused(q.shape, k.shape, " ".join(str(e).split())[:200])
    return attend_einsum(q, k, v, mask, dtype)
  return out.astype(dtype)


# ---- banded sliding-window attention ------------------------------------------------------------------------------
# A sliding layer's query at position p sees at most the keys in slots (p - window, p]. Queries are cut into chunks
# of C consecutive positions; chunk i (positions q0 .. q0 + C - 1) reads the span of C + window - 1 slots ending at
# its last query (one more, masked, when that is odd: `band_span`), so the scores cost L x (C + window - 1) per head
# instead of L x S. With C = window / 4 that is <= 1.25x the band itself (L x window). The span is gathered with a
# clamped `dynamic_slice` per (row, chunk); the mask is computed from the slots actually gathered, so clamping at
# either end of the cache changes nothing.
BAND_CHUNK_FRACTION = 4  # C = window // 4
BAND_MIN_CAPACITY = 1024  # smaller caches keep the dense path (banding tiny problems only adds gathers)


def band_chunk(num_queries: int, window: int) -> int:
  """Query chunk size C of the banded path (all queries in one chunk when there are fewer than window // 4)."""
  return max(1, min(num_queries, window // BAND_CHUNK_FRACTION))


def band_back(window: int, reach: int = 1) -> int:
  """How many slots before its first query a chunk reads: `window - 1`, or `reach - 1` when a block (`reach` the
  longest) reaches further back."""
  return max(window, reach) - 1


def band_span(chunk: int, window: int, reach: int = 1) -> int:
  """Key slots a query chunk reads: `chunk + window - 1` (+ `reach - 1` ahead of its last query, and further back
  when `reach > window`, for the bidirectional blocks of `VisionBlocks.reach`), rounded up to even (cuDNN's flash
  attention wants even key lengths for a masked training pass, `attention_implementation`; the extra slot is
  masked)."""
  span = chunk + band_back(window, reach) + reach - 1
  return span + span % 2


def band_pays(num_queries: int, capacity: int, window: int | None, reach: int = 1) -> bool:
  """Whether a sliding layer's encoder pass takes the banded path: a cache of at least `BAND_MIN_CAPACITY` slots
  and at least twice the key span of a query chunk."""
  if window is None or capacity < BAND_MIN_CAPACITY:
    return False
  return 2 * band_span(band_chunk(num_queries, window), window, reach) <= capacity


def _gather_spans(x: Array, first: Array, span: int) -> Array:
  """x [B, S, ...], first [B, n] (slots, in range) -> [B, n, span, ...]: slots first .. first + span - 1."""
  one = lambda row, f: jax.lax.dynamic_slice_in_dim(row, f, span, axis=0)
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(x, first)


def banded_encoder_attention(q: Array, cache_k: Array, cache_v: Array, valid: Array, start: Array, window: int,
                             dtype, blocks: VisionBlocks | None = None) -> Array:
  """Causal sliding-window attention of `q [B, L, N, D]` at positions `start [B] + arange(L)` over the (written)
  cache `[B, S, kv, D]` with `valid [B, S]`, computed over each query chunk's key span only -> [B, L, N, D].

  Same function as `attend(q, cache_k, cache_v, encoder_mask(valid, start + arange(L), window, blocks))` on every
  query that sees a key (a query at a padding position sees none: its output is unspecified, as in the dense path),
  for blocks no longer than `blocks.reach`.
  """
  b, l, n, d = q.shape
  s = cache_k.shape[1]
  c = band_chunk(l, window)
  num_chunks = -(-l // c)
  reach = 1 if blocks is None else blocks.reach
  span = band_span(c, window, reach)
  chunk_pos = c * jnp.arange(num_chunks, dtype=jnp.int32)  # [n]: offset of each chunk's first query
  first = jnp.clip(start[:, None] + chunk_pos[None, :] - band_back(window, reach), 0, s - span)  # [B, n]
  slots = first[..., None] + jnp.arange(span, dtype=jnp.int32)  # [B, n, span]
  q_pos = start[:, None, None] + chunk_pos[None, :, None] + jnp.arange(c, dtype=jnp.int32)  # [B, n, C]
  bounds = (None, None)
  if blocks is not None:  # [B, n, C] each
    chunked = blocks.padded(num_chunks * c)
    bounds = (chunked.first.reshape(b, num_chunks, c), chunked.last.reshape(b, num_chunks, c))
  mask = _visible(_gather_spans(valid, first, span), slots, q_pos, window, *bounds)  # [B, n, C, span]
  keys = _gather_spans(cache_k, first, span).astype(dtype).reshape(b * num_chunks, span, *cache_k.shape[2:])
  values = _gather_spans(cache_v, first, span).astype(dtype).reshape(b * num_chunks, span, *cache_v.shape[2:])
  qc = jnp.pad(q, ((0, 0), (0, num_chunks * c - l), (0, 0), (0, 0))).reshape(b * num_chunks, c, n, d)
  out = attend(qc, keys, values, mask.reshape(b * num_chunks, c, span), dtype)  # [B*n, C, N, D]
  return out.reshape(b, num_chunks * c, n, d)[:, :l]


# ---- query-chunked dense attention (full layers, long prompts) ---------------------------------------------------
# A full layer's query sees every earlier slot, so its FLOPs stay O(L x S); its memory need not: queries in chunks
# of FULL_QUERY_CHUNK, one chunk at a time (`lax.map`), each chunk recomputed in the backward pass
# (`jax.checkpoint`), hold fp32 scores `[B, kv, group, C, S]` instead of `[B, kv, group, L, S]`.
FULL_QUERY_CHUNK = 1024


def chunked_encoder_attention(q: Array, keys: Array, values: Array, valid: Array, start: Array, window: int | None,
                              dtype, chunk: int, blocks: VisionBlocks | None = None) -> Array:
  """`attend(q, keys, values, encoder_mask(valid, start + arange(L), window, blocks))` one query chunk at a time.

  q [B, L, N, D], keys/values [B, S, kv, D] (in `dtype`), valid [B, S], start [B] -> [B, L, N, D].
  """
  b, l, n, d = q.shape
  num_chunks = -(-l // chunk)
  qc = jnp.pad(q, ((0, 0), (0, num_chunks * chunk - l), (0, 0), (0, 0))).reshape(b, num_chunks, chunk, n, d)
  per_chunk = lambda a: jnp.moveaxis(a.reshape(b, num_chunks, chunk), 1, 0)  # noqa: E731  [B, n*C] -> [n, B, C]
  padded = None if blocks is None else blocks.padded(num_chunks * chunk)
  bounds = None if padded is None else (per_chunk(padded.first), per_chunk(padded.last))

  @jax.checkpoint
  def one(args: tuple[Array, Array, tuple[Array, Array] | None]) -> Array:
    q_chunk, offset, chunk_bounds = args  # [B, C, N, D], [], ([B, C], [B, C]) or None
    q_pos = start[:, None] + offset + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [B, C]
    chunk_blocks = None if chunk_bounds is None else VisionBlocks(*chunk_bounds)
    return attend(q_chunk, keys, values, encoder_mask(valid, q_pos, window, chunk_blocks), dtype)

  offsets = chunk * jnp.arange(num_chunks, dtype=jnp.int32)
  out = jax.lax.map(one, (jnp.moveaxis(qc, 1, 0), offsets, bounds))  # [n, B, C, N, D]
  return jnp.moveaxis(out, 0, 1).reshape(b, num_chunks * chunk, n, d)[:, :l]


def encoder_attention(q: Array, cache_k: Array, cache_v: Array, valid: Array, start: Array, window: int | None,
                      dtype, blocks: VisionBlocks | None = None) -> Array:
  """Encoder-mode attention of `q [B, L, N, D]` (positions `start + arange(L)`) over the written cache: banded on
  sliding layers when it pays (`band_pays`), else dense over all S slots with `encoder_mask`, one query chunk at a
  time when there are at least 2 x `FULL_QUERY_CHUNK` queries. `blocks`: each query's bidirectional image block
  (None: causal). -> [B, L, N, D]."""
  b, l = q.shape[:2]
  if band_pays(l, cache_k.shape[1], window, 1 if blocks is None else blocks.reach):
    return banded_encoder_attention(q, cache_k, cache_v, valid, start, window, dtype, blocks)
  keys, values = cache_k.astype(dtype), cache_v.astype(dtype)
  if l >= 2 * FULL_QUERY_CHUNK and cache_k.shape[1] >= BAND_MIN_CAPACITY:
    return chunked_encoder_attention(q, keys, values, valid, start, window, dtype, FULL_QUERY_CHUNK, blocks)
  q_pos = start[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
  return attend(q, keys, values, encoder_mask(valid, q_pos, window, blocks), dtype)  # mask [B, L, S]


def prefix_band_pays(capacity: int, window: int | None) -> bool:
  """Whether a sliding layer's decoder pass reads only `sliding_prefix`: a cache of at least `BAND_MIN_CAPACITY`
  slots and at least twice the `window - 1` it keeps."""
  return window is not None and capacity >= BAND_MIN_CAPACITY and 2 * (window - 1) <= capacity


def sliding_prefix(cache_k: Array, cache_v: Array, prefix_mask: Array, window: int,
                   span: int | None = None) -> tuple[Array, Array, Array]:
  """The `span` (default `window - 1`, at least that) cache slots that hold a sliding layer's visible prefix in
  decoder mode.

  cache_k/v [B, S, kv, D], prefix_mask [B, S] (`decoder_prefix_mask`: True only on slots within the last
  `window - 1` before `length`) -> keys/values [B, span, kv, D] and their mask [B, span]; the span starts at each
  row's first visible slot (clamped into the cache; a row with none gets an all-False mask).
  """
  span = window - 1 if span is None else span
  first = jnp.clip(jnp.argmax(prefix_mask, axis=1), 0, prefix_mask.shape[1] - span)[:, None]  # [B, 1]
  take = lambda x: _gather_spans(x, first, span)[:, 0]
  return take(cache_k), take(cache_v), take(prefix_mask)


class Attention(nnx.Module):
  """Self-attention of one layer (shared by encoder and decoder mode).

  `q = rope(q_norm(q_proj x))`, `k = rope(k_norm(k_proj x))`, `v = v_norm(v_proj x)`; full-attention layers have
  no `v_proj`: V is the raw `k_proj` output through `v_norm` (no weight).
  """

  def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype, param_dtype):
    self.is_sliding = config.layer_types[layer_idx] == SLIDING
    self.window = config.sliding_window if self.is_sliding else None
    self.num_heads = config.num_attention_heads
    self.num_kv = config.layer_kv_heads(layer_idx)
    self.head_dim = config.layer_head_dim(layer_idx)
    self.dtype = dtype
    hidden, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
    kw = dict(dtype=dtype, param_dtype=param_dtype, std=std, matmul_dtype=config.matmul_dtype)
    self.q_proj = layers.linear(rngs, hidden, self.num_heads * self.head_dim, ("embed", "heads"), **kw)
    self.k_proj = layers.linear(rngs, hidden, self.num_kv * self.head_dim, ("embed", "kv"), **kw)
    self.v_proj = (
        layers.linear(rngs, hidden, self.num_kv * self.head_dim, ("embed", "kv"), **kw) if self.is_sliding else None
    )
    self.o_proj = layers.linear(rngs, self.num_heads * self.head_dim, hidden, ("heads", "embed"), **kw)
    self.q_norm = layers.RMSNorm(self.head_dim, eps=eps, param_dtype=param_dtype, axis_name=None)
    self.k_norm = layers.RMSNorm(self.head_dim, eps=eps, param_dtype=param_dtype, axis_name=None)
    self.v_norm = layers.RMSNorm(self.head_dim, eps=eps, with_scale=False)

  def qkv(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
    """x [B, L, H] -> q [B, L, N, D], k/v [B, L, Nkv, D]."""
    b, l, _ = x.shape
    flat = layers.tokens_2d(x)  # [B*L, H]
    q = self.q_proj(flat).reshape(b, l, self.num_heads, self.head_dim)
    q = layers.apply_rope(self.q_norm(q), cos, sin)
    raw_k = self.k_proj(flat).reshape(b, l, self.num_kv, self.head_dim)
    raw_v = raw_k if self.v_proj is None else self.v_proj(flat).reshape(b, l, self.num_kv, self.head_dim)
    k = layers.apply_rope(self.k_norm(raw_k), cos, sin)
    return q, k, self.v_norm(raw_v)

  def encode(self, x: Array, cos: Array, sin: Array, cache_k: Array, cache_v: Array, start: Array,
             valid: Array, blocks: VisionBlocks | None = None) -> tuple[Array, Array, Array]:
    """Causal attention that writes its keys/values into the cache at `start [B]`.

    valid [B, S]: the cache's `valid` with this pass's tokens already written. blocks: the queries' bidirectional
    image blocks (None: causal). -> (out, cache_k, cache_v).
    """
    b, l, _ = x.shape
    q, k, v = self.qkv(x, cos, sin)
    cache_k = write_rows(cache_k, k, start)
    cache_v = write_rows(cache_v, v, start)
    extra = {} if blocks is None else {"blocks": blocks}  # a causal pass uses the 7-argument form (a test swaps it)
    out = encoder_attention(q, cache_k, cache_v, valid, start, self.window, self.dtype, **extra)
    return self.o_proj(out.reshape(b * l, -1)).reshape(b, l, -1), cache_k, cache_v

  def decode(self, x: Array, cos: Array, sin: Array, cache_k: Array, cache_v: Array, prefix_mask: Array,
             canvas_mask: Array | None) -> Array:
    """Bidirectional attention over cache + canvas; never writes.

    prefix_mask [B, S]; canvas_mask [B|1, N|1, C, P + C] (task structure, `structure.canvas_mask`): its last C
    columns restrict canvas-to-canvas attention, its first P (often 0) the first P cache slots.
    """
    b, c, _ = x.shape
    q, k, v = self.qkv(x, cos, sin)
    p = 0 if canvas_mask is None else canvas_mask.shape[-1] - c
    if p == 0 and prefix_band_pays(cache_k.shape[1], self.window):  # read the window's slots only (+1: even keys)
      span = self.window - 1 + (self.window - 1 + c) % 2
      cache_k, cache_v, prefix_mask = sliding_prefix(cache_k, cache_v, prefix_mask, self.window, span)
    keys = jnp.concatenate([cache_k.astype(self.dtype), k], axis=1)
    values = jnp.concatenate([cache_v.astype(self.dtype), v], axis=1)
    if canvas_mask is None:
      mask = jnp.concatenate([prefix_mask, jnp.ones((b, c), bool)], axis=1)[:, None, :]  # [B, 1, S+C]
      mask = jnp.broadcast_to(mask, (b, c, mask.shape[-1]))
    else:
      n, s = self.num_heads, prefix_mask.shape[1]
      if p > s:
        raise ConfigError(f"the attention structure constrains {p} prompt slots but the cache holds {s}")
      prefix = jnp.broadcast_to(prefix_mask[:, None, None, :], (b, n, c, s))
      if p:  # [B|1, N|1, C, P] structure over the first P slots; the rest of the cache as the prefix mask says
        prefix = prefix & jnp.pad(canvas_mask[..., :p], [(0, 0)] * 3 + [(0, s - p)], constant_values=True)
      mask = jnp.concatenate([prefix, jnp.broadcast_to(canvas_mask[..., p:], (b, n, c, c))], axis=-1)
    out = attend(q, keys, values, mask, self.dtype)
    return self.o_proj(out.reshape(b * c, -1)).reshape(b, c, -1)
