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

The call reads as: `prepare` (the arguments, as one `GenerateRequest`, validated into one `Prepared`,
`sampling/prepare.py`), then per canvas: encode (the new prefix into the KV cache), denoise (one compiled
`lax.while_loop` over a small `flax.struct` state, `sampling/denoise.py`; no host round trip per step), commit
(EOS / pad handling, below).
Compiled programs are cached per (model graph, static options) in one bounded cache (`sampling/programs.py`)
and, inside, per shape and acceptance-rule class; prompts are padded to a length bucket so that one program
serves many prompt lengths. The bucket padding goes *after* the prompt with the cache length rewound to the true
prompt length, so positions (and therefore results) are exactly those of the unpadded prompt.

With `mesh=` the batch is split over the mesh's batch axes (data x fsdp x expert) and the parameters are placed
by the logical-axis rules of `hackable_diffusion.sharding`; the sequences are the same as on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hackable_diffusion import sharding as sharding_lib
from hackable_diffusion.model.kv_cache import KVCache
from hackable_diffusion.sampling import programs
from hackable_diffusion.sampling.checker import Checker
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.denoise import DenoiseScalars, DenoiseState, StepInfo
from hackable_diffusion.sampling.prepare import GenerateRequest, Prepared, prepare
from hackable_diffusion.sampling.programs import clear_cache, trace_counts
from hackable_diffusion.sampling.rules import AcceptanceRule

