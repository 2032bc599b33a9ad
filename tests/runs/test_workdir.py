"""The workdir before training (`runs/workdir.py`): one owner at a time, a resume never damages the run it
resumes, and every check that can be made at start is made before anything is written.

One tiny 2-step run (module fixture) provides a workdir with a checkpoint; each test works on its own copy. Two
subprocesses check what a CLI user sees (one `error:` line); the rest runs in-process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from hackable_diffusion.errors import ConfigError, DataError, TrainingError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.training import trainer as trainer_lib
from hackable_diffusion.runs import workdir as workdir_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# small and fast: 64 generated examples, 2 steps, no evaluation
SMALL = {
    "train.steps": 2, "train.batch_size": 8, "train.log_every": 1, "train.eval_at_end": False,
    "train.async_checkpointing": False, "data.generator_args.num_train": 64,
    "data.generator_args.num_validation": 8, "data.prefetch_batches": 0,
}


def small_config(**overrides):
  return config_lib.load_config_file("tiny.py", {**SMALL, **overrides})


def _env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0",
              PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))


def _cli(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", f"hackable_diffusion.{module}", *args], env=_env(), cwd=cwd,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A workdir trained for 2 steps through `trainer.train` (which must leave the workdir unlocked)."""
  workdir = str(tmp_path_factory.mktemp("tiny") / "run")
  trainer_lib.train(small_config(), workdir, progress=False)
  assert workdir_lib.checkpoint_steps(workdir) == [2]
  return workdir


