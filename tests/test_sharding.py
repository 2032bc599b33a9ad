"""Sharding: mesh config, logical-axis rules, memory arithmetic, and (in subprocesses with 8 fake CPU devices)
sharded training == one device, compile-once, per-device bytes, sharded generate (`generate(mesh=)`),
cross-mesh checkpoint restore, HF checkpoints loaded straight into shards, and `SFTTrainer` with a `mesh` config
section (== one device, resumed on another mesh).

The multi-device checks run in `tests/sharding_worker.py` because JAX fixes its device count when it first
initialises, which other test modules in this process have already done with one device. The three workers run
in parallel (started by one module fixture) and report numbers as JSON; the assertions live here.

Tolerances (float32): a sharded step computes the same sums in a different order (per-shard partial sums of the
batch mean and of every matmul contracting a sharded axis, then an all-reduce), so results differ by rounding
only: losses and gradient norms agree to 1e-5 relative, parameters and Adam moments to 1e-6 absolute (params are
O(1), so ~8 float32 ulps; the step's own update is ~2e-3). Adam's eps is 1e-3 in the worker so its update is a
smooth function of the gradient (with eps=1e-8 the first update is lr * sign(g), and a gradient within rounding
of zero could flip sign between reduction orders). The trainer runs (5 steps, two meshes) use the same settings
and tolerances: losses 1e-5 relative, final parameters 1e-6 absolute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from hackable_diffusion import sharding as sh
from hackable_diffusion.model.config import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "sharding_worker.py")
TINY = get_preset("tiny")
GIB = 1024 ** 3

# the meshes of the memory table in docs/scaling.md (axis sizes; missing axes are 1)
DOC_MESHES = (
    {"fsdp": 8},
    {"fsdp": 4, "tensor": 2},
    {"expert": 8},
    {"fsdp": 2, "expert": 4},
    {"data": 2, "fsdp": 8},
    {"fsdp": 16},
)


# ---- hand-written arithmetic for the tiny preset (independent of the helpers) -------------------------------------
def tiny_param_elements(fsdp: int = 1, tensor: int = 1, expert: int = 1) -> int:
  """Elements of every `nnx.Param` of `get_preset('tiny')` held by one device.

  embed -> fsdp; heads, kv, mlp, vocab -> tensor; expert -> expert; a dimension that does not divide is whole.
  tiny: vocab 64, hidden 32, mlp 64, 2 layers (sliding: 4 heads x 8, 2 kv heads; full: 4 heads x 16, 1 kv head,
  no v_proj), 4 experts x 16.
  """
  v, h, i, e, im = 64, 32, 64, 4, 16

  def d(n, k):
    return n // k if n % k == 0 else n

  hf = d(h, fsdp)
  mlp = 2 * hf * d(i, tensor) + d(i, tensor) * hf  # gate, up [H, I]; down [I, H]
  router = hf * e + hf + e  # proj [H, E] (E unsharded), scale [H], per_expert_scale [E]
  experts = d(e, expert) * d(2 * im, tensor) * hf + d(e, expert) * hf * d(im, tensor)
  per_layer = mlp + router + experts + 7 * hf  # + 7 RMSNorm weights [H]
  sliding = 2 * hf * d(4 * 8, tensor) + 2 * hf * d(2 * 8, tensor) + 2 * 8  # q, o; k, v; q/k norms [head_dim]
  full = 2 * hf * d(4 * 16, tensor) + hf * d(1 * 16, tensor) + 2 * 16  # q, o; k (no v)
  embed = d(v, tensor) * hf
  final_norm = hf
  self_conditioning = hf + mlp  # pre_norm [H] + MLP
  return embed + sliding + full + 2 * per_layer + final_norm + self_conditioning


TINY_BUFFERS = 2 * 2  # layer_scalar + encoder_layer_scalar per layer, [1] each, replicated


def tiny_lora_elements(rank: int, fsdp: int = 1, tensor: int = 1) -> int:
  """A [d_in, r] + B [r, d_out] for q/k/v/o and the dense MLP of both layers, held by one device.

  A keeps the kernel's input axis, B its output axis: `embed` -> fsdp; `heads`, `kv`, `mlp` -> tensor.
  """
  h, i = 32, 64

  def d(n, k):
    return n // k if n % k == 0 else n

  e_, t_ = (lambda n: d(n, fsdp)), (lambda n: d(n, tensor))
  mlp = 2 * (e_(h) + t_(i)) + (t_(i) + e_(h))  # gate, up [H, I]; down [I, H]
  sliding = (e_(h) + t_(32)) + 2 * (e_(h) + t_(16)) + (t_(32) + e_(h))  # q; k, v; o
  full = (e_(h) + t_(64)) + (e_(h) + t_(16)) + (t_(64) + e_(h))  # q; k; o (no v_proj)
  return rank * (sliding + full + 2 * mlp)


# ---- configuration --------------------------------------------------------------------------------------------
def test_mesh_config_resolves_the_rest_and_rejects_bad_shapes():
  assert sh.MeshConfig().shape(8) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
  assert sh.MeshConfig(data=-1, fsdp=4).shape(8) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
  assert sh.MeshConfig(data=1, fsdp=2, tensor=2, expert=-1).shape(16)["expert"] == 4
  with pytest.raises(ValueError, match=r"needs 8 devices but 4 are available"):
    sh.MeshConfig(data=2, fsdp=4).shape(4)
  with pytest.raises(ValueError, match=r"does not divide the 8 available devices"):
    sh.MeshConfig(data=-1, fsdp=3).shape(8)
  with pytest.raises(ValueError, match=r"at most one axis"):
    sh.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match=r"mesh.tensor=0"):
    sh.MeshConfig(tensor=0)
  with pytest.raises(ValueError, match=r"unknown mesh config keys \['fspd'\]"):
    sh.MeshConfig.from_dict({"fspd": 2})
  assert sh.MeshConfig.from_dict({"fsdp": 1, "data": -1}) == sh.MeshConfig()


def test_make_mesh_on_one_device():
  mesh = sh.make_mesh()
  assert mesh.axis_names == sh.MESH_AXES
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1, "expert": 1}
  with pytest.raises(ValueError, match=r"jax.device_count\(\)"):
    sh.make_mesh(sh.MeshConfig(data=1, fsdp=2 * jax.device_count()))


def test_distributed_is_opt_in(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert sh.maybe_initialize_distributed(sh.MeshConfig()) is False  # nothing configured: single process
  with pytest.raises(ValueError, match=r"num_processes is not"):
    sh.maybe_initialize_distributed(sh.MeshConfig(coordinator_address="10.0.0.1:1234"))
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match=r"no coordinator address"):
    sh.maybe_initialize_distributed(sh.MeshConfig())
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ValueError, match=r"process_id=2 is outside \[0, num_processes=2\)"):
    sh.maybe_initialize_distributed(sh.MeshConfig())


def test_mesh_config_section(monkeypatch):
  """The `mesh` section of experiment configs: default = no mesh; CLI-style overrides; one-line errors."""
  from hackable_diffusion.training import config as config_lib
  from hackable_diffusion.training import trainer as trainer_lib

  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  for path in sorted(os.listdir(config_lib.CONFIGS_DIR)):  # every config file has the section (so --config.mesh.*)
    if path.endswith(".py"):
      raw = config_lib.load_config_file(path)
      assert dict(raw.mesh) == dict(data=1, fsdp=1, tensor=1, expert=1, coordinator_address="", num_processes=0,
                                    process_id=-1, auto_distributed=False), path
  cfg = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py"))
  assert not cfg.mesh.enabled and trainer_lib.make_run_mesh(cfg) is None  # default: the one-device path
  del_mesh = config_lib.load_config_file("tiny.py").to_dict()
  del del_mesh["mesh"]  # configs written before the section existed (a workdir's config.json)
  assert config_lib.ExperimentConfig.from_config_dict(del_mesh).mesh == cfg.mesh
  gpu = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("sudoku_gpu.py", {"mesh.fsdp": 8}))
  assert gpu.mesh.enabled and gpu.mesh.mesh_config() == sh.MeshConfig(data=1, fsdp=8)
  multi = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file(
      "tiny.py", {"mesh.data": -1, "mesh.coordinator_address": "10.0.0.1:1234", "mesh.num_processes": 2,
                  "mesh.process_id": 1}))
  assert multi.mesh.mesh_config() == sh.MeshConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
  with pytest.raises(config_lib.ConfigError, match=r"^mesh.tensor=0; expected a positive integer or -1"):
    config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py", {"mesh.tensor": 0}))
  too_big = config_lib.load_config_file("tiny.py", {"mesh.fsdp": 2 * jax.device_count()})
  with pytest.raises(config_lib.ConfigError, match=r"^mesh .* devices but .* \(jax.device_count\(\)=\d+\)"):
    trainer_lib.make_run_mesh(config_lib.ExperimentConfig.from_config_dict(too_big))
  with pytest.raises(config_lib.ConfigError, match=r"unknown config key --config.mesh.fspd"):
    config_lib.load_config_file("tiny.py", {"mesh.fspd": 2})


def test_process_batch_shard_on_one_process():
  mesh = sh.make_mesh()
  assert sh.process_batch_shard(mesh) == (0, 1)


# ---- rules ------------------------------------------------------------------------------------------------------
def test_logical_rules():
  P = jax.sharding.PartitionSpec
  assert sh.logical_to_mesh_spec(("embed", "heads")) == P("fsdp", "tensor")
  assert sh.logical_to_mesh_spec(("expert", "mlp", "embed")) == P("expert", "tensor", "fsdp")
  assert sh.logical_to_mesh_spec(("vocab", "embed")) == P("tensor", "fsdp")
  assert sh.logical_to_mesh_spec(("batch", None, None)) == P(("data", "fsdp", "expert"))
  assert sh.logical_to_mesh_spec(None) == P()
  sizes = {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
  assert sh.logical_to_mesh_spec(("embed", "heads"), mesh=sizes) == P("fsdp")  # size-1 axes dropped
  assert sh.logical_to_mesh_spec(("batch",), mesh=sizes) == P(("data", "fsdp"))
  # a mesh axis is used once per spec; unknown names are replicated; mesh axis names map to themselves
  rules = (("a", ("fsdp",)), ("b", ("fsdp",)))
  assert sh.logical_to_mesh_spec(("a", "b"), rules=rules) == P("fsdp")
  assert sh.logical_to_mesh_spec(("nonsense", "tensor")) == P(None, "tensor")


def test_non_divisible_dimension_is_replicated_and_logged_once(caplog):
  P = jax.sharding.PartitionSpec
  sizes = {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  sh._LOGGED.clear()
  with caplog.at_level("WARNING"):
    assert sh.logical_to_mesh_spec(("embed", "heads"), mesh=sizes, shape=(6, 8)) == P(None, "tensor")
    assert sh.logical_to_mesh_spec(("embed", "heads"), mesh=sizes, shape=(6, 8)) == P(None, "tensor")
  messages = [r.getMessage() for r in caplog.records if "not divisible" in r.getMessage()]
  assert len(messages) == 1 and "(6, 8)" in messages[0], messages


def test_state_shardings_follow_variable_metadata():
  from flax import nnx

  from hackable_diffusion.model.transformer import DiffusionGemma
  from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
  from hackable_diffusion.training.step import init_train_state

  tx, _ = make_optimizer(OptimizerConfig())
  abstract = jax.eval_shape(lambda: init_train_state(DiffusionGemma(TINY, rngs=nnx.Rngs(0)), tx)[1])
  mesh = sh.make_mesh()
  shardings = sh.state_shardings(mesh, abstract)
  # same structure as the state (so it can be jit's in/out shardings), opt_state included
  assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(shardings))
  target = sh.abstract_with_shardings(abstract, shardings)
  assert all(x.sharding is not None for x in jax.tree.leaves(target))


# ---- memory arithmetic ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", [
    {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
    {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1},
    {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2},
    {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8},  # 4 experts over 8: replicated
    {"data": 1, "fsdp": 16, "tensor": 1, "expert": 1},  # hidden 32 over 16
])
def test_memory_estimate_matches_hand_arithmetic(mesh):
  f, t, e = mesh["fsdp"], mesh["tensor"], mesh["expert"]
  p = tiny_param_elements(f, t, e)
  full = sh.memory_estimate(TINY, mesh)
  assert full.params == 4 * (p + TINY_BUFFERS)
  assert full.grads == 4 * p
  assert full.optimizer == 2 * 4 * p
  assert full.adapters == 0
  assert full.num_trainable == tiny_param_elements()
  lora = sh.memory_estimate(TINY, mesh, lora_rank=8)
  n = tiny_lora_elements(8, f, t)
  assert lora.num_trainable == tiny_lora_elements(8)
  assert (lora.params, lora.adapters, lora.grads, lora.optimizer) == (4 * (p + TINY_BUFFERS), 4 * n, 4 * n, 8 * n)
  bf16 = sh.memory_estimate(TINY, mesh, param_dtype="bfloat16")
  assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * (p + TINY_BUFFERS), 2 * p, 8 * p)


def test_lora_estimate_matches_real_adapters():
  """The estimate's adapters are what `lora.apply_lora` creates (shapes, count and sharding)."""
  from flax import nnx

  from hackable_diffusion.lora.adapters import LoraConfig, apply_lora
  from hackable_diffusion.model.transformer import init_model

  model = apply_lora(init_model(TINY, 0), LoraConfig(rank=8), rngs=nnx.Rngs(0))
  adapters = nnx.state(model, nnx.LoRAParam)
  for mesh in ({"fsdp": 1}, {"fsdp": 2, "tensor": 2}, {"fsdp": 16, "tensor": 8}):
    estimate = sh.memory_estimate(TINY, mesh, lora_rank=8)
    assert estimate.adapters == sh.per_device_bytes(adapters, mesh), mesh
  assert estimate.num_trainable == sum(x.size for x in jax.tree.leaves(adapters))


