"""`generate`: block-autoregressive, entropy-bounded diffusion sampling with a compiled denoising loop.

Same algorithm and outputs as transformers' `DiffusionGemmaForBlockDiffusion.generate` (5.23):

  for each canvas (block) of `canvas_length` tokens:
    encode the new prefix (prompt, then the last committed canvas) into the KV cache;
    canvas <- uniform-random tokens (or the user's seed canvas);
    for n = N .. 1 (while some row is unfinished):
      logits <- decoder(canvas, cache, self-conditioning = previous step's processed logits; none at n = N)
      processed <- logits / T(n)       (after restricting to the allowed tokens, if any)
      sample a token per position (denoiser canvas) and take the argmax canvas
      accept the lowest-entropy positions within the entropy bound, re-noise all others
      per row: stop when the argmax canvas is stable and the mean entropy is below the confidence threshold;
      finished rows are frozen
    commit the argmax canvas; EOS ends a row, tokens after it become pad; rows finished earlier get pad.

One canvas's denoising loop is a single compiled `lax.while_loop` over a small `flax.struct` state (no host
round trip per step). Compiled programs are cached per (model graph, static options) and, inside, per shape;
prompts are padded to a length bucket so that one program serves many prompt lengths. The bucket padding goes
*after* the prompt with the cache length rewound to the true prompt length, so positions (and therefore
results) are exactly those of the unpadded prompt.

With `mesh=` the batch is split over the mesh's batch axes (data x fsdp x expert) and the parameters are placed
by the logical-axis rules of `hackable_diffusion.sharding`; the sequences are the same as on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hackable_diffusion import sharding as sharding_lib
from hackable_diffusion.sampling import entropy_bound as eb
from hackable_diffusion.sampling.config import SamplingConfig

Array = jax.Array
AcceptFn = Callable[[Array, Array, Array, Array], Array]


@flax.struct.dataclass
class GenerateOutput:
  """What `generate` returns.

  sequences: `[B, P + k * C]` int32, the prompt followed by the `k` generated canvases (whole canvases, like
    transformers; `k` is smaller than `ceil(max_new_tokens / C)` when every row ended early). Tokens after a
    row's first EOS, and every canvas after the one holding it, are `pad_token_id`.
  tokens_per_forward: `[B]` float32, non-pad new tokens / decoder forwards spent on the row while unfinished.
  denoising_steps: `[B, k]` int32, decoder forwards per canvas counted while the row was unfinished (0 for
    canvases after the row ended).
  trajectory: `[k, N, B, C]` int32 argmax canvas after every step (only with `return_trajectory=True`; steps
    after a canvas stopped repeat its final argmax canvas).
  """

  sequences: Array
  tokens_per_forward: Array
  denoising_steps: Array
  trajectory: Array | None = None


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """Given to `generate(callback=...)` after every denoising step (host-side numpy values)."""

  canvas_index: int  # which canvas (block) is being denoised
  step: int  # the step just taken, counting down from N (first) to 1 (last)
  argmax_canvas: np.ndarray  # [B, C] the argmax canvas after this step (the draft that would be committed)
  done: np.ndarray  # [B] rows that stopped (or were finished before this canvas)


@flax.struct.dataclass
class DenoiseState:
  """The `lax.while_loop` carry of one canvas."""

  step: Array  # [] int32, steps remaining; the loop runs while step >= 1
  key: Array  # PRNG key
  canvas: Array  # [B, C] int32, the (partly noisy) canvas fed to the decoder
  argmax: Array  # [B, C] int32, argmax canvas of the latest step
  sc_logits: Array  # [B, C, V] float32, processed logits of the previous step (self-conditioning)
  has_sc: Array  # [] bool, False before the first step (self-conditioning off)
  done: Array  # [B] bool, frozen rows
  steps: Array  # [B] int32, decoder forwards counted for unfinished rows
  history: Array  # [S, B, C] int32, the previous S argmax canvases (stable-and-confident stopping)
  trajectory: Array | None  # [N, B, C] int32 or None


@flax.struct.dataclass
class _Scalars:
  """Traced per-call numbers (changing them does not recompile)."""

  num_steps: Array
  t_min: Array
  t_max: Array
  entropy_bound: Array
  confidence_threshold: Array
  early_stopping: Array  # [] bool
  canvas_index: Array
  callback_id: Array  # [] int32, key of this call's callback in `_CALLBACKS`


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything that changes the traced program (part of the compile-cache key)."""

  vocab_size: int
  stability_threshold: int
  has_pins: bool
  has_allowed: bool
  has_structure: bool
  accept_fn: AcceptFn | None
  has_callback: bool
  trajectory_steps: int | None  # N when the trajectory is recorded


