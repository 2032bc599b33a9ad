"""Several sampling tries per evaluation example, kept by a task's checker (test-time scaling).

Try 0 samples every example with the evaluation's own keys (`fold_in(rng, i)`); try `s >= 1` samples only the
examples whose every earlier try the checker rejected, example `i` with key `fold_in(fold_in(rng, TRY_KEY + s), i)`.
An example keeps its first try without a violation on any canvas, else its first try; every try's decoder forwards
count towards the example's cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# try `s >= 1` folds `TRY_KEY + s` into the evaluation key
TRY_KEY = 2_000_000

# sample(indices [m], keys [m]) -> (new tokens, forwards per canvas, tokens per forward), one entry per index
Sample = Callable[[np.ndarray, Array], tuple[list[np.ndarray], list[np.ndarray], list[float]]]


@dataclasses.dataclass
class Tried:
  """Per example: the kept try's new tokens `[k * C]`, forwards per canvas `[k]` and tokens per forward, and over
  every try the decoder forwards and the number of tries."""

  new_tokens: list[np.ndarray]
  step_rows: list[np.ndarray]
  tokens_per_forward: list[float]
  forwards: np.ndarray  # [n] float64
  tries: np.ndarray  # [n] float64


def is_valid(checker: Any, tokens: np.ndarray, steps: np.ndarray) -> bool:
  """Whether `checker` flags nothing on the canvases of one example's new tokens (`[k * C]`, `steps [k]`)."""
  canvases = np.asarray(tokens).reshape(max(len(steps), 1), -1)  # [k, C]
  return not bool(np.asarray(checker(jnp.asarray(canvases, jnp.int32))).any())


def sample_tries(sample: Sample, n: int, rng: Array, tries: int, valid: Any) -> Tried:
  """Up to `tries` tries of the `n` examples (see the module docstring); `valid` is the checker (unused for 1)."""
  keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(n))  # [n] one key per example
  new_tokens, step_rows, tpf = sample(np.arange(n), keys)
  out = Tried(list(new_tokens), list(step_rows), list(tpf), np.array([s.sum() for s in step_rows], np.float64),
              np.ones(n))
  todo = np.arange(n)
  for attempt in range(1, tries):
    todo = todo[[not is_valid(valid, out.new_tokens[i], out.step_rows[i]) for i in todo]]
    if not todo.size:
      break
    try_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(rng, TRY_KEY + attempt), jnp.asarray(todo))
    again = sample(todo, try_keys)
    for j, i in enumerate(todo):
      out.forwards[i] += again[1][j].sum()
      out.tries[i] += 1
      if is_valid(valid, again[0][j], again[1][j]):
        out.new_tokens[i], out.step_rows[i], out.tokens_per_forward[i] = again[0][j], again[1][j], again[2][j]
  return out


__all__ = ["Sample", "TRY_KEY", "Tried", "is_valid", "sample_tries"]
