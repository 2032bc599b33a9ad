"""The vision tower's variables <-> their Hugging Face tensor names (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`), and the tower's tensors for writing a checkpoint.

transformers 5.23.0 names them after its modules (`models/gemma4/modeling_gemma4.py`): the projections inside the
encoder layers are `Gemma4ClippableLinear`s holding an `nn.Linear` (`...q_proj.linear.weight`, and with
`use_clipped_linears` the scalar bounds `...q_proj.input_min` etc. beside it); the patch embedding's `input_proj`
and the embedder's `embedding_projection` are plain `nn.Linear`s (`...input_proj.weight`). Our modules carry the
same names under `DiffusionGemma.vision_tower` / `.embed_vision`, kernels `[in, out]` (stored transposed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
VISION_MODULES = ("vision_tower", "embed_vision")  # our attribute names of the tower and the embedder
_WRAPPED = ("self_attn", "mlp")  # modules whose projections are ClippableLinears (an inner `linear`)


def is_vision_name(name: str) -> bool:
  """Whether a HF tensor name belongs to the vision tower or its embedder."""
  return name.startswith(VISION_PREFIXES)


def is_vision_path(path: tuple[Any, ...]) -> bool:
  """Whether one of our variable paths belongs to the vision tower or its embedder."""
  return bool(path) and str(path[0]) in VISION_MODULES


def vision_hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
  """A vision variable path (e.g. `('vision_tower', 'encoder', 'layers', 0, 'self_attn', 'q_proj', 'kernel')`) ->
  (HF tensor name, transpose?)."""
  parts = [str(p) for p in path]
  if parts[-1] != "kernel":
    return "model.encoder." + ".".join(parts), False
  leaf = "linear.weight" if any(p in _WRAPPED for p in parts) else "weight"
  return "model.encoder." + ".".join(parts[:-1]) + "." + leaf, True


def iter_vision_tensors(model: nnx.Module, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, value in the torch layout) of every vision variable of `model`, cast to `dtype` (default: as
  stored). Nothing for a text-only model."""
  for path, var in nnx.to_flat_state(nnx.state(model)):
    path = tuple(path)
    if not is_vision_path(path):
      continue
    name, transpose = vision_hf_name(path)
    value = jnp.asarray(var[...])
    value = value.T if transpose else value
    yield name, np.asarray(value.astype(jnp.dtype(dtype)) if dtype is not None else value)


def vision_state_dict(model: nnx.Module, dtype: str | None = None) -> dict[str, np.ndarray]:
  """{HF name: array} of the model's vision tower and embedder (`iter_vision_tensors`), e.g. for `save_pretrained`.
  Empty for a text-only model."""
  return dict(iter_vision_tensors(model, dtype))


__all__ = ["VISION_MODULES", "VISION_PREFIXES", "is_vision_name", "is_vision_path", "iter_vision_tensors",
           "vision_hf_name", "vision_state_dict"]
