"""Checkpointer: TrainState round trip, partial restores, retention, and one-line errors on bad checkpoints."""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.runs import checkpoints
from hackable_diffusion.runs.checkpoints import Checkpointer
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state


@pytest.fixture(scope="module")
def state():
  tx, _ = make_optimizer(OptimizerConfig())
  graphdef, st = init_train_state(init_model(get_preset("tiny"), seed=0), tx)
  # make the optimizer state non-trivial so that a mix-up between items would show
  st = st.replace(step=jnp.asarray(7, jnp.int32),
                  opt_state=jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                         st.opt_state))
  return graphdef, st


def _assert_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_and_meta(tmp_path, state):
  _, st = state
  with Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(7, st, {"seed": 3, "data_state": {"next_index": 12}})
    assert not ckpt.save(7, st, {"seed": 3})  # existing step: no-op
  with Checkpointer(str(tmp_path / "ckpt"), read_only=True) as ckpt:
    restored, meta = ckpt.restore(jax.eval_shape(lambda: st))
    assert meta == {"step": 7, "seed": 3, "data_state": {"next_index": 12}}
    _assert_equal(restored, st)
    assert jax.tree.structure(restored) == jax.tree.structure(st)
    params, rest, meta2 = ckpt.restore_variables(st.params, st.rest)
    _assert_equal(params, st.params)
    _assert_equal(rest, st.rest)
    assert meta2["step"] == 7


def test_retention_keeps_latest(tmp_path, state):
  _, st = state
  with Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2, async_save=True) as ckpt:
    for step in (1, 2, 3, 4):
      ckpt.save(step, st, {})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
    assert ckpt.latest_step() == 4
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["3", "4"]  # the old steps are gone, trash purged


def test_old_steps_leave_by_an_atomic_rename(tmp_path, state, monkeypatch):
  """Retention never leaves a half-deleted step under its final name (a kill during an in-place delete could: the
  step would keep opt/ and meta/ but lose params/, and no longer restore). Old steps are renamed into the trash dir in
  one step, and whatever a killed process left there is purged when the directory is next opened for writing."""
  _, st = state
  directory = tmp_path / "ckpt"
  purged = []
  monkeypatch.setattr(Checkpointer, "_purge_trash", lambda self: purged.append(1))  # as if killed before purging
  with Checkpointer(str(directory), max_to_keep=1, async_save=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, st, {}, wait=True)
  trash = directory / checkpoints.TRASH_DIR
  assert sorted(os.listdir(directory)) == ["2", checkpoints.TRASH_DIR] and os.listdir(trash) == ["1"]
  assert sorted(os.listdir(trash / "1")) == sorted(os.listdir(directory / "2"))  # moved whole, not deleted in place
  monkeypatch.undo()
  with Checkpointer(str(directory), max_to_keep=1) as ckpt:
    assert ckpt.all_steps() == [2]
  assert sorted(os.listdir(directory)) == ["2"]


def test_without_rest(tmp_path, state):
  _, st = state
  with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    ckpt.save(1, st.replace(rest=None), {"has_rest": False}, wait=True)
    restored, meta = ckpt.restore(st.replace(rest=None))
    assert restored.rest is None and meta["has_rest"] is False
    _assert_equal(restored.params, st.params)
  assert sorted(os.listdir(tmp_path / "ckpt" / "1")) and not (tmp_path / "ckpt" / "1" / "rest").exists()


def test_errors_are_one_line(tmp_path, state):
  _, st = state
  with pytest.raises(CheckpointError, match="no checkpoint directory"):
    Checkpointer(str(tmp_path / "missing"), read_only=True)
  directory = str(tmp_path / "ckpt")
  with Checkpointer(directory) as ckpt:
    with pytest.raises(CheckpointError, match="no checkpoint found"):
      ckpt.restore_meta()
    ckpt.save(5, st, {}, wait=True)
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 6; available steps: \[5\]"):
      ckpt.restore_meta(6)
  # a damaged checkpoint: the array data of `params` is gone
  shutil.rmtree(os.path.join(directory, "5", "params", "d"))
  with Checkpointer(directory, read_only=True) as ckpt:
    with pytest.raises(CheckpointError) as err:
      ckpt.restore(st)
  assert "\n" not in str(err.value) and "cannot restore" in str(err.value)
  # a checkpoint of another model shape
  directory2 = str(tmp_path / "ckpt2")
  with Checkpointer(directory2) as ckpt:
    ckpt.save(1, st, {}, wait=True)
  other = init_train_state(init_model(get_preset("tiny", hidden_size=16, head_dim=4, global_head_dim=8), 0),
                           make_optimizer(OptimizerConfig())[0])[1]
  with Checkpointer(directory2, read_only=True) as ckpt:
    with pytest.raises(CheckpointError, match="cannot restore"):
      ckpt.restore(other)


