"""Orbax checkpoints of a run: `workdir/checkpoints/<step>/{params,rest,opt,meta}`.

Items of one step (a train state: `training.step.TrainState`, or any dataclass with its four fields):
- `params`: the trainable variables (`state.params`, an `nnx.State`),
- `rest`: every other variable (frozen weights, buffers),
- `opt`: `{'step': state.step, 'opt_state': ...}`,
- `meta`: JSON: `{'step', 'seed', 'data_state' (the grain iterator state), ...}`.

Keeping them apart lets evaluation and sampling restore only `params` + `rest`. Saving is asynchronous where
orbax allows (device->host copy happens in `save`, the write in a background thread); a step directory appears
under its final name only once complete, so a run killed mid-save leaves the previous checkpoints loadable
(orbax deletes the partial temporary directory in the background when the manager is next opened for writing).

Failed saves are errors, never hangs or silent losses. A save that fails (ENOSPC, EIO, ...) raises a one-line
`CheckpointError` naming the step, the reason and the last complete checkpoint - from `save` when the synchronous
part fails, else from the first `check()` (non-blocking, called by the trainer every step), `wait()`, `save()` or
`close()` after the background write failed. Older checkpoints are only deleted (`max_to_keep`) once a newer save
has completed, so the last complete checkpoint survives a failed save and stays restorable. Once the error has
been raised, `close()` waits for the failed save's abandoned writer threads (bounded; a rerun in the same process
must not race them) and releases orbax's resources without raising it again, and orbax's own tracebacks of that
failure (logged from its background threads) are dropped unless absl logs at INFO (`-v 0`): the one line says it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging as py_logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import jax
import orbax.checkpoint as ocp
from absl import logging

from hackable_diffusion import sharding
from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.runs.config_files import CONFIG_FILENAME

CHECKPOINT_DIR = "checkpoints"


class TrainStateLike(Protocol):
  """What a checkpoint holds (`training.step.TrainState`): a dataclass with these fields."""

  step: Any
  params: Any
  rest: Any
  opt_state: Any


State = TypeVar("State", bound=TrainStateLike)
_ITEMS = ("params", "rest", "opt", "meta")


def _os_cause(e: BaseException) -> OSError | None:
  """The first `OSError` with an errno in `e`'s chain (`__cause__` / `__context__`), `e` included."""
  seen: set[int] = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    e = e.__cause__ or e.__context__
  return None


_QUOTED_OS_ERRORS = tuple(os.strerror(n) for n in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO))


def one_line_error(e: BaseException) -> str:
  """`Type: message` on one line, at most ~300 characters of the message; the OS error that caused it (e.g.
  `[Errno 28] No space left on device`) is always named, even when a long message (paths) would cut it off."""
  text = " ".join(str(e).split())
  cause = _os_cause(e)
  if cause is not None:
    reason = f"[Errno {cause.errno}] {cause.strerror or os.strerror(cause.errno)}"
  else:  # an OS error quoted inside the message of a wrapper exception
    found = re.search(r"\[Errno \d+\] [^:'\"\]\)]+", text)
    # tensorstore quotes the OS error without its number ('Failed writing: "PATH": No space left on device')
    reason = found.group(0).strip() if found else next((r for r in _QUOTED_OS_ERRORS if r in text), "")
  if len(text) > 300:
    text = text[:300] + "..."
  if reason and reason.split("] ", 1)[-1] not in text:
    text = f"{text} ({reason})" if text else reason
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---- quiet failure paths ----------------------------------------------------------------------------------------
_ORBAX_DIR = os.path.dirname(ocp.__file__)
TRASH_DIR = "deleted"  # checkpoints/deleted/: old steps on their way out (never a step: not a number)
_QUIET_LOGGERS = ("absl", "asyncio")  # orbax logs through absl
# After a failed save, orbax abandons the save's other writes; its writer threads may still be writing into the
# step's temporary directory. close() waits this long for them, at most (they finish within milliseconds).
ABANDONED_WRITES_WAIT_S = 30.0
# A latest-step restore that loses its step to rotation reads the then-newest one, at most this many more times.
ROTATION_RETRIES = 2


