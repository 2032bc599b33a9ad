"""The files of a HF checkpoint directory: which safetensors files hold its weights, their headers, and reading.

Owns the file names (`WEIGHTS_NAME`, `INDEX_NAME`, the index's `weight_map`), the safetensors header format and
plain-file reads of single tensors (no memory map: the file's pages never count as resident memory), plus lazy
iteration over every stored tensor (`iter_tensors`) and the checkpoint's size on disk (`checkpoint_nbytes`).
Every malformed, missing or truncated file is a one-line `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import read_json

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
  """The safetensors files of the checkpoint directory `path`: the shards its index lists, or its single file."""
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


def open_safetensors(file: str):
  """`file` opened by safetensors (a context manager giving lazy slices, `get_slice` / `get_tensor`)."""
  try:
    return safe_open(file, framework="flax")
  except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
    raise CheckpointError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
              "F8_E4M3": jnp.float8_e4m3fn}  # F8_E4M3: read only as part of a quantized weight


def read_header(file: str) -> tuple[dict[str, Any], int]:
  """The safetensors JSON header of `file` and the byte offset where tensor data starts."""
  try:
    with open(file, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      return json.loads(f.read(n)), 8 + n
  except (OSError, struct.error, ValueError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def read_tensor(file: str, name: str, header: Mapping[str, Any], start: int) -> np.ndarray:
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
  for file in weight_files(path):
    with open_safetensors(file) as f:
      for name in f.keys():
        yield file, name, f


def checkpoint_nbytes(path: str) -> int:
  """The total size on disk of the safetensors files of the checkpoint directory `path`."""
  return sum(os.path.getsize(f) for f in weight_files(path))


__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "checkpoint_nbytes", "iter_tensors", "open_safetensors", "read_header",
           "read_tensor", "weight_files"]
