"""`generate` end to end: parity with transformers' `generate`, infilling, streaming, compile caching, errors.

Parity runs in the deterministic regime (temperature ~1e-4, so sampling is the argmax; an entropy bound of 1e9,
so every position is accepted and nothing is re-noised) with the same starting canvases given to both sides.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hackable_diffusion as hd
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import entropy_bound as eb
from hackable_diffusion.sampling import generate as gen_mod
from hackable_diffusion.sampling import rules

torch = pytest.importorskip("torch")
hf_gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

VOCAB, CANVAS, PROMPT, BATCH, CANVASES, STEPS = 128, 8, 7, 3, 3, 6
DET = dict(t_min=1e-4, t_max=2e-4, entropy_bound=1e9)  # deterministic regime


# ---- acceptance rules defined here, not in the library (selected by `SamplingConfig(acceptance='module:Class')`) --
@flax.struct.dataclass
class LowestK:
  """Accepts the `k` lowest-entropy positions per row: `rules.TopK` written independently (stable ranks)."""

  k: Any

  def __call__(self, token_entropy, processed_logits, step, num_steps):
    order = jnp.argsort(token_entropy, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return rank < self.k


class _Sink:
  """Collects (token entropies, accept mask) of every step on the host (hashable by identity)."""

  def __init__(self):
    self.records: list[tuple[np.ndarray, np.ndarray]] = []

  def __call__(self, token_entropy, accept):
    self.records.append((np.asarray(token_entropy), np.asarray(accept)))


@flax.struct.dataclass
class RecordingEntropyBound:
  """`rules.EntropyBound` that also reports what it saw and decided (the sink is static: part of the compile key)."""

  bound: Any
  sink: _Sink = flax.struct.field(pytree_node=False)

  def __call__(self, token_entropy, processed_logits, step, num_steps):
    accept = eb.accept_entropy_bound(token_entropy, self.bound)
    jax.debug.callback(self.sink, token_entropy, accept)
    return accept


@pytest.fixture(scope="module")
def models(hf_factory):
  ref, path = hf_factory("sampling_generate", vocab=VOCAB, canvas=CANVAS)
  return ref, hd.load_pretrained(path)


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  ids = rng.integers(3, VOCAB - 3, size=(BATCH, PROMPT))
  mask = np.ones((BATCH, PROMPT), np.int64)
  mask[1, :2] = 0
  mask[2, :4] = 0
  ids[mask == 0] = 0
  starts = rng.integers(0, VOCAB, size=(CANVASES, BATCH, CANVAS))  # the starting canvas of each block
  return ids, mask, starts


def _hf_generate(ref, ids, mask, starts, monkeypatch, **kwargs):
  """transformers' generate with canvas k starting from starts[k] (seed for k = 0, a patched init after)."""
  block = {"k": 0}
  original = hf_gen.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs

  def prepare(self, *args, **kw):
    out = original(self, *args, **kw)
    block["k"] += 1
    return out

  def initialize_canvas(self, batch_size, device):
    # called once per block for the starting canvas (before `prepare` returns) and by every re-noise, which
    # changes nothing here because every position is accepted
    return torch.tensor(starts[min(block["k"], len(starts) - 1)])

  monkeypatch.setattr(hf_gen.DiffusionGemmaGenerationMixin, "_prepare_denoiser_inputs", prepare)
  monkeypatch.setattr(hf_gen.EntropyBoundSampler, "initialize_canvas", initialize_canvas)
  kwargs = dict(kwargs)
  bound = kwargs.pop("entropy_bound")
  with torch.no_grad():
    out = ref.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), decoder_input_ids=torch.tensor(starts[0]),
                       sampler_config=hf_gen.EntropyBoundSamplerConfig(entropy_bound=float(bound)), **kwargs)
  monkeypatch.undo()
  return out.sequences.numpy(), out.tokens_per_forward.numpy()


def _ours(model, ids, mask, starts, **kwargs):
  cfg = hd.SamplingConfig(**kwargs)
  seed = np.concatenate(list(starts), axis=1)
  return gen_mod.generate(model, ids, cfg, rng=jax.random.key(0), attention_mask=mask, seed_canvas=seed)


