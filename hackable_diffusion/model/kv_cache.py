"""`KVCache`: the keys and values of every layer that the encoder writes and the decoder reads.

Slot `j` of the cache holds position `j` (prompt positions are a plain `arange`, also with left padding), so
positions and slots coincide and a per-row `length` lets one batch hold prefixes of different lengths.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hackable_diffusion.model.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer, `valid [B, S]` (written and not padding), `length [B]`.

  Two layouts of the same numbers. Per layer (`groups == 0`): `keys[i]`, `values[i]` are layer `i`'s
  `[B, S, kv_heads, head_dim]`. Stacked (`groups = G`: what a scanned model reads and writes without copying,
  `model/scan.py`): `keys[j]` is `[G, B, S, kv_heads, head_dim]`, layers `j, j + p, ..., j + (G - 1) p` with `p =
  len(keys)` the layer period.
  """

  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  valid: Array
  length: Array
  groups: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def capacity(self) -> int:
    return self.valid.shape[1]

  def truncated(self, capacity: int) -> KVCache:
    """The first `capacity` slots (static): a reader that never looks past them attends over fewer keys."""
    cut = (slice(None),) * (2 if self.groups else 1) + (slice(None, capacity),)
    return self.replace(keys=tuple(k[cut] for k in self.keys), values=tuple(v[cut] for v in self.values),
                        valid=self.valid[:, :capacity], length=jnp.minimum(self.length, capacity))

  def batch_axes(self) -> KVCache:
    """The same tree with every array replaced by the index of its batch axis (1 for stacked keys/values)."""
    axis = 1 if self.groups else 0
    return self.replace(keys=(axis,) * len(self.keys), values=(axis,) * len(self.values), valid=0, length=0)

  def where_rows(self, which: Array, other: KVCache) -> KVCache:
    """Rows `which [B]` from this cache, the other rows from `other` (same layout)."""
    def pick(a, b, axis):
      return jnp.where(which.reshape((1,) * axis + (-1,) + (1,) * (a.ndim - axis - 1)), a, b)
    return jax.tree.map(pick, self, other, self.batch_axes())

  def take_rows(self, index: Array) -> KVCache:
    """Rows `index [B']` of this cache, in that order (copied: the numbers do not change)."""
    return jax.tree.map(lambda a, axis: jnp.take(a, index, axis=axis), self, self.batch_axes())

  def padded(self, capacity: int) -> KVCache:
    """This cache with `capacity >= self.capacity` slots (static); the added slots are empty (zero, not valid)."""
    extra = capacity - self.capacity
    if extra < 0:
      raise ValueError(f"padded: capacity {capacity} is below the cache's {self.capacity}")
    if extra == 0:
      return self
    def pad(a: Array, axis: int) -> Array:
      return jnp.pad(a, [(0, extra) if d == axis else (0, 0) for d in range(a.ndim)])
    axis = 2 if self.groups else 1
    return self.replace(keys=tuple(pad(k, axis) for k in self.keys), values=tuple(pad(v, axis) for v in self.values),
                        valid=pad(self.valid, 1))

  def regrouped(self, groups: int) -> KVCache:
    """This cache in the layout of `groups` (0: per layer; G: stacked over G groups). A copy unless unchanged."""
    if groups == self.groups:
      return self
    _check_groups(len(self.keys) * (self.groups or 1), groups)
    def per_layer(arrays: tuple[Array, ...]) -> list[Array]:
      if not self.groups:
        return list(arrays)
      return [arrays[i % len(arrays)][i // len(arrays)] for i in range(len(arrays) * self.groups)]
    def layout(arrays: tuple[Array, ...]) -> tuple[Array, ...]:
      layers = per_layer(arrays)
      if not groups:
        return tuple(layers)
      period = len(layers) // groups
      return tuple(jnp.stack(layers[j::period]) for j in range(period))
    return self.replace(keys=layout(self.keys), values=layout(self.values), groups=groups)

  @classmethod
  def empty(cls, config: ModelConfig, batch: int, capacity: int, dtype, groups: int = 0) -> KVCache:
    n = config.num_hidden_layers
    _check_groups(n, groups)
    period = n // groups if groups else n
    lead = (groups,) if groups else ()
    shapes = [lead + (batch, capacity, config.layer_kv_heads(i), config.layer_head_dim(i)) for i in range(period)]
    return cls(
        keys=tuple(jnp.zeros(s, dtype) for s in shapes),
        values=tuple(jnp.zeros(s, dtype) for s in shapes),
        valid=jnp.zeros((batch, capacity), bool),
        length=jnp.zeros((batch,), jnp.int32),
        groups=groups,
    )


def _check_groups(layers: int, groups: int) -> None:
  if groups < 0 or (groups and layers % groups):
    raise ValueError(f"KVCache: groups={groups} is invalid for {layers} layers: 0 (per layer) or a divisor of {layers}")


def write_rows(cache: Array, new: Array, start: Array) -> Array:
  """Writes `new [B, L, ...]` into `cache [B, S, ...]` at per-row offsets `start [B]`."""
  def one(c, n, s):
    return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=0)
  return jax.vmap(one)(cache, new.astype(cache.dtype), start)


__all__ = ["KVCache", "write_rows"]
