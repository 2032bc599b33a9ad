"""Experiment configs: ml_collections files -> typed, validated section objects.

A config file (`configs/*.py`) defines `get_config()` returning a `ConfigDict` with the sections below (every
section is optional; missing keys take the defaults of the typed objects). `ExperimentConfig.from_config_dict`
turns it into frozen dataclasses, rejecting unknown keys with a one-line `ConfigError` that lists the valid ones.
Sections that configure a library component *are* that component's frozen dataclass, validated by it when the run
starts (before any data is read or any step runs):

  model      preset | checkpoint, dtype, overrides (ModelConfig fields for a fresh init)
  tokenizer  path ('train' = a char model trained on the data, saved as workdir/tokenizer.model), model_type
  data       generator (+ generator_args) | train_path / validation_path, fields, chat_template ('task': the
             generator task's), lengths
  diffusion  -> `diffusion.loss.LossConfig` (loss_variant, schedule, time_eps, self_conditioning_prob, ...)
  optimizer  -> `OptimizerConfig` (schedule, Adam, clipping; decay_steps 0 or unset = train.steps,
             the schedule spans the run; master_weights: float32 masters of
             a bfloat16 model's trainable variables, 'auto' = on for full fine-tuning, off under LoRA)
  train      steps, batch_size, grad_accum_steps, seed, log_every, checkpoint_every, keep_checkpoints, eval_every
  eval       task (+ task_args), split, num_examples, batch_size, step_budgets, early_stopping_steps, ablations;
             eval.sampling -> `sampling.config.SamplingConfig` (the sampler of every evaluation run)
  lora       enabled, seed; the other keys -> `lora.LoraConfig` (rank, alpha, dropout, target_modules, ...)
  mesh       -> `sharding.MeshConfig` (data, fsdp, tensor, expert; all 1 = one device; multi-host settings)

Command-line handling (`--config=FILE`, `--config.a.b=value`) lives in `hackable_diffusion.cli`; finding, running
and overriding config files, and a run's `config.json`, in `runs.config_files` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from hackable_diffusion.data.chat import chat_template_kind
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.errors import ConfigError, TrainingError
from hackable_diffusion.lora.adapters import LoraConfig
from hackable_diffusion.model.config import ModelConfig, get_preset
from hackable_diffusion.runs.config_files import (CONFIG_FILENAME, CONFIGS_DIR, apply_overrides, check_config_source,
                                                  check_override_keys, config_file_error, config_from_json,
                                                  config_to_dict, load_config_file, resolve_config_path,
                                                  write_config_json)
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sharding.mesh import MESH_AXES, MeshConfig
from hackable_diffusion.tasks import base as task_lib

SECTIONS = ("model", "tokenizer", "data", "diffusion", "optimizer", "train", "eval", "lora", "mesh")


# ---- sections ---------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(section: str, name: str, v: Any, *, allow_zero: bool = False) -> None:
  if not _is_int(v) or v < (0 if allow_zero else 1):
    raise ConfigError(f"{section}.{name}={v!r}; expected an integer >= {0 if allow_zero else 1}")


_SCHEDULES = ("cosine", "linear", "constant")
_MASTER_WEIGHTS = ("auto", "float32", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """The optimizer of a run (`training.optimizer`: clip by global norm -> AdamW -> warmup + decay schedule).

  master_weights: 'auto' (default: 'float32' for full fine-tuning, 'off' under LoRA, whose adapters are stored
    in `lora.param_dtype`, float32 by default, and whose frozen base keeps its dtype), 'float32' (trainable
    variables stored below float32, e.g. bfloat16, get a float32 master copy that the optimizer updates; the
    forward/backward runs on its cast to the stored dtype) or 'off' (the optimizer updates the variables in the
    dtype they are stored in: in bfloat16 an update below half a unit in the last place is lost). A no-op for
    variables already stored in float32.
  """

  peak_lr: float = 1.5e-4
  end_lr_ratio: float = 0.1  # final lr = peak_lr * end_lr_ratio
  warmup_steps: int = 100
  decay_steps: int = 2000  # total schedule length (warmup included)
  schedule: str = "cosine"
  b1: float = 0.95
  b2: float = 0.99
  eps: float = 1e-8
  weight_decay: float = 1e-4
  clip_norm: float | None = 1.0
  master_weights: str = "auto"

  def __post_init__(self):
    if not self.peak_lr > 0:
      raise ValueError(f"optimizer.peak_lr={self.peak_lr}; expected > 0")
    if self.schedule not in _SCHEDULES:
      raise ValueError(f"optimizer.schedule={self.schedule!r}; expected one of {_SCHEDULES}")
    if self.warmup_steps < 0 or self.decay_steps < 1:
      raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} / decay_steps={self.decay_steps} out of range")
    if not 0 <= self.end_lr_ratio <= 1:
      raise ValueError(f"optimizer.end_lr_ratio={self.end_lr_ratio}; expected [0, 1]")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      raise ValueError(f"optimizer.b1={self.b1}, b2={self.b2}; expected [0, 1)")
    if self.clip_norm is not None and self.clip_norm <= 0:
      raise ValueError(f"optimizer.clip_norm={self.clip_norm}; expected > 0 or None")
    if self.master_weights not in _MASTER_WEIGHTS:
      raise ValueError(f"optimizer.master_weights={self.master_weights!r}; expected one of {_MASTER_WEIGHTS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """Which network to train: a preset (fresh init) or a HF checkpoint directory (fine-tune).

  preset: a name in `hackable_diffusion.model.config.PRESETS` ('' when `checkpoint` is set; both unset: 'tiny').
  checkpoint: a HF DiffusionGemma directory or Hub id loaded with `hd.load_pretrained`, or a previous run's workdir
    ('' for a fresh init).
  dtype: parameter dtype when loading a checkpoint: 'auto' (the dtype it was saved in, bfloat16 for the released
    models), 'float32', 'bfloat16' or 'float16'.
  overrides: ModelConfig fields. For a fresh init, `vocab_size` defaults to the tokenizer's size.
  """

  preset: str = ""
  checkpoint: str = ""
  dtype: str = "auto"
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.preset and not self.checkpoint:
      object.__setattr__(self, "preset", "tiny")
    if self.preset and self.checkpoint:
      raise ConfigError(f"model: set exactly one of model.preset ({self.preset!r}) and model.checkpoint "
                        f"({self.checkpoint!r}); to fine-tune the checkpoint set model.preset=''")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(self.overrides) - fields)
    if unknown:
      raise ConfigError(f"model.overrides has unknown key(s) {unknown}; valid keys: {sorted(fields)}")
    if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
      raise ConfigError(f"model.dtype={self.dtype!r}; expected 'auto', 'float32', 'bfloat16' or 'float16'")
    if self.preset:
      check_preset_overrides(self.preset, self.overrides)


_TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")


def check_preset_overrides(preset: str, overrides: Mapping[str, Any]) -> None:
  """Raises the one-line ConfigError `get_preset(preset, **overrides)` would raise when the run builds its model,
  now (before any data is generated or read). The fields a fresh init takes from the tokenizer when unset
  (`vocab_size`, the special token ids) get placeholders that always fit; the run checks the real ones."""
  try:
    get_preset(preset)
  except ConfigError as e:
    raise ConfigError(f"model.preset: {e}") from None
  trial = dict(overrides)
  if "vocab_size" not in trial:  # the tokenizer's size, known later: every id fits for now
    trial["vocab_size"] = 1 << 30
  for name in _TOKENIZER_FIELDS[1:]:
    trial.setdefault(name, 0)
  try:
    get_preset(preset, **trial)
  except ConfigError as e:
    raise ConfigError(f"model.overrides: {e}") from None
  except (TypeError, ValueError) as e:
    raise ConfigError(f"model.overrides: {' '.join(str(e).split())}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSection:
  """path: 'auto' (default: 'checkpoint' when model.checkpoint is set, else 'train'), 'train' (train a
  SentencePiece model on the training data, saved as workdir/tokenizer.model), 'checkpoint' (the tokenizer of
  model.checkpoint: its tokenizer.json or tokenizer.model, tokenizer_config.json, chat_template.jinja,
  generation_config.json), or the path of a tokenizer.json / tokenizer.model (or a directory holding one).
  model_type / vocab_size: for 'train' ('char' needs no vocab_size)."""

  path: str = "auto"
  model_type: str = "char"
  vocab_size: int = 0

  def __post_init__(self):
    if not self.path:
      raise ConfigError("tokenizer.path is empty; use 'auto', 'train', 'checkpoint' or the path of a tokenizer.json "
                        "or tokenizer.model")
    if self.model_type not in ("char", "bpe", "unigram", "word"):
      raise ConfigError(f"tokenizer.model_type={self.model_type!r}; expected char, bpe, unigram or word")
    _positive_int("tokenizer", "vocab_size", self.vocab_size, allow_zero=True)
    if self.path == "train" and self.model_type != "char" and not self.vocab_size:
      raise ConfigError(f"tokenizer.vocab_size is required for tokenizer.model_type={self.model_type!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
  """SFT data: JSONL files with prompt/completion strings, or a built-in generator that writes them.

  generator: a task name (see `hackable_diffusion.tasks.base.BUILTIN_TASKS`) or 'module:factory' whose task writes
    train/validation JSONL into workdir/data ('' = use train_path / validation_path). With a generator, a
    train_path / validation_path that is set replaces the generated split of that name (e.g. evaluate a run on
    another file: --config.data.validation_path=FILE --config.eval.split=validation).
  generator_args: keyword arguments of that task.
  max_prompt_length / max_canvases: prompt tokens (left-padded) and completion canvases per example.
  pinned_field: '' or the JSON key of a '0'/'1' string marking completion tokens known at sampling time
    (infilling): never corrupted in training, pinned by the sampler in evaluation.
  max_images: images per example of chat records with image parts (-1: the most any record has; fewer are padded
    with empty images).
  image_processor: `ImageProcessorConfig` fields (data/images.py) that replace the run's image processor settings
    (the checkpoint's, else the released ones at the vision tower's patch and pooling sizes), e.g.
    `{'max_soft_tokens': 140, 'do_resize': False}` to feed pictures at their own size.
  """

  generator: str = ""
  generator_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  train_path: str = ""
  validation_path: str = ""
  prompt_field: str = "prompt"
  completion_field: str = "completion"
  messages_field: str = "messages"
  chat_template: str = ""
  max_prompt_length: int = 128
  max_canvases: int = 1
  add_bos: bool = False
  append_eos: bool = True
  on_overlength: str = "error"
  on_malformed: str = "error"
  shuffle: bool = True
  prefetch_batches: int = 2
  pinned_field: str = ""
  max_images: int = -1
  image_processor: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.generator and not self.train_path:
      raise ConfigError("data: set data.train_path (a JSONL file) or data.generator (a built-in task)")
    for name in ("max_prompt_length", "max_canvases"):
      _positive_int("data", name, getattr(self, name))
    _positive_int("data", "prefetch_batches", self.prefetch_batches, allow_zero=True)
    if not _is_int(self.max_images) or self.max_images < -1:
      raise ConfigError(f"data.max_images={self.max_images!r}; expected an integer >= 0, or -1 (the most images of "
                        "any record)")
    if self.on_overlength not in ("error", "truncate"):
      raise ConfigError(f"data.on_overlength={self.on_overlength!r}; expected 'error' or 'truncate'")
    if self.on_malformed not in ("error", "skip"):
      raise ConfigError(f"data.on_malformed={self.on_malformed!r}; expected 'error' or 'skip'")
    if self.chat_template and chat_template_kind(self.chat_template) == "format" and \
        "{prompt}" not in self.chat_template:
      raise ConfigError(f"data.chat_template={self.chat_template!r} must contain '{{prompt}}', be a jinja chat "
                        f"template, or be 'tokenizer' (the tokenizer's chat template)")


TASK_CHAT_TEMPLATE = "task"  # data.chat_template: the data generator's task's template (`Task.chat_template`)


def task_chat_template(data: Mapping[str, Any]) -> str:
  """The chat template of the task `data['generator']` (built with `generator_args`) for
  `data.chat_template='task'`; a one-line `ConfigError` without a generator or when its task has none."""
  generator = data.get("generator") or ""
  if not generator:
    raise ConfigError("data.chat_template='task' needs data.generator (the task whose prompt template it is)")
  template = task_lib.chat_template(task_lib.get_task(generator, dict(data.get("generator_args") or {})))
  if not template:
    raise ConfigError(f"data.chat_template='task': task {generator!r} has no chat template")
  return template


# train.train_vision -> the vision modules training keeps unchanged
VISION_TRAINING = types.MappingProxyType({"none": ("vision_tower", "embed_vision"), "projector": ("vision_tower",),
                                          "all": ()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSection:
  """The loop. Intervals count optimizer steps; 0 disables periodic evaluation (it still runs at the end).

  freeze_router: keep every MoE router (its projection, scale and per-expert scales) as it is. 'auto': frozen when
  fine-tuning a pretrained checkpoint in full (`model.checkpoint` set, no `lora`), trained from a fresh init (a
  random router must learn). A few thousand SFT steps on a narrow dataset move a pretrained router's top-k choice
  for every token and can leave experts idle; the experts themselves still adapt. True / False force it.
  train_vision: what of a model's vision tower trains: 'none' (default: the tower and its projection into the text
  model, `embed_vision`, keep their weights), 'projector' (`embed_vision` only) or 'all' (both); 'projector' and
  'all' need full fine-tuning (LoRA adapts the tower only where `lora.target_modules` names it, docs/lora.md).
  """

  steps: int = 1000
  batch_size: int = 8
  grad_accum_steps: int = 1
  seed: int = 0
  log_every: int = 50
  checkpoint_every: int = 500
  keep_checkpoints: int = 3
  eval_every: int = 0
  eval_at_end: bool = True
  async_checkpointing: bool = True
  freeze_router: bool | str = "auto"
  train_vision: str = "none"

  def __post_init__(self):
    if not (self.freeze_router == "auto" or isinstance(self.freeze_router, bool)):
      raise ConfigError(f"train.freeze_router={self.freeze_router!r}; expected 'auto', True or False")
    if self.train_vision not in VISION_TRAINING:
      raise ConfigError(f"train.train_vision={self.train_vision!r}; expected one of {', '.join(VISION_TRAINING)}")
    for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "checkpoint_every", "keep_checkpoints"):
      _positive_int("train", name, getattr(self, name))
    _positive_int("train", "eval_every", self.eval_every, allow_zero=True)
    if not _is_int(self.seed):
      raise ConfigError(f"train.seed={self.seed!r}; expected an integer")
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by "
                        f"train.grad_accum_steps={self.grad_accum_steps}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
  """Generation-based evaluation: one run per step budget (early stopping off) and one with early stopping.

  task: a task name (`tasks.BUILTIN_TASKS`) or 'package.module:factory' ('' = the data generator's task,
    else 'text': exact match and character accuracy). task_args: its keyword arguments ('' task with a data
    generator reuses generator_args).
  split: 'validation', 'test' (generated data) or 'train'. num_examples: examples evaluated (the first ones).
  batch_size: examples per `generate` call; on a mesh each batch is padded to a multiple of its batch shards
    (data x fsdp x expert) and split over them (same tokens as one device).
  step_budgets: one run per budget with `max_denoising_steps=N`, early stopping off. early_stopping_steps: the step
    cap of the early-stopping run. max_new_tokens: 0 = the data's completion capacity (max_canvases * canvas).
  sampling: the sampler of every run (`SamplingConfig`: entropy_bound, t_min, t_max, stability_threshold,
    confidence_threshold, acceptance, ...); each run sets its own max_denoising_steps / early_stopping /
    max_new_tokens from the keys above.
  ablations: name -> task-argument overrides, each evaluated once at `ablation_steps` (fixed steps; 0 turns
    them off), e.g. `{'no_pins': {'pin_givens': False}}` reports a puzzle task without pinning its givens.
  checker: the sampler re-noises what the task's checker flags (`tasks.base.checker`; off by default), with the
    options `sampling.checker_confidence` / `checker_forget` / `checker_restarts` / `checker_step_budget` (which
    need it).
  samples_per_prompt: tries per example (1: one); each further try samples only the examples whose earlier tries
    the task's checker rejects, and the first valid try is kept (needs a task with a checker).
  """

  task: str = ""
  task_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  split: str = "validation"
  num_examples: int = 128
  batch_size: int = 64
  step_budgets: tuple[int, ...] = (32, 64, 96)
  early_stopping_steps: int = 96
  max_new_tokens: int = 0
  seed: int = 0
  num_samples: int = 8
  ablation_steps: int = 0
  ablations: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  sampling: SamplingConfig = SamplingConfig()
  checker: bool = False
  samples_per_prompt: int = 1

  def __post_init__(self):
    object.__setattr__(self, "step_budgets", tuple(self.step_budgets))
    if not isinstance(self.sampling, SamplingConfig):
      raise ConfigError(f"eval.sampling={self.sampling!r}; expected a SamplingConfig")
    for name, args in self.ablations.items():
      if not hasattr(args, "items"):
        raise ConfigError(f"eval.ablations.{name}={args!r}; expected a mapping of task arguments to override")
    if not (_is_int(self.ablation_steps) and self.ablation_steps >= 0):
      raise ConfigError(f"eval.ablation_steps={self.ablation_steps!r}; expected an integer >= 0 (0: no ablation runs)")
    for name in ("num_examples", "batch_size", "early_stopping_steps", "samples_per_prompt"):
      _positive_int("eval", name, getattr(self, name))
    if not isinstance(self.checker, bool):
      raise ConfigError(f"eval.checker={self.checker!r}; expected a bool")
    if self.sampling.uses_checker and not self.checker:
      raise ConfigError("eval.sampling.checker_* options need eval.checker=True (the task's checker in the "
                        "sampler)")
    for name in ("max_new_tokens", "num_samples"):
      _positive_int("eval", name, getattr(self, name), allow_zero=True)
    if not _is_int(self.seed):
      raise ConfigError(f"eval.seed={self.seed!r}; expected an integer")
    if not self.step_budgets or not all(_is_int(b) and b > 0 for b in self.step_budgets):
      raise ConfigError(f"eval.step_budgets={self.step_budgets!r}; expected positive integers")
    if self.split not in ("validation", "train", "test"):
      raise ConfigError(f"eval.split={self.split!r}; expected 'validation', 'test' (generated data) or 'train'")


def mesh_requested(mesh: MeshConfig) -> bool:
  """Whether a `mesh` section asks for a device mesh (any axis other than 1) or for a multi-host job."""
  return (any(getattr(mesh, a) != 1 for a in MESH_AXES) or mesh.coordinator_address is not None
          or (mesh.num_processes or 1) > 1 or mesh.auto_distributed)


# `mesh` section defaults: one device (a missing section must not spread a run over every visible device).
_MESH_DEFAULTS = {"data": 1}
# keys of the `lora` section that are not `LoraConfig` fields
_LORA_SWITCHES = ("enabled", "seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """Every section of an experiment, typed and validated. `raw` is the resolved config as a plain dict.

  lora: the adapters' `LoraConfig`, or None for full fine-tuning (`lora.enabled=False`); lora_seed: the seed of
  the adapters' initialisation (`lora.seed`). trust_remote_code: whether the run directories this config points at
  (`model.checkpoint` = a run) may name components by 'module:attribute' in their config.json (see `specs`); the
  config itself is trusted (it comes from a config file or from Python), and this flag is not part of `raw`.
  """

  model: ModelSection
  tokenizer: TokenizerSection
  data: DataSection
  diffusion: LossConfig
  optimizer: OptimizerConfig
  train: TrainSection
  eval: EvalSection
  lora: LoraConfig | None = None
  lora_seed: int = 0
  mesh: MeshConfig = MeshConfig(data=1)
  raw: Mapping[str, Any]
  trust_remote_code: bool = False

  def __post_init__(self):
    if self.lora is not None and self.train.train_vision != "none":
      raise ConfigError(f"train.train_vision={self.train.train_vision!r} needs full fine-tuning (lora.enabled="
                        "False); with LoRA, adapt the tower through lora.target_modules (e.g. 'vision_tower', "
                        "'embed_vision')")

  @property
  def frozen_modules(self) -> tuple[str, ...]:
    """Module names whose trainable variables training keeps unchanged: 'router' (`train.freeze_router`), then the
    vision modules `train.train_vision` leaves frozen (names no text model has). With LoRA only the adapters train,
    and the tower has adapters only where `lora.target_modules` names it: no vision module is held back."""
    freeze = self.train.freeze_router
    if freeze == "auto":
      freeze = bool(self.model.checkpoint) and self.lora is None
    vision = VISION_TRAINING[self.train.train_vision] if self.lora is None else ()
    return ("router",) * bool(freeze) + vision

  @classmethod
  def from_config_dict(cls, config: ml_collections.ConfigDict | Mapping[str, Any], *,
                       trust_remote_code: bool = False) -> ExperimentConfig:
    raw = config_to_dict(config)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
      raise ConfigError(f"unknown config section(s) {unknown}; valid sections: {list(SECTIONS)}")
    sec = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    diffusion = {("variant" if k == "loss_variant" else k): v for k, v in sec["diffusion"].items()}
    ev = dict(sec["eval"])
    sampling = ev.pop("sampling", None) or {}
    if not isinstance(sampling, Mapping):
      raise ConfigError(f"eval.sampling={sampling!r}; expected a section of SamplingConfig fields")
    ev["sampling"] = _build(SamplingConfig, "eval.sampling", dict(sampling))
    lora_values = dict(sec["lora"])
    enabled = lora_values.pop("enabled", False)
    lora_seed = lora_values.pop("seed", 0)
    if not isinstance(enabled, bool):
      raise ConfigError(f"lora.enabled={enabled!r}; expected a bool")
    if not _is_int(lora_seed):
      raise ConfigError(f"lora.seed={lora_seed!r}; expected an integer")
    if isinstance(lora_values.get("target_modules"), list):
      lora_values["target_modules"] = tuple(lora_values["target_modules"])
    lora = _build(LoraConfig, "lora", lora_values, extra=_LORA_SWITCHES)  # validated even when disabled
    train = _build(TrainSection, "train", sec["train"])
    optimizer = dict(sec["optimizer"])
    if optimizer.get("decay_steps", 0) == 0:  # 0 or unset: the schedule spans the run
      optimizer["decay_steps"] = train.steps
    if sec["data"].get("chat_template") == TASK_CHAT_TEMPLATE:
      sec["data"]["chat_template"] = task_chat_template(sec["data"])
    return cls(
        model=_build(ModelSection, "model", sec["model"]),
        tokenizer=_build(TokenizerSection, "tokenizer", sec["tokenizer"]),
        data=_build(DataSection, "data", sec["data"]),
        diffusion=_build(LossConfig, "diffusion", diffusion, rename={"variant": "loss_variant"}),
        optimizer=_build(OptimizerConfig, "optimizer", optimizer),
        train=train,
        eval=_build(EvalSection, "eval", ev, extra=("sampling",)),
        lora=lora if enabled else None,
        lora_seed=lora_seed,
        mesh=_build(MeshConfig, "mesh", {**_MESH_DEFAULTS, **sec["mesh"]}),
        raw=raw,
        trust_remote_code=bool(trust_remote_code),
    )


def _build(cls: type, section: str, values: dict[str, Any], rename: Mapping[str, str] | None = None,
           extra: Sequence[str] = ()):
  """`cls(**values)` with unknown keys and the class's own validation errors as one-line `ConfigError`s."""
  rename = rename or {}
  fields = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(values) - set(fields))
  if unknown:
    valid = sorted({rename.get(f, f) for f in fields} | set(extra))
    raise ConfigError(f"unknown key(s) {[f'{section}.{k}' for k in unknown]}; valid keys of {section!r}: "
                      f"{', '.join(valid)}")
  try:
    return cls(**values)
  except (ValueError, TypeError) as e:
    msg = " ".join(str(e).split()) or type(e).__name__
    if msg.startswith(f"{cls.__name__}."):  # "SamplingConfig.t_min=..." -> "eval.sampling.t_min=..."
      msg = f"{section}.{msg[len(cls.__name__) + 1:]}"
    raise ConfigError(msg if msg.startswith((f"{section}.", f"{section}:")) else f"{section}: {msg}") from None


__all__ = [
    "CONFIG_FILENAME", "CONFIGS_DIR", "ConfigError", "DataSection", "EvalSection", "ExperimentConfig", "ModelSection",
    "OptimizerConfig",
    "SECTIONS", "TokenizerSection", "TrainSection", "TrainingError", "apply_overrides", "check_config_source",
    "check_override_keys", "config_file_error", "config_from_json", "config_to_dict", "load_config_file",
    "mesh_requested", "resolve_config_path", "write_config_json",
]
