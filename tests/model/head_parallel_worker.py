"""The vocabulary-parallel head on 8 fake CPU devices, run by `tests/model/test_head_parallel.py`.

JAX fixes its device count when it first initialises (the test process has one device), hence a subprocess.
Usage: `python tests/model/head_parallel_worker.py OUT.json`; writes measurements (max errors, HLO facts) as JSON.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: device_workers
import device_workers  # noqa: E402

device_workers.use_fake_cpu_devices(8)

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from device_workers import max_err, scale  # noqa: E402
from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.model import head, head_parallel  # noqa: E402

MESHES = {"fsdp8": (1, 8, 1, 1), "data2_fsdp4": (2, 4, 1, 1), "data2_fsdp2_tensor2": (2, 2, 2, 1),
          "fsdp4_expert2": (1, 4, 1, 2)}
B, L, H, V = 8, 12, 16, 64
SPEC = head.HeadSpec(jnp.float32, 5.0, 5)  # 3 tiles of 5 positions, the last one padded


def mesh_of(shape) -> jax.sharding.Mesh:
  return sh.make_mesh(sh.MeshConfig(**dict(zip(sh.MESH_AXES, shape))))


def inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(B, L, H)), jnp.float32)
  e = jnp.asarray(rng.normal(size=(V, H)) * 0.5, jnp.float32)
  t = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
  g = jnp.asarray(rng.uniform(size=(B, L)), jnp.float32)
  return h, e, t, g


def objective(ce_fn, soft_fn, t, g):
  """(scalar, argmax) of both heads: a weighted CE sum plus a projection of the soft embeddings."""
  def f(h, e):
    ce, pred = ce_fn(h, e, t, SPEC)
    soft = soft_fn(h, e, SPEC)
    return jnp.sum(ce * g) + jnp.sum(soft * jnp.cos(jnp.arange(H, dtype=jnp.float32))), (pred, ce, soft)
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


def equality() -> dict:
  h, e, t, g = inputs()
  (want_v, (want_pred, want_ce, want_soft)), want_g = jax.jit(objective(head.cross_entropy, head.soft_embeddings,
                                                                        t, g))(h, e)
  out = {}
  for name, shape in MESHES.items():
    mesh = mesh_of(shape)
    with sh.activation_sharding(mesh):
      layout = head_parallel.vocab_layout(B, V)
      run = jax.jit(objective(head_parallel.cross_entropy, head_parallel.soft_embeddings, t, g))
      (v, (pred, ce, soft)), grads = run(h, e)
    out[name] = dict(rows=list(layout.rows), vocab=list(layout.vocab),
                     err_ce=max_err(ce, want_ce), scale_ce=scale(want_ce),
                     err_soft=max_err(soft, want_soft), scale_soft=scale(want_soft),
                     err_value=abs(float(v) - float(want_v)), scale_value=abs(float(want_v)),
                     pred_equal=bool(np.array_equal(np.asarray(pred), np.asarray(want_pred))),
                     err_grad_h=max_err(grads[0], want_g[0]), scale_grad_h=scale(want_g[0]),
                     err_grad_e=max_err(grads[1], want_g[1]), scale_grad_e=scale(want_g[1]))
  return out


def whole_embedding_arrays(ce_fn, soft_fn, vocab: int, hidden: int) -> int:
  """Arrays of the whole embedding's shape (f32 [V, H] or [H, V]) in the compiled gradient of both heads on fsdp=8,
  the embedding entering split along H over fsdp (as the model's sharding rules place it)."""
  mesh = mesh_of(MESHES["fsdp8"])
  b, length = 16, 16
  spec = head.HeadSpec(jnp.float32, 30.0, 4)
  shapes = (jax.ShapeDtypeStruct((b, length, hidden), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp"))),
            jax.ShapeDtypeStruct((vocab, hidden), jnp.float32,
                                 sharding=NamedSharding(mesh, PartitionSpec(None, "fsdp"))),
            jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("fsdp"))))

  def loss(h, e, t):
    return jnp.sum(ce_fn(h, e, t, spec)[0]) + jnp.sum(soft_fn(h, e, spec))

  with sh.activation_sharding(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile().as_text()
  return len(re.findall(rf"f32\[({vocab},{hidden}|{hidden},{vocab})\]", hlo))


def model_loss() -> dict:
  """The tiny model's diffusion loss with tiled logits (the diffusion term, the encoder's AR term and the
  self-conditioning input all through the head) and its parameter gradients: one device vs fsdp=8 (the vocabulary
  path taken there)."""
  from flax import nnx  # noqa: PLC0415

  from hackable_diffusion.data.sft import SFTBatch  # noqa: PLC0415
  from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss, draw_noise  # noqa: PLC0415
  from hackable_diffusion.model.config import get_preset  # noqa: PLC0415
  from hackable_diffusion.model.transformer import init_model  # noqa: PLC0415

  cfg = get_preset("tiny", vocab_size=V, moe_impl="dense")  # dense experts: the head's are the only shard_maps
  model = init_model(cfg, 0)
  rng = np.random.default_rng(1)
  batch = SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, V, (B, 6)), jnp.int32), prompt_mask=jnp.ones((B, 6), bool),
                   completion_ids=jnp.asarray(rng.integers(3, V, (B, cfg.canvas_length)), jnp.int32),
                   completion_mask=jnp.ones((B, cfg.canvas_length), bool))
  loss_cfg = LossConfig(self_conditioning_prob=1.0, encoder_ar_weight=1.0,
                        logits_tile_mib=3 * B * V * 4 / 2**20)  # 3 positions per tile
  key = jax.random.key(2)
  noise = draw_noise(key, batch, cfg.canvas_length, V, loss_cfg)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return diffusion_loss(nnx.merge(graphdef, p, rest), batch, key, loss_cfg, noise=noise)[0]

  want_v, want_g = jax.jit(jax.value_and_grad(loss))(params)
  mesh = mesh_of(MESHES["fsdp8"])
  with sh.activation_sharding(mesh):
    taken = head_parallel.vocab_layout(B, V) is not None
    run = jax.jit(jax.value_and_grad(loss))
    v, g = run(params)
    manual = run.lower(params).as_text().count("sdy.manual_computation")
  return dict(taken=taken, manual_computations=manual,
              err_value=abs(float(v) - float(want_v)), scale_value=abs(float(want_v)),
              err_grad=max_err(g, want_g), scale_grad=scale(want_g),
              err_grad_embed=max_err(g["embed_tokens"], want_g["embed_tokens"]),
              scale_grad_embed=scale(want_g["embed_tokens"]))


def main(path: str) -> None:
  result = dict(devices=jax.device_count(), equality=equality(), model=model_loss())
  with sh.activation_sharding(mesh_of(MESHES["fsdp8"])):
    result["layout_indivisible_vocab"] = head_parallel.vocab_layout(B, 60) is None
    result["layout_unsplit_batch"] = head_parallel.vocab_layout(3, V) is None
  result["layout_outside_mesh"] = head_parallel.vocab_layout(B, V) is None
  result["whole_parallel"] = whole_embedding_arrays(head_parallel.cross_entropy, head_parallel.soft_embeddings,
                                                    4096, 64)
  result["whole_plain"] = whole_embedding_arrays(head.cross_entropy, head.soft_embeddings, 4096, 64)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
