"""Hugging Face DiffusionGemma checkpoints, both ways: the entry points (`load_pretrained`, `save_pretrained`).

Layout written by transformers' `DiffusionGemmaForBlockDiffusion.save_pretrained`: `config.json` with a
`text_config`, weights stored once under `model.decoder.*` (encoder and decoder text weights are tied), the
encoder's own `layer_scalar` buffers under `model.encoder.language_model.layers.N.layer_scalar`, and a vision
tower under `model.encoder.vision_tower.*` / `model.encoder.embed_vision.*` (the name mapping: `interop.names`).
Our model has one set of text weights; loading maps the names onto it tensor by tensor (never two full copies in
memory), the vision tower included when the config has a real one (`model.vision`; the tiny placeholder tower a
text-only model writes, or `vision=None`, loads a text-only model and skips it); saving writes every name
transformers expects, with a tiny vision stub (or the vision tower of a source checkpoint) for a text-only model,
so that `from_pretrained` reports no missing or unexpected keys.

Loading is one loop over the stored tensors with a per-tensor *placement* function: on one device
(`place_on_host`: read the tensor, cast, transpose) or straight into its shards on a mesh (`place_in_shards`:
every device reads only its own slice). Quantized checkpoints in the compressed-tensors format (the FP8 and NVFP4
checkpoints published for vLLM, `interop.quantized`) are dequantized tensor by tensor on the way: each quantized
weight is read with its scales and placed as a dense array of the requested dtype; per-expert weights
(`experts.N.gate_proj/up_proj/down_proj`) are stacked into the fused expert layout. Every tensor is checked for
NaN and inf as it is read (`check_finite=False` turns that off), and every safetensors header against its file's
size before anything of the size it declares is read.

This module owns a checkpoint's config (`load_config`, `checkpoint_dtype`, `resolve_dtype`, `abstract_model`) and
loading (`load_weights`, `load_pretrained`), and re-exports the rest of the public API from where it lives:
files, headers and reads in `interop.safetensors_io`; tensor sources and placements in `interop.placement`; which
stored tensors fill which variable in `interop.load_plan`; writing (`save_pretrained`) in `interop.hf_write`.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion.errors import CheckpointError, ConfigError
from hackable_diffusion.files import read_json
from hackable_diffusion.hub import resolve_model_path
from hackable_diffusion.interop import load_plan
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.interop.hf_write import save_pretrained
from hackable_diffusion.interop.placement import (DequantizedTensor, Placement, StoredTensor, TensorSource,
                                                  place_in_shards, place_on_host)
from hackable_diffusion.interop.safetensors_io import INDEX_NAME, WEIGHTS_NAME, checkpoint_nbytes, iter_tensors
from hackable_diffusion.model import scan
from hackable_diffusion.model.config import ModelConfig
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.sharding.logical import LOGICAL_AXIS_RULES, Rules


def load_config(path: str, **overrides: Any) -> ModelConfig:
  """The `ModelConfig` of a checkpoint directory or Hub id (its config.json) with `overrides`."""
  path = resolve_model_path(path)
  config_path = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a directory")
  try:
    return ModelConfig.from_json_file(config_path, **overrides)
  except ConfigError as e:
    raise CheckpointError(str(e)) from None


CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(path: str) -> str:
  """The dtype a HF checkpoint was saved in: config.json's `dtype` (transformers 5) or `torch_dtype` (older),
  at the top level or in `text_config`; 'float32' (transformers' own default) with a warning when it records none,
  since a bf16 model then loads at twice its size. One-line `CheckpointError` for another."""
  path = resolve_model_path(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a directory")
  config = read_json(os.path.join(path, "config.json"), error=CheckpointError)
  sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
  for section in sections:
    for key in ("dtype", "torch_dtype"):
      value = section.get(key)
      if value is None or value == "auto":
        continue
      name = str(value).removeprefix("torch.")
      if name not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"{path}/config.json: {key}={value!r}; expected one of {list(CHECKPOINT_DTYPES)}")
      return name
  logging.warning("%s/config.json records no dtype: loading the weights in float32 (transformers' default); pass "
                  "dtype='bfloat16' (model.dtype in a config) to keep a bf16 checkpoint in bf16", path)
  return "float32"


def resolve_dtype(path: str, dtype: Any) -> Any:
  """`dtype`, or the checkpoint's own (`checkpoint_dtype`) when it is 'auto'."""
  return checkpoint_dtype(path) if isinstance(dtype, str) and dtype == "auto" else dtype


def abstract_model(path: str, dtype: Any = "auto", compute_dtype: Any = None,
                   **config_overrides: Any) -> DiffusionGemma:
  """The model of the checkpoint directory or Hub id `path`, built abstractly (`nnx.eval_shape`: no weights yet):
  its config with parameters in `dtype` ('auto': the checkpoint's, `resolve_dtype`), the forward in
  `compute_dtype` (default `dtype`), and `config_overrides`."""
  path = resolve_model_path(path)
  dtype = jnp.dtype(resolve_dtype(path, dtype))
  compute = jnp.dtype(compute_dtype) if compute_dtype is not None else dtype
  config = load_config(path, param_dtype=dtype.name, dtype=compute.name, **config_overrides)
  return nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))


