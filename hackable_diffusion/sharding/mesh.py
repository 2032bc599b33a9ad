"""Device meshes: their shape (`MeshConfig`, also the `mesh` section of experiment configs) and multi-host setup.

Typical use (one process per host; on one host just skip `maybe_initialize_distributed`):

  cfg = MeshConfig(data=-1, fsdp=8)           # -1: whatever devices are left
  maybe_initialize_distributed(cfg)            # multi-host: before any other JAX call
  mesh = make_mesh(cfg)                        # axes ("data", "fsdp", "tensor", "expert")

Bad values raise `hackable_diffusion.errors.ConfigError` (a `ValueError`) with a one-line message naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh

from hackable_diffusion.errors import ConfigError, HackableDiffusionError, TrainingError
from hackable_diffusion.sharding.logical import MESH_AXES

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Shape of the device mesh and (optionally) how to join a multi-host job.

  Axis sizes: positive integers, or -1 on one axis for "all remaining devices". Their product must equal the
  number of devices (`jax.device_count()`, all hosts together).

  Multi-host (`maybe_initialize_distributed`): `coordinator_address` ("host:port" of process 0),
  `num_processes` and `process_id`, each falling back to the env vars `JAX_COORDINATOR_ADDRESS`,
  `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; or `auto_distributed=True` to let JAX detect the cluster (Cloud TPU
  pods, SLURM, Open MPI).
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto_distributed: bool = False

  def __post_init__(self):
    for name in MESH_AXES:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and value != -1):
        raise ConfigError(f"mesh.{name}={value!r}; expected a positive integer or -1 (all remaining devices)")
    rest = [name for name in MESH_AXES if getattr(self, name) == -1]
    if len(rest) > 1:
      raise ConfigError(f"mesh axes {rest} are all -1; at most one axis may take the remaining devices")
    if self.num_processes is not None and self.num_processes < 1:
      raise ConfigError(f"mesh.num_processes={self.num_processes!r}; expected >= 1")
    if self.process_id is not None and self.process_id < 0:
      raise ConfigError(f"mesh.process_id={self.process_id!r}; expected >= 0")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> MeshConfig:
    """From a plain mapping (e.g. `config.mesh` of an ml_collections config); unknown keys are an error."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ConfigError(f"unknown mesh config keys {unknown}; valid keys: {sorted(fields)}")
    return cls(**dict(values))

  def shape(self, num_devices: int | None = None) -> dict[str, int]:
    """Axis sizes `{data, fsdp, tensor, expert}` for `num_devices` (default: `jax.device_count()`)."""
    n = jax.device_count() if num_devices is None else int(num_devices)
    sizes = {name: getattr(self, name) for name in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    for name, value in sizes.items():
      if value == -1:
        if n % fixed:
          raise ConfigError(f"mesh {desc}: the fixed axes use {fixed} devices, which does not divide the {n} "
                            f"available devices (jax.device_count()={n})")
        sizes[name] = n // fixed
    if math.prod(sizes.values()) != n:
      raise ConfigError(f"mesh {desc} needs {math.prod(sizes.values())} devices but {n} are available "
                        f"(jax.device_count()={n}); set one axis to -1 to use all remaining devices")
    return sizes


def make_mesh(cfg: MeshConfig | None = None, *, devices: Sequence[Any] | None = None) -> Mesh:
  """A `Mesh` with axes `("data", "fsdp", "tensor", "expert")` over `devices` (default: all, every host).

  Axes are `AxisType.Auto` (XLA's sharding propagation; shardings are given at `jit` boundaries and by
  `with_sharding_constraint`). `jax.make_mesh` orders devices for the physical topology (TPU torus, NVLink):
  the last axes vary fastest, so keep the chattiest axis (`tensor`, then `expert`, then `fsdp`) within a host.
  """
  cfg = cfg or MeshConfig()
  devices = list(jax.devices() if devices is None else devices)
  sizes = cfg.shape(len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def maybe_initialize_distributed(cfg: MeshConfig | None = None, *, timeout_s: int = 300) -> bool:
  """Joins a multi-process JAX job when one is configured; returns True when running distributed.

  Must run before any other JAX call in the process (JAX's rule). Configured means: `cfg.auto_distributed`
  (JAX detects TPU pods / SLURM / Open MPI), or a coordinator address in `cfg` or `$JAX_COORDINATOR_ADDRESS`
  (then `num_processes` / `process_id` come from `cfg` or `$JAX_NUM_PROCESSES` / `$JAX_PROCESS_ID`).
  Otherwise nothing happens (single process). Calling it again is a no-op. `timeout_s`: how long to wait for every
  process to join (JAX's `initialization_timeout`; past it JAX aborts the process).
  """
  if jax.distributed.is_initialized():
    return True
  cfg = cfg or MeshConfig()
  address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  num = cfg.num_processes if cfg.num_processes is not None else _env_int("JAX_NUM_PROCESSES")
  pid = cfg.process_id if cfg.process_id is not None else _env_int("JAX_PROCESS_ID")
  if not cfg.auto_distributed and address is None:
    if num not in (None, 1):
      raise ConfigError(f"mesh.num_processes={num} but no coordinator address: set mesh.coordinator_address "
                        "(or $JAX_COORDINATOR_ADDRESS), or mesh.auto_distributed=True on a TPU pod / SLURM / MPI")
    return False
  if not cfg.auto_distributed and (num is None or pid is None):
    missing = "num_processes" if num is None else "process_id"
    raise ConfigError(f"mesh.coordinator_address={address!r} is set but mesh.{missing} is not (nor "
                      f"$JAX_{missing.upper()}); every process needs both")
  if num is not None and pid is not None and not 0 <= pid < num:
    raise ConfigError(f"mesh.process_id={pid} is outside [0, num_processes={num})")
  jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                             initialization_timeout=timeout_s)
  logging.info("joined distributed JAX job: process %d of %d, %d local / %d global devices", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f"${name}={value!r}; expected an integer") from None


MESSAGE_BYTES = 2048  # what one process tells the others of its failure (longer messages are cut, marked "...")


def first_failure(message: str | None) -> tuple[int, str] | None:
  """(process index, message) of the lowest-numbered process that failed, or None when none did.

  Each process passes its own failure message (None: it succeeded). In a multi-process job every process must
  call this at the same point (one all-gather of `MESSAGE_BYTES` bytes per process), so a check that fails on
  one host stops every host there instead of leaving the others waiting at their next collective. In a single
  process: the message itself, without communication.
  """
  if jax.process_count() == 1:
    return None if message is None else (0, message)
  from jax.experimental import multihost_utils  # local: multi-host only

  row = np.zeros(1 + MESSAGE_BYTES, np.uint8)  # [failed flag, utf-8 message padded with zeros]
  if message is not None:
    raw = message.encode("utf-8")
    if len(raw) > MESSAGE_BYTES:
      raw = raw[:MESSAGE_BYTES - 3].decode("utf-8", errors="ignore").encode("utf-8") + b"..."  # whole characters
    row[0] = 1
    row[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(row))  # [processes, 1 + MESSAGE_BYTES]
  for index, gathered in enumerate(rows):
    if gathered[0]:
      return index, bytes(gathered[1:]).rstrip(b"\0").decode("utf-8", errors="replace")
  return None


def is_main_process() -> bool:
  """Whether this is process 0 of the job (the one that writes files and prints); True with one process."""
  return jax.process_index() == 0


def process_values(value: int) -> list[int]:
  """Every process's integer `value`, in process order (one all-gather; `[value]` in a single process)."""
  if jax.process_count() == 1:
    return [int(value)]
  from jax.experimental import multihost_utils  # local: multi-host only

  return [int(v) for v in np.asarray(multihost_utils.process_allgather(np.int64(value))).reshape(-1)]


def stop_together(error: Exception | None, *, cleanup: Callable[[], None] | None = None,
                  before: str = "training") -> None:
  """Returns when no process failed; else runs `cleanup` and raises on every process: the failing one its own
  `error`, the others a one-line `TrainingError` naming it. `error`: this process's failure (None: it succeeded).
  Every process must call it at the same point (`first_failure`), before any collective that a failed process
  would never join: a check that fails on one host then stops every host at once instead of leaving the others
  waiting at their next collective (e.g. orbax's first barrier, or the first training step). The others' line
  names the error's type when it is not one of the project's (a bug on that host: its own traceback is there);
  `before`: what the failure came before, in that line ("process 1 of 2 stopped before training: ...")."""
  told = None
  if error is not None:
    told = str(error) if isinstance(error, HackableDiffusionError) else f"{type(error).__name__}: {error}"
    told = " ".join(told.splitlines())  # one line on every process
  failed = first_failure(told)
  if failed is None:
    return
  if cleanup is not None:
    cleanup()
  if error is not None:
    raise error
  index, message = failed
  raise TrainingError(f"process {index} of {jax.process_count()} stopped before {before}: {message}")


def agree_on(work: Callable[[], T], *, together: bool, before: str) -> T:
  """`work()` (each process on its own: files, no collective), then, when `together` (a run on a mesh, possibly
  one of several processes), the agreement point of `stop_together`: a failure on any process raises on every
  process here, before the collectives that follow (`before` names them in the others' line). Not `together`
  (one device, or a caller outside any job): `work()` alone, its error raised as it is."""
  if not together:
    return work()
  try:
    out = work()
  except Exception as e:  # noqa: BLE001 - told to the other processes, then raised
    stop_together(e, before=before)  # raises `e` here (and a line naming this process on the others)
    raise
  stop_together(None, before=before)
  return out


JOINED = "the job started"  # `stop_together(before=JOINED)`: the agreement point right after joining (`make_run_mesh`)


TELL_TIMEOUT_S = 60  # how long a failed process waits for the others to join before JAX aborts it


def tell_job_and_leave(error: Exception) -> None:
  """For a process that fails before it joined its multi-process job (a command line or file that only this host
  gets wrong): joins the job the environment configures (`$JAX_COORDINATOR_ADDRESS`, ...), if any, and tells the
  other processes at their first agreement point (`stop_together(None, before=JOINED)`, right after they join), so
  they stop at once with a line naming this process instead of waiting in `jax.distributed.initialize` until its
  timeout aborts them (5 minutes, a C++ check failure). It waits at most `TELL_TIMEOUT_S` for them to join (then
  JAX aborts it: processes that never started). Nothing when no job is configured, or when this process had
  already joined (its failure then belongs to the collective it is at)."""
  if jax.distributed.is_initialized():
    return
  try:
    if not maybe_initialize_distributed(timeout_s=TELL_TIMEOUT_S):
      return
    stop_together(error, before=JOINED)
  except Exception:  # noqa: BLE001 - its own `error` back, or a job it cannot join: the caller reports `error`
    return


__all__ = ["JOINED", "MESH_AXES", "MESSAGE_BYTES", "MeshConfig", "agree_on", "first_failure", "make_mesh",
           "maybe_initialize_distributed", "process_values", "stop_together", "tell_job_and_leave"]
