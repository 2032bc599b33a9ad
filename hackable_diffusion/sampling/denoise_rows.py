"""The denoising loop with one random stream and one step counter per row, run in chunks of steps.

`denoise.make_denoise` runs a whole canvas for a batch that starts and ends together, from one batch key. Here every
row carries its own key, step counter and stop flag (`RowState`), so a row's result is a function of its own key,
prompt and seed only, whatever else is in the batch and whenever it entered. That is what lets a serving loop
(`sampling.stream.generate_stream`) take a finished row out between two chunks of steps and start the next prompt
in its slot, and `generate(rng=<one key per row>)` give the same sequences in one fixed batch.

Per row and step (the batch loop's step, with per-row randomness):

    key, sample_key, noise_key <- split(row key, 3)
    logits <- decoder(canvas, cache, self-conditioning where the row has taken a step); allowed tokens; pins
    T <- temperature(row's steps remaining);   samples / argmax / entropies of logits / T (uniforms from sample_key)
    accept <- rule | pinned;  canvas <- accepted samples, uniform tokens from noise_key elsewhere;  pins
    the row is done after its last step, or when stable and confident (early stopping)

A row entering a slot (`reset`) starts like the batch loop's canvas: `key, init_key = split(its key)`, the seed canvas
or `randint(init_key, [C])`, `num_steps` steps to go. Rows that are done (or empty slots) are frozen: their state,
key included, does not change, and they cost no forward of their own (the batch's forward still runs over them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.sampling import entropy_bound as eb
from hackable_diffusion.sampling.checker import CheckerArg
from hackable_diffusion.sampling.denoise import DenoiseScalars, DenoiseStatic, StepHook, canvas_logits, \
    checked_entropy, checked_soft, checked_stop, self_conditioning_embeddings

Array = jax.Array


@flax.struct.dataclass
class RowState:
  """The per-row carry of the chunked loop (all leading dimensions are the batch's slots `B`)."""

  key: Array  # [B] typed PRNG keys: each row's own stream
  step: Array  # [B] int32, steps remaining (the next step taken is `step`; 0 once the row has run out)
  canvas: Array  # [B, C] int32, the (partly noisy) canvas fed to the decoder
  argmax: Array  # [B, C] int32, argmax canvas of the row's latest step
  sc_embeddings: Array  # [B, C, H] model dtype, the self-conditioning input of the next step
  has_sc: Array  # [B] bool, False before the row's first step
  done: Array  # [B] bool, stopped / out of steps / empty slot: frozen
  steps: Array  # [B] int32, decoder forwards the row has taken
  history: Array  # [S, B, C] int32, the row's previous S argmax canvases (stable-and-confident stopping)
  attempts: Array | None = None  # [B] int32, checker restarts taken on the canvas (None without restarts)


def empty_rows(batch: int, canvas_length: int, hidden: int, dtype: Any, stability_threshold: int,
               restarts: bool = False) -> RowState:
  """`B` empty slots (done, nothing to denoise); `restarts`: with the checker restarts' counter."""
  return RowState(
      key=jax.random.split(jax.random.key(0), batch),
      step=jnp.zeros((batch,), jnp.int32),
      canvas=jnp.zeros((batch, canvas_length), jnp.int32),
      argmax=jnp.zeros((batch, canvas_length), jnp.int32),
      sc_embeddings=jnp.zeros((batch, canvas_length, hidden), dtype),
      has_sc=jnp.zeros((batch,), bool),
      done=jnp.ones((batch,), bool),
      steps=jnp.zeros((batch,), jnp.int32),
      history=eb.init_stability_history(stability_threshold, batch, canvas_length),
      attempts=jnp.zeros((batch,), jnp.int32) if restarts else None,
  )


def _rows_where(mask: Array, new: RowState, old: RowState) -> RowState:
  """`new` on the rows of `mask [B]`, `old` elsewhere (every field is batch-major but the history, [S, B, C])."""

  def pick(n: Array, o: Array, axis: int) -> Array:
    m = mask.reshape((1,) * axis + (-1,) + (1,) * (n.ndim - axis - 1))
    return jnp.where(m, n, o)

  fields = {f: pick(getattr(new, f), getattr(old, f), 0) for f in
            ("key", "step", "canvas", "argmax", "sc_embeddings", "has_sc", "done", "steps")}
  attempts = None if new.attempts is None else pick(new.attempts, old.attempts, 0)
  return RowState(**fields, history=pick(new.history, old.history, 1), attempts=attempts)


def start_rows(rows: RowState, reset: Array, keys: Array, seed_canvas: Array, use_seed: Array, pinned: Array,
               active: Array, num_steps: Array, static: DenoiseStatic) -> RowState:
  """Rows of `reset [B]` start a canvas: key `keys [B]`, the seed canvas `[B, C]` where `use_seed [B]` (else uniform
  noise), pins `pinned [B, C]`; `active [B]` False leaves the (reset) slot empty. Other rows are unchanged."""
  batch, canvas_len = seed_canvas.shape
  split = jax.vmap(lambda k: jax.random.split(k, 2))(keys)  # [B, 2]
  noise = jax.vmap(lambda k: jax.random.randint(k, (canvas_len,), 0, static.vocab_size, dtype=jnp.int32))(
      split[:, 1])  # [B, C]
  canvas = jnp.where(use_seed[:, None], seed_canvas, noise)
  if static.has_pins:
    canvas = eb.apply_pins(canvas, seed_canvas, pinned)
  fresh = RowState(
      key=split[:, 0],
      step=jnp.broadcast_to(num_steps.astype(jnp.int32), (batch,)),
      canvas=canvas,
      argmax=canvas,
      sc_embeddings=jnp.zeros_like(rows.sc_embeddings),
      has_sc=jnp.zeros((batch,), bool),
      done=~active,
      steps=jnp.zeros((batch,), jnp.int32),
      history=eb.init_stability_history(static.stability_threshold, batch, canvas_len),
      attempts=None if rows.attempts is None else jnp.zeros((batch,), jnp.int32),
  )
  return _rows_where(reset, fresh, rows)


def restart_rows(rows: RowState, restart: Array, seed_canvas: Array, pinned: Array, num_steps: Array,
                 static: DenoiseStatic) -> RowState:
  """Rows of `restart [B]` start their canvas again (a checker restart): fresh uniform noise from a split of their
  key (pins kept), `num_steps` steps to go, no self-conditioning, an empty stability history, one more attempt;
  their forwards keep counting. Other rows are unchanged."""
  batch, canvas_len = seed_canvas.shape
  split = jax.vmap(lambda k: jax.random.split(k, 2))(rows.key)  # [B, 2]
  canvas = jax.vmap(lambda k: jax.random.randint(k, (canvas_len,), 0, static.vocab_size, dtype=jnp.int32))(
      split[:, 1])  # [B, C]
  if static.has_pins:
    canvas = eb.apply_pins(canvas, seed_canvas, pinned)
  fresh = rows.replace(
      key=split[:, 0],
      step=jnp.broadcast_to(num_steps.astype(jnp.int32), (batch,)),
      canvas=canvas,
      sc_embeddings=jnp.zeros_like(rows.sc_embeddings),
      has_sc=jnp.zeros((batch,), bool),
      done=jnp.zeros((batch,), bool),
      history=eb.init_stability_history(static.stability_threshold, batch, canvas_len),
      attempts=rows.attempts + 1,
  )
  return _rows_where(restart, fresh, rows)


def _restart_or_finish(rows: RowState, flagged: Array, checker_arg: CheckerArg, seed_canvas: Array, pinned: Array,
                       num_steps: Array, static: DenoiseStatic) -> RowState:
  """After a step: rows that finished with a flagged position restart while they have restarts and forwards left;
  rows whose forwards reached the budget are done (their last attempt is the result)."""
  spent = rows.steps >= checker_arg.budget  # [B]
  invalid = jnp.any(flagged, axis=-1)  # [B]
  restart = rows.done & invalid & (rows.attempts < checker_arg.restarts) & ~spent
  rows = rows.replace(done=rows.done | spent)
  return restart_rows(rows, restart, seed_canvas, pinned, num_steps, static)


def make_denoise_rows(graphdef: nnx.GraphDef, static: DenoiseStatic, key_impl: str, *,
                      on_trace: Callable[[], None], on_step: StepHook | None = None) -> Callable[..., Any]:
  """The traced chunk of the per-row loop (to be `jax.jit`ted).

  Returns `run(state, cache, rows, reset [B], key_data [B, ...], seed_canvas [B, C], use_seed [B], pinned [B, C],
  active [B], allowed [B, V], structure, scalars, rule, checker_arg, max_steps [], stop_on_finish [] bool,
  call_id) -> RowState`:
  starts the `reset` rows (`start_rows`, keys `wrap_key_data(key_data, impl=key_impl)`), then takes up to
  `max_steps` steps while some row is not done; with `stop_on_finish`, it also returns after the first step that
  finishes a row (so a serving loop can refill that slot at once). `rows=None`: every slot starts empty (a fresh
  batch). `on_step` (with `static.has_callback`) after every step, given the step the live rows took (the largest,
  when rows started at different times). `checker_arg` (`checker.CheckerArg`, None without a checker: nothing of
  it traced): the checker's flagged positions are re-noised; with `static.checker_restarts` a row that would finish
  with a flagged position restarts (`restart_rows`) while it has restarts and forwards (`CheckerArg.budget`) left,
  and a row that reaches the budget is done.
  """

  def run(state, cache, rows: RowState | None, reset, key_data, seed_canvas, use_seed, pinned, active, allowed,
          structure, scalars: DenoiseScalars, rule, checker_arg, max_steps, stop_on_finish, call_id):
    on_trace()
    accept_rule = static.static_rule if static.static_rule is not None else rule
    model = nnx.merge(graphdef, state)
    batch, canvas_len = seed_canvas.shape
    if rows is None:
      rows = empty_rows(batch, canvas_len, model.config.hidden_size, model.dtype, static.stability_threshold,
                        restarts=static.checker_restarts)
    keys = jax.random.wrap_key_data(key_data, impl=key_impl)
    rows = start_rows(rows, reset, keys, seed_canvas, use_seed, pinned, active, scalars.num_steps, static)
    entered_done = rows.done  # [B] empty slots and rows that ended before this chunk
    weights_dtype = model.embed_tokens[...].dtype

    def body(carry: tuple[Array, RowState]) -> tuple[Array, RowState]:
      taken, s = carry
      live = ~s.done
      split = jax.vmap(lambda k: jax.random.split(k, 3))(s.key)  # [B, 3]
      logits = canvas_logits(model, static, s.canvas, cache, s.sc_embeddings, s.has_sc, seed_canvas, pinned,
                             allowed, structure)  # [B, C, V]
      temp = eb.temperature(s.step, scalars.num_steps, scalars.t_min, scalars.t_max)[:, None]  # [B, 1]
      uniforms = jax.vmap(lambda k: jax.random.uniform(k, (canvas_len,), jnp.float32))(split[:, 1])  # [B, C]
      stats = eb.step_statistics(None, logits, temp, weights_dtype=weights_dtype, uniforms=uniforms)
      flagged, token_entropy = checked_entropy(static, checker_arg, stats.argmax, stats.entropy, pinned)
      accept = accept_rule(token_entropy, logits / temp[..., None], s.step[:, None], scalars.num_steps)
      if flagged is not None:  # flagged positions are re-noised
        accept = accept & ~flagged
      if static.has_pins:
        accept = accept | pinned
      noise = jax.vmap(lambda k: jax.random.randint(k, (canvas_len,), 0, static.vocab_size, dtype=jnp.int32))(
          split[:, 2])  # [B, C]
      canvas = jnp.where(accept, stats.samples, noise)
      if static.has_pins:
        canvas = eb.apply_pins(canvas, seed_canvas, pinned)
      soft = checked_soft(static, self_conditioning_embeddings(model.embed_tokens[...], model.dtype, stats.weights,
                                                               stats.total), flagged)
      stop, history = eb.stable_and_confident(s.history, stats.argmax, token_entropy, scalars.confidence_threshold)
      stop = checked_stop(static, stop, flagged)
      stepped = RowState(key=split[:, 0], step=s.step - 1, canvas=canvas, argmax=stats.argmax, sc_embeddings=soft,
                         has_sc=jnp.full_like(s.has_sc, static.self_conditioning),
                         done=(s.step <= 1) | (stop & scalars.early_stopping),
                         steps=s.steps + 1, history=history, attempts=s.attempts)
      if static.checker_restarts:
        stepped = _restart_or_finish(stepped, flagged, checker_arg, seed_canvas, pinned, scalars.num_steps, static)
      new = _rows_where(live, stepped, s)
      if static.has_callback and on_step is not None:
        jax.debug.callback(on_step, call_id, scalars.canvas_index, jnp.max(jnp.where(live, s.step, 0)), new.argmax,
                           new.done)
      return taken + 1, new

    def cond(carry: tuple[Array, RowState]) -> Array:
      taken, s = carry
      finished = jnp.any(s.done & ~entered_done)
      return (taken < max_steps) & ~jnp.all(s.done) & ~(stop_on_finish & finished)

    _, rows = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), rows))
    return rows

  return run


__all__ = ["RowState", "empty_rows", "make_denoise_rows", "restart_rows", "start_rows"]
