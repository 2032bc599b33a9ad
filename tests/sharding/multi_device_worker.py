"""Multi-device checks of sharding, run by `tests/sharding/test_multi_device.py` in a subprocess.

JAX fixes its device count when it initialises, and the test process has long initialised it with one CPU
device, so these checks run here with 8 fake CPU devices (`--xla_force_host_platform_device_count=8`).
Usage: `python tests/sharding/multi_device_worker.py train|misc|trainer OUT.json`; writes measurements (numbers,
specs) as JSON and lets the test assert on them.
"""

from __future__ import annotations

import os
import sys

# the repository root first: `python tests/sharding/multi_device_worker.py` would otherwise put only tests/sharding/
# on the path
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    # tiny models: compile time dominates; these two flags cut CPU compile time ~3x (numerics unchanged in kind:
    # the reference and the sharded runs use the same flags)
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
])

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hackable_diffusion import sharding as sh  # noqa: E402
from hackable_diffusion.data.sft import SFTBatch  # noqa: E402
from hackable_diffusion.diffusion.loss import LossConfig  # noqa: E402
from hackable_diffusion.model.config import get_preset  # noqa: E402
from hackable_diffusion.model.scan import stack_layers  # noqa: E402
from hackable_diffusion.model.transformer import DiffusionGemma, init_model  # noqa: E402
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from hackable_diffusion.training.step import (init_train_state, init_train_state_sharded,  # noqa: E402
                                              make_train_step)

CFG = get_preset("tiny")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring event of every XLA compile
# a sharded train step == one device: two meshes that together shard every axis (default tier, 'train'), and the
# data-parallel and data x fsdp meshes (slow tier, 'train_more'; the default tier places their parameters only)
TRAIN_MESHES = ((2, 2, 2, 1), (1, 2, 1, 4))
MORE_TRAIN_MESHES = ((8, 1, 1, 1), (2, 4, 1, 1))
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
def run_train(step_meshes=TRAIN_MESHES, placement_meshes=BYTES_ONLY_MESHES + MORE_TRAIN_MESHES) -> dict:
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
  for shape in step_meshes:
    mesh = mesh_of(shape)
    shardings = sh.state_shardings(mesh, state0)
    state = sh.shard_state(state0, shardings)
    step = make_train_step(graphdef, tx, loss_config, lr_schedule=schedule, mesh=mesh, shardings=shardings)
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
  for shape in placement_meshes:  # placement only (no step)
    mesh = mesh_of(shape)
    params = sh.shard_state(state0.params, sh.state_shardings(mesh, state0.params))
    out["meshes"]["x".join(map(str, shape))] = {
        "param_bytes_measured": bytes_per_device(params),
        "param_bytes_helper": sh.per_device_bytes(params, mesh),
        "specs": {"embed_tokens": spec(params["embed_tokens"][...]),
                  "experts.gate_up_proj": spec(params["layers"][0]["experts"]["gate_up_proj"][...]),
                  "k_proj.full": spec(params["layers"][1]["self_attn"]["k_proj"]["kernel"][...])},
    }
  return out


