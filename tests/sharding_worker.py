"""Multi-device checks of `hackable_diffusion.sharding`, run by `tests/test_sharding.py` in a subprocess.

JAX fixes its device count when it initialises, and the test process has long initialised it with one CPU
device, so these checks run here with 8 fake CPU devices (`--xla_force_host_platform_device_count=8`).
Usage: `python tests/sharding_worker.py train|misc OUT.json`; writes measurements (numbers, specs) as JSON and
lets the test assert on them.
"""

from __future__ import annotations

import os
import sys

# the repository root first: `python tests/sharding_worker.py` would otherwise put only tests/ on the path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    # tiny models: compile time dominates; these two flags cut CPU compile time ~3x (numerics unchanged in kind:
    # the reference and the sharded runs use the same flags)
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
])

import json  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.data.sft import SFTBatch  # noqa: E402
from hackable_diffusion.diffusion.loss import LossConfig  # noqa: E402
from hackable_diffusion.model.config import get_preset  # noqa: E402
from hackable_diffusion.model.transformer import DiffusionGemma, init_model  # noqa: E402
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from hackable_diffusion.training.step import init_train_state, make_train_step  # noqa: E402

CFG = get_preset("tiny")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring event of every XLA compile
TRAIN_MESHES = ((8, 1, 1, 1), (2, 4, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4))
BYTES_ONLY_MESHES = ((1, 1, 1, 8), (1, 1, 8, 1))  # 8 experts / tensor shards of a 4-expert model: fallbacks


def mesh_of(shape) -> jax.sharding.Mesh:
  return sh.make_mesh(sh.MeshConfig(**dict(zip(sh.MESH_AXES, shape))))


def batch(seed: int, b: int = 8) -> SFTBatch:
  rng = np.random.default_rng(seed)
  p, w = 5, 2 * CFG.canvas_length
  mask = np.ones((b, w), bool)
  mask[::3, CFG.canvas_length + 3:] = False  # some rows have one valid canvas only
  return SFTBatch(prompt_ids=rng.integers(3, 60, (b, p)).astype(np.int32), prompt_mask=np.ones((b, p), bool),
                  completion_ids=rng.integers(3, 60, (b, w)).astype(np.int32), completion_mask=mask)


def max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def bytes_per_device(tree) -> dict[str, int]:
  """Bytes each device actually holds (summed over the shards of every array)."""
  out: dict[str, int] = defaultdict(int)
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      out[str(shard.device.id)] += shard.data.nbytes
  return dict(out)


def spec(x) -> list:
  return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


