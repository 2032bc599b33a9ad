"""Evaluation: the generation loop with task hooks (built-in tasks and one defined in tests/), report and plot."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from hackable_diffusion.data import SFTDataConfig, train_tokenizer
from hackable_diffusion.evaluation import loop
from hackable_diffusion.evaluation import report as report_lib
from hackable_diffusion.model.config import ConfigError, get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.tasks.base import BaseTask, get_task
from hackable_diffusion.tasks.text import DigitsTask, TextTask
from hackable_diffusion.runs.config import EvalSection


def test_eval_runs():
  runs = loop.eval_runs(EvalSection(step_budgets=(8, 2, 8), early_stopping_steps=5), max_new_tokens=16)
  assert [(r.name, r.sampling.max_denoising_steps, r.sampling.early_stopping) for r in runs] == [
      ("steps_2", 2, False), ("steps_8", 8, False), ("early_stopping", 5, True)]
  assert all(r.sampling.max_new_tokens == 16 for r in runs)


class _PinFirstDigit(BaseTask):
  """Pins the first canvas position to the target's first character; allows digits and EOS only."""

  name = "pinned"
  primary_metric = "first_char_ok"

  def metrics(self, predictions, records):
    return {"first_char_ok": float(np.mean([p[:1] == r.completion[:1] for p, r in zip(predictions, records)])),
            "extra_field": float(np.mean([r.fields["k"] for r in records]))}

  def allowed_token_ids(self, tokenizer):
    return tokenizer.token_ids_for("0123456789") + [tokenizer.eos_id]

  def seed_canvas(self, records, tokenizer, num_tokens):
    seed = np.zeros((len(records), num_tokens), np.int32)
    pinned = np.zeros((len(records), num_tokens), bool)
    for i, r in enumerate(records):
      seed[i, 0] = tokenizer.encode(r.completion[0])[0]
      pinned[i, 0] = True
    return seed, pinned


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("eval")
  task = DigitsTask(length=5, num_train=8, num_validation=5, seed=0)
  paths = task.make_data(str(tmp))
  with open(paths["validation"]) as f:  # an extra JSON field, kept in EvalRecord.fields
    lines = [dict(json.loads(line), k=i, pins="10001") for i, line in enumerate(f)]
  with open(paths["validation"], "w") as f:
    f.writelines(json.dumps(line) + "\n" for line in lines)
  tok = train_tokenizer(["0123456789"])
  model = init_model(get_preset("tiny", vocab_size=tok.vocab_size, canvas_length=8), seed=0)
  cfg = SFTDataConfig(path=paths["validation"], max_prompt_length=6, canvas_length=8, batch_size=1)
  data = loop.load_eval_data(paths["validation"], cfg, tok, num_examples=4)
  return tmp, tok, model, data


def test_load_eval_data(setup):
  _, _, _, data = setup
  assert len(data) == 4 and data.records.prompt_ids.shape == (4, 6)
  assert [e.fields["k"] for e in data.examples] == [0, 1, 2, 3]
  assert data.examples[0].completion == "".join(sorted(data.examples[0].prompt))


def test_run_evaluation_report_and_plot(setup):
  tmp, tok, model, data = setup
  sampler = SamplingConfig(t_min=0.9, t_max=1.1, confidence_threshold=0.07)  # not the defaults
  runs = loop.eval_runs(EvalSection(step_budgets=(2, 4), early_stopping_steps=4, sampling=sampler), max_new_tokens=8)
  out = str(tmp / "out")
  report = loop.run_evaluation(model, tok, data, TextTask(), runs, batch_size=3, step=11, out_dir=out,
                               num_samples=2)
  assert report["step"] == 11 and report["num_examples"] == 4 and report["primary_metric"] == "exact_match"
  assert [r["name"] for r in report["runs"]] == ["steps_2", "steps_4", "early_stopping"]
  assert report["runs"][0]["mean_denoising_steps"] == 2.0
  assert 0.0 <= report["runs"][1]["metrics"]["char_accuracy"] <= 1.0
  # every run records the sampler it ran with (temperature, acceptance, early-stopping threshold, ...)
  for r in report["runs"]:
    assert r["sampling"]["t_min"] == 0.9 and r["sampling"]["t_max"] == 1.1
    assert r["sampling"]["confidence_threshold"] == 0.07
    assert r["sampling"]["self_conditioning"] is True and r["sampling"]["acceptance"] == "entropy_bound"
  assert len(report["samples"]) == 2
  with open(os.path.join(out, "report_step_11.json")) as f:
    written = json.load(f)  # strict JSON
  assert written["runs"][0]["name"] == "steps_2"
  assert written["runs"][2]["sampling"] == report["runs"][2]["sampling"]
  png = os.path.join(out, "accuracy_vs_steps_step_11.png")
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert len(report_lib.summary_lines(report)) == 3