# ---- generate(mesh=...) -------------------------------------------------------------------------------------------
def run_generate_mesh(hd, ids, mask, seed, sampling) -> dict:
  """`hd.generate(..., mesh=)` of an unsharded model on 2x2x2x1 == one device, with every batch input (ids, mask,
  seed canvas, pins, per-row allowed tokens); records what the compiled denoising loop was given."""
  from hackable_diffusion.sampling import programs as programs_lib

  rng = np.random.default_rng(1)
  pins = rng.random(seed.shape) < 0.3
  allowed = np.ones((ids.shape[0], CFG.vocab_size), bool)
  allowed[0, 5:20] = False  # row 0 may not use these ids
  allowed[2, 30:] = False
  kwargs = dict(rng=jax.random.key(1), attention_mask=mask, seed_canvas=seed, pinned=pins, allowed_token_ids=allowed)
  single = hd.generate(init_model(CFG, 3), ids, sampling, **kwargs)
  seen: dict = {}
  original = programs_lib.denoise_program

  def spy(graphdef, static, mesh=None):  # records the placement of the denoising loop's arguments
    fn = original(graphdef, static, mesh)

    def call(state, cache, key, seed_canvas, use_seed, pinned, allowed_arg, structure, frozen, *rest, **kw):
      seen.update(seed=spec(seed_canvas), pinned=spec(pinned), allowed=spec(allowed_arg), frozen=spec(frozen),
                  cache_valid=spec(cache.valid), cache_key=spec(cache.keys[0]),
                  embed=spec(state["embed_tokens"][...]))
      return fn(state, cache, key, seed_canvas, use_seed, pinned, allowed_arg, structure, frozen, *rest, **kw)

    return call

  mesh = mesh_of((2, 2, 2, 1))
  programs_lib.denoise_program = spy
  try:
    sharded = hd.generate(init_model(CFG, 3), ids, sampling, mesh=mesh, **kwargs)
    unsharded_seen = dict(seen)
    # scanned layers: the cache is stacked [groups, batch, ...] and split along its batch axis (1)
    scanned = hd.generate(stack_layers(init_model(CFG, 3)), ids, sampling, mesh=mesh, **kwargs)
    scanned_cache_key = seen["cache_key"]
    seen = unsharded_seen
  finally:
    programs_lib.denoise_program = original
  try:
    hd.generate(init_model(CFG, 3), ids[:3], sampling, rng=jax.random.key(1), mesh=mesh)
    bad = ""
  except ValueError as e:
    bad = str(e)
  return {
      "equal": bool(np.array_equal(np.asarray(single.sequences), np.asarray(sharded.sequences))),
      "steps_equal": bool(np.array_equal(np.asarray(single.denoising_steps), np.asarray(sharded.denoising_steps))),
      "tpf_equal": bool(np.array_equal(np.asarray(single.tokens_per_forward), np.asarray(sharded.tokens_per_forward))),
      "scanned_equal": bool(np.array_equal(np.asarray(single.sequences), np.asarray(scanned.sequences))),
      "scanned_cache_key": scanned_cache_key,
      "new_tokens": int(np.asarray(single.sequences).shape[1] - ids.shape[1]),
      "specs": seen,
      "bad_batch_error": bad,
  }


# ---- generate, checkpoints, HF loading ---------------------------------------------------------------------------
def run_misc() -> dict:
  import hackable_diffusion as hd
  from hackable_diffusion.interop.hf import load_pretrained, save_pretrained
  from hackable_diffusion.runs.checkpoints import Checkpointer

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
  out["generate_mesh"] = run_generate_mesh(hd, ids, mask, seed, sampling)

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
  graphdef, state_b, shardings_b = init_train_state_sharded(lambda: DiffusionGemma(CFG, rngs=nnx.Rngs(4)), tx, mesh_b)
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
    loaded = load_pretrained(tmp, mesh=mesh_b)
    loaded_bf16 = load_pretrained(tmp, jnp.bfloat16, mesh=mesh_b)
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


# ---- Trainer on a mesh ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def spy_programs():
  """Records what every encode program of `generate` is given: the model's arrays, the prompt ids' rows / spec."""
  from hackable_diffusion.sampling import programs as programs_lib

  seen: list[dict] = []
  original = programs_lib.encode_program

  def spy(graphdef, mesh=None):
    fn = original(graphdef, mesh)

    def call(state, cache, ids, *rest, **kw):
      seen.append({"state": jax.tree.leaves(state), "embed": spec(state["embed_tokens"][...]),
                   "ids_rows": int(ids.shape[0]), "ids_spec": spec(ids)})
      return fn(state, cache, ids, *rest, **kw)

    return call

  programs_lib.encode_program = spy
  try:
    yield seen
  finally:
    programs_lib.encode_program = original