# ---- compile cache ------------------------------------------------------------------------------------------------
_CACHE: dict[Any, Callable[..., Any]] = {}
_CACHE_LOCK = threading.Lock()
_TRACE_COUNTS = {"encode": 0, "denoise": 0}
# Step callbacks of the `generate` calls in flight, by id: the compiled loop looks its callback up at run time, so
# a new callback object does not recompile anything.
_CALLBACKS: dict[int, Callable[[StepInfo], Any]] = {}
_CALLBACK_IDS = itertools.count()


def _run_callback(callback_id, canvas_index, step, argmax, done) -> None:
  callback = _CALLBACKS.get(int(callback_id))
  if callback is not None:
    callback(StepInfo(int(canvas_index), int(step), np.asarray(argmax), np.asarray(done)))


def trace_counts() -> dict[str, int]:
  """How many times the encode / denoise programs were traced (compiled) in this process (for tests)."""
  return dict(_TRACE_COUNTS)


def clear_cache() -> None:
  """Drops every cached compiled program."""
  with _CACHE_LOCK:
    _CACHE.clear()


def _cached(key: Any, build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  with _CACHE_LOCK:
    fn = _CACHE.get(key)
    if fn is None:
      fn = _CACHE[key] = build()
    return fn


def _encode_fn(graphdef: nnx.GraphDef, mesh: Mesh | None = None) -> Callable[..., Any]:
  """(state, cache, ids [B, L], mask [B, L], length [B]) -> cache with the ids appended, length rewound."""

  def encode(state, cache, ids, mask, length):
    _TRACE_COUNTS["encode"] += 1
    model = nnx.merge(graphdef, state)
    _, cache = model.encode(ids, cache, mask)
    return cache.replace(length=length)  # drops the bucket padding written after the real tokens

  # a mesh gets its own program: it is traced under `activation_sharding(mesh)` (constraints for that mesh)
  key = ("encode", graphdef) if mesh is None else ("encode", graphdef, mesh)
  return _cached(key, lambda: jax.jit(encode, donate_argnums=(1,)))


def _denoise_fn(graphdef: nnx.GraphDef, static: _Static, mesh: Mesh | None = None) -> Callable[..., Any]:
  key = ("denoise", graphdef, static) if mesh is None else ("denoise", graphdef, static, mesh)
  return _cached(key, lambda: jax.jit(_make_denoise(graphdef, static)))


# ---- one canvas ---------------------------------------------------------------------------------------------------
def _make_denoise(graphdef: nnx.GraphDef, static: _Static) -> Callable[..., Any]:
  """Builds the compiled denoising loop of one canvas."""
  def denoise(state, cache, key, seed_canvas, use_seed, pinned, allowed, structure, frozen, scalars: _Scalars):
    """-> (argmax canvas [B, C], decoder forwards [B], trajectory [N, B, C] or None)."""
    _TRACE_COUNTS["denoise"] += 1
    model = nnx.merge(graphdef, state)
    batch, canvas_len = seed_canvas.shape
    vocab = static.vocab_size
    key, init_key = jax.random.split(key)
    canvas = jnp.where(use_seed, seed_canvas, eb.initial_canvas(init_key, batch, canvas_len, vocab))
    if static.has_pins:
      canvas = eb.apply_pins(canvas, seed_canvas, pinned)
    trajectory = None
    if static.trajectory_steps is not None:
      trajectory = jnp.zeros((static.trajectory_steps, batch, canvas_len), jnp.int32)
    init = DenoiseState(
        step=scalars.num_steps.astype(jnp.int32),
        key=key,
        canvas=canvas,
        argmax=canvas,
        sc_logits=jnp.zeros((batch, canvas_len, vocab), jnp.float32),
        has_sc=jnp.zeros((), bool),
        # rows finished in an earlier canvas are frozen from the start (their tokens become pad anyway)
        done=frozen,
        steps=jnp.zeros((batch,), jnp.int32),
        history=eb.init_stability_history(static.stability_threshold, batch, canvas_len),
        trajectory=trajectory,
    )

    def cond(s: DenoiseState):
      return (s.step >= 1) & ~jnp.all(s.done)

    def body(s: DenoiseState) -> DenoiseState:
      steps = s.steps + (~s.done).astype(jnp.int32)
      logits = model.decode(s.canvas, cache, s.sc_logits, jnp.broadcast_to(s.has_sc, (batch,)),
                            structure if static.has_structure else None)
      if static.has_allowed:
        logits = eb.apply_allowed_tokens(logits, allowed)
      if static.has_pins:
        logits = eb.pin_logits(logits, seed_canvas, pinned)
      temp = eb.temperature(s.step, scalars.num_steps, scalars.t_min, scalars.t_max)
      processed = logits / temp  # transformers' "processed logits": sampled from and fed back as self-conditioning
      key, sample_key, noise_key = jax.random.split(s.key, 3)
      # = sample_tokens(processed), argmax_canvas(processed), entropy(processed), in one pass over the vocabulary
      denoised, argmax, token_entropy = eb.sample_argmax_entropy(sample_key, logits, temp)
      if static.accept_fn is None:
        accept = eb.accept_entropy_bound(token_entropy, scalars.entropy_bound)
      else:
        accept = static.accept_fn(token_entropy, processed, s.step, scalars.num_steps)
      if static.has_pins:
        accept = accept | pinned
      canvas = eb.renoise(noise_key, denoised, accept, vocab)
      if static.has_pins:
        canvas = eb.apply_pins(canvas, seed_canvas, pinned)
      # finished rows keep their canvas, argmax canvas and self-conditioning logits
      argmax = jnp.where(s.done[:, None], s.argmax, argmax)
      canvas = jnp.where(s.done[:, None], s.canvas, canvas)
      processed = jnp.where(s.done[:, None, None], s.sc_logits, processed)
      stop, history = eb.stable_and_confident(s.history, argmax, token_entropy, scalars.confidence_threshold)
      done = s.done | (stop & scalars.early_stopping)
      trajectory = s.trajectory
      if trajectory is not None:
        trajectory = jax.lax.dynamic_update_index_in_dim(trajectory, argmax, scalars.num_steps - s.step, axis=0)
      if static.has_callback:
        jax.debug.callback(_run_callback, scalars.callback_id, scalars.canvas_index, s.step, argmax, done)
      return DenoiseState(step=s.step - 1, key=key, canvas=canvas, argmax=argmax, sc_logits=processed,
                          has_sc=jnp.ones((), bool), done=done, steps=steps, history=history,
                          trajectory=trajectory)

    final = jax.lax.while_loop(cond, body, init)
    trajectory = final.trajectory
    if trajectory is not None:  # steps after the loop ended repeat the final argmax canvas
      taken = scalars.num_steps - final.step
      idx = jnp.arange(trajectory.shape[0])[:, None, None]
      trajectory = jnp.where(idx < taken, trajectory, final.argmax[None])
    return final.argmax, final.steps, trajectory

  return denoise


# ---- input checks -------------------------------------------------------------------------------------------------
def _int_array(name: str, value: Any, ndim: int) -> np.ndarray:
  arr = np.asarray(value)
  if arr.ndim != ndim or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
    raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape} dtype {arr.dtype}")
  return arr.astype(np.int64)


