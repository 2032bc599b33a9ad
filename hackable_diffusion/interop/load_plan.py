"""The loading plan: which stored tensors of a HF checkpoint fill which variable of our model, checked up front.

Owns the mapping from a checkpoint's stored tensors (located by `locate`) to our variables: `group` sorts every
stored tensor under the weight it belongs to (skipping a vision tower the model lacks, activation-quantization
scales and tied encoder copies; a quantized weight's parts `weight` / `weight_scale` / ... together; per-expert
weights under their fused expert tensor), and `plan` checks every shape, dtype and scale and returns, per file,
the source factory of each variable (`interop.placement`), before any tensor is read. Every problem is a one-line
`CheckpointError` naming the tensor. `prepare_load` runs these for one model and checkpoint directory into a
`LoadPlan`, whose `read` gives every variable's source file by file (shared by `interop.hf.load_weights` and
`interop.qlora_load`). Dequantization itself: `interop.quantized`.
`stored_quantized` / `stacked_quantized` read an FP8 or NVFP4 weight's stored values and scales as they are (no
dequantization), for a base kept quantized on the device (QLoRA, `interop.qlora_load`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import read_json
from hackable_diffusion.interop import quantized
from hackable_diffusion.interop.names import hf_tensor_names, is_vision, iter_variables, tied_decoder_name
from hackable_diffusion.interop.placement import DequantizedTensor, FiniteTensor, StoredTensor, TensorSource
from hackable_diffusion.interop.safetensors_io import open_safetensors, read_header, read_tensor, weight_files

# a per-expert weight (vLLM / llm-compressor layout) -> the fused `experts.gate_up_proj` / `experts.down_proj`
_PER_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class Location:
  """Where one stored tensor is: its file, that file's safetensors header and where its tensor data starts."""

  file: str
  header: Mapping[str, Any]
  start: int

  def part(self, name: str) -> quantized.StoredPart:
    return quantized.StoredPart(name, self.header[name]["dtype"], tuple(self.header[name]["shape"]))


def locate(files: list[str]) -> dict[str, Location]:
  """Every stored tensor of `files` (by name) -> its `Location`; reads only the headers."""
  where: dict[str, Location] = {}
  for file in files:
    header, start = read_header(file)
    where.update({name: Location(file, header, start) for name in header if name != "__metadata__"})
  return where


def _split_part(name: str) -> tuple[str, str]:
  """A stored name -> (its layer's weight name, part): `X.weight_scale` -> (`X.weight`, 'weight_scale'); any other
  name is its own weight (`X.weight`, `experts.gate_up_proj`, `layer_scalar`) with part 'weight'."""
  for part in quantized.WEIGHT_PARTS + quantized.ACTIVATION_PARTS:
    if name.endswith("." + part):
      return name[: -len(part)] + "weight", part
  return name, "weight"


@dataclasses.dataclass
class Layer:
  """The stored parts (part -> stored name) of one weight, and the file of its first part."""

  file: str
  parts: dict[str, str] = dataclasses.field(default_factory=dict)


def _stored_parts(layer: Layer, where: Mapping[str, Location]) -> dict[str, quantized.StoredPart]:
  return {part: where[name].part(name) for part, name in layer.parts.items()}


def _read_stored(name: str, where: Mapping[str, Location]) -> np.ndarray:
  loc = where[name]
  return read_tensor(loc.file, name, loc.header, loc.start)


def _dense_or_dequantized(layer: Layer, where: Mapping[str, Location]) -> np.ndarray:
  """A (checked) layer's value in the stored layout: the dense tensor, or float32 dequantized from its parts."""
  if quantized.quantized_kind(layer.parts) is None:
    return _read_stored(layer.parts["weight"], where)
  return quantized.dequantize(quantized.read_quantized(layer.parts, lambda name: _read_stored(name, where)))


def _check_layer(key: str, layer: Layer, where: Mapping[str, Location],
                 config: quantized.QuantizationConfig | None) -> tuple[int, ...]:
  """The stored (torch-layout) dense shape of one layer, after checking its parts (`quantized.check_quantized`)."""
  parts = _stored_parts(layer, where)
  shape = quantized.check_quantized(key, layer.file, parts, config)
  return parts["weight"].shape if shape is None else shape


