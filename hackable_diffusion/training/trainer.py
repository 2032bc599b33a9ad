"""`Trainer`: thin orchestration of data, model, optimizer, loop, checkpoints, logging and evaluation.

The math lives elsewhere: the loss in `diffusion/loss.py`, the pure `(state, batch, key) -> (state, metrics)`
step in `training/step.py`, the optimizer in `training/optimizer.py`; building the run's pieces from its config
and the workdir layout in `runs/run.py`. This module trains, and nothing else.

Setup is one path: the model as shapes (`run.build_abstract_model`) -> the train state's shardings (none without
a mesh) -> the state materialised by restoring the latest checkpoint of the workdir, or by loading the base
checkpoint, or by a fresh init (directly in its shards on a mesh).

Exact resume: step `s` uses `jax.random.fold_in(key(seed), s)` and the batch the grain iterator yields after
the state stored with the checkpoint, so N straight steps and N/2 + resume + N/2 give the same parameters.

Sharded runs (the `mesh` section, see docs/scaling.md): the trainer joins the multi-host job first (when one
is configured), builds the mesh, creates or restores the train state directly in its shards, places each batch
with `sharding.shard_batch` (every process reads its own block of the global `train.batch_size`), and runs the
step of `training.step.make_train_step(..., mesh=mesh)`. Checkpoints hold the sharded state and restore onto
whatever mesh the resuming run has. Evaluation during training samples on the same mesh with the parameters in
their training shardings (nothing is gathered onto one device), every `eval.batch_size` batch split over the
mesh's batch axes, with the tokens of one device. Only process 0 writes the config, tokenizer, metrics,
TensorBoard events and reports.

Non-finite loss: the step leaves the state unchanged when the loss or gradient is not finite and reports
`finite=False`; that flag is fed back into the next step on the device, which then leaves the state unchanged too
(`make_train_step(halt_after_non_finite=True)`), so the host reads it only before logging, saving or evaluating
and at the end - no device->host sync per step. Then the trainer saves the last good state (the state after the
first non-finite step's predecessors) as the checkpoint of that step, and stops with a one-line `TrainingError`;
a non-finite update is never applied, so never written.

Signals: SIGINT or SIGTERM during setup stops with one line and nothing saved; during training the loop stops at
the next step boundary, logs the steps since the last metrics line, saves the state with the data iterator's state
after the same number of batches (a resume continues bit for bit) and stops with one line; a second signal exits at
once. The workdir lock is released either way (`_Interrupts`).

I/O failures: a metrics or TensorBoard write that fails (ENOSPC, EIO) raises a one-line `TrainingError` at once
(every write happens in the training thread); a checkpoint save that fails raises a one-line `CheckpointError` -
an asynchronous save's failure is picked up by `Checkpointer.check()` at the next step. Either way the loop stops,
the last complete checkpoint is kept (older ones are deleted only after a newer save completed), and cleanup
errors after the first one are logged, not raised, so the user sees that one line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion import sharding
from hackable_diffusion.data.sft import make_sft_dataset
from hackable_diffusion.errors import TrainingError
from hackable_diffusion.evaluation import loop as eval_loop
from hackable_diffusion.evaluation import report as eval_report
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs import workdir as workdir_lib
from hackable_diffusion.runs.checkpoints import CHECKPOINT_DIR, Checkpointer
from hackable_diffusion.runs.config import ExperimentConfig
from hackable_diffusion.sharding.mesh import is_main_process
from hackable_diffusion.training.images import check_image_run, image_data_config
from hackable_diffusion.training.logging import MetricWriter, Progress
from hackable_diffusion.training.optimizer import make_optimizer, master_dtype
from hackable_diffusion.training.step import (TrainState, abstract_train_state, init_train_state,
                                              init_train_state_sharded, make_train_step, master_params,
                                              state_to_model,
                                              train_state_shardings)

_LOGGED = ("loss", "diffusion_loss", "ar_loss", "accuracy", "accuracy_corrupted", "grad_norm")


# ---- compiled steps, shared by trainers of the same model/optimizer/loss ----------------------------------------
_STEP_CACHE: dict[Any, tuple[Any, Callable, Callable, Any]] = {}
_STEP_CACHE_SIZE = 4


def _optimizer_and_step(graphdef: nnx.GraphDef, cfg: ExperimentConfig, mesh: Mesh | None, params: nnx.State,
                        rest: nnx.State, param_dtypes: tuple[Any, ...] | None = None
                        ) -> tuple[Any, Callable, Callable, Any]:
  """(tx, lr schedule, jitted train step, state shardings or None), memoised (a bounded cache) so that a second
  trainer in the same process (a resumed run, a notebook re-run) reuses the compiled step. `params`: the trainable
  variables as the state holds them; `param_dtypes`: the model's dtypes of a master copy (see `training.step`)."""
  key = (graphdef, cfg.optimizer, cfg.diffusion, cfg.train.grad_accum_steps, mesh, param_dtypes, cfg.frozen_modules)
  if key not in _STEP_CACHE:
    tx, schedule = make_optimizer(cfg.optimizer)
    shardings = None if mesh is None else train_state_shardings(mesh, params, rest, tx)
    step = make_train_step(graphdef, tx, cfg.diffusion, grad_accum_steps=cfg.train.grad_accum_steps,
                           lr_schedule=schedule, mesh=mesh, shardings=shardings, halt_after_non_finite=True,
                           param_dtypes=param_dtypes, frozen=cfg.frozen_modules)
    while len(_STEP_CACHE) >= _STEP_CACHE_SIZE:
      _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
    _STEP_CACHE[key] = (tx, schedule, step, shardings)
  return _STEP_CACHE[key]


