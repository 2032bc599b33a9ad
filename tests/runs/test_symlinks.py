"""No symbolic link is followed for writing: a link planted in a workdir or an export folder under a name the
project writes (the lock file, config.json, metrics.jsonl, a safetensors file, a tokenizer file) is refused with one
line, and the file it points to (the victim) is left byte for byte as it was. Also: exported files get the usual
permissions (0666 less the umask), and a full disk while exporting is one line.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hackable_diffusion import files
from hackable_diffusion.errors import CheckpointError, UnsafePathError
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop import hf_write
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
    hf_write._atomic_save(tensors, str(out / "model.safetensors"), {"format": "pt"})  # noqa: SLF001
  assert open(victim).read() == VICTIM_TEXT
  os.remove(out / "model.safetensors")
  old = os.umask(0o022)
  try:
    hf_write._atomic_save(tensors, str(out / "model.safetensors"), {"format": "pt"})  # noqa: SLF001
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
  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(hf_write, "save_file", full)
  with pytest.raises(CheckpointError) as err:
    hf_write._atomic_save({"w": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"), {})  # noqa: SLF001
  assert str(err.value) == f"cannot write {tmp_path / 'model.safetensors'}: No space left on device"
  assert os.listdir(tmp_path) == []
