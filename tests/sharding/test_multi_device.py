"""Multi-device sharding, in subprocesses with 8 fake CPU devices: sharded training (`make_train_step(mesh=)`) ==
one device, compile-once, per-device bytes, sharded generate (`generate(mesh=)`), cross-mesh checkpoint restore,
a train state initialised in its shards, HF checkpoints loaded straight into shards (`load_pretrained(mesh=)`),
`Trainer` with a `mesh` config section (== one device, resumed on another mesh), and evaluation on the run's
mesh with the parameters in their training shardings (== one device's report; `load_run(mesh=)` too).

The checks run in `tests/sharding/multi_device_worker.py` because JAX fixes its device count when it first
initialises, which other test modules in this process have already done with one device. The 'train' and 'misc'
workers run in parallel (one module fixture); the 'trainer' worker and the 'train_more' worker (the sharded step on
the data-parallel and data x fsdp meshes, whose placement the default tier checks) are in the slow tier. Workers report
numbers as JSON; the assertions live here.

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

import numpy as np
import pytest
from tiny_shards import TINY_BUFFERS, tiny_param_elements

from hackable_diffusion.model.config import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "sharding", "multi_device_worker.py")
TINY = get_preset("tiny")


# ---- multi-device: subprocess workers -------------------------------------------------------------------------------
def _run_workers(tmp, names: tuple[str, ...]) -> dict:
  """Runs the named workers in parallel; returns {name: JSON measurements (+ 'log')} or {name: {'error': ...}}."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  procs = {}
  for what in names:
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


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
  """The 'train' and 'misc' workers (sharded step, generate, checkpoints, loading), run in parallel."""
  return _run_workers(tmp_path_factory.mktemp("sharding"), ("train", "misc"))


@pytest.fixture(scope="module")
def more_train_results(tmp_path_factory):
  """The 'train_more' worker (the sharded step on two more meshes; slow tier)."""
  return _run_workers(tmp_path_factory.mktemp("sharding_more"), ("train_more",))


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory):
  """The 'trainer' worker (the `Trainer` and evaluation on meshes; slow tier)."""
  return _run_workers(tmp_path_factory.mktemp("sharding_trainer"), ("trainer",))


def _get(results, what):
  if "error" in results[what]:
    pytest.fail(results[what]["error"])
  return results[what]


TRAIN_MESHES = ("2x2x2x1", "1x2x1x4")  # together every mesh axis
MORE_TRAIN_MESHES = ("8x1x1x1", "2x4x1x1")


@pytest.mark.parametrize("mesh", TRAIN_MESHES)
def test_sharded_train_step_equals_one_device(worker_results, mesh):
  _check_sharded_step(_get(worker_results, "train"), mesh)


@pytest.mark.slow  # two more sharded steps: data parallel alone and data x fsdp
@pytest.mark.parametrize("mesh", MORE_TRAIN_MESHES)
def test_more_sharded_train_steps_equal_one_device(more_train_results, mesh):
  _check_sharded_step(_get(more_train_results, "train_more"), mesh)
  assert _get(more_train_results, "train_more")["meshes"][mesh]["compiles_after_first_step"] == 0


def _check_sharded_step(r: dict, mesh: str) -> None:
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


@pytest.mark.parametrize("mesh", TRAIN_MESHES + MORE_TRAIN_MESHES + ("1x1x1x8", "1x1x8x1"))
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
  # scanned layers: the same sequences, the stacked cache [groups, batch, ...] split along its batch axis
  assert g["scanned_equal"]
  assert g["scanned_cache_key"][:2] == [None, batch[0]]


