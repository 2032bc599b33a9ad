"""No symbolic link is followed for writing: a link planted in a workdir or an export folder under a name the
project writes (the lock file, config.json, metrics.jsonl, a safetensors file, a tokenizer file) is refused with one
line, and the file it points to (the victim) is left byte for byte as it was. Also: exported files get the usual
permissions (0666 less the umask), and a full disk while exporting is one line.
"""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

from hackable_diffusion import files
from hackable_diffusion.errors import CheckpointError, UnsafePathError
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop import safetensors_io
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import workdir as workdir_lib

VICTIM_TEXT = "the victim's own content\n"


@pytest.fixture
def victim(tmp_path):
  path = tmp_path / "victim.txt"
  path.write_text(VICTIM_TEXT)
  return str(path)


def _small_config():
  return config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file("tiny.py"))


@pytest.mark.parametrize("name", [".lock", "config.json", "metrics.jsonl", "tokenizer.model"])
def test_a_linked_file_in_the_workdir_is_refused_and_its_target_unchanged(tmp_path, victim, name):
  workdir = tmp_path / "run"
  workdir.mkdir()
  os.symlink(victim, workdir / name)
  with pytest.raises(UnsafePathError) as err:
    workdir_lib.open_workdir(_small_config(), str(workdir))
  message = str(err.value)
  assert "\n" not in message and name in message and "symbolic link" in message
  assert open(victim).read() == VICTIM_TEXT
  assert os.path.islink(workdir / name)  # left as it was
  assert not os.path.exists(workdir / ".lock") or name == ".lock"  # nothing locked behind


def test_the_lock_never_follows_a_link(tmp_path, victim):
  os.symlink(victim, tmp_path / ".lock")
  with pytest.raises(UnsafePathError, match=r"lock file .* is a symbolic link"):
    workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  assert open(victim).read() == VICTIM_TEXT


def test_write_atomic_refuses_a_link_and_never_follows_its_temporary_name(tmp_path, victim):
  link = tmp_path / "config.json"
  os.symlink(victim, link)
  with pytest.raises(UnsafePathError, match="config.json is a symbolic link"):
    files.write_json(link, {"a": 1})
  target = tmp_path / "report.json"
  os.symlink(victim, f"{target}.tmp-{os.getpid()}")  # planted at the temporary name
  files.write_json(target, {"a": 1})
  assert open(victim).read() == VICTIM_TEXT
  assert not os.path.islink(target) and not os.path.lexists(f"{target}.tmp-{os.getpid()}")


def test_exported_files_refuse_links_and_get_the_usual_permissions(tmp_path, victim):
  out = tmp_path / "export"
  out.mkdir()
  tensors = {"w": np.ones((2, 2), np.float32)}
  os.symlink(victim, out / "model.safetensors")
  with pytest.raises(UnsafePathError):
    safetensors_io.write_file(str(out / "model.safetensors"), tensors, {"format": "pt"})
  assert open(victim).read() == VICTIM_TEXT
  os.remove(out / "model.safetensors")
  old = os.umask(0o022)
  try:
    safetensors_io.write_file(str(out / "model.safetensors"), tensors, {"format": "pt"})
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(b"tok")
    os.symlink(victim, out / "tokenizer.model")
    with pytest.raises(UnsafePathError):
      export_lib.copy_tokenizer(str(tok), str(out))
    os.remove(out / "tokenizer.model")
    export_lib.copy_tokenizer(str(tok), str(out))
  finally:
    os.umask(old)
  assert open(victim).read() == VICTIM_TEXT
  for name in ("model.safetensors", "tokenizer.model"):
    assert os.stat(out / name).st_mode & 0o777 == 0o644, name


def test_a_full_disk_while_exporting_is_one_line(tmp_path, monkeypatch):
  class Full:
    def __init__(self, f):
      self.f = f

    def __getattr__(self, name):
      return getattr(self.f, name)

    def write(self, data):
      raise OSError(errno.ENOSPC, "No space left on device")

  opened = safetensors_io.open_new
  monkeypatch.setattr(safetensors_io, "open_new", lambda *a, **k: Full(opened(*a, **k)))
  with pytest.raises(CheckpointError) as err:
    safetensors_io.write_file(str(tmp_path / "model.safetensors"), {"w": np.ones(2, np.float32)}, {})
  assert str(err.value) == f"cannot write {tmp_path / 'model.safetensors'}: No space left on device"
  assert os.listdir(tmp_path) == []