# ---- training step on several meshes vs one device -----------------------------------------------------------
def run_train() -> dict:
  # eps=1e-3 makes Adam's update a smooth function of the gradient (with eps=1e-8 the first step is
  # lr * sign(g), and a gradient within rounding of 0 could flip sign between reduction orders)
  tx, schedule = make_optimizer(OptimizerConfig(peak_lr=1e-3, warmup_steps=0, eps=1e-3))
  loss_config = LossConfig()  # self-conditioning on (two decoder passes) and the encoder AR loss
  graphdef, state0 = init_train_state(init_model(CFG, 0), tx)
  batches = [batch(1), batch(2)]
  keys = [jax.random.key(10), jax.random.key(11)]
  ref_step = make_train_step(graphdef, tx, loss_config, lr_schedule=schedule, donate=False)
  ref, ref_metrics = state0, []
  for b, k in zip(batches, keys):
    ref, m = ref_step(ref, jax.device_put(b), k)
    ref_metrics.append({n: float(v) for n, v in m.items()})
  out = {"devices": jax.device_count(), "meshes": {}}
  for shape in TRAIN_MESHES:
    mesh = mesh_of(shape)
    shardings = sh.state_shardings(mesh, state0)
    state = sh.shard_state(state0, shardings)
    step = sh.make_sharded_train_step(graphdef, tx, loss_config, mesh, state, lr_schedule=schedule)
    sharded = [sh.shard_batch(b, mesh) for b in batches]
    b3, k3 = sh.shard_batch(batch(3), mesh), jax.random.key(12)
    compiles: list[str] = []

    def listener(event, _duration, **_kwargs):
      if event == BACKEND_COMPILE:
        compiles.append(event)

    metrics = []
    for i, (b, k) in enumerate(zip(sharded, keys)):
      if i == 1:  # count XLA compiles from the second step on: the first step compiled everything
        jax.monitoring.register_event_duration_secs_listener(listener)
      state, m = step(state, b, k)
      metrics.append({n: float(v) for n, v in m.items()})
    measured = {
        "param_max_diff": max_diff(state.params, ref.params),
        "param_bytes_measured": bytes_per_device(state.params),
        "param_bytes_helper": sh.per_device_bytes(state.params, mesh),
        "state_bytes_measured": bytes_per_device(state),
        "state_bytes_helper": sh.per_device_bytes(state, mesh),
        "opt_max_diff": max_diff(state.opt_state, ref.opt_state),
        "step": int(state.step),
    }
    state3, _ = step(state, b3, k3)  # a third step on a fresh batch: still no compile
    jax.block_until_ready(state3)
    jax.monitoring.unregister_event_duration_listener(listener)
    params = state3.params
    out["meshes"]["x".join(map(str, shape))] = {
        "loss": [m["loss"] for m in metrics],
        "ref_loss": [m["loss"] for m in ref_metrics],
        "grad_norm": [m["grad_norm"] for m in metrics],
        "ref_grad_norm": [m["grad_norm"] for m in ref_metrics],
        "param_update_max": max_diff(ref.params, state0.params),
        "compiles_after_first_step": len(compiles),
        "specs": {
            "embed_tokens": spec(params["embed_tokens"][...]),
            "experts.gate_up_proj": spec(params["layers"][0]["experts"]["gate_up_proj"][...]),
            "q_proj": spec(params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]),
            "mu.embed_tokens": spec(state3.opt_state[1][0].mu["embed_tokens"][...]),
        },
        **measured,
    }
  for shape in BYTES_ONLY_MESHES:  # placement only (no step): the divisibility fallbacks
    mesh = mesh_of(shape)
    params = sh.shard_state(state0.params, sh.state_shardings(mesh, state0.params))
    out["meshes"]["x".join(map(str, shape))] = {
        "param_bytes_measured": bytes_per_device(params),
        "param_bytes_helper": sh.per_device_bytes(params, mesh),
        "specs": {"experts.gate_up_proj": spec(params["layers"][0]["experts"]["gate_up_proj"][...]),
                  "k_proj.full": spec(params["layers"][1]["self_attn"]["k_proj"]["kernel"][...])},
    }
  return out