def test_generate_mesh_rejects_a_batch_it_cannot_split(worker_results):
  msg = _get(worker_results, "misc")["generate_mesh"]["bad_batch_error"]
  assert "batch of 3 rows is not divisible by the 4 batch shards" in msg and "\n" not in msg


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_trainer_on_a_mesh_equals_one_device(trainer_results):
  """Trainer with `mesh.data=2, mesh.fsdp=2, mesh.tensor=2`: the state is sharded and the per-step losses are
  those of the same config on one device (1e-5 relative; see the module docstring)."""
  t = _get(trainer_results, "trainer")
  assert t["single_mesh"] is False  # the default config: no mesh
  assert t["a_mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
  assert t["a_embed_spec"] == ["tensor", "fsdp"] and t["a_batch_spec"] == [["data", "fsdp"]]
  single, sharded = t["single_losses"], t["sharded_losses"]
  assert sorted(single, key=int) == sorted(sharded, key=int) == ["1", "2", "3", "4", "5"]
  for step in ("1", "2", "3"):
    np.testing.assert_allclose(sharded[step], single[step], rtol=1e-5)
  assert len(set(single.values())) == 5  # the steps really trained (different batches, moving weights)


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_scanned_trainer_on_a_mesh_equals_one_device(trainer_results):
  """`scan_layers=True` on data 2 x fsdp 2 x tensor 2: stacked kernels are sharded like a layer's, behind a
  replicated layer axis, and the per-step losses are the unrolled single-device run's."""
  t = _get(trainer_results, "trainer")
  assert t["scan_q_spec"] == [None, "fsdp", "tensor"] and len(t["scan_q_shape"]) == 3
  for step in ("1", "2", "3"):
    np.testing.assert_allclose(t["scanned_losses"][step], t["single_losses"][step], rtol=1e-5)


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_trainer_checkpoint_resumes_on_another_mesh(trainer_results):
  """The step-3 checkpoint of the 2x2x2 run restores onto fsdp 4 x tensor 2 and continues: steps 4-5 and the final
  parameters match 5 straight steps on one device."""
  t = _get(trainer_results, "trainer")
  assert t["a_checkpoints"] == [3] and t["b_start_step"] == 3
  assert t["b_mesh"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  assert t["b_embed_spec"] == ["tensor", "fsdp"] and t["b_mu_spec"] == ["fsdp", "tensor"]
  for step in ("4", "5"):
    np.testing.assert_allclose(t["sharded_losses"][step], t["single_losses"][step], rtol=1e-5)
  assert t["final_param_max_diff"] <= 1e-6, t["final_param_max_diff"]


def _without_timing(report: dict) -> dict:
  return {**report, "runs": [{k: v for k, v in run.items() if k != "seconds"} for run in report["runs"]]}


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_trainer_evaluates_on_its_mesh_without_gathering(trainer_results):
  """Evaluation during training (fsdp 4 x tensor 2) hands the sampler the train state's own arrays, in their training
  shardings over all 8 devices (a model gathered onto one device would fail every check), and splits each batch of
  `eval.batch_size=3` examples, padded to 4 rows, over the batch axis."""
  t = _get(trainer_results, "trainer")
  assert t["eval_calls"] >= 4  # 3 batches x 2 runs + the trajectory, one encode call each (one canvas)
  assert t["eval_state_is_train_state"] and t["eval_state_in_train_shardings"]
  assert t["eval_state_min_devices"] == 8
  assert t["eval_embed_specs"] == ['["tensor", "fsdp"]']
  assert t["eval_ids"] == ['[4, ["fsdp"]]']


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_trainer_evaluation_on_a_mesh_equals_one_device(trainer_results):
  """Same checkpoint, same eval seed: the mesh evaluation's report (metrics, step counts, every sample's tokens, the
  trajectory) is the one-device evaluation's."""
  t = _get(trainer_results, "trainer")
  mesh, single = _without_timing(t["mesh_report"]), _without_timing(t["single_report"])
  assert [r["name"] for r in mesh["runs"]] == ["steps_3", "early_stopping"] and mesh["num_examples"] == 7
  assert mesh["trajectory"]["steps"]  # the trajectory was sampled on the mesh too
  assert mesh == single


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_evaluate_cli_path_restores_onto_the_run_mesh(trainer_results):
  """`load_run(..., mesh=make_run_mesh(cfg))` (what `python -m hackable_diffusion.evaluate` does for a run with a
  `mesh` section) restores the variables straight into their shards, samples with them unmoved, and reports what one
  device reports."""
  t = _get(trainer_results, "trainer")
  assert t["load_run_mesh"] == {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  assert t["load_run_embed_spec"] == ["tensor", "fsdp"] and t["load_run_eval_state_is_model"]
  assert _without_timing(t["load_run_report"]) == _without_timing(t["single_report"])


@pytest.mark.slow  # the trainer worker: training and evaluation runs on meshes
def test_trainer_rejects_a_batch_the_mesh_cannot_split(trainer_results):
  msg = _get(trainer_results, "trainer")["bad_batch_error"]
  assert msg.startswith("train.batch_size=6 is not divisible by the 4 batch shards of the mesh") and "\n" not in msg
