"""The sampler's compiled programs and their one bounded cache.

`generate` runs two programs per canvas: `encode` (the new prefix into the KV cache; for a prompt with images,
`encode_images`, which also runs the vision tower) and `denoise` (the whole denoising loop, `sampling.denoise`).
Each is a `jax.jit` function built once per (kind, model graph, static options, mesh) and kept in `PROGRAMS`, a
least-recently-used cache of at most `MAX_PROGRAMS` entries (inside, jit keeps one executable per argument shape /
tree structure, e.g. per acceptance-rule or checker class; the static options, `denoise.DenoiseStatic`, include
whether a checker is used and how). This cache is the module's only mutable state.

A `Program` owns what belongs to it: how often it was traced (also added to its cache's per-kind totals, which
`trace_counts()` reads, so evicted programs still count) and the step callbacks of the calls in flight. A call
with `callback=` registers the callback under a fresh call id for its duration; the compiled loop passes that id
to `jax.debug.callback`, and the program looks the callback up. So a new callback object never recompiles, and no
registry outlives the program it serves.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion.sampling import denoise as denoise_lib
from hackable_diffusion.sampling import denoise_rows as rows_lib

MAX_PROGRAMS = 32


class Program:
  """One cached program: `build(program)` gives the function to jit; `program(*args, callback=None)` runs it.

  The built function takes the call id (`[]` int32) as its last argument. With a `callback`, the call blocks until
  the program and its step callbacks are done (the callback is registered only for the call's duration).
  """

  def __init__(self, kind: str, build: Callable[[Program], Callable[..., Any]],
               on_trace: Callable[[str], None] | None = None, **jit_kwargs: Any):
    self.kind = kind
    self.traces = 0
    self._on_trace = on_trace
    self._lock = threading.Lock()
    self._callbacks: dict[int, Callable[[denoise_lib.StepInfo], Any]] = {}
    self._call_ids = itertools.count(1)  # 0: a call without callback
    self._fn = jax.jit(build(self), **jit_kwargs)

  def on_trace(self) -> None:
    self.traces += 1
    if self._on_trace is not None:
      self._on_trace(self.kind)

  def on_step(self, call_id: Any, canvas_index: Any, step: Any, argmax: Any, done: Any) -> None:
    callback = self._callbacks.get(int(call_id))
    if callback is not None:
      callback(denoise_lib.step_info(canvas_index, step, argmax, done))

  def __call__(self, *args: Any, callback: Callable[[denoise_lib.StepInfo], Any] | None = None) -> Any:
    if callback is None:
      return self._fn(*args, jnp.asarray(0, jnp.int32))
    with self._lock:
      call_id = next(self._call_ids) % (2**31 - 1) or 1
      self._callbacks[call_id] = callback
    try:
      out = jax.block_until_ready(self._fn(*args, jnp.asarray(call_id, jnp.int32)))
      jax.effects_barrier()  # every step callback of this call has run
      return out
    finally:
      with self._lock:
        self._callbacks.pop(call_id, None)


class ProgramCache:
  """A thread-safe LRU cache of `Program`s (at most `max_size`) and the trace counts of every program it built."""

  def __init__(self, max_size: int):
    self.max_size = max_size
    self._programs: collections.OrderedDict[Any, Program] = collections.OrderedDict()
    self._traces: collections.Counter[str] = collections.Counter({"encode": 0, "denoise": 0})
    self._lock = threading.Lock()

  def _count_trace(self, kind: str) -> None:
    with self._lock:
      self._traces[kind] += 1

  def get(self, key: Any, kind: str, build: Callable[[Program], Callable[..., Any]], **jit_kwargs: Any) -> Program:
    with self._lock:
      program = self._programs.get(key)
      if program is not None:
        self._programs.move_to_end(key)
        return program
      program = self._programs[key] = Program(kind, build, self._count_trace, **jit_kwargs)
      while len(self._programs) > self.max_size:
        self._programs.popitem(last=False)
      return program

  def trace_counts(self) -> dict[str, int]:
    """Traces per kind of every program this cache built (evicted ones and traces after eviction included)."""
    with self._lock:
      return dict(self._traces)

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()


PROGRAMS = ProgramCache(MAX_PROGRAMS)


def trace_counts() -> dict[str, int]:
  """How many times the encode / denoise programs were traced (compiled) in this process (for tests)."""
  return PROGRAMS.trace_counts()


def clear_cache() -> None:
  """Drops every cached compiled program (trace counts are kept)."""
  PROGRAMS.clear()


def encode_program(graphdef: nnx.GraphDef, mesh: Mesh | None = None) -> Program:
  """`(state, cache, ids [B, L], mask [B, L], length [B]) -> cache` with the ids appended and the cache length
  rewound to `length` (dropping the bucket padding written after the real tokens). The cache is donated."""

  def build(program: Program) -> Callable[..., Any]:
    def encode(state, cache, ids, mask, length, call_id):
      del call_id  # no step callbacks
      program.on_trace()
      model = nnx.merge(graphdef, state)
      _, cache = model.encode(ids, cache, mask)
      return cache.replace(length=length)

    return encode

  # a mesh gets its own program: it is traced under `activation_sharding(mesh)` (constraints for that mesh)
  key = ("encode", graphdef) if mesh is None else ("encode", graphdef, mesh)
  return PROGRAMS.get(key, "encode", build, donate_argnums=(1,))


def encode_images_program(graphdef: nnx.GraphDef, mesh: Mesh | None = None) -> Program:
  """`(state, cache, ids [B, L], mask [B, L], length [B], pixel_values [N, P, D], positions [N, P, 2]) -> cache`:
  `encode_program` for a prompt with images: the vision tower runs once, inside this program, and its soft tokens
  take the places of the prompt's image tokens. The cache is donated."""

  def build(program: Program) -> Callable[..., Any]:
    def encode(state, cache, ids, mask, length, pixel_values, positions, call_id):
      del call_id  # no step callbacks
      program.on_trace()
      model = nnx.merge(graphdef, state)
      _, cache = model.encode(ids, cache, mask, model.image_features(pixel_values, positions))
      return cache.replace(length=length)

    return encode

  key = ("encode_images", graphdef) if mesh is None else ("encode_images", graphdef, mesh)
  return PROGRAMS.get(key, "encode", build, donate_argnums=(1,))


def denoise_program(graphdef: nnx.GraphDef, static: denoise_lib.DenoiseStatic, mesh: Mesh | None = None) -> Program:
  """The compiled denoising loop of one canvas (`denoise.make_denoise`; call it without the trailing call id)."""

  def build(program: Program) -> Callable[..., Any]:
    return denoise_lib.make_denoise(graphdef, static, on_trace=program.on_trace,
                                    on_step=program.on_step if static.has_callback else None)

  key = ("denoise", graphdef, static) if mesh is None else ("denoise", graphdef, static, mesh)
  return PROGRAMS.get(key, "denoise", build)


def encode_rows_program(graphdef: nnx.GraphDef, mesh: Mesh | None = None) -> Program:
  """`(state, cache, ids [B, L], mask [B, L], length [B], which [B], reset [B]) -> cache`: the rows `which` get
  `ids` appended (the `reset` rows after emptying them: a new prompt in a reused slot) and their length set to
  `length` (rewinding bucket padding); every other row is unchanged. The cache is donated."""

  def build(program: Program) -> Callable[..., Any]:
    def encode(state, cache, ids, mask, length, which, reset, call_id):
      del call_id
      program.on_trace()
      model = nnx.merge(graphdef, state)
      start = cache.replace(length=jnp.where(reset, 0, cache.length), valid=cache.valid & ~reset[:, None])
      _, new = model.encode(ids, start, mask)
      new = new.replace(length=length)
      return new.where_rows(which, cache)

    return encode

  key = ("encode_rows", graphdef) if mesh is None else ("encode_rows", graphdef, mesh)
  return PROGRAMS.get(key, "encode_rows", build, donate_argnums=(1,))


def encode_rows_images_program(graphdef: nnx.GraphDef, mesh: Mesh | None = None) -> Program:
  """`encode_rows_program` for prompts with images: `(state, cache, ids, mask, length, which, reset, pixel_values
  [N, P, D], positions [N, P, 2]) -> cache`, the images' soft tokens (the vision tower runs inside) taking the places
  of the image tokens of `ids` in row-major order. The cache is donated."""

  def build(program: Program) -> Callable[..., Any]:
    def encode(state, cache, ids, mask, length, which, reset, pixel_values, positions, call_id):
      del call_id
      program.on_trace()
      model = nnx.merge(graphdef, state)
      start = cache.replace(length=jnp.where(reset, 0, cache.length), valid=cache.valid & ~reset[:, None])
      _, new = model.encode(ids, start, mask, model.image_features(pixel_values, positions))
      new = new.replace(length=length)
      return new.where_rows(which, cache)

    return encode

  key = ("encode_rows_images", graphdef) if mesh is None else ("encode_rows_images", graphdef, mesh)
  return PROGRAMS.get(key, "encode_rows", build, donate_argnums=(1,))


def copy_rows_program() -> Program:
  """`(cache, source, index [B], which [B]) -> cache`: row `i` of the rows `which` becomes row `index[i]` of
  `source` (a cache of the same layout with at most as many slots, e.g. prompts encoded ahead of time); every other
  row is unchanged. A copy: the copied rows hold exactly the numbers of `source`. The cache is donated."""

  def build(program: Program) -> Callable[..., Any]:
    def copy(cache, source, index, which, call_id):
      del call_id
      program.on_trace()
      return source.take_rows(index).padded(cache.capacity).where_rows(which, cache)

    return copy

  return PROGRAMS.get(("copy_rows",), "copy_rows", build, donate_argnums=(0,))


def denoise_rows_program(graphdef: nnx.GraphDef, static: denoise_lib.DenoiseStatic, key_impl: str,
                         mesh: Mesh | None = None) -> Program:
  """The compiled chunk of the per-row loop (`denoise_rows.make_denoise_rows`; call it without the call id)."""

  def build(program: Program) -> Callable[..., Any]:
    return rows_lib.make_denoise_rows(graphdef, static, key_impl, on_trace=program.on_trace,
                                      on_step=program.on_step if static.has_callback else None)

  key = ("denoise_rows", graphdef, static, key_impl, mesh)
  return PROGRAMS.get(key, "denoise_rows", build)


__all__ = ["MAX_PROGRAMS", "PROGRAMS", "Program", "ProgramCache", "clear_cache", "copy_rows_program", "denoise_program",
           "denoise_rows_program", "encode_images_program", "encode_program", "encode_rows_images_program",
           "encode_rows_program", "trace_counts"]
