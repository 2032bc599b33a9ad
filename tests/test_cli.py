"""The CLIs as a user runs them (subprocesses): help, one-line errors, a run killed with SIGKILL and resumed,
then evaluate and sample on the result.

Subprocesses share a persistent XLA compilation cache (`<pytest basetemp>/xla_cache`, also used in-process by
tests/training/test_trainer.py with the same settings), so the same programs are not compiled again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hackable_diffusion.errors import CheckpointError, DataError
from hackable_diffusion.runs import checkpoints
from hackable_diffusion import cli as cli_lib
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.training import logging as log_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 300
# Same optimizer/eval settings as tests/training/test_trainer.py: the compiled programs are shared.
TRAIN_OVERRIDES = [
    f"--config.train.steps={STEPS}", "--config.optimizer.decay_steps=500", "--config.train.checkpoint_every=25",
    "--config.train.log_every=25", "--config.train.eval_at_end=false", "--no_progress",
]
STORED_THRESHOLD = 0.004  # a stricter early stop than tiny.py's 0.005 (the sampled outputs can only get surer)
EVAL_OVERRIDES = ["--config.eval.num_examples=64", "--config.eval.step_budgets=(2,8)",
                  "--config.eval.early_stopping_steps=8"]


def compilation_cache_dir(tmp_path_factory) -> str:
  path = tmp_path_factory.getbasetemp() / "xla_cache"
  path.mkdir(exist_ok=True)
  return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=compilation_cache_dir(tmp_path_factory),
              PYTHONPATH=path)


def cli(module, *args, env, cwd, timeout=300):
  return subprocess.run([sys.executable, "-m", f"hackable_diffusion.{module}", *args], env=env, cwd=cwd,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("module,flag", [("train", "--config"), ("evaluate", "--step"), ("sample", "--prompt")])
def test_help(module, flag, env, tmp_path):
  res = cli(module, "--help", env=env, cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  assert flag in res.stdout and "--workdir" in res.stdout and f"hackable_diffusion.{module}" in res.stdout


def test_bad_inputs_print_one_line(env, tmp_path):
  """What a user sees for a bad key, a missing data file, a missing workdir, a bad value: one `error:` line, exit
  code 1, nothing written. (More messages are checked in-process below and in tests/test_configs.py.)"""
  import re

  cases = [
      ("train", ["--config=tiny.py", "--config.optimizer.peak_lrr=1"], "valid keys: .*peak_lr"),
      ("train", ["--config=tiny.py", "--config.data.generator=", "--config.data.train_path=/no/such.jsonl",
                 f"--workdir={tmp_path / 'w1'}"], "/no/such.jsonl: data file not found"),
      ("evaluate", [f"--workdir={tmp_path / 'missing'}"], "missing/config.json: no such file"),
      # a model field the file does not list: accepted by the CLI, its value checked before any data is written
      ("train", ["--config=tiny.py", "--config.model.overrides.matmul_dtype=fp8", f"--workdir={tmp_path / 'w4'}"],
       r"model\.overrides: ModelConfig\.matmul_dtype='fp8'; expected one of"),
  ]
  for module, args, pattern in cases:
    res = cli(module, *args, env=env, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1, (module, args)
    assert len(lines) == 1 and lines[0].startswith("error: "), (module, args, res.stderr)
    assert re.search(pattern, lines[0]), (pattern, lines[0])
  assert not (tmp_path / "w4").exists()  # refused before the workdir was written


@pytest.mark.parametrize("overrides, pattern", [
    ({"eval.sampling.t_min": 0.9, "eval.sampling.t_max": 0.1}, r"eval\.sampling\.t_min=0\.9"),
    ({"eval.sampling.acceptance": "no_such_rule"}, r"eval\.sampling\.acceptance='no_such_rule'")])
def test_a_bad_evaluation_sampler_fails_before_the_workdir_is_written(tmp_path, overrides, pattern):
  """The evaluation sampler is checked when the run starts, before any data, tokenizer or step (the same
  `ConfigError` the train CLI prints as its one line, above)."""
  workdir = tmp_path / "w"
  with pytest.raises(config_lib.ConfigError, match=pattern) as err:
    trainer_lib.train(config_lib.load_config_file("tiny.py", overrides), str(workdir), progress=False)
  assert "\n" not in str(err.value) and not workdir.exists()


def test_argv_checks_in_process(tmp_path):
  """The flag checks the CLIs run before absl parses argv (fast, no subprocess)."""
  argv = cli_lib.prepare_argv(["prog", "--config=tiny.py", "--config.train.steps=3"])
  shipped = os.path.join(config_lib.CONFIGS_DIR, "tiny.py")
  assert argv[1].startswith("--config=") and os.path.samefile(argv[1][len("--config="):], shipped)
  argv = cli_lib.prepare_argv(["prog", "--config", "tiny", "--config.train.steps=3"])
  assert os.path.samefile(argv[2], shipped)
  for argv, match in ((["prog", "--config=tiny.py", "--config.train.stepz=3"], "train has no 'stepz'; valid keys"),
                      (["prog", "--config=tiny.py", "--config.model.overrides.hidden_sise=3"],
                       "'hidden_sise' is not a ModelConfig field; valid keys: .*hidden_size"),
                      (["prog", "--config.train.steps=3"], "given without --config=FILE"),
                      (["prog", "--config=nope.py"], "'nope.py' not found")):
    with pytest.raises(config_lib.ConfigError, match=match) as err:
      cli_lib.prepare_argv(argv)
    assert "\n" not in str(err.value)
  default = config_lib.load_config_file("tiny.py")
  assert cli_lib.prepare_argv(["prog", "--config.eval.seed=3"], default_config=default) == [
      "prog", "--config.eval.seed=3"]


def test_model_overrides_the_config_file_lacks():
  """`--config.model.overrides.FIELD=VALUE` adds any ModelConfig field (absl only overrides keys a file defines):
  those flags leave argv (absl would refuse them) and are set after parsing; keys the file has stay for absl."""
  config = config_lib.load_config_file("tiny.py")
  assert "hidden_size" not in config.model.overrides and "canvas_length" in config.model.overrides
  argv = ["prog", "--config=tiny.py", "--config.model.overrides.hidden_size=48", "--config.train.steps=3",
          "--config.model.overrides.canvas_length=16",
          "--config.model.overrides.layer_types=('full_attention','full_attention')",
          "--config.model.overrides.matmul_dtype=bfloat16", "--noconfig.model.overrides.scan_layers",
          "--config.model.overrides.final_logit_softcapping=None"]
  assert cli_lib.prepare_argv(argv)[2:] == argv[2:]  # all keys accepted (argv[1]: the resolved path)
  rest, fields = cli_lib.split_model_overrides(argv, config)
  assert rest == ["prog", "--config=tiny.py", "--config.train.steps=3", "--config.model.overrides.canvas_length=16"]
  assert fields == {"hidden_size": 48, "layer_types": ("full_attention", "full_attention"), "matmul_dtype": "bfloat16",
                    "scan_layers": False, "final_logit_softcapping": None}
  cli_lib.set_model_overrides(config, fields)
  assert config.model.overrides.hidden_size == 48 and config.model.overrides.canvas_length == 8
  assert config_lib.ExperimentConfig.from_config_dict(config).model.overrides["matmul_dtype"] == "bfloat16"
  with pytest.raises(config_lib.ConfigError, match="needs a value"):
    cli_lib.split_model_overrides(["prog", "--config.model.overrides.num_experts", "8"], config)
  # what is no Python literal stays a string (ModelConfig then names the field if it is a bad value)
  _, fields = cli_lib.split_model_overrides(["prog", "--config.model.overrides.moe_impl={[1]: 2}",
                                             "--config.model.overrides.attention_structure=pkg.mod:mask"], config)
  assert fields == {"moe_impl": "{[1]: 2}", "attention_structure": "pkg.mod:mask"}


def test_bad_data_errors_in_process(tmp_path):
  """Data problems surface as one-line DataErrors naming file and line, before any model is built."""
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1", "completion": "1"}\n{"prompt": 3\n')
  nocomp = tmp_path / "nocomp.jsonl"
  nocomp.write_text('{"prompt": "1", "answer": "1"}\n')
  for path, match in ((bad, "bad.jsonl:2: invalid JSON"), (nocomp, "nocomp.jsonl:1: missing field 'completion'")):
    config = config_lib.load_config_file("tiny.py", {"data.generator": "", "data.train_path": str(path)})
    with pytest.raises(DataError, match=match) as err:
      trainer_lib.Trainer(config, str(tmp_path / "w"))
    assert "\n" not in str(err.value)
  corrupt = tmp_path / "corrupt_run"
  (corrupt / "checkpoints").mkdir(parents=True)
  config_lib.write_config_json(config_lib.load_config_file("tiny.py"), str(corrupt))
  (corrupt / "tokenizer.model").write_bytes(b"not a sentencepiece model")
  with pytest.raises(CheckpointError, match="tokenizer.model: not a valid SentencePiece model"):
    run_lib.load_run(str(corrupt))


def _wait_for_checkpoint(proc, workdir, min_step, timeout):
  ckpt_dir = os.path.join(workdir, "checkpoints")
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f"training ended before it could be killed: {proc.stderr.read()}")
    steps = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(ckpt_dir) else []
    if steps and max(steps) >= min_step:
      return max(steps)
    time.sleep(0.05)
  raise AssertionError("no checkpoint appeared in time")


@pytest.fixture(scope="module")
def killed_and_resumed(env, tmp_path_factory):
  """Starts training, SIGKILLs it right after its second checkpoint (async saves may be in flight), checks the
  workdir, then reruns the same command, which resumes and finishes."""
  tmp = tmp_path_factory.mktemp("cli_run")
  workdir = str(tmp / "run")
  # scan_layers: a ModelConfig field tiny.py's model.overrides does not list (its default value: same model)
  args = [sys.executable, "-m", "hackable_diffusion.train", "--config=tiny.py", f"--workdir={workdir}",
          *TRAIN_OVERRIDES, "--config.model.overrides.scan_layers=false",
          # stored in the run's config.json, not tiny.py's 0.005: `evaluate` must print (and use) the stored one
          f"--config.eval.sampling.confidence_threshold={STORED_THRESHOLD}"]
  proc = subprocess.Popen(args, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    seen = _wait_for_checkpoint(proc, workdir, 50, timeout=240)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == -signal.SIGKILL
  # the killed workdir is loadable: its latest complete checkpoint restores
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  at_kill = ckpt.latest_step()
  assert at_kill is not None and at_kill >= seen and at_kill < STEPS
  assert run_lib.load_run(workdir).step == at_kill
  res = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
  return workdir, at_kill, res, env, tmp


def test_sigkill_then_resume_finishes(killed_and_resumed):
  workdir, at_kill, res, _, _ = killed_and_resumed
  assert res.returncode == 0, res.stderr[-2000:]
  assert f"done: {workdir}" in res.stdout
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["model"]["overrides"] == {"canvas_length": 8, "scan_layers": False}
  ckpt = checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  assert ckpt.latest_step() == STEPS
  steps = [r["step"] for r in log_lib.read_metrics(workdir) if "train/loss" in r]
  assert steps == list(range(25, STEPS + 1, 25))  # the lost tail was dropped, nothing duplicated
  losses = [r["train/loss"] for r in log_lib.read_metrics(workdir) if "train/loss" in r]
  assert losses[-1] < losses[0]


def test_evaluate_and_sample_cli(killed_and_resumed):
  workdir, at_kill, _, env, tmp = killed_and_resumed
  out = os.path.join(tmp, "eval_out")
  res = cli("evaluate", f"--workdir={workdir}", f"--out={out}", *EVAL_OVERRIDES, env=env, cwd=tmp)
  assert res.returncode == 0, res.stderr[-2000:]
  assert "early_stopping" in res.stdout and "exact_match=" in res.stdout
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["eval"]["sampling"]["confidence_threshold"] == STORED_THRESHOLD
  sampler = next(line for line in res.stdout.splitlines() if line.startswith("sampler (the run's config.json"))
  assert f" confidence_threshold={STORED_THRESHOLD} " in f"{sampler} ", sampler  # the run's, not tiny.py's 0.005
  with open(os.path.join(out, f"report_step_{STEPS}.json")) as f:
    report = json.load(f)
  assert report["step"] == STEPS and report["num_examples"] == 64 and len(report["runs"]) == 3
  assert os.path.exists(os.path.join(out, f"accuracy_vs_steps_step_{STEPS}.png"))
  res = cli("evaluate", f"--workdir={workdir}", "--step=12345", env=env, cwd=tmp)
  assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
  assert "no checkpoint at step 12345; available steps: [275, 300]" in res.stderr
  # a bad sampler override of the run's config: one line before any evaluation (no report written)
  bad_out = os.path.join(tmp, "bad_eval_out")
  res = cli("evaluate", f"--workdir={workdir}", f"--out={bad_out}", "--config.eval.sampling.t_min=0.9",
            "--config.eval.sampling.t_max=0.1", env=env, cwd=tmp)
  assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
  assert "eval.sampling.t_min=0.9" in res.stderr and not os.path.exists(os.path.join(bad_out, "report_step_300.json"))
  res = cli("sample", f"--workdir={workdir}", "--prompt=5895382", "--steps=8", "--live", env=env, cwd=tmp)
  assert res.returncode == 0, res.stderr[-2000:]
  outs = res.stdout.strip().splitlines()
  # one line: the completion of a model that learned to sort (its length may miss a digit or two: EOS comes early
  # after 300 tiny steps)
  assert len(outs) == 1 and outs[0].isdigit() and 5 <= len(outs[0]) <= 8, res.stdout
  assert list(outs[0]) == sorted(outs[0]), res.stdout
  assert "[canvas 0 step   8]" in res.stderr  # the live view printed every step
  res = subprocess.run([sys.executable, "-m", "hackable_diffusion.sample", f"--workdir={workdir}", "--steps=8",
                        "--live"], input="5895382\n\n", env=env, cwd=tmp, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode == 0 and "prompt> " in res.stdout and outs[0] in res.stdout, res.stderr[-2000:]


def test_the_clis_let_jax_reserve_most_of_a_gpu_unless_told_otherwise(monkeypatch):
  """Every CLI sets XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 before JAX starts a backend (JAX's 0.75 leaves a quarter of
  the card unused); a value the user set is kept. The variable is read by the GPU client only (CPU unchanged)."""
  env: dict[str, str] = {}
  assert cli_lib.set_gpu_memory_fraction(env) == "0.95" and env == {cli_lib.GPU_MEMORY_FRACTION_ENV: "0.95"}
  mine = {cli_lib.GPU_MEMORY_FRACTION_ENV: "0.5"}
  assert cli_lib.set_gpu_memory_fraction(mine) == "0.5" and mine == {cli_lib.GPU_MEMORY_FRACTION_ENV: "0.5"}
  monkeypatch.delenv(cli_lib.GPU_MEMORY_FRACTION_ENV, raising=False)
  seen = []
  monkeypatch.setattr(cli_lib.app, "run", lambda main, flags_parser=None: seen.append(
      os.environ.get(cli_lib.GPU_MEMORY_FRACTION_ENV)))
  cli_lib.run_cli(lambda argv: None)
  assert seen == ["0.95"]
