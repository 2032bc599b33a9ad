"""A run directory never executes code: the one resolver of named components (`specs.resolve`) and the trust check
of a run's config.json (`runs.config_files.config_from_json`), in-process and through the CLIs.

The attack: a copied run whose config.json names `eval.task="subprocess:getoutput"` with
`task_args={"cmd": "touch MARKER"}`. `sample`, `evaluate` and `export` on it must refuse in one line naming the key,
the value and `--trust_remote_code`, and the marker file must not appear. The refusal comes before any model is
loaded, so the run needs only its config.json here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from hackable_diffusion import specs
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.sampling import rules
from hackable_diffusion.tasks import base as tasks_base

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _malicious_run(tmp_path, **eval_overrides) -> tuple[str, str]:
  """(workdir whose config.json names `subprocess:getoutput` as its task, the marker path the command creates)."""
  marker = str(tmp_path / "MARKER")
  raw = config_lib.config_to_dict(config_lib.load_config_file("tiny.py"))
  raw["eval"].update(task="subprocess:getoutput", task_args={"cmd": f"touch {marker}"}, **eval_overrides)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps(raw))
  return str(workdir), marker


def test_a_run_config_naming_code_is_refused_unless_trusted(tmp_path):
  workdir, marker = _malicious_run(tmp_path)
  path = os.path.join(workdir, "config.json")
  with pytest.raises(ConfigError) as err:
    config_lib.config_from_json(path)
  message = str(err.value)
  assert "\n" not in message
  assert "eval.task='subprocess:getoutput'" in message and path in message and "--trust_remote_code" in message
  from hackable_diffusion.runs import run as run_lib

  with pytest.raises(ConfigError, match="eval.task='subprocess:getoutput'"):
    run_lib.load_run(workdir)
  assert config_lib.config_from_json(path, trust_remote_code=True).eval.task == "subprocess:getoutput"
  assert not os.path.exists(marker)


@pytest.mark.parametrize("key,value", [
    ("data.generator", "os:system"), ("diffusion.loss_variant", "os:getcwd"),
    ("eval.sampling.acceptance", "os:getcwd"), ("model.overrides.attention_structure", "os:getcwd"),
    ("eval.ablations.a.task", "os:system"),
])
def test_every_key_naming_a_component_is_checked(tmp_path, key, value):
  raw = config_lib.config_to_dict(config_lib.load_config_file("tiny.py"))
  node = raw
  *parents, leaf = key.split(".")
  for part in parents:
    node = node.setdefault(part, {})
  node[leaf] = value
  path = tmp_path / "config.json"
  path.write_text(json.dumps(raw))
  with pytest.raises(ConfigError, match=f"{key}='{value}' in .* names code to import"):
    config_lib.config_from_json(str(path))


def test_built_in_and_plugin_names_are_accepted_from_a_run(tmp_path, monkeypatch):
  plugin = importlib.metadata.EntryPoint(name="digits_plugin", value="hackable_diffusion.tasks.text:DigitsTask",
                                         group="hackable_diffusion.tasks")
  real = importlib.metadata.entry_points
  monkeypatch.setattr(importlib.metadata, "entry_points",
                      lambda **kw: [plugin] if kw.get("group") == "hackable_diffusion.tasks" else real(**kw))
  raw = config_lib.config_to_dict(config_lib.load_config_file("tiny.py"))
  raw["eval"]["task"] = "digits_plugin"
  raw["data"]["generator"] = "digits"
  raw.setdefault("diffusion", {})["loss_variant"] = "elbo"
  path = tmp_path / "config.json"
  path.write_text(json.dumps(raw))
  config = config_lib.config_from_json(str(path))
  assert config.eval.task == "digits_plugin"
  task = tasks_base.get_task("digits_plugin", {"length": 5})  # resolved through the entry point
  assert type(task).__name__ == "DigitsTask"


def test_one_resolver_order_and_errors(monkeypatch):
  assert specs.resolve("acceptance_rules", "top_k", what="acceptance", builtins=rules.BUILTIN_RULES) is rules.TopK
  # a built-in name wins over a plugin of the same name; a plugin that fails to load is one line
  broken = importlib.metadata.EntryPoint(name="top_k", value="no_such_module_xyz:f",
                                         group="hackable_diffusion.acceptance_rules")
  other = importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz:f",
                                        group="hackable_diffusion.acceptance_rules")
  monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [broken, other])
  assert rules.resolve_factory("top_k") is rules.TopK
  with pytest.raises(ConfigError, match=r"^acceptance='broken': the installed plugin no_such_module_xyz:f .* cannot "
                                        r"be loaded"):
    rules.resolve_factory("broken")
  with pytest.raises(ConfigError, match=r"acceptance='nope' is unknown: expected one of \["):
    rules.resolve_factory("nope")
  with pytest.raises(ValueError, match="unknown component kind"):
    specs.plugins("registry")
  assert not isinstance(tasks_base.BUILTIN_TASKS, dict)  # a fixed table: nothing registers into it


def _cli(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
  return subprocess.run([sys.executable, "-m", f"hackable_diffusion.{module}", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module,args", [
    ("sample", ["--prompt=1234567"]),
    ("evaluate", []),
    ("export", ["--format=merged", "--out=exported"]),
])
def test_clis_refuse_a_copied_run_that_names_code(tmp_path, module, args):
  workdir, marker = _malicious_run(tmp_path)
  res = _cli(module, f"--workdir={workdir}", *args, cwd=tmp_path)
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1, res.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: eval.task='subprocess:getoutput' in "), res.stderr[-3000:]
  assert "--trust_remote_code" in lines[0]
  assert not os.path.exists(marker)
