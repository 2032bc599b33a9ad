"""Hugging Face DiffusionGemma checkpoints, both ways.

Layout written by transformers' `DiffusionGemmaForBlockDiffusion.save_pretrained`: `config.json` with a
`text_config`, weights stored once under `model.decoder.*` (encoder and decoder text weights are tied), the
encoder's own `layer_scalar` buffers under `model.encoder.language_model.layers.N.layer_scalar`, and a vision
tower under `model.encoder.vision_tower.*` / `model.encoder.embed_vision.*` (the name mapping: `interop.names`).
Our model has one set of text weights; loading maps the names onto it tensor by tensor (never two full copies in
memory) and skips the vision tower (text-only); saving writes every name transformers expects, with a tiny vision
stub (or the vision tower of a source checkpoint) so that `from_pretrained` reports no missing or unexpected keys.

Loading is one loop over the stored tensors with a per-tensor *placement* function: on one device
(`place_on_host`: read the tensor, cast, transpose) or straight into its shards on a mesh (`place_in_shards`:
every device reads only its own slice).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import flax as safetensors_flax
from safetensors import safe_open
from safetensors.numpy import save_file

from hackable_diffusion.errors import CheckpointError, ConfigError
from hackable_diffusion.files import read_json, write_json
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.interop.names import hf_name, hf_tensor_names, is_vision, iter_variables, tied_decoder_name
from hackable_diffusion.lora.adapters import has_lora
from hackable_diffusion.model.config import TINY_VISION_CONFIG, ModelConfig
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.sharding.logical import LOGICAL_AXIS_RULES, Rules, logical_to_mesh_spec, variable_axes

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


# ---- reading --------------------------------------------------------------------------------------------------
def _weight_files(path: str) -> list[str]:
  index = os.path.join(path, INDEX_NAME)
  single = os.path.join(path, WEIGHTS_NAME)
  if os.path.exists(index):
    weight_map = read_json(index, error=CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: malformed index (no 'weight_map' object)")
    files = sorted(set(weight_map.values()))
    for name in files:
      if not os.path.exists(os.path.join(path, name)):
        raise CheckpointError(f"{index}: lists shard {name!r}, which does not exist")
    return [os.path.join(path, name) for name in files]
  if os.path.exists(single):
    return [single]
  raise CheckpointError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}")


def _open(file: str):
  try:
    return safe_open(file, framework="flax")
  except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
    raise CheckpointError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _header(file: str) -> tuple[dict[str, Any], int]:
  """The safetensors JSON header of `file` and the byte offset where tensor data starts."""
  try:
    with open(file, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      return json.loads(f.read(n)), 8 + n
  except (OSError, struct.error, ValueError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _read_tensor(file: str, name: str, header: Mapping[str, Any], start: int) -> np.ndarray:
  """Reads one tensor with plain file I/O (no memory map: the file's pages never count as resident memory)."""
  entry = header[name]
  if entry["dtype"] not in _ST_DTYPES:
    raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {entry['dtype']}")
  begin, end = entry["data_offsets"]
  with open(file, "rb") as f:
    f.seek(start + begin)
    data = f.read(end - begin)
  if len(data) != end - begin:
    raise CheckpointError(f"{file}: tensor {name!r} is truncated ({len(data)} of {end - begin} bytes)")
  return np.frombuffer(data, dtype=_ST_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def iter_tensors(path: str) -> Iterator[tuple[str, str, Any]]:
  """Yields (file, name, lazy slice handle) over every tensor of a checkpoint directory, one file open at a time."""
  for file in _weight_files(path):
    with _open(file) as f:
      for name in f.keys():
        yield file, name, f


def load_config(path: str, **overrides: Any) -> ModelConfig:
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
  at the top level or in `text_config`; 'float32' when it records none. One-line `CheckpointError` for another."""
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
  return "float32"


def resolve_dtype(path: str, dtype: Any) -> Any:
  """`dtype`, or the checkpoint's own (`checkpoint_dtype`) when it is 'auto'."""
  return checkpoint_dtype(path) if isinstance(dtype, str) and dtype == "auto" else dtype


@dataclasses.dataclass(frozen=True)
class StoredTensor:
  """One stored tensor as the variable it loads into sees it: `shape` is ours (the stored one reversed when
  `transpose`: torch kernels are `[out, in]`, ours `[in, out]`). Valid while its file is open (inside the loop)."""

  file: str
  name: str
  shape: tuple[int, ...]
  transpose: bool
  header: Mapping[str, Any]  # the file's safetensors header
  data_start: int  # byte offset of the file's tensor data
  handle: Any  # the file opened by safetensors (lazy slices)

  def read(self) -> np.ndarray:
    """The whole tensor in our layout, read with plain file I/O (a transposed view of the stored bytes)."""
    tensor = _read_tensor(self.file, self.name, self.header, self.data_start)
    return tensor.T if self.transpose else tensor

  def read_block(self, index: tuple[slice, ...]) -> np.ndarray:
    """The block `index` (slices of our layout) of the tensor; only that block is read from the file."""
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    try:
      stored = self.handle.get_slice(self.name)
      block = stored[index[::-1]] if self.transpose else stored[index]
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for truncated data
      raise CheckpointError(f"{self.file}: cannot read tensor {self.name!r} ({str(e).splitlines()[0]})") from None
    block = np.asarray(block)
    return block.T if self.transpose else block


# (stored tensor, the abstract variable it fills) -> its value
Placement = Callable[[StoredTensor, nnx.Variable], jax.Array]


def place_on_host(tensor: StoredTensor, var: nnx.Variable) -> jax.Array:
  """The whole tensor read on the host and cast to the variable's dtype, on the default device."""
  return jnp.asarray(tensor.read(), dtype=var.dtype)


def place_in_shards(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Placement:
  """Every tensor straight into its `NamedSharding` on `mesh` (by the variable's logical axes and `rules`).

  Each device reads only its own slice from the file (`jax.make_array_from_callback`), so neither the model nor a
  whole large tensor is ever gathered in one host buffer or device. Multi-host: every process reads the slices its
  devices hold.
  """

  def place(tensor: StoredTensor, var: nnx.Variable) -> jax.Array:
    spec = logical_to_mesh_spec(variable_axes(var), rules=rules, mesh=mesh, shape=tensor.shape)
    return jax.make_array_from_callback(tensor.shape, NamedSharding(mesh, spec),
                                        lambda index: tensor.read_block(index).astype(var.dtype))

  return place


def load_weights(model: nnx.Module, path: str, place: Placement = place_on_host) -> nnx.Module:
  """Fills every variable of `model` (built abstractly: `nnx.eval_shape`) from the checkpoint at `path`.

  Tensors are read one at a time and placed by `place`; the vision tower is skipped with one warning; a tied
  encoder copy stored next to its decoder copy is skipped. Raises `CheckpointError` naming the tensor for a missing
  tensor, an unexpected tensor, or a shape mismatch.
  """
  names = hf_tensor_names(model)
  variables = dict(iter_variables(model))
  loaded: set[str] = set()
  skipped_vision = 0
  stored = {name for _, name, _ in iter_tensors(path)}  # headers only
  headers: dict[str, tuple[dict[str, Any], int]] = {}
  for file, name, handle in iter_tensors(path):
    if is_vision(name):
      skipped_vision += 1
      continue
    key = name
    if name not in names and tied_decoder_name(name) is not None:
      key = tied_decoder_name(name)  # a tied encoder copy stored explicitly
      if key in stored:
        continue  # the decoder copy of this tied weight is stored too
    if key not in names:
      raise CheckpointError(f"{file}: unexpected tensor {name!r} (not part of a DiffusionGemma text model)")
    var_path, transpose = names[key]
    var = variables[var_path]
    if file not in headers:
      headers = {file: _header(file)}  # one file at a time
    header, start = headers[file]
    stored_shape = tuple(header[name]["shape"])
    shape = stored_shape[::-1] if transpose else stored_shape
    if shape != tuple(var.shape):
      expected = tuple(var.shape[::-1]) if transpose else tuple(var.shape)
      raise CheckpointError(f"{file}: tensor {name!r} has shape {stored_shape}, expected {expected}")
    var.set_value(place(StoredTensor(file, name, shape, transpose, header, start, handle), var))
    loaded.add(key)
  missing = sorted(set(names) - loaded)
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}")
  if skipped_vision:
    logging.warning("%s: skipped %d vision-tower tensors (hackable_diffusion is text-only)", path, skipped_vision)
  return model


def load_pretrained(path: str, dtype: Any = "auto", *, compute_dtype: Any = None, adapter: str | None = None,
                    mesh: Mesh | None = None, rules: Rules = LOGICAL_AXIS_RULES,
                    **config_overrides: Any) -> DiffusionGemma:
  """Loads a HF DiffusionGemma directory (config.json + safetensors, sharded or not) into `DiffusionGemma`.

  `dtype`: parameter dtype (also the compute dtype unless `compute_dtype` is given); 'auto' (default): the dtype
  the checkpoint was saved in (`checkpoint_dtype`: bfloat16 for the released models). Tensors are read one at a
  time and cast on the fly (peak memory: the model plus one tensor in transit); the vision tower is skipped with
  one warning. `mesh`: every tensor goes straight into its `NamedSharding` on the mesh (by `rules`), each device
  reading only its own slice (`place_in_shards`). Raises `CheckpointError` naming the tensor for a missing tensor,
  an unexpected tensor, or a shape mismatch. `adapter`: a PEFT adapter directory to apply on top (see
  `hackable_diffusion.interop.peft`). `config_overrides`: `ModelConfig` fields to override.
  """
  dtype = jnp.dtype(resolve_dtype(path, dtype))
  compute = jnp.dtype(compute_dtype) if compute_dtype is not None else dtype
  config = load_config(path, param_dtype=dtype.name, dtype=compute.name, **config_overrides)
  model = nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))
  load_weights(model, path, place_on_host if mesh is None else place_in_shards(mesh, rules))
  if adapter is not None:
    model = peft_io.load_adapter(model, adapter)
  return model