# ---- signals -----------------------------------------------------------------------------------------------------
class _Interrupts:
  """SIGINT and SIGTERM while a trainer works (installed in the main thread only, the previous handlers restored on
  `restore()`).

  `defer=True` (the training loop): the first signal only sets `signum`; the loop stops at the next step boundary,
  where the parameters and the data iterator's state match, so the checkpoint saved there resumes bit for bit. A
  second signal exits at once (`os._exit(128 + signum)`) after releasing the workdir lock: a checkpoint being
  written then is orbax's temporary directory, never a complete-looking step. `defer=False` (setup, before the
  first step: nothing to save yet): the first signal raises `KeyboardInterrupt` there.
  """

  def __init__(self, *, defer: bool, on_exit: Callable[[], Any] | None = None):
    self.signum: int | None = None
    self._defer = defer
    self._on_exit = on_exit
    self._previous: dict[int, Any] = {}

  def install(self) -> _Interrupts:
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  @property
  def requested(self) -> bool:
    return self.signum is not None

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum is not None else "interrupt"

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if self.signum is None:
      self.signum = signum
      if not self._defer:
        raise KeyboardInterrupt
      return  # the loop stops at the next step boundary and says so in its one line
    try:
      sys.stderr.write(f"error: {signal.Signals(signum).name} again: exited at once; the last complete checkpoint "
                       "is kept - rerun the same command to resume\n")
      sys.stderr.flush()
      if self._on_exit is not None:
        self._on_exit()
    finally:
      os._exit(128 + signum)


