"""`SFTConfig`: the flat, validated settings of `hd.SFTTrainer`, mapped onto the experiment config of the CLI.

TRL/transformers users know these names (`max_steps`, `num_train_epochs`, `per_device_train_batch_size`,
`learning_rate`, `warmup_steps`, `gradient_accumulation_steps`, `report_to`, ...). `SFTConfig.experiment_sections()`
turns them into the sections of `runs/config.py` (the same dict a config file produces), so the Python API and
`python -m hackable_diffusion.train` run one trainer on one config format.

One source of truth for defaults: a field that is a section key (`SECTION_KEYS`) takes that section's typed default
(`runs/config.py`); the few that differ on purpose are listed, with the reason, in `DIFFERENT_DEFAULTS`
(tests/training/test_sft_api.py checks both). They remove the traps of writing the nested config by hand: the
learning-rate schedule lasts the run (warmup included), `add_bos=None` follows the tokenizer, and the tokenizer is
the checkpoint's (or, for a fresh init, a character model trained on the data).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.data.chat import chat_template_kind
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora.adapters import LoraConfig
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.runs.config import (VISION_TRAINING, DataSection, EvalSection, ModelSection, OptimizerConfig,
                                           TrainSection)
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sharding.mesh import MESH_AXES, MeshConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SCHEDULES = ("cosine", "linear", "constant")
_MASTER = ("auto", "float32", "off")
REPORTS = ("tensorboard", "none", "wandb")


def _defaults(cls: type) -> dict[str, Any]:
  """The typed defaults of a config section's dataclass (a default_factory called)."""
  out = {}
  for f in dataclasses.fields(cls):
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
  return out


_SECTION_CLASSES = {"model": ModelSection, "data": DataSection, "optimizer": OptimizerConfig, "train": TrainSection,
                    "eval": EvalSection}
_D = {name: _defaults(cls) for name, cls in _SECTION_CLASSES.items()}

# SFTConfig field -> the (section, key) of runs/config.py it sets; `key` None: the field is the whole section
SECTION_KEYS: dict[str, tuple[str, str | None]] = {
    "max_steps": ("train", "steps"), "batch_size": ("train", "batch_size"),
    "gradient_accumulation_steps": ("train", "grad_accum_steps"), "seed": ("train", "seed"),
    "logging_steps": ("train", "log_every"), "save_steps": ("train", "checkpoint_every"),
    "save_total_limit": ("train", "keep_checkpoints"), "eval_steps": ("train", "eval_every"),
    "eval_at_end": ("train", "eval_at_end"), "freeze_router": ("train", "freeze_router"),
    "learning_rate": ("optimizer", "peak_lr"), "lr_scheduler_type": ("optimizer", "schedule"),
    "warmup_steps": ("optimizer", "warmup_steps"), "end_lr_ratio": ("optimizer", "end_lr_ratio"),
    "weight_decay": ("optimizer", "weight_decay"), "adam_beta1": ("optimizer", "b1"),
    "adam_beta2": ("optimizer", "b2"), "max_grad_norm": ("optimizer", "clip_norm"),
    "master_weights": ("optimizer", "master_weights"),
    "dtype": ("model", "dtype"), "model_overrides": ("model", "overrides"), "tokenizer": ("tokenizer", "path"),
    "add_bos": ("data", "add_bos"), "prompt_field": ("data", "prompt_field"),
    "completion_field": ("data", "completion_field"), "messages_field": ("data", "messages_field"),
    "chat_template": ("data", "chat_template"), "max_prompt_length": ("data", "max_prompt_length"),
    "max_canvases": ("data", "max_canvases"), "max_images": ("data", "max_images"),
    "train_vision": ("train", "train_vision"),
    "eval_num_examples": ("eval", "num_examples"), "eval_batch_size": ("eval", "batch_size"),
    "eval_step_budgets": ("eval", "step_budgets"), "eval_max_steps": ("eval", "early_stopping_steps"),
    "sampling": ("eval", "sampling"), "loss": ("diffusion", None), "mesh": ("mesh", None),
    "lora_seed": ("lora", "seed"),
}
# Fields whose default differs from their section's on purpose, and why.
DIFFERENT_DEFAULTS: dict[str, str] = {
    "warmup_steps": "None = 5% of the run's steps, at most 100: the section's fixed 100 is the recipe's warmup for "
                    "its 2,000 steps, and a short Python run would be mostly warmup",
    "add_bos": "None = from the tokenizer: a bos token when it has one and the model is a pretrained checkpoint",
    "tokenizer": "'' = the checkpoint's tokenizer, or a character model trained on the data for a fresh init (what "
                 "the section's 'auto' picks); otherwise a tokenizer file or directory",
    "eval_batch_size": "None = the training micro-batch (batch_size / gradient_accumulation_steps), at most the "
                       "section's 64: a batch the memory plan already fits (sampling holds no gradients), where the "
                       "section's fixed 64 runs a 26B model out of memory",
}
# TRL/transformers settings this trainer has no counterpart for, with the one-line reason / what to use instead
UNSUPPORTED: dict[str, str] = {
    "bf16": "use dtype='bfloat16' (the parameter dtype; 'auto' keeps the checkpoint's)",
    "fp16": "use dtype='float16'", "tf32": "not applicable (XLA picks matmul precision)",
    "packing": "not supported: an example is one prompt and its completion canvases",
    "dataset_text_field": "use prompt_field / completion_field (or messages_field for chat records)",
    "completion_only_loss": "always on: the loss is on the completion canvases",
    "assistant_only_loss": "always on for chat records: the loss is on the final assistant turn",
    "per_device_eval_batch_size": "use eval_batch_size (the evaluation batch of the whole mesh)",
    "optim": "the optimizer is AdamW (adam_beta1 / adam_beta2 / weight_decay)",
    "gradient_checkpointing": "use model_overrides={'remat': 'nothing_saveable'}",
    "eval_strategy": "use eval_steps (0: only at the end)", "save_strategy": "use save_steps",
    "logging_strategy": "use logging_steps", "push_to_hub": "not supported: export() and upload the folder",
    "resume_from_checkpoint": "a rerun with the same output_dir resumes from its latest checkpoint",
    "dataloader_num_workers": "not applicable (grain reads the JSONL in the training process)",
}


