"""Optimizer and learning-rate schedule (optax), defaults from the gemma JAX Sudoku recipe (REFERENCE §3).

clip by global norm 1.0 -> Adam(b1 0.95, b2 0.99, eps 1e-8) with decoupled weight decay 1e-4 -> lr schedule:
linear warmup 100 steps to 1.5e-4, cosine to peak/10 at 2,000 steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import optax

_SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
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