Array = jax.Array


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
    acceptance: AcceptanceRule | None = None,
    checker: Checker | None = None,
    callback: Callable[[StepInfo], Any] | None = None,
    return_trajectory: bool = False,
    mesh: Mesh | None = None,
    pixel_values: Any = None,
    image_position_ids: Any = None,
) -> GenerateOutput:
  """Samples `config.max_new_tokens` tokens (rounded up to whole canvases) after `input_ids`.

  Args:
    model: a `DiffusionGemma` (anything with `config`, `init_cache`, `encode`, `decode`).
    input_ids: `[B, P]` prompt ids (left padding allowed with `attention_mask`).
    config: a `SamplingConfig` (None: defaults); None fields are filled from `model.config`.
    rng: a `jax.random` key; the whole call is a deterministic function of it. Or one key per row (`[B]` keys,
      e.g. `jax.random.split(key, B)`): each row then has its own random stream (`sampling.denoise_rows`; canvas
      `k` starts from `fold_in(row key, k)`), so a row's result depends on its own key and inputs only - the
      sequences `generate_stream` gives for the same keys. Not with `return_trajectory`.
    attention_mask: `[B, P]` bool/0-1, False on prompt padding.
    seed_canvas: `[B, k * C]` ids that start the first `k` canvases instead of uniform noise (infilling /
      editing; transformers' `decoder_input_ids` for `k = 1`).
    pinned: `[B, k * C]` bool, needs `seed_canvas`: pinned positions keep their seed token at every step (they
      are part of the decoder input, are never re-noised, and count as certain: zero entropy).
    allowed_token_ids: ids the sampler may produce (or a `[V]` / `[B, V]` bool mask); logits of other tokens
      are set to the finite `entropy_bound.DISALLOWED_LOGIT`. Pinned tokens are kept even if not allowed.
    canvas_attention_mask: optional `[B|1, N|1, C, P + C]` bool task structure passed to `model.decode`.
    acceptance: an acceptance rule (`sampling.rules`, e.g. `rules.TopK(8)`) used instead of the config's
      (`config.acceptance_rule()`, by default `EntropyBound(config.entropy_bound)`). Its numeric fields are
      traced: an equal rule, or the same class with other values, reuses the compiled program.
    checker: a task's rules (`sampling.checker.Checker`, e.g. `SudokuTask().checker(tokenizer)`): every step, the
      positions it flags on the argmax canvas are re-noised (never accepted); `config.checker_confidence` and
      `config.checker_restarts` / `checker_step_budget` add a stopping guard and restarts (see `SamplingConfig`;
      restarts run the per-row loop, with keys `split(rng, B)` from a single key). Its numeric fields are traced.
      None: nothing of it is traced (the program of a call without it).
    callback: called as `callback(StepInfo)` after every denoising step (through `jax.debug.callback`; when
      None nothing is added to the compiled loop; any callback reuses the same compiled program).
    return_trajectory: also return every step's argmax canvas in `GenerateOutput.trajectory`.
    mesh: a `jax.sharding.Mesh` (`sharding.make_mesh`): the batch inputs (ids, masks, seed canvas, pins, per-row
      allowed tokens) and the KV cache are split over its batch axes (data x fsdp x expert; the batch must be a
      multiple of their size), the parameters placed by the logical-axis rules (already sharded ones, e.g. by
      `sharding.shard_model`, stay put). Multi-host: every process passes the same whole batch; every process
      gets the whole output. None: one device.
    pixel_values: `[N, P, 3 * patch^2]` float, the patches of the `N` images of the whole batch (values in [0, 1],
      padding patches anywhere), as transformers' Gemma 4 image processor gives them; needs a model with a vision
      tower. Their soft tokens replace the prompts' `image_token_id` tokens in row-major order (image 0's first),
      so `input_ids` must hold exactly one image token per soft token
      (`hackable_diffusion.model.vision.num_soft_tokens`). The tower runs once, in the prompt's encoder pass; the
      denoising steps read the KV cache only.
    image_position_ids: `[N, P, 2]` int, each patch's (x, y) in its image's patch grid; (-1, -1) on padding.

  Returns:
    A `GenerateOutput` (see there).
  """
  p = prepare(model, GenerateRequest(
      input_ids=input_ids, config=config, rng=rng, attention_mask=attention_mask, seed_canvas=seed_canvas,
      pinned=pinned, allowed_token_ids=allowed_token_ids, canvas_attention_mask=canvas_attention_mask,
      acceptance=acceptance, checker=checker, callback=callback, return_trajectory=return_trajectory, mesh=mesh,
      pixel_values=pixel_values, image_position_ids=image_position_ids))
  graphdef, state = nnx.split(model)
  encode = programs.encode_program(graphdef, p.mesh)
  encode_prompt = _prompt_encoder(graphdef, p)
  place, to_host = _placement(p.mesh)
  if p.row_keys is None:
    denoise = programs.denoise_program(graphdef, p.static, p.mesh)
  else:
    denoise = _per_row_denoise(programs.denoise_rows_program(graphdef, p.static, p.key_impl, p.mesh), p, place)
  if p.row_keys is not None:  # the batch key is unused (one key per row): any single key keeps the loop uniform
    p = dataclasses.replace(p, rng=jax.random.key(0))
  if p.mesh is None:
    cache = model.init_cache(p.batch, p.cache_capacity)
    key = p.rng
  else:
    state = place_state(state, p.mesh)
    # created in its shards (split along each array's batch axis): never whole on one device
    cache = _empty_in_shards(jax.eval_shape(lambda: model.init_cache(p.batch, p.cache_capacity)), p.mesh)
    key = _replicated_key(p.rng, p.mesh)
  allowed = place(p.allowed) if p.allowed is not None else jnp.ones((1, 1), bool)
  structure = p.structure if p.structure is not None else jnp.ones((1, 1, 1, 1), bool)

  finished = np.zeros(p.batch, bool)
  blocks, step_counts, trajectories = [], [], []
  new_ids, new_mask = p.padded_prompt()
  length = p.prompt_length
  for k in range(p.num_canvases):
    # encode: the new prefix (the prompt, then the last committed canvas) into the cache
    lengths = place(jnp.full((p.batch,), length, jnp.int32))
    with _activations(p.mesh):
      run = encode_prompt if k == 0 else encode
      cache = run(state, cache, place(new_ids), place(new_mask), lengths)
    # denoise: with a pad token, rows finished in earlier canvases are frozen (transformers still denoises them
    # but overwrites the result with pad and does not count their forwards; the output is the same)
    key, canvas_key = jax.random.split(key)
    seed_k, pins_k, has_seed = p.canvas_seed(k)
    frozen = finished if p.pad_token_id is not None else np.zeros(p.batch, bool)
    with _activations(p.mesh):
      argmax, fwd, traj = denoise(state, cache, canvas_key, place(seed_k), jnp.asarray(has_seed), place(pins_k),
                                  allowed, structure, place(frozen), DenoiseScalars.of(p.config, k), p.rule_arg,
                                  p.checker_arg, callback=p.callback)
    # commit: the argmax canvas, with EOS / pad handling
    block = np.array(to_host(argmax), dtype=np.int32)
    step_counts.append(np.asarray(to_host(fwd)) * ~finished)  # forwards of rows finished earlier are not counted
    if traj is not None:
      trajectories.append(traj if p.mesh is None else jnp.asarray(to_host(traj)))
    block, finished = commit_canvas(block, finished, p.eos_ids, p.pad_token_id)
    blocks.append(block)
    if finished.all():
      break
    new_ids, new_mask = block, np.ones((p.batch, p.canvas_length), bool)
    length += p.canvas_length
  return _output(p, blocks, step_counts, trajectories)


