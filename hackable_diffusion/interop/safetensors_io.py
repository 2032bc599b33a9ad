"""The files of a HF checkpoint directory: which safetensors files hold its weights, their headers, reading, and
writing them one tensor at a time.

Owns the file names (`WEIGHTS_NAME`, `INDEX_NAME`, the index's `weight_map`), the safetensors header format and
plain-file reads of single tensors (no memory map: the file's pages never count as resident memory), plus lazy
iteration over every stored tensor (`iter_tensors`) and the checkpoint's size on disk (`checkpoint_nbytes`).
Every malformed, missing or truncated file is a one-line `CheckpointError` naming the file; a header's declared
sizes are checked against the file's before anything of their size is read.

Writing (`ShardedWriter`): the names, shapes and dtypes of every tensor are known before any data (`TensorSpec`),
so the shards (`plan_shards`) and each file's header are fixed first and every tensor is written at its offset as
it arrives; nothing but the tensor being written is held. Each file is the one safetensors' own `save_file` writes
for the same tensors, byte for byte (tensors ordered by dtype, widest first, then by name; the JSON header padded
with spaces to a multiple of 8 bytes), written through a fresh temporary file and a rename.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import check_not_link, make_readable, open_new, read_json, write_json

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


# ---- writing -------------------------------------------------------------------------------------------------
# safetensors' dtype names, in the order its writer sorts them (widest first: its `Dtype` enum, reversed)
_WRITE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8",
                "U8", "BOOL")
_ST_NAMES = {"float64": "F64", "int64": "I64", "uint64": "U64", "float32": "F32", "uint32": "U32", "int32": "I32",
             "bfloat16": "BF16", "float16": "F16", "uint16": "U16", "int16": "I16", "float8_e4m3fn": "F8_E4M3",
             "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A tensor to be written: its name, shape and numpy / ml_dtypes dtype name ('bfloat16', 'float8_e4m3fn', ...)."""

  name: str
  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(jnp.dtype(self.dtype)).itemsize

  @property
  def st_dtype(self) -> str:
    if self.dtype not in _ST_NAMES:
      raise CheckpointError(f"tensor {self.name!r}: dtype {self.dtype} cannot be written to safetensors")
    return _ST_NAMES[self.dtype]


def spec_of(name: str, array: Any) -> TensorSpec:
  return TensorSpec(name, tuple(int(d) for d in array.shape), jnp.dtype(array.dtype).name)


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
  """`specs` in order, cut into files of at most `max_shard_size` bytes (a larger tensor gets a file of its own):
  a new file starts where the next tensor would overflow a non-empty one."""
  shards: list[list[TensorSpec]] = [[]]
  size = 0
  for spec in specs:
    if size and size + spec.nbytes > max_shard_size:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += spec.nbytes
  return shards


def shard_names(count: int) -> list[str]:
  """The file names of a checkpoint of `count` files (`model.safetensors`, or `model-0000i-of-0000N.safetensors`)."""
  return [WEIGHTS_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def file_layout(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
                ) -> tuple[bytes, dict[str, int]]:
  """(the file's first bytes: length + JSON header, each tensor's byte offset from the file's start) of a
  safetensors file holding `specs`, laid out as safetensors' `save_file` lays them out."""
  names = [s.name for s in specs]
  if len(set(names)) != len(names):
    raise CheckpointError(f"duplicate tensor names {sorted({n for n in names if names.count(n) > 1})[:3]}")
  ordered = sorted(specs, key=lambda s: (_WRITE_ORDER.index(s.st_dtype), s.name))
  header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
  begin, offsets = 0, {}
  for s in ordered:
    header[s.name] = {"dtype": s.st_dtype, "shape": list(s.shape), "data_offsets": [begin, begin + s.nbytes]}
    offsets[s.name] = begin
    begin += s.nbytes
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  start = 8 + len(text)
  return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in offsets.items()}


def _write_error(file: str, e: BaseException) -> CheckpointError:
  reason = (e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())) or type(e).__name__
  return CheckpointError(f"cannot write {file}: {reason}")


