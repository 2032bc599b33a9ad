"""The files of a HF checkpoint directory: which safetensors files hold its weights, their headers, and reading.

Owns the file names (`WEIGHTS_NAME`, `INDEX_NAME`, the index's `weight_map`), the safetensors header format and
plain-file reads of single tensors (no memory map: the file's pages never count as resident memory), plus lazy
iteration over every stored tensor (`iter_tensors`) and the checkpoint's size on disk (`checkpoint_nbytes`).
Every malformed, missing or truncated file is a one-line `CheckpointError` naming the file; a header's declared
sizes are checked against the file's before anything of their size is read.
"""

from __future__ import annotations

import json
import math
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
  """The safetensors JSON header of `file` and the byte offset where tensor data starts.

  The declared header length and every tensor's byte range are checked against the file's size before anything of
  that size is read or allocated (a corrupt or hostile length is a one-line `CheckpointError` naming the file,
  never a `MemoryError`), and every entry's `dtype` / `shape` / `data_offsets` against each other."""
  try:
    with open(file, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      (n,) = struct.unpack("<Q", f.read(8))
      text = f.read(n) if n <= size - 8 else None
    header = json.loads(text) if text is not None else None
  except (OSError, struct.error, ValueError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
  if text is None:
    raise CheckpointError(f"{file}: not a readable safetensors file (its header declares {n} bytes, the file has "
                          f"{size - 8} after the length)")
  if not isinstance(header, dict):
    raise CheckpointError(f"{file}: not a readable safetensors file (its header is not a JSON object)")
  for name, entry in header.items():
    if name != "__metadata__":
      _check_entry(file, name, entry, size - 8 - n)
  return header, 8 + n


def _check_entry(file: str, name: str, entry: Any, data_size: int) -> None:
  """One header entry: its layout, a byte range inside the file's `data_size` bytes of tensor data, and (for a
  dtype we read) as many bytes as its shape needs."""
  entry = entry if isinstance(entry, dict) else {}
  dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
  if not (isinstance(dtype, str) and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
          and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
    raise CheckpointError(f"{file}: malformed safetensors header entry for tensor {name!r} (expected dtype, shape "
                          "and data_offsets [begin, end])")
  begin, end = offsets
  if not 0 <= begin <= end <= data_size:
    raise CheckpointError(f"{file}: tensor {name!r} declares bytes [{begin}, {end}) but the file holds {data_size} "
                          "bytes of tensor data (truncated or corrupt)")
  if dtype in _ST_DTYPES and end - begin != (need := math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize):
    raise CheckpointError(f"{file}: tensor {name!r} ({dtype} {tuple(shape)}) declares {end - begin} bytes, "
                          f"expected {need}")


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