def test_task_hooks_reach_the_sampler(setup):
  """allowed_token_ids and seed_canvas/pinned from the task are applied: even an untrained model then produces
  only digits and keeps the pinned first character."""
  _, tok, model, data = setup
  runs = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=2), max_new_tokens=8)[:1]
  report = loop.run_evaluation(model, tok, data, _PinFirstDigit(), runs, batch_size=4, num_samples=4)
  assert report["runs"][0]["metrics"] == {"first_char_ok": 1.0, "extra_field": 1.5}
  assert all(set(s["prediction"]) <= set("0123456789") for s in report["samples"])


def test_a_task_defined_outside_the_library_drives_the_loop(setup):
  """A task from tests/custom_components.py, selected by 'module:factory' spec: its sampler hook (one digit, no
  EOS) decides every prediction, and its metrics fill the report."""
  _, tok, model, data = setup
  task = get_task("custom_components:OneDigitTask", {"digit": "7"})
  runs = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=2), max_new_tokens=8)[:1]
  report = loop.run_evaluation(model, tok, data, task, runs, batch_size=4, num_samples=4)
  assert report["primary_metric"] == "all_digit"
  assert report["runs"][0]["metrics"] == {"all_digit": 1.0, "mean_length": 8.0, "mean_prompt_length": 5.0}
  assert [s["prediction"] for s in report["samples"]] == ["77777777"] * 4


class _DigitsOnly(TextTask):
  """No EOS either: an untrained model then always fills the whole canvas with digits."""

  def allowed_token_ids(self, tokenizer):
    return tokenizer.token_ids_for("0123456789")


def test_data_pinned_tokens_are_pinned_in_evaluation(setup):
  """With `pinned_field`, the data's pinned completion tokens start the canvas and never change; the other
  positions start from noise (the reference must not leak)."""
  tmp, tok, model, _ = setup
  path = str(tmp / "validation.jsonl")
  cfg = SFTDataConfig(path=path, max_prompt_length=6, canvas_length=8, batch_size=1, pinned_field="pins")
  data = loop.load_eval_data(path, cfg, tok, num_examples=4)
  assert data.records.completion_pinned[0, :6].tolist() == [True, False, False, False, True, False]
  seed, pinned = loop._pinned_from_records(data.records, slice(0, 4), 8, model.config.vocab_size)
  assert (seed[pinned] == data.records.completion_ids[:4, :8][pinned]).all()
  later, _ = loop._pinned_from_records(data.records, slice(1, 4), 8, model.config.vocab_size)
  np.testing.assert_array_equal(later, seed[1:])  # an example's noise is its own, whatever batch it is in
  runs = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=2), max_new_tokens=8)[:1]
  report = loop.run_evaluation(model, tok, data, _DigitsOnly(), runs, batch_size=4, num_samples=4)
  for sample in report["samples"]:
    assert len(sample["prediction"]) == 8
    assert sample["prediction"][0] == sample["target"][0] and sample["prediction"][4] == sample["target"][4]
  # so the completions do not depend on the evaluation's batch size (before: noise drawn per batch)
  by_four, _ = loop.generate_texts(model, tok, data, runs[0].sampling, _DigitsOnly(), batch_size=4,
                                   rng=jax.random.key(1))
  by_three, _ = loop.generate_texts(model, tok, data, runs[0].sampling, _DigitsOnly(), batch_size=3,
                                    rng=jax.random.key(1))
  assert by_four == by_three


class _PinSome(BaseTask):
  """Pins the first `3 - k % 4` positions of the example with field `k` (k = 0..3: the later examples have more
  free cells); digits only."""

  name = "pin_some"
  primary_metric = "count"

  def metrics(self, predictions, records):
    return {"count": float(len(predictions))}

  def allowed_token_ids(self, tokenizer):
    return tokenizer.token_ids_for("0123456789")

  def seed_canvas(self, records, tokenizer, num_tokens):
    seed = np.zeros((len(records), num_tokens), np.int32)
    pinned = np.zeros((len(records), num_tokens), bool)
    for i, r in enumerate(records):
      k = 3 - r.fields["k"] % 4  # from the record (fields k = 0..3), not its place in the batch
      seed[i, :k] = tokenizer.encode(r.completion[:k])
      pinned[i, :k] = True
    return seed, pinned


