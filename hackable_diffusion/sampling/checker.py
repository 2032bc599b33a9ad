"""Checkers: a task's rules evaluated inside the compiled denoising loop, so that rule-breaking positions are re-noised.

A checker is a small frozen object called on the argmax canvas (the draft) of every denoising step:

    violations = checker(canvas_ids [B, C] int32) -> [B, C] bool

True marks a position whose token breaks the task's rules (e.g. a Sudoku digit that repeats in its row, column or
box). It is written in `jax.numpy` and traced into the loop: no host round trip per step. Like the acceptance rules
(`sampling.rules`), a checker that is a `flax.struct.dataclass` is a pytree whose numeric fields are traced leaves:
its class (tree structure) is the compile key, and other field values reuse the compiled program. A checker that is
not a pytree node (e.g. a plain function) is wholly static: it must be hashable, and a new object recompiles.

With a checker, each step of `generate` (`sampling.denoise`, `sampling.denoise_rows`):

- re-noises the flagged positions: they are never accepted (pinned positions are never flagged);
- with `SamplingConfig.checker_confidence`, also raises their entropy to `log V` (so an entropy rule spends none of
  its budget on them and ranks them last) and lets no row stop early (stable and confident) while it has a
  violation;
- with `SamplingConfig.checker_restarts = R > 0`, a row that ends its canvas (early stop or step cap) with a
  violation starts the canvas again from fresh noise (pins kept, a new key), at most `R` times and while its decoder
  forwards on the canvas are below `checker_step_budget`; the result is the first attempt without a violation, else
  the last one (cut at the budget).

Tasks supply a checker through the optional `checker(tokenizer)` hook (`tasks.base.checker`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import rules

Array = jax.Array


@runtime_checkable
class Checker(Protocol):
  """`(canvas_ids [B, C] int32) -> violations [B, C] bool` (traced inside the denoising loop)."""

  def __call__(self, canvas_ids: Array) -> Array:
    ...


@flax.struct.dataclass
class CheckerArg:
  """What the compiled loop receives for a checker: the checker (None when it is static, then part of the compile
  key) and the traced restart settings."""

  checker: Any  # the checker with its leaves as arrays, or None (static checker)
  restarts: Array  # [] int32, restarts allowed per row and canvas
  budget: Array  # [] int32, decoder forwards per row and canvas (attempts included)


def is_static(checker: Checker) -> bool:
  """True when `checker` is not a pytree node (e.g. a plain function): it is then part of the compile key."""
  return rules.is_static(checker)


def check_checker(checker: Any, what: str = "checker") -> None:
  """`ConfigError` unless `checker` is callable and, when static, hashable (it is part of the compile key)."""
  if not callable(checker):
    raise ConfigError(f"{what}: expected a checker (a callable canvas [B, C] -> violations [B, C] bool, see "
                      f"sampling.checker), got {type(checker).__name__}")
  try:
    hash(checker if is_static(checker) else jax.tree.structure(checker))
  except TypeError:
    raise ConfigError(f"{what}: the static part of {type(checker).__name__} must be hashable (it is part of the "
                      f"compile key)") from None


def checker_arg(checker: Checker, restarts: int, budget: int) -> CheckerArg:
  """The traced argument of the loop for `checker` (its leaves as arrays; None when the checker is static)."""
  check_checker(checker)
  traced = None if is_static(checker) else jax.tree.map(lambda v: rules.traced_leaf(v, "checker:"), checker)
  return CheckerArg(checker=traced, restarts=jnp.asarray(restarts, jnp.int32), budget=jnp.asarray(budget, jnp.int32))


def violations(checker: Checker, argmax: Array, pinned: Array | None) -> Array:
  """`checker(argmax [B, C])` as `[B, C]` bool, pinned positions (`[B, C]` bool or None) never flagged."""
  flagged = jnp.asarray(checker(argmax))
  if flagged.shape != argmax.shape:
    raise ValueError(f"checker {type(checker).__name__} returned shape {flagged.shape} for a canvas of shape "
                     f"{argmax.shape}; expected the canvas's shape")
  flagged = flagged.astype(bool)
  return flagged if pinned is None else flagged & ~pinned


def raise_entropy(token_entropy: Array, flagged: Array, vocab_size: int) -> Array:
  """Entropies `[B, C]` with the flagged positions raised to at least `log V` (the entropy of a uniform token)."""
  return jnp.where(flagged, jnp.maximum(token_entropy, math.log(vocab_size)), token_entropy)


__all__ = ["Checker", "CheckerArg", "check_checker", "checker_arg", "is_static", "raise_entropy", "violations"]
