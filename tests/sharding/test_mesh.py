"""`sharding.mesh`: mesh shapes, one-device meshes, opt-in multi-host setup, and the `mesh` config section."""

from __future__ import annotations

import os

import jax
import pytest

from hackable_diffusion import sharding as sh
from hackable_diffusion.errors import ConfigError

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def test_mesh_config_resolves_the_rest_and_rejects_bad_shapes():
  assert sh.MeshConfig().shape(8) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
  assert sh.MeshConfig(data=-1, fsdp=4).shape(8) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
  assert sh.MeshConfig(data=1, fsdp=2, tensor=2, expert=-1).shape(16)["expert"] == 4
  with pytest.raises(ConfigError, match=r"needs 8 devices but 4 are available"):
    sh.MeshConfig(data=2, fsdp=4).shape(4)
  with pytest.raises(ConfigError, match=r"does not divide the 8 available devices"):
    sh.MeshConfig(data=-1, fsdp=3).shape(8)
  with pytest.raises(ConfigError, match=r"at most one axis"):
    sh.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ConfigError, match=r"^mesh.tensor=0"):
    sh.MeshConfig(tensor=0)
  with pytest.raises(ConfigError, match=r"unknown mesh config keys \['fspd'\]"):
    sh.MeshConfig.from_dict({"fspd": 2})
  assert sh.MeshConfig.from_dict({"fsdp": 1, "data": -1}) == sh.MeshConfig()
  assert issubclass(ConfigError, ValueError)  # `except ValueError` callers keep working


def test_make_mesh_on_one_device():
  mesh = sh.make_mesh()
  assert mesh.axis_names == sh.MESH_AXES
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1, "expert": 1}
  with pytest.raises(ConfigError, match=r"jax.device_count\(\)"):
    sh.make_mesh(sh.MeshConfig(data=1, fsdp=2 * jax.device_count()))


def test_distributed_is_opt_in(monkeypatch):
  for name in _ENV:
    monkeypatch.delenv(name, raising=False)
  assert sh.maybe_initialize_distributed(sh.MeshConfig()) is False  # nothing configured: single process
  with pytest.raises(ConfigError, match=r"num_processes is not"):
    sh.maybe_initialize_distributed(sh.MeshConfig(coordinator_address="10.0.0.1:1234"))
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ConfigError, match=r"no coordinator address"):
    sh.maybe_initialize_distributed(sh.MeshConfig())
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  with pytest.raises(ConfigError, match=r"process_id=2 is outside \[0, num_processes=2\)"):
    sh.maybe_initialize_distributed(sh.MeshConfig())


def test_mesh_config_section(monkeypatch):
  """The `mesh` section of experiment configs (a `MeshConfig`): default = no mesh; CLI-style overrides;
  one-line errors."""
  from hackable_diffusion.runs import config as config_lib
  from hackable_diffusion.runs import run as run_lib

  for name in _ENV:
    monkeypatch.delenv(name, raising=False)
  for path in sorted(os.listdir(config_lib.CONFIGS_DIR)):  # every config file has the section (so --config.mesh.*)
    if path.endswith(".py"):
      # base.py trains on a file it is given (it generates no data of its own)
      raw = config_lib.load_config_file(path, {"data.train_path": "train.jsonl"} if path == "base.py" else None)
      assert "mesh" in raw, path
      assert config_lib.ExperimentConfig.from_config_dict(raw).mesh == sh.MeshConfig(data=1), path
  cfg = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py"))
  assert not config_lib.mesh_requested(cfg.mesh) and run_lib.make_run_mesh(cfg) is None  # the one-device path
  del_mesh = config_lib.load_config_file("tiny.py").to_dict()
  del del_mesh["mesh"]  # configs written before the section existed (a workdir's config.json)
  assert config_lib.ExperimentConfig.from_config_dict(del_mesh).mesh == cfg.mesh
  gpu = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("sudoku_gpu.py", {"mesh.fsdp": 8}))
  assert config_lib.mesh_requested(gpu.mesh) and gpu.mesh == sh.MeshConfig(data=1, fsdp=8)
  multi = config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file(
      "tiny.py", {"mesh.data": -1, "mesh.coordinator_address": "10.0.0.1:1234", "mesh.num_processes": 2,
                  "mesh.process_id": 1}))
  assert multi.mesh == sh.MeshConfig(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
  with pytest.raises(ConfigError, match=r"^mesh.tensor=0; expected a positive integer or -1"):
    config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py", {"mesh.tensor": 0}))
  too_big = config_lib.load_config_file("tiny.py", {"mesh.fsdp": 2 * jax.device_count()})
  with pytest.raises(ConfigError, match=r"^mesh .* devices but .* \(jax.device_count\(\)=\d+\)"):
    run_lib.make_run_mesh(config_lib.ExperimentConfig.from_config_dict(too_big))
  with pytest.raises(ConfigError, match=r"unknown config key --config.mesh.fspd"):
    config_lib.load_config_file("tiny.py", {"mesh.fspd": 2})