class _NoisePerCall(_PinSome):
  """Noise from one generator per call (as a task's hook may draw it) or by place in the batch: a row's
  start canvas then depends on the batch it is in."""

  def __init__(self, by_place: bool):
    self.by_place = by_place

  def seed_canvas(self, records, tokenizer, num_tokens):
    seed, pinned = super().seed_canvas(records, tokenizer, num_tokens)
    if self.by_place:
      pinned[:, 0] = np.arange(len(records)) % 2 == 0
      return seed, pinned
    noise = np.random.default_rng(len(records)).integers(0, tokenizer.vocab_size, size=seed.shape)
    return np.where(pinned, seed, noise).astype(np.int32), pinned


@pytest.mark.parametrize("by_place", [False, True])
def test_a_start_canvas_that_depends_on_its_batch_is_a_one_line_error(setup, by_place):
  """Results must not depend on `eval.batch_size`: the loop compares each batch's last row with the hook called on
  that example alone and names the task and example when they differ; with batches of one it cannot differ."""
  _, tok, model, data = setup
  sampling = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=2), max_new_tokens=8)[0].sampling
  with pytest.raises(ConfigError, match=r"^task 'pin_some': seed_canvas gives example 3 another start canvas in a "
                                        r"batch of 4 than alone; .* eval\.batch_size$"):
    loop.generate_texts(model, tok, data, sampling, _NoisePerCall(by_place), batch_size=4, rng=jax.random.key(0))
  texts, _ = loop.generate_texts(model, tok, data, sampling, _NoisePerCall(by_place), batch_size=1,
                                 rng=jax.random.key(0))
  assert len(texts) == 4


def test_early_stopping_streams_the_most_free_cells_first_with_the_same_completions(setup, monkeypatch):
  """With early stopping and pins the stream is fed the examples with the most free cells first; every example
  still gets the completion that fixed batches in input order give it (one device as a mesh: `generate`)."""
  _, tok, model, data = setup
  task = _PinSome()
  early = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=4), max_new_tokens=8)[-1].sampling
  assert early.early_stopping
  free_seen = []
  real = loop.generate_stream

  def spy(model, requests, *args, **kwargs):
    requests = list(requests)
    free_seen.extend(int((~np.asarray(r.pinned, bool)).sum()) for r in requests)
    return real(model, requests, *args, **kwargs)

  monkeypatch.setattr(loop, "generate_stream", spy)
  texts, _ = loop.generate_texts(model, tok, data, early, task, batch_size=4, rng=jax.random.key(3))
  assert free_seen == [8, 7, 6, 5]  # examples 0..3 have 5..8 free cells: fed 3, 2, 1, 0
  monkeypatch.undo()
  mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
  fixed, _ = loop.generate_texts(model, tok, data, early, task, batch_size=4, rng=jax.random.key(3), mesh=mesh)
  assert len(set(texts)) == len(texts) == 4 and texts == fixed


def test_ablation_runs_and_trajectory(setup):
  """An ablation run is scored (and sampled) with its own task; the report holds the first example's canvas after
  every step of the last main run, with the task's pinned position held at every step."""
  tmp, tok, model, data = setup
  section = EvalSection(step_budgets=(2,), early_stopping_steps=4, ablation_steps=3, ablations={"pins": {}})
  runs = loop.eval_runs(section, max_new_tokens=8)
  made = []
  runs += loop.ablation_runs(section, 8, lambda overrides: made.append(overrides) or _PinFirstDigit())
  assert made == [{}] and [(r.name, r.ablation, r.sampling.max_denoising_steps) for r in runs] == [
      ("steps_2", None, 2), ("early_stopping", None, 4), ("steps_3/pins", "pins", 3)]
  out = str(tmp / "ablation")
  report = loop.run_evaluation(model, tok, data, _PinFirstDigit(), runs[:1] + runs[2:], batch_size=4, out_dir=out,
                               num_samples=4)
  ablation = report["runs"][-1]
  assert ablation["ablation"] == "pins" and ablation["metrics"]["first_char_ok"] == 1.0
  traj = report["trajectory"]
  assert traj["run"] == "steps_2" and len(traj["steps"]) == 2
  # (decoding stops at an EOS, which the task allows)
  assert all(0 < len(s) <= 8 and s[0] == data.examples[0].completion[0] for s in traj["steps"])
  assert all(set(s) <= set("0123456789") for s in traj["steps"])  # the task's allowed tokens
  # the base Task draws nothing; the JSON still carries the trajectory
  assert not os.path.exists(os.path.join(out, report_lib.CANVAS_PLOT_PATTERN.format(step=0)))
  with open(os.path.join(out, "report_step_0.json")) as f:
    assert json.load(f)["trajectory"]["steps"] == traj["steps"]


