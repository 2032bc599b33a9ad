"""Checkers in the sampler (`sampling/checker.py`): unchanged results without one, flagged positions re-noised,
confidence guarding early stopping, restarts within a forward budget, and one-line errors."""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import checker as checker_lib
from hackable_diffusion.sampling import programs
from hackable_diffusion.sampling.denoise import DenoiseScalars, checked_entropy, checked_soft
from hackable_diffusion.sampling.prepare import GenerateRequest, prepare
from hackable_diffusion.sampling.stream import StreamRequest, generate_stream

VOCAB, CANVAS, PROMPT, BATCH, STEPS = 64, 8, 5, 3, 6
# one canvas, stability not required (rows stop as soon as confident): every test shares the few programs this needs
CONFIG = hd.SamplingConfig(max_new_tokens=CANVAS, max_denoising_steps=STEPS, stability_threshold=0)
IDS = np.random.default_rng(0).integers(3, VOCAB - 3, size=(BATCH, PROMPT))
# The sampler's output for CONFIG / IDS on the tiny model below, computed once with the sampler as it was before
# checkers existed (batch key 0, then per-row keys split(key(1), 3)): new tokens, forwards per canvas.
GUARDED = CONFIG.replace(checker_confidence=True, checker_forget=True)  # every per-step option of a checker
BEFORE_BATCH = ([[48, 42, 46, 10, 13, 25, 10, 18], [44, 38, 57, 45, 42, 62, 45, 14], [5, 45, 14, 59, 45, 55, 27, 11]],
                [[6], [6], [6]])
BEFORE_ROWS = ([[24, 4, 8, 27, 56, 6, 15, 27], [55, 60, 1, 0, 0, 0, 0, 0], [11, 56, 15, 60, 35, 38, 35, 25]],
               [[6], [6], [6]])


@flax.struct.dataclass
class FlagPosition:
  """Flags one canvas position in every row (a position past the canvas flags nothing); traced: one program."""

  position: Any

  def __call__(self, canvas):
    return jnp.broadcast_to(jnp.arange(canvas.shape[1]) == self.position, canvas.shape)


@pytest.fixture(scope="module")
def model(hf_factory):
  _, path = hf_factory("sampling_checker", vocab=VOCAB, canvas=CANVAS)
  return hd.load_pretrained(path)


def _result(out) -> tuple[list[list[int]], list[list[int]]]:
  return np.asarray(out.sequences)[:, PROMPT:].tolist(), np.asarray(out.denoising_steps).tolist()


def _row_keys(seed: int) -> jax.Array:
  return jax.random.split(jax.random.key(seed), BATCH)


def test_without_a_checker_the_sampler_is_unchanged(model):
  batch = hd.generate(model, IDS, CONFIG, rng=jax.random.key(0))
  traces = programs.trace_counts()["denoise"]
  assert _result(hd.generate(model, IDS, CONFIG, rng=jax.random.key(0), checker=None)) == _result(batch)
  assert programs.trace_counts()["denoise"] == traces  # checker=None: the very same compiled program
  assert _result(batch) == BEFORE_BATCH
  assert _result(hd.generate(model, IDS, CONFIG, rng=_row_keys(1))) == BEFORE_ROWS


def test_a_checker_that_flags_nothing_changes_nothing(model):
  nothing = FlagPosition(position=10 * CANVAS)
  guarded = GUARDED
  assert _result(hd.generate(model, IDS, guarded, rng=jax.random.key(0), checker=nothing)) == BEFORE_BATCH
  assert _result(hd.generate(model, IDS, guarded, rng=_row_keys(1), checker=nothing)) == BEFORE_ROWS
  # restarts run the per-row loop (keys split(rng, B) from one key); nothing flagged: no restart, same tokens
  restarts = guarded.replace(checker_restarts=3)
  got = hd.generate(model, IDS, restarts, rng=jax.random.key(1), checker=nothing)
  assert _result(got) == _result(hd.generate(model, IDS, CONFIG, rng=_row_keys(1)))