def _check_shape(file: str, name: str, stored_shape: tuple[int, ...], var: nnx.Variable, transpose: bool) -> None:
  shape = stored_shape[::-1] if transpose else stored_shape
  if shape != tuple(var.shape):
    expected = tuple(var.shape[::-1]) if transpose else tuple(var.shape)
    raise CheckpointError(f"{file}: tensor {name!r} has shape {stored_shape}, expected {expected}")


def _fused_expert_name(match: re.Match[str]) -> str:
  return match["experts"] + (".down_proj" if match["proj"] == "down_proj" else ".gate_up_proj")


def _stacked_experts(target: str, pieces: Mapping[tuple[int, str], str], layers: Mapping[str, Layer],
                     where: Mapping[str, Location], config: quantized.QuantizationConfig | None,
                     var: nnx.Variable) -> Callable[[], np.ndarray]:
  """Checks the per-expert weights of one fused expert tensor `target` and returns its reader: `gate_up_proj`
  `[E, 2I, H]` stacks `experts.N.gate_proj` then `up_proj` (`[I, H]` each), `down_proj` `[E, H, I]` stacks
  `experts.N.down_proj`."""
  num, *rest = var.shape
  projs = ("gate_proj", "up_proj") if target.endswith("gate_up_proj") else ("down_proj",)
  piece_shape = (rest[0] // len(projs), rest[1])
  prefix = target.rsplit(".", 1)[0]
  for (index, proj), key in sorted(pieces.items()):
    if index >= num:
      raise CheckpointError(f"{layers[key].file}: unexpected tensor {key!r} "
                            f"(the model has {num} experts)")
  for index in range(num):
    for proj in projs:
      key = f"{prefix}.{index}.{proj}.weight"
      if (index, proj) not in pieces:
        raise CheckpointError(f"{layers[next(iter(pieces.values()))].file}: missing tensor {key!r} "
                              f"(the other experts of {target!r} are stored one by one)")
      layer = layers[key]
      stored = _check_layer(key, layer, where, config)
      if tuple(stored) != piece_shape:
        raise CheckpointError(f"{layer.file}: tensor {key!r} has shape {tuple(stored)}, expected {piece_shape}")

  def read() -> np.ndarray:
    out = np.empty(tuple(var.shape), np.float32)
    for index in range(num):
      for j, proj in enumerate(projs):
        key = f"{prefix}.{index}.{proj}.weight"
        out[index, j * piece_shape[0]:(j + 1) * piece_shape[0]] = _dense_or_dequantized(layers[key], where)
    return out

  return read


def stored_quantized(layer: Layer, where: Mapping[str, Location], kind: str) -> tuple[np.ndarray, ...] | None:
  """A (checked) quantized layer of `kind` as stored, every part with the output axis first; None for a dense layer
  or another kind.

  FP8: (float8_e4m3fn values `[out, in]`, float32 scales `[out, 1]`: a per-tensor scale repeated for every channel,
  the same dense value `values * scale`). NVFP4: (uint8 FP4 codes `[out, in]`, unpacked, one per byte;
  float8_e4m3fn block scales `[out, in / 16]`; float32 global scales `[out, 1]`, the tensor's repeated)."""
  if quantized.quantized_kind(layer.parts) != kind:
    return None
  weight = quantized.read_quantized(layer.parts, lambda name: _read_stored(name, where))
  scale = np.asarray(weight.scale)
  if kind == quantized.NVFP4:
    codes = quantized.unpack_codes(np.asarray(weight.data, np.uint8))
    block = scale.view(jnp.float8_e4m3fn) if scale.dtype == np.uint8 else scale.astype(jnp.float8_e4m3fn)
    global_scale = np.asarray(weight.global_scale, np.float32).reshape(())
    return codes, block, np.full((codes.shape[0], 1), global_scale, np.float32)
  data = np.asarray(weight.data)
  data = data.view(jnp.float8_e4m3fn) if data.dtype == np.uint8 else data.astype(jnp.float8_e4m3fn)
  scale = (scale.view(jnp.float8_e4m3fn) if scale.dtype == np.uint8 else scale).astype(np.float32)
  return data, np.broadcast_to(scale.reshape(-1, 1), (data.shape[0], 1)).copy()


def stacked_quantized(target: str, pieces: Mapping[tuple[int, str], str], layers: Mapping[str, Layer],
                      where: Mapping[str, Location], num_experts: int, kind: str) -> tuple[np.ndarray, ...] | None:
  """The per-expert weights of one fused expert tensor as stored (`stored_quantized`), stacked like
  `_stacked_experts` (every part `[E, out, ...]`, gate and up concatenated along out); None unless every piece is of
  `kind`. Call after `plan` (which checks the pieces)."""
  projs = ("gate_proj", "up_proj") if target.endswith("gate_up_proj") else ("down_proj",)
  prefix = target.rsplit(".", 1)[0]
  keys = [[f"{prefix}.{index}.{proj}.weight" for proj in projs] for index in range(num_experts)]
  if any(quantized.quantized_kind(layers[k].parts) != kind for row in keys for k in row):
    return None
  experts = []
  for row in keys:
    read = [stored_quantized(layers[k], where, kind) for k in row]
    experts.append([np.concatenate(parts, axis=0) for parts in zip(*read)])
  return tuple(np.stack(parts) for parts in zip(*experts))


@dataclasses.dataclass
class Grouped:
  """A checkpoint's tensors grouped by the variable they fill."""

  layers: dict[str, Layer]  # weight name (decoder side) -> its stored parts (per-expert weights included)
  experts: dict[str, dict[tuple[int, str], str]]  # fused expert name -> {(index, proj): per-expert weight name}
  skipped_vision: int = 0
  skipped_activation: int = 0


def group(names: Mapping[str, Any], where: Mapping[str, Location],
          config: quantized.QuantizationConfig | None) -> Grouped:
  """Groups every stored tensor by its weight (skipping the vision tower when the model has none, activation scales
  and tied encoder copies whose decoder copy is stored); one-line `CheckpointError` for an unexpected tensor."""
  stored_keys = {_split_part(name)[0] for name in where}
  out = Grouped({}, {})
  for name, loc in where.items():
    if is_vision(name) and name not in names:
      out.skipped_vision += 1
      continue
    key, part = _split_part(name)
    if part in quantized.ACTIVATION_PARTS and config is not None:
      out.skipped_activation += 1
      continue
    if key not in names and tied_decoder_name(key) is not None:
      decoder_key = tied_decoder_name(key)
      if decoder_key in stored_keys:
        continue  # the decoder copy of this tied weight is stored too
      key = decoder_key  # a tied encoder copy stored explicitly
    match = _PER_EXPERT.match(key) if key not in names else None
    if match is not None and (target := _fused_expert_name(match)) in names:
      if target in stored_keys:
        raise CheckpointError(f"{loc.file}: tensor {name!r} is stored beside the fused {target!r}; expected one")
      out.experts.setdefault(target, {})[(int(match["index"]), match["proj"])] = key
    elif key not in names:
      raise CheckpointError(f"{loc.file}: unexpected tensor {name!r} (not part of a DiffusionGemma text model)")
    layer = out.layers.setdefault(key, Layer(loc.file))
    if part in layer.parts:
      raise CheckpointError(f"{loc.file}: tensor {name!r} is stored twice (also as {layer.parts[part]!r})")
    layer.parts[part] = name
  return out


# opens the source of one variable, given the safetensors handle of the file being read
SourceFactory = Callable[[Any], TensorSource]


def _dequantized_source(name: str, shape: tuple[int, ...], transpose: bool,
                        read: Callable[[], np.ndarray]) -> SourceFactory:
  # a fresh object per placement: its dequantized value is freed once the variable is placed
  return lambda _handle: DequantizedTensor(name, shape, transpose, read)


def plan(grouped: Grouped, names: Mapping[str, Any], variables: Mapping[Any, nnx.Variable],
         where: Mapping[str, Location], config: quantized.QuantizationConfig | None,
         files: list[str]) -> dict[str, list[tuple[str, SourceFactory]]]:
  """(variable's HF name, source factory) lists keyed by the file of each variable's first stored part, after
  checking every shape, dtype and scale (nothing is read yet)."""
  out: dict[str, list[tuple[str, SourceFactory]]] = {file: [] for file in files}
  for key, layer in grouped.layers.items():
    if key not in names:
      continue  # a per-expert piece: read with its fused tensor
    var_path, transpose = names[key]
    var = variables[var_path]
    stored_shape = _check_layer(key, layer, where, config)
    _check_shape(layer.file, layer.parts.get("weight", key), tuple(stored_shape), var, transpose)
    if quantized.quantized_kind(layer.parts) is None:
      loc = where[layer.parts["weight"]]
      factory = functools.partial(StoredTensor, loc.file, layer.parts["weight"], tuple(var.shape), transpose,
                                  loc.header, loc.start)
    else:
      factory = _dequantized_source(key, tuple(var.shape), transpose,
                                    functools.partial(_dense_or_dequantized, layer, where))
    out[layer.file].append((key, factory))
  for target, pieces in grouped.experts.items():
    var_path, transpose = names[target]
    var = variables[var_path]
    read = _stacked_experts(target, pieces, grouped.layers, where, config, var)
    out[grouped.layers[min(pieces.values())].file].append(
        (target, _dequantized_source(target, tuple(var.shape), transpose, read)))
  return out


@dataclasses.dataclass(frozen=True)
class LoadPlan:
  """The checked plan of loading the checkpoint at `path` into one abstract model (`prepare_load`).

  names: HF tensor name -> (our variable path, transpose?); variables: variable path -> the abstract variable;
  where / grouped: the stored tensors (`locate`, `group`); sources: per file, (HF name, source factory) of every
  variable whose first stored part is in it (`plan`).
  """

  path: str
  names: Mapping[str, tuple[Any, bool]]
  variables: Mapping[Any, nnx.Variable]
  where: Mapping[str, Location]
  grouped: Grouped
  sources: Mapping[str, list[tuple[str, SourceFactory]]]

  def read(self, *, check_finite: bool = True) -> Iterator[tuple[str, str, nnx.Variable, TensorSource]]:
    """(file, HF name, abstract variable, source) of every variable, file by file (each file open while its sources
    are read). `check_finite`: every read is checked for NaN and inf (`placement.FiniteTensor`; a one-line
    `CheckpointError` naming the tensor and the file). Once all are yielded: a `CheckpointError` naming a variable
    no stored tensor fills, and one warning per kind of skipped tensor (vision tower, activation scales)."""
    loaded: set[str] = set()
    for file, planned in self.sources.items():
      if not planned:
        continue
      with open_safetensors(file) as handle:
        for key, factory in planned:
          source = factory(handle)
          loaded.add(key)
          yield file, key, self.variables[self.names[key][0]], FiniteTensor(source, file) if check_finite else source
    missing = sorted(set(self.names) - loaded)
    if missing:
      more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
      raise CheckpointError(f"{self.path}: missing tensor {missing[0]!r}{more}")
    if self.grouped.skipped_vision:
      logging.warning("%s: skipped %d vision-tower tensors (the model is text-only: the checkpoint's tower is the "
                      "placeholder stub, or the config's vision was set to None)", self.path,
                      self.grouped.skipped_vision)
    if self.grouped.skipped_activation:
      logging.warning("%s: skipped %d activation-quantization tensors (input scales): activations run in full "
                      "precision, as with transformers' CompressedTensorsConfig(dequantize=True)", self.path,
                      self.grouped.skipped_activation)


def prepare_load(model: nnx.Module, path: str) -> LoadPlan:
  """The plan of loading the checkpoint directory `path` into `model` (built abstractly): its config.json's
  `quantization_config` parsed, every stored tensor located, grouped and checked against the model (`group`,
  `plan`) - every header read, no tensor yet."""
  names = hf_tensor_names(model)
  variables = dict(iter_variables(model))
  config_path = os.path.join(path, "config.json")
  config = None
  if os.path.exists(config_path):
    config = quantized.parse_quantization_config(read_json(config_path, error=CheckpointError), config_path)
  files = weight_files(path)
  where = locate(files)
  grouped = group(names, where, config)
  return LoadPlan(path, names, variables, where, grouped, plan(grouped, names, variables, where, config, files))


__all__ = ["Grouped", "Layer", "LoadPlan", "Location", "SourceFactory", "group", "locate", "plan", "prepare_load",
           "stacked_quantized", "stored_quantized"]