def run_trainer() -> dict:
  """`Trainer` with `mesh` config sections: 3 steps on data 2 x fsdp 2 x tensor 2, resumed for 2 more on
  fsdp 4 x tensor 2, against 5 straight steps on one device (no mesh); and a batch the mesh cannot split."""
  from hackable_diffusion.runs import config as config_lib
  from hackable_diffusion.training import logging as log_lib
  from hackable_diffusion.runs import run as run_lib
  from hackable_diffusion.training import trainer as trainer_lib

  common = {
      "train.batch_size": 8, "train.log_every": 1, "train.checkpoint_every": 100, "train.eval_at_end": False,
      "train.async_checkpointing": False, "data.generator_args.num_train": 64, "data.generator_args.num_validation": 8,
      "data.prefetch_batches": 0,
      # as run_train: Adam's update a smooth function of the gradient, and a first step that moves the weights
      "optimizer.warmup_steps": 0, "optimizer.peak_lr": 1e-3, "optimizer.eps": 1e-3,
      # one schedule for the 5 straight steps and the 3 + 2 resumed ones (0 would follow each run's train.steps)
      "optimizer.decay_steps": 1000,
      # a small evaluation: 7 examples in batches of 3 (3, 3, 1: padded to 4 rows on fsdp=4), two runs
      "eval.num_examples": 7, "eval.batch_size": 3, "eval.step_budgets": (3,), "eval.early_stopping_steps": 3,
  }

  def config(steps: int, mesh: dict[str, int] | None = None, **extra):
    over = {**common, "train.steps": steps, **{f"mesh.{k}": v for k, v in (mesh or {}).items()}, **extra}
    return config_lib.load_config_file("tiny.py", over)

  def losses(workdir: str) -> dict[str, float]:
    return {str(r["step"]): r["train/loss"] for r in log_lib.read_metrics(workdir)}

  out: dict = {}
  with tempfile.TemporaryDirectory() as tmp:
    single, sharded = os.path.join(tmp, "single"), os.path.join(tmp, "sharded")
    with trainer_lib.Trainer(config(5), single, progress=False) as t:
      out["single_mesh"] = t.mesh is not None
      t.train()
    mesh_a = {"data": 2, "fsdp": 2, "tensor": 2}
    with trainer_lib.Trainer(config(3, mesh_a), sharded, progress=False) as t:
      out["a_mesh"] = dict(t.mesh.shape)
      out["a_embed_spec"] = spec(t.state.params["embed_tokens"][...])
      t.train()
      out["a_batch_spec"] = spec(sh.shard_batch(t.train_data[0], t.mesh).completion_ids)
    out["a_checkpoints"] = sorted(int(d) for d in os.listdir(os.path.join(sharded, "checkpoints")) if d.isdigit())
    mesh_b = {"data": 1, "fsdp": 4, "tensor": 2}
    with trainer_lib.Trainer(config(5, mesh_b), sharded, progress=False) as t:
      out["b_mesh"] = dict(t.mesh.shape)
      out["b_start_step"] = t.step
      out["b_embed_spec"] = spec(t.state.params["embed_tokens"][...])
      mu = [x for path, x in jax.tree_util.tree_leaves_with_path(t.state.opt_state)
            if "mu" in jax.tree_util.keystr(path) and "q_proj" in jax.tree_util.keystr(path)]
      out["b_mu_spec"] = spec(mu[0])  # Adam's first moment of layer 0's q_proj kernel
      t.train()
      train_arrays = jax.tree.leaves((t.state.params, t.state.rest))
      train_sharding = dict(zip(map(id, train_arrays), jax.tree.leaves((t._shardings.params, t._shardings.rest))))
      with spy_programs() as seen:  # evaluation during training: sampled on the run's mesh
        t0 = time.perf_counter()
        out["mesh_report"] = t.evaluate()
        out["mesh_eval_seconds"] = time.perf_counter() - t0
      out["eval_calls"] = len(seen)
      # every model array handed to the sampler's programs is the train state's own array, in its training sharding
      out["eval_state_is_train_state"] = bool(seen) and all(
          len(c["state"]) == len(train_arrays) and {id(x) for x in c["state"]} == set(train_sharding) for c in seen)
      out["eval_state_in_train_shardings"] = all(
          x.sharding.is_equivalent_to(train_sharding[id(x)], x.ndim) for c in seen for x in c["state"]
          if id(x) in train_sharding)
      out["eval_state_min_devices"] = min(len(x.sharding.device_set) for c in seen for x in c["state"])
      out["eval_embed_specs"] = sorted({json.dumps(c["embed"]) for c in seen})
      out["eval_ids"] = sorted({json.dumps([c["ids_rows"], c["ids_spec"]]) for c in seen})
    with trainer_lib.Trainer(config(5), single, progress=False) as t:  # the 5-step single-device state
      single_params = jax.device_get(t.state.params)
    restored = run_lib.load_run(sharded)  # and the mesh run's, restored on one device
    out["final_param_max_diff"] = max_diff(nnx.state(restored.model, nnx.Param), single_params)
    # the same checkpoint evaluated on one device: the mesh evaluation's reference
    data = run_lib.load_eval_data(restored.config, restored.model.config, restored.tokenizer, restored.paths)
    out["single_report"] = run_lib.evaluate_model(restored.config, restored.model, restored.tokenizer, data,
                                                  step=restored.step, out_dir=os.path.join(tmp, "eval_single"))
    # `python -m hackable_diffusion.evaluate`'s path: the run's mesh from its config, restored straight into shards
    cfg_b = dataclasses.replace(restored.config, mesh=sh.MeshConfig(**mesh_b))
    on_mesh = run_lib.load_run(sharded, cfg_b, mesh=run_lib.make_run_mesh(cfg_b))
    out["load_run_mesh"] = dict(on_mesh.mesh.shape)
    out["load_run_embed_spec"] = spec(on_mesh.model.embed_tokens[...])
    model_arrays = jax.tree.leaves(nnx.state(on_mesh.model))
    with spy_programs() as seen:
      out["load_run_report"] = run_lib.evaluate_model(on_mesh.config, on_mesh.model, on_mesh.tokenizer, data,
                                                      step=on_mesh.step, out_dir=os.path.join(tmp, "eval_mesh"),
                                                      mesh=on_mesh.mesh)
    out["load_run_eval_state_is_model"] = bool(seen) and all(
        {id(x) for x in c["state"]} == {id(x) for x in model_arrays} for c in seen)
    # the same 3 steps on the same mesh with the layers scanned (stacked variables sharded by the same rules)
    scanned_cfg = config(3, mesh_a)
    scanned_cfg.unlock()
    scanned_cfg.model.overrides.scan_layers = True
    scanned_cfg.lock()
    with trainer_lib.Trainer(scanned_cfg, os.path.join(tmp, "scanned"), progress=False) as t:
      out["scan_q_spec"] = spec(t.state.params["layers"]["blocks"][0]["self_attn"]["q_proj"]["kernel"][...])
      out["scan_q_shape"] = list(t.state.params["layers"]["blocks"][0]["self_attn"]["q_proj"]["kernel"][...].shape)
      t.train()
    out["scanned_losses"] = losses(os.path.join(tmp, "scanned"))
    out["single_losses"], out["sharded_losses"] = losses(single), losses(sharded)
    try:
      trainer_lib.Trainer(config(3, mesh_a, **{"train.batch_size": 6}), os.path.join(tmp, "bad"), progress=False)
      out["bad_batch_error"] = ""
    except config_lib.ConfigError as e:
      out["bad_batch_error"] = str(e)
  return out


if __name__ == "__main__":
  what, path = sys.argv[1], sys.argv[2]
  result = {"train": run_train, "train_more": lambda: run_train(MORE_TRAIN_MESHES, ()), "misc": run_misc,
            "trainer": run_trainer}[what]()
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
