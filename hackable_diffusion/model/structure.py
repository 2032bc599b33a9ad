"""Task-provided attention structure: an optional, hackable restriction of canvas-to-canvas attention.

Not part of the reference architecture (a model using one cannot be exported to transformers/vLLM). At CPU
budgets it decides results on structured tasks: a Sudoku denoiser whose heads only see each cell's
row/column/box peers learns an order of magnitude faster than one with plain attention (see the Sudoku issue).

A structure is a function `(config) -> bool array [heads or 1, canvas, canvas]` (True = may attend), named in
`ModelConfig.attention_structure`. Built-in names resolve lazily to `module:function`; add your own with
`register_structure(name, fn)`. The decoder applies the mask to canvas-to-canvas attention in every layer; the
cached prefix (prompt) stays fully visible.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

StructureFn = Callable[..., np.ndarray]

_BUILTIN = {
    "sudoku_peers": "hackable_diffusion.tasks.sudoku.structure:peer_mask",
    "sudoku_peers_per_head": "hackable_diffusion.tasks.sudoku.structure:per_head_peer_mask",
}
_REGISTRY: dict[str, StructureFn] = {}


def register_structure(name: str, fn: StructureFn) -> None:
  """Registers `fn(config) -> [heads|1, C, C] bool` under `name`."""
  _REGISTRY[name] = fn


def available() -> list[str]:
  return sorted(set(_BUILTIN) | set(_REGISTRY))


def get_structure(name: str) -> StructureFn:
  if name in _REGISTRY:
    return _REGISTRY[name]
  if name in _BUILTIN:
    module, fn = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(module), fn)
  raise ValueError(f"unknown attention_structure {name!r}; available: {available()}")


def canvas_mask(config) -> np.ndarray | None:
  """The `[1, heads|1, C, C]` mask of `config.attention_structure` (None when the model has none)."""
  if config.attention_structure is None:
    return None
  mask = np.asarray(get_structure(config.attention_structure)(config), bool)
  c, h = config.canvas_length, config.num_attention_heads
  if mask.ndim != 3 or mask.shape[1:] != (c, c) or mask.shape[0] not in (1, h):
    raise ValueError(
        f"attention_structure {config.attention_structure!r} returned shape {mask.shape}; expected (1 or {h}, {c}, {c})")
  if not mask.any(axis=-1).all():
    raise ValueError(f"attention_structure {config.attention_structure!r} leaves a canvas position with no key")
  return mask[None]