def _prompt_encoder(graphdef: nnx.GraphDef, p: Prepared) -> Callable[..., Any]:
  """The encoder call of the prompt: `encode_program`'s, or with images `encode_images_program`'s with the images
  bound (placed whole on every device of a mesh: the images are not split like the rows)."""
  if p.pixel_values is None:
    return programs.encode_program(graphdef, p.mesh)
  program = programs.encode_images_program(graphdef, p.mesh)
  if p.mesh is None:
    pixels, positions = jnp.asarray(p.pixel_values), jnp.asarray(p.image_position_ids)
  else:
    everywhere = sharding_lib.replicated(p.mesh)
    pixels, positions = _put(p.pixel_values, everywhere), _put(p.image_position_ids, everywhere)
  return lambda state, cache, ids, mask, lengths: program(state, cache, ids, mask, lengths, pixels, positions)


def _per_row_denoise(program: programs.Program, p: Prepared, place: Callable[[Any], Any]) -> Callable[..., Any]:
  """The per-row loop (`sampling.denoise_rows`) behind the batch loop's call signature: canvas `k` of row `b`
  starts from key `fold_in(row key b, k)` (the batch key is not used). Returns (argmax, forwards, no trajectory)."""
  keys = jax.random.wrap_key_data(jnp.asarray(p.row_keys), impl=p.key_impl)  # [B]
  # checker restarts take a row past `max_denoising_steps`, up to its budget
  max_steps = p.config.checker_budget() if p.static.checker_restarts else p.config.max_denoising_steps

  def denoise(state, cache, key, seed, has_seed, pins, allowed, structure, frozen, scalars, rule_arg, checker_arg,
              callback=None):
    del key  # per-row keys
    canvas_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, scalars.canvas_index)  # [B]
    key_data = place(np.asarray(jax.random.key_data(canvas_keys)))
    every = place(np.ones((p.batch,), bool))
    rows = program(state, cache, None, every, key_data, seed, every & has_seed, pins, ~frozen, allowed, structure,
                   scalars, rule_arg, checker_arg, jnp.asarray(max_steps, jnp.int32), jnp.asarray(False),
                   callback=callback)
    return rows.argmax, rows.steps, None

  return denoise


def commit_canvas(block: np.ndarray, finished: np.ndarray, eos: np.ndarray,
                  pad: int | None) -> tuple[np.ndarray, np.ndarray]:
  """EOS / pad handling of one committed canvas `[B, C]` (transformers' `_finalize_canvas`).

  `finished [B]`: rows that ended in an earlier canvas (they become all pad); `eos [E]`: the EOS ids. Tokens
  after a row's first EOS become pad. Returns (the canvas, rows finished now or earlier). `block` is modified.
  """
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


