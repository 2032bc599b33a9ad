"""`generate_stream` (refilling slots between chunks of steps) == `generate` with one key per row (one fixed batch).

The per-row loop makes a row's sequence a function of its own key and inputs; these tests check that the refilling
loop - rows entering slots at different times, next to different neighbours, their KV-cache rows reused - gives
every row exactly the sequence and step counts the fixed batch gives it, with early stopping at varied steps,
rows ending at an EOS before the last canvas, and seed canvases with pins.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.scan import stack_layers
from hackable_diffusion.sampling import programs, stream
from hackable_diffusion.sampling.stream import StreamRequest, generate_stream

N = 7  # prompts
# early stopping at varied steps: near-greedy samples, every position accepted, stop once the argmax is stable
CONFIG = dict(max_denoising_steps=8, confidence_threshold=50.0, stability_threshold=1, t_min=0.01, t_max=0.02,
              entropy_bound=float("inf"))


@pytest.fixture(scope="module")
def model():
  return hd.DiffusionGemma(get_preset("tiny"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def prompts(model):
  return np.random.default_rng(0).integers(1, model.config.vocab_size, size=(N, 5)).astype(np.int32)


def _keys(rng, n):
  return jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(n))


@pytest.mark.parametrize("chunk_steps", [2, None])
def test_refilling_equals_the_fixed_batch_per_row(model, prompts, chunk_steps):
  sampling = hd.SamplingConfig(max_new_tokens=2 * model.config.canvas_length, **CONFIG)
  rng = jax.random.key(3)
  fixed = hd.generate(model, prompts, sampling, rng=_keys(rng, N))
  before = programs.trace_counts().get("denoise_rows", 0)
  outs = list(generate_stream(model, list(prompts), sampling, rng=rng, batch_size=3, chunk_steps=chunk_steps))
  assert programs.trace_counts().get("denoise_rows", 0) - before <= 1  # at most one compile for the whole stream
  assert sorted(o.index for o in outs) == list(range(N))
  assert [o.index for o in outs] != list(range(N))  # rows left in the order they finished, not the input order
  steps = np.asarray(fixed.denoising_steps)
  for o in outs:
    ref = np.asarray(fixed.sequences)[o.index]
    k = len(o.denoising_steps)
    np.testing.assert_array_equal(o.sequence, ref[:len(o.sequence)])
    assert (ref[len(o.sequence):] == sampling.resolve(model.config).pad_token_id).all()
    np.testing.assert_array_equal(o.denoising_steps, steps[o.index, :k])
    assert o.tokens_per_forward == float(fixed.tokens_per_forward[o.index])  # the same float32 number
  # the case is not trivial: rows stopped at different steps, and one ended (EOS) before its second canvas
  assert len({tuple(o.denoising_steps) for o in outs}) > 2
  assert min(len(o.denoising_steps) for o in outs) == 1 and max(len(o.denoising_steps) for o in outs) == 2


def test_a_falling_temperature_follows_each_rows_own_steps(model, prompts):
  """A temperature that falls tenfold over the cap (the Sudoku default falls 2.0 -> 0.8; this random model's logits
  are nearly flat, so 0.05 -> 0.005 is already a schedule that changes the samples): each row's temperature follows
  its own step count, so rows that enter a slot mid-stream sample exactly what the fixed batch samples."""
  config = dict(CONFIG, t_min=0.005, t_max=0.05)
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **config)
  rng = jax.random.key(5)
  fixed = hd.generate(model, prompts, sampling, rng=_keys(rng, N))
  outs = list(generate_stream(model, list(prompts), sampling, rng=rng, batch_size=3))
  for o in outs:
    np.testing.assert_array_equal(o.sequence, np.asarray(fixed.sequences)[o.index])
    np.testing.assert_array_equal(o.denoising_steps, np.asarray(fixed.denoising_steps)[o.index])
  assert len({int(o.denoising_steps[0]) for o in outs}) > 2  # rows entered slots at different steps
  # the temperature matters here: the near-greedy schedule of CONFIG gives other sequences for the same keys
  cold = hd.generate(model, prompts, hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG),
                     rng=_keys(rng, N))
  assert not np.array_equal(np.asarray(cold.sequences), np.asarray(fixed.sequences))


class _Recorder:
  """Wraps a stream's compiled program and records every call's arguments and result."""

  def __init__(self, program):
    self.program, self.calls = program, []

  def __call__(self, *args, **kwargs):
    out = self.program(*args, **kwargs)
    self.calls.append((args, out))
    return out


def _record(monkeypatch, name):
  recorders, original = [], getattr(programs, name)

  def make(*args, **kwargs):
    recorders.append(_Recorder(original(*args, **kwargs)))
    return recorders[-1]

  monkeypatch.setattr(stream.programs, name, make, raising=True)
  return recorders


def test_prompts_are_encoded_a_batch_at_a_time(model, prompts, monkeypatch):
  """One encoder pass per `batch_size` prompts (staged ahead), not one per refill: 7 prompts in 3 slots = 3; each
  at the prompts' own width."""
  recorders = _record(monkeypatch, "encode_rows_program")
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG)
  outs = list(generate_stream(model, list(prompts), sampling, rng=jax.random.key(3), batch_size=3))
  assert len(outs) == N and len({int(o.denoising_steps[0]) for o in outs}) > 1  # rows finished at different steps
  (encoder,) = recorders
  assert len(encoder.calls) == 3
  assert [int(np.asarray(args[5]).sum()) for args, _ in encoder.calls] == [3, 3, 1]  # rows encoded per pass
  # at the prompts' width: the config's prompt-length buckets (16 for these 5 tokens) are not applied
  assert sampling.bucket_prompt_length(prompts.shape[1]) == 16
  assert {np.shape(args[2]) for args, _ in encoder.calls} == {(3, prompts.shape[1])}


