"""Our variable paths <-> the tensor names of transformers' DiffusionGemma checkpoints (loader, writer, peft.py).

transformers stores the text weights once under `model.decoder.*` (encoder and decoder weights are tied), the
encoder's own `layer_scalar` buffers under `model.encoder.language_model.layers.N.layer_scalar`, and a vision
tower under `model.encoder.vision_tower.*` / `model.encoder.embed_vision.*` (our `vision_tower` / `embed_vision`,
named by `interop.vision_io`). Kernels are stored `[out, in]` (torch `nn.Linear`), ours are `[in, out]`: those names
carry `transpose=True`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flax import nnx

from hackable_diffusion.interop.vision_io import VISION_PREFIXES, is_vision_name, is_vision_path, vision_hf_name

DECODER = "model.decoder."
DECODER_LAYERS = DECODER + "layers."
ENCODER_TEXT = "model.encoder.language_model."  # the encoder's copy of the (tied) text model
ENCODER_LAYERS = ENCODER_TEXT + "layers."

VariablePath = tuple[Any, ...]


def hf_name(path: VariablePath) -> tuple[str, bool]:
  """Our variable path (e.g. `('layers', 0, 'self_attn', 'q_proj', 'kernel')`) -> (HF tensor name, transpose?)."""
  if is_vision_path(path):
    return vision_hf_name(path)
  parts = [str(p) for p in path]
  if parts == ["embed_tokens"]:
    return DECODER + "embed_tokens.weight", False
  if parts[0] == "layers" and parts[-1] == "encoder_layer_scalar":
    return f"{ENCODER_LAYERS}{parts[1]}.layer_scalar", False
  if parts[:2] == ["self_conditioning", "mlp"]:
    parts = ["self_conditioning", *parts[2:]]
  if parts[-1] == "kernel":
    return DECODER + ".".join(parts[:-1]) + ".weight", True
  return DECODER + ".".join(parts), False


def tied_decoder_name(name: str) -> str | None:
  """The decoder name of a tied encoder copy (`model.encoder.language_model.X` -> `model.decoder.X`), else None."""
  return DECODER + name[len(ENCODER_TEXT):] if name.startswith(ENCODER_TEXT) else None


def is_vision(name: str) -> bool:
  """Whether a HF tensor belongs to the vision tower or its embedder."""
  return is_vision_name(name)


def iter_variables(model: nnx.Module) -> Iterator[tuple[VariablePath, nnx.Variable]]:
  """(path, variable) for every variable of `model` (concrete or abstract), in state order."""
  for path, var in nnx.to_flat_state(nnx.state(model)):
    yield tuple(path), var


def hf_tensor_names(model: nnx.Module) -> dict[str, tuple[VariablePath, bool]]:
  """HF tensor name -> (our variable path, transpose?) for every variable of `model`."""
  out = {}
  for path, _ in iter_variables(model):
    name, transpose = hf_name(path)
    out[name] = (path, transpose)
  return out


__all__ = ["DECODER", "DECODER_LAYERS", "ENCODER_LAYERS", "ENCODER_TEXT", "VISION_PREFIXES", "VariablePath",
           "hf_name", "hf_tensor_names", "is_vision", "iter_variables", "tied_decoder_name"]