@pytest.fixture
def run_copy(trained, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(trained, workdir)
  return workdir


def _digest(workdir: str) -> dict[str, str]:
  """sha256 of every file (and '<dir>' for every directory) under `workdir`."""
  out = {}
  for root, dirs, files in os.walk(workdir):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), workdir)] = "<dir>"
    for f in files:
      with open(os.path.join(root, f), "rb") as fh:
        out[os.path.relpath(os.path.join(root, f), workdir)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def _one_line(e: pytest.ExceptionInfo) -> str:
  text = str(e.value)
  assert "\n" not in text, text
  return text


# ---- one owner per workdir -------------------------------------------------------------------------------------------
def test_train_releases_the_lock(trained):
  assert not os.path.exists(os.path.join(trained, workdir_lib.LOCK_FILENAME))
  with workdir_lib.WorkdirLock(trained):  # free again
    pass


def test_second_trainer_on_one_workdir_refuses_naming_the_owner(run_copy):
  lock_path = os.path.join(run_copy, workdir_lib.LOCK_FILENAME)
  with trainer_lib.Trainer(small_config(), run_copy, progress=False):
    owner = open(lock_path, encoding="utf-8").read()
    with pytest.raises(TrainingError, match=rf"in use by another training run \(pid {os.getpid()} on host "
                       rf"{socket.gethostname()}") as e:
      trainer_lib.Trainer(small_config(**{"train.seed": 1}), run_copy, progress=False)
    _one_line(e)
    assert open(lock_path, encoding="utf-8").read() == owner  # the refused run left the owner's lock alone
  assert not os.path.exists(lock_path)  # released (and removed) by close()
  with trainer_lib.Trainer(small_config(), run_copy, progress=False) as t:  # free again
    assert t.step == 2


def test_failed_setup_releases_the_lock(tmp_path):
  """A trainer whose setup fails after taking the lock (here: bad training data) must not keep the workdir."""
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": 3\n')
  config = small_config(**{"data.generator": "", "data.train_path": str(bad)})
  for _ in range(2):  # the second attempt would be refused if the first kept the lock
    with pytest.raises(DataError, match="bad.jsonl:1: invalid JSON"):
      trainer_lib.Trainer(config, str(tmp_path / "w"), progress=False)
  assert not os.path.exists(tmp_path / "w" / workdir_lib.LOCK_FILENAME)


def test_lock_of_a_killed_process_does_not_block(tmp_path):
  """flock is dropped by the kernel when its owner dies, even on SIGKILL: the next run takes the lock over."""
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  code = ("import sys, time\nfrom hackable_diffusion.runs.workdir import WorkdirLock\n"
          "lock = WorkdirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n")
  proc = subprocess.Popen([sys.executable, "-c", code, workdir], stdout=subprocess.PIPE, text=True, env=_env())
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(TrainingError, match=rf"pid {proc.pid} on host {socket.gethostname()}") as e:
      workdir_lib.WorkdirLock(workdir).acquire()
    _one_line(e)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
  lock_path = os.path.join(workdir, workdir_lib.LOCK_FILENAME)
  assert str(proc.pid) in open(lock_path, encoding="utf-8").read()  # the stale file is still there...
  with workdir_lib.WorkdirLock(workdir):  # ...but does not block
    assert f'"pid": {os.getpid()}' in open(lock_path, encoding="utf-8").read()
  assert not os.path.exists(lock_path)


def test_cli_second_run_prints_one_line(tmp_path):
  """What a user sees starting `train` on a workdir another run holds: one `error:` line naming pid and host."""
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  with workdir_lib.WorkdirLock(workdir).acquire():
    res = _cli("train", "--config=tiny.py", f"--workdir={workdir}", "--config.train.steps=2", "--no_progress",
               cwd=tmp_path)
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1, res.stderr
  assert len(lines) == 1 and lines[0].startswith("error: workdir "), res.stderr
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in lines[0]
  assert os.listdir(workdir) == []  # the refused run wrote nothing (not even config.json); our lock is released


# ---- resume compatibility --------------------------------------------------------------------------------------------
def test_shape_changing_resume_is_refused_and_leaves_the_workdir_unchanged(run_copy):
  before = _digest(run_copy)
  raw = config_lib.config_to_dict(small_config())
  raw["model"]["overrides"]["hidden_size"] = 64  # the tiny preset has 32
  raw["optimizer"]["clip_norm"] = None  # no clipping: the optimizer state has another structure
  raw["optimizer"]["peak_lr"] = 1e-3  # safe changes: not listed among the refused ones
  raw["train"]["steps"] = 4
  with pytest.raises(ConfigError, match=r"has a checkpoint \(step 2\)") as e:
    trainer_lib.Trainer(raw, run_copy, progress=False)
  message = _one_line(e)
  assert "model.overrides.hidden_size: <unset> -> 64; optimizer.clip_norm: 1.0 -> null - " in message
  assert "train.steps" not in message and "peak_lr" not in message
  assert _digest(run_copy) == before  # byte for byte: config.json, checkpoints, tokenizer, metrics, no .lock


def test_safe_change_resumes_with_a_warning_and_keeps_the_previous_config(run_copy, monkeypatch):
  warnings = []
  monkeypatch.setattr(workdir_lib.logging, "warning", lambda msg, *args: warnings.append(msg % args))
  before = open(os.path.join(run_copy, config_lib.CONFIG_FILENAME), "rb").read()
  with trainer_lib.Trainer(small_config(**{"train.batch_size": 16, "train.steps": 4}), run_copy,
                              progress=False) as t:
    assert t.step == 2
    t.train()  # the resumed run really goes on
    assert t.step == 4
  assert any("changed config: train.batch_size: 8 -> 16; train.steps: 2 -> 4" in w for w in warnings), warnings
  assert open(os.path.join(run_copy, workdir_lib.PREV_CONFIG_FILENAME), "rb").read() == before
  stored = config_lib.config_from_json(os.path.join(run_copy, config_lib.CONFIG_FILENAME))
  assert stored.train.batch_size == 16


def test_unchanged_rerun_writes_no_previous_config(run_copy):
  with trainer_lib.Trainer(small_config(), run_copy, progress=False):
    pass
  assert not os.path.exists(os.path.join(run_copy, workdir_lib.PREV_CONFIG_FILENAME))


def test_without_a_checkpoint_the_config_may_change(tmp_path):
  workdir = str(tmp_path)
  config_lib.write_config_json(small_config(), workdir)
  raw = config_lib.config_to_dict(small_config())
  raw["model"]["overrides"]["hidden_size"] = 64
  assert workdir_lib.check_resume(raw, workdir) == []  # no checkpoint: nothing to protect
  os.makedirs(os.path.join(workdir, "checkpoints", "7"))
  with pytest.raises(ConfigError, match=r"step 7.*model.overrides.hidden_size: <unset> -> 64"):
    workdir_lib.check_resume(raw, workdir)


def test_data_paths_are_stored_absolute_so_another_directory_finds_the_data(tmp_path, monkeypatch):
  """Trained from directory A with a relative data path, the run is loaded (as `evaluate` / `sample` do) from
  directory B: config.json names the data absolutely, and the run's evaluation data load from there. A path
  relative to the workdir (hand-written config.json) resolves too."""
  from hackable_diffusion.runs import config_files
  from hackable_diffusion.runs import run as run_lib

  a, b = tmp_path / "a", tmp_path / "b"
  (a / "data").mkdir(parents=True)
  b.mkdir()
  lines = "".join(f'{{"prompt": "{i % 10}{(i + 3) % 10}", "completion": "{(i + 3) % 10}{i % 10}"}}\n'
                  for i in range(16))
  for split in ("train", "valid"):
    (a / "data" / f"{split}.jsonl").write_text(lines)
  monkeypatch.chdir(a)
  config = small_config(**{"data.generator": "", "data.train_path": "data/train.jsonl",
                           "data.validation_path": "data/valid.jsonl", "eval.split": "validation",
                           "train.steps": 1})
  trainer_lib.train(config, "run", progress=False)
  workdir = str(a / "run")
  monkeypatch.chdir(b)
  stored = config_files.config_from_json(os.path.join(workdir, "config.json"))
  assert stored.data.train_path == str(a / "data" / "train.jsonl")
  run = run_lib.load_run(workdir)
  assert run.paths["validation"] == str(a / "data" / "valid.jsonl")
  data = run_lib.load_eval_data(run.config, run.model.config, run.tokenizer, run.paths)
  assert len(data) > 0
  relative = config_files.resolve_data_paths({"data": {"train_path": "../data/train.jsonl"}}, workdir)
  assert relative["data"]["train_path"] == os.path.join(workdir, "../data/train.jsonl")


# ---- checks before anything is written -------------------------------------------------------------------------------
def test_missing_validation_file_fails_before_anything_is_written(tmp_path):
  train = tmp_path / "train.jsonl"
  train.write_text("".join(f'{{"prompt": "{i}{i + 1}", "completion": "{i + 1}{i}"}}\n' for i in range(8)))
  config = small_config(**{"data.generator": "", "data.train_path": str(train),
                           "data.validation_path": str(tmp_path / "nope.jsonl")})
  workdir = tmp_path / "w"
  with pytest.raises(DataError, match=r"data.validation_path=.*nope.jsonl: data file not found") as e:
    trainer_lib.Trainer(config, str(workdir), progress=False)
  _one_line(e)
  assert not workdir.exists()


@pytest.mark.parametrize("layout", ["workdir_is_a_file", "parent_is_a_file"])
def test_workdir_in_place_of_a_file_is_one_line(tmp_path, layout):
  file = tmp_path / "file"
  file.write_text("x")
  workdir = file if layout == "workdir_is_a_file" else file / "run"
  with pytest.raises(ConfigError, match=rf"workdir {file}.* is a file") as e:
    trainer_lib.Trainer(small_config(), str(workdir), progress=False)
  _one_line(e)
  assert file.read_text() == "x"


@contextlib.contextmanager
def _unprivileged():
  """As root (where permission bits do not stop writes) run as user 'nobody' for a while; otherwise as is."""
  if os.geteuid() != 0:
    yield
    return
  os.setegid(65534)
  os.seteuid(65534)
  try:
    yield
  finally:
    os.seteuid(0)
    os.setegid(0)


def test_read_only_workdir_is_one_line():
  base = tempfile.mkdtemp()  # not under pytest's 0700 tmp dir: 'nobody' must be able to reach the workdir
  try:
    os.chmod(base, 0o755)
    workdir = os.path.join(base, "run")
    os.makedirs(workdir, mode=0o555)
    os.chmod(workdir, 0o555)
    config = small_config()
    with _unprivileged():
      with pytest.raises(ConfigError, match=rf"workdir {workdir} is not writable: permission denied") as e:
        trainer_lib.Trainer(config, workdir, progress=False)
    _one_line(e)
    assert os.listdir(workdir) == []
  finally:
    shutil.rmtree(base)


def test_read_only_file_system_is_named(tmp_path, monkeypatch):
  """EROFS (a read-only mount; injected here, a test cannot mount one) is reported as such."""
  def read_only(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))

  monkeypatch.setattr(workdir_lib.os, "open", read_only)
  with pytest.raises(ConfigError, match=rf"workdir {tmp_path} is not writable: read-only file system"):
    workdir_lib.check_writable_dir(str(tmp_path))


def test_low_disk_space_warns(tmp_path, monkeypatch):
  warnings = []
  monkeypatch.setattr(workdir_lib.logging, "warning", lambda msg, *args: warnings.append(msg % args))
  assert not workdir_lib.warn_if_low_disk(str(tmp_path), 1)
  assert workdir_lib.warn_if_low_disk(str(tmp_path), 1 << 60) and "2 checkpoints" in warnings[0]


def test_evaluate_on_an_unwritable_run_fails_before_evaluating(run_copy, tmp_path):
  """`evaluate` checks its output directory first: one line, no report, no evaluation run first."""
  eval_dir = os.path.join(run_copy, "eval")
  shutil.rmtree(eval_dir, ignore_errors=True)
  with open(eval_dir, "w") as f:  # something that is not a writable directory where the report goes
    f.write("x")
  res = _cli("evaluate", f"--workdir={run_copy}", cwd=tmp_path)
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1, res.stderr
  assert len(lines) == 1, res.stderr
  assert lines[0] == f"error: eval directory {eval_dir} is a file, not a directory; pass --out=DIR to write the " \
                     "report elsewhere", res.stderr