class _OpenFile:
  """One safetensors file being written: its header is written at once, the tensors at their offsets as they come;
  `close` renames the temporary file into place once every tensor is in."""

  def __init__(self, file: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None):
    self.file, self.tmp = check_not_link(file), file + ".tmp"
    head, self.offsets = file_layout(specs, metadata)
    self.left = {s.name for s in specs}
    if os.path.lexists(self.tmp):  # left by a killed export (or planted): removed, never followed
      os.remove(self.tmp)
    try:
      self.f = open_new(self.tmp)
      self.f.write(head)
    except OSError as e:
      self.abort()
      raise _write_error(self.file, e) from None

  def write(self, name: str, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # no copy of a contiguous array
    self.f.seek(self.offsets[name])
    self.f.write(memoryview(data))
    self.left.discard(name)

  def close(self) -> None:
    self.f.flush()
    os.fsync(self.f.fileno())
    self.f.close()
    make_readable(self.tmp)
    os.replace(self.tmp, self.file)

  def abort(self) -> None:
    f = getattr(self, "f", None)
    if f is not None and not f.closed:
      f.close()
    if os.path.lexists(self.tmp):
      os.remove(self.tmp)


class ShardedWriter:
  """Writes the checkpoint files of `specs` into `path` tensor by tensor (`write`), then its index (`finish`).

  The files are cut by `plan_shards`; a file is opened at its first tensor and renamed into place at its last, so
  tensors given in `specs`' order keep one file open at a time. Each tensor is checked against its spec (name,
  shape, dtype). A failure (a full disk) is a one-line `CheckpointError` naming the file and leaves no temporary
  file (use it as a context manager). A single file replaces a stale index; several get
  `model.safetensors.index.json` (`total_size`: the tensors' bytes; `weight_map`: name -> file).
  """

  def __init__(self, path: str, specs: Sequence[TensorSpec], *, max_shard_size: int,
               metadata: Mapping[str, str] | None = None):
    self.path, self.metadata = path, metadata
    self.shards = plan_shards(specs, max_shard_size)
    self.files = [os.path.join(path, n) for n in shard_names(len(self.shards))]
    self.where = {s.name: (i, s) for i, shard in enumerate(self.shards) for s in shard}
    if len(self.where) != len(specs):
      names = [s.name for s in specs]
      raise CheckpointError(f"duplicate tensor names {sorted({n for n in names if names.count(n) > 1})[:3]}")
    self.open: dict[int, _OpenFile] = {}
    self.done: set[int] = set()

  def __enter__(self) -> ShardedWriter:
    return self

  def __exit__(self, *exc: Any) -> None:
    for f in self.open.values():
      f.abort()
    self.open.clear()

  def write(self, name: str, array: np.ndarray) -> None:
    if name not in self.where:
      raise CheckpointError(f"tensor {name!r} is not in the planned checkpoint layout")
    i, spec = self.where[name]
    got = spec_of(name, array)
    if got != spec:
      raise CheckpointError(f"tensor {name!r}: {got.dtype} {got.shape}, planned {spec.dtype} {spec.shape}")
    if i in self.done or (i in self.open and name not in self.open[i].left):
      raise CheckpointError(f"tensor {name!r} written twice")
    if i not in self.open:
      self.open[i] = _OpenFile(self.files[i], self.shards[i], self.metadata)
    f = self.open[i]
    try:
      f.write(name, array)
      if not f.left:
        del self.open[i]
        f.close()
        self.done.add(i)
    except OSError as e:
      f.abort()
      self.open.pop(i, None)
      raise _write_error(f.file, e) from None

  def write_all(self, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    for name, array in tensors:
      self.write(name, array)

  def finish(self) -> list[str]:
    """Checks that every planned tensor was written, writes (or removes a stale) index; returns the files."""
    for i, shard in enumerate(self.shards):
      if i not in self.done and shard:
        missing = [s.name for s in shard if i not in self.open or s.name in self.open[i].left]
        raise CheckpointError(f"{self.files[i]}: tensors never written: {missing[:3]}")
    index = os.path.join(self.path, INDEX_NAME)
    if len(self.shards) == 1:
      if os.path.lexists(index):
        os.remove(index)
      if not self.shards[0]:  # no tensors at all: still a valid (empty) file
        _OpenFile(self.files[0], [], self.metadata).close()
    else:
      weight_map = {s.name: os.path.basename(self.files[i]) for i, shard in enumerate(self.shards) for s in shard}
      total = sum(s.nbytes for shard in self.shards for s in shard)
      write_json(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return self.files


def write_file(file: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> str:
  """One safetensors file of `tensors` (the bytes safetensors' `save_file` writes), through a temporary file and
  a rename; a symbolic link at `file` is refused, never followed."""
  f = _OpenFile(file, [spec_of(n, a) for n, a in tensors.items()], metadata)
  try:
    for name, array in tensors.items():
      f.write(name, np.asarray(array))
    f.close()
  except OSError as e:
    f.abort()
    raise _write_error(file, e) from None
  return file


__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "ShardedWriter", "TensorSpec", "checkpoint_nbytes", "file_layout",
           "iter_tensors", "open_safetensors", "plan_shards", "read_header", "read_tensor", "shard_names", "spec_of",
           "weight_files", "write_file"]