def test_the_metric_writer_never_writes_through_a_link(tmp_path, victim):
  """metrics.jsonl (appended to), its rewrite's temporary file and the TensorBoard directory: a link planted at any
  of them is refused (the temporary name is removed, never followed) and its target left as it was."""
  from hackable_diffusion.training import logging as log_lib

  run = tmp_path / "run"
  run.mkdir()
  os.symlink(victim, run / "metrics.jsonl")
  with pytest.raises(UnsafePathError, match="metrics.jsonl is a symbolic link"):
    log_lib.MetricWriter(str(run), enabled=True, tensorboard=False)
  os.remove(run / "metrics.jsonl")
  os.symlink(victim, run / "metrics.jsonl.tmp")
  victim_dir = tmp_path / "victim_dir"
  victim_dir.mkdir()
  os.symlink(victim_dir, run / log_lib.TENSORBOARD_DIR)
  with pytest.raises(UnsafePathError, match="tensorboard is a symbolic link"):
    log_lib.MetricWriter(str(run), enabled=True)
  assert os.listdir(victim_dir) == [] and not os.path.lexists(run / "metrics.jsonl.tmp")
  os.remove(run / log_lib.TENSORBOARD_DIR)
  writer = log_lib.MetricWriter(str(run), enabled=True)
  writer.write(1, {"loss": 0.5})
  writer.close()
  assert open(victim).read() == VICTIM_TEXT
  assert [r["step"] for r in log_lib.read_metrics(str(run))] == [1]


def test_evaluation_reports_and_plots_never_follow_a_link(tmp_path, victim):
  """`write_report`: the report, the accuracy plot and the task's canvas plot are refused when a link stands at
  their name, and so is a linked output directory; the targets stay as they were."""
  from hackable_diffusion.evaluation import report as report_lib

  report = {"step": 3, "task": "t", "num_examples": 1, "primary_metric": "acc", "trajectory": {"steps": ["a"]},
            "runs": [{"name": "steps_2", "early_stopping": False, "max_denoising_steps": 2,
                      "mean_denoising_steps": 2.0, "metrics": {"acc": 0.5}}]}

  class Drawing:  # the one hook write_report calls

    def plot_trajectory(self, trajectory, path):
      with open(path, "w") as f:  # a task's own writer (follows links): must never meet one
        f.write("png")
      return path

  out = tmp_path / "eval"
  for pattern in (report_lib.REPORT_PATTERN, report_lib.PLOT_PATTERN, report_lib.CANVAS_PLOT_PATTERN):
    out.mkdir(exist_ok=True)
    target = out / pattern.format(step=3)
    os.symlink(victim, target)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
      report_lib.write_report(report, str(out), task=Drawing())
    assert open(victim).read() == VICTIM_TEXT and os.path.islink(target)
    shutil.rmtree(out)
  os.symlink(tmp_path, out)
  with pytest.raises(UnsafePathError, match="eval is a symbolic link"):
    report_lib.write_report(report, str(out), task=Drawing())
  os.remove(out)
  report_lib.write_report(report, str(out), task=Drawing())
  assert sorted(os.listdir(out)) == sorted(p.format(step=3) for p in (
      report_lib.REPORT_PATTERN, report_lib.PLOT_PATTERN, report_lib.CANVAS_PLOT_PATTERN))


def test_permissions_follow_the_umask_without_changing_it(tmp_path, monkeypatch):
  """`files.umask()` reads the umask without setting it (setting it to read it is process-wide, racy with other
  threads creating files); `make_readable` gives 0666 less the umask."""
  old = os.umask(0o027)
  try:
    monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was changed to read it"))
    assert files.umask() == 0o027
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)
    files.make_readable(path)
    assert os.stat(path).st_mode & 0o777 == 0o640
  finally:
    monkeypatch.undo()
    os.umask(old)
