"""Per-device computation on a device's own rows inside `jax.shard_map`, with the weights it reads gathered whole.

Some computations do not partition along the batch by themselves: a sort of all the tokens by expert (the MoE
kernels, `model.moe.on_local_tokens`). Left to XLA's partitioner, it is replicated: every device sorts and runs
every device's tokens. Run under `jax.shard_map` instead, each device takes its own rows (split like the batch:
the `batch` rule's mesh axes) and gathers the weights it reads, as FSDP does per layer:

- along the mesh axes that split the rows, `all_gather` (to varying): its transpose reduce-scatters the weight
  gradient, so each device receives its shard of the sum over every device's rows;
- along the others, whose devices hold the same rows and so compute the same gradient, an invariant gather
  (`to='invarying'`): its transpose keeps each device's own slice;
- weights split along none of the row axes are marked varying over them (`pcast`): their gradient is summed
  (psum) over the row axes.

`gather_whole` is one weight's part of that; `row_axes` says which mesh axes split the rows of the active mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec

from hackable_diffusion.sharding.logical import active_mesh, active_rules, logical_to_mesh_spec

Array = jax.Array


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one `PartitionSpec` entry (None, a name or a tuple of names) as a tuple."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def row_axes(rows: int) -> tuple[str, ...]:
  """The mesh axes of the active mesh (`activation_sharding`) that split `rows` rows like the batch; () outside a
  mesh or when they do not divide `rows` (the rows are then replicated)."""
  mesh = active_mesh()
  if mesh is None:
    return ()
  spec = logical_to_mesh_spec(("batch",), rules=active_rules(), mesh=mesh, shape=(rows,))
  return spec_axes(spec[0]) if len(spec) else ()


def weight_spec(w: Array, axes: Sequence[str | None]) -> PartitionSpec:
  """The split of weight `w` with logical `axes` on the active mesh, by the active sharding rules."""
  return logical_to_mesh_spec(tuple(axes), rules=active_rules(), mesh=active_mesh(), shape=w.shape)


def gather_whole(w: Array, spec: PartitionSpec, axes: tuple[str, ...], *, keep_from_dim: int | None = None,
                 name: str = "weight") -> tuple[Array, tuple[tuple[str, ...], int] | None]:
  """Inside `jax.shard_map`: `w`, entered split by `spec`, gathered whole on every device (see the module
  docstring; `axes`: the mesh axes that split the rows) -> (w, None).

  `keep_from_dim`: the first dimension >= it that the row axes split stays split -> (w, (those mesh axes, that
  dimension)), for a caller that gathers it piece by piece (the MoE kernel, one expert at a time). `name`: what
  the error for a split it cannot gather calls `w`.
  """
  kept = None
  for dim, entry in enumerate(spec):
    mesh_axes = spec_axes(entry)
    over_rows = tuple(a for a in mesh_axes if a in axes)
    if over_rows and over_rows != mesh_axes:
      raise ValueError(f"{name} {tuple(w.shape)}: dimension {dim} is split over mesh axes {mesh_axes}, some of which "
                       f"({over_rows}) split the batch too; give it either only batch axes or none (sharding rules)")
    if over_rows and keep_from_dim is not None and dim >= keep_from_dim and kept is None:
      kept = (mesh_axes, dim)
    elif mesh_axes:
      w = jax.lax.all_gather(w, mesh_axes, axis=dim, tiled=True, to="varying" if over_rows else "invarying")
  missing = tuple(a for a in axes if a not in jax.typeof(w).mat.varying)
  return (jax.lax.pcast(w, missing, to="varying") if missing else w), kept


__all__ = ["gather_whole", "row_axes", "spec_axes", "weight_spec"]
