"""`SFTTrainer`: thin orchestration of data, model, optimizer, loop, checkpoints, logging and evaluation.

The math lives elsewhere: the loss in `diffusion/loss.py`, the pure `(state, batch, key) -> (state, metrics)`
step in `training/step.py`, the optimizer in `training/optimizer.py`. This module wires them to a workdir:

  workdir/config.json        the resolved config          workdir/tokenizer.model   the tokenizer used
  workdir/checkpoints/<N>/   orbax (see checkpointing.py)  workdir/metrics.jsonl     one JSON object per log step
  workdir/tensorboard/       TensorBoard events            workdir/eval/             reports and plots
  workdir/data/              data written by a built-in generator (data.generator)

Exact resume: step `s` uses `jax.random.fold_in(key(seed), s)` and the batch the grain iterator yields after
the state stored with the checkpoint, so N straight steps and N/2 + resume + N/2 give the same parameters.

Sharded runs (the `mesh` section, see docs/scaling.md): the trainer joins the multi-host job first (when one
is configured), builds the mesh, creates or restores the train state directly in its shards, places each batch
with `sharding.shard_batch` (every process reads its own block of the global `train.batch_size`), and runs
`sharding.make_sharded_train_step`. Checkpoints hold the sharded state and restore onto whatever mesh the
resuming run has. Evaluation during training gathers the model onto one device per process (every device must
fit the whole model for it; set `train.eval_every=0` and `train.eval_at_end=False` otherwise) and runs as on one
device. Only process 0 writes the config, tokenizer, metrics, TensorBoard events and evaluation reports.

Non-finite loss: the step leaves the state unchanged when the loss or gradient is not finite and reports
`finite=False`; the trainer reads that flag every step (one scalar device->host read, which serialises host and
device work but costs little next to a step), saves the unchanged (last good) state as a checkpoint, and stops
with a one-line `TrainingError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion import sharding
from hackable_diffusion.data.sft import DataError, SFTDataConfig, make_sft_dataset
from hackable_diffusion.data.tokenizer import TOKENIZER_FILENAME, Tokenizer, train_tokenizer
from hackable_diffusion.evaluation import loop as eval_loop
from hackable_diffusion.evaluation.tasks import Task, get_task
from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.interop.hf import load_config as load_hf_config
from hackable_diffusion.interop.hf import load_pretrained
from hackable_diffusion.model.config import ConfigError, ModelConfig, get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model
from hackable_diffusion.training import config as config_lib
from hackable_diffusion.training.checkpointing import CHECKPOINT_DIR, Checkpointer
from hackable_diffusion.training.config import ExperimentConfig, TrainingError
from hackable_diffusion.training.logging import MetricWriter, Progress, is_main_process
from hackable_diffusion.training.optimizer import make_optimizer
from hackable_diffusion.training.step import TrainState, init_train_state, make_train_step, state_to_model

DATA_DIR = "data"
EVAL_DIR = "eval"
_LOGGED = ("loss", "diffusion_loss", "ar_loss", "accuracy", "accuracy_corrupted", "grad_norm")


# ---- building blocks (also used by the evaluate / sample CLIs) ---------------------------------------------------
def as_experiment_config(config: ExperimentConfig | ml_collections.ConfigDict | Mapping[str, Any]) -> ExperimentConfig:
  return config if isinstance(config, ExperimentConfig) else ExperimentConfig.from_config_dict(config)


def data_paths(cfg: ExperimentConfig, workdir: str) -> dict[str, str]:
  """`{'train': path, 'validation': path or '', ...}`; a built-in generator writes its files (every split it
  makes, e.g. also 'test') into workdir/data."""
  if cfg.data.generator:
    task = get_task(cfg.data.generator, cfg.data.generator_args)
    paths = dict(task.make_data(os.path.join(workdir, DATA_DIR)))
    paths.setdefault("validation", "")
    return paths
  return {"train": cfg.data.train_path, "validation": cfg.data.validation_path}


def _training_texts(cfg: ExperimentConfig, path: str) -> list[str]:
  """Prompt (chat template applied) and completion texts of a JSONL file, for training a tokenizer."""
  if not os.path.isfile(path):
    raise DataError(f"{path}: data file not found")
  texts = []
  template = cfg.data.chat_template
  fields = (cfg.data.prompt_field, cfg.data.completion_field)
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      problem = None
      try:
        obj = json.loads(line.decode("utf-8").lstrip("\ufeff"))
      except UnicodeDecodeError:
        problem = "not valid UTF-8"
      except json.JSONDecodeError as e:
        problem = f"invalid JSON ({e.msg} at column {e.colno})"
      else:
        if not isinstance(obj, dict):
          problem = f"expected a JSON object, got {type(obj).__name__}"
        else:
          missing = [k for k in fields if not isinstance(obj.get(k), str)]
          if missing:
            problem = (f"field {missing[0]!r} is missing or not a string (keys: {sorted(obj)}; set "
                       f"data.prompt_field / data.completion_field if the data uses other names)")
      if problem is not None:
        if cfg.data.on_malformed == "skip":
          continue
        raise DataError(f"{path}:{lineno}: {problem}; set data.on_malformed='skip' to skip such lines")
      prompt, completion = obj[fields[0]], obj[fields[1]]
      texts += [template.format(prompt=prompt) if template else prompt, completion]
  if not texts:
    raise DataError(f"{path}: no records to train a tokenizer on")
  return texts


def build_tokenizer(cfg: ExperimentConfig, workdir: str, train_path: str) -> Tokenizer:
  """The run's tokenizer: `workdir/tokenizer.model` if present, else trained on the data or loaded from
  `tokenizer.path`, then saved into the workdir (evaluation, sampling and export reuse it)."""
  saved = os.path.join(workdir, TOKENIZER_FILENAME)
  try:
    if os.path.isfile(saved):
      return Tokenizer.load(saved)
    if cfg.tokenizer.path == "train":
      tok = train_tokenizer(_training_texts(cfg, train_path), model_type=cfg.tokenizer.model_type,
                            vocab_size=cfg.tokenizer.vocab_size or None)
    else:
      tok = Tokenizer.load(cfg.tokenizer.path)
  except (FileNotFoundError, ValueError) as e:
    if isinstance(e, (DataError, ConfigError)):
      raise
    raise ConfigError(f"tokenizer: {e}") from None
  if is_main_process():
    tok.save(workdir)
  return tok


def load_run_tokenizer(workdir: str) -> Tokenizer:
  path = os.path.join(workdir, TOKENIZER_FILENAME)
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: no tokenizer in this workdir (was it written by hackable_diffusion.train?)")
  try:
    return Tokenizer.load(path)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None


def is_run_workdir(path: str) -> bool:
  """A directory written by `hackable_diffusion.train` (as opposed to a Hugging Face checkpoint)."""
  return os.path.isdir(os.path.join(path, CHECKPOINT_DIR)) and os.path.isfile(
      os.path.join(path, config_lib.CONFIG_FILENAME)) and not os.path.isfile(os.path.join(path, "model.safetensors"))


def build_model_config(cfg: ExperimentConfig, tokenizer: Tokenizer) -> ModelConfig:
  """ModelConfig of the run: the preset (or the checkpoint's config.json) with `model.overrides`.

  For a fresh init, `vocab_size` and the pad/eos/bos ids default to the tokenizer's. The tokenizer must fit
  in the model's vocabulary.
  """
  overrides = dict(cfg.model.overrides)
  if cfg.model.checkpoint and is_run_workdir(cfg.model.checkpoint):
    base_cfg = config_lib.config_from_json(os.path.join(cfg.model.checkpoint, config_lib.CONFIG_FILENAME))
    base = build_model_config(as_experiment_config(base_cfg), tokenizer)
    return base.replace(**overrides) if overrides else base
  if cfg.model.checkpoint:
    overrides.setdefault("param_dtype", cfg.model.dtype)
    overrides.setdefault("dtype", cfg.model.dtype)
    model_config = load_hf_config(cfg.model.checkpoint, **overrides)
  else:
    overrides.setdefault("vocab_size", tokenizer.vocab_size)
    for name, tid in (("pad_token_id", tokenizer.pad_id), ("eos_token_id", tokenizer.eos_id),
                      ("bos_token_id", tokenizer.bos_id)):
      if tid >= 0:
        overrides.setdefault(name, tid)
    try:
      model_config = get_preset(cfg.model.preset, **overrides)
    except (TypeError, ValueError) as e:
      if isinstance(e, ConfigError):
        raise
      raise ConfigError(f"model.overrides: {e}") from None
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model vocab_size is "
                      f"{model_config.vocab_size}")
  return model_config


def apply_lora(cfg: ExperimentConfig, model: DiffusionGemma) -> tuple[nnx.Module, Any]:
  """Wraps `model` with adapters when `lora.enabled` -> (model, trainable filter); else (model, nnx.Param).

  The LoRA package provides `hackable_diffusion.lora.from_config(model, lora_section) -> (model, filter)`.
  """
  if not cfg.lora.get("enabled", False):
    return model, nnx.Param
  try:
    from hackable_diffusion import lora as lora_lib  # local: optional feature
    from_config = lora_lib.from_config
  except (ImportError, AttributeError):
    raise ConfigError("lora.enabled=True but hackable_diffusion.lora.from_config is not available") from None
  return from_config(model, dict(cfg.lora))


def build_model(cfg: ExperimentConfig, model_config: ModelConfig, *, abstract: bool = False,
                mesh: Mesh | None = None) -> tuple[nnx.Module, Any]:
  """The network to train (fresh init from the preset or `hd.load_pretrained`), LoRA-wrapped if configured.

  `abstract=True` builds shapes only (`nnx.eval_shape`), for restoring a checkpoint. `mesh`: a HF checkpoint is
  read straight into its shards (`sharding.load_pretrained_sharded`); other weights are built on one device.
  """
  if abstract:
    trainable = []

    def make():
      wrapped, filt = apply_lora(cfg, DiffusionGemma(model_config, rngs=nnx.Rngs(cfg.train.seed)))
      trainable.append(filt)
      return wrapped

    return nnx.eval_shape(make), trainable[0]
  if cfg.model.checkpoint and is_run_workdir(cfg.model.checkpoint):
    model = load_run(cfg.model.checkpoint).model  # a previous run's latest checkpoint as the base
    from hackable_diffusion import lora as lora_lib  # local: optional feature

    if lora_lib.has_lora(model):
      model = lora_lib.merge(model)
  elif cfg.model.checkpoint:
    overrides = {k: v for k, v in cfg.model.overrides.items() if k not in ("dtype", "param_dtype")}
    if mesh is None:
      model = load_pretrained(cfg.model.checkpoint, dtype=cfg.model.dtype, **overrides)
    else:
      model = sharding.load_pretrained_sharded(cfg.model.checkpoint, mesh, cfg.model.dtype, **overrides)
  else:
    model = init_model(model_config, seed=cfg.train.seed)
  return apply_lora(cfg, model)


def make_run_mesh(cfg: ExperimentConfig) -> Mesh | None:
  """The run's device mesh, or None for the plain one-device path (the `mesh` section all 1, single process).

  Joins a multi-host job first when one is configured (`mesh.coordinator_address` / `$JAX_COORDINATOR_ADDRESS`
  or `mesh.auto_distributed`), so call it before any other JAX call of the process.
  """
  mesh_cfg = cfg.mesh.mesh_config()
  try:
    distributed = sharding.maybe_initialize_distributed(mesh_cfg)
    if not (cfg.mesh.enabled or distributed):
      return None
    return sharding.make_mesh(mesh_cfg)
  except ValueError as e:
    raise ConfigError(" ".join(str(e).split())) from None


def data_shard(cfg: ExperimentConfig, mesh: Mesh | None) -> tuple[int, int, int]:
  """`(shard_index, shard_count, batch_size)` of this process's data loader.

  Without a mesh: every process reads shard `jax.process_index()` of `jax.process_count()` with
  `train.batch_size`. With one: `train.batch_size` is the global batch, split over the mesh's batch axes
  (data x fsdp x expert, which it must divide), and the process reads the block of rows its devices hold.
  """
  if mesh is None:
    return jax.process_index(), jax.process_count(), cfg.train.batch_size
  batch = cfg.train.batch_size
  shards = sharding.num_batch_shards(mesh)
  if batch % shards:
    raise ConfigError(f"train.batch_size={batch} is not divisible by the {shards} batch shards of the mesh "
                      f"(data x fsdp x expert of {dict(mesh.shape)}); use a multiple of {shards}")
  index, count = sharding.process_batch_shard(mesh)
  return index, count, batch // count


def sft_data_config(cfg: ExperimentConfig, model_config: ModelConfig, path: str, *, batch_size: int,
                    shuffle: bool, seed: int) -> SFTDataConfig:
  d = cfg.data
  try:
    return SFTDataConfig(
        path=path, prompt_field=d.prompt_field, completion_field=d.completion_field,
        chat_template=d.chat_template or None, max_prompt_length=d.max_prompt_length,
        canvas_length=model_config.canvas_length, max_canvases=d.max_canvases, append_eos=d.append_eos,
        add_bos=d.add_bos, on_overlength=d.on_overlength, on_malformed=d.on_malformed, batch_size=batch_size,
        shuffle=shuffle, seed=seed, num_epochs=None, drop_remainder=True, prefetch_batches=d.prefetch_batches,
        pinned_field=d.pinned_field or None)
  except ValueError as e:
    raise ConfigError(f"data: {e}") from None


def eval_task(cfg: ExperimentConfig, overrides: Mapping[str, Any] | None = None) -> Task:
  """`eval.task` ('' = the data generator's task with its arguments, else the generic 'text' task); `overrides`
  replace some of its arguments (an ablation)."""
  if cfg.eval.task:
    name, args = cfg.eval.task, cfg.eval.task_args
  elif cfg.data.generator:
    name, args = cfg.data.generator, cfg.data.generator_args
  else:
    name, args = "text", cfg.eval.task_args
  return get_task(name, {**dict(args), **dict(overrides or {})})


def check_eval_tasks(cfg: ExperimentConfig) -> None:
  """Builds the evaluation task and every ablation's task once, so that a bad task argument fails when the run
  starts (a one-line ConfigError naming the ablation), not after training."""
  if not (cfg.train.eval_at_end or cfg.train.eval_every):
    return
  eval_task(cfg)
  for name, overrides in cfg.eval.ablations.items():
    try:
      eval_task(cfg, overrides)
    except ConfigError as e:
      raise ConfigError(f"eval.ablations.{name}: {e}") from None


def load_eval_data(cfg: ExperimentConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                   paths: Mapping[str, str], num_examples: int | None = None) -> eval_loop.EvalData:
  split = cfg.eval.split
  path = paths.get(split) or ""
  if not path and split == "test":
    raise ConfigError("eval.split='test' needs a data generator that writes a test split (e.g. data.generator='sudoku')")
  if not path:
    logging.warning("no %s data configured; evaluating on the training data", split)
    path = paths["train"]
  data_cfg = sft_data_config(cfg, model_config, path, batch_size=1, shuffle=False, seed=0)
  return eval_loop.load_eval_data(path, data_cfg, tokenizer, num_examples or cfg.eval.num_examples)


def evaluate_model(cfg: ExperimentConfig, model: Any, tokenizer: Tokenizer, data: eval_loop.EvalData, *,
                   step: int, out_dir: str | None, log: Callable[[str], Any] | None = None) -> dict[str, Any]:
  """Runs the configured evaluation (every step budget + early stopping) and writes the report/plot."""
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model.config.canvas_length
  runs = eval_loop.eval_runs(cfg.eval, max_new)
  runs += eval_loop.ablation_runs(cfg.eval, max_new, lambda overrides: eval_task(cfg, overrides))
  return eval_loop.run_evaluation(model, tokenizer, data, eval_task(cfg), runs, batch_size=cfg.eval.batch_size,
                                  seed=cfg.eval.seed, step=step, out_dir=out_dir, num_samples=cfg.eval.num_samples,
                                  log=log)


@dataclasses.dataclass(frozen=True)
class LoadedRun:
  """A trained model restored from a workdir (for evaluation and sampling)."""

  config: ExperimentConfig
  model: nnx.Module
  tokenizer: Tokenizer
  step: int
  paths: dict[str, str]


def load_run(workdir: str, config: ExperimentConfig | ml_collections.ConfigDict | None = None,
             step: int | None = None) -> LoadedRun:
  """Restores the model of checkpoint `step` (default: latest) of `workdir`, without optimizer state."""
  if not os.path.isdir(workdir):
    raise CheckpointError(f"{workdir}: no such workdir")
  if config is None:
    config = config_lib.config_from_json(os.path.join(workdir, config_lib.CONFIG_FILENAME))
  cfg = as_experiment_config(config)
  tokenizer = load_run_tokenizer(workdir)
  model_config = build_model_config(cfg, tokenizer)
  ckpt = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), read_only=True)
  meta = ckpt.restore_meta(step)
  step = int(meta["step"])
  has_rest = meta.get("has_rest", True)
  # Shapes only, unless the frozen weights come from the base checkpoint (LoRA on a pretrained model).
  abstract, trainable = build_model(cfg, model_config, abstract=has_rest)
  graphdef, params, rest = nnx.split(abstract, trainable, ...)
  params, restored_rest, _ = ckpt.restore_variables(params, rest if has_rest else None, step)
  ckpt.close()
  model = nnx.merge(graphdef, params, restored_rest if has_rest else rest)
  paths = {"train": "", "validation": ""}
  try:
    paths = data_paths(cfg, workdir)
  except (ConfigError, DataError) as e:
    logging.warning("data of this run is not available: %s", e)
  return LoadedRun(config=cfg, model=model, tokenizer=tokenizer, step=step, paths=paths)


# ---- compiled steps, shared by trainers of the same model/optimizer/loss ----------------------------------------
_STEP_CACHE: dict[Any, tuple[Any, Callable, Callable, Any]] = {}
_STEP_CACHE_SIZE = 4


def _abstract_state(params: nnx.State, rest: nnx.State | None, tx: Any) -> TrainState:
  """The `TrainState` of `params` / `rest` (arrays or shapes) as shapes, optimizer state included."""
  return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, rest=rest,
                    opt_state=jax.eval_shape(tx.init, params))


def _optimizer_and_step(graphdef: nnx.GraphDef, cfg: ExperimentConfig, mesh: Mesh | None = None,
                        params: nnx.State | None = None,
                        rest: nnx.State | None = None) -> tuple[Any, Callable, Callable, Any]:
  """(tx, lr schedule, jitted train step, state shardings), memoised so that a second trainer in the same process
  (a resumed run, a notebook re-run) reuses the compiled step instead of compiling it again.

  With `mesh`: the step of `sharding.make_sharded_train_step` and the `TrainState` shardings it expects
  (computed from `params` / `rest`, arrays or shapes); without: the one-device step and None.
  """
  key = (graphdef, cfg.optimizer, cfg.diffusion, cfg.train.grad_accum_steps, mesh)
  if key not in _STEP_CACHE:
    tx, schedule = make_optimizer(cfg.optimizer)
    if mesh is None:
      shardings = None
      step = make_train_step(graphdef, tx, cfg.diffusion, grad_accum_steps=cfg.train.grad_accum_steps,
                             lr_schedule=schedule)
    else:
      shardings = sharding.state_shardings(mesh, _abstract_state(params, rest, tx))
      step = sharding.make_sharded_train_step(graphdef, tx, cfg.diffusion, mesh, None, shardings=shardings,
                                              grad_accum_steps=cfg.train.grad_accum_steps, lr_schedule=schedule)
    while len(_STEP_CACHE) >= _STEP_CACHE_SIZE:
      _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
    _STEP_CACHE[key] = (tx, schedule, step, shardings)
  return _STEP_CACHE[key]


def _gather_to_one_device(tree: Any, mesh: Mesh) -> Any:
  """Every array of a sharded tree, whole, on this process's first device of `mesh` (an all-gather)."""
  whole = jax.jit(lambda t: t, out_shardings=sharding.replicated(mesh))(tree)
  return jax.tree.map(lambda x: x.addressable_data(0), whole)


# ---- the trainer ------------------------------------------------------------------------------------------------
class SFTTrainer:
  """Supervised fine-tuning of a DiffusionGemma on prompt/completion data, resumable from its workdir.

  `SFTTrainer(config, workdir).train()` builds the tokenizer, data, model and optimizer, restores the latest
  checkpoint of `workdir/checkpoints` if there is one, trains to `train.steps`, evaluates every
  `train.eval_every` steps and at the end, and returns the last logged metrics.

  Args:
    config: an `ExperimentConfig` or a ConfigDict/dict with the sections of `training/config.py`.
    workdir: the run directory (created).
    progress: show the tqdm bar (default: on process 0).
  """

  def __init__(self, config: ExperimentConfig | ml_collections.ConfigDict | Mapping[str, Any], workdir: str, *,
               progress: bool | None = None):
    self.config = cfg = as_experiment_config(config)
    self.mesh = make_run_mesh(cfg)  # first: a multi-host job must be joined before any other JAX call
    check_eval_tasks(cfg)
    shard_index, shard_count, host_batch = data_shard(cfg, self.mesh)
    self.workdir = workdir = os.path.abspath(workdir)
    self._progress_enabled = progress
    os.makedirs(workdir, exist_ok=True)
    if is_main_process():
      config_lib.write_config_json(cfg.raw, workdir)
    self.paths = data_paths(cfg, workdir)
    self.tokenizer = build_tokenizer(cfg, workdir, self.paths["train"])
    self.model_config = build_model_config(cfg, self.tokenizer)
    data_cfg = sft_data_config(cfg, self.model_config, self.paths["train"], batch_size=host_batch,
                               shuffle=cfg.data.shuffle, seed=cfg.train.seed)
    self.train_data = make_sft_dataset(data_cfg, self.tokenizer, shard_index=shard_index, shard_count=shard_count)
    self._tokens_scale = shard_count if self.mesh is not None else 1  # tokens/s of the global batch
    self.checkpointer = Checkpointer(os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=cfg.train.keep_checkpoints,
                                     async_save=cfg.train.async_checkpointing)
    self._save_rest = not (cfg.model.checkpoint and cfg.lora.get("enabled", False))
    latest = self.checkpointer.latest_step()
    self.seed = cfg.train.seed
    self._data_state: dict[str, Any] | None = None
    self._shardings: Any = None  # the TrainState's shardings on the mesh (None without one)
    if latest is not None:
      self._restore(latest)
    elif self.mesh is None:
      model, trainable = build_model(cfg, self.model_config)
      self.graphdef = nnx.split(model, trainable, ...)[0]
      self.tx, self.lr_schedule, self.train_step, _ = _optimizer_and_step(self.graphdef, cfg)
      _, self.state = init_train_state(model, self.tx, trainable=trainable)
      del model
    else:
      self._init_sharded()
    if self.mesh is None:
      # Committed arrays: a fresh and a restored state then hit the same compiled step (jit keys on it).
      self.state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), self.state)
    self._eval_data: eval_loop.EvalData | None = None

  # ---- state ------------------------------------------------------------------------------------------------
  def _init_sharded(self) -> None:
    """A fresh train state created in its shards (a pretrained base: loaded, then sharded)."""
    cfg, mesh = self.config, self.mesh
    abstract, trainable = build_model(cfg, self.model_config, abstract=True)
    self.graphdef, params, rest = nnx.split(abstract, trainable, ...)
    self.tx, self.lr_schedule, self.train_step, self._shardings = _optimizer_and_step(self.graphdef, cfg, mesh,
                                                                                      params, rest)
    if cfg.model.checkpoint:
      model, _ = build_model(cfg, self.model_config, mesh=mesh)
      self.state = sharding.shard_state(init_train_state(model, self.tx, trainable=trainable)[1], self._shardings)
      return

    def model_fn() -> nnx.Module:  # what build_model initialises, traced inside one sharded program
      return apply_lora(cfg, DiffusionGemma(self.model_config, rngs=nnx.Rngs(cfg.train.seed)))[0]

    _, self.state, _ = sharding.init_train_state_sharded(model_fn, self.tx, mesh, trainable=trainable)

  def _restore(self, step: int) -> None:
    cfg, mesh = self.config, self.mesh
    has_rest = self.checkpointer.restore_meta(step).get("has_rest", True)
    # Shapes only, unless the frozen weights come from the base checkpoint (they are not in ours).
    model, trainable = build_model(cfg, self.model_config, abstract=has_rest, mesh=mesh)
    self.graphdef, params, rest = nnx.split(model, trainable, ...)
    self.tx, self.lr_schedule, self.train_step, self._shardings = _optimizer_and_step(self.graphdef, cfg, mesh,
                                                                                      params, rest)
    target = _abstract_state(params, rest if has_rest else None, self.tx)
    if mesh is not None:  # restore every array straight into its shards on this run's mesh
      target = sharding.abstract_with_shardings(
          target, self._shardings if has_rest else self._shardings.replace(rest=None))
      if not has_rest:
        rest = sharding.shard_state(rest, self._shardings.rest)
    state, meta = self.checkpointer.restore(target, step)
    self.state = state if has_rest else state.replace(rest=rest)
    self.seed = int(meta.get("seed", cfg.train.seed))
    if self.seed != cfg.train.seed:
      logging.warning("resuming with the checkpoint's seed %d (the config says train.seed=%d)", self.seed,
                      cfg.train.seed)
    self._data_state = meta.get("data_state")
    logging.info("restored %s/%d", self.checkpointer.directory, step)

  @property
  def step(self) -> int:
    return int(self.state.step)

  def model(self) -> nnx.Module:
    """The current model (shares arrays with the train state, sharded like it: use it before the next step)."""
    return state_to_model(self.graphdef, self.state)

  def _eval_model(self) -> nnx.Module:
    """The model for evaluation: on a mesh, gathered whole onto one device per process."""
    if self.mesh is None:
      return self.model()
    params, rest = _gather_to_one_device((self.state.params, self.state.rest), self.mesh)
    return nnx.merge(self.graphdef, params, rest)

  def save(self, step: int, data_state: Mapping[str, Any] | None, *, wait: bool = False) -> None:
    meta = {"seed": self.seed, "data_state": dict(data_state) if data_state is not None else None,
            "has_rest": self._save_rest}
    state = self.state if self._save_rest else self.state.replace(rest=None)
    self.checkpointer.save(step, state, meta, wait=wait)

  # ---- evaluation ---------------------------------------------------------------------------------------------
  def eval_data(self) -> eval_loop.EvalData:
    if self._eval_data is None:
      self._eval_data = load_eval_data(self.config, self.model_config, self.tokenizer, self.paths)
    return self._eval_data

  def evaluate(self, *, log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Evaluates the current state; writes workdir/eval/report_step_{N}.json and the plot (process 0)."""
    out_dir = os.path.join(self.workdir, EVAL_DIR) if is_main_process() else None
    return evaluate_model(self.config, self._eval_model(), self.tokenizer, self.eval_data(), step=self.step,
                          out_dir=out_dir, log=log)

  # ---- the loop -----------------------------------------------------------------------------------------------
  def train(self) -> dict[str, float]:
    """Trains to `train.steps`; returns the last logged metrics. Raises TrainingError on a non-finite loss."""
    cfg = self.config.train
    total = cfg.steps
    step = self.step
    base_key = jax.random.key(self.seed)
    iterator = self.train_data.iterator(self._data_state)
    writer = MetricWriter(self.workdir, resume_step=step)
    bar = Progress(total, step, enabled=self._progress_enabled)
    pending: list[dict[str, jax.Array]] = []
    last: dict[str, float] = {}
    tokens = 0.0
    t_log = time.perf_counter()
    if step > 0:
      bar.write(f"resuming from step {step} ({self.checkpointer.directory})")
    try:
      while step < total:
        data_state = iterator.get_state()
        batch = next(iterator)
        tokens += float(np.sum(batch.prompt_mask) + np.sum(batch.completion_mask)) * self._tokens_scale
        if self.mesh is not None:
          batch = sharding.shard_batch(batch, self.mesh)
        self.state, metrics = self.train_step(self.state, batch, jax.random.fold_in(base_key, step))
        if not bool(metrics["finite"]):
          self._stop_non_finite(step, metrics, data_state, writer)
        step += 1
        pending.append(metrics)
        bar.update(1)
        if step % cfg.log_every == 0 or step == total:
          elapsed = time.perf_counter() - t_log
          last = self._log(step, pending, writer, tokens / max(elapsed, 1e-9), len(pending) / max(elapsed, 1e-9))
          bar.update(0, tokens=tokens)
          bar.set_metrics(last["loss"], lr=last.get("lr", 0.0))
          pending, tokens, t_log = [], 0.0, time.perf_counter()
        if step % cfg.checkpoint_every == 0 or step == total:
          self.save(step, iterator.get_state())
        if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
          self._evaluate_and_log(step, writer, bar)
          t_log = time.perf_counter()
      self.checkpointer.wait()
      if cfg.eval_at_end and step == total:
        report_path = os.path.join(self.workdir, EVAL_DIR, eval_loop.REPORT_PATTERN.format(step=step))
        if not os.path.exists(report_path):
          self._evaluate_and_log(step, writer, bar)
    except KeyboardInterrupt:
      self.save(step, iterator.get_state(), wait=True)
      raise TrainingError(f"interrupted at step {step}; saved a checkpoint - rerun the same command to resume")
    finally:
      bar.close()
      writer.close()
      self.checkpointer.wait()
      self._data_state = iterator.get_state()  # a later train() call continues from here
    return last

  def _log(self, step: int, pending: list[dict[str, jax.Array]], writer: MetricWriter, tokens_per_s: float,
           steps_per_s: float) -> dict[str, float]:
    host = jax.device_get(pending)
    out = {k: float(np.mean([m[k] for m in host])) for k in _LOGGED if k in host[0]}
    if "lr" in host[-1]:
      out["lr"] = float(host[-1]["lr"])
    out["tokens_per_s"] = tokens_per_s
    out["steps_per_s"] = steps_per_s
    writer.write(step, out, prefix="train/")
    return out

  def _evaluate_and_log(self, step: int, writer: MetricWriter, bar: Progress) -> None:
    report = self.evaluate(log=bar.write if is_main_process() else None)
    for run in report["runs"]:
      values = {f"{run['name']}/{k}": v for k, v in run["metrics"].items() if isinstance(v, float)}
      values[f"{run['name']}/mean_denoising_steps"] = run["mean_denoising_steps"]
      writer.write(step, values, prefix="eval/")

  def _stop_non_finite(self, step: int, metrics: Mapping[str, jax.Array], data_state: Mapping[str, Any],
                       writer: MetricWriter) -> None:
    loss = float(metrics["loss"])
    grad_norm = float(metrics["grad_norm"])
    writer.write(step, {"loss": loss, "grad_norm": grad_norm}, prefix="train/")
    # The step left the state unchanged: it is the state after `step` good updates.
    saved = step not in self.checkpointer.all_steps()
    self.save(step, data_state, wait=True)
    where = f"{self.checkpointer.directory}/{step}"
    raise TrainingError(
        f"non-finite loss at step {step} (loss={loss}, grad_norm={grad_norm}); stopped and "
        f"{'saved' if saved else 'kept'} the last good state as {where} - lower optimizer.peak_lr or check the data")

  def close(self) -> None:
    self.checkpointer.close()

  def __enter__(self) -> SFTTrainer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def train(config: ExperimentConfig | ml_collections.ConfigDict | Mapping[str, Any], workdir: str, *,
          progress: bool | None = None) -> dict[str, float]:
  """Builds an `SFTTrainer` and trains; returns the last logged metrics."""
  with SFTTrainer(config, workdir, progress=progress) as trainer:
    return trainer.train()


__all__ = ["DATA_DIR", "EVAL_DIR", "LoadedRun", "SFTTrainer", "apply_lora", "build_model", "build_model_config",
           "build_tokenizer", "check_eval_tasks", "data_paths", "data_shard", "eval_task", "evaluate_model",
           "load_eval_data", "load_run", "load_run_tokenizer", "make_run_mesh", "sft_data_config", "train"]
