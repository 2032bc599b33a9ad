"""The denoising loop of one canvas: a single `lax.while_loop` over a small `flax.struct` state.

    canvas <- seed canvas or uniform noise (pinned positions take their seed token)
    for n = N .. 1, while some row is unfinished:
      logits <- model.decode(canvas, cache, self-conditioning = softmax(previous step's processed logits) @ embed)
                (no self-conditioning at n = N)
      logits <- allowed-token restriction, pins made certain;  processed <- logits / T(n)
      sample a token per position (denoiser canvas), the argmax canvas, the entropies and the softmax weights of
        the processed logits in two passes over [B, C, V] (`entropy_bound.step_statistics`: one fused reduce,
        one elementwise pass writing the weights)
      accept <- rule(entropies, processed, n, N) | pinned;  re-noise the rest
        (with a checker: minus the positions it flags on the argmax canvas, `sampling.checker`)
      next self-conditioning input <- (weights @ embed) / sum of weights   [B, C, H]
      per row: stop when stable and confident (if early stopping); finished rows are frozen

The loop carries the self-conditioning *embeddings* `[B, C, H]` (what the decoder consumes), not the processed
logits `[B, C, V]`: per step only the logits and the softmax weights exist at vocabulary width (at the released
vocabulary of 262,144 and batch 8, 2 GiB each in float32). The logits are read by one fused reduction and one
elementwise pass that writes the weights, which the self-conditioning product reads once.

This module builds the traced function (`make_denoise`); `sampling.programs` compiles and caches it and
`sampling.generate` calls it once per canvas. PRNG use per canvas (fixed, so results are reproducible): one split
for the starting canvas, then one three-way split per step (carry, sample, re-noise).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.sampling import checker as checker_lib
from hackable_diffusion.sampling import entropy_bound as eb
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.rules import AcceptanceRule

Array = jax.Array


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
  sc_embeddings: Array  # [B, C, H] model dtype, softmax(previous step's processed logits) @ embed * sqrt(H)
  has_sc: Array  # [] bool, False before the first step (self-conditioning off)
  done: Array  # [B] bool, frozen rows
  steps: Array  # [B] int32, decoder forwards counted for unfinished rows
  history: Array  # [S, B, C] int32, the previous S argmax canvases (stable-and-confident stopping)
  trajectory: Array | None  # [N, B, C] int32 or None


@flax.struct.dataclass
class DenoiseScalars:
  """Traced per-call numbers of the loop (changing them does not recompile)."""

  num_steps: Array  # [] int32, N
  t_min: Array  # [] float32
  t_max: Array  # [] float32
  confidence_threshold: Array  # [] float32
  early_stopping: Array  # [] bool
  canvas_index: Array  # [] int32, reported to the step callback

  @classmethod
  def of(cls, config: SamplingConfig, canvas_index: int) -> DenoiseScalars:
    return cls(
        num_steps=jnp.asarray(config.max_denoising_steps, jnp.int32),
        t_min=jnp.asarray(config.t_min, jnp.float32),
        t_max=jnp.asarray(config.t_max, jnp.float32),
        confidence_threshold=jnp.asarray(config.confidence_threshold, jnp.float32),
        early_stopping=jnp.asarray(config.early_stopping),
        canvas_index=jnp.asarray(canvas_index, jnp.int32),
    )


@dataclasses.dataclass(frozen=True)
class DenoiseStatic:
  """Everything that changes the traced program (part of the compile-cache key)."""

  vocab_size: int
  stability_threshold: int
  has_pins: bool
  has_allowed: bool
  has_structure: bool
  static_rule: AcceptanceRule | None  # a rule that is not a pytree (then the `rule` argument is None)
  has_callback: bool
  trajectory_steps: int | None  # N when the trajectory is recorded
  self_conditioning: bool = True  # False: every step decodes with the self-conditioning input off
  has_checker: bool = False  # a checker re-noises the positions it flags (`sampling.checker`)
  static_checker: Any = None  # a checker that is not a pytree (then `CheckerArg.checker` is None)
  checker_confidence: bool = False  # flagged positions get entropy log V; no early stop while one is flagged
  checker_forget: bool = False  # flagged positions lose their self-conditioning input
  checker_restarts: bool = False  # rows ending a canvas with a violation restart (the per-row loop only)


def self_conditioning_embeddings(embed: Array, dtype: Any, weights: Array, total: Array) -> Array:
  """The decoder's self-conditioning input `softmax(z) @ embed * sqrt(H)` `[B, C, H]` in `dtype`.

  embed `[V, H]` (the tied embedding), weights `[B, C, V]` = `exp(z - max z)` in the embedding's dtype, total
  `[B, C]` their float32 sum (`entropy_bound.step_statistics`). The same quantity as
  `DiffusionGemma.soft_embeddings(z)`, with the normalisation applied after the product (`[B, C, H]` instead of
  `[B, C, V]` divisions, no normalised copy of the weights; equal up to rounding).
  """
  b, c, v = weights.shape
  scale = jnp.asarray(math.sqrt(embed.shape[1]), embed.dtype).astype(dtype)
  soft = (weights.reshape(b * c, v) @ embed).reshape(b, c, -1)  # [B, C, H]
  soft = soft * (1.0 / total)[..., None]
  return soft.astype(dtype) * scale


def canvas_logits(model: Any, static: DenoiseStatic, canvas: Array, cache: Any, sc_embeddings: Array, has_sc: Array,
                  seed_canvas: Array, pinned: Array, allowed: Array, structure: Array) -> Array:
  """One decoder forward of `canvas [B, C]` (self-conditioning `[B, C, H]` where `has_sc [B]`), its logits
  `[B, C, V]` float32 restricted to the allowed tokens and with the pinned positions made certain."""
  hidden = model.decode_hidden(canvas, cache, sc_embeddings, has_sc, structure if static.has_structure else None)
  logits = model.lm_logits(hidden)  # [B, C, V] float32
  if static.has_allowed:
    logits = eb.apply_allowed_tokens(logits, allowed)
  if static.has_pins:
    logits = eb.pin_logits(logits, seed_canvas, pinned)
  return logits


def checked_entropy(static: DenoiseStatic, checker_arg: checker_lib.CheckerArg | None, argmax: Array,
                    token_entropy: Array, pinned: Array) -> tuple[Array | None, Array]:
  """(the positions the checker flags on `argmax [B, C]` or None without a checker, the entropies `[B, C]` the rule
  and the stopping test see: raised to `log V` on flagged positions with `checker_confidence`)."""
  if not static.has_checker:
    return None, token_entropy
  checker = static.static_checker if static.static_checker is not None else checker_arg.checker
  flagged = checker_lib.violations(checker, argmax, pinned if static.has_pins else None)
  if static.checker_confidence:
    token_entropy = checker_lib.raise_entropy(token_entropy, flagged, static.vocab_size)
  return flagged, token_entropy


def checked_soft(static: DenoiseStatic, soft: Array, flagged: Array | None) -> Array:
  """The next self-conditioning input `[B, C, H]`, zero on flagged positions with `checker_forget`."""
  if flagged is None or not static.checker_forget:
    return soft
  return jnp.where(flagged[..., None], jnp.zeros((), soft.dtype), soft)


def checked_stop(static: DenoiseStatic, stop: Array, flagged: Array | None) -> Array:
  """The stop decision `[B]`, False for a row with a flagged position when `checker_confidence`."""
  if flagged is None or not static.checker_confidence:
    return stop
  return stop & ~jnp.any(flagged, axis=-1)


# on_step(call_id, canvas_index, step, argmax [B, C], done [B]): host side, through `jax.debug.callback`
StepHook = Callable[[Any, Any, Any, Any, Any], None]


def make_denoise(graphdef: nnx.GraphDef, static: DenoiseStatic, *, on_trace: Callable[[], None],
                 on_step: StepHook | None) -> Callable[..., Any]:
  """The traced denoising loop of one canvas (to be `jax.jit`ted).

  Returns `denoise(state, cache, key, seed_canvas [B, C], use_seed [], pinned [B, C], allowed [B, V],
  structure, frozen [B], scalars, rule, checker_arg, call_id []) -> (argmax canvas [B, C] int32, decoder forwards
  [B] int32, trajectory [N, B, C] int32 or None)`. `rule` is the traced acceptance rule (None when
  `static.static_rule` is set); `checker_arg` the traced checker (`checker.CheckerArg`; None without a checker:
  then nothing of it is traced); `on_trace()` is called at every trace; `on_step` (with `static.has_callback`)
  after every step. Checker restarts are the per-row loop's (`denoise_rows`); here a checker re-noises only.
  """

  def denoise(state, cache, key, seed_canvas, use_seed, pinned, allowed, structure, frozen,
              scalars: DenoiseScalars, rule: AcceptanceRule | None, checker_arg: checker_lib.CheckerArg | None,
              call_id):
    on_trace()
    accept_rule = static.static_rule if static.static_rule is not None else rule
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
        sc_embeddings=jnp.zeros((batch, canvas_len, model.config.hidden_size), model.dtype),
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
      logits = canvas_logits(model, static, s.canvas, cache, s.sc_embeddings, jnp.broadcast_to(s.has_sc, (batch,)),
                             seed_canvas, pinned, allowed, structure)  # [B, C, V] float32
      temp = eb.temperature(s.step, scalars.num_steps, scalars.t_min, scalars.t_max)
      key, sample_key, noise_key = jax.random.split(s.key, 3)
      # sample_tokens / argmax_canvas / entropy / softmax of transformers' "processed logits" `logits / temp`
      stats = eb.step_statistics(sample_key, logits, temp, weights_dtype=model.embed_tokens[...].dtype)
      denoised, argmax, token_entropy = stats.samples, stats.argmax, stats.entropy
      flagged, token_entropy = checked_entropy(static, checker_arg, argmax, token_entropy, pinned)
      # the rule's view of the processed logits: nothing is computed unless the rule reads them
      accept = accept_rule(token_entropy, logits / temp, s.step, scalars.num_steps)
      if flagged is not None:  # flagged positions are re-noised
        accept = accept & ~flagged
      if static.has_pins:
        accept = accept | pinned
      canvas = eb.renoise(noise_key, denoised, accept, vocab)
      if static.has_pins:
        canvas = eb.apply_pins(canvas, seed_canvas, pinned)
      # finished rows keep their canvas, argmax canvas and self-conditioning input
      argmax = jnp.where(s.done[:, None], s.argmax, argmax)
      canvas = jnp.where(s.done[:, None], s.canvas, canvas)
      soft = self_conditioning_embeddings(model.embed_tokens[...], model.dtype, stats.weights, stats.total)
      soft = checked_soft(static, soft, flagged)
      soft = jnp.where(s.done[:, None, None], s.sc_embeddings, soft)
      stop, history = eb.stable_and_confident(s.history, argmax, token_entropy, scalars.confidence_threshold)
      stop = checked_stop(static, stop, flagged)
      done = s.done | (stop & scalars.early_stopping)
      trajectory = s.trajectory
      if trajectory is not None:
        trajectory = jax.lax.dynamic_update_index_in_dim(trajectory, argmax, scalars.num_steps - s.step, axis=0)
      if static.has_callback and on_step is not None:
        jax.debug.callback(on_step, call_id, scalars.canvas_index, s.step, argmax, done)
      return DenoiseState(step=s.step - 1, key=key, canvas=canvas, argmax=argmax, sc_embeddings=soft,
                          has_sc=jnp.full((), static.self_conditioning), done=done, steps=steps, history=history,
                          trajectory=trajectory)

    final = jax.lax.while_loop(cond, body, init)
    trajectory = final.trajectory
    if trajectory is not None:  # steps after the loop ended repeat the final argmax canvas
      taken = scalars.num_steps - final.step
      idx = jnp.arange(trajectory.shape[0])[:, None, None]
      trajectory = jnp.where(idx < taken, trajectory, final.argmax[None])
    return final.argmax, final.steps, trajectory

  return denoise


def step_info(canvas_index: Any, step: Any, argmax: Any, done: Any) -> StepInfo:
  """The host-side `StepInfo` of one step (from the values `jax.debug.callback` hands over)."""
  return StepInfo(int(canvas_index), int(step), np.asarray(argmax), np.asarray(done))


__all__ = ["DenoiseScalars", "DenoiseState", "DenoiseStatic", "StepHook", "StepInfo", "canvas_logits",
           "checked_entropy", "checked_soft", "checked_stop", "make_denoise", "self_conditioning_embeddings",
           "step_info"]
