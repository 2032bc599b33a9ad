"""`SFTConfig`: the flat, validated settings of `hd.SFTTrainer`, mapped onto the experiment config of the CLI.

TRL users know these names (`max_steps`, `learning_rate`, `warmup_steps`, `gradient_accumulation_steps`, ...).
`SFTConfig.experiment_sections()` turns them into the sections of `runs/config.py` (the same dict a config
file produces), so the Python API and `python -m hackable_diffusion.train` run one trainer on one config format.

Defaults that remove the traps of writing the nested config by hand: the learning-rate schedule lasts
`max_steps` (warmup included), the parameter dtype is the checkpoint's own ('auto'), `add_bos=None` follows the
tokenizer (a bos token when it has one and the model is a pretrained checkpoint), and the tokenizer is the
checkpoint's (or, for a fresh init, a character model trained on the data).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.data.chat import chat_template_kind
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora.adapters import LoraConfig
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sharding.mesh import MeshConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SCHEDULES = ("cosine", "linear", "constant")
_MASTER = ("auto", "float32", "off")


def _int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """Settings of a supervised fine-tuning run (`hd.SFTTrainer(..., args=SFTConfig(...))`).

  output_dir: the run directory (checkpoints, metrics, eval reports; a rerun resumes from it).
  max_steps / batch_size (global, split over the mesh) / gradient_accumulation_steps (micro-batches per step).
  learning_rate (peak), lr_scheduler_type ('cosine', 'linear', 'constant'), warmup_steps (None: 5% of max_steps,
    at most 100 - the recipe's warmup for its 2,000 steps), end_lr_ratio (final lr =
    learning_rate * end_lr_ratio), weight_decay, adam_beta1/2, max_grad_norm (None: no clipping): the schedule
    spans `max_steps`.
  lora: a `LoraConfig` (train adapters only) or None (full fine-tuning); lora_seed: the adapters' init seed.
  dtype: parameter dtype when loading a checkpoint ('auto' = the checkpoint's own); master_weights: float32
    masters of a bf16 model's trainable weights ('auto': on for full fine-tuning).
  tokenizer: '' = the checkpoint's tokenizer files (a fresh init: a character model trained on the data), or a
    tokenizer file/directory. add_bos: None = from the tokenizer (see the module docstring).
  prompt_field / completion_field: the keys of prompt/completion records; messages_field: the key of chat records
    (`[{"role": ..., "content": ...}, ...]`, the loss on the final assistant turn); chat_template: '', a format
    string with {prompt}, a jinja template, or 'tokenizer' (the checkpoint's own);
    max_prompt_length (tokens) / max_canvases (completion canvases per example).
  logging_steps, save_steps, save_total_limit: logging and checkpoint intervals / checkpoints kept.
  eval_steps: evaluate every N steps (0: only at the end, when `eval_at_end`); eval_num_examples, eval_batch_size,
    eval_step_budgets (one fixed-steps run each), eval_max_steps (the early-stopping run's cap), sampling (the
    evaluation sampler).
  loss: the diffusion objective (`LossConfig`); mesh: the device mesh (`MeshConfig`; default one device);
  model_overrides: `ModelConfig` fields changed on top of the model (e.g. {'remat': 'nothing_saveable'}).
  seed: init, data order and noise.
  """

  output_dir: str = "runs/sft"
  max_steps: int = 1000
  learning_rate: float = 1.5e-4
  lr_scheduler_type: str = "cosine"
  warmup_steps: int | None = None
  end_lr_ratio: float = 0.1
  weight_decay: float = 1e-4
  adam_beta1: float = 0.95
  adam_beta2: float = 0.99
  max_grad_norm: float | None = 1.0
  batch_size: int = 8
  gradient_accumulation_steps: int = 1
  seed: int = 0
  lora: LoraConfig | None = None
  lora_seed: int = 0
  dtype: str = "auto"
  master_weights: str = "auto"
  tokenizer: str = ""
  add_bos: bool | None = None
  prompt_field: str = "prompt"
  completion_field: str = "completion"
  messages_field: str = "messages"
  chat_template: str = ""
  max_prompt_length: int = 128
  max_canvases: int = 1
  logging_steps: int = 50
  save_steps: int = 500
  save_total_limit: int = 3
  eval_steps: int = 0
  eval_at_end: bool = True
  eval_num_examples: int = 128
  eval_batch_size: int = 64
  eval_step_budgets: tuple[int, ...] = (32,)
  eval_max_steps: int = 64
  sampling: SamplingConfig = SamplingConfig()
  loss: LossConfig = LossConfig()
  mesh: MeshConfig = MeshConfig(data=1)
  model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "eval_step_budgets", tuple(self.eval_step_budgets)
                       if isinstance(self.eval_step_budgets, (list, tuple)) else self.eval_step_budgets)
    for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
      problem = _problem(name, value)
      if problem:
        raise ConfigError(f"SFTConfig.{name}={_short(value)}: {problem}")
    if self.warmup_steps is None:
      object.__setattr__(self, "warmup_steps", min(100, self.max_steps // 20))
    if self.warmup_steps > self.max_steps:
      raise ConfigError(f"SFTConfig.warmup_steps={self.warmup_steps}: longer than max_steps={self.max_steps}")
    if self.batch_size % self.gradient_accumulation_steps:
      raise ConfigError(f"SFTConfig.gradient_accumulation_steps={self.gradient_accumulation_steps}: does not divide "
                        f"batch_size={self.batch_size}")

  def replace(self, **changes: Any) -> SFTConfig:
    return dataclasses.replace(self, **changes)

  def experiment_sections(self) -> dict[str, Any]:
    """The config sections of `runs/config.py` these settings mean, except `model`, `tokenizer.path`,
    `data`'s paths and `eval.task` (which depend on the trainer's model, data and task arguments)."""
    lora = {"enabled": False} if self.lora is None else {"enabled": True, "seed": self.lora_seed,
                                                        **dataclasses.asdict(self.lora)}
    return {
        "tokenizer": {"model_type": "char", "vocab_size": 0},
        "data": {"prompt_field": self.prompt_field, "completion_field": self.completion_field,
                 "messages_field": self.messages_field,
                 "chat_template": self.chat_template, "max_prompt_length": self.max_prompt_length,
                 "max_canvases": self.max_canvases},
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
                  "eval_at_end": self.eval_at_end},
        "eval": {"num_examples": self.eval_num_examples, "batch_size": self.eval_batch_size,
                 "step_budgets": self.eval_step_budgets, "early_stopping_steps": self.eval_max_steps,
                 "seed": self.seed, "sampling": _sampling_dict(self.sampling)},
        "lora": lora,
        "mesh": dataclasses.asdict(self.mesh),
    }


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
  if name in ("max_steps", "batch_size", "gradient_accumulation_steps", "max_prompt_length", "max_canvases",
              "logging_steps", "save_steps", "save_total_limit", "eval_num_examples", "eval_batch_size",
              "eval_max_steps"):
    return _positive(v)
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


__all__ = ["SFTConfig"]