# ---- generate, checkpoints, HF loading ---------------------------------------------------------------------------
def run_misc() -> dict:
  import hackable_diffusion as hd
  from hackable_diffusion.interop.hf import load_pretrained, save_pretrained
  from hackable_diffusion.training.checkpointing import Checkpointer

  out: dict = {"devices": jax.device_count()}

  # generate with sharded parameters == one device (deterministic regime: temperature ~1e-4 -> argmax sampling,
  # entropy bound 1e9 -> every position accepted, seed canvas -> the same start)
  rng = np.random.default_rng(0)
  ids = rng.integers(3, CFG.vocab_size - 3, (4, 5))
  mask = np.ones_like(ids)
  mask[1, :2] = 0
  seed = rng.integers(0, CFG.vocab_size, (4, 2 * CFG.canvas_length))
  sampling = hd.SamplingConfig(max_new_tokens=2 * CFG.canvas_length, max_denoising_steps=3, t_min=1e-4, t_max=2e-4,
                               entropy_bound=1e9)
  single = hd.generate(init_model(CFG, 3), ids, sampling, rng=jax.random.key(0), attention_mask=mask,
                       seed_canvas=seed)
  mesh = mesh_of((2, 2, 2, 1))
  model = sh.shard_model(init_model(CFG, 3), mesh)
  sharded = hd.generate(model, ids, sampling, rng=jax.random.key(0), attention_mask=mask, seed_canvas=seed)
  out["generate"] = {
      "equal": bool(np.array_equal(np.asarray(single.sequences), np.asarray(sharded.sequences))),
      "steps_equal": bool(np.array_equal(np.asarray(single.denoising_steps), np.asarray(sharded.denoising_steps))),
      "new_tokens": int(np.asarray(single.sequences).shape[1] - ids.shape[1]),
      "embed_spec": spec(model.embed_tokens[...]),
  }

  # a TrainState saved on one mesh restores onto another mesh shape
  tx, _ = make_optimizer(OptimizerConfig(warmup_steps=0))
  _, state0 = init_train_state(init_model(CFG, 4), tx)
  mesh_a, mesh_b = mesh_of((2, 4, 1, 1)), mesh_of((1, 2, 2, 2))
  state_a = sh.shard_state(state0, sh.state_shardings(mesh_a, state0))
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = Checkpointer(os.path.join(tmp, "checkpoints"), async_save=False)
    ckpt.save(7, state_a, {"seed": 0}, wait=True)
    ckpt.close()
    target_shardings = sh.state_shardings(mesh_b, state0)
    target = sh.abstract_with_shardings(state0, target_shardings)
    restored, meta = Checkpointer(os.path.join(tmp, "checkpoints"), read_only=True).restore(target)
  got = jax.tree.leaves(restored)
  want = jax.tree.leaves(target_shardings)
  out["checkpoint"] = {
      "max_diff": max_diff(restored, state0),
      "shardings_match": all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(got, want)),
      "leaves": len(got),
      "meta_step": int(meta["step"]),
      "restored_embed_spec": spec(restored.params["embed_tokens"][...]),
      "restored_mu_expert_spec": spec(restored.opt_state[1][0].mu["layers"][0]["experts"]["down_proj"][...]),
  }

  # a TrainState initialised directly in its shards == initialised on one device, then sharded
  graphdef, state_b, shardings_b = sh.init_train_state_sharded(lambda: DiffusionGemma(CFG, rngs=nnx.Rngs(4)), tx,
                                                              mesh_b)
  graphdef_1, _ = init_train_state(init_model(CFG, 4), tx)
  out["init"] = {
      "max_diff": max_diff(state_b, state0),
      "graphdef_equal": graphdef == graphdef_1,
      "shardings_match": all(x.sharding.is_equivalent_to(s, x.ndim)
                             for x, s in zip(jax.tree.leaves(state_b), jax.tree.leaves(shardings_b))),
      "embed_spec": spec(state_b.params["embed_tokens"][...]),
  }

  # a HF checkpoint (several safetensors files) straight into shards
  model = init_model(CFG, 5)
  with tempfile.TemporaryDirectory() as tmp:
    save_pretrained(model, tmp, max_shard_size=20_000)
    n_files = len([f for f in os.listdir(tmp) if f.endswith(".safetensors")])
    reference = load_pretrained(tmp)
    loaded = sh.load_pretrained_sharded(tmp, mesh_b)
    loaded_bf16 = sh.load_pretrained_sharded(tmp, mesh_b, jnp.bfloat16)
    ref_bf16 = load_pretrained(tmp, jnp.bfloat16)
  ref_state, got_state = nnx.state(reference), nnx.state(loaded)
  expected_shardings = sh.state_shardings(mesh_b, ref_state)
  out["hf"] = {
      "files": n_files,
      "max_diff": max_diff(got_state, ref_state),
      "bf16_max_diff": max_diff(nnx.state(loaded_bf16), nnx.state(ref_bf16)),
      "bf16_dtype": str(loaded_bf16.embed_tokens[...].dtype),
      "shardings_match": all(x.sharding.is_equivalent_to(s, x.ndim)
                             for x, s in zip(jax.tree.leaves(got_state), jax.tree.leaves(expected_shardings))),
      "q_proj_spec": spec(loaded.layers[0].self_attn.q_proj.kernel[...]),
      "experts_spec": spec(loaded.layers[0].experts.gate_up_proj[...]),
  }
  return out


if __name__ == "__main__":
  what, path = sys.argv[1], sys.argv[2]
  result = {"train": run_train, "misc": run_misc}[what]()
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