def _first_eos_candidate(model, ids, mask, starts):
  """A token our sampler emits mid-canvas in row 1 (so that forcing it as EOS ends that row early)."""
  out = _ours(model, ids, mask, starts, max_new_tokens=CANVASES * CANVAS, max_denoising_steps=STEPS,
              eos_token_id=VOCAB - 1, pad_token_id=0, **DET)
  block = np.asarray(out.sequences)[1, PROMPT:PROMPT + CANVAS]
  return int(block[3])


@pytest.mark.parametrize("mode", ["eos_mid_canvas", "full_steps", "all_rows_end"])
def test_matches_transformers_generate(models, inputs, monkeypatch, mode):
  ref, ours = models
  ids, mask, starts = inputs
  eos = _first_eos_candidate(ours, ids, mask, starts)
  common = dict(max_new_tokens=CANVASES * CANVAS, max_denoising_steps=STEPS, pad_token_id=0, **DET)
  hf_kw, our_kw = dict(common), dict(common)
  if mode == "eos_mid_canvas":
    hf_kw["eos_token_id"] = our_kw["eos_token_id"] = eos
  elif mode == "full_steps":  # never stop early: transformers' history can't fill within STEPS steps
    hf_kw.update(eos_token_id=VOCAB - 1, stability_threshold=STEPS + 1)
    our_kw.update(eos_token_id=VOCAB - 1, early_stopping=False)
  else:  # so many EOS ids that every row ends in the first canvas: both return a single canvas
    hf_kw["eos_token_id"] = our_kw["eos_token_id"] = list(range(3, VOCAB))
  expected, expected_tpf = _hf_generate(ref, ids, mask, starts, monkeypatch, **hf_kw)
  out = _ours(ours, ids, mask, starts, **our_kw)
  got = np.asarray(out.sequences)
  assert got.shape == expected.shape
  np.testing.assert_array_equal(got, expected)
  np.testing.assert_allclose(np.asarray(out.tokens_per_forward), expected_tpf, rtol=1e-6)
  steps = np.asarray(out.denoising_steps)
  assert steps.shape == (BATCH, (got.shape[1] - PROMPT) // CANVAS)
  if mode == "eos_mid_canvas":
    row = got[1, PROMPT:]
    first = int(np.flatnonzero(row == eos)[0])
    assert first < CANVAS and (row[first + 1:] == 0).all()  # pad after EOS and in every later canvas
    assert (steps[1, 1:] == 0).all() and steps[1, 0] > 0
    assert (got[:, PROMPT:] != 0).any(axis=1).all()
  elif mode == "full_steps":
    assert (steps == STEPS).all()
    non_pad = (got[:, PROMPT:] != 0).sum(-1)
    np.testing.assert_allclose(np.asarray(out.tokens_per_forward), non_pad / (CANVASES * STEPS), rtol=1e-6)
  else:
    assert got.shape[1] == PROMPT + CANVAS


def test_bucketing_does_not_change_results(models, inputs):
  _, ours = models
  ids, mask, _ = inputs
  cfg = hd.SamplingConfig(max_new_tokens=CANVASES * CANVAS, max_denoising_steps=STEPS, eos_token_id=VOCAB - 1,
                          pad_token_id=0)  # default stochastic regime
  a = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(3), attention_mask=mask)
  b = gen_mod.generate(ours, ids, cfg.replace(prompt_length_buckets=()), rng=jax.random.key(3), attention_mask=mask)
  np.testing.assert_array_equal(np.asarray(a.sequences), np.asarray(b.sequences))
  np.testing.assert_array_equal(np.asarray(a.denoising_steps), np.asarray(b.denoising_steps))
  d = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(4), attention_mask=mask)
  assert not np.array_equal(np.asarray(a.sequences), np.asarray(d.sequences))  # the rng matters


def test_compiles_once_per_shape(models, inputs):
  _, ours = models
  ids, mask, _ = inputs
  cfg = hd.SamplingConfig(max_new_tokens=CANVASES * CANVAS, max_denoising_steps=STEPS, pad_token_id=0)
  gen_mod.generate(ours, ids, cfg, rng=jax.random.key(0), attention_mask=mask)
  before = gen_mod.trace_counts()
  # another prompt length in the same bucket, other numbers, another rng, a freshly loaded copy of the model
  other = cfg.replace(t_min=0.1, t_max=0.9, entropy_bound=0.5, max_denoising_steps=3, confidence_threshold=0.1,
                      early_stopping=False, eos_token_id=5)
  gen_mod.generate(ours, ids[:, 2:], other, rng=jax.random.key(1))
  gen_mod.generate(ours, ids[:, :5], cfg, rng=jax.random.key(2), attention_mask=mask[:, :5])
  assert gen_mod.trace_counts() == before
  gen_mod.generate(ours, ids[:1], cfg, rng=jax.random.key(2))  # a new batch size compiles again
  assert gen_mod.trace_counts()["denoise"] == before["denoise"] + 1