def test_ablation_steps_zero_turns_ablations_off():
  section = EvalSection(ablations={"no_pins": {"pin_givens": False}})
  assert loop.ablation_runs(section, 8, lambda overrides: TextTask()) == []
  with pytest.raises(ConfigError, match="eval.ablation_steps"):
    EvalSection(ablation_steps=-1)


def test_trajectory_of_a_two_canvas_evaluation_uses_the_first_canvas(setup):
  """With completions of two canvases the task seeds 16 tokens; the trajectory samples (and pins) the first."""
  _, tok, model, data = setup
  sampling = loop.eval_runs(EvalSection(step_budgets=(3,), early_stopping_steps=3), max_new_tokens=16)[0].sampling
  steps = loop.trajectory_texts(model, tok, data, sampling, _PinFirstDigit(), rng=jax.random.key(0))
  assert len(steps) == 3 and all(s[:1] == data.examples[0].completion[:1] for s in steps)


def test_batch_rows():
  """Examples per batch: `eval.batch_size` (at most all of them); on a mesh rounded up to its batch shards."""
  assert loop.batch_rows(64, 7) == 7 and loop.batch_rows(3, 7) == 3 and loop.batch_rows(1, 1) == 1
  mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
  assert loop.batch_rows(3, 7, mesh) == 3  # one device: one batch shard


def test_padding_rows_do_not_change_a_row(setup):
  """What lets an evaluation on a mesh pad its batches to the batch shards and still report one device's tokens:
  a row's random draws depend on the key and the row only, so extra (padding) rows leave the others unchanged."""
  _, tok, model, data = setup
  from hackable_diffusion.sampling.generate import generate

  sampling = loop.eval_runs(EvalSection(step_budgets=(3,), early_stopping_steps=3), max_new_tokens=8)[0].sampling
  ids, mask = data.records.prompt_ids[:3], data.records.prompt_mask[:3]
  three = generate(model, ids, sampling, rng=jax.random.key(5), attention_mask=mask)
  four = generate(model, loop._pad_rows(ids, 4), sampling, rng=jax.random.key(5),
                  attention_mask=loop._pad_rows(mask, 4))
  np.testing.assert_array_equal(np.asarray(four.sequences)[:3], np.asarray(three.sequences))
  np.testing.assert_array_equal(np.asarray(four.denoising_steps)[:3], np.asarray(three.denoising_steps))


def test_sampler_fields_are_strict_json_with_an_infinite_bound():
  fields = loop.sampler_fields(SamplingConfig(entropy_bound=float("inf"), t_min=0.5))
  assert fields["entropy_bound"] == "inf" and fields["t_min"] == 0.5
  assert json.loads(json.dumps(fields, allow_nan=False)) == fields  # what write_report's strict JSON needs


def test_the_evaluation_samples_at_the_prompts_width_with_the_bucketed_completions(setup, monkeypatch):
  """Every prompt of an evaluation has one width, so it samples without bucket padding (`one_width`): the mesh
  path's and the trajectory's `generate` calls get the prompts' width (the stream applies no bucket itself,
  tests/sampling/test_stream.py); the completions are those of bucketed `generate` calls, one example at a time with
  its own key."""
  _, tok, model, data = setup
  from hackable_diffusion.sampling.generate import generate

  early = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=4), max_new_tokens=8)[-1].sampling
  width = data.records.prompt_ids.shape[1]
  assert early.bucket_prompt_length(width) > width  # the configured sampler would pad these prompts
  seen = []

  def spy(model, ids, config, **kwargs):
    seen.append(config.bucket_prompt_length(np.shape(ids)[1]))
    return generate(model, ids, config, **kwargs)

  monkeypatch.setattr(loop, "generate", spy)
  rng = jax.random.key(4)
  mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
  texts, _ = loop.generate_texts(model, tok, data, early, _PinSome(), batch_size=4, rng=rng, mesh=mesh)
  loop.trajectory_texts(model, tok, data, early, _PinSome(), rng=rng)
  assert seen == [width, width]  # one batch of 4, then the trajectory
  seeds, pins = _PinSome().seed_canvas(data.examples, tok, 8)
  for i, text in enumerate(texts):
    one = generate(model, data.records.prompt_ids[i:i + 1], early, rng=jax.random.fold_in(rng, i)[None],
                   attention_mask=data.records.prompt_mask[i:i + 1], seed_canvas=seeds[i:i + 1],
                   pinned=pins[i:i + 1], allowed_token_ids=_PinSome().allowed_token_ids(tok))
    assert tok.decode(np.asarray(one.sequences)[0, width:]) == text