def load_weights(model: nnx.Module, path: str, place: Placement = place_on_host, *,
                 check_finite: bool = True) -> nnx.Module:
  """Fills every variable of `model` (built abstractly: `nnx.eval_shape`) from the checkpoint at `path`.

  Tensors are read one at a time and placed by `place`; a vision tower the model lacks is skipped with one warning; a
  tied encoder copy stored next to its decoder copy is skipped. A compressed-tensors checkpoint (config.json's
  `quantization_config`, `interop.quantized`) is dequantized weight by weight (FP8: `weight` + `weight_scale`; NVFP4:
  `weight_packed` + `weight_scale` + `weight_global_scale`), per-expert weights (`experts.N.gate_proj` / `up_proj` /
  `down_proj`, quantized or not) are stacked into the fused layout, and activation-quantization scales are skipped
  with one warning. Everything is checked before the first tensor is read (`load_plan.prepare_load`).
  Raises `CheckpointError` naming the tensor for a missing tensor, an unexpected tensor, a shape mismatch or a
  quantized tensor without its scales, and naming the field for an unsupported `quantization_config`.
  `check_finite`: every tensor is checked for NaN and inf as it is read (one reduction per tensor), a one-line
  `CheckpointError` naming the tensor and its file; False loads such values as they are.
  """
  for _, _, var, source in load_plan.prepare_load(model, path).read(check_finite=check_finite):
    var.set_value(place(source, var))
  return model


def load_pretrained(path: str, dtype: Any = "auto", *, compute_dtype: Any = None, adapter: str | None = None,
                    mesh: Mesh | None = None, rules: Rules = LOGICAL_AXIS_RULES, adapter_path: str | None = None,
                    stack: bool = True, check_finite: bool = True, **config_overrides: Any) -> DiffusionGemma:
  """Loads a HF DiffusionGemma directory (config.json + safetensors, sharded or not) into `DiffusionGemma`.

  `path` (and `adapter`): a local directory or a Hugging Face Hub id (`owner/name`), resolved by
  `hackable_diffusion.hub.resolve_model_path` (the local cache first; `HF_HUB_OFFLINE` honoured).

  `dtype`: parameter dtype (also the compute dtype unless `compute_dtype` is given); 'auto' (default): the dtype the
  checkpoint was saved in (`checkpoint_dtype`: bfloat16 for the released models). Tensors are read one at a time and
  cast on the fly (peak memory: the model plus one tensor in transit). The vision tower (config.json's
  `vision_config`) loads with the text model and takes images (`hd.generate(..., pixel_values=...)`); `vision=None`
  loads the text model alone (the tower skipped with one warning), as does a text-only checkpoint's placeholder tower
  (`TINY_VISION_CONFIG`). `mesh`: every tensor goes straight into its `NamedSharding` on the mesh (by `rules`), each
  device reading only its own slice (`place_in_shards`). Quantized compressed-tensors checkpoints (FP8, NVFP4; fused
  or per-expert experts) are dequantized to `dtype` on the way (`load_weights`, `interop.quantized`). Raises
  `CheckpointError` naming the tensor for a missing tensor, an unexpected tensor, or a shape mismatch, and the field
  for an unsupported `quantization_config`, and a tensor holding a NaN or an inf (naming it and its file; every tensor
  is checked as it is read, one reduction each) unless `check_finite=False` (for deliberate experiments).
  `adapter`: a PEFT adapter directory to apply on top (see
  `hackable_diffusion.interop.peft`; `adapter_path` is the same argument under transformers' name).
  `config_overrides`: `ModelConfig` fields to override. With `scan_layers=True` (an override or the config) the
  returned model's layers are stacked (`model.scan.stack_layers`, after the adapter), unless `stack=False` (the
  trainer adds its adapters first and stacks after).
  """
  if adapter is not None and adapter_path is not None and adapter != adapter_path:
    raise ConfigError(f"load_pretrained: adapter={adapter!r} and adapter_path={adapter_path!r} disagree; pass one")
  adapter = adapter if adapter is not None else adapter_path
  path = resolve_model_path(path)
  model = abstract_model(path, dtype, compute_dtype, **config_overrides)
  load_weights(model, path, place_on_host if mesh is None else place_in_shards(mesh, rules),
               check_finite=check_finite)
  if adapter is not None:
    model = peft_io.load_adapter(model, resolve_model_path(adapter))
  if stack and model.config.scan_layers:
    model = scan.stack_layers(model, donate=True)
  return model


__all__ = [
    # defined here
    "CHECKPOINT_DTYPES", "abstract_model", "checkpoint_dtype", "load_config", "load_pretrained", "load_weights",
    "resolve_dtype",
    # re-exported
    "CheckpointError",  # hackable_diffusion.errors
    "INDEX_NAME", "WEIGHTS_NAME", "checkpoint_nbytes", "iter_tensors",  # interop.safetensors_io
    "DequantizedTensor", "Placement", "StoredTensor", "TensorSource", "place_in_shards", "place_on_host",  # placement
    "save_pretrained",  # interop.hf_write
]