class _OrbaxFailureFilter(py_logging.Filter):
  """Drops orbax's error logs (a traceback each, many per failure, most from its background threads) and asyncio's
  'Future exception was never retrieved' for the other reads/writes of the same failed save or restore, while its
  Checkpointer has an operation in flight or after one of them failed - the Checkpointer reports that failure as
  one line - unless absl logs at INFO or more (`-v 0`). One filter per Checkpointer (added at construction,
  removed by a clean `close()`; kept after a failure, whose late noise it still drops)."""

  def __init__(self, checkpointer: Checkpointer):
    super().__init__()
    self._checkpointer = checkpointer

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno < py_logging.ERROR or not (record.name == "asyncio" or record.pathname.startswith(_ORBAX_DIR)):
      return True
    return logging.get_verbosity() >= logging.INFO or not self._checkpointer.owns_failure_log(record)


_previous_unraisablehook = sys.unraisablehook


def _is_orbax_coroutine(obj: Any) -> bool:
  code = getattr(obj, "cr_code", None)  # a coroutine object's code
  return code is not None and code.co_filename.startswith(_ORBAX_DIR)


def _ignore_closed_loop_callbacks(unraisable: Any) -> None:
  """`sys.unraisablehook` for the late noise of a failed orbax restore (a damaged checkpoint, another model's
  shapes), which the Checkpointer has already reported as one line: tensorstore reads still in flight finish later
  and call back into the restore's asyncio loop, closed by then (`RuntimeError('Event loop is closed')`), and orbax's
  abandoned read coroutines, when collected, raise their read error instead of exiting (a traceback with the whole
  TensorStore spec, printed wherever the collection happens: a later cell of a notebook). Anything else is passed on."""
  e = unraisable.exc_value
  if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
    return
  if _is_orbax_coroutine(getattr(unraisable, "object", None)):
    return
  _previous_unraisablehook(unraisable)


def _install_unraisable_hook() -> None:
  global _previous_unraisablehook
  if sys.unraisablehook is not _ignore_closed_loop_callbacks:
    _previous_unraisablehook = sys.unraisablehook
    sys.unraisablehook = _ignore_closed_loop_callbacks


def abstract_like(tree: Any) -> Any:
  """Restore targets: arrays -> `ShapeDtypeStruct` with their sharding; shapes without a sharding get the
  first local device."""
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding or default)
    return x

  return jax.tree.map(one, tree)


