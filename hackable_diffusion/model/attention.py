"""Attention with a fixed-capacity KV cache, in the two DiffusionGemma modes.

*Encoder mode* (causal; writes the cache): the new tokens' keys/values are written at each row's `cache.length`
and every query attends to the cache slots at or before its own position (sliding layers: the last
`sliding_window` positions, itself included).
*Decoder mode* (bidirectional; reads the cache): the canvas attends to the valid cached prefix and to the whole
canvas. On sliding layers only the last `sliding_window - 1` cached positions are visible, which is what the
reference's sliding cache keeps (transformers `DynamicSlidingWindowLayer`).

Slot `j` of the cache holds position `j` (prompt positions are a plain `arange`, also with left padding), so
positions and slots coincide and a per-row `length` lets one batch hold prefixes of different lengths (training
decodes a different canvas per example).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.model import layers
from hackable_diffusion.model.config import SLIDING, ModelConfig

Array = jax.Array
_NEG = -1e30  # additive mask value; rows always keep at least one visible key


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values `[B, S, kv_heads, head_dim]`, `valid [B, S]` (written and not padding), `length [B]`."""

  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  valid: Array
  length: Array

  @property
  def capacity(self) -> int:
    return self.valid.shape[1]

  def truncated(self, capacity: int) -> KVCache:
    """The first `capacity` slots (static): a reader that never looks past them attends over fewer keys."""
    return KVCache(keys=tuple(k[:, :capacity] for k in self.keys), values=tuple(v[:, :capacity] for v in self.values),
                   valid=self.valid[:, :capacity], length=jnp.minimum(self.length, capacity))

  @classmethod
  def empty(cls, config: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
    shapes = [(batch, capacity, config.layer_kv_heads(i), config.layer_head_dim(i)) for i in range(config.num_hidden_layers)]
    return cls(
        keys=tuple(jnp.zeros(s, dtype) for s in shapes),
        values=tuple(jnp.zeros(s, dtype) for s in shapes),
        valid=jnp.zeros((batch, capacity), bool),
        length=jnp.zeros((batch,), jnp.int32),
    )


def write_rows(cache: Array, new: Array, start: Array) -> Array:
  """Writes `new [B, L, ...]` into `cache [B, S, ...]` at per-row offsets `start [B]`."""
  def one(c, n, s):
    return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0)
  return jax.vmap(one)(cache, new.astype(cache.dtype), start)


def encoder_mask(valid: Array, q_pos: Array, window: int | None) -> Array:
  """valid [B, S], q_pos [B, L] -> [B, L, S] bool: causal (+ sliding window of `window` keys incl. itself)."""
  slots = jnp.arange(valid.shape[1])[None, None, :]
  q = q_pos[:, :, None]
  mask = valid[:, None, :] & (slots <= q)
  if window is not None:
    mask &= slots > q - window
  return mask


def decoder_prefix_mask(valid: Array, length: Array, window: int | None) -> Array:
  """valid [B, S], length [B] -> [B, S] bool: the cached prefix a canvas sees (sliding: last `window - 1`)."""
  slots = jnp.arange(valid.shape[1])[None, :]
  mask = valid & (slots < length[:, None])
  if window is not None:
    mask &= slots >= length[:, None] - (window - 1)
  return mask


def attend(q: Array, k: Array, v: Array, mask: Array, dtype) -> Array:
  """Grouped-query attention with scaling 1.0 (q/k norms replace 1/sqrt(d)).

  q [B, L, N, D], k/v [B, S, Nkv, D], mask broadcastable to [B, N or 1, L, S] -> [B, L, N, D].
  """
  b, l, n, d = q.shape
  nkv = k.shape[2]
  qg = q.reshape(b, l, nkv, n // nkv, d)
  scores = jnp.einsum("blkgd,bskd->bkgls", qg, k).astype(jnp.float32)
  if mask.ndim == 3:  # [B, L, S]
    mask = mask[:, None, None]
  else:  # [B, N, L, S]
    mask = mask.reshape(b, nkv, n // nkv, *mask.shape[2:])
  scores = jnp.where(mask, scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
  return out.reshape(b, l, n, d)


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
    kw = dict(dtype=dtype, param_dtype=param_dtype, std=std)
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
             mask: Array) -> tuple[Array, Array, Array]:
    """Causal attention that writes its keys/values into the cache. mask [B, L, S] -> (out, cache_k, cache_v)."""
    b, l, _ = x.shape
    q, k, v = self.qkv(x, cos, sin)
    cache_k = write_rows(cache_k, k, start)
    cache_v = write_rows(cache_v, v, start)
    out = attend(q, cache_k.astype(self.dtype), cache_v.astype(self.dtype), mask, self.dtype)
    return self.o_proj(out.reshape(b * l, -1)).reshape(b, l, -1), cache_k, cache_v

  def decode(self, x: Array, cos: Array, sin: Array, cache_k: Array, cache_v: Array, prefix_mask: Array,
             canvas_mask: Array | None) -> Array:
    """Bidirectional attention over cache + canvas; never writes. prefix_mask [B, S]; canvas_mask [B|1, N|1, C, C]."""
    b, c, _ = x.shape
    q, k, v = self.qkv(x, cos, sin)
    keys = jnp.concatenate([cache_k.astype(self.dtype), k], axis=1)
    values = jnp.concatenate([cache_v.astype(self.dtype), v], axis=1)
    if canvas_mask is None:
      mask = jnp.concatenate([prefix_mask, jnp.ones((b, c), bool)], axis=1)[:, None, :]  # [B, 1, S+C]
      mask = jnp.broadcast_to(mask, (b, c, mask.shape[-1]))
    else:
      n = self.num_heads
      prefix = jnp.broadcast_to(prefix_mask[:, None, None, :], (b, n, c, prefix_mask.shape[1]))
      mask = jnp.concatenate([prefix, jnp.broadcast_to(canvas_mask, (b, n, c, c))], axis=-1)
    out = attend(q, keys, values, mask, self.dtype)
    return self.o_proj(out.reshape(b * c, -1)).reshape(b, c, -1)
