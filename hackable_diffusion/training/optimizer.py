"""Optimizer and learning-rate schedule (optax), defaults from the gemma JAX Sudoku recipe
(docs/reference.md, "Training recipe").

clip by global norm 1.0 -> Adam(b1 0.95, b2 0.99, eps 1e-8) with decoupled weight decay 1e-4 -> lr schedule:
linear warmup 100 steps to 1.5e-4, cosine to peak/10 at 2,000 steps.

Precision (`master_weights`): full fine-tuning of a bfloat16 model keeps a float32 master copy of the trainable
parameters in the train state; the optimizer is created from that copy, so Adam's moments (mu, nu: optax keeps
them in the dtype of the parameters it is initialised with) are float32 too, and each step computes in the model's
own dtype (`training.step`, docs/training.md "Precision").

`OptimizerConfig`, the run's `optimizer` config section, lives with the other sections in `runs.config`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import optax

from hackable_diffusion.runs.config import OptimizerConfig

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