def _rotate_during_the_first_read(reader: Checkpointer, save) -> None:
  """Makes `reader`'s first restore race a writer: `save()` (a newer save that rotates old steps out) runs after
  the reader picked its step and before it reads the files."""
  original, calls = reader._manager.restore, []  # noqa: SLF001

  def racing(step, *args, **kwargs):
    if not calls:
      save()
    calls.append(step)
    return original(step, *args, **kwargs)

  reader._manager.restore = racing  # noqa: SLF001


def test_a_checkpoint_rotated_out_while_being_read_is_not_damaged(tmp_path, state):
  """A reader (sample, evaluate) racing the run's rotation: an explicit step that left while being read is 'rotated
  out, re-run', never 'damaged - delete it'; a latest-step read retries the newest step and succeeds."""
  _, st = state
  directory = str(tmp_path / "ckpt")
  with Checkpointer(directory, max_to_keep=2, async_save=False) as writer:
    writer.save(1, st, {}, wait=True)
    writer.save(2, st, {}, wait=True)
  with Checkpointer(directory, read_only=True) as reader, Checkpointer(directory, max_to_keep=2) as writer:
    _rotate_during_the_first_read(reader, lambda: writer.save(3, st, {}, wait=True))  # step 1 leaves
    with pytest.raises(CheckpointError) as err:
      reader.restore_meta(1)
  message = str(err.value)
  assert "\n" not in message and "rotated out while being read" in message and "re-run" in message
  assert "damaged" not in message and "newest is now step 3" in message
  with Checkpointer(directory, read_only=True) as reader, Checkpointer(directory, max_to_keep=1) as writer:
    _rotate_during_the_first_read(reader, lambda: writer.save(4, st, {}, wait=True))  # steps 2 and 3 leave
    restored, meta = reader.restore(jax.eval_shape(lambda: st))
  assert meta["step"] == 4
  _assert_equal(restored.params, st.params)


def test_late_asyncio_noise_of_a_failed_restore_is_dropped(tmp_path, state):
  """A failed restore leaves tensorstore reads in flight; when their futures are collected later, asyncio logs
  'Future exception was never retrieved' with a traceback (seen on CI after the one-line error). The checkpointer's
  filter must keep dropping those after the restore failed and after close(); other errors (before the failure, or
  not naming the checkpoint) still show."""
  _, st = state
  directory = str(tmp_path / "ckpt")
  with Checkpointer(directory) as ckpt:
    ckpt.save(5, st, {}, wait=True)
  records: list[logging.LogRecord] = []

  tag = "[test-late-noise]"  # other tests' late asyncio noise (their own failed restores) may be logged meanwhile

  class Collect(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith(tag):
        records.append(record)

  handler = Collect(level=logging.ERROR)
  logger = logging.getLogger("asyncio")
  logger.addHandler(handler)
  try:
    with Checkpointer(directory, read_only=True) as ckpt:
      logger.error(tag + "Future exception was never retrieved (before any failure)")
      assert len(records) == 1  # nothing has failed: the log is someone else's and passes
      with open(os.path.join(directory, "5", "params", "manifest.ocdbt"), "w") as f:
        f.write("damaged\n")
      with pytest.raises(CheckpointError, match="cannot restore"):
        ckpt.restore(st)
      late = ValueError(f'DATA_LOSS: Error reading "d/x" in OCDBT database at local file "{ckpt.directory}/5/params/"')
      logger.error(tag + "Future exception was never retrieved (during)", exc_info=(ValueError, late, None))
    logger.error(tag + "Future exception was never retrieved (after close)", exc_info=(ValueError, late, None))
    logger.error(tag + "an unrelated error after the failure")  # not the checkpoint's: it still shows
    assert [r.getMessage().removeprefix(tag) for r in records] == [
        "Future exception was never retrieved (before any failure)", "an unrelated error after the failure"]
  finally:
    logger.removeHandler(handler)


def test_partial_save_left_by_a_crash_is_ignored(tmp_path, state):
  """A step directory under orbax's temporary name (a save killed before it finished) is not a checkpoint (orbax
  also deletes it in the background when the directory is next opened for writing)."""
  _, st = state
  directory = tmp_path / "ckpt"
  with Checkpointer(str(directory)) as ckpt:
    ckpt.save(1, st, {}, wait=True)
  partial = directory / "2.orbax-checkpoint-tmp-1234"
  partial.mkdir()
  (partial / "junk").write_text("x")
  with Checkpointer(str(directory), read_only=True) as ckpt:
    assert ckpt.all_steps() == [1]
  with Checkpointer(str(directory)) as ckpt:
    assert ckpt.latest_step() == 1
    ckpt.save(2, st, {}, wait=True)  # the step of the killed save can be written again
    assert ckpt.all_steps() == [1, 2]