def test_a_chunk_ends_at_the_step_that_finishes_a_row(model, prompts, monkeypatch):
  """While a prompt waits, no finished row idles in its slot: every row that finishes in a call of the denoising
  program finishes at that call's last step, and the slot is refilled before the next step."""
  recorders = _record(monkeypatch, "denoise_rows_program")
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG)
  outs = list(generate_stream(model, list(prompts), sampling, rng=jax.random.key(3), batch_size=3))
  assert len(outs) == N
  (denoise,) = recorders
  refilled_mid_stream = 0
  for args, out in denoise.calls:
    rows, reset, active, stop_on_finish = args[2], np.asarray(args[3]), np.asarray(args[8]), bool(args[-1])
    before_steps = np.where(reset, 0, np.asarray(rows.steps))
    before_done = np.where(reset, ~active, np.asarray(rows.done))
    taken = np.asarray(out.steps) - before_steps  # [B] steps each row took in this call
    finished = np.asarray(out.done) & ~before_done
    assert finished.any()
    if stop_on_finish:
      assert (taken[finished] == taken.max()).all(), (taken, finished)
      refilled_mid_stream += int((reset & active).sum() > 0 and (~reset & active).any())
  assert refilled_mid_stream > 1  # slots were refilled next to rows that kept running


@pytest.mark.parametrize("canvases, chunk_steps", [(2, None), (1, None), (1, 2)])
def test_many_prompts_through_few_slots(model, canvases, chunk_steps):
  """20 prompts through 4 slots: blocks of staged prompts run out in the middle of a refill (some slots take the
  last rows of one block, the others the first rows of the next) and every row still equals the fixed batch's,
  with one canvas per row or two, with chunks of at most 2 steps or none."""
  many = np.random.default_rng(1).integers(1, model.config.vocab_size, size=(20, 5)).astype(np.int32)
  sampling = hd.SamplingConfig(max_new_tokens=canvases * model.config.canvas_length, **CONFIG)
  rng = jax.random.key(7)
  fixed = hd.generate(model, many, sampling, rng=_keys(rng, 20))
  outs = list(generate_stream(model, list(many), sampling, rng=rng, batch_size=4, chunk_steps=chunk_steps))
  assert sorted(o.index for o in outs) == list(range(20))
  sequences, steps = np.asarray(fixed.sequences), np.asarray(fixed.denoising_steps)
  for o in outs:
    np.testing.assert_array_equal(o.sequence, sequences[o.index, :len(o.sequence)])
    np.testing.assert_array_equal(o.denoising_steps, steps[o.index, :len(o.denoising_steps)])


