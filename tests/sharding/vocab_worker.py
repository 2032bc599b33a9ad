"""Vocabulary-sharded embedding lookups (`sharding.embed_lookup`) on 8 fake CPU devices, run by
`tests/sharding/test_vocab.py`, which also reads this process's stderr for XLA's SPMD warnings.
Usage: `python tests/sharding/vocab_worker.py OUT.json`; writes measurements (max errors) as JSON.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: device_workers
import device_workers  # noqa: E402

device_workers.use_fake_cpu_devices(8)

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from device_workers import max_err, scale  # noqa: E402
from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.model.config import get_preset  # noqa: E402
from hackable_diffusion.model.transformer import init_model  # noqa: E402

CFG = get_preset("tiny")  # vocab 64, hidden 32
# (data, fsdp, tensor, expert): vocab over tensor, hidden over fsdp, the batch over data x fsdp x expert
MESHES = {"fsdp2_tensor2_expert2": (1, 2, 2, 2), "fsdp8": (1, 8, 1, 1), "tensor8": (1, 1, 8, 1),
          "data2_tensor2_expert2": (2, 1, 2, 2), "fsdp4_tensor2": (1, 4, 2, 1)}


def mesh_of(shape) -> jax.sharding.Mesh:
  return sh.make_mesh(sh.MeshConfig(**dict(zip(sh.MESH_AXES, shape))))


def mark(what: str) -> None:
  """A line on stderr before each compile, so that a warning after it names its program."""
  print(f"== {what}", file=sys.stderr, flush=True)


def run_lookup() -> dict:
  """`embed_lookup` (value and table gradient) on each mesh == `jnp.take` on one device."""
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.normal(size=(CFG.vocab_size, CFG.hidden_size)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (8, 12)), jnp.int32)
  probe = jnp.asarray(rng.normal(size=(8, 12, CFG.hidden_size)), jnp.float32)

  def loss(table, ids):
    return jnp.sum(jnp.sin(sh.embed_lookup(table, ids)) * probe)

  want = (jnp.take(table, ids, axis=0), jax.grad(loss)(table, ids))
  out = {}
  for name, shape in MESHES.items():
    mesh = mesh_of(shape)
    t = jax.device_put(table, jax.sharding.NamedSharding(mesh, sh.logical_to_mesh_spec(
        ("vocab", "embed"), mesh=mesh, shape=table.shape)))
    i = jax.device_put(ids, sh.batch_sharding(mesh))
    mark(f"lookup {name}")
    with sh.activation_sharding(mesh):
      got = (jax.jit(sh.embed_lookup)(t, i), jax.jit(jax.grad(loss))(t, i))
    out[name] = {"err": max_err(got, want), "scale": scale(want)}
  # 3 rows: the batch axes cannot split them (replicated ids; the columns are all-gathered instead)
  mesh = mesh_of(MESHES["fsdp2_tensor2_expert2"])
  t = jax.device_put(table, jax.sharding.NamedSharding(mesh, sh.logical_to_mesh_spec(
      ("vocab", "embed"), mesh=mesh, shape=table.shape)))
  mark("lookup 3 rows")
  with sh.activation_sharding(mesh):
    got = jax.jit(sh.embed_lookup)(t, ids[:3])
  out["fsdp2_tensor2_expert2/3rows"] = {"err": max_err(got, want[0][:3]), "scale": scale(want[0])}
  return out


def run_model() -> dict:
  """The tiny model's encode + decode logits with its parameters in their shards on fsdp 2 x tensor 2 x expert 2
  == one device."""
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(3, CFG.vocab_size, (8, 8)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, CFG.vocab_size, (8, CFG.canvas_length)), jnp.int32)

  def logits(model, mesh=None):
    graphdef, state = nnx.split(model)

    def fn(state, prompt, canvas):
      m = nnx.merge(graphdef, state)
      _, cache = m.encode(prompt, m.init_cache(prompt.shape[0], 16))
      return m.decode(canvas, cache)

    if mesh is None:
      return jax.jit(fn)(state, prompt, canvas)
    rows = sh.batch_sharding(mesh)
    with sh.activation_sharding(mesh):
      return jax.jit(fn)(state, jax.device_put(prompt, rows), jax.device_put(canvas, rows))

  want = logits(init_model(CFG, 3))
  mesh = mesh_of(MESHES["fsdp2_tensor2_expert2"])
  model = sh.shard_model(init_model(CFG, 3), mesh)
  mark("model fsdp2_tensor2_expert2")
  got = logits(model, mesh)
  return {"err": max_err(got, want), "scale": scale(want),
          "embed_spec": [str(a) for a in model.embed_tokens[...].sharding.spec]}


def run_generate() -> dict:
  """`hd.generate(..., mesh=)` with the parameters in their shards on fsdp 2 x tensor 2 x expert 2 == one device
  (deterministic regime: temperature ~1e-4, every position accepted)."""
  import hackable_diffusion as hd

  rng = np.random.default_rng(2)
  ids = rng.integers(3, CFG.vocab_size - 3, (8, 5))
  sampling = hd.SamplingConfig(max_new_tokens=2 * CFG.canvas_length, max_denoising_steps=3, t_min=1e-4, t_max=2e-4,
                               entropy_bound=1e9)
  single = hd.generate(init_model(CFG, 3), ids, sampling, rng=jax.random.key(0))
  mesh = mesh_of(MESHES["fsdp2_tensor2_expert2"])
  mark("generate fsdp2_tensor2_expert2")
  sharded = hd.generate(sh.shard_model(init_model(CFG, 3), mesh), ids, sampling, rng=jax.random.key(0), mesh=mesh)
  return {"equal": bool(np.array_equal(np.asarray(single.sequences), np.asarray(sharded.sequences)))}


if __name__ == "__main__":
  result = {"devices": jax.device_count(), "lookup": run_lookup(), "model": run_model(), "generate": run_generate()}
  with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
