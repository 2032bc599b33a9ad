"""Expert-parallel MoE and banded attention on 8 fake CPU devices, run by `tests/sharding/test_moe_mesh.py`.

JAX fixes its device count when it first initialises (the test process has one device), hence a subprocess.
Usage: `python tests/sharding/moe_mesh_worker.py OUT.json`; writes measurements (max errors, HLO facts) as JSON.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: device_workers
import device_workers  # noqa: E402

device_workers.use_fake_cpu_devices(8)

import contextlib  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from device_workers import max_err, scale  # noqa: E402
from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.model import attention, moe  # noqa: E402
from hackable_diffusion.model.config import get_preset  # noqa: E402
from hackable_diffusion.model.transformer import init_model  # noqa: E402

MESHES = {"expert8": (1, 1, 1, 8), "fsdp2_expert4": (1, 2, 1, 4), "data2_fsdp2_expert2": (2, 2, 1, 2)}


def mesh_of(shape) -> jax.sharding.Mesh:
  return sh.make_mesh(sh.MeshConfig(**dict(zip(sh.MESH_AXES, shape))))


def routing(tokens: int, top_k: int, num_experts: int, seed: int, skewed: bool):
  """(weights [T, K], idx [T, K]), distinct experts per token; skewed: expert 0 chosen by every token and expert
  E-1 by none, else K random experts."""
  rng = np.random.default_rng(seed)
  if skewed:
    rest = [rng.permutation(np.arange(1, num_experts - 1))[: top_k - 1] for _ in range(tokens)]
    idx = np.concatenate([np.zeros((tokens, 1), np.int64), np.stack(rest)], axis=1)
  else:
    idx = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])
  weights = rng.uniform(0.1, 1.5, (tokens, top_k)).astype(np.float32)
  return jnp.asarray(weights), jnp.asarray(idx, jnp.int32)


def run_functions() -> dict:
  """`expert_parallel_experts` == `dense_experts` on one device: value and gradients w.r.t. x, routing weights,
  gate_up and down; T = 48 (split with the batch) and T = 45 (not divisible: tokens replicated, psum path)."""
  num_experts, hidden, inter, top_k = 8, 32, 16, 3
  k = jax.random.split(jax.random.key(0), 4)
  gate_up = jax.random.normal(k[0], (num_experts, 2 * inter, hidden)) * 0.3
  down = jax.random.normal(k[1], (num_experts, hidden, inter)) * 0.3
  out: dict = {}
  for tokens, skewed in ((48, True), (48, False), (45, True)):
    x = jax.random.normal(k[2], (tokens, hidden))
    weights, idx = routing(tokens, top_k, num_experts, seed=tokens, skewed=skewed)
    probe = jax.random.normal(k[3], (tokens, hidden))

    def grads(fn, idx=idx, probe=probe):
      def loss(x, weights, gate_up, down):
        return jnp.sum(jnp.sin(fn(x, weights, idx, gate_up, down)) * probe)
      return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    ref = jax.jit(grads(moe.dense_experts))(x, weights, gate_up, down)
    counts = np.bincount(np.asarray(idx).ravel(), minlength=num_experts)
    for name, shape in MESHES.items():
      if tokens == 45 and name != "fsdp2_expert4":  # the replicated-token path: one mesh is enough
        continue
      mesh = mesh_of(shape)
      fn = jax.jit(grads(lambda *a, mesh=mesh: moe.expert_parallel_experts(*a, mesh=mesh)))
      compiled = fn.lower(x, weights, gate_up, down).compile()  # compiled once: run it and read its HLO
      got, hlo = compiled(x, weights, gate_up, down), compiled.as_text()
      out[f"{name}/T{tokens}/{'skewed' if skewed else 'random'}"] = {
          "err": max_err(got, ref), "scale": scale(ref), "grad_gate_up_scale": scale(ref[1][2]),
          "min_count": int(counts.min()), "max_count": int(counts.max()),
          "all_gather": "all-gather" in hlo, "reduce_scatter": "reduce-scatter" in hlo,
      }
  return out


def run_model() -> dict:
  """The model with moe_impl='expert_parallel' / 'all_to_all', parameters in their shards, traced under `activation_sharding`
  == the dense model on one device (logits and parameter gradients)."""
  cfg = get_preset("tiny", num_experts=8, top_k_experts=2)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, 6)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, cfg.canvas_length)), jnp.int32)

  def logits_and_grads(impl, mesh=None):
    model = init_model(cfg.replace(moe_impl=impl), seed=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):
      logits = nnx.merge(graphdef, params, rest)(ids, canvas)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

    f = jax.value_and_grad(loss, has_aux=True)
    if mesh is None:
      (_, logits), g = jax.jit(f)(params, rest)
      return logits, g, ""

    def traced(params, rest):
      with sh.activation_sharding(mesh):
        return f(params, rest)

    params = sh.shard_state(params, sh.state_shardings(mesh, params))
    rest = sh.shard_state(rest, sh.state_shardings(mesh, rest))
    compiled = jax.jit(traced).lower(params, rest).compile()
    (_, logits), g = compiled(params, rest)
    return logits, g, compiled.as_text()

  ref_logits, ref_grads, _ = logits_and_grads("dense")
  out = {}
  for impl, name in (("expert_parallel", "fsdp2_expert4"), ("all_to_all", "fsdp2_expert4")):
    logits, grads, hlo = logits_and_grads(impl, mesh_of(MESHES[name]))
    out[f"{impl}/{name}"] = {
        "logits_err": max_err(logits, ref_logits), "logits_scale": scale(ref_logits),
        "grads_err": max_err(grads, ref_grads), "grads_scale": scale(ref_grads),
        "reduce_scatter": "reduce-scatter" in hlo,
        "runs_as": moe.resolve_moe_impl(impl, cfg.num_experts, mesh_of(MESHES[name]), top_k=cfg.top_k_experts)}
  return out


def run_qlora() -> dict:
  """The tiny model with a quantized base (fp8 / packed int4 / nvfp4) under LoRA adapters, its variables in their shards:
  loss and adapter gradients == one device; reports which quantized values are really split."""
  from hackable_diffusion import lora  # noqa: PLC0415 (after the XLA flags, as every import here)
  from hackable_diffusion.lora import qlora  # noqa: PLC0415

  cfg = get_preset("tiny")
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, 6)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (8, cfg.canvas_length)), jnp.int32)
  out = {}
  for mode in ("fp8", "int4", "nvfp4"):
    config = lora.LoraConfig(rank=2, target_modules="all-linear", base_quantization=mode, base_block_size=16)
    model = lora.apply_lora(init_model(cfg, seed=1), config, rngs=nnx.Rngs(0))
    for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # B != 0: the adapters change the output
      v.value = jnp.asarray(0.3 * rng.standard_normal(v.shape), v.dtype)
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(adapters, rest):
      logits = nnx.merge(graphdef, adapters, rest)(ids, canvas)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    f = jax.value_and_grad(loss)
    ref_loss, ref_grads = jax.jit(f)(adapters, rest)
    for name in ("data2_fsdp2_tensor2", "fsdp2_expert4"):
      mesh = mesh_of({"data2_fsdp2_tensor2": (2, 2, 2, 1), "fsdp2_expert4": (1, 2, 1, 4)}[name])

      def traced(adapters, rest):
        with sh.activation_sharding(mesh):
          return f(adapters, rest)

      sharded_adapters = sh.shard_state(adapters, sh.state_shardings(mesh, adapters))
      sharded_rest = sh.shard_state(rest, sh.state_shardings(mesh, rest))
      got_loss, grads = jax.jit(traced)(sharded_adapters, sharded_rest)
      quantized = nnx.to_flat_state(nnx.state(nnx.merge(graphdef, sharded_adapters, sharded_rest),
                                              qlora.QuantizedBase))
      split = sum(len(v.get_value().sharding.device_set) == 8 and not v.get_value().sharding.is_fully_replicated
                  for _, v in quantized)
      out[f"{mode}/{name}"] = {"loss_err": abs(float(got_loss) - float(ref_loss)), "loss": float(ref_loss),
                               "grads_err": max_err(grads, ref_grads), "grads_scale": scale(ref_grads),
                               "quantized_vars": len(quantized), "quantized_split": int(split)}
  return out


def run_attention() -> dict:
  """Banded sliding-window encoder attention (`encoder_attention` taking the band) with the batch split over
  data x fsdp and the heads over tensor == one device; padded rows and per-row start offsets included."""
  attention.BAND_MIN_CAPACITY = 32  # band a 64-slot cache (the default keeps caches < 1024 dense)
  b, l, s, n, nkv, d, window = 4, 40, 64, 4, 2, 8, 16
  assert attention.band_pays(l, s, window)
  k = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(k[0], (b, l, n, d))
  cache_k = jax.random.normal(k[1], (b, s, nkv, d))
  cache_v = jax.random.normal(k[2], (b, s, nkv, d))
  start = jnp.array([0, 5, 12, 20], jnp.int32)
  slots = jnp.arange(s)[None, :]
  pad = jnp.array([0, 3, 0, 7])[:, None]  # left padding of rows 1 and 3
  valid = (slots < start[:, None] + l) & (slots >= pad)

  def f(q, cache_k, cache_v, valid, start):
    return attention.encoder_attention(q, cache_k, cache_v, valid, start, window, jnp.float32)

  ref = jax.jit(f)(q, cache_k, cache_v, valid, start)
  dense = jax.jit(lambda *a: attention.attend(a[0], a[1], a[2], attention.encoder_mask(
      a[3], a[4][:, None] + jnp.arange(l)[None, :], window), jnp.float32))(q, cache_k, cache_v, valid, start)
  seen = np.asarray(jnp.any(attention.encoder_mask(valid, start[:, None] + jnp.arange(l)[None, :], window), -1))
  out = {"band_vs_dense_err": float(np.max(np.abs(np.asarray(ref - dense))[seen]))}
  meshes = {"data2_fsdp2_tensor2": (2, 2, 2, 1), "fsdp4_tensor2": (1, 4, 2, 1), "data2_expert4": (2, 1, 1, 4)}
  for name, shape in meshes.items():
    mesh = mesh_of(shape)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    heads = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    got = jax.jit(f, in_shardings=(heads, heads, heads, rows, rows))(q, cache_k, cache_v, valid, start)
    out[name] = {"err": float(np.max(np.abs(np.asarray(got - ref))[seen])), "out_spec": str(got.sharding.spec),
                 "devices": len(got.sharding.device_set)}
  return out


def run_local_tokens() -> dict:
  """The sorting kernels (`tiled`, `ragged`) on meshes with the tokens split like the batch and the expert weights
  split by their rules (FSDP over `fsdp`, and `tensor` / `expert` where the mesh has them) == `dense_experts` on
  one device: value and gradients (x, routing weights, gate_up, down). Each device runs its own tokens
  (`moe.on_local_tokens`): on fsdp=8 the compiled gradient's temporaries are measured against one device's for the
  same global tokens, and its HLO is read for the per-expert reduce-scatter of the weight gradients."""
  num_experts, hidden, inter, top_k = 8, 64, 32, 2
  k = jax.random.split(jax.random.key(5), 5)
  gate_up = jax.random.normal(k[0], (num_experts, 2 * inter, hidden)) * 0.2
  down = jax.random.normal(k[1], (num_experts, hidden, inter)) * 0.2
  out: dict = {}
  for tokens in (48, 2048):
    x = jax.random.normal(k[2], (tokens, hidden))
    weights, idx = routing(tokens, top_k, num_experts, seed=tokens, skewed=False)
    probe = jax.random.normal(k[3], (tokens, hidden))

    def grads(impl, mesh=None, idx=idx, probe=probe):
      def loss(x, weights, gate_up, down):
        if mesh is None:
          return jnp.sum(jnp.sin(moe.experts_forward(impl, x, weights, idx, gate_up, down)) * probe)
        with sh.activation_sharding(mesh):
          return jnp.sum(jnp.sin(moe.experts_forward(impl, x, weights, idx, gate_up, down)) * probe)
      return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    ref = jax.jit(grads("dense"))(x, weights, gate_up, down)
    one_device = jax.jit(grads("tiled")).lower(x, weights, gate_up, down).compile()
    meshes = {"fsdp8": (1, 8, 1, 1), "data2_fsdp4": (2, 4, 1, 1), "data2_fsdp2_tensor2": (2, 2, 2, 1),
              "fsdp4_expert2": (1, 4, 1, 2)} if tokens == 48 else {"fsdp8": (1, 8, 1, 1)}
    for name, shape in meshes.items():
      mesh = mesh_of(shape)
      rows = NamedSharding(mesh, sh.logical_to_mesh_spec(("batch", None), mesh=mesh))
      experts = tuple(NamedSharding(mesh, sh.logical_to_mesh_spec(axes, mesh=mesh)) for axes in moe.EXPERT_WEIGHT_AXES)
      args = (jax.device_put(x, rows), jax.device_put(weights, rows), jax.device_put(gate_up, experts[0]),
              jax.device_put(down, experts[1]))
      for impl in ("tiled", "ragged"):
        compiled = jax.jit(grads(impl, mesh)).lower(*args).compile()
        got = compiled(*args)
        case = {"err": max_err(got, ref), "scale": scale(ref), "grad_gate_up_scale": scale(ref[1][2]),
                "weights_split": not args[2].sharding.is_fully_replicated}
        if tokens == 2048 and impl == "tiled":
          case.update(temporaries=compiled.memory_analysis().temp_size_in_bytes,
                      one_device_temporaries=one_device.memory_analysis().temp_size_in_bytes,
                      reduce_scatter="reduce-scatter" in compiled.as_text())
        out[f"{impl}/{name}/T{tokens}"] = case
  out["tiled/fsdp8/weights"] = per_expert_gathers()
  return out


def run_linked() -> dict:
  """A training step's loss and gradients with the layers scanned, remat 'nothing_saveable' and `tiled` experts
  (`training.step.make_loss_and_grad`: linked passes, one gradient buffer for the encoder and decoder passes,
  each device running its own tokens) on fsdp=8 and data2 x fsdp2 x tensor2 == the unrolled model without remat
  on one device, every parameter gradient compared layer by layer."""
  from hackable_diffusion.data.sft import SFTBatch  # noqa: PLC0415
  from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss  # noqa: PLC0415
  from hackable_diffusion.model import scan  # noqa: PLC0415
  from hackable_diffusion.training.step import make_loss_and_grad  # noqa: PLC0415

  cfg = get_preset("tiny", num_experts=8, top_k_experts=2, num_hidden_layers=4, moe_impl="tiled",
                   layer_types=("sliding_attention", "full_attention") * 2)
  rng = np.random.default_rng(4)
  b, c = 8, cfg.canvas_length
  batch = SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 6)), jnp.int32),
                   prompt_mask=jnp.asarray(np.arange(6)[None] >= rng.integers(0, 3, (b, 1))),
                   completion_ids=jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 2 * c)), jnp.int32),
                   completion_mask=jnp.asarray(np.arange(2 * c)[None] < rng.integers(c, 2 * c + 1, (b, 1))))
  key, loss_cfg = jax.random.key(6), LossConfig(self_conditioning_prob=0.5)
  graphdef, params, rest = nnx.split(init_model(cfg, seed=2), nnx.Param, ...)
  ref_loss, ref = jax.jit(jax.value_and_grad(
      lambda p: diffusion_loss(nnx.merge(graphdef, p, rest), batch, key, loss_cfg)[0]))(params)

  scanned = scan.stack_layers(init_model(cfg.replace(remat="nothing_saveable", scan_layers=True), seed=2))
  s_graphdef, s_params, s_rest = nnx.split(scanned, nnx.Param, ...)
  grad_fn = make_loss_and_grad(s_graphdef, loss_cfg)
  out: dict = {}
  for name, shape in {"fsdp8": (1, 8, 1, 1), "data2_fsdp2_tensor2": (2, 2, 2, 1)}.items():
    mesh = mesh_of(shape)

    def traced(p, r, batch, mesh=mesh):
      with sh.activation_sharding(mesh):
        return grad_fn(p, r, batch, key)

    p_in = sh.shard_state(s_params, sh.state_shardings(mesh, s_params))
    r_in = sh.shard_state(s_rest, sh.state_shardings(mesh, s_rest))
    b_in = jax.device_put(batch, sh.batch_sharding(mesh))
    (loss, _), grads = jax.jit(traced)(p_in, r_in, b_in)
    unrolled = nnx.state(scan.unstack_layers(nnx.merge(s_graphdef, grads, s_rest)), nnx.Param)
    out[name] = {"loss": float(loss), "ref_loss": float(ref_loss), "err": max_err(unrolled, ref),
                 "scale": scale(ref), "same_tree": jax.tree.structure(unrolled) == jax.tree.structure(ref),
                 "q_split": not p_in["layers"]["blocks"][0]["self_attn"]["q_proj"]["kernel"][...]
                 .sharding.is_fully_replicated}
  return out


def per_expert_gathers() -> dict:
  """Weight-heavy experts (gate_up + down: 6 MiB whole) on few tokens, fsdp=8: the compiled `tiled` gradient's
  temporaries against the experts' whole bytes. Gathered one expert at a time, a device never holds a layer's whole
  weights or gradients (gathered per layer: 17 MiB of temporaries); values and gradients == `dense_experts`."""
  num_experts, hidden, inter, tokens, top_k = 8, 256, 256, 64, 2
  k = jax.random.split(jax.random.key(6), 4)
  gate_up = jax.random.normal(k[0], (num_experts, 2 * inter, hidden)) * 0.1
  down = jax.random.normal(k[1], (num_experts, hidden, inter)) * 0.1
  x = jax.random.normal(k[2], (tokens, hidden))
  weights, idx = routing(tokens, top_k, num_experts, seed=7, skewed=False)

  def grads(impl, mesh=None):
    def loss(x, weights, gate_up, down):
      with sh.activation_sharding(mesh) if mesh is not None else contextlib.nullcontext():
        return jnp.sum(jnp.sin(moe.experts_forward(impl, x, weights, idx, gate_up, down)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

  ref = jax.jit(grads("dense"))(x, weights, gate_up, down)
  mesh = mesh_of((1, 8, 1, 1))
  rows = NamedSharding(mesh, sh.logical_to_mesh_spec(("batch", None), mesh=mesh))
  experts = tuple(NamedSharding(mesh, sh.logical_to_mesh_spec(axes, mesh=mesh)) for axes in moe.EXPERT_WEIGHT_AXES)
  args = (jax.device_put(x, rows), jax.device_put(weights, rows), jax.device_put(gate_up, experts[0]),
          jax.device_put(down, experts[1]))
  compiled = jax.jit(grads("tiled", mesh)).lower(*args).compile()
  return {"err": max_err(compiled(*args), ref), "scale": scale(ref), "grad_gate_up_scale": scale(ref[1][2]),
          "weights_split": not args[2].sharding.is_fully_replicated,
          "temporaries": compiled.memory_analysis().temp_size_in_bytes,
          "whole_expert_bytes": (gate_up.size + down.size) * gate_up.dtype.itemsize}


if __name__ == "__main__":
  result = {"devices": jax.device_count(), "functions": run_functions(), "model": run_model(),
            "attention": run_attention(), "qlora": run_qlora(),
            "local_tokens": run_local_tokens(), "linked": run_linked()}
  with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
