"""`generate_stream`: a serving-style loop over an iterable of prompts that refills finished rows.

A fixed batch runs until its slowest row stops; with early stopping most rows stop long before. Here the batch is
`batch_size` *slots*. Prompts are encoded ahead of time, `batch_size` at a time, into a staging KV cache (one
encoder pass per `batch_size` prompts, at `prompt_length`: no prompt-length bucket). The compiled per-row loop
(`sampling.denoise_rows`) runs until a row finishes while another prompt waits (or at most `chunk_steps` steps);
then the host takes every row that stopped out of its slot: it commits the canvas (EOS / pad as `generate`), then
either encodes it into the slot's KV cache and starts the row's next canvas, or yields the finished row and copies
the next staged prompt's cache row into the slot (the other rows untouched). Shapes never change, so the three
programs (encode rows, copy rows, denoise chunk) compile once per stream configuration.

Every row has its own key (the request's, else `fold_in(rng, index)`) and its canvas `k` starts from
`fold_in(key, k)`: a row's sequence depends on its own key and inputs only, and equals what
`generate(prompts, rng=<the same keys, one per row>)` gives it in one fixed batch (tests/sampling/test_stream.py).
Prompts are left-padded to `prompt_length` (as `generate` pads a batch to its longest prompt). A request may carry
images (`StreamRequest.pixel_values` / `image_position_ids`, as `generate`'s for one row): the vision tower runs in
the staging encoder pass of its block, whose images are stacked (patches padded to the block's widest, the image
count padded to a power of two with empty images that feed no token), so few image counts compile.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.sampling import denoise_rows as rows_lib
from hackable_diffusion.sampling import programs
from hackable_diffusion.sampling.checker import Checker
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.denoise import DenoiseScalars
from hackable_diffusion.sampling.generate import commit_canvas
from hackable_diffusion.sampling.prepare import GenerateRequest, Prepared, prepare
from hackable_diffusion.sampling.rules import AcceptanceRule

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StreamRequest:
  """One prompt of a stream. input_ids `[P]`; attention_mask `[P]` (False on left padding; None: all tokens);
  seed_canvas / pinned `[k * C]` (as `generate`'s rows); key: the row's `jax.random` key (None:
  `fold_in(rng, index)`); pixel_values `[N, patches, 3 p^2]` / image_position_ids `[N, patches, 2]`: the prompt's
  images (as `generate`'s, for this prompt alone)."""

  input_ids: Any
  attention_mask: Any = None
  seed_canvas: Any = None
  pinned: Any = None
  key: Array | None = None
  pixel_values: Any = None
  image_position_ids: Any = None


@dataclasses.dataclass(frozen=True)
class StreamOutput:
  """One finished row. index: the request's position in the input; sequence `[P + k * C]` int32: the prompt as
  given, then the generated canvases (pad after an EOS); denoising_steps `[k]`: decoder forwards per canvas;
  tokens_per_forward: non-pad new tokens / forwards."""

  index: int
  sequence: np.ndarray
  denoising_steps: np.ndarray
  tokens_per_forward: float


@dataclasses.dataclass
class _Slot:
  """The host's view of one occupied slot."""

  index: int
  key: Array  # the row's key
  request: Prepared  # the request validated as a batch of one
  canvas: int = 0  # the canvas being denoised
  length: int = 0  # cache length before that canvas
  blocks: list[np.ndarray] = dataclasses.field(default_factory=list)
  steps: list[int] = dataclasses.field(default_factory=list)


def _as_request(item: Any) -> StreamRequest:
  return item if isinstance(item, StreamRequest) else StreamRequest(input_ids=item)


def generate_stream(
    model: Any,
    requests: Iterable[StreamRequest | Sequence[int]],
    config: SamplingConfig | None = None,
    *,
    rng: Array,
    batch_size: int = 8,
    prompt_length: int | None = None,
    chunk_steps: int | None = None,
    allowed_token_ids: Sequence[int] | Any = None,
    canvas_attention_mask: Any = None,
    acceptance: AcceptanceRule | None = None,
    checker: Checker | None = None,
) -> Iterator[StreamOutput]:
  """Samples every request, `batch_size` rows at a time, refilling a row's slot as soon as it finishes.

  Args:
    model: a `DiffusionGemma`.
    requests: prompts (`[P]` id sequences) or `StreamRequest`s; read lazily, `batch_size` at a time (each block
      is validated and encoded when the previous one has been taken into slots). With early stopping and all
      requests at hand, feeding them in `longest_first(pinned)` order shortens the tail (as the evaluation does).
    config: a `SamplingConfig` (as `generate`).
    rng: a `jax.random` key; request `i` without its own key uses `fold_in(rng, i)`.
    batch_size: slots (rows per compiled step).
    prompt_length: every prompt is left-padded to it (None: the first prompt's length); a longer one is an error.
      The stream samples at exactly this width: its shapes never change, so `config.prompt_length_buckets` (which
      let `generate` calls of many widths share programs) would only add padding, and are not applied.
    chunk_steps: at most this many denoising steps per compiled call (None: no limit). A call also ends after
      the step that finishes a row while a prompt (or the row's next canvas) is waiting, which is then started.
    allowed_token_ids / canvas_attention_mask / acceptance / checker: as `generate` (the same for every row;
      `canvas_attention_mask` with a leading dimension of 1). With `config.checker_restarts`, a row's restarts run
      inside the compiled chunks (it leaves its slot when valid or out of budget).

  Yields:
    `StreamOutput`s in the order rows finish (see `index`).
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} is invalid: must be an integer >= 1")
  if chunk_steps is not None and (isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int)
                                  or chunk_steps < 1):
    raise ValueError(f"chunk_steps={chunk_steps!r} is invalid: must be None or an integer >= 1")
  if canvas_attention_mask is not None and np.shape(canvas_attention_mask)[0] != 1:
    raise ValueError(f"canvas_attention_mask has shape {np.shape(canvas_attention_mask)}: generate_stream needs "
                     f"one structure for every row (leading dimension 1)")
  if config is None or isinstance(config, SamplingConfig):  # anything else: `prepare`'s one-line error
    config = (config or SamplingConfig()).replace(prompt_length_buckets=())  # one width (bucketing changes no result)
  items = iter(enumerate(map(_as_request, requests)))
  first = next(items, None)
  if first is None:
    return
  width = prompt_length or len(np.asarray(first[1].input_ids).reshape(-1))
  shared = prepare(model, GenerateRequest(
      input_ids=np.zeros((batch_size, width), np.int32), config=config, rng=rng, allowed_token_ids=allowed_token_ids,
      canvas_attention_mask=canvas_attention_mask, acceptance=acceptance, checker=checker))
  static = dataclasses.replace(shared.static, has_pins=True)  # all-False pins change nothing
  run = _Runner(model, shared, static, batch_size, width)
  pending = itertools.chain([first], items)
  staged: collections.deque[tuple[int, _Slot]] = collections.deque()  # (staging cache row, the row to be)
  exhausted = False
  slots: list[_Slot | None] = [None] * batch_size
  max_steps = chunk_steps if chunk_steps is not None else 2**31 - 1
  while True:
    new_prompt = np.zeros(batch_size, bool)  # [B] slots that start a prompt
    to_copy = np.zeros(batch_size, bool)  # [B] of those, the ones whose staged cache row is not copied yet
    source = np.zeros(batch_size, np.int32)  # [B] their row in the staging cache
    for i in range(batch_size):
      if slots[i] is not None:
        continue
      if not staged and not exhausted:
        run.take_staged(slots, to_copy, source)  # rows taken from the block about to be replaced: copy them first
        to_copy[:] = False
        block = [_Slot(index=j, key=_row_key(r, rng, j),
                       request=_validate(model, r, shared.config, width, rng, j, checker))
                 for j, r in itertools.islice(pending, batch_size)]
        exhausted = len(block) < batch_size
        staged.extend(enumerate(block))
        run.stage(block)
      if not staged:
        continue
      source[i], slots[i] = staged.popleft()
      new_prompt[i] = to_copy[i] = True
    if not any(s is not None for s in slots):
      return
    run.take_staged(slots, to_copy, source)
    run.encode_canvases(slots, run.continuing)
    starting = new_prompt | run.continuing
    # a waiting prompt or a next canvas: return as soon as a row finishes, so its slot is busy again at once
    waiting = bool(staged) or not exhausted or shared.num_canvases > 1
    done, argmax, forwards = run.chunk(slots, starting, max_steps, waiting)
    run.continuing = np.zeros(batch_size, bool)
    for i, slot in enumerate(slots):
      if slot is None or not done[i]:
        continue
      block, finished = commit_canvas(argmax[i:i + 1].copy(), np.zeros(1, bool), shared.eos_ids,
                                      shared.pad_token_id)
      slot.blocks.append(block[0])
      slot.steps.append(int(forwards[i]))
      if finished[0] or len(slot.blocks) == shared.num_canvases:
        yield _output(slot, shared)
        slots[i] = None
      else:
        slot.canvas += 1
        run.continuing[i] = True


def longest_first(pinned: Any) -> np.ndarray:
  """The order to feed requests to `generate_stream` in so that the rows likely to take the most steps start first:
  most free (unpinned) canvas positions first, ties in input order. pinned `[n, T]` bool -> `[n]` indices.

  With early stopping a row's steps grow with what it has to fill (Sudoku: blanks; correlation 0.82 on the main
  job's test split), and a stream's last rows run on while the slots around them idle (the tail): starting the
  long rows first leaves short ones for the tail (docs/sampling.md). Results do not depend on the order when every
  request carries its own key.
  """
  pins = np.asarray(pinned, bool)
  if pins.ndim != 2:
    raise ValueError(f"longest_first: pinned has shape {pins.shape}; expected [requests, canvas tokens]")
  return np.argsort(-(~pins).sum(axis=1), kind="stable")


def _row_key(request: StreamRequest, rng: Array, index: int) -> Array:
  """The row's typed key: the request's own, else `fold_in(rng, index)`."""
  key = request.key if request.key is not None else jax.random.fold_in(rng, index)
  return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


def _validate(model: Any, request: StreamRequest, config: SamplingConfig, width: int, rng: Array,
              index: int, checker: Checker | None = None) -> Prepared:
  """The request as a one-row `generate` call (every check of `prepare`, its errors naming request `index`), its
  prompt left-padded to `width`."""
  ids = np.asarray(request.input_ids)
  if ids.ndim != 1 or ids.size > width:
    raise ValueError(f"generate_stream: request {index}: input_ids of shape {ids.shape}: expected one prompt of at "
                     f"most prompt_length={width} tokens")
  given = np.ones(ids.shape, bool) if request.attention_mask is None else np.asarray(request.attention_mask)
  if given.shape != ids.shape:
    raise ValueError(f"generate_stream: request {index}: attention_mask has shape {given.shape}, input_ids {ids.shape}")
  padded = np.zeros((1, width), ids.dtype if ids.size else np.int32)
  mask = np.zeros((1, width), bool)
  padded[0, width - ids.size:], mask[0, width - ids.size:] = ids, given
  as_row = (lambda x: None if x is None else np.asarray(x)[None])
  try:
    return prepare(model, GenerateRequest(input_ids=padded, config=config, rng=rng, attention_mask=mask,
                                          seed_canvas=as_row(request.seed_canvas), pinned=as_row(request.pinned),
                                          pixel_values=request.pixel_values,
                                          image_position_ids=request.image_position_ids, checker=checker))
  except ValueError as e:
    raise type(e)(f"generate_stream: request {index}: {e}") from None


def stacked_images(requests: list[Prepared]) -> tuple[Array, Array] | None:
  """The images of `requests` in row order as one batch (pixel_values `[N, patches, D]`, positions `[N, patches,
  2]`), or None when none has any. Patches are padded to the widest request's (padding patches change no soft
  token), and the image count up to a power of two with empty images (all padding: their soft tokens come after
  every real one and fill no image token), so that blocks with a similar number of images share one program."""
  given = [(r.pixel_values, r.image_position_ids) for r in requests if r.pixel_values is not None]
  if not given:
    return None
  n = sum(p.shape[0] for p, _ in given)
  width = max(p.shape[1] for p, _ in given)
  count = 1 << max(n - 1, 0).bit_length()
  pixels = np.zeros((count, width, given[0][0].shape[2]), np.float32)
  positions = np.full((count, width, 2), -1, np.int32)
  row = 0
  for p, pos in given:
    pixels[row:row + p.shape[0], :p.shape[1]] = p
    positions[row:row + p.shape[0], :p.shape[1]] = pos
    row += p.shape[0]
  return jnp.asarray(pixels), jnp.asarray(positions)


def _placed_like(state: Any, tree: Any) -> Any:
  """`tree` committed to the device of the model's arrays when they are committed to one: the compiled programs
  return the cache and row state committed there, and a first call with uncommitted inputs would compile each
  program a second time (seconds each for the Sudoku denoising chunk)."""
  leaf = next((x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)), None)
  if leaf is None or not getattr(leaf, "committed", False) or len(leaf.devices()) != 1:
    return tree
  return jax.device_put(tree, next(iter(leaf.devices())))


def _output(slot: _Slot, shared: Prepared) -> StreamOutput:
  request = slot.request
  prompt = request.input_ids[0][request.attention_mask[0]]
  new = np.concatenate(slot.blocks)
  pad = shared.pad_token_id
  valid = int((new != pad).sum()) if pad is not None else new.size
  steps = np.asarray(slot.steps, np.int32)
  return StreamOutput(index=slot.index, sequence=np.concatenate([prompt, new]).astype(np.int32),
                      denoising_steps=steps,  # float32, as `generate` computes it (the same number)
                      tokens_per_forward=float(np.float32(valid) / np.float32(max(int(steps.sum()), 1))))


class _Runner:
  """The device side of a stream: the model's state, the KV cache and per-row carry, and the per-slot host buffers
  (seed canvas and pins of the canvas each slot is denoising)."""

  def __init__(self, model: Any, shared: Prepared, static: Any, batch: int, width: int):
    graphdef, self.state = nnx.split(model)
    self.shared, self.batch = shared, batch
    canvas = shared.canvas_length
    self.width = width  # every prompt, left-padded (the stream applies no prompt-length bucket)
    self.cache = _placed_like(self.state, model.init_cache(batch, self.width + (shared.num_canvases - 1) * canvas))
    self.staging = _placed_like(self.state, model.init_cache(batch, self.width))  # prompts encoded ahead
    self.encode = programs.encode_rows_program(graphdef)
    self.encode_images = programs.encode_rows_images_program(graphdef) if model.config.vision is not None else None
    self.copy = programs.copy_rows_program()
    self.denoise = programs.denoise_rows_program(graphdef, static, shared.key_impl)
    self.rows = _placed_like(self.state, rows_lib.empty_rows(batch, canvas, model.config.hidden_size, model.dtype,
                                                              static.stability_threshold,
                                                              restarts=static.checker_restarts))
    self.seed = np.zeros((batch, canvas), np.int32)
    self.pins = np.zeros((batch, canvas), bool)
    self.continuing = np.zeros(batch, bool)
    self.allowed = jnp.asarray(shared.allowed) if shared.allowed is not None else jnp.ones((1, 1), bool)
    self.structure = shared.structure if shared.structure is not None else jnp.ones((1, 1, 1, 1), bool)
    self.scalars = DenoiseScalars.of(shared.config, 0)

  def stage(self, block: list[_Slot]) -> None:
    """Encodes the prompts of `block` (at most `batch` rows; row `j` = `block[j]`, left-padded to the stream's
    width) into the staging cache, in one encoder pass of the batch's shape."""
    if not block:
      return
    ids = np.zeros((self.batch, self.width), np.int32)
    mask = np.zeros((self.batch, self.width), bool)
    lengths = np.zeros(self.batch, np.int32)
    for j, slot in enumerate(block):
      request = slot.request
      p = request.prompt_length
      ids[j, :p], mask[j, :p] = request.input_ids[0], request.attention_mask[0]
      lengths[j] = p
    which = jnp.asarray(np.arange(self.batch) < len(block))
    args = (self.state, self.staging, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(lengths), which, which)
    images = stacked_images([slot.request for slot in block])
    self.staging = self.encode(*args) if images is None else self.encode_images(*args, *images)

  def take_staged(self, slots: list[_Slot | None], which: np.ndarray, source: np.ndarray) -> None:
    """Slot `i` of `which` gets the staging cache's row `source[i]` (its prompt); the other slots are unchanged."""
    if not which.any():
      return
    for i in np.flatnonzero(which):
      slots[i].length = slots[i].request.prompt_length
    self.cache = self.copy(self.cache, self.staging, jnp.asarray(source), jnp.asarray(which))

  def encode_canvases(self, slots: list[_Slot | None], which: np.ndarray) -> None:
    """Appends the last committed canvas of the rows `which` to their cache rows."""
    if not which.any():
      return
    c = self.shared.canvas_length
    ids = np.zeros((self.batch, c), np.int32)
    lengths = np.zeros(self.batch, np.int32)
    for i in np.flatnonzero(which):
      ids[i] = slots[i].blocks[-1]
      lengths[i] = slots[i].length = slots[i].length + c
    self.cache = self.encode(self.state, self.cache, jnp.asarray(ids), jnp.ones((self.batch, c), bool),
                             jnp.asarray(lengths), jnp.asarray(which), jnp.zeros(self.batch, bool))

  def chunk(self, slots: list[_Slot | None], starting: np.ndarray, max_steps: int,
            stop_on_finish: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Starts the canvases of `starting`, runs up to `max_steps` steps (with `stop_on_finish`, until a row
    finishes); returns (done [B], argmax [B, C], forwards [B]) on the host."""
    key_data = np.zeros((self.batch,) + self._key_shape(), np.uint32)
    use_seed = np.zeros(self.batch, bool)
    active = np.array([s is not None for s in slots])
    for i in np.flatnonzero(starting):
      slot = slots[i]
      seed, pins, has_seed = slot.request.canvas_seed(slot.canvas)
      self.seed[i], self.pins[i], use_seed[i] = seed[0], pins[0], has_seed
      key_data[i] = np.asarray(jax.random.key_data(jax.random.fold_in(slot.key, slot.canvas)))
    self.rows = self.denoise(self.state, self.cache, self.rows, jnp.asarray(starting), jnp.asarray(key_data),
                             jnp.asarray(self.seed), jnp.asarray(use_seed), jnp.asarray(self.pins),
                             jnp.asarray(active), self.allowed, self.structure, self.scalars, self.shared.rule_arg,
                             self.shared.checker_arg, jnp.asarray(max_steps, jnp.int32), jnp.asarray(stop_on_finish))
    done = np.asarray(self.rows.done)
    if not (done & active).any():
      return done, np.zeros((self.batch, self.shared.canvas_length), np.int32), np.zeros(self.batch, np.int32)
    return done, np.asarray(self.rows.argmax), np.asarray(self.rows.steps)

  def _key_shape(self) -> tuple[int, ...]:
    return jax.random.key_data(jax.random.key(0, impl=self.shared.key_impl)).shape


__all__ = ["StreamOutput", "StreamRequest", "generate_stream", "longest_first", "stacked_images"]