def test_entropy_bound_governs_acceptance(models, inputs):
  """Stochastic regime: every step accepts exactly the positions the bound allows, at least one per row."""
  _, ours = models
  ids, mask, _ = inputs
  sink = _Sink()
  cfg = hd.SamplingConfig(max_new_tokens=CANVASES * CANVAS, max_denoising_steps=12, t_min=0.2, t_max=0.4,
                          eos_token_id=VOCAB - 1, pad_token_id=0, early_stopping=False)
  out = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(5), attention_mask=mask,
                         acceptance=RecordingEntropyBound(0.3, sink))
  records = sink.records
  assert len(records) == 12 * (np.asarray(out.sequences).shape[1] - PROMPT) // CANVAS
  # the recording rule decides exactly as the built-in one: same sequences from the same key
  plain = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(5), attention_mask=mask,
                           acceptance=rules.EntropyBound(0.3))
  np.testing.assert_array_equal(np.asarray(plain.sequences), np.asarray(out.sequences))
  peaked = 0
  for ent, m in records:
    for e, row in zip(ent.astype(np.float64), m):
      order = np.argsort(e, kind="stable")
      before = np.cumsum(e[order]) - e[order]
      expected = np.zeros_like(row)
      expected[order] = before <= 0.3 + 1e-6
      assert row.sum() >= 1
      assert abs(int(row.sum()) - int(expected.sum())) <= 1 and (row <= expected | (e == e[row].max())).all()
      peaked += e.min() < 0.05
  assert peaked > 0  # low-temperature steps produce near-certain positions
  # a tight bound accepts fewer tokens per step than accepting everything
  loose = gen_mod.generate(ours, ids, cfg.replace(entropy_bound=1e9, early_stopping=True), rng=jax.random.key(5),
                           attention_mask=mask)
  tight = gen_mod.generate(ours, ids, cfg.replace(entropy_bound=1e-3, early_stopping=True, max_denoising_steps=48),
                           rng=jax.random.key(5), attention_mask=mask)
  assert np.asarray(tight.denoising_steps).mean() > np.asarray(loose.denoising_steps).mean()


def test_rule_defined_outside_the_library_is_selected_from_the_config(models, inputs):
  """`SamplingConfig(acceptance='<this test module>:LowestK', acceptance_args={'k': ...})` runs that rule: the result
  is the built-in `TopK` one bit for bit, and the value of `k` changes it."""
  _, ours = models
  ids, mask, _ = inputs
  spec = f"{__name__}:LowestK"  # this module as pytest imported it (importable by that name from sys.modules)
  cfg = hd.SamplingConfig(max_new_tokens=2 * CANVAS, max_denoising_steps=STEPS, eos_token_id=VOCAB - 1,
                          pad_token_id=0, early_stopping=False)
  custom = cfg.replace(acceptance=spec, acceptance_args={"k": 2})
  assert custom.acceptance_rule() == LowestK(2) and custom.acceptance_args == (("k", 2),)

  def run(config, acceptance=None):
    out = gen_mod.generate(ours, ids, config, rng=jax.random.key(8), attention_mask=mask, acceptance=acceptance)
    return np.asarray(out.sequences)

  got = run(custom)
  np.testing.assert_array_equal(got, run(cfg, rules.TopK(2)))
  np.testing.assert_array_equal(got, run(cfg.replace(acceptance="top_k", acceptance_args={"k": 2})))
  assert not np.array_equal(got, run(cfg))  # the default entropy bound decides differently...
  assert not np.array_equal(got, run(custom.replace(acceptance_args={"k": CANVAS})))  # ...and so does another k
  with pytest.raises(ConfigError, match="acceptance_args"):
    cfg.replace(acceptance=spec, acceptance_args={"kk": 2})


