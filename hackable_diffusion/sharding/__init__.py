"""Device meshes and logical-axis sharding: data, FSDP, tensor and expert parallelism, multi-host ready.

  logical.py  the axis-rules table, logical axes -> `PartitionSpec`, state / batch placement, `constrain`
              (imports nothing else of the project: the model uses it)
  mesh.py     `MeshConfig` (the `mesh` config section), `make_mesh`, `maybe_initialize_distributed`,
              `first_failure` / `stop_together` / `agree_on` (every process learns whether any failed a check),
              `process_values`, `is_main_process`
  memory.py   per-device bytes of a training state on any mesh shape (`memory_estimate`, `memory_table`)
  local.py    helpers for `jax.shard_map` code that runs on each device's own rows with the weights gathered whole
              (FSDP by hand: the MoE kernels' `model.moe.on_local_tokens`)
  vocab.py    `embed_lookup`: token embeddings from a vocabulary-sharded table, per device, without replicating it

Sharded training lives with the step (`training.step.make_train_step(..., mesh=)`, `init_train_state_sharded`),
sharded loading with the loader (`interop.hf.load_pretrained(..., mesh=)`). Typical use:

  cfg = MeshConfig(data=-1, fsdp=8)
  maybe_initialize_distributed(cfg)            # multi-host: before any other JAX call
  mesh = make_mesh(cfg)
  graphdef, state, shardings = init_train_state_sharded(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)), tx, mesh)
  step = make_train_step(graphdef, tx, loss_config, mesh=mesh, shardings=shardings)
  state, metrics = step(state, shard_batch(batch, mesh), key)

Nothing here runs at import time; without a mesh the rest of the library runs unchanged on one device.
"""

from hackable_diffusion.sharding.logical import (LOGICAL_AXIS_RULES, MESH_AXES, MeshLike, Rules,
                                                 abstract_with_shardings, activation_sharding, active_mesh,
                                                 active_rules, batch_sharding, constrain, leaves_with_axes,
                                                 logical_to_mesh_spec, mesh_axis_sizes, num_batch_shards,
                                                 process_batch_shard, replicated, shard_batch, shard_model,
                                                 shard_state, state_shardings, variable_axes)
from hackable_diffusion.sharding.memory import (MemoryEstimate, abstract_state, memory_estimate, memory_table,
                                                per_device_bytes, per_device_param_bytes)
from hackable_diffusion.sharding.mesh import (JOINED, MeshConfig, agree_on, first_failure, is_main_process,
                                              make_mesh, maybe_initialize_distributed, process_values,
                                              stop_together, tell_job_and_leave)
from hackable_diffusion.sharding.vocab import embed_lookup

__all__ = [
    "JOINED", "LOGICAL_AXIS_RULES", "MESH_AXES", "MemoryEstimate", "MeshConfig", "MeshLike", "Rules", "abstract_state",
    "abstract_with_shardings", "activation_sharding", "active_mesh", "active_rules", "agree_on", "batch_sharding",
    "constrain", "embed_lookup", "first_failure", "is_main_process", "leaves_with_axes", "logical_to_mesh_spec",
    "make_mesh",
    "maybe_initialize_distributed", "memory_estimate", "memory_table", "mesh_axis_sizes", "num_batch_shards",
    "per_device_bytes", "per_device_param_bytes", "process_batch_shard", "process_values", "replicated", "shard_batch",
    "shard_model", "shard_state", "state_shardings", "stop_together", "tell_job_and_leave", "variable_axes",
]
