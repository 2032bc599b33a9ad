"""Tensor sources and their placement: how one variable's value is read from a checkpoint and put on devices.

A `TensorSource` is one variable's value in our layout, read whole or block by block: `StoredTensor` (one stored
tensor, transposed from torch's `[out, in]` when needed) or `DequantizedTensor` (a quantized or per-expert weight,
made dense on the host), either checked for NaN and inf as it is read (`FiniteTensor`). A `Placement` turns a
source into the variable's array: on one device (`place_on_host`) or straight into its shards on a mesh
(`place_in_shards`, each device reading only its own slice). Which stored tensors make up which source is the
loading plan's business (`interop.load_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.interop.safetensors_io import read_tensor
from hackable_diffusion.sharding.logical import LOGICAL_AXIS_RULES, Rules, logical_to_mesh_spec, variable_axes


class TensorSource(Protocol):
  """What a placement reads: one variable's value in our layout (`shape` is ours), whole or block by block."""

  name: str
  shape: tuple[int, ...]

  def read(self) -> np.ndarray: ...

  def read_block(self, index: tuple[slice, ...]) -> np.ndarray: ...


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
    tensor = read_tensor(self.file, self.name, self.header, self.data_start)
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


class DequantizedTensor:
  """A variable whose stored form is quantized (compressed-tensors) or split per expert: `read_stored()` gives its
  dense float32 value in the stored (torch) layout. `read_block` dequantizes the whole tensor once (kept until the
  placement drops this object) and slices it: a quantized block's scales need not line up with the mesh's slices."""

  def __init__(self, name: str, shape: tuple[int, ...], transpose: bool, read_stored: Callable[[], np.ndarray]):
    self.name, self.shape, self.transpose, self._read_stored = name, shape, transpose, read_stored
    self._value: np.ndarray | None = None

  def read(self) -> np.ndarray:
    if self._value is None:
      value = self._read_stored()
      self._value = value.T if self.transpose else value
    return self._value

  def read_block(self, index: tuple[slice, ...]) -> np.ndarray:
    return self.read()[tuple(index)]


def all_finite(value: np.ndarray) -> bool:
  """Whether every element of `value` is finite (integer arrays always are). One reduction in the common case: a
  NaN or inf element makes the float32 sum non-finite, so a finite sum proves them all finite; only a non-finite
  sum (a bad element, or finite values whose sum overflows) is checked element by element."""
  value = np.asarray(value)
  if value.dtype.kind in "biu":
    return True
  with np.errstate(over="ignore", invalid="ignore"):
    if np.isfinite(value.sum(dtype=np.float64 if value.dtype == np.float64 else np.float32)):
      return True
  return bool(np.isfinite(value).all())


def check_finite(value: np.ndarray, file: str, name: str) -> np.ndarray:
  """`value`, after a one-line `CheckpointError` naming the tensor and its file when it holds a NaN or an inf."""
  if not all_finite(value):
    raise CheckpointError(f"{file}: tensor {name!r} holds non-finite values (NaN or inf); refusing to load it "
                          "(check_finite=False loads it anyway)")
  return value


@dataclasses.dataclass(frozen=True)
class FiniteTensor:
  """A `TensorSource` whose every read (whole or block) is checked for NaN and inf (`check_finite`); `file` names
  where the tensor is stored."""

  source: TensorSource
  file: str

  @property
  def name(self) -> str:
    return self.source.name

  @property
  def shape(self) -> tuple[int, ...]:
    return self.source.shape

  def read(self) -> np.ndarray:
    return check_finite(self.source.read(), self.file, self.name)

  def read_block(self, index: tuple[slice, ...]) -> np.ndarray:
    return check_finite(self.source.read_block(index), self.file, self.name)


# (what a variable is read from, the abstract variable it fills) -> its value
Placement = Callable[[TensorSource, nnx.Variable], jax.Array]


def place_on_host(tensor: TensorSource, var: nnx.Variable) -> jax.Array:
  """The whole tensor read on the host and cast to the variable's dtype, on the default device."""
  return jnp.asarray(tensor.read(), dtype=var.dtype)


def place_in_shards(mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES) -> Placement:
  """Every tensor straight into its `NamedSharding` on `mesh` (by the variable's logical axes and `rules`).

  Each device reads only its own slice from the file (`jax.make_array_from_callback`), so neither the model nor a
  whole large tensor is ever gathered in one host buffer or device. Multi-host: every process reads the slices its
  devices hold. Quantized or per-expert weights are the exception: each is read whole, dequantized (with its
  scales) and stacked on the host, then sliced (`DequantizedTensor`).
  """

  def place(tensor: TensorSource, var: nnx.Variable) -> jax.Array:
    spec = logical_to_mesh_spec(variable_axes(var), rules=rules, mesh=mesh, shape=tensor.shape)
    return jax.make_array_from_callback(tensor.shape, NamedSharding(mesh, spec),
                                        lambda index: np.asarray(tensor.read_block(index)).astype(var.dtype))

  return place


__all__ = ["DequantizedTensor", "FiniteTensor", "Placement", "StoredTensor", "TensorSource", "all_finite",
           "check_finite", "place_in_shards", "place_on_host"]