def test_equal_rules_and_other_values_compile_once(models, inputs):
  """The rule's numbers are traced: an equal rule, other values of the same class (given as an object or through
  the config) and another callback reuse one denoise program; another rule class traces once more."""
  _, ours = models
  ids, mask, _ = inputs
  cfg = hd.SamplingConfig(max_new_tokens=CANVAS, max_denoising_steps=3, pad_token_id=0, eos_token_id=VOCAB - 1)

  def run(config=cfg, **kwargs):
    return gen_mod.generate(ours, ids, config, rng=jax.random.key(9), attention_mask=mask, **kwargs)

  run(acceptance=rules.EntropyBound(0.2))
  before = gen_mod.trace_counts()
  run(acceptance=rules.EntropyBound(0.2))  # an equal rule (another object)
  run(acceptance=rules.EntropyBound(np.float64(0.7)))  # another value (and Python / numpy scalar types)
  run(cfg.replace(entropy_bound=1e9))  # the config's default rule: EntropyBound(entropy_bound)
  run(cfg.replace(acceptance_args={"bound": 0.05}))
  assert gen_mod.trace_counts() == before
  run(acceptance=rules.TopK(2))  # another class: one more trace...
  run(acceptance=rules.TopK(5))  # ...and none for another k
  assert gen_mod.trace_counts()["denoise"] == before["denoise"] + 1
  assert gen_mod.trace_counts()["encode"] == before["encode"]


def test_program_cache_is_bounded_and_counts_traces():
  from hackable_diffusion.sampling.programs import ProgramCache

  cache = ProgramCache(max_size=2)

  def build(program):
    def fn(x, call_id):
      program.on_trace()
      return x + 1
    return fn

  programs = [cache.get(("p", i), "encode", build) for i in range(3)]
  for p in programs:
    p(jnp.zeros(2))
  assert cache.get(("p", 2), "encode", build) is programs[2]  # cached
  assert cache.get(("p", 0), "encode", build) is not programs[0]  # evicted (least recently used)
  assert cache.trace_counts() == {"encode": 3, "denoise": 0}  # evicted programs' traces still count


