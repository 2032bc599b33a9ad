"""I/O failures are errors, never hangs.

A full disk (ENOSPC) or a failing device (EIO) while writing metrics, TensorBoard events or a checkpoint stops the
run with a one-line error within seconds, keeps the last complete checkpoint restorable, and leaves no background
writer blocking the process. Most tests inject the error by replacing `builtins.open` for paths under the test's
directory (orbax writes its metadata through it; tensorstore's array writes do not, but one failed file fails the
save), so they need no special file system; `test_disk_full_cli_on_tmpfs` fills a real tmpfs where the test may
mount one (root, Linux) and is skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.errors import CheckpointError, TrainingError
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.runs import checkpoints
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.training import logging as log_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 30.0  # "exits within seconds": generous for a loaded CI machine, far from "forever"
# Same optimizer settings as tests/training/test_trainer.py: the compiled train step is shared in one session.
RUN = {"optimizer.decay_steps": 500, "train.log_every": 5, "train.checkpoint_every": 10,
       "train.eval_at_end": False, "train.keep_checkpoints": 1}


pytestmark = pytest.mark.usefixtures("shared_xla_cache")  # tests/conftest.py


class DiskFull:
  """`builtins.open` that raises `OSError(code)` for write modes under `root` once `arm()` was called."""

  def __init__(self, monkeypatch, root: str, code: int = errno.ENOSPC):
    self.root, self.code, self.armed_at, self.hits = os.path.abspath(root), code, None, 0
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
      if (self.armed_at is not None and isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
          and os.path.abspath(os.fspath(file)).startswith(self.root)):
        self.hits += 1
        raise OSError(self.code, os.strerror(self.code), os.fspath(file))
      return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)

  def arm(self) -> None:
    self.armed_at = time.monotonic()


class FailingFile:
  """A text file whose writes succeed into a buffer but whose flush (the real write) fails."""

  def __init__(self, code: int):
    self.code, self.closed = code, False

  def write(self, text: str) -> int:
    return len(text)

  def flush(self) -> None:
    raise OSError(self.code, os.strerror(self.code))

  def close(self) -> None:
    self.closed = True
    self.flush()


def _one_line(e: BaseException) -> str:
  msg = str(e)
  assert "\n" not in msg and len(msg) < 600, msg
  return msg


def _in_thread(fn, timeout: float = DEADLINE_S):
  """Runs `fn` in a daemon thread; returns ('ok', value) / ('raised', exception); fails if it has not returned
  after `timeout` seconds (a hang, not a slow call: the calls under test take milliseconds)."""
  out: list = []

  def target():
    try:
      out.append(("ok", fn()))
    except BaseException as e:  # noqa: BLE001
      out.append(("raised", e))

  t = threading.Thread(target=target, daemon=True)
  t.start()
  t.join(timeout)
  assert not t.is_alive(), f"{fn} did not return within {timeout}s"
  return out[0]


# ---- metrics.jsonl and TensorBoard --------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_metrics_write_failure_is_a_one_line_error(tmp_path, code):
  writer = log_lib.MetricWriter(str(tmp_path), enabled=True)
  writer.write(1, {"loss": 1.0}, prefix="train/")
  writer._file.close()
  writer._file = FailingFile(code)
  with pytest.raises(TrainingError, match=os.strerror(code)) as err:
    writer.write(2, {"loss": 0.5}, prefix="train/")
  assert "metrics.jsonl: cannot write metrics" in _one_line(err.value)
  assert "rerun to resume" in str(err.value)
  writer.close()  # the failure was reported: closing does not raise it again
  assert [r["step"] for r in log_lib.read_metrics(str(tmp_path))] == [1]


def test_metric_writer_starts_no_background_thread(tmp_path):
  """TensorBoard events are written in the caller's thread: no writer thread that could die and leave the
  trainer blocked on its queue (what tensorboardX's SummaryWriter did on a full disk)."""
  before = set(threading.enumerate())
  writer = log_lib.MetricWriter(str(tmp_path), enabled=True)
  for step in range(1, 30):
    writer.write(step, {"loss": 1.0 / step, "acc": 0.5}, prefix="train/")
  writer.close()
  assert set(threading.enumerate()) <= before
  events = os.listdir(tmp_path / log_lib.TENSORBOARD_DIR)
  assert len(events) == 1 and "tfevents" in events[0]
  scalars = _read_scalars(str(tmp_path / log_lib.TENSORBOARD_DIR / events[0]))
  assert [step for step, tag, _ in scalars if tag == "train/loss"] == list(range(1, 30))


def _read_scalars(path: str) -> list[tuple[int, str, float]]:
  """`(step, tag, value)` of every scalar in a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (length,) = struct.unpack("Q", data[pos:pos + 8])
    event = Event.FromString(data[pos + 12:pos + 12 + length])
    pos += 12 + length + 4
    for v in event.summary.value:
      out.append((event.step, v.tag, v.simple_value if v.HasField("simple_value") else float(v.tensor.float_val[0])))
  return out


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_dead_tensorboard_writer_never_hangs(tmp_path, code):
  """An event file whose writes fail: `write`, `flush` and `close` all return or raise promptly (checked in a
  thread with a join timeout); the first failure is a one-line TrainingError."""
  writer = log_lib.MetricWriter(str(tmp_path), enabled=True)
  writer.write(1, {"loss": 1.0}, prefix="train/")
  events = writer._tb

  def broken(*_args, **_kwargs):
    raise OSError(code, os.strerror(code))

  events._write = broken
  events.flush = broken
  for _ in range(3):  # more writes than tensorboardX's queue (10) would have taken before blocking
    kind, value = _in_thread(lambda: writer.write(2, {f"m{i}": float(i) for i in range(20)}, prefix="train/"))
    assert kind == "raised" and isinstance(value, TrainingError), value
    assert "tensorboard: cannot write metrics" in _one_line(value)
  kind, value = _in_thread(writer.flush)
  assert kind == "raised" and isinstance(value, TrainingError)
  assert _in_thread(writer.close) == ("ok", None)  # already reported: closing is quiet
  assert writer._file.closed


def test_metric_writer_resume_drops_the_lost_tail(tmp_path):
  """On resume from step 10, lines after step 10 (logged before a kill) are dropped: no step appears twice."""
  writer = log_lib.MetricWriter(str(tmp_path), enabled=True, tensorboard=False)
  for step in (5, 10, 15):
    writer.write(step, {"loss": 1.0}, prefix="train/")
  writer.close()
  with open(tmp_path / log_lib.METRICS_FILENAME, "a") as f:
    f.write('{"step": 20, "train/lo')  # a line cut by a kill
  writer = log_lib.MetricWriter(str(tmp_path), enabled=True, resume_step=10, tensorboard=False)
  writer.write(15, {"loss": 0.5}, prefix="train/")
  writer.close()
  with open(tmp_path / log_lib.METRICS_FILENAME) as f:
    assert [json.loads(line)["step"] for line in f] == [5, 10, 15]


# ---- checkpoints ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def state():
  tx, _ = make_optimizer(OptimizerConfig())
  _, st = init_train_state(init_model(get_preset("tiny"), seed=0), tx)
  return st.replace(step=jnp.asarray(3, jnp.int32))


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("async_save", [True, False])
def test_failed_save_keeps_the_last_complete_checkpoint(tmp_path, monkeypatch, state, async_save):
  """max_to_keep=1: the old step is deleted only after the new one is complete, so a failed save keeps it."""
  directory = str(tmp_path / "ckpt")
  disk = DiskFull(monkeypatch, directory)
  ckpt = checkpoints.Checkpointer(directory, max_to_keep=1, async_save=async_save)
  ckpt.save(1, state, {"seed": 0}, wait=True)
  disk.arm()
  with pytest.raises(CheckpointError) as err:
    ckpt.save(2, state, {"seed": 0})
    while time.monotonic() - disk.armed_at < DEADLINE_S:  # async: the trainer polls check() every step
      ckpt.check()
      time.sleep(0.01)
  assert disk.hits and time.monotonic() - disk.armed_at < DEADLINE_S
  msg = _one_line(err.value)
  assert f"{directory}/2: cannot write this checkpoint" in msg and "No space left on device" in msg
  assert f"the last complete checkpoint {directory}/1 is kept" in msg
  with pytest.raises(CheckpointError, match="cannot write this checkpoint"):  # stays failed: no further saves
    ckpt.save(3, state, {})
  assert _in_thread(ckpt.close) == ("ok", None)  # reported once; closing releases orbax quietly
  assert ckpt.complete_steps() == [1]
  # after close, the failed save's filter drops only late noise naming its directory: others' errors still show
  seen: list[str] = []
  handler = logging.Handler(level=logging.ERROR)
  handler.emit = lambda record: seen.append(record.getMessage())
  logging.getLogger("asyncio").addHandler(handler)
  try:
    logging.getLogger("asyncio").error(f"[late] Future exception was never retrieved: {directory}/2/params")
    logging.getLogger("asyncio").error("[other] Future exception was never retrieved: another program's")
  finally:
    logging.getLogger("asyncio").removeHandler(handler)
  assert [m for m in seen if m.startswith(("[late]", "[other]"))] == [
      "[other] Future exception was never retrieved: another program's"]
  with checkpoints.Checkpointer(directory, read_only=True) as ro:
    assert ro.latest_step() == 1
    restored, meta = ro.restore(jax.eval_shape(lambda: state))
  _assert_same(restored, state)
  assert meta["seed"] == 0


def test_a_long_error_message_still_names_the_os_error():
  """A failure whose message is long (orbax's wrappers around deep temporary paths) is cut at ~300 characters but
  still names the OS error that caused it: on CI's longer paths 'No space left on device' was cut off."""
  try:
    try:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/" + "x" * 200)
    except OSError as e:
      raise RuntimeError("writing /tmp/" + "y" * 400 + " failed") from e
  except RuntimeError as e:
    line = checkpoints.one_line_error(e)
  assert line.startswith("RuntimeError: writing /tmp/yyy") and "\n" not in line and len(line) < 400, line
  assert "[Errno 28] No space left on device" in line
  short = checkpoints.one_line_error(OSError(errno.EIO, os.strerror(errno.EIO)))
  assert short == "OSError: [Errno 5] Input/output error"  # already named: not repeated
  assert checkpoints.one_line_error(ValueError("bad\nvalue")) == "ValueError: bad value"
  quoted = checkpoints.one_line_error(ValueError("z" * 400 + " [Errno 28] No space left on device: '/tmp/a'"))
  assert quoted.endswith("... ([Errno 28] No space left on device)"), quoted  # quoted by a wrapper, cut off
  store = checkpoints.one_line_error(ValueError("RESOURCE_EXHAUSTED: Failed writing: \"/" + "p" * 400
                                                  + "/_sharding\": No space left on device"))  # tensorstore's form
  assert store.endswith("... (No space left on device)"), store


def test_first_save_failing_says_no_checkpoint_was_kept(tmp_path, monkeypatch, state):
  directory = str(tmp_path / "ckpt")
  disk = DiskFull(monkeypatch, directory, errno.EIO)
  with checkpoints.Checkpointer(directory) as ckpt:
    disk.arm()
    with pytest.raises(CheckpointError) as err:
      ckpt.save(1, state, {}, wait=True)
  msg = _one_line(err.value)
  assert "Input/output error" in msg and "no checkpoint was kept" in msg


def test_orbax_failure_logs_are_dropped_and_closed_loop_callbacks_ignored(tmp_path, monkeypatch):
  """The quiet hooks: orbax's tracebacks logged while a Checkpointer operation is in flight (or after a save
  failed) are dropped - the Checkpointer raises that failure as one line - and an unraisable 'Event loop is closed'
  (tensorstore calling back into a failed restore's closed loop) is not printed; anything else still is."""
  import logging as py_logging

  ckpt = checkpoints.Checkpointer(str(tmp_path / "c"))  # installs its log filter and the unraisable hook
  orbax_file = os.path.join(checkpoints._ORBAX_DIR, "checkpoint_manager.py")

  def record(path=orbax_file, level=py_logging.ERROR):
    exc = OSError(errno.ENOSPC, "No space left on device")
    return py_logging.LogRecord("absl", level, path, 1, "failed", None, (type(exc), exc, None))

  absl_logger = py_logging.getLogger("absl")
  filt = ckpt._log_filter  # one per Checkpointer (the other tests' failed saves keep theirs on the same logger)
  assert filt in absl_logger.filters
  assert filt.filter(record())  # no operation in flight: an orbax error is shown
  monkeypatch.setattr(ckpt, "_pending", 7)  # a save of step 7 in flight
  assert not filt.filter(record())
  assert filt.filter(record(path=__file__)) and filt.filter(record(level=py_logging.WARNING))
  monkeypatch.setattr(ckpt, "_pending", None)
  ckpt.close()  # a clean close removes its filter
  assert filt not in absl_logger.filters
  seen = []
  prev = checkpoints._previous_unraisablehook
  checkpoints._previous_unraisablehook = seen.append
  try:
    args = types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed"))
    checkpoints._ignore_closed_loop_callbacks(args)
    other = types.SimpleNamespace(exc_value=RuntimeError("something else"))
    checkpoints._ignore_closed_loop_callbacks(other)
    # an abandoned read coroutine of orbax, collected after the failed restore: its error is dropped; the same
    # error from a coroutine that is not orbax's is still shown
    namespace: dict = {}
    for name, path in (("orbax_read", os.path.join(checkpoints._ORBAX_DIR, "serialization.py")),
                       ("own_read", __file__)):
      exec(compile(f"async def {name}():\n  pass\n", path, "exec"), namespace)
    read_error = Exception("Encountered error while reading array index")
    coroutines = [namespace["orbax_read"](), namespace["own_read"]()]
    for coroutine in coroutines:
      checkpoints._ignore_closed_loop_callbacks(types.SimpleNamespace(exc_value=read_error, object=coroutine))
      coroutine.close()
  finally:
    checkpoints._previous_unraisablehook = prev
  assert [s.exc_value for s in seen] == [other.exc_value, read_error]
  assert seen[1].object is coroutines[1]


# ---- a training run on a full disk ----------------------------------------------------------------------------------
def _config(**overrides):
  return config_lib.load_config_file("tiny.py", {**RUN, **overrides})


def _files_under(root: str) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_disk_full_training_run_stops_and_resumes(tmp_path, monkeypatch):
  """The disk fills after the checkpoint of step 10 (keep_checkpoints=1): the run stops with one line within
  seconds, checkpoint 10 is intact and restorable, metrics.jsonl is valid, and a rerun (disk freed) resumes from it
  and finishes. Orbax's writer of the failed save's sharding files is slowed down (unless stopped, it finishes only
  after the error, and a rerun in the same process races it: 'Directory not empty'): nothing is written once the error
  is raised."""
  from orbax.checkpoint._src.serialization import jax_array_handlers  # fault injection into orbax's own writer

  workdir = str(tmp_path / "run")
  disk = DiskFull(monkeypatch, workdir)
  real_save = checkpoints.Checkpointer.save
  real_shardings = jax_array_handlers._async_serialize_shardings
  slow_writes = []

  async def slow_shardings(*args, **kwargs):
    if disk.armed_at is not None:
      slow_writes.append(time.monotonic())
      await asyncio.sleep(1.0)
    return await real_shardings(*args, **kwargs)

  monkeypatch.setattr(jax_array_handlers, "_async_serialize_shardings", slow_shardings)

  def save(self, step, *args, **kwargs):
    if step > 10 and disk.armed_at is None:
      self.wait()  # checkpoint 10 is complete; the disk fills now
      disk.arm()
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoints.Checkpointer, "save", save)
  with pytest.raises(CheckpointError) as err:
    trainer_lib.train(_config(**{"train.steps": 40}), workdir, progress=False)
  assert time.monotonic() - disk.armed_at < DEADLINE_S
  msg = _one_line(err.value)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  files = _files_under(ckpt_dir)
  assert slow_writes, "the failed save started no sharding writer: the injection no longer reaches orbax"
  time.sleep(1.5)
  assert _files_under(ckpt_dir) == files  # the failed save's writers had finished when the error was raised
  assert f"{ckpt_dir}/20: cannot write this checkpoint" in msg and f"checkpoint {ckpt_dir}/10 is kept" in msg
  assert checkpoints.Checkpointer(ckpt_dir, read_only=True).complete_steps() == [10]
  assert run_lib.load_run(workdir).step == 10
  with open(os.path.join(workdir, log_lib.METRICS_FILENAME)) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps == sorted(set(steps)) and 10 in steps
  disk.armed_at = None  # space freed: the same command resumes from step 10
  monkeypatch.setattr(checkpoints.Checkpointer, "save", real_save)
  trainer_lib.train(_config(**{"train.steps": 40}), workdir, progress=False)
  assert run_lib.load_run(workdir).step == 40
  assert [r["step"] for r in log_lib.read_metrics(workdir)] == list(range(5, 45, 5))


def _can_mount_tmpfs(path: str) -> bool:
  if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
    return False
  os.makedirs(path, exist_ok=True)
  res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", path], capture_output=True)
  return res.returncode == 0


def _fill(path: str) -> None:
  chunk = b"\0" * (1 << 20)
  with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
    try:
      while True:
        f.write(chunk)
    except OSError as e:
      assert e.errno == errno.ENOSPC
  try:  # the last few KB too
    with open(os.path.join(path, "filler2"), "wb", buffering=0) as f:
      while True:
        f.write(b"\0" * 512)
  except OSError:
    pass


@pytest.mark.slow  # the CLI form of test_disk_full_training_run_stops_and_resumes (default tier)
def test_disk_full_cli_on_tmpfs(tmp_path):
  """The CLI on a real full disk: after checkpoint 10 the tmpfs is filled; `train` exits with code 1 and one
  `error:` line within seconds, and checkpoint 10 still restores. Needs `mount` (root): skipped elsewhere."""
  mnt = str(tmp_path / "mnt")
  if not _can_mount_tmpfs(mnt):
    pytest.skip("cannot mount a tmpfs here (needs root on Linux); the injected-ENOSPC tests cover the logic")
  try:
    workdir = os.path.join(mnt, "run")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    args = [sys.executable, "-m", "hackable_diffusion.train", "--config=tiny.py", f"--workdir={workdir}",
            "--config.train.steps=100000", "--config.optimizer.decay_steps=500", "--config.train.log_every=5",
            "--config.train.checkpoint_every=10", "--config.train.keep_checkpoints=1", "--no_progress"]
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
      first = os.path.join(workdir, "checkpoints", "10")
      deadline = time.monotonic() + 240
      while not os.path.isdir(first):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
      _fill(mnt)
      full_at = time.monotonic()
      _, stderr = proc.communicate(timeout=DEADLINE_S)
      assert time.monotonic() - full_at < DEADLINE_S
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    lines = [line for line in stderr.strip().splitlines() if line]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert "No space left on device" in lines[0] and "is kept" in lines[0], lines[0]  # the whole line when it fails
    os.remove(os.path.join(mnt, "filler"))  # the reader needs no space, but orbax opens files read-only anyway
    steps = checkpoints.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True).complete_steps()
    assert steps and run_lib.load_run(workdir).step == steps[-1]
  finally:
    subprocess.run(["umount", "-l", mnt], capture_output=True)


# ---- a damaged latest checkpoint --------------------------------------------------------------------------------
def test_evaluate_on_a_damaged_checkpoint_prints_one_line(tmp_path):
  """Row 11: `evaluate` on a run whose latest checkpoint is damaged printed the error line plus dozens of 'Event
  loop is closed' tracebacks (a race: tensorstore reads still in flight call back into the closed loop of the
  failed restore); several tries, since the race does not show every time."""
  workdir = str(tmp_path / "run")
  trainer_lib.train(_config(**{"train.steps": 20, "train.keep_checkpoints": 2}), workdir, progress=False)
  with open(os.path.join(workdir, "checkpoints", "20", "params", "manifest.ocdbt"), "w") as f:
    f.write("damaged\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
  for _ in range(3):
    res = subprocess.run([sys.executable, "-m", "hackable_diffusion.evaluate", f"--workdir={workdir}"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
    assert "checkpoints/20: cannot restore this checkpoint" in lines[0]
