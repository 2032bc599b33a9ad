"""A run: its workdir layout, and building its model, tokenizer, data, mesh and evaluation from a config.

Used by every CLI (`train`, `evaluate`, `sample`, `export`) and by the `SFTTrainer`; sampling and export go through
here, not through the trainer. A run's workdir holds:

  workdir/config.json        the resolved config          workdir/tokenizer.json|.model  the tokenizer
  workdir/checkpoints/<N>/   orbax (runs/checkpoints.py)   workdir/metrics.jsonl     one JSON object per log step
  workdir/tensorboard/       TensorBoard events            workdir/eval/             reports and plots
  workdir/data/              data written by a built-in generator (data.generator)
  workdir/.lock              the owning run's lock         workdir/config.prev.json  the config before a resume
                                                           changed it (both: runs/workdir.py)
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion import lora as lora_lib
from hackable_diffusion import sharding
from hackable_diffusion.data.chat import ChatTemplate, chat_template_kind
from hackable_diffusion.data.sft import SFTDataConfig, format_prompt, read_records
from hackable_diffusion.data.tokenizer import Tokenizer, find_tokenizer_file, train_tokenizer
from hackable_diffusion.errors import CheckpointError, ConfigError, DataError
from hackable_diffusion.evaluation import loop as eval_loop
from hackable_diffusion.evaluation.checks import check_records
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.interop.hf import load_config as load_hf_config
from hackable_diffusion.interop.hf import load_pretrained, resolve_dtype
from hackable_diffusion.interop.qlora_load import load_pretrained_quantized
from hackable_diffusion.model import scan, structure
from hackable_diffusion.model.config import ModelConfig, get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model
from hackable_diffusion.tasks.base import EvalRecord, Task, get_task
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import workdir as workdir_lib
from hackable_diffusion.runs.checkpoints import CHECKPOINT_DIR, Checkpointer, is_run_workdir, step_to_restore
from hackable_diffusion.runs.config import ExperimentConfig
from hackable_diffusion.runs.images import TRAINED_IMAGE_TOKENS, image_data_config
from hackable_diffusion.sharding.mesh import is_main_process

DATA_DIR = "data"
EVAL_DIR = "eval"

AnyConfig = ExperimentConfig | ml_collections.ConfigDict | Mapping[str, Any]


# ---- config and workdir -------------------------------------------------------------------------------------------
def as_experiment_config(config: AnyConfig) -> ExperimentConfig:
  return config if isinstance(config, ExperimentConfig) else ExperimentConfig.from_config_dict(config)


def data_paths(cfg: ExperimentConfig, workdir: str, *, progress: bool | None = None) -> dict[str, str]:
  """`{'train': path, 'validation': path or '', ...}`; a built-in generator writes its files (every split it
  makes, e.g. also 'test') into workdir/data, with its progress bar when `progress` (None: on process 0) and its
  `make_data` takes a `progress` argument (a task written without one is called as before). `data.train_path` /
  `data.validation_path`, when set, replace the generated split of that name (e.g. to evaluate a run on another
  file)."""
  given = {"train": cfg.data.train_path, "validation": cfg.data.validation_path}
  if not cfg.data.generator:
    return given
  task = get_task(cfg.data.generator, cfg.data.generator_args)
  progress = is_main_process() if progress is None else progress
  kwargs = {"progress": progress} if "progress" in inspect.signature(task.make_data).parameters else {}
  paths = dict(task.make_data(os.path.join(workdir, DATA_DIR), **kwargs))
  paths.setdefault("validation", "")
  return paths | {split: path for split, path in given.items() if path}


# ---- tokenizer ----------------------------------------------------------------------------------------------------
def _training_texts(cfg: ExperimentConfig, path: str) -> list[str]:
  """Prompt (chat template applied) and completion texts of a JSONL file, for training a tokenizer."""
  d = cfg.data
  records = read_records(path, prompt_field=d.prompt_field, completion_field=d.completion_field,
                         pinned_field=d.pinned_field or None, on_malformed=d.on_malformed,
                         messages_field=d.messages_field)
  if not records:
    raise DataError(f"{path}: no records to train a tokenizer on")
  # a jinja template's output (e.g. Sudoku's cell characters) is what the model reads: train on it, as rendered
  # before the tokenizer exists (special-token variables empty)
  template = ChatTemplate(source=d.chat_template, origin="data.chat_template") if chat_template_kind(
      d.chat_template or None) == "jinja" else None
  texts = []
  for r in records:
    prompt = format_prompt(d.chat_template or None, r.prompt) if template is None else template.render(
        [{"role": "user", "content": r.prompt}], add_generation_prompt=True, where=f"{path}:{r.source[1]}")
    texts += [prompt, r.completion]
  return texts


def build_tokenizer(cfg: ExperimentConfig, workdir: str, train_path: str) -> Tokenizer:
  """The run's tokenizer: the workdir's (tokenizer.json or tokenizer.model) if present, else trained on the data,
  loaded from the model checkpoint ('checkpoint') or from `tokenizer.path`, then saved into the workdir
  (evaluation, sampling and export reuse it)."""
  try:
    if find_tokenizer_file(workdir):
      return Tokenizer.load(workdir)
    source = cfg.tokenizer.path
    if source == "auto":
      source = "checkpoint" if cfg.model.checkpoint else "train"
    if source == "train":
      # a model with a vision tower reads images: Gemma 4's image tokens, kept whole, named in the tokenizer config
      image_tokens = TRAINED_IMAGE_TOKENS if cfg.model.overrides.get("vision") else {}
      tok = train_tokenizer(_training_texts(cfg, train_path), model_type=cfg.tokenizer.model_type,
                            vocab_size=cfg.tokenizer.vocab_size or None,
                            user_defined_symbols=tuple(image_tokens.values()))
      if image_tokens:
        tok = tok.with_config(image_tokens)
      if chat_template_kind(cfg.data.chat_template or None) == "jinja":  # saved with it: exports carry it
        tok = tok.with_chat_template(cfg.data.chat_template, "data.chat_template")
    elif source == "checkpoint":
      if not cfg.model.checkpoint:
        raise ConfigError("tokenizer.path='checkpoint' needs model.checkpoint (a HF directory or run workdir)")
      tok = Tokenizer.load(resolve_model_path(cfg.model.checkpoint))  # a folder, a run workdir or a Hub id
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
  path = find_tokenizer_file(workdir)
  if path is None:
    raise CheckpointError(f"{workdir}: no tokenizer (tokenizer.json or tokenizer.model) in this workdir (was it "
                          f"written by hackable_diffusion.train?)")
  try:
    return Tokenizer.load(workdir)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None


# ---- model --------------------------------------------------------------------------------------------------------
def build_model_config(cfg: ExperimentConfig, tokenizer: Tokenizer) -> ModelConfig:
  """ModelConfig of the run: the preset (or the checkpoint's config.json) with `model.overrides`.

  For a fresh init, `vocab_size` and the pad/eos/bos ids default to the tokenizer's. The tokenizer must fit
  in the model's vocabulary.
  """
  overrides = dict(cfg.model.overrides)
  if cfg.model.checkpoint and is_run_workdir(cfg.model.checkpoint):
    base_cfg = config_lib.config_from_json(os.path.join(cfg.model.checkpoint, config_lib.CONFIG_FILENAME),
                                           trust_remote_code=cfg.trust_remote_code)
    base = build_model_config(ExperimentConfig.from_config_dict(base_cfg, trust_remote_code=cfg.trust_remote_code),
                              tokenizer)
    return base.replace(**overrides) if overrides else base
  if cfg.model.checkpoint:
    dtype = resolve_dtype(cfg.model.checkpoint, cfg.model.dtype)
    overrides.setdefault("param_dtype", dtype)
    overrides.setdefault("dtype", dtype)
    model_config = load_hf_config(cfg.model.checkpoint, **overrides)
    tokenizer.check_model_ids(pad_token_id=model_config.pad_token_id, eos_token_id=model_config.eos_token_ids,
                              bos_token_id=model_config.bos_token_id,
                              where=os.path.join(cfg.model.checkpoint, "config.json"))
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


def apply_lora(cfg: ExperimentConfig, model: nnx.Module) -> tuple[nnx.Module, Any]:
  """`(model with adapters, nnx.LoRAParam)` when the run has a `lora` config, else `(model, nnx.Param)`: the
  trainable filter of the run (training only adapters is an optimizer filter, not special code).

  With `ModelConfig.scan_layers` the layers are then stacked (`model.scan.stack_layers`, the per-layer arrays
  released as they are stacked: `model` is freshly built at every call site) — every run path (fresh, loaded,
  restored, sharded init) builds its model through here, so they all hold the same stacked structure.
  """
  if cfg.lora is None:
    out, trainable = model, nnx.Param
  else:
    out, trainable = lora_lib.apply_lora(model, cfg.lora, rngs=nnx.Rngs(cfg.lora_seed)), nnx.LoRAParam
  if out.config.scan_layers:
    out = scan.stack_layers(out, donate=True)
  return out, trainable


def build_abstract_model(cfg: ExperimentConfig, model_config: ModelConfig) -> tuple[nnx.Module, Any]:
  """`(model as shapes only, trainable filter)`: what the train state, its shardings and a restore are built from."""
  trainable = []

  def make():
    wrapped, filt = apply_lora(cfg, DiffusionGemma(model_config, rngs=nnx.Rngs(cfg.train.seed)))
    trainable.append(filt)
    return wrapped

  abstract = nnx.eval_shape(make)
  if cfg.lora is None or cfg.lora.base_quantization == "none":  # a quantized base needs less than its shapes say
    check_fits_memory(abstract)
  return abstract, trainable[0]


def available_memory() -> tuple[int, str]:
  """(bytes free for the model, where): the free memory of every accelerator of this job together (the most any
  mesh can hold), or on a CPU the host's available memory (`MemAvailable`)."""
  devices = jax.devices()
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - a backend without memory statistics
    stats = {}
  if stats.get("bytes_limit"):
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free * len(devices), f"{len(devices)} x {devices[0].device_kind}"
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      meminfo = {line.split(":")[0]: line.split()[1] for line in f if ":" in line}
    return int(meminfo["MemAvailable"]) * 1024, "host memory"
  except (OSError, KeyError, ValueError, IndexError):
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"


def check_fits_memory(abstract: Any, *, what: str = "the model's parameters") -> int:
  """A one-line `ConfigError` when the arrays of `abstract` (shapes only) need more bytes than `available_memory()`
  - checked before anything is allocated, so a mistyped size (`model.overrides.vocab_size=1e10`) is refused at once
  instead of failing deep inside an allocation. Returns the bytes needed."""
  need = workdir_lib.state_bytes(abstract)
  free, where = available_memory()
  if need > free:
    raise ConfigError(f"{what} need an estimated {need / 2**30:.1f} GiB > available {free / 2**30:.1f} GiB "
                      f"({where}); check model.preset / model.overrides (vocab_size, hidden_size, "
                      "num_hidden_layers, ...)")
  return need


def build_model(cfg: ExperimentConfig, model_config: ModelConfig, *, mesh: Mesh | None = None) -> nnx.Module:
  """The network's base weights (no adapters): a fresh init, a Hugging Face checkpoint (read straight into its
  shards with `mesh`), or a previous run's latest checkpoint (its adapters merged)."""
  if cfg.model.checkpoint and is_run_workdir(cfg.model.checkpoint):
    # a previous run's latest checkpoint (its config.json trusted as far as this config says)
    model = scan.unstack_layers(load_run(cfg.model.checkpoint, trust_remote_code=cfg.trust_remote_code).model)
    return lora_lib.merge(model) if lora_lib.has_lora(model) else model
  if cfg.model.checkpoint:
    overrides = {k: v for k, v in cfg.model.overrides.items() if k not in ("dtype", "param_dtype")}
    quantized = cfg.lora.base_quantization if cfg.lora is not None else "none"
    if quantized != "none":  # QLoRA: quantized tensor by tensor as it loads; no dense copy on the device
      return load_pretrained_quantized(cfg.model.checkpoint, quantized, dtype=cfg.model.dtype,
                                       block_size=cfg.lora.base_block_size, mesh=mesh, **overrides)
    return load_pretrained(cfg.model.checkpoint, dtype=cfg.model.dtype, mesh=mesh, stack=False, **overrides)
  return init_model(model_config, seed=cfg.train.seed)


def model_factory(cfg: ExperimentConfig, model_config: ModelConfig) -> Callable[[], nnx.Module]:
  """A function building the freshly initialised network (adapters included) to trace inside one sharded program."""
  return lambda: apply_lora(cfg, DiffusionGemma(model_config, rngs=nnx.Rngs(cfg.train.seed)))[0]


# ---- devices and data ---------------------------------------------------------------------------------------------
def make_run_mesh(cfg: ExperimentConfig) -> Mesh | None:
  """The run's device mesh, or None for the plain one-device path (the `mesh` section all 1, single process).

  Joins a multi-host job first when one is configured (`mesh.coordinator_address` / `$JAX_COORDINATOR_ADDRESS`
  or `mesh.auto_distributed`), so call it before any other JAX call of the process. Once joined, the processes
  agree that every one of them started (`sharding.stop_together(before=JOINED)`): a process whose command line or
  files failed before it joined comes in to say so (`sharding.tell_job_and_leave`), and all stop here.
  """
  try:
    distributed = sharding.maybe_initialize_distributed(cfg.mesh)
    if distributed:
      sharding.stop_together(None, before=sharding.JOINED)
    if not (config_lib.mesh_requested(cfg.mesh) or distributed):
      return None
    return sharding.make_mesh(cfg.mesh)
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
  width = structure.prompt_width(model_config)
  if width and d.max_prompt_length != width:
    raise ConfigError(f"model.attention_structure={model_config.attention_structure!r} reads the prompt as its first "
                      f"{width} cache slots, but data.max_prompt_length={d.max_prompt_length}; set "
                      f"data.max_prompt_length={width} (a longer padded prompt would shift it out of place)")
  try:
    return SFTDataConfig(
        path=path, prompt_field=d.prompt_field, completion_field=d.completion_field,
        messages_field=d.messages_field, chat_template=d.chat_template or None, max_prompt_length=d.max_prompt_length,
        min_prompt_length=width,
        canvas_length=model_config.canvas_length, max_canvases=d.max_canvases, append_eos=d.append_eos,
        add_bos=d.add_bos, on_overlength=d.on_overlength, on_malformed=d.on_malformed, batch_size=batch_size,
        shuffle=shuffle, seed=seed, num_epochs=None, drop_remainder=True, prefetch_batches=d.prefetch_batches,
        pinned_field=d.pinned_field or None)
  except ValueError as e:
    raise ConfigError(f"data: {e}") from None


# ---- evaluation ---------------------------------------------------------------------------------------------------
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
    raise ConfigError("eval.split='test' needs a data generator that writes a test split "
                      "(a task of tasks.BUILTIN_TASKS with make_data)")
  if not path:
    logging.warning("no %s data configured; evaluating on the training data", split)
    path = paths["train"]
  data_cfg = sft_data_config(cfg, model_config, path, batch_size=1, shuffle=False, seed=0)
  data_cfg = image_data_config(cfg, data_cfg, model_config)  # chat records with images: read as in training
  num = num_examples or cfg.eval.num_examples
  data = eval_loop.load_eval_data(path, dataclasses.replace(data_cfg, pinned_field=None), tokenizer, num)
  # every record usable by every evaluated task before anything is sampled (a one-line error naming file:line)
  for task in _eval_tasks(cfg):
    check_records(task, data.examples, data.records.sources, tokenizer, model_config.canvas_length)
  # The data's pins are read only where a task brings no start canvases of its own (a puzzle task pins its givens
  # from the prompt): then a file without the pinned field (e.g. a user's own puzzles) needs no
  # --config.data.pinned_field=.
  if data_cfg.pinned_field is None or (
      data.examples and _tasks_seed_canvases(cfg, tokenizer, data.examples[0], model_config.canvas_length)):
    return data
  return eval_loop.load_eval_data(path, data_cfg, tokenizer, num)


def _tasks_seed_canvases(cfg: ExperimentConfig, tokenizer: Tokenizer, example: EvalRecord, num_tokens: int) -> bool:
  """Whether the evaluation task and every ablation task that runs give `example` a start canvas of their own
  (`seed_canvas` not None), so that no run reads the data's pinned tokens."""
  return all(task.seed_canvas([example], tokenizer, num_tokens) is not None for task in _eval_tasks(cfg))


def _eval_tasks(cfg: ExperimentConfig) -> list[Task]:
  """The evaluation task, then each ablation's (those that run: `eval.ablation_steps` > 0)."""
  ablations = cfg.eval.ablations.values() if cfg.eval.ablation_steps else ()
  return [eval_task(cfg)] + [eval_task(cfg, overrides) for overrides in ablations]


def evaluate_model(cfg: ExperimentConfig, model: Any, tokenizer: Tokenizer, data: eval_loop.EvalData, *,
                   step: int, out_dir: str | None, log: Callable[[str], Any] | None = None,
                   mesh: Mesh | None = None) -> dict[str, Any]:
  """Runs the configured evaluation (every step budget + early stopping) and writes the report/plot.

  `mesh`: sample on the run's mesh with the model's variables where they are (a train state's shardings; see
  `evaluation.loop`), batches of `eval.batch_size` examples split over its batch axes. Multi-host: every process
  calls it (`out_dir` None where nothing is written)."""
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model.config.canvas_length
  runs = eval_loop.eval_runs(cfg.eval, max_new)
  runs += eval_loop.ablation_runs(cfg.eval, max_new, lambda overrides: eval_task(cfg, overrides))
  return eval_loop.run_evaluation(model, tokenizer, data, eval_task(cfg), runs, batch_size=cfg.eval.batch_size,
                                  seed=cfg.eval.seed, step=step, out_dir=out_dir, num_samples=cfg.eval.num_samples,
                                  log=log, mesh=mesh)


def generation_defaults(cfg: ExperimentConfig, model_config: ModelConfig) -> dict[str, Any]:
  """The run's evaluation sampler as the generation defaults of an export (`generation_config.json`)."""
  sampling = cfg.eval.sampling
  return dict(max_new_tokens=cfg.eval.max_new_tokens or cfg.data.max_canvases * model_config.canvas_length,
              max_denoising_steps=cfg.eval.early_stopping_steps, entropy_bound=sampling.entropy_bound,
              t_min=sampling.t_min, t_max=sampling.t_max, stability_threshold=sampling.stability_threshold,
              confidence_threshold=sampling.confidence_threshold)


# ---- a trained run ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoadedRun:
  """A trained model restored from a workdir (for evaluation, sampling and export); `mesh`: the mesh its variables
  were restored onto (None: one device)."""

  config: ExperimentConfig
  model: nnx.Module
  tokenizer: Tokenizer
  step: int
  paths: dict[str, str]
  mesh: Mesh | None = None


def load_run(workdir: str, config: AnyConfig | None = None, step: int | None = None, *,
             mesh: Mesh | None = None, trust_remote_code: bool = False) -> LoadedRun:
  """Restores the model of checkpoint `step` (default: latest) of `workdir`, without optimizer state.

  `config` (default: the run's config.json): a config given here is trusted like any config built in Python;
  the run's own config.json is not, unless `trust_remote_code` - a component it names by 'module:attribute'
  (code to import) is refused in one line (see `specs`).

  `mesh` (e.g. `make_run_mesh(cfg)`, the run's own mesh): every variable is restored straight into its shards by
  the logical-axis rules, as training holds it (whatever mesh wrote the checkpoint); None: whole on one device.
  With a mesh the processes of a multi-process job agree after reading the run's files (`sharding.agree_on`): a
  file one host lacks (its copy of the workdir, a checkpoint step) stops every host before the restore's collectives.
  """

  ckpt_dir, requested = os.path.join(workdir, CHECKPOINT_DIR), step

  def read() -> tuple[ExperimentConfig, Tokenizer, ModelConfig, int]:
    if not os.path.isdir(workdir):
      raise CheckpointError(f"{workdir}: no such workdir")
    if config is None:
      cfg = ExperimentConfig.from_config_dict(
          config_lib.config_from_json(os.path.join(workdir, config_lib.CONFIG_FILENAME),
                                      trust_remote_code=trust_remote_code), trust_remote_code=trust_remote_code)
    else:
      cfg = as_experiment_config(config)
    tokenizer = load_run_tokenizer(workdir)
    return cfg, tokenizer, build_model_config(cfg, tokenizer), step_to_restore(ckpt_dir, requested)

  cfg, tokenizer, model_config, step = sharding.agree_on(read, together=mesh is not None,
                                                         before="restoring the checkpoint")
  ckpt = Checkpointer(ckpt_dir, read_only=True)  # with several processes, opening it is a collective (orbax)
  try:
    if mesh is not None:  # each host picked its latest step: the same one on every host, or a one-line error
      ckpt.same_step_on_every_process(step)
    meta = ckpt.restore_meta(step)
    step = int(meta["step"])
    has_rest = meta.get("has_rest", True)
    abstract, trainable = build_abstract_model(cfg, model_config)
    graphdef, params, rest = nnx.split(abstract, trainable, ...)
    if mesh is not None:  # restore targets carrying this mesh's shardings
      params = sharding.abstract_with_shardings(params, sharding.state_shardings(mesh, params))
      if has_rest:
        rest = sharding.abstract_with_shardings(rest, sharding.state_shardings(mesh, rest))
    if not has_rest:  # LoRA on a pretrained base: the frozen weights come from the base checkpoint, not ours
      _, rest = nnx.split(apply_lora(cfg, build_model(cfg, model_config, mesh=mesh))[0], trainable, ...)[1:]
      if mesh is not None:
        rest = sharding.shard_state(rest, sharding.state_shardings(mesh, rest))
    params, restored_rest, _ = ckpt.restore_variables(params, rest if has_rest else None, step)
  finally:
    ckpt.close()
  model = nnx.merge(graphdef, params, restored_rest if has_rest else rest)
  paths = {"train": "", "validation": ""}
  try:
    paths = data_paths(cfg, workdir)
  except (ConfigError, DataError) as e:
    logging.warning("data of this run is not available: %s", e)
  return LoadedRun(config=cfg, model=model, tokenizer=tokenizer, step=step, paths=paths, mesh=mesh)


def load_run_adapters(workdir: str, step: int | None = None, *, trust_remote_code: bool = False) -> LoadedRun:
  """The adapters of checkpoint `step` (default: latest) of a LoRA run, on a model whose base weights are shapes
  only (`jax.ShapeDtypeStruct`: nothing of the base is read, built or allocated): what writing a PEFT adapter
  needs (`interop.peft.save_adapter`). `paths` is left empty (no data is read). A one-line `ConfigError` for a
  run without LoRA."""
  if not os.path.isdir(workdir):
    raise CheckpointError(f"{workdir}: no such workdir")
  cfg = ExperimentConfig.from_config_dict(
      config_lib.config_from_json(os.path.join(workdir, config_lib.CONFIG_FILENAME),
                                  trust_remote_code=trust_remote_code), trust_remote_code=trust_remote_code)
  if cfg.lora is None:
    raise ConfigError(f"{workdir}: the run has no LoRA adapters (its config has no lora section); export it with "
                      "format 'merged'")
  tokenizer = load_run_tokenizer(workdir)
  model_config = build_model_config(cfg, tokenizer)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  step = step_to_restore(ckpt_dir, step)
  abstract = nnx.eval_shape(lambda: apply_lora(cfg, DiffusionGemma(model_config, rngs=nnx.Rngs(cfg.train.seed)))[0])
  graphdef, params, rest = nnx.split(abstract, nnx.LoRAParam, ...)
  ckpt = Checkpointer(ckpt_dir, read_only=True)
  try:
    params, _, meta = ckpt.restore_variables(params, None, step)
  finally:
    ckpt.close()
  model = nnx.merge(graphdef, params, rest)
  return LoadedRun(config=cfg, model=model, tokenizer=tokenizer, step=int(meta["step"]),
                   paths={"train": "", "validation": ""})


__all__ = ["DATA_DIR", "EVAL_DIR", "LoadedRun", "apply_lora", "as_experiment_config", "available_memory",
           "build_abstract_model", "check_fits_memory",
           "build_model", "build_model_config", "build_tokenizer", "check_eval_tasks", "data_paths", "data_shard",
           "eval_task", "evaluate_model", "generation_defaults", "is_run_workdir", "load_eval_data", "load_run",
           "load_run_adapters", "load_run_tokenizer", "make_run_mesh", "model_factory", "sft_data_config"]