def _check_ids(name: str, arr: np.ndarray, vocab: int) -> None:
  if arr.size and (arr.min() < 0 or arr.max() >= vocab):
    bad = arr.min() if arr.min() < 0 else arr.max()
    raise ValueError(f"{name} holds token id {int(bad)} outside the vocabulary [0, {vocab})")


def _allowed_mask(allowed: Any, batch: int, vocab: int) -> np.ndarray:
  arr = np.asarray(allowed)
  if arr.size == 0:
    raise ValueError("allowed_token_ids is empty: at least one token must be allowed")
  if arr.dtype == bool:
    if arr.shape not in ((vocab,), (batch, vocab)):
      raise ValueError(f"allowed_token_ids as a mask must have shape ({vocab},) or ({batch}, {vocab}), got {arr.shape}")
    mask = np.broadcast_to(arr, (batch, vocab))
    empty = np.flatnonzero(~mask.any(-1))
    if empty.size:
      raise ValueError(f"allowed_token_ids mask allows no token for row {int(empty[0])}")
    return np.ascontiguousarray(mask)
  if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"allowed_token_ids must be a sequence of ids or a bool mask, got shape {arr.shape} "
                     f"dtype {arr.dtype}")
  _check_ids("allowed_token_ids", arr, vocab)
  mask = np.zeros((batch, vocab), bool)
  mask[:, arr] = True
  return mask