# ---- writing --------------------------------------------------------------------------------------------------
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _vision_stub(hidden: int, vision: dict[str, Any]) -> dict[str, np.ndarray]:
  """Minimal vision tower weights for `TINY_VISION_CONFIG` (transformers always builds one)."""
  vh, inter, hd = vision["hidden_size"], vision["intermediate_size"], vision["head_dim"]
  heads, kv, patch = vision["num_attention_heads"], vision["num_key_value_heads"], vision["patch_size"]
  rng = np.random.default_rng(0)
  normal = lambda *s: (0.02 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
  ones = lambda *s: np.ones(s, np.float32)  # noqa: E731
  out = {
      "model.encoder.embed_vision.embedding_projection.weight": normal(hidden, vh),
      "model.encoder.vision_tower.patch_embedder.input_proj.weight": normal(vh, 3 * patch * patch),
      "model.encoder.vision_tower.patch_embedder.position_embedding_table":
          ones(2, vision["position_embedding_size"], vh),
  }
  for i in range(vision["num_hidden_layers"]):
    p = f"model.encoder.vision_tower.encoder.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
      out[p + norm + ".weight"] = ones(vh)
    out[p + "self_attn.q_norm.weight"] = ones(hd)
    out[p + "self_attn.k_norm.weight"] = ones(hd)
    out[p + "self_attn.q_proj.linear.weight"] = normal(heads * hd, vh)
    out[p + "self_attn.k_proj.linear.weight"] = normal(kv * hd, vh)
    out[p + "self_attn.v_proj.linear.weight"] = normal(kv * hd, vh)
    out[p + "self_attn.o_proj.linear.weight"] = normal(vh, heads * hd)
    out[p + "mlp.gate_proj.linear.weight"] = normal(inter, vh)
    out[p + "mlp.up_proj.linear.weight"] = normal(inter, vh)
    out[p + "mlp.down_proj.linear.weight"] = normal(vh, inter)
  return out


def _to_numpy(x: jax.Array, dtype: str) -> np.ndarray:
  return np.asarray(jnp.asarray(x, dtype=jnp.dtype(dtype)))


def save_pretrained(model: DiffusionGemma, path: str, *, dtype: str | None = None, max_shard_size: int = 4 << 30,
                    vision_source: str | None = None, extra_config: dict[str, Any] | None = None) -> None:
  """Writes a directory that transformers' `DiffusionGemmaForBlockDiffusion.from_pretrained` loads.

  `dtype`: storage dtype (default: the model's parameter dtype). Shards above `max_shard_size` bytes, with an
  index. `vision_source`: a HF checkpoint whose vision tower and vision config are copied (default: a tiny stub,
  since transformers always builds a vision tower). Refuses a model whose attention structure the reference
  cannot run.
  """
  config = model.config
  if has_lora(model):
    raise CheckpointError("the model has LoRA adapters: merge them first (hackable_diffusion.lora.merge, or "
                          "interop.export.export_merged)")
  if config.attention_structure is not None:
    raise CheckpointError(
        f"model uses attention_structure={config.attention_structure!r}, which transformers/vLLM cannot run; "
        "export a pure-architecture model (configs/sudoku_pure.py) instead"
    )
  dtype = dtype or config.param_dtype
  if dtype not in _TORCH_DTYPES:
    raise CheckpointError(f"unsupported save dtype {dtype!r}; expected one of {sorted(_TORCH_DTYPES)}")
  os.makedirs(path, exist_ok=True)
  hf_config = config.to_hf_config(torch_dtype=dtype)
  if vision_source is not None:
    src = read_json(os.path.join(vision_source, "config.json"), error=CheckpointError)
    for key in ("vision_config", "boi_token_id", "eoi_token_id", "image_token_id"):
      if key in src:
        hf_config[key] = src[key]
  if extra_config:
    hf_config.update(extra_config)

  def tensors() -> Iterator[tuple[str, np.ndarray]]:
    for p, var in iter_variables(model):
      name, transpose = hf_name(p)
      value = var[...]
      yield name, _to_numpy(value.T if transpose else value, dtype)
    if vision_source is not None:
      for _, name, handle in iter_tensors(vision_source):
        if is_vision(name):
          yield name, np.asarray(jnp.asarray(handle.get_tensor(name)).astype(jnp.dtype(dtype)))
    else:
      for name, value in _vision_stub(config.hidden_size, TINY_VISION_CONFIG).items():
        yield name, _to_numpy(jnp.asarray(value), dtype)

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in tensors():
    if size and size + array.nbytes > max_shard_size:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(array)
    size += array.nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    _atomic_save(shards[0], os.path.join(path, WEIGHTS_NAME), metadata)
    stale = os.path.join(path, INDEX_NAME)
    if os.path.exists(stale):
      os.remove(stale)
  else:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      _atomic_save(shard, os.path.join(path, fname), metadata)
      for name, array in shard.items():
        weight_map[name] = fname
        total += array.nbytes
    write_json(os.path.join(path, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
  write_json(os.path.join(path, "config.json"), hf_config)


def _atomic_save(tensors: dict[str, np.ndarray], file: str, metadata: dict[str, str]) -> None:
  """Writes a safetensors file through a temporary file and a rename (streamed by safetensors, not via bytes)."""
  tmp = file + ".tmp"
  if any(a.dtype == jnp.bfloat16 for a in tensors.values()):  # numpy has no bf16 in safetensors' numpy writer
    safetensors_flax.save_file({k: jnp.asarray(v) for k, v in tensors.items()}, tmp, metadata=metadata)
  else:
    save_file(tensors, tmp, metadata=metadata)
  os.replace(tmp, file)


def checkpoint_nbytes(path: str) -> int:
  return sum(os.path.getsize(f) for f in _weight_files(path))


__all__ = ["CHECKPOINT_DTYPES", "INDEX_NAME", "WEIGHTS_NAME", "CheckpointError", "Placement", "StoredTensor",
           "checkpoint_dtype", "checkpoint_nbytes", "iter_tensors", "load_config", "load_pretrained", "load_weights",
           "place_in_shards", "place_on_host", "resolve_dtype", "save_pretrained"]
