"""Embedding lookups from a vocabulary-sharded table without replicating it (the vocab-parallel lookup).

`jnp.take(table, ids)` on a table split along the vocabulary (`vocab` -> `tensor`) and the hidden axis (`embed` ->
`fsdp`) is a gather XLA's SPMD partitioner cannot split: it rematerialises the table whole on every device
("Involuntary full rematerialization"). `embed_lookup` runs the lookup inside `jax.shard_map` instead, as
Megatron-LM's `VocabParallelEmbedding` and MaxText do:

1. the ids (a few bytes each) are all-gathered over the mesh axes that split both the batch and the table's
   hidden axis, so each device holds every id whose embedding columns it stores;
2. each device looks its ids up in its own vocabulary rows (ids outside them read row 0 and are zeroed) and the
   partial rows are summed over the vocabulary axes (`psum`): exact, each id lives in one shard;
3. an all-to-all over those same axes sends every row's column block back to the device that holds the row, so the
   result leaves split like the batch with the hidden axis whole (the residual stream's layout). Hidden-axis
   splits over axes that do not split the batch are all-gathered.

Nothing table-sized moves. Gradients follow by autodiff (the all-to-all's transpose is an all-to-all, the psum's a
broadcast, the masked take's a scatter-add into the local rows). Outside a mesh, or where the table's vocabulary
axes also split the batch, it is `jnp.take`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from hackable_diffusion.sharding.local import row_axes, spec_axes, weight_spec
from hackable_diffusion.sharding.logical import active_mesh

Array = jax.Array
TABLE_AXES = ("vocab", "embed")


def embed_lookup(table: Array, ids: Array) -> Array:
  """table [V, H] (logical axes `vocab`, `embed`), ids [B, ...] int -> [B, ..., H] = `jnp.take(table, ids, 0)`.

  Under an active mesh (`sharding.activation_sharding`) whose sharding rules split the table, the lookup runs
  per device on its own vocabulary rows (see the module docstring); the result is split like the batch.
  """
  mesh = active_mesh()
  if mesh is None or ids.ndim < 1:
    return jnp.take(table, ids, axis=0)
  spec = weight_spec(table, TABLE_AXES)
  spec = tuple(spec) + (None,) * (2 - len(spec))
  vocab_axes, hidden_axes = spec_axes(spec[0]), spec_axes(spec[1])
  batch_axes = row_axes(ids.shape[0])
  if not vocab_axes and not hidden_axes:
    return jnp.take(table, ids, axis=0)
  if set(vocab_axes) & set(batch_axes):
    return jnp.take(table, ids, axis=0)  # a device's rows and its vocabulary would have to meet elsewhere
  # hidden-axis splits shared with the batch are exchanged (steps 1 and 3); the others are all-gathered
  swapped = tuple(a for a in hidden_axes if a in batch_axes)
  gathered = tuple(a for a in hidden_axes if a not in batch_axes)
  if swapped != tuple(a for a in batch_axes if a in swapped):
    return jnp.take(table, ids, axis=0)  # the two splits order the shared axes differently
  if swapped and gathered and hidden_axes != gathered + swapped:
    return jnp.take(table, ids, axis=0)  # the columns would come back in another order than the split's
  rows_local = table.shape[0] // _size(mesh, vocab_axes)

  def per_device(table, ids):
    if swapped:  # every id whose columns this device stores: [n_swap * b, ...]
      ids = jax.lax.all_gather(ids, swapped, axis=0, tiled=True)
    if vocab_axes:
      local = ids - jax.lax.axis_index(vocab_axes) * rows_local
      here = (local >= 0) & (local < rows_local)
      rows = jnp.take(table, jnp.where(here, local, 0), axis=0)
      rows = jax.lax.psum(jnp.where(here[..., None], rows, jnp.zeros((), rows.dtype)), vocab_axes)
    else:
      rows = jnp.take(table, ids, axis=0)
    if swapped:  # rows back to their devices, column blocks joined: [b, ..., H / n_gathered]
      rows = jax.lax.all_to_all(rows, swapped, split_axis=0, concat_axis=rows.ndim - 1, tiled=True)
    if gathered:
      rows = jax.lax.all_gather(rows, gathered, axis=rows.ndim - 1, tiled=True, to="invarying")
    return rows

  id_spec = PartitionSpec(batch_axes or None)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(PartitionSpec(*spec), id_spec),
                       out_specs=id_spec)(table, ids)


def _size(mesh, axes: tuple[str, ...]) -> int:
  sizes = dict(mesh.shape)
  n = 1
  for a in axes:
    n *= int(sizes[a])
  return n


__all__ = ["embed_lookup"]