def _check_key(rng: Any) -> None:
  ok = isinstance(rng, jax.Array) and (
      jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) or (rng.dtype == jnp.uint32 and rng.shape == (2,)))
  if not ok or getattr(rng, "ndim", 0) != (0 if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else 1):
    raise ValueError(f"rng must be a single jax.random key (e.g. jax.random.key(0)), got {type(rng).__name__} "
                     f"with shape {getattr(rng, 'shape', None)}")


def _model_vocab(model: Any) -> int:
  return int(model.config.vocab_size)


# ---- the outer loop -----------------------------------------------------------------------------------------------
def generate(
    model: Any,
    input_ids: Any,
    config: SamplingConfig | None = None,
    *,
    rng: Array,
    attention_mask: Any = None,
    seed_canvas: Any = None,
    pinned: Any = None,
    allowed_token_ids: Sequence[int] | Any = None,
    canvas_attention_mask: Any = None,
    accept_fn: AcceptFn | None = None,
    callback: Callable[[StepInfo], Any] | None = None,
    return_trajectory: bool = False,
    mesh: Mesh | None = None,
) -> GenerateOutput:
  """Samples `config.max_new_tokens` tokens (rounded up to whole canvases) after `input_ids`.

  Args:
    model: a `DiffusionGemma` (anything with `config`, `init_cache`, `encode`, `decode`).
    input_ids: `[B, P]` prompt ids (left padding allowed with `attention_mask`).
    config: a `SamplingConfig` (None: defaults); None fields are filled from `model.config`.
    rng: a `jax.random` key; the whole call is a deterministic function of it.
    attention_mask: `[B, P]` bool/0-1, False on prompt padding.
    seed_canvas: `[B, k * C]` ids that start the first `k` canvases instead of uniform noise (infilling /
      editing; transformers' `decoder_input_ids` for `k = 1`).
    pinned: `[B, k * C]` bool, needs `seed_canvas`: pinned positions keep their seed token at every step (they
      are part of the decoder input, are never re-noised, and count as certain: zero entropy).
    allowed_token_ids: ids the sampler may produce (or a `[V]` / `[B, V]` bool mask); logits of other tokens
      are set to the finite `entropy_bound.DISALLOWED_LOGIT`. Pinned tokens are kept even if not allowed.
    canvas_attention_mask: optional `[B|1, N|1, C, C]` bool task structure passed to `model.decode`.
    accept_fn: replaces the entropy-bound rule: `accept_fn(token_entropy [B, C], processed_logits [B, C, V],
      step, num_steps) -> [B, C] bool` (e.g. `lambda e, l, n, N: entropy_bound.accept_top_k(e, 8)`). It is
      part of the compile-cache key: pass the same function object to reuse the compiled program.
    callback: called as `callback(StepInfo)` after every denoising step (through `jax.debug.callback`; when
      None nothing is added to the compiled loop; any callback reuses the same compiled program).
    return_trajectory: also return every step's argmax canvas in `GenerateOutput.trajectory`.
    mesh: a `jax.sharding.Mesh` (`sharding.make_mesh`): the batch inputs (ids, masks, seed canvas, pins, per-row
      allowed tokens) and the KV cache are split over its batch axes (data x fsdp x expert; the batch must be a
      multiple of their size), the parameters placed by the logical-axis rules (already sharded ones, e.g. by
      `sharding.shard_model`, stay put). Multi-host: every process passes the same whole batch; every process
      gets the whole output. None: one device.

  Returns:
    A `GenerateOutput` (see there).
  """
  if config is not None and not isinstance(config, SamplingConfig):
    raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
  _check_key(rng)
  config = (config or SamplingConfig()).resolve(model.config)
  vocab = _model_vocab(model)
  ids = _int_array("input_ids", input_ids, 2)
  batch, prompt_len = ids.shape
  if batch == 0 or prompt_len == 0:
    raise ValueError(f"input_ids must have at least one row and one token, got shape {ids.shape}")
  _check_ids("input_ids", ids, vocab)
  if attention_mask is None:
    mask = np.ones(ids.shape, bool)
  else:
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape:
      raise ValueError(f"attention_mask has shape {mask.shape}, expected {ids.shape} (the shape of input_ids)")
    if not (mask.dtype == bool or np.isin(mask, (0, 1)).all()):
      raise ValueError("attention_mask must be bool or hold only 0 and 1")
    mask = mask.astype(bool)
  canvas_len = config.canvas_length
  num_canvases = config.num_canvases()
  seeds = None
  if seed_canvas is not None:
    seeds = _int_array("seed_canvas", seed_canvas, 2)
    if seeds.shape[0] != batch or seeds.shape[1] == 0 or seeds.shape[1] % canvas_len \
        or seeds.shape[1] > num_canvases * canvas_len:
      raise ValueError(f"seed_canvas has shape {seeds.shape}; expected ({batch}, k * {canvas_len}) with "
                       f"1 <= k <= {num_canvases} canvases")
    _check_ids("seed_canvas", seeds, vocab)
  pins = None
  if pinned is not None:
    if seeds is None:
      raise ValueError("pinned was given without seed_canvas: pinned positions keep their seed_canvas token")
    pins = np.asarray(pinned)
    if pins.shape != seeds.shape:
      raise ValueError(f"pinned has shape {pins.shape}, expected {seeds.shape} (the shape of seed_canvas)")
    if pins.dtype != bool:
      if not np.isin(pins, (0, 1)).all():
        raise ValueError("pinned must be bool or hold only 0 and 1")
      pins = pins.astype(bool)
  allowed = None if allowed_token_ids is None else _allowed_mask(allowed_token_ids, batch, vocab)
  structure = None
  if canvas_attention_mask is not None:
    structure = jnp.asarray(canvas_attention_mask, bool)
    if structure.ndim != 4 or structure.shape[-2:] != (canvas_len, canvas_len):
      raise ValueError(f"canvas_attention_mask has shape {structure.shape}, expected [B|1, N|1, {canvas_len}, "
                       f"{canvas_len}]")
  if callback is not None and not callable(callback):
    raise ValueError(f"callback must be callable, got {type(callback).__name__}")

  eos = np.asarray(config.eos_token_ids, np.int64)
  pad = config.pad_token_id
  steps_n = config.max_denoising_steps
  static = _Static(
      vocab_size=vocab,
      stability_threshold=config.stability_threshold,
      has_pins=pins is not None,
      has_allowed=allowed is not None,
      has_structure=structure is not None,
      accept_fn=accept_fn,
      has_callback=callback is not None,
      trajectory_steps=steps_n if return_trajectory else None,
  )
  graphdef, state = nnx.split(model)
  encode = _encode_fn(graphdef, mesh)
  denoise = _denoise_fn(graphdef, static, mesh)
  place, to_host = _placement(mesh, batch)
  if mesh is not None:
    state = jax.device_put(state, sharding_lib.state_shardings(mesh, state))

  # The prompt is padded *after* its real tokens up to the bucket length; the encoder writes those slots as
  # padding and the cache length is rewound to `prompt_len`, so the next canvas overwrites them and positions are
  # exactly those of the unpadded prompt.
  bucket = config.bucket_prompt_length(prompt_len)
  padded_ids = np.zeros((batch, bucket), np.int32)
  padded_ids[:, :prompt_len] = ids
  padded_mask = np.zeros((batch, bucket), bool)
  padded_mask[:, :prompt_len] = mask
  capacity = bucket + (num_canvases - 1) * canvas_len
  cache = model.init_cache(batch, capacity)
  if mesh is not None:  # every cache array is [batch, ...]
    cache = place(cache)

  def scalars(k: int) -> _Scalars:
    return _Scalars(
        num_steps=jnp.asarray(steps_n, jnp.int32),
        t_min=jnp.asarray(config.t_min, jnp.float32),
        t_max=jnp.asarray(config.t_max, jnp.float32),
        entropy_bound=jnp.asarray(config.entropy_bound, jnp.float32),
        confidence_threshold=jnp.asarray(config.confidence_threshold, jnp.float32),
        early_stopping=jnp.asarray(config.early_stopping),
        canvas_index=jnp.asarray(k, jnp.int32),
        callback_id=jnp.asarray(callback_id, jnp.int32),
    )

  zeros_canvas = np.zeros((batch, canvas_len), np.int32)
  no_pins = np.zeros((batch, canvas_len), bool)
  allowed_arg = place(allowed) if allowed is not None else jnp.ones((1, 1), bool)
  structure_arg = structure if structure is not None else jnp.ones((1, 1, 1, 1), bool)
  finished = np.zeros(batch, bool)
  pieces = [ids.astype(np.int32)]
  step_counts, trajectories = [], []
  key = rng if mesh is None else jax.device_put(rng, sharding_lib.replicated(mesh))
  new_ids, new_mask = padded_ids, padded_mask
  length = prompt_len
  callback_id = next(_CALLBACK_IDS) % (2**31 - 1)
  if callback is not None:
    _CALLBACKS[callback_id] = callback

  def activations():  # traced under it, the model's `sharding.constrain` calls pin activations to the mesh
    return sharding_lib.activation_sharding(mesh) if mesh is not None else contextlib.nullcontext()

  try:
    for k in range(num_canvases):
      lengths = place(jnp.full((batch,), length, jnp.int32))
      with activations():
        cache = encode(state, cache, place(new_ids), place(new_mask), lengths)
      key, canvas_key = jax.random.split(key)
      has_seed = seeds is not None and (k + 1) * canvas_len <= seeds.shape[1]
      sl = slice(k * canvas_len, (k + 1) * canvas_len)
      seed_k = seeds[:, sl].astype(np.int32) if has_seed else zeros_canvas
      pins_k = pins[:, sl] if (has_seed and pins is not None) else no_pins
      # with a pad token, rows finished in earlier canvases are frozen (transformers still denoises them but
      # overwrites the result with pad and does not count their forwards; the output is the same)
      frozen = finished if pad is not None else np.zeros(batch, bool)
      with activations():
        argmax, fwd, traj = denoise(state, cache, canvas_key, place(seed_k), jnp.asarray(has_seed), place(pins_k),
                                    allowed_arg, structure_arg, place(frozen), scalars(k))
      block = np.array(to_host(argmax), dtype=np.int32)
      fwd = np.asarray(to_host(fwd)) * ~finished  # forwards of rows finished earlier are not counted
      step_counts.append(fwd)
      if traj is not None:
        trajectories.append(traj if mesh is None else jnp.asarray(to_host(traj)))
      block, finished = _finalize_canvas(block, finished, eos, pad)
      pieces.append(block)
      if finished.all():
        break
      new_ids, new_mask = block, np.ones((batch, canvas_len), bool)
      length += canvas_len
  finally:
    _CALLBACKS.pop(callback_id, None)

  sequences = np.concatenate(pieces, axis=1)
  steps = np.stack(step_counts, axis=1).astype(np.int32)
  new_tokens = sequences[:, prompt_len:]
  valid = (new_tokens != pad).sum(-1) if pad is not None else np.full(batch, new_tokens.shape[1])
  tokens_per_forward = valid.astype(np.float32) / steps.sum(-1).astype(np.float32)
  return GenerateOutput(
      sequences=jnp.asarray(sequences),
      tokens_per_forward=jnp.asarray(tokens_per_forward),
      denoising_steps=jnp.asarray(steps),
      trajectory=jnp.stack(trajectories) if trajectories else None,
  )


