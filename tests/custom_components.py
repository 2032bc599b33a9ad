"""A researcher's own components, defined outside the library and selected in configs by 'module:attribute' spec.

tests/conftest.py puts this directory on `sys.path`, so the specs below import in any pytest import mode:
- tasks: 'custom_components:OneDigitTask' (through `hackable_diffusion.tasks.base.get_task`),
  'custom_components:DigitsMissingOnProcess' (a data generator that fails on one process of a multi-process job);
- attention structure: 'custom_components:self_only', one over the prompt too (and broken ones) for `ModelConfig.attention_structure`;
- loss term: 'custom_components:DoubledFlat' for `LossConfig(variant=...)` / `diffusion.loss_variant`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hackable_diffusion.diffusion import loss
from hackable_diffusion.errors import DataError
from hackable_diffusion.tasks.base import BaseTask, check_lengths
from hackable_diffusion.tasks.text import DigitsTask


# ---- a task ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class OneDigitTask(BaseTask):
  """Samples only `digit` (no EOS), so every prediction is `digit` repeated over the whole completion; with
  `refuse`, a record whose prompt contains it has no start canvas (a `ValueError`)."""

  digit: str = "7"
  refuse: str = ""
  name: str = "one_digit"
  primary_metric: str = "all_digit"

  def metrics(self, predictions, records):
    check_lengths(predictions, records)
    return {"all_digit": float(np.mean([bool(p) and set(p) == {self.digit} for p in predictions])),
            "mean_length": float(np.mean([len(p) for p in predictions])),
            "mean_prompt_length": float(np.mean([len(r.prompt) for r in records]))}

  def allowed_token_ids(self, tokenizer):
    return tokenizer.token_ids_for(self.digit)

  def seed_canvas(self, records, tokenizer, num_tokens):
    for r in records:
      if self.refuse and self.refuse in r.prompt:
        raise ValueError(f"prompt holds {self.refuse!r}")
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsMissingOnProcess(DigitsTask):
  """The built-in digits task, except that process `process` of a multi-process job cannot make its data (a host
  that lacks what the others have)."""

  process: int = 1

  def make_data(self, out_dir: str) -> dict[str, str]:
    if jax.process_index() == self.process:
      raise DataError(f"{out_dir}: no data on process {self.process} (custom_components.DigitsMissingOnProcess)")
    return super().make_data(out_dir)


def not_a_task():
  """A factory whose result lacks the `Task` hooks."""
  return object()


# ---- attention structures ----------------------------------------------------------------------------------------
def self_only(config) -> np.ndarray:
  """[1, C, C]: each canvas position attends only to itself (and the prompt)."""
  return np.eye(config.canvas_length, dtype=bool)[None]


def self_only_with_prompt_slot(config) -> np.ndarray:
  """[1, C, 4 + C]: canvas position i attends only to itself and, for i < 4, to prompt slot i (i >= 4: no slot)."""
  c = config.canvas_length
  prompt = np.zeros((c, 4), bool)
  prompt[np.arange(4), np.arange(4)] = True
  return np.concatenate([prompt, np.eye(c, dtype=bool)], axis=1)[None]


def empty_row(config) -> np.ndarray:
  """[1, C, C] with position 0 attending to nothing: rejected."""
  mask = np.ones((1, config.canvas_length, config.canvas_length), bool)
  mask[0, 0] = False
  return mask


def wrong_shape(config) -> np.ndarray:
  """[C, C] (no head axis): rejected."""
  return np.ones((config.canvas_length, config.canvas_length), bool)


NOT_CALLABLE = "a string, not a function"


# ---- a loss term -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DoubledFlat:
  """Twice the 'flat' term (a stand-in for a researcher's own weighting)."""

  scale: float = 2.0

  def __call__(self, logits: jax.Array, noise: loss.NoisedCanvas, schedule) -> jax.Array:
    return self.scale * loss.FlatCrossEntropy()(logits, noise, schedule)