def _run_steps(model, checker, steps: int, pins: np.ndarray):
  """Drives the per-row program one step per call in the deterministic regime (every position accepted, sampling =
  argmax; seed canvas 7 with `pins`); yields (the row keys before the step, the row state after it)."""
  cfg = CONFIG.replace(max_denoising_steps=steps, t_min=1e-4, t_max=2e-4, entropy_bound=1e9, early_stopping=False)
  seed = np.full((BATCH, CANVAS), 7, np.int32)
  p = prepare(model, GenerateRequest(input_ids=IDS, config=cfg, rng=_row_keys(2), checker=checker, seed_canvas=seed,
                                     pinned=pins))
  graphdef, state = nnx.split(model)
  cache = model.init_cache(BATCH, p.cache_capacity)
  ids, mask = p.padded_prompt()
  cache = programs.encode_program(graphdef)(state, cache, jnp.asarray(ids), jnp.asarray(mask),
                                            jnp.full((BATCH,), PROMPT, jnp.int32))
  program = programs.denoise_rows_program(graphdef, p.static, p.key_impl)
  every = jnp.ones((BATCH,), bool)
  seed_k, pins_k, has_seed = p.canvas_seed(0)
  keys = jax.random.wrap_key_data(jnp.asarray(p.row_keys), impl=p.key_impl)
  rows, reset = None, every
  row_keys = jax.vmap(lambda k: jax.random.split(k, 2)[0])(keys)  # what `start_rows` gives the first step
  for _ in range(steps):
    rows = program(state, cache, rows, reset, jax.random.key_data(keys), jnp.asarray(seed_k),
                   every & has_seed, jnp.asarray(pins_k), every, jnp.ones((1, 1), bool), jnp.ones((1, 1, 1, 1), bool),
                   DenoiseScalars.of(p.config, 0), p.rule_arg, p.checker_arg, jnp.asarray(1, jnp.int32),
                   jnp.asarray(False))
    yield row_keys, rows
    row_keys, reset = rows.key, ~every


def test_flagged_positions_are_renoised_at_every_step(model):
  renoised = 0
  for before, rows in _run_steps(model, FlagPosition(position=3), STEPS, np.zeros((BATCH, CANVAS), bool)):
    noise_keys = jax.vmap(lambda k: jax.random.split(k, 3)[2])(before)
    noise = np.asarray(jax.vmap(lambda k: jax.random.randint(k, (CANVAS,), 0, VOCAB, dtype=jnp.int32))(noise_keys))
    canvas, argmax = np.asarray(rows.canvas), np.asarray(rows.argmax)
    np.testing.assert_array_equal(canvas[:, 3], noise[:, 3])  # position 3: this step's fresh noise
    others = np.arange(CANVAS) != 3
    np.testing.assert_array_equal(canvas[:, others], argmax[:, others])  # the rest: accepted (= argmax here)
    renoised += int((canvas[:, 3] != argmax[:, 3]).sum())
  assert renoised > 0  # the noise differs from what would have been accepted


def test_pinned_positions_are_never_renoised(model):
  pins = np.zeros((BATCH, CANVAS), bool)
  pins[:, 3] = True
  for _, rows in _run_steps(model, FlagPosition(position=3), 2, pins):
    assert (np.asarray(rows.canvas)[:, 3] == 7).all()


def test_confidence_raises_the_entropy_and_blocks_early_stopping(model):
  eager = CONFIG.replace(confidence_threshold=1e9)  # every row confident at once: it stops after its first step
  assert (np.asarray(hd.generate(model, IDS, eager, rng=jax.random.key(0)).denoising_steps) == 1).all()
  flag = FlagPosition(position=3)
  guarded = hd.generate(model, IDS, GUARDED.replace(confidence_threshold=1e9), rng=jax.random.key(0), checker=flag)
  assert (np.asarray(guarded.denoising_steps) == STEPS).all()  # a flagged position: never stable and confident
  rows = hd.generate(model, IDS, GUARDED.replace(confidence_threshold=1e9), rng=_row_keys(0), checker=flag)
  assert (np.asarray(rows.denoising_steps) == STEPS).all()  # the per-row loop too
  # what the acceptance rule and the stopping test see: the flagged position's entropy raised to log V
  static = prepare(model, GenerateRequest(input_ids=IDS, config=GUARDED, rng=jax.random.key(0), checker=flag)).static
  entropy = jnp.full((BATCH, CANVAS), 0.25)
  flagged, seen = checked_entropy(static, checker_lib.checker_arg(flag, 0, STEPS), jnp.zeros((BATCH, CANVAS),
                                  jnp.int32), entropy, jnp.zeros((BATCH, CANVAS), bool))
  np.testing.assert_allclose(np.asarray(seen)[:, 3], math.log(VOCAB), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(seen)[:, np.arange(CANVAS) != 3], 0.25)
  assert np.asarray(flagged)[:, 3].all() and np.asarray(flagged).sum() == BATCH
  soft = np.asarray(checked_soft(static, jnp.ones((BATCH, CANVAS, 4)), flagged))  # forget: no input there
  assert (soft[:, 3] == 0).all() and (soft[:, np.arange(CANVAS) != 3] == 1).all()