def _placement(mesh: Mesh | None, batch: int) -> tuple[Callable[[Any], Any], Callable[[Array], Any]]:
  """`(place, to_host)`: puts a `[batch, ...]` array (or pytree) on the device(s), and reads a result back.

  One device: `jnp.asarray` and the identity. A mesh: split along the batch over its batch axes, and results
  gathered from every process.
  """
  if mesh is None:
    return jnp.asarray, lambda x: x
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh (see sharding.make_mesh), got {type(mesh).__name__}")
  shards = sharding_lib.num_batch_shards(mesh)
  if batch % shards:
    raise ValueError(f"generate: batch of {batch} rows is not divisible by the {shards} batch shards of mesh "
                     f"{dict(mesh.shape)} (data x fsdp x expert); pad the batch to a multiple of {shards}")
  batch_sharding = sharding_lib.batch_sharding(mesh)

  def to_host(x: Array) -> Any:
    if x.is_fully_addressable:
      return x
    from jax.experimental import multihost_utils  # local: multi-host only

    return multihost_utils.process_allgather(x, tiled=True)

  return (lambda tree: jax.device_put(tree, batch_sharding)), to_host


def _finalize_canvas(block: np.ndarray, finished: np.ndarray, eos: np.ndarray,
                     pad: int | None) -> tuple[np.ndarray, np.ndarray]:
  """EOS / pad handling of one committed canvas `[B, C]` (transformers' `_finalize_canvas`)."""
  finished_now = np.isin(block, eos).any(-1) if eos.size else np.zeros(block.shape[0], bool)
  previously = finished
  finished = previously | finished_now
  if pad is not None and finished.any():
    block[previously] = pad  # rows finished in an earlier canvas
    if eos.size and finished_now.any():  # tokens after the first EOS
      is_eos = np.isin(block, eos)
      seen = np.cumsum(is_eos, axis=-1)
      block[(seen > 0) & ~((seen == 1) & is_eos)] = pad
  return block, finished