def test_scaling_doc_table_is_current():
  """docs/scaling.md shows `memory_table` of the 26B-A4B preset; regenerate it when rules or the model change."""
  table = sh.memory_table(get_preset("diffusion_gemma_26b_a4b"), DOC_MESHES)
  with open(os.path.join(ROOT, "docs", "scaling.md"), encoding="utf-8") as f:
    doc = f.read()
  assert table in doc, "docs/scaling.md is stale; paste this table:\n" + table
  full = sh.memory_estimate(get_preset("diffusion_gemma_26b_a4b"), {"fsdp": 8})
  assert 25.2e9 < full.num_params < 25.3e9  # the public 26B-A4B shape
  assert abs(full.params - 2 * full.num_params / 8) < 0.01 * full.params  # bf16, ~all of it split 8 ways


# ---- multi-device: subprocess workers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
  """Runs the workers in parallel; returns {'train': ..., 'misc': ..., 'trainer': ...} (JSON measurements)."""
  tmp = tmp_path_factory.mktemp("sharding")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  procs = {}
  for what in ("train", "misc", "trainer"):
    out = str(tmp / f"{what}.json")
    procs[what] = (subprocess.Popen([sys.executable, WORKER, what, out], env=env, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
  results, start = {}, time.monotonic()
  for what, (proc, out) in procs.items():
    try:
      log, _ = proc.communicate(timeout=max(1.0, 600 - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
      proc.kill()
      log, _ = proc.communicate()
    if proc.returncode != 0:
      results[what] = {"error": f"worker {what!r} exited {proc.returncode}:\n{log[-4000:]}"}
    else:
      with open(out, encoding="utf-8") as f:
        results[what] = json.load(f)
      results[what]["log"] = log
  return results


def _get(results, what):
  if "error" in results[what]:
    pytest.fail(results[what]["error"])
  return results[what]


TRAIN_MESHES = ("8x1x1x1", "2x4x1x1", "2x2x2x1", "1x2x1x4")


@pytest.mark.parametrize("mesh", TRAIN_MESHES)
def test_sharded_train_step_equals_one_device(worker_results, mesh):
  r = _get(worker_results, "train")
  assert r["devices"] == 8
  m = r["meshes"][mesh]
  assert m["step"] == 2
  np.testing.assert_allclose(m["loss"], m["ref_loss"], rtol=1e-5)
  np.testing.assert_allclose(m["grad_norm"], m["ref_grad_norm"], rtol=1e-5)
  assert m["param_max_diff"] <= 1e-6, m["param_max_diff"]
  assert m["param_update_max"] > 1e-3  # the step really moved the parameters
  assert m["opt_max_diff"] <= 1e-6, m["opt_max_diff"]


def test_sharded_train_step_compiles_once(worker_results):
  r = _get(worker_results, "train")
  for mesh in TRAIN_MESHES:
    assert r["meshes"][mesh]["compiles_after_first_step"] == 0, mesh


def test_parameters_are_placed_by_the_rules(worker_results):
  specs = {k: v["specs"] for k, v in _get(worker_results, "train")["meshes"].items()}
  assert specs["8x1x1x1"]["embed_tokens"] == []  # pure data parallel: replicated
  assert specs["2x4x1x1"]["embed_tokens"] == [None, "fsdp"]
  assert specs["2x2x2x1"]["embed_tokens"] == ["tensor", "fsdp"]
  assert specs["2x2x2x1"]["q_proj"] == ["fsdp", "tensor"]
  assert specs["2x2x2x1"]["mu.embed_tokens"] == ["tensor", "fsdp"]  # optimizer state mirrors the params
  assert specs["1x2x1x4"]["experts.gate_up_proj"] == ["expert", None, "fsdp"]
  assert specs["1x1x1x8"]["experts.gate_up_proj"] == []  # 4 experts do not split 8 ways: replicated
  assert specs["1x1x8x1"]["experts.gate_up_proj"] == [None, "tensor"]
  assert "not divisible by mesh axes ('expert',) (size 8)" in _get(worker_results, "train")["log"]


@pytest.mark.parametrize("mesh", TRAIN_MESHES + ("1x1x1x8", "1x1x8x1"))
def test_per_device_bytes_match_hand_arithmetic(worker_results, mesh):
  m = _get(worker_results, "train")["meshes"][mesh]
  _, f, t, e = map(int, mesh.split("x"))
  want = 4 * tiny_param_elements(f, t, e)
  measured = m["param_bytes_measured"]
  assert len(measured) == 8 and set(measured.values()) == {want}, measured  # every device holds the same
  assert m["param_bytes_helper"] == want
  if "state_bytes_helper" in m:
    # TrainState: params + Adam mu, nu (same shardings) + 4 replicated fp32 buffers + 3 int32 counters
    want_state = 3 * want + 4 * TINY_BUFFERS + 3 * 4
    assert m["state_bytes_helper"] == want_state
    assert set(m["state_bytes_measured"].values()) == {want_state}


def test_generate_on_a_mesh_equals_one_device(worker_results):
  g = _get(worker_results, "misc")["generate"]
  assert g["embed_spec"] == ["tensor", "fsdp"]  # the parameters really were sharded
  assert g["new_tokens"] == 2 * TINY.canvas_length
  assert g["equal"] and g["steps_equal"]


def test_checkpoint_restores_onto_another_mesh(worker_results):
  c = _get(worker_results, "misc")["checkpoint"]
  assert c["max_diff"] == 0.0 and c["shardings_match"] and c["meta_step"] == 7
  assert c["restored_embed_spec"] == ["tensor", "fsdp"]  # saved on 2x4x1x1, restored on 1x2x2x2
  assert c["restored_mu_expert_spec"] == ["expert", "fsdp", "tensor"]


def test_train_state_initialised_in_shards_equals_one_device(worker_results):
  i = _get(worker_results, "misc")["init"]
  assert i["max_diff"] == 0.0 and i["graphdef_equal"] and i["shardings_match"]
  assert i["embed_spec"] == ["tensor", "fsdp"]


def test_hf_checkpoint_loads_straight_into_shards(worker_results):
  h = _get(worker_results, "misc")["hf"]
  assert h["files"] > 1  # a sharded safetensors checkpoint with an index
  assert h["max_diff"] == 0.0 and h["bf16_max_diff"] == 0.0 and h["bf16_dtype"] == "bfloat16"
  assert h["shardings_match"]
  assert h["q_proj_spec"] == ["fsdp", "tensor"] and h["experts_spec"] == ["expert", "tensor", "fsdp"]


def test_generate_mesh_argument_equals_one_device(worker_results):
  """`generate(model, ..., mesh=)` of an unsharded model: every batch input split over data x fsdp, the weights
  placed by the rules, and the same sequences as one device (argmax sampling, seed canvas, pins, per-row allowed
  tokens)."""
  g = _get(worker_results, "misc")["generate_mesh"]
  assert g["equal"] and g["steps_equal"] and g["tpf_equal"]
  assert g["new_tokens"] == 2 * TINY.canvas_length
  batch = [["data", "fsdp"]]
  specs = g["specs"]
  assert {k: specs[k] for k in ("seed", "pinned", "allowed", "frozen", "cache_valid")} == dict.fromkeys(
      ("seed", "pinned", "allowed", "frozen", "cache_valid"), batch)
  assert specs["cache_key"][0] == batch[0]
  assert specs["embed"] == ["tensor", "fsdp"]


def test_generate_mesh_rejects_a_batch_it_cannot_split(worker_results):
  msg = _get(worker_results, "misc")["generate_mesh"]["bad_batch_error"]
  assert "batch of 3 rows is not divisible by the 4 batch shards" in msg and "\n" not in msg


def test_trainer_on_a_mesh_equals_one_device(worker_results):
  """SFTTrainer with `mesh.data=2, mesh.fsdp=2, mesh.tensor=2`: the state is sharded and the per-step losses are
  those of the same config on one device (1e-5 relative; see the module docstring)."""
  t = _get(worker_results, "trainer")
  assert t["single_mesh"] is False  # the default config: no mesh
  assert t["a_mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
  assert t["a_embed_spec"] == ["tensor", "fsdp"] and t["a_batch_spec"] == [["data", "fsdp"]]
  single, sharded = t["single_losses"], t["sharded_losses"]
  assert sorted(single, key=int) == sorted(sharded, key=int) == ["1", "2", "3", "4", "5"]
  for step in ("1", "2", "3"):
    np.testing.assert_allclose(sharded[step], single[step], rtol=1e-5)
  assert len(set(single.values())) == 5  # the steps really trained (different batches, moving weights)


def test_trainer_checkpoint_resumes_on_another_mesh(worker_results):
  """The step-3 checkpoint of the 2x2x2 run restores onto fsdp 4 x tensor 2 and continues: steps 4-5 and the final
  parameters match 5 straight steps on one device."""
  t = _get(worker_results, "trainer")
  assert t["a_checkpoints"] == [3] and t["b_start_step"] == 3
  assert t["b_mesh"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  assert t["b_embed_spec"] == ["tensor", "fsdp"] and t["b_mu_spec"] == ["fsdp", "tensor"]
  for step in ("4", "5"):
    np.testing.assert_allclose(t["sharded_losses"][step], t["single_losses"][step], rtol=1e-5)
  assert t["final_param_max_diff"] <= 1e-6, t["final_param_max_diff"]


def test_trainer_evaluates_on_the_gathered_model(worker_results):
  t = _get(worker_results, "trainer")
  assert t["eval_model_devices"] == [1] and t["eval_model_max_diff"] == 0.0


def test_trainer_rejects_a_batch_the_mesh_cannot_split(worker_results):
  msg = _get(worker_results, "trainer")["bad_batch_error"]
  assert msg.startswith("train.batch_size=6 is not divisible by the 4 batch shards of the mesh") and "\n" not in msg