def _output(p: Prepared, blocks: list[np.ndarray], step_counts: list[np.ndarray],
            trajectories: list[Array]) -> GenerateOutput:
  sequences = np.concatenate([p.input_ids, *blocks], axis=1)
  steps = np.stack(step_counts, axis=1).astype(np.int32)
  new_tokens = sequences[:, p.prompt_length:]
  pad = p.pad_token_id
  valid = (new_tokens != pad).sum(-1) if pad is not None else np.full(p.batch, new_tokens.shape[1])
  tokens_per_forward = valid.astype(np.float32) / steps.sum(-1).astype(np.float32)
  return GenerateOutput(
      sequences=jnp.asarray(sequences),
      tokens_per_forward=jnp.asarray(tokens_per_forward),
      denoising_steps=jnp.asarray(steps),
      trajectory=jnp.stack(trajectories) if trajectories else None,
  )


def place_state(state: Any, mesh: Mesh) -> Any:
  """The model's variables on `mesh`: an array already sharded over this mesh (a train state in its training
  shardings, `sharding.shard_model`) stays as it is - never gathered, never resharded; any other array is placed
  by the logical-axis rules (`sharding.state_shardings`)."""
  targets = sharding_lib.state_shardings(mesh, state)

  def one(x: Any, target: Any) -> Any:
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
      return x
    return jax.device_put(x, target)

  return jax.tree.map(one, state, targets)


def _empty_in_shards(shapes: KVCache, mesh: Mesh) -> KVCache:
  """Zeros of every `ShapeDtypeStruct` of `shapes` (an empty KV cache), split along each array's batch axis over the
  mesh's batch axes, each device writing only its own shard."""
  batch_spec = tuple(sharding_lib.batch_sharding(mesh).spec)

  def one(x: jax.ShapeDtypeStruct, axis: int) -> Array:
    sharding = NamedSharding(mesh, PartitionSpec(*(None,) * axis, *batch_spec))
    shard = np.zeros(sharding.shard_shape(x.shape), x.dtype)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: shard)

  return jax.tree.map(one, shapes, shapes.batch_axes())


def _replicated_key(rng: Array, mesh: Mesh) -> Array:
  """The PRNG key replicated over the mesh (its raw data placed like any host value, so multi-host safe)."""
  if isinstance(rng, jax.Array) and isinstance(rng.sharding, NamedSharding) and rng.sharding.mesh == mesh:
    return rng
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  data = np.asarray(jax.random.key_data(rng) if typed else rng)
  placed = _put(data, sharding_lib.replicated(mesh))
  return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(rng)) if typed else placed


def _put(x: Any, sharding: NamedSharding) -> Array:
  """A host value (the same on every process) as a global array of `sharding`; each device gets only its slice."""
  x = np.asarray(x)
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _activations(mesh: Mesh | None) -> contextlib.AbstractContextManager[Any]:
  """Traced under it, the model's `sharding.constrain` calls pin activations to the mesh."""
  return sharding_lib.activation_sharding(mesh) if mesh is not None else contextlib.nullcontext()


def _placement(mesh: Mesh | None) -> tuple[Callable[[Any], Any], Callable[[Array], Any]]:
  """`(place, to_host)`: puts a `[batch, ...]` array (or pytree) on the device(s), and reads a result back.

  One device: `jnp.asarray` and the identity. A mesh (checked by `prepare`): split along the batch over its batch
  axes (host values, the same on every process: each device receives only its rows), and results - the small
  token / step-count outputs - gathered to the host from every process.
  """
  if mesh is None:
    return jnp.asarray, lambda x: x
  batch_sharding = sharding_lib.batch_sharding(mesh)

  def place(tree: Any) -> Any:
    return jax.tree.map(lambda x: _put(x, batch_sharding), tree)

  def to_host(x: Array) -> Any:
    if x.is_fully_addressable:
      return x
    from jax.experimental import multihost_utils  # local: multi-host only

    return multihost_utils.process_allgather(x, tiled=True)

  return place, to_host


__all__ = ["DenoiseState", "GenerateOutput", "StepInfo", "clear_cache", "commit_canvas", "generate", "place_state",
           "trace_counts"]
