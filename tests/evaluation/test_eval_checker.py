"""The evaluation with a task's checker: re-noising in the sampler (`eval.checker`) and several tries per example
(`eval.samples_per_prompt`), their report entries and errors."""

from __future__ import annotations

import json
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.data import SFTDataConfig, train_tokenizer
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.evaluation import loop
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.runs.config import EvalSection
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.tasks.text import DigitsTask


@flax.struct.dataclass
class FirstTokenIn:
  """Flags position 0 unless its token is one of `ok` (`[K]` ids)."""

  ok: Any

  def __call__(self, canvas):
    bad = ~jnp.any(canvas[:, :1, None] == jnp.asarray(self.ok, jnp.int32), axis=-1)  # [B, 1]
    return jnp.concatenate([bad, jnp.zeros((canvas.shape[0], canvas.shape[1] - 1), bool)], axis=1)


class CheckedDigits(DigitsTask):
  """Digits whose answer is 'valid' when it starts with 0-4 (a rule the tiny random model breaks often)."""

  def checker(self, tokenizer):
    return FirstTokenIn(ok=np.asarray(tokenizer.token_ids_for("01234"), np.int32))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("eval_checker")
  task = CheckedDigits(length=5, num_train=8, num_validation=6, seed=0)
  paths = task.make_data(str(tmp))
  tok = train_tokenizer(["0123456789"])
  model = init_model(get_preset("tiny", vocab_size=tok.vocab_size, canvas_length=8), seed=0)
  cfg = SFTDataConfig(path=paths["validation"], max_prompt_length=6, canvas_length=8, batch_size=1)
  data = loop.load_eval_data(paths["validation"], cfg, tok, num_examples=6)
  return task, tok, model, data


def _valid(task, tok, text: str) -> bool:
  ids = np.asarray(tok.encode(text) or [0])
  return bool(np.isin(ids[0], tok.token_ids_for("01234")))


def test_further_tries_sample_only_the_rejected_examples(setup):
  task, tok, model, data = setup
  sampling = SamplingConfig(max_new_tokens=8, max_denoising_steps=3, early_stopping=False)
  check = task.checker(tok)
  kwargs = dict(batch_size=3, rng=jax.random.key(0), valid=check)
  one, stats1 = loop.generate_texts(model, tok, data, sampling, task, samples_per_prompt=1, **kwargs)
  many, stats4 = loop.generate_texts(model, tok, data, sampling, task, samples_per_prompt=4, **kwargs)
  first_ok = [_valid(task, tok, t) for t in one]
  assert not all(first_ok)  # some example needs another try
  for a, b, ok in zip(one, many, first_ok):
    if ok:
      assert a == b  # a valid first try is kept (try 0 uses the evaluation's own keys)
  assert sum(_valid(task, tok, t) for t in many) > sum(first_ok)
  rejected = len(first_ok) - sum(first_ok)
  assert stats1["tries_per_example"] == 1.0 and stats1["forwards_per_example"] == 3.0
  assert 1.0 + rejected / len(one) <= stats4["tries_per_example"] <= 4.0
  assert stats4["forwards_per_example"] == pytest.approx(3.0 * stats4["tries_per_example"])


def test_run_evaluation_with_the_checker_in_the_sampler(setup):
  task, tok, model, data = setup
  sampler = SamplingConfig(checker_confidence=True, checker_restarts=2)
  runs = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=3, sampling=sampler, checker=True,
                                    samples_per_prompt=2), max_new_tokens=8)
  report = loop.run_evaluation(model, tok, data, task, runs, batch_size=3)
  for run in report["runs"]:
    assert run["checker"] is True and run["samples_per_prompt"] == 2
    assert run["sampling"]["checker_restarts"] == 2
    # restarts: up to 3 attempts of the step cap per try, two tries
    assert run["max_denoising_steps"] <= run["forwards_per_example"] <= 6 * run["max_denoising_steps"]
  json.dumps(report)


def test_a_task_without_a_checker_is_a_one_line_error(setup):
  _, tok, model, data = setup
  runs = loop.eval_runs(EvalSection(step_budgets=(2,), early_stopping_steps=2, samples_per_prompt=2),
                        max_new_tokens=8)
  with pytest.raises(ConfigError, match="need a task with a checker") as e:
    loop.run_evaluation(model, tok, data, DigitsTask(length=5), runs, batch_size=3)
  assert "\n" not in str(e.value)