def steps_on_disk(directory: str) -> list[int]:
  """The steps whose directory is in `directory` under its final name (a save in progress or failed is not)."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def step_to_restore(directory: str, step: int | None) -> int:
  """The checkpoint step a restore of `step` (None: the latest) reads, from the directory listing alone: no orbax
  (opening its manager is a collective of every process of a job), so each process can check its own file system
  before the processes agree. A one-line `CheckpointError` when the directory or the step is not there."""
  directory = os.path.abspath(directory)  # named as `Checkpointer` names it
  if not os.path.isdir(directory):
    raise CheckpointError(f"{directory}: no checkpoint directory (has this workdir been trained?)")
  return pick_step(directory, steps_on_disk(directory), step)


def rotated_out_message(directory: str, step: int, newest: list[int]) -> str:
  """The one line for checkpoint `step` that left `directory` while it was being read (rotation by the run writing
  it keeps only its latest checkpoints): the checkpoint is fine, it is just gone."""
  now = f"; the newest is now step {newest[-1]}" if newest else ""
  return (f"{directory}/{step}: rotated out while being read (the run writing this workdir keeps only its latest "
          f"checkpoints){now} - re-run to read the newest (or set train.keep_checkpoints higher to keep more)")


def pick_step(directory: str, steps: list[int], step: int | None) -> int:
  """`step` if it is one of `steps` (None: the latest), else a one-line `CheckpointError` naming `directory`."""
  if step is None:
    if not steps:
      raise CheckpointError(f"{directory}: no checkpoint found")
    return steps[-1]
  if step not in steps:
    raise CheckpointError(f"{directory}: no checkpoint at step {step}; available steps: {steps}")
  return step


class Checkpointer:
  """A thin wrapper over `orbax.checkpoint.CheckpointManager` for a train state + JSON metadata.

  Args:
    directory: the checkpoint directory (created unless `read_only`).
    max_to_keep: number of most recent steps kept (older ones are deleted after a save).
    async_save: write in a background thread (`wait()` blocks until done; `close()` waits too).
    read_only: open for restoring only (evaluation, sampling): nothing is created or deleted.
  """

  def __init__(self, directory: str, *, max_to_keep: int | None = 3, async_save: bool = True,
               read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    self._pending: int | None = None  # the step of an asynchronous save not yet known to be complete
    self._failed: str | None = None  # the one-line message of a failed save (close() is quiet after it)
    self._restoring = False
    self._restore_failed = False  # a restore failed: its reads still in flight log late (the filter stays for them)
    self._closed = False
    self._log_filter = _OrbaxFailureFilter(self)
    for name in _QUIET_LOGGERS:
      py_logging.getLogger(name).addFilter(self._log_filter)
    _install_unraisable_hook()
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"{self.directory}: no checkpoint directory (has this workdir been trained?)")
    # read_only: nothing is created, cleaned or deleted (orbax's own read_only option only adds log warnings)
    # Old steps (max_to_keep) are renamed into TRASH_DIR (one atomic rename) and purged from there: deleting them in
    # place would leave a half-deleted step under its final name if the process were killed mid-delete.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, enable_async_checkpointing=async_save,
        create=not read_only, cleanup_tmp_directories=not read_only, todelete_subdir=TRASH_DIR)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    except Exception as e:  # noqa: BLE001 - orbax raises many types; the user needs one line
      raise CheckpointError(f"{self.directory}: cannot open checkpoints ({one_line_error(e)})") from None
    self._purge_trash()

  def _purge_trash(self) -> None:
    """Deletes the steps orbax moved into TRASH_DIR (nothing in read-only mode; a failure is left for next time)."""
    if not self.read_only:
      shutil.rmtree(os.path.join(self.directory, TRASH_DIR), ignore_errors=True)

  # ---- queries ----------------------------------------------------------------------------------------------
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def latest_step_of_every_process(self) -> int | None:
    """`latest_step()`, checked to be the same on every process of a multi-process job (one all-gather): a
    workdir that is not on a file system every host shares shows each host other checkpoints, and restoring then
    fails inside orbax with a message that blames the checkpoint. Raises a one-line `CheckpointError` on every
    process instead."""
    return self.same_step_on_every_process(self.latest_step())

  def same_step_on_every_process(self, step: int | None) -> int | None:
    """`step` (this process's choice of checkpoint, None: none), checked to be every process's (one all-gather;
    see `latest_step_of_every_process`)."""
    seen = sharding.process_values(-1 if step is None else step)
    if len(set(seen)) > 1:
      each = ", ".join(f"process {i}: {'none' if s < 0 else f'step {s}'}" for i, s in enumerate(seen))
      raise CheckpointError(f"{self.directory}: the processes of this job see different checkpoints ({each}); a "
                            "multi-host run needs its workdir on a file system that every host shares")
    return step

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def _check_step(self, step: int | None) -> int:
    return pick_step(self.directory, self.all_steps(), step)

  # ---- save ---------------------------------------------------------------------------------------------------
  def save(self, step: int, state: TrainStateLike, meta: Mapping[str, Any], *, wait: bool = False) -> bool:
    """Saves `state` and JSON `meta` as checkpoint `step` (a no-op returning False if it exists).

    `state.rest=None` leaves the non-trainable variables out (LoRA on a pretrained model: they come from the
    base checkpoint and would only make every checkpoint as large as the model).
    """
    if self.read_only:
      raise CheckpointError(f"{self.directory}: opened read-only, cannot save")
    self.wait()  # the previous save must have completed (a failed one raises here, before a new one starts)
    if step in self._manager.all_steps():
      return False
    items = dict(
        params=ocp.args.StandardSave(state.params),
        opt=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
        meta=ocp.args.JsonSave({"step": int(step), **dict(meta)}),
    )
    if state.rest is not None:
      items["rest"] = ocp.args.StandardSave(state.rest)
    args = ocp.args.Composite(**items)
    if step in self.complete_steps():
      raise CheckpointError(f"{self.directory}/{step}: exists on disk but not in orbax's list of steps; move it away")
    self._set_pending(step)
    try:
      saved = self._manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - ENOSPC, EIO, ... in the synchronous part of the save
      raise self._save_failed(step, e) from None
    if wait:
      self.wait()
    return bool(saved)

  def check(self) -> None:
    """Raises the one-line `CheckpointError` of an asynchronous save that has failed; never blocks (a save still
    being written is left alone). Cheap enough to call every step."""
    if self._failed is not None:
      raise CheckpointError(self._failed)
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def complete_steps(self) -> list[int]:
    """The steps whose directory is on disk under its final name (a save still in progress or failed is not)."""
    return steps_on_disk(self.directory)

  def _save_failed(self, step: int | None, e: BaseException) -> CheckpointError:
    """Records a failed save of `step` and returns its one-line error (naming the last complete checkpoint)."""
    # the failed save's other writes, abandoned by orbax, are reported when collected: noise after the one line
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
    if step is not None and step == self._pending and step in self.complete_steps():
      # this save's directory was renamed into place, but the save did not finish: it is not a good checkpoint
      shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
    done = [s for s in self.complete_steps() if s != step]
    kept = f"the last complete checkpoint {self.directory}/{done[-1]} is kept" if done else "no checkpoint was kept"
    where = self.directory if step is None else f"{self.directory}/{step}"
    self._failed = (f"{where}: cannot write this checkpoint ({one_line_error(e)}); {kept} - free disk space (or fix "
                    f"the error) and rerun the same command to resume")
    self._set_pending(None)
    return CheckpointError(self._failed)

  def _set_pending(self, step: int | None) -> None:
    self._pending = step

  def owns_failure_log(self, record: py_logging.LogRecord) -> bool:
    """Whether an orbax/asyncio error log belongs to this checkpointer's operations: any while a save or restore
    runs, or after a save failed until `close()`; after `close()` of a failed save, orbax's own (its writer
    threads' late errors, up to interpreter shutdown); after a failed restore or save, asyncio's that name its
    directory (the late 'never retrieved' reads and writes), so that other code's errors still show."""
    if self._pending is not None or self._restoring or (self._failed is not None and not self._closed):
      return True
    if self._failed is None and not self._restore_failed:
      return False
    if self._failed is not None and record.pathname.startswith(_ORBAX_DIR):
      return True
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
      text += str(record.exc_info[1])
    return self.directory in text

  # ---- restore ------------------------------------------------------------------------------------------------
  def restore(self, target: State, step: int | None = None) -> tuple[State, dict[str, Any]]:
    """Restores the whole train state (`target`: arrays or ShapeDtypeStructs of the same structure, returned as
    the same dataclass with the restored values; `target.rest=None` skips the non-trainable variables)."""
    target = abstract_like(target)
    items = dict(
        params=ocp.args.StandardRestore(target.params),
        opt=ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state}),
        meta=ocp.args.JsonRestore(),
    )
    if target.rest is not None:
      items["rest"] = ocp.args.StandardRestore(target.rest)
    out = self._restore(step, ocp.args.Composite(**items))
    rest = out.rest if target.rest is not None else None
    state = dataclasses.replace(target, step=out.opt["step"], params=out.params, rest=rest,
                                opt_state=out.opt["opt_state"])
    return state, dict(out.meta)

  def restore_variables(self, params: Any, rest: Any, step: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Restores only the model variables (no optimizer state): `(params, rest, meta)`; `rest=None` skips them."""
    items = dict(params=ocp.args.StandardRestore(abstract_like(params)), meta=ocp.args.JsonRestore())
    if rest is not None:
      items["rest"] = ocp.args.StandardRestore(abstract_like(rest))
    out = self._restore(step, ocp.args.Composite(**items))
    return out.params, (out.rest if rest is not None else None), dict(out.meta)

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    return dict(self._restore(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

  def _restore(self, requested: int | None, args: ocp.args.Composite):
    """Restores step `requested` (None: the latest). A reader can race the run that writes this directory: a step
    rotated out (`max_to_keep`) while being read is not damaged. For `requested=None` in a single-process job the
    newest step is read instead (at most `ROTATION_RETRIES` times); otherwise a one-line 'rotated out, re-run'."""
    step = self._check_step(requested)
    for attempt in range(ROTATION_RETRIES + 1):
      self._restoring = True
      try:
        return self._manager.restore(step, args=args)
      except Exception as e:  # noqa: BLE001 - a damaged or mismatched checkpoint, or one rotated out; one line
        self._restore_failed = True
        if step in self.complete_steps():
          raise CheckpointError(
              f"{self.directory}/{step}: cannot restore this checkpoint ({one_line_error(e)}); it is damaged or was "
              f"written by a different model/config - delete it to fall back to an earlier step") from None
        newest = self.complete_steps()
        if requested is not None or jax.process_count() > 1 or not newest or attempt == ROTATION_RETRIES:
          raise CheckpointError(rotated_out_message(self.directory, step, newest)) from None
        self._manager.reload()  # orbax lists the steps it saw when opened: read the directory again
        step = newest[-1]
      finally:
        self._restoring = False
    raise AssertionError("unreachable")

  # ---- lifecycle ----------------------------------------------------------------------------------------------
  def wait(self) -> None:
    """Blocks until a pending asynchronous save has completed; raises its one-line error if it failed."""
    if self._failed is not None:
      raise CheckpointError(self._failed)
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - the background write failed
      raise self._save_failed(self._pending, e) from None
    if self._pending is not None:
      self._purge_trash()  # the steps this save made old
    self._set_pending(None)

  def close(self) -> None:
    """Waits for a pending save and releases orbax's threads and files. Raises a save failure only if it was not
    raised before; after one, closing never raises."""
    try:
      if self._failed is None:
        self.wait()
    finally:
      if self._failed is not None:
        self._join_abandoned_writes()
      self._close_manager()
      self._closed = True
      if self._failed is None and not self._restore_failed:  # after a failure the filter stays: orbax's and
        # asyncio's late noise of it (reads/writes still in flight, 'Future exception was never retrieved') is dropped
        for name in _QUIET_LOGGERS:
          py_logging.getLogger(name).removeFilter(self._log_filter)

  def _join_abandoned_writes(self) -> None:
    """Waits (at most `ABANDONED_WRITES_WAIT_S` in all) for orbax's writer threads still running after a failed
    save. Left running, one may write into the failed step's temporary directory after a rerun in this process
    has cleaned it, and that rerun's save of the same step fails ('Directory not empty')."""
    deadline = time.monotonic() + ABANDONED_WRITES_WAIT_S
    for thread in threading.enumerate():
      if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax."):
        try:
          thread.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - orbax's threads re-raise their write's error: the save's, already raised
          pass

  def _close_manager(self) -> None:
    # After a failed save, orbax re-raises stored background errors (once per error and thread) from inside
    # close() before it has released anything: retry until it gets through (bounded: there are few such errors).
    error: Exception | None = None
    for _ in range(4):
      try:
        self._manager.close()
        return
      except Exception as e:  # noqa: BLE001
        error = error or e
    if self._failed is None:
      raise CheckpointError(f"{self.directory}: cannot close the checkpoint manager ({one_line_error(error)})")

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def is_run_workdir(path: str) -> bool:
  """A directory written by `hackable_diffusion.train` (as opposed to a Hugging Face checkpoint)."""
  return os.path.isdir(os.path.join(path, CHECKPOINT_DIR)) and os.path.isfile(
      os.path.join(path, CONFIG_FILENAME)) and not os.path.isfile(os.path.join(path, "model.safetensors"))


__all__ = ["CHECKPOINT_DIR", "Checkpointer", "ROTATION_RETRIES", "TrainStateLike", "abstract_like", "is_run_workdir",
           "one_line_error", "pick_step", "rotated_out_message", "step_to_restore", "steps_on_disk"]
