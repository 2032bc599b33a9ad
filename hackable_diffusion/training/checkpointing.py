"""Orbax checkpoints of a training run: `workdir/checkpoints/<step>/{params,rest,opt,meta}`.

Items of one step:
- `params`: the trainable variables (`TrainState.params`, an `nnx.State`),
- `rest`: every other variable (frozen weights, buffers),
- `opt`: `{'step': TrainState.step, 'opt_state': ...}`,
- `meta`: JSON: `{'step', 'seed', 'data_state' (the grain iterator state), ...}`.

Keeping them apart lets evaluation and sampling restore only `params` + `rest`. Saving is asynchronous where
orbax allows (device->host copy happens in `save`, the write in a background thread); a step directory appears
under its final name only once complete, so a run killed mid-save leaves the previous checkpoints loadable
(orbax deletes the partial temporary directory in the background when the manager is next opened for writing).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.training.step import TrainState

CHECKPOINT_DIR = "checkpoints"
_ITEMS = ("params", "rest", "opt", "meta")


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  text = text if len(text) <= 300 else text[:300] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


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


class Checkpointer:
  """A thin wrapper over `orbax.checkpoint.CheckpointManager` for `TrainState` + JSON metadata.

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
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"{self.directory}: no checkpoint directory (has this workdir been trained?)")
    # read_only: nothing is created, cleaned or deleted (orbax's own read_only option only adds log warnings)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, enable_async_checkpointing=async_save,
        create=not read_only, cleanup_tmp_directories=not read_only)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)
    except Exception as e:  # noqa: BLE001 - orbax raises many types; the user needs one line
      raise CheckpointError(f"{self.directory}: cannot open checkpoints ({_one_line(e)})") from None

  # ---- queries ----------------------------------------------------------------------------------------------
  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def _check_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"{self.directory}: no checkpoint found")
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"{self.directory}: no checkpoint at step {step}; available steps: {steps}")
    return step

  # ---- save ---------------------------------------------------------------------------------------------------
  def save(self, step: int, state: TrainState, meta: Mapping[str, Any], *, wait: bool = False) -> bool:
    """Saves `state` and JSON `meta` as checkpoint `step` (a no-op returning False if it exists).

    `state.rest=None` leaves the non-trainable variables out (LoRA on a pretrained model: they come from the
    base checkpoint and would only make every checkpoint as large as the model).
    """
    if self.read_only:
      raise CheckpointError(f"{self.directory}: opened read-only, cannot save")
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
    saved = self._manager.save(step, args=args, force=True)
    if wait:
      self.wait()
    return bool(saved)

  # ---- restore ------------------------------------------------------------------------------------------------
  def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Restores the whole `TrainState` (`target`: arrays or ShapeDtypeStructs of the same structure;
    `target.rest=None` skips the non-trainable variables)."""
    step = self._check_step(step)
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
    state = TrainState(step=out.opt["step"], params=out.params, rest=rest, opt_state=out.opt["opt_state"])
    return state, dict(out.meta)

  def restore_variables(self, params: Any, rest: Any, step: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """Restores only the model variables (no optimizer state): `(params, rest, meta)`; `rest=None` skips them."""
    step = self._check_step(step)
    items = dict(params=ocp.args.StandardRestore(abstract_like(params)), meta=ocp.args.JsonRestore())
    if rest is not None:
      items["rest"] = ocp.args.StandardRestore(abstract_like(rest))
    out = self._restore(step, ocp.args.Composite(**items))
    return out.params, (out.rest if rest is not None else None), dict(out.meta)

  def restore_meta(self, step: int | None = None) -> dict[str, Any]:
    step = self._check_step(step)
    return dict(self._restore(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

  def _restore(self, step: int, args: ocp.args.Composite):
    try:
      return self._manager.restore(step, args=args)
    except Exception as e:  # noqa: BLE001 - a damaged or mismatched checkpoint; report one line
      raise CheckpointError(
          f"{self.directory}/{step}: cannot restore this checkpoint ({_one_line(e)}); it is damaged or was "
          f"written by a different model/config - delete it to fall back to an earlier step") from None

  # ---- lifecycle ----------------------------------------------------------------------------------------------
  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


__all__ = ["CHECKPOINT_DIR", "Checkpointer", "abstract_like"]
