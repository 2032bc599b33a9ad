"""Task-provided attention structure: an optional, hackable restriction of canvas-to-canvas attention.

Not part of the DiffusionGemma architecture (a model using one cannot be exported to transformers/vLLM). At CPU
budgets it decides results on structured tasks: a puzzle denoiser whose heads only see each cell's
row/column/box peers learns an order of magnitude faster than one with plain attention (docs/sudoku.md).

A structure is a function `(config: ModelConfig) -> bool array [heads or 1, canvas, P + canvas]` (True = may
attend) living in any importable module; the last `canvas` columns restrict canvas-to-canvas attention, the first
`P` (none by default) the canvas's view of the first `P` cache slots (the prompt, when every prompt has the same
fixed layout, as a puzzle grid does); `ModelConfig.attention_structure` names it as 'package.module:function' (what
a task's `attention_structure()` returns, e.g. a module of its own package under `tasks/`). The
model knows no task: the spec is imported on use and its result validated (shape, no position left without a key).
The decoder applies the mask in every layer; cache slots past `P` (and all of them when `P` is 0) stay visible as
the prompt's own mask says.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from hackable_diffusion import specs
from hackable_diffusion.errors import ConfigError

StructureFn = Callable[[Any], np.ndarray]

FIELD = "ModelConfig.attention_structure"


# The project's own attention structures by name (none: a task's structure is named by its 'module:function' or by
# an installed `hackable_diffusion.attention_structures` plugin).
BUILTIN_STRUCTURES: Mapping[str, StructureFn] = types.MappingProxyType({})


def check_spec(spec: str | None) -> None:
  """A one-line `ConfigError` unless `spec` is None, an installed plugin name or 'package.module:function' (imports
  nothing)."""
  if spec is None:
    return
  if not (specs.is_spec(spec) or specs.is_named("attention_structures", spec, BUILTIN_STRUCTURES)):
    raise ConfigError(f"{FIELD}={spec!r}: expected None or 'package.module:function' returning a "
                      "[heads|1, canvas, canvas] bool mask (a task's own structure: what its "
                      "attention_structure() returns)")


def get_structure(spec: str) -> StructureFn:
  """The structure function `spec` ('package.module:function') names; a one-line `ConfigError` if there is none."""
  check_spec(spec)
  fn = specs.resolve("attention_structures", spec, what=FIELD, builtins=BUILTIN_STRUCTURES)
  if not callable(fn):
    raise ConfigError(f"{FIELD}={spec!r} is a {type(fn).__name__}, not a function of the model config")
  return fn


def canvas_mask(config: Any) -> np.ndarray | None:
  """The `[1, heads|1, C, P + C]` bool mask of `config.attention_structure` (None when the model has none).

  `config` is the `ModelConfig`; a one-line `ConfigError` when the function's result is not `[1 or heads, C, P + C]`
  or leaves a canvas position with no canvas key to attend to.
  """
  spec = config.attention_structure
  if spec is None:
    return None
  mask = np.asarray(get_structure(spec)(config), bool)
  c, h = config.canvas_length, config.num_attention_heads
  if mask.ndim != 3 or mask.shape[1] != c or mask.shape[2] < c or mask.shape[0] not in (1, h):
    raise ConfigError(f"{FIELD}={spec!r} returned shape {mask.shape}; expected (1 or {h}, {c}, P + {c}) with P >= 0")
  if not mask[..., -c:].any(axis=-1).all():
    raise ConfigError(f"{FIELD}={spec!r} leaves a canvas position with no canvas key")
  return mask[None]


def prompt_width(config: Any) -> int:
  """`P`: how many leading cache slots (the prompt) `config.attention_structure` restricts (0 without one)."""
  mask = canvas_mask(config)
  return 0 if mask is None else mask.shape[-1] - config.canvas_length


__all__ = ["BUILTIN_STRUCTURES", "FIELD", "StructureFn", "canvas_mask", "check_spec", "get_structure", "prompt_width"]