# ---- the trainer ------------------------------------------------------------------------------------------------
class Trainer:
  """Supervised fine-tuning of a DiffusionGemma on prompt/completion data, resumable from its workdir: the engine
  of the CLI and of `hd.SFTTrainer` (the public Python API, `training.sft_api`).

  `Trainer(config, workdir).train()` builds the tokenizer, data, model and optimizer, restores the latest
  checkpoint of `workdir/checkpoints` if there is one, trains to `train.steps`, evaluates every
  `train.eval_every` steps and at the end, and returns the last logged metrics.

  Args:
    config: an `ExperimentConfig` or a ConfigDict/dict with the sections of `runs/config.py`.
    workdir: the run directory (created; checked, locked and compared with its stored config.json before anything
      is written, see `runs/workdir.py`; `close()` releases the lock).
    progress: show the tqdm bar (default: on process 0).

  Attributes a caller may set before `train()`: `on_event(name, step, values)` is called with
  ('log', step, the logged training metrics), ('step_end', step, {}) after every optimizer step and
  ('evaluate', step, the evaluation metrics `eval/<run>/<metric>`) after each evaluation during training
  (`hd.SFTTrainer` turns these into TRL/transformers callback calls); a true return of 'step_end' stops training
  after that step (its checkpoint saved, no final evaluation). `tensorboard=False` writes metrics.jsonl only.
  """

  def __init__(self, config: run_lib.AnyConfig, workdir: str, *, progress: bool | None = None):
    self.config = cfg = run_lib.as_experiment_config(config)
    self.mesh = run_lib.make_run_mesh(cfg)  # first: a multi-host job must be joined before any other JAX call
    run_lib.check_eval_tasks(cfg)
    shard_index, shard_count, host_batch = run_lib.data_shard(cfg, self.mesh)
    self.workdir = workdir = os.path.abspath(workdir)
    self._progress_enabled = progress
    self.on_event: Callable[[str, int, Mapping[str, Any]], Any] | None = None
    self.tensorboard = True
    # before anything is written: data paths, workdir writable, the workdir lock (process 0), resume
    # compatibility with the stored config.json; then config.json (versioned). See runs/workdir.py.
    # SIGINT/SIGTERM during setup: nothing to save yet - stop with one line, the lock released
    self._lock = None
    interrupts = _Interrupts(defer=False, on_exit=self._release_lock).install()
    try:
      self._lock = workdir_lib.open_workdir(cfg, workdir)
      self._setup(cfg, workdir, shard_index, shard_count, host_batch)
    except BaseException as e:
      if self._lock is not None:
        self._lock.release()
      if isinstance(e, KeyboardInterrupt):
        raise TrainingError(f"{interrupts.name} before the first step; nothing was saved - rerun the same command "
                            "to start") from None
      raise
    finally:
      interrupts.restore()

  def _setup(self, cfg: ExperimentConfig, workdir: str, shard_index: int, shard_count: int, host_batch: int) -> None:
    """The rest of `__init__` (run with the workdir locked): tokenizer, data, model, optimizer, train state."""
    error = None
    try:  # each process on its own (files, tokenizer, data): no collective yet
      self.paths = run_lib.data_paths(cfg, workdir, progress=self._progress_enabled)
      self.tokenizer = run_lib.build_tokenizer(cfg, workdir, self.paths["train"])
      self.model_config = run_lib.build_model_config(cfg, self.tokenizer)
      data_cfg = run_lib.sft_data_config(cfg, self.model_config, self.paths["train"], batch_size=host_batch,
                                         shuffle=cfg.data.shuffle, seed=cfg.train.seed)
      data_cfg = image_data_config(cfg, data_cfg, self.model_config)
      self.train_data = make_sft_dataset(data_cfg, self.tokenizer, shard_index=shard_index, shard_count=shard_count)
      check_image_run(cfg, self.train_data, self.model_config)
      self._eval_data: eval_loop.EvalData | None = None
      if cfg.train.eval_at_end or cfg.train.eval_every:
        self.eval_data()  # a bad evaluation file or record fails now, not after training
    except Exception as e:  # noqa: BLE001 - told to the other processes, then raised
      error = e
    sharding.stop_together(error)  # multi-process: a failure above on any host stops every host here
    self._tokens_scale = shard_count if self.mesh is not None else 1  # tokens/s of the global batch
    self.checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=cfg.train.keep_checkpoints,
                                     async_save=cfg.train.async_checkpointing)
    # LoRA on a pretrained base checkpoints only the adapters (the base is re-read from its own checkpoint)
    self._save_rest = not (cfg.model.checkpoint and cfg.lora is not None)
    self.seed = cfg.train.seed
    self._data_state: dict[str, Any] | None = None
    # one setup path: shapes -> shardings (None without a mesh) -> restore, load or init
    abstract, trainable = run_lib.build_abstract_model(cfg, self.model_config)
    self.graphdef, model_params, rest = nnx.split(abstract, trainable, ...)
    # optimizer.master_weights: the state holds a float32 master of trainable variables stored in less (bfloat16)
    self._master = master_dtype(cfg.optimizer, lora=cfg.lora is not None)
    params = model_params if self._master is None else master_params(model_params, self._master)
    dtypes = tuple(x.dtype for x in jax.tree.leaves(model_params))
    self._param_dtypes = dtypes if dtypes != tuple(x.dtype for x in jax.tree.leaves(params)) else None
    self.tx, self.lr_schedule, self.train_step, self._shardings = _optimizer_and_step(
        self.graphdef, cfg, self.mesh, params, rest, self._param_dtypes)
    if is_main_process():
      workdir_lib.warn_if_low_disk(workdir, workdir_lib.state_bytes(abstract_train_state(params, rest, self.tx)))
    latest = self.checkpointer.latest_step_of_every_process()
    if latest is not None:
      self.state = self._restore(latest, trainable, params, rest)
    else:
      self.state = self._materialise(trainable)
    if self.mesh is None:
      # Committed arrays: a fresh and a restored state then hit the same compiled step (jit keys on it).
      self.state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), self.state)

  # ---- state ------------------------------------------------------------------------------------------------
  def _materialise(self, trainable: Any) -> TrainState:
    """A fresh train state: the base loaded or initialised, adapters added, optimizer state created; on a mesh
    directly in its shards (a fresh init never exists whole on one device)."""
    cfg, mesh = self.config, self.mesh
    if mesh is not None and not cfg.model.checkpoint:
      model_fn = run_lib.model_factory(cfg, self.model_config)
      return init_train_state_sharded(model_fn, self.tx, mesh, trainable=trainable, master_dtype=self._master)[1]
    model = run_lib.apply_lora(cfg, run_lib.build_model(cfg, self.model_config, mesh=mesh))[0]
    state = init_train_state(model, self.tx, trainable=trainable, master_dtype=self._master)[1]
    return state if mesh is None else sharding.shard_state(state, self._shardings)

  def _restore(self, step: int, trainable: Any, params: nnx.State, rest: nnx.State) -> TrainState:
    """The state of checkpoint `step`, restored straight into this run's shardings (whatever mesh wrote it)."""
    cfg, mesh = self.config, self.mesh
    has_rest = self.checkpointer.restore_meta(step).get("has_rest", True)
    target = abstract_train_state(params, rest if has_rest else None, self.tx)
    if mesh is not None:
      target = sharding.abstract_with_shardings(
          target, self._shardings if has_rest else self._shardings.replace(rest=None))
    if not has_rest:  # the frozen base weights come from the base checkpoint, not ours
      model = run_lib.apply_lora(cfg, run_lib.build_model(cfg, self.model_config, mesh=mesh))[0]
      rest = nnx.split(model, trainable, ...)[2]
      if mesh is not None:
        rest = sharding.shard_state(rest, self._shardings.rest)
    state, meta = self.checkpointer.restore(target, step)
    self.seed = int(meta.get("seed", cfg.train.seed))
    if self.seed != cfg.train.seed:
      logging.warning("resuming with the checkpoint's seed %d (the config says train.seed=%d)", self.seed,
                      cfg.train.seed)
    self._data_state = meta.get("data_state")
    logging.info("restored %s/%d", self.checkpointer.directory, step)
    return state if has_rest else state.replace(rest=rest)

  @property
  def step(self) -> int:
    return int(self.state.step)

  def model(self) -> nnx.Module:
    """The current model (shares arrays with the train state, sharded like it: use it before the next step; with
    master weights, their cast to the model's dtypes)."""
    return state_to_model(self.graphdef, self.state, self._param_dtypes)

  def _eval_model(self) -> nnx.Module:
    """The model for evaluation: `model()`, i.e. the train state's arrays (with master weights their cast, sharded
    alike) - on a mesh in their training shardings, never gathered onto one device; `evaluate` samples with them on
    `self.mesh`."""
    return self.model()

  def save(self, step: int, data_state: Mapping[str, Any] | None, *, wait: bool = False) -> None:
    meta = {"seed": self.seed, "data_state": dict(data_state) if data_state is not None else None,
            "has_rest": self._save_rest}
    state = self.state if self._save_rest else self.state.replace(rest=None)
    self.checkpointer.save(step, state, meta, wait=wait)

  # ---- evaluation ---------------------------------------------------------------------------------------------
  def eval_data(self) -> eval_loop.EvalData:
    if self._eval_data is None:
      self._eval_data = run_lib.load_eval_data(self.config, self.model_config, self.tokenizer, self.paths)
    return self._eval_data

  def evaluate(self, *, log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Evaluates the current state; writes workdir/eval/report_step_{N}.json and the plot (process 0).

    On a mesh every process samples with the parameters in their training shardings on the run's mesh, batches
    of `eval.batch_size` examples split over its batch axes (see `evaluation.loop`)."""
    out_dir = os.path.join(self.workdir, run_lib.EVAL_DIR) if is_main_process() else None
    return run_lib.evaluate_model(self.config, self._eval_model(), self.tokenizer, self.eval_data(), step=self.step,
                                  out_dir=out_dir, log=log, mesh=self.mesh)

  # ---- the loop -----------------------------------------------------------------------------------------------
  def train(self) -> dict[str, float]:
    """Trains to `train.steps`; returns the last logged metrics.

    Raises a one-line TrainingError on a non-finite loss or a failed metrics write, and a CheckpointError when a
    checkpoint cannot be written (an asynchronous save's failure is picked up at the next step); either way the
    last complete checkpoint is kept and a rerun resumes from it.
    """
    cfg = self.config.train
    total = cfg.steps
    step = self.step
    base_key = jax.random.key(self.seed)
    # SIGINT/SIGTERM from here on: stop at the next step boundary with a consistent checkpoint (see `_Interrupts`)
    interrupts = _Interrupts(defer=True, on_exit=self._release_lock).install()
    try:
      iterator = self.train_data.iterator(self._data_state)
      writer = MetricWriter(self.workdir, resume_step=step, tensorboard=self.tensorboard)
    except BaseException:
      interrupts.restore()
      raise
    bar = Progress(total, step, enabled=self._progress_enabled)
    pending: list[dict[str, jax.Array]] = []  # the metrics of the steps since the last log step
    pending_data: list[Mapping[str, Any]] = []  # the data-iterator state before each of those steps
    # `metrics['finite']` of the last step, fed back into the next one on the device: after a non-finite step the
    # state stays the last good one (see `make_train_step(halt_after_non_finite=True)`), so it is read on the host
    # only before logging, saving, evaluating and at the end, not after every step
    # (committed like the step's outputs, so the first step and the later ones share one compiled program)
    healthy = jax.device_put(True, jax.local_devices()[0] if self.mesh is None else sharding.replicated(self.mesh))
    last: dict[str, float] = {}
    tokens = 0.0
    t_log = time.perf_counter()
    if step > 0:
      bar.write(f"resuming from step {step} ({self.checkpointer.directory})")
    stopped = True  # by an exception, until the loop ends normally
    try:
      while step < total and not interrupts.requested:
        self.checkpointer.check()  # a background save that failed stops the run now, not at the next save
        data_state = iterator.get_state()
        batch = next(iterator)
        tokens += float(np.sum(batch.prompt_mask) + np.sum(batch.completion_mask)) * self._tokens_scale
        if self.mesh is not None:
          batch = sharding.shard_batch(batch, self.mesh)
        self.state, metrics = self.train_step(self.state, batch, jax.random.fold_in(base_key, step), healthy)
        healthy = metrics["finite"]
        step += 1
        pending.append(metrics)
        pending_data.append(data_state)
        bar.update(1)
        log_now = step % cfg.log_every == 0 or step == total
        save_now = step % cfg.checkpoint_every == 0 or step == total
        eval_now = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step != total
        if (log_now or save_now or eval_now) and not bool(jax.device_get(healthy)):
          self._stop_non_finite(step - len(pending), pending, pending_data, writer)
        if log_now:
          elapsed = time.perf_counter() - t_log
          last = self._log(step, pending, writer, tokens / max(elapsed, 1e-9), len(pending) / max(elapsed, 1e-9))
          bar.update(0, tokens=tokens)
          bar.set_metrics(last["loss"], lr=last.get("lr", 0.0))
          pending, pending_data, tokens, t_log = [], [], 0.0, time.perf_counter()
        if save_now:
          self.save(step, iterator.get_state())
        if eval_now:
          self._evaluate_and_log(step, writer, bar)
          t_log = time.perf_counter()
        if self._event("step_end", step, {}) and step < total:  # a callback asked to stop: keep this step
          if not save_now:
            if pending and not bool(jax.device_get(healthy)):
              self._stop_non_finite(step - len(pending), pending, pending_data, writer)
            self.save(step, iterator.get_state())
          break
      if not interrupts.requested:
        self.checkpointer.wait()
      if cfg.eval_at_end and step == total and not interrupts.requested:
        report_path = os.path.join(self.workdir, run_lib.EVAL_DIR, eval_report.REPORT_PATTERN.format(step=step))
        if not os.path.exists(report_path):
          self._evaluate_and_log(step, writer, bar)
      if interrupts.requested:
        self._stop_interrupted(step, pending, pending_data, healthy, iterator, writer, tokens, t_log,
                               interrupts.name)
      stopped = False
    except KeyboardInterrupt:  # raised by a caller's code (the signals themselves are handled by `interrupts`)
      raise TrainingError(f"interrupted at step {step}; the last complete checkpoint is kept - rerun the same "
                          "command to resume") from None
    finally:
      self._data_state = iterator.get_state()  # a later train() call continues from here
      try:
        self._finish(bar, writer, quiet=stopped)
      finally:
        interrupts.restore()
    return last

  def _stop_interrupted(self, step: int, pending: list[dict[str, jax.Array]],
                        pending_data: list[Mapping[str, Any]], healthy: jax.Array, iterator: Any,
                        writer: MetricWriter, tokens: float, t_log: float, name: str) -> None:
    """Stops at a step boundary after a signal: the steps since the last log line get their line, the state after
    `step` steps is saved with the data iterator's state after `step` batches (unless that step is saved already or
    no step ran), then a one-line `TrainingError`."""
    if pending and not bool(jax.device_get(healthy)):  # frozen since a non-finite step: save that state
      self._stop_non_finite(step - len(pending), pending, pending_data, writer)
    if pending:  # every counted step has its metrics line
      elapsed = max(time.perf_counter() - t_log, 1e-9)
      self._log(step, pending, writer, tokens / elapsed, len(pending) / elapsed)
    self.checkpointer.wait()
    saved = step > 0 and step not in self.checkpointer.all_steps()
    if saved:
      self.save(step, iterator.get_state(), wait=True)
    what = "saved a checkpoint" if saved else ("the checkpoint of this step is kept" if step > 0 else
                                               "nothing was saved")
    raise TrainingError(f"{name} at step {step}; {what} - rerun the same command to resume")

  def _release_lock(self) -> None:
    if self._lock is not None:
      self._lock.release()

  def _finish(self, bar: Progress, writer: MetricWriter, *, quiet: bool) -> None:
    """Closes the bar and the metric files and waits for the last checkpoint to be written. `quiet` (training is
    already stopping with an error): a failure here is only logged, so that error is the one line the user sees."""
    bar.close()
    for finish in (writer.close, self.checkpointer.wait):
      try:
        finish()
      except Exception as e:  # noqa: BLE001
        if not quiet:
          raise
        logging.info("while stopping after an error: %s", e)

  def _log(self, step: int, pending: list[dict[str, jax.Array]], writer: MetricWriter, tokens_per_s: float,
           steps_per_s: float) -> dict[str, float]:
    host = jax.device_get(pending)
    out = {k: float(np.mean([m[k] for m in host])) for k in _LOGGED if k in host[0]}
    if "lr" in host[-1]:
      out["lr"] = float(host[-1]["lr"])
    out["tokens_per_s"] = tokens_per_s
    out["steps_per_s"] = steps_per_s
    writer.write(step, out, prefix="train/")
    self._event("log", step, out)
    return out

  def _event(self, name: str, step: int, values: Mapping[str, Any]) -> bool:
    """Tells `on_event` (when set) that `name` happened at `step`; True: it asks training to stop."""
    return self.on_event is not None and bool(self.on_event(name, step, values))

  def _evaluate_and_log(self, step: int, writer: MetricWriter, bar: Progress) -> None:
    try:
      report = self.evaluate(log=bar.write if is_main_process() else None)
    except OSError as e:  # the report or plot could not be written (ENOSPC, EIO, ...)
      where = f": {e.filename}" if e.filename else ""
      raise TrainingError(f"cannot write the evaluation report at step {step} ({e.strerror or e}{where}); stopped - "
                          f"the last complete checkpoint is kept, free disk space and rerun to resume") from None
    logged: dict[str, Any] = {}
    for run in report["runs"]:
      values = {f"{run['name']}/{k}": v for k, v in run["metrics"].items() if isinstance(v, float)}
      values[f"{run['name']}/mean_denoising_steps"] = run["mean_denoising_steps"]
      writer.write(step, values, prefix="eval/")
      logged.update({f"eval/{k}": v for k, v in values.items()})
    self._event("evaluate", step, logged)

  def _stop_non_finite(self, first: int, pending: list[Mapping[str, jax.Array]],
                       pending_data: list[Mapping[str, Any]], writer: MetricWriter) -> None:
    """Saves the last good state and stops: `pending[i]` are the metrics of step `first + i`, one of them (the
    first with `finite=False`) the first non-finite step; the state has been frozen since then."""
    host = jax.device_get(pending)
    bad = next(i for i, m in enumerate(host) if not bool(m["finite"]))
    step, data_state = first + bad, pending_data[bad]
    loss = float(host[bad]["loss"])
    grad_norm = float(host[bad]["grad_norm"])
    writer.write(step, {"loss": loss, "grad_norm": grad_norm}, prefix="train/")
    # The steps from `step` on left the state unchanged: it is the state after `step` good updates.
    saved = step not in self.checkpointer.all_steps()
    self.save(step, data_state, wait=True)
    where = f"{self.checkpointer.directory}/{step}"
    raise TrainingError(
        f"non-finite loss at step {step} (loss={loss}, grad_norm={grad_norm}); stopped and "
        f"{'saved' if saved else 'kept'} the last good state as {where} - lower optimizer.peak_lr or check the data")

  def close(self) -> None:
    try:
      self.checkpointer.close()
    finally:
      if self._lock is not None:
        self._lock.release()  # the workdir lock (runs/workdir.py)

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def train(config: run_lib.AnyConfig, workdir: str, *,
          progress: bool | None = None) -> dict[str, float]:
  """Builds a `Trainer` and trains; returns the last logged metrics."""
  with Trainer(config, workdir, progress=progress) as trainer:
    return trainer.train()


__all__ = ["Trainer", "train"]