def _int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _KnownKeywords(type):
  """Unknown keyword arguments of `SFTConfig(...)` are one-line ConfigErrors (with the TRL name's counterpart)."""

  def __call__(cls, *args: Any, **kwargs: Any) -> Any:
    if args:
      raise ConfigError("SFTConfig takes keyword arguments only, e.g. SFTConfig(max_steps=100)")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in kwargs:
      if key not in names:
        raise ConfigError(unknown_setting_error("SFTConfig", key, names))
    return super().__call__(**kwargs)


def unknown_setting_error(where: str, key: str, names: list[str]) -> str:
  """The one-line message for an unknown setting `key` of `where` (valid: `names`)."""
  if key in UNSUPPORTED:
    return f"{where}: {key} is not supported: {UNSUPPORTED[key]}"
  close = difflib.get_close_matches(key, names, n=3)
  hint = f"; did you mean {', '.join(close)}?" if close else "; see help(hd.SFTConfig) for the settings"
  return f"{where}: unknown setting {key!r}{hint}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(metaclass=_KnownKeywords):
  """Settings of a supervised fine-tuning run (`hd.SFTTrainer(..., args=SFTConfig(...))`).

  output_dir: the run directory (checkpoints, metrics, eval reports; a rerun resumes from it).
  max_steps: optimizer steps (None: from num_train_epochs, else the train section's default). num_train_epochs:
    steps = ceil(epochs * records / global batch), used only when max_steps is None (max_steps wins, as in
    transformers); resolved by `hd.SFTTrainer`, which knows the records (`with_num_records`).
  batch_size: the global batch of one optimizer step (split over the mesh's batch axes and into
    gradient_accumulation_steps micro-batches). per_device_train_batch_size: transformers' form, batch_size =
    per_device_train_batch_size x batch devices (mesh data x fsdp x expert) x gradient_accumulation_steps.
  learning_rate (peak), lr_scheduler_type ('cosine', 'linear', 'constant'), warmup_steps (None: 5% of max_steps,
    at most 100), end_lr_ratio (final lr = learning_rate * end_lr_ratio), weight_decay, adam_beta1/2,
    max_grad_norm (None: no clipping): the schedule spans `max_steps`.
  lora: a `LoraConfig` (train adapters only) or None (full fine-tuning); lora_seed: the adapters' init seed.
  dtype: parameter dtype when loading a checkpoint ('auto' = the checkpoint's own); master_weights: float32
    masters of a bf16 model's trainable weights ('auto': on for full fine-tuning).
  tokenizer: '' = the checkpoint's tokenizer files (a fresh init: a character model trained on the data), or a
    tokenizer file/directory. add_bos: None = from the tokenizer.
  prompt_field / completion_field: the keys of prompt/completion records; messages_field: the key of chat records
    (`[{"role": ..., "content": ...}, ...]`, the loss on the final assistant turn); chat_template: '', a format
    string with {prompt}, a jinja template, or 'tokenizer' (the checkpoint's own);
    max_prompt_length (tokens) / max_canvases (completion canvases per example). max_length: transformers' total
    budget (prompt + completion tokens): `hd.SFTTrainer` keeps max_canvases and sets max_prompt_length =
    max_length - max_canvases x the model's canvas_length (giving max_prompt_length too is an error).
  logging_steps, save_steps, save_total_limit: logging and checkpoint intervals / checkpoints kept.
  report_to: 'tensorboard' (TensorBoard events beside metrics.jsonl), 'none' (metrics.jsonl only), 'wandb'
    (also Weights & Biases, when wandb is installed), or a list of them.
  eval_steps: evaluate every N steps (0: only at the end, when `eval_at_end`); eval_num_examples, eval_batch_size
    (None: the training micro-batch, at most 64), eval_step_budgets (one fixed-steps run each), eval_max_steps (the
    early-stopping run's cap), sampling (the evaluation sampler).
  loss: the diffusion objective (`LossConfig`); mesh: the device mesh (`MeshConfig`; default one device);
  model_overrides: `ModelConfig` fields changed on top of the model (e.g. {'remat': 'nothing_saveable'}).
  seed: init, data order and noise. freeze_router: keep the MoE routers as loaded ('auto': when fine-tuning a
  checkpoint in full; True / False force it).
  max_images: images per example of chat records with image parts (-1: the most any record has). train_vision: what
  of the vision tower trains: 'none' (frozen), 'projector' or 'all' (full fine-tuning only).
  Settings of TRL's SFTConfig without a counterpart (`UNSUPPORTED`) and unknown names are one-line ConfigErrors.
  """

  output_dir: str = "runs/sft"
  max_steps: int | None = None
  num_train_epochs: float | None = None
  learning_rate: float = _D["optimizer"]["peak_lr"]
  lr_scheduler_type: str = _D["optimizer"]["schedule"]
  warmup_steps: int | None = None  # DIFFERENT_DEFAULTS
  end_lr_ratio: float = _D["optimizer"]["end_lr_ratio"]
  weight_decay: float = _D["optimizer"]["weight_decay"]
  adam_beta1: float = _D["optimizer"]["b1"]
  adam_beta2: float = _D["optimizer"]["b2"]
  max_grad_norm: float | None = _D["optimizer"]["clip_norm"]
  batch_size: int | None = None  # None: per_device_train_batch_size's, else the train section's
  per_device_train_batch_size: int | None = None
  gradient_accumulation_steps: int = _D["train"]["grad_accum_steps"]
  seed: int = _D["train"]["seed"]
  lora: LoraConfig | None = None
  lora_seed: int = 0  # the lora section's `seed` (not a dataclass field there)
  dtype: str = _D["model"]["dtype"]
  master_weights: str = _D["optimizer"]["master_weights"]
  tokenizer: str = ""  # DIFFERENT_DEFAULTS
  add_bos: bool | None = None  # DIFFERENT_DEFAULTS
  prompt_field: str = _D["data"]["prompt_field"]
  completion_field: str = _D["data"]["completion_field"]
  messages_field: str = _D["data"]["messages_field"]
  chat_template: str = _D["data"]["chat_template"]
  max_prompt_length: int = _D["data"]["max_prompt_length"]
  max_canvases: int = _D["data"]["max_canvases"]
  max_images: int = _D["data"]["max_images"]
  max_length: int | None = None
  logging_steps: int = _D["train"]["log_every"]
  save_steps: int = _D["train"]["checkpoint_every"]
  save_total_limit: int = _D["train"]["keep_checkpoints"]
  report_to: str | tuple[str, ...] = "tensorboard"
  eval_steps: int = _D["train"]["eval_every"]
  eval_at_end: bool = _D["train"]["eval_at_end"]
  freeze_router: bool | str = _D["train"]["freeze_router"]
  train_vision: str = _D["train"]["train_vision"]
  eval_num_examples: int = _D["eval"]["num_examples"]
  eval_batch_size: int | None = None  # DIFFERENT_DEFAULTS
  eval_step_budgets: tuple[int, ...] = _D["eval"]["step_budgets"]
  eval_max_steps: int = _D["eval"]["early_stopping_steps"]
  sampling: SamplingConfig = _D["eval"]["sampling"]
  loss: LossConfig = LossConfig()
  mesh: MeshConfig = MeshConfig(data=1)  # the mesh section's default: one device
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "eval_step_budgets", tuple(self.eval_step_budgets)
                       if isinstance(self.eval_step_budgets, (list, tuple)) else self.eval_step_budgets)
    if isinstance(self.report_to, (list, tuple)):
      object.__setattr__(self, "report_to", tuple(self.report_to))
    for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
      problem = _problem(name, value)
      if problem:
        raise ConfigError(f"SFTConfig.{name}={_short(value)}: {problem}")
    derived = set()  # fields computed here from others: `replace` derives them again
    if self.max_steps is None and self.num_train_epochs is None:
      object.__setattr__(self, "max_steps", _D["train"]["steps"])
      derived.add("max_steps")
    if self.warmup_steps is None and self.max_steps is not None:
      object.__setattr__(self, "warmup_steps", min(100, self.max_steps // 20))
      derived.add("warmup_steps")
    if self.max_steps is not None and self.warmup_steps is not None and self.warmup_steps > self.max_steps:
      raise ConfigError(f"SFTConfig.warmup_steps={self.warmup_steps}: longer than max_steps={self.max_steps}")
    if self.per_device_train_batch_size is not None:
      devices = batch_devices(self.mesh)
      implied = self.per_device_train_batch_size * devices * self.gradient_accumulation_steps
      if self.batch_size is not None and self.batch_size != implied:
        raise ConfigError(f"SFTConfig.batch_size={self.batch_size}: per_device_train_batch_size="
                          f"{self.per_device_train_batch_size} x {devices} device(s) x gradient_accumulation_steps="
                          f"{self.gradient_accumulation_steps} is {implied}; give one of the two")
      object.__setattr__(self, "batch_size", implied)
      derived.add("batch_size")
    elif self.batch_size is None:
      object.__setattr__(self, "batch_size", _D["train"]["batch_size"])
      derived.add("batch_size")
    if self.batch_size % self.gradient_accumulation_steps:
      raise ConfigError(f"SFTConfig.gradient_accumulation_steps={self.gradient_accumulation_steps}: does not divide "
                        f"batch_size={self.batch_size}")
    if self.eval_batch_size is None:
      micro = self.batch_size // self.gradient_accumulation_steps
      object.__setattr__(self, "eval_batch_size", max(1, min(micro, _D["eval"]["batch_size"])))
      derived.add("eval_batch_size")
    object.__setattr__(self, "_derived", frozenset(derived))
    if self.max_length is not None and self.max_prompt_length != _D["data"]["max_prompt_length"]:
      raise ConfigError(f"SFTConfig.max_length={self.max_length}: give max_length (prompt + completion tokens) or "
                        f"max_prompt_length={self.max_prompt_length}, not both")

  def replace(self, **changes: Any) -> SFTConfig:
    """A copy with `changes`; the fields this config derived (max_steps, warmup_steps, batch_size, eval_batch_size
    left unset) are derived again from the new values."""
    return dataclasses.replace(self, **{**{k: None for k in self._derived}, **changes})

  @property
  def tensorboard(self) -> bool:
    """Whether TensorBoard events are written (`report_to`)."""
    return "tensorboard" in _reports(self.report_to)

  @property
  def wandb(self) -> bool:
    return "wandb" in _reports(self.report_to)

  def with_num_records(self, num_records: int) -> SFTConfig:
    """The config with max_steps resolved from num_train_epochs for a training set of `num_records` records
    (itself when max_steps is set)."""
    if self.max_steps is not None:
      return self
    steps = max(1, math.ceil(self.num_train_epochs * num_records / self.batch_size))
    return self.replace(max_steps=steps)

  def with_canvas_length(self, canvas_length: int) -> SFTConfig:
    """The config with max_prompt_length resolved from max_length for a model of `canvas_length` (itself when
    max_length is None)."""
    if self.max_length is None:
      return self
    prompt = self.max_length - self.max_canvases * canvas_length
    if prompt < 1:
      raise ConfigError(f"SFTConfig.max_length={self.max_length}: leaves no prompt tokens after max_canvases="
                        f"{self.max_canvases} canvas(es) of {canvas_length} tokens; raise it or lower max_canvases")
    return self.replace(max_length=None, max_prompt_length=prompt)

  def experiment_sections(self) -> dict[str, Any]:
    """The config sections of `runs/config.py` these settings mean, except `model`, `tokenizer.path`,
    `data`'s paths and `eval.task` (which depend on the trainer's model, data and task arguments)."""
    if self.max_steps is None:
      raise ConfigError(f"SFTConfig.num_train_epochs={self.num_train_epochs}: the step count needs the number of "
                        "records (hd.SFTTrainer resolves it; or give max_steps)")
    if self.max_length is not None:
      raise ConfigError(f"SFTConfig.max_length={self.max_length}: the prompt budget needs the model's canvas length "
                        "(hd.SFTTrainer resolves it; or give max_prompt_length)")
    lora = {"enabled": False} if self.lora is None else {"enabled": True, "seed": self.lora_seed,
                                                        **dataclasses.asdict(self.lora)}
    return {
        "tokenizer": {"model_type": "char", "vocab_size": 0},
        "data": {"prompt_field": self.prompt_field, "completion_field": self.completion_field,
                 "messages_field": self.messages_field,
                 "chat_template": self.chat_template, "max_prompt_length": self.max_prompt_length,
                 "max_canvases": self.max_canvases, "max_images": self.max_images},
        "diffusion": dataclasses.asdict(self.loss),
        "optimizer": {"peak_lr": float(self.learning_rate), "end_lr_ratio": float(self.end_lr_ratio),
                      "warmup_steps": self.warmup_steps, "decay_steps": self.max_steps,
                      "schedule": self.lr_scheduler_type, "b1": float(self.adam_beta1), "b2": float(self.adam_beta2),
                      "weight_decay": float(self.weight_decay),
                      "clip_norm": None if self.max_grad_norm is None else float(self.max_grad_norm),
                      "master_weights": self.master_weights},
        "train": {"steps": self.max_steps, "batch_size": self.batch_size,
                  "grad_accum_steps": self.gradient_accumulation_steps, "seed": self.seed,
                  "log_every": self.logging_steps, "checkpoint_every": self.save_steps,
                  "keep_checkpoints": self.save_total_limit, "eval_every": self.eval_steps,
                  "eval_at_end": self.eval_at_end, "freeze_router": self.freeze_router,
                  "train_vision": self.train_vision},
        "eval": {"num_examples": self.eval_num_examples, "batch_size": self.eval_batch_size,
                 "step_budgets": self.eval_step_budgets, "early_stopping_steps": self.eval_max_steps,
                 "seed": self.seed, "sampling": _sampling_dict(self.sampling)},
        "lora": lora,
        "mesh": dataclasses.asdict(self.mesh),
    }


def batch_devices(mesh: MeshConfig) -> int:
  """The devices a global batch is split over: the mesh's data x fsdp x expert axes (-1: the devices left)."""
  sizes = {a: getattr(mesh, a) for a in MESH_AXES}
  if -1 in sizes.values():
    import jax  # local: only a mesh with a -1 axis needs the device count

    known = math.prod(v for v in sizes.values() if v != -1)
    sizes = {a: (jax.device_count() // known if v == -1 else v) for a, v in sizes.items()}
  return math.prod(sizes[a] for a in ("data", "fsdp", "expert") if a in sizes)


def _reports(value: str | tuple[str, ...]) -> tuple[str, ...]:
  return (value,) if isinstance(value, str) else tuple(value)


def _sampling_dict(sampling: SamplingConfig) -> dict[str, Any]:
  """The evaluation sampler as config keys (each evaluation run sets its own steps / early stopping / length)."""
  out = dataclasses.asdict(sampling)
  for per_run in ("max_new_tokens", "max_denoising_steps", "early_stopping"):
    out.pop(per_run, None)
  return out


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _positive(v: Any) -> str | None:
  return None if _int(v) and v >= 1 else "expected an integer >= 1"


def _non_negative(v: Any) -> str | None:
  return None if _int(v) and v >= 0 else "expected an integer >= 0"


def _problem(name: str, v: Any) -> str | None:
  """Why `v` is not a valid value of SFTConfig field `name` (None: it is)."""
  if name in ("gradient_accumulation_steps", "max_prompt_length", "max_canvases",
              "logging_steps", "save_steps", "save_total_limit", "eval_num_examples", "eval_max_steps"):
    return _positive(v)
  if name in ("max_steps", "batch_size", "per_device_train_batch_size", "max_length", "eval_batch_size"):
    return None if v is None else _positive(v)
  if name == "num_train_epochs":
    return None if v is None or (_num(v) and v > 0) else "expected a number of epochs > 0 (or None: max_steps)"
  if name == "report_to":
    reports = _reports(v) if isinstance(v, (str, tuple)) else None
    if not reports or any(r not in REPORTS for r in reports):
      return f"expected one of {REPORTS} or a list of them"
    if "none" in reports and len(reports) > 1:
      return "'none' goes alone"
    if "wandb" in reports and importlib.util.find_spec("wandb") is None:
      return "wandb is not installed (pip install wandb), use 'tensorboard' or 'none'"
    return None
  if name == "warmup_steps":
    return None if v is None else _non_negative(v)
  if name == "eval_steps":
    return _non_negative(v)
  if name in ("seed", "lora_seed"):
    return None if _int(v) else "expected an integer"
  if name == "learning_rate":
    return None if _num(v) and v > 0 else "expected a number > 0"
  if name in ("end_lr_ratio", "weight_decay"):
    return None if _num(v) and v >= 0 and (name != "end_lr_ratio" or v <= 1) else (
        "expected a number in [0, 1]" if name == "end_lr_ratio" else "expected a number >= 0")
  if name in ("adam_beta1", "adam_beta2"):
    return None if _num(v) and 0 <= v < 1 else "expected a number in [0, 1)"
  if name == "max_grad_norm":
    return None if v is None or (_num(v) and v > 0) else "expected a number > 0 or None (no clipping)"
  if name == "lr_scheduler_type":
    return None if v in _SCHEDULES else f"expected one of {_SCHEDULES}"
  if name == "dtype":
    return None if v in _DTYPES else f"expected one of {_DTYPES}"
  if name == "master_weights":
    return None if v in _MASTER else f"expected one of {_MASTER}"
  if name == "output_dir":
    return None if isinstance(v, str) and v else "expected a non-empty directory path"
  if name in ("tokenizer", "chat_template"):
    if not isinstance(v, str):
      return "expected a string"
    if name == "chat_template" and v and chat_template_kind(v) == "format" and "{prompt}" not in v:
      return "expected a format string with {prompt}, a jinja chat template, or 'tokenizer'"
    return None
  if name in ("prompt_field", "completion_field", "messages_field"):
    return None if isinstance(v, str) and v else "expected a non-empty record key"
  if name in ("add_bos",):
    return None if v is None or isinstance(v, bool) else "expected True, False or None (from the tokenizer)"
  if name == "eval_at_end":
    return None if isinstance(v, bool) else "expected a bool"
  if name == "freeze_router":
    return None if v == "auto" or isinstance(v, bool) else "expected 'auto', True or False"
  if name == "max_images":
    return None if _int(v) and v >= -1 else "expected an integer >= 0, or -1 (the most images of any record)"
  if name == "train_vision":
    return None if v in VISION_TRAINING else f"expected one of {', '.join(VISION_TRAINING)}"
  if name == "eval_step_budgets":
    return None if isinstance(v, tuple) and v and all(_int(b) and b > 0 for b in v) else (
        "expected a non-empty tuple of positive integers")
  if name == "lora":
    return None if v is None or isinstance(v, LoraConfig) else "expected a hd.LoraConfig or None (full fine-tuning)"
  if name == "sampling":
    return None if isinstance(v, SamplingConfig) else "expected a hd.SamplingConfig"
  if name == "loss":
    return None if isinstance(v, LossConfig) else "expected a LossConfig (hackable_diffusion.diffusion.loss)"
  if name == "mesh":
    return None if isinstance(v, MeshConfig) else "expected a MeshConfig (hackable_diffusion.sharding)"
  if name == "model_overrides":
    if not isinstance(v, Mapping):
      return "expected a dict of ModelConfig fields"
    unknown = sorted(set(v) - {f.name for f in dataclasses.fields(ModelConfig)})
    return f"unknown ModelConfig field(s) {unknown}" if unknown else None
  raise AssertionError(f"SFTConfig.{name} has no validation rule")  # a new field must get one


__all__ = ["DIFFERENT_DEFAULTS", "REPORTS", "SECTION_KEYS", "SFTConfig", "UNSUPPORTED", "batch_devices",
           "unknown_setting_error"]
