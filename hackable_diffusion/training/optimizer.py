"""Optimizer and learning-rate schedule (optax), defaults from the gemma JAX Sudoku recipe
(docs/reference.md, "Training recipe").

clip by global norm 1.0 -> Adam(b1 0.95, b2 0.99, eps 1e-8) with decoupled weight decay 1e-4 -> lr schedule:
linear warmup 100 steps to 1.5e-4, cosine to peak/10 at 2,000 steps.

Precision (`master_weights`): full fine-tuning of a bfloat16 model keeps a float32 master copy of the trainable
parameters in the train state; the optimizer is created from that copy, so Adam's moments (mu, nu: optax keeps
them in the dtype of the parameters it is initialised with) are float32 too, and each step computes in the model's
own dtype (`training.step`, docs/training.md "Precision").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import optax

_SCHEDULES = ("cosine", "linear", "constant")
_MASTER_WEIGHTS = ("auto", "float32", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """The optimizer of a run (fields as in the module docstring).

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


def master_dtype(cfg: OptimizerConfig, *, lora: bool) -> str | None:
  """The dtype of the trainable variables' master copy ('float32'), or None (no copy): `cfg.master_weights` with
  'auto' resolved (on for full fine-tuning, off when `lora` adapters are what trains)."""
  if cfg.master_weights == "off" or (cfg.master_weights == "auto" and lora):
    return None
  return "float32"


def make_schedule(cfg: OptimizerConfig) -> Callable[[jnp.ndarray], jnp.ndarray]:
  end = cfg.peak_lr * cfg.end_lr_ratio
  if cfg.schedule == "constant":
    decay = optax.constant_schedule(cfg.peak_lr)
  elif cfg.schedule == "linear":
    decay = optax.linear_schedule(cfg.peak_lr, end, max(cfg.decay_steps - cfg.warmup_steps, 1))
  else:
    decay = optax.cosine_decay_schedule(cfg.peak_lr, max(cfg.decay_steps - cfg.warmup_steps, 1),
                                        alpha=cfg.end_lr_ratio)
  if cfg.warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, cfg.peak_lr, cfg.warmup_steps)
  return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation, Callable]:
  """(transformation, lr schedule). Weight decay is decoupled (AdamW) and applied to every trainable array."""
  schedule = make_schedule(cfg)
  parts = []
  if cfg.clip_norm is not None:
    parts.append(optax.clip_by_global_norm(cfg.clip_norm))
  parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
  return optax.chain(*parts), schedule