def test_a_row_does_not_depend_on_its_batch(model, prompts):
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG)
  keys = jax.random.split(jax.random.key(5), N)
  whole = hd.generate(model, prompts, sampling, rng=keys)
  picked = np.array([4, 1])
  part = hd.generate(model, prompts[picked], sampling, rng=keys[picked])
  np.testing.assert_array_equal(np.asarray(whole.sequences)[picked], np.asarray(part.sequences))
  np.testing.assert_array_equal(np.asarray(whole.denoising_steps)[picked], np.asarray(part.denoising_steps))


def test_seed_canvas_pins_and_own_keys(model, prompts):
  c = model.config.canvas_length
  sampling = hd.SamplingConfig(max_new_tokens=c, **CONFIG)
  eos = sampling.resolve(model.config).eos_token_ids
  allowed = [t for t in range(model.config.vocab_size) if t not in eos]  # no EOS: nothing is padded away
  rs = np.random.default_rng(1)
  seeds = rs.choice(allowed, size=(N, c)).astype(np.int32)
  pins = rs.random((N, c)) < 0.4
  pins[0] = False  # a row without pins next to rows with them
  keys = jax.random.split(jax.random.key(9), N)
  fixed = hd.generate(model, prompts, sampling, rng=keys, seed_canvas=seeds, pinned=pins, allowed_token_ids=allowed)
  requests = [StreamRequest(prompts[i], seed_canvas=seeds[i], pinned=pins[i], key=keys[i]) for i in range(N)]
  outs = {o.index: o for o in generate_stream(model, requests, sampling, rng=jax.random.key(0), batch_size=2,
                                              allowed_token_ids=allowed)}
  for i in range(N):
    np.testing.assert_array_equal(outs[i].sequence, np.asarray(fixed.sequences)[i])
    new = outs[i].sequence[prompts.shape[1]:]
    np.testing.assert_array_equal(new[pins[i]], seeds[i][pins[i]])  # pins held