def test_restarts_spend_the_budget_on_rows_that_stay_invalid(model):
  flag = FlagPosition(position=3)
  guarded = GUARDED
  budget = hd.generate(model, IDS, guarded.replace(checker_restarts=100, checker_step_budget=15),
                       rng=jax.random.key(0), checker=flag)
  assert (np.asarray(budget.denoising_steps) == 15).all()  # every row, every canvas: the whole budget
  one = hd.generate(model, IDS, guarded.replace(checker_restarts=1), rng=jax.random.key(0), checker=flag)
  assert (np.asarray(one.denoising_steps) == 2 * STEPS).all()  # the first attempt and one restart, in full
  # the refilling stream runs the same compiled restarts: the sequences of generate with the same row keys
  cfg = guarded.replace(checker_restarts=2, checker_step_budget=10)
  keys = _row_keys(3)
  fixed = hd.generate(model, IDS, cfg, rng=keys, checker=flag)
  outs = sorted(generate_stream(model, [StreamRequest(IDS[i], key=keys[i]) for i in range(BATCH)], cfg,
                                rng=jax.random.key(9), batch_size=2, checker=flag), key=lambda o: o.index)
  for i, o in enumerate(outs):
    np.testing.assert_array_equal(o.sequence, np.asarray(fixed.sequences)[i, :len(o.sequence)])
    np.testing.assert_array_equal(o.denoising_steps, np.asarray(fixed.denoising_steps)[i, :len(o.denoising_steps)])


@pytest.mark.parametrize("changes, match", [
    (dict(checker_restarts=-1), "checker_restarts=-1 is invalid"),
    (dict(checker_restarts=1.5), "checker_restarts=1.5 is invalid"),
    (dict(checker_confidence="yes"), "checker_confidence='yes' is invalid"),
    (dict(checker_forget=1), "checker_forget=1 is invalid"),
    (dict(checker_restarts=2, checker_step_budget=0), "checker_step_budget=0 is invalid"),
    (dict(checker_step_budget=20), "needs checker_restarts > 0"),
])
def test_config_errors_are_one_line(changes, match):
  with pytest.raises(ConfigError, match=match) as e:
    hd.SamplingConfig(**changes)
  assert "\n" not in str(e.value)


def test_call_errors_are_one_line(model):
  with pytest.raises(ValueError, match="no checker was given"):
    hd.generate(model, IDS, CONFIG.replace(checker_restarts=1), rng=jax.random.key(0))
  with pytest.raises(ValueError, match="return_trajectory cannot be combined"):
    hd.generate(model, IDS, CONFIG.replace(checker_restarts=1), rng=jax.random.key(0), checker=FlagPosition(3),
                return_trajectory=True)
  with pytest.raises(ConfigError, match="expected a checker"):
    hd.generate(model, IDS, CONFIG, rng=jax.random.key(0), checker="sudoku")
  from hackable_diffusion.runs.config import EvalSection

  with pytest.raises(ConfigError, match="need eval.checker=True"):
    EvalSection(sampling=hd.SamplingConfig(checker_restarts=1))
  with pytest.raises(ConfigError, match="eval.samples_per_prompt=0"):
    EvalSection(samples_per_prompt=0)


@flax.struct.dataclass
class _NamedChecker:
  name: Any  # a non-numeric pytree field: not traceable

  def __call__(self, canvas_ids):
    return jnp.zeros(canvas_ids.shape, bool)


def test_a_non_numeric_checker_field_is_one_line():
  with pytest.raises(ConfigError, match=r"^checker: field 'sudoku' is not a number"):
    checker_lib.checker_arg(_NamedChecker("sudoku"), restarts=0, budget=8)
  arg = checker_lib.checker_arg(_NamedChecker(np.float64(0.5)), restarts=0, budget=8)
  assert arg.checker.name.dtype == jnp.float32  # numeric fields are traced with a fixed dtype