def test_infill_pins_allowed_tokens_trajectory_and_callback(models, inputs):
  _, ours = models
  ids, mask, _ = inputs
  rng = np.random.default_rng(7)
  allowed = [5, 9, 17, 33, 60, 61, 90]
  seed = rng.choice([12, 13, 14], size=(BATCH, CANVAS))  # pinned tokens outside the allowed set
  pinned = rng.random((BATCH, CANVAS)) < 0.4
  pinned[:, 0] = True
  steps_seen = []
  cfg = hd.SamplingConfig(max_new_tokens=CANVASES * CANVAS, max_denoising_steps=STEPS, eos_token_id=VOCAB - 1,
                          pad_token_id=0)
  out = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(6), attention_mask=mask, seed_canvas=seed, pinned=pinned,
                         allowed_token_ids=allowed, return_trajectory=True, callback=steps_seen.append)
  seqs = np.asarray(out.sequences)
  assert seqs.shape == (BATCH, PROMPT + CANVASES * CANVAS)  # EOS is not allowed: no row ends
  first, rest = seqs[:, PROMPT:PROMPT + CANVAS], seqs[:, PROMPT + CANVAS:]
  np.testing.assert_array_equal(first[pinned], seed[pinned])  # pins survive
  assert np.isin(first[~pinned], allowed).all() and np.isin(rest, allowed).all()  # only allowed tokens
  traj = np.asarray(out.trajectory)
  assert traj.shape == (CANVASES, STEPS, BATCH, CANVAS)
  for step in traj[0]:
    np.testing.assert_array_equal(step[pinned], seed[pinned])  # at every step
    assert np.isin(step[~pinned], allowed).all()
  np.testing.assert_array_equal(traj[:, -1], seqs[:, PROMPT:].reshape(BATCH, CANVASES, CANVAS).transpose(1, 0, 2))
  # the callback saw every step of both canvases, counting down, with the argmax canvas of that step
  per_canvas = [[s for s in steps_seen if s.canvas_index == k] for k in range(CANVASES)]
  steps = np.asarray(out.denoising_steps)
  for k, calls in enumerate(per_canvas):
    assert len(calls) == steps[:, k].max()
    assert [c.step for c in calls] == list(range(STEPS, STEPS - len(calls), -1))
    np.testing.assert_array_equal(calls[-1].argmax_canvas, traj[k, -1])
  # a [B, V] mask is the same as the id list, and another callback object reuses the compiled program
  mask_v = np.zeros((BATCH, VOCAB), bool)
  mask_v[:, allowed] = True
  traces = gen_mod.trace_counts()
  calls = []
  again = gen_mod.generate(ours, ids, cfg, rng=jax.random.key(6), attention_mask=mask, seed_canvas=seed,
                           pinned=pinned, allowed_token_ids=mask_v, return_trajectory=True,
                           callback=lambda info: calls.append(info.step))
  np.testing.assert_array_equal(np.asarray(again.sequences), seqs)
  assert gen_mod.trace_counts() == traces and len(calls) == len(steps_seen)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(input_ids=np.array([[1, 2, VOCAB]])), "input_ids holds token id 128"),
        (dict(input_ids=np.array([1, 2, 3])), "input_ids must be a 2-D"),
        (dict(attention_mask=np.ones((1, 4))), "attention_mask has shape (1, 4)"),
        (dict(seed_canvas=np.zeros((1, 5), int)), "seed_canvas has shape (1, 5)"),
        (dict(seed_canvas=np.full((1, CANVAS), -1)), "seed_canvas holds token id -1"),
        (dict(seed_canvas=np.zeros((1, 3 * CANVAS), int)), "seed_canvas has shape (1, 24)"),
        (dict(pinned=np.ones((1, CANVAS), bool)), "pinned was given without seed_canvas"),
        (dict(seed_canvas=np.zeros((1, CANVAS), int), pinned=np.ones((1, 2), bool)), "pinned has shape (1, 2)"),
        (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
        (dict(allowed_token_ids=[3, 999]), "allowed_token_ids holds token id 999"),
        (dict(allowed_token_ids=np.zeros(VOCAB, bool)), "allows no token for row 0"),
        (dict(allowed_token_ids=np.ones((2, VOCAB), bool)), "allowed_token_ids as a mask must have shape"),
        (dict(canvas_attention_mask=np.ones((1, 1, CANVAS, CANVAS - 1), bool)),
         f"expected [B|1, N|1, {CANVAS}, P + {CANVAS}]"),
        # a structure over the first 2 prompt slots, and row 0 left-padded into slot 0: its prompt would sit shifted
        (dict(canvas_attention_mask=np.ones((1, 1, CANVAS, 2 + CANVAS), bool), attention_mask=np.array([[0, 1, 1]])),
         "constrains the first 2 prompt slots, but row 0 has left padding in slot 0 (its prompt is 2 tokens"),
        (dict(callback=3), "callback must be callable"),
        (dict(rng=7), "rng must be a jax.random key"),
        (dict(config=dict(max_new_tokens=8)), "config must be a SamplingConfig"),
        (dict(acceptance=3), "acceptance: expected an acceptance rule"),
        (dict(acceptance=rules.EntropyBound("a")), "is not a number"),
    ],
)
def test_input_validation(models, kwargs, message):
  _, ours = models
  call = dict(input_ids=np.array([[4, 5, 6]]), rng=jax.random.key(0),
              config=hd.SamplingConfig(max_new_tokens=2 * CANVAS, max_denoising_steps=2))
  call.update(kwargs)
  with pytest.raises(ValueError) as info:
    gen_mod.generate(ours, call.pop("input_ids"), call.pop("config"), **call)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_generate_keeps_its_signature_and_passes_every_argument_to_prepare():
  # `generate(model, input_ids, config, *, rng, ...)` is the public contract; every argument but the model travels
  # to `prepare` in one `GenerateRequest`
  import dataclasses
  import inspect

  from hackable_diffusion.sampling.prepare import GenerateRequest

  params = inspect.signature(hd.generate).parameters
  assert list(params)[:3] == ["model", "input_ids", "config"]
  assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name not in
             ("model", "input_ids", "config"))
  assert {f.name for f in dataclasses.fields(GenerateRequest)} == set(params) - {"model"}
  for f in dataclasses.fields(GenerateRequest):
    if f.default is not dataclasses.MISSING:
      assert params[f.name].default == f.default, f.name