def test_shorter_prompts_are_left_padded_like_a_batch(model, prompts):
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG)
  mask = np.ones(prompts.shape, bool)
  mask[1, :2] = mask[3, :1] = False  # rows 1 and 3 are shorter (left padding)
  keys = jax.random.split(jax.random.key(2), N)
  fixed = hd.generate(model, prompts, sampling, rng=keys, attention_mask=mask)
  requests = [StreamRequest(prompts[i][mask[i]], key=keys[i]) for i in range(N)]
  outs = {o.index: o for o in generate_stream(model, requests, sampling, rng=keys[0], batch_size=3,
                                               prompt_length=prompts.shape[1])}
  for i in range(N):
    width = prompts.shape[1]
    np.testing.assert_array_equal(outs[i].sequence[mask[i].sum():], np.asarray(fixed.sequences)[i, width:])


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size=0 is invalid"),
    (dict(chunk_steps=0), "chunk_steps=0 is invalid"),
    (dict(prompt_length=3),
     r"request 0: input_ids of shape \(5,\): expected one prompt of at most prompt_length=3 tokens"),
])
def test_bad_arguments_are_one_line_errors(model, prompts, kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    list(generate_stream(model, list(prompts), hd.SamplingConfig(max_new_tokens=8), rng=jax.random.key(0),
                         **kwargs))
  assert "\n" not in str(e.value)


def test_a_bad_token_id_names_the_request(model, prompts):
  bad = prompts.copy()
  bad[2, 1] = model.config.vocab_size
  with pytest.raises(ValueError, match="^generate_stream: request 2: input_ids holds token id") as e:
    list(generate_stream(model, list(bad), hd.SamplingConfig(max_new_tokens=8), rng=jax.random.key(0)))
  assert "\n" not in str(e.value)


def test_a_scanned_model_streams_the_unrolled_sequences(model, prompts):
  """Scanned layers keep the KV cache stacked (`[groups, B, ...]`, the batch on axis 1): refilling slots replaces
  rows along that axis, and every row still gets the unrolled model's fixed-batch sequence."""
  sampling = hd.SamplingConfig(max_new_tokens=2 * model.config.canvas_length, **CONFIG)
  rng = jax.random.key(3)
  fixed = hd.generate(model, prompts, sampling, rng=_keys(rng, N))
  scanned = stack_layers(nnx.clone(model))
  assert scanned.init_cache(2, 4).groups == len(scanned.layers) // scanned.layers.period
  outs = list(generate_stream(scanned, list(prompts), sampling, rng=rng, batch_size=3, chunk_steps=2))
  assert sorted(o.index for o in outs) == list(range(N))
  for o in outs:
    np.testing.assert_array_equal(o.sequence, np.asarray(fixed.sequences)[o.index, :len(o.sequence)])
    np.testing.assert_array_equal(o.denoising_steps, np.asarray(fixed.denoising_steps)[o.index, :len(o.denoising_steps)])


def test_a_stream_compiles_each_program_once(model, prompts, caplog):
  """With the model's arrays committed to a device (as a loaded checkpoint's are), the stream's first chunk and
  encode see the same argument placement as the later ones: one XLA compilation each, not two."""
  graphdef, state = nnx.split(model)
  committed = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, **CONFIG)
  with jax.log_compiles(), caplog.at_level("WARNING"):
    outs = list(generate_stream(committed, list(prompts), sampling, rng=jax.random.key(3), batch_size=4,
                                chunk_steps=2))
  assert len(outs) == N
  compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
  assert sum("jit(run)" in m for m in compiled) == 1, compiled
  assert sum("jit(encode)" in m for m in compiled) == 1, compiled
  assert sum("jit(copy)" in m for m in compiled) == 1, compiled


def test_self_conditioning_off_never_reads_the_previous_step(model, prompts):
  """`self_conditioning=False` decodes every step with a zero soft embedding, which the bias-free
  self-conditioning MLP maps to zero: its weights cannot change the samples then (the fixed batch with one key,
  per-row keys, and the refilling stream alike). With it on (the default) the same change of weights does."""
  other = nnx.clone(model)
  for proj in (other.self_conditioning.mlp.gate_proj, other.self_conditioning.mlp.up_proj):
    proj.kernel.set_value(proj.kernel.get_value() * 50 + 0.1)
  rng = jax.random.key(3)

  def sequences(m, on, keys):
    sampling = hd.SamplingConfig(max_new_tokens=2 * model.config.canvas_length, self_conditioning=on, **CONFIG)
    return np.asarray(hd.generate(m, prompts, sampling, rng=keys).sequences)

  for keys in (rng, _keys(rng, N)):
    off = sequences(model, False, keys)
    np.testing.assert_array_equal(off, sequences(other, False, keys))
    assert (sequences(model, True, keys) != sequences(other, True, keys)).any()
  sampling = hd.SamplingConfig(max_new_tokens=2 * model.config.canvas_length, self_conditioning=False, **CONFIG)
  for o in generate_stream(other, list(prompts), sampling, rng=rng, batch_size=3, chunk_steps=2):
    np.testing.assert_array_equal(o.sequence, off[o.index, :len(o.sequence)])


def test_longest_first_orders_by_free_positions_then_input_order():
  pinned = np.array([[1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]], bool)  # free: 2 3 1 2 4
  assert stream.longest_first(pinned).tolist() == [4, 1, 0, 3, 2]
  with pytest.raises(ValueError, match=r"pinned has shape \(4,\)"):
    stream.longest_first(pinned[0])
