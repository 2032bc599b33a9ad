"""Evaluation with image prompts: chat records whose user turn holds a picture are sampled with their preprocessed
pixels, exactly as `hd.generate(..., pixel_values=..., image_position_ids=...)` samples them (same sequences, on
the refilling stream and in fixed batches), and the pixels matter (a blank picture gives other completions)."""

from __future__ import annotations

import json

import jax
import numpy as np
import PIL.Image
import pytest

import hackable_diffusion as hd
from hackable_diffusion.data import SFTDataConfig, train_tokenizer
from hackable_diffusion.data.images import ImageProcessorConfig, preprocess_images
from hackable_diffusion.evaluation import loop
from hackable_diffusion.evaluation.images import batch_images, example_images
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.runs.images import TRAINED_IMAGE_TOKENS
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.tasks.text import TextTask

pytestmark = pytest.mark.usefixtures("shared_xla_cache")

TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}{% endfor %}")
PROCESSOR = ImageProcessorConfig(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70, do_resize=False)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=16)
CANVAS, N = 6, 5
SAMPLING = SamplingConfig(max_new_tokens=CANVAS, max_denoising_steps=3, early_stopping=False, t_min=0.5, t_max=1.0)


def _write(tmp, name: str, blank: bool) -> str:
  """N chat records, record i: a 16x16 picture (random gray levels, or white when `blank`) and a question."""
  rng = np.random.default_rng(0)
  (tmp / "img").mkdir(exist_ok=True)
  lines = []
  for i in range(N):
    pixels = np.full((16, 16), 255, np.uint8) if blank else rng.integers(0, 256, (16, 16)).astype(np.uint8)
    PIL.Image.fromarray(pixels, mode="L").save(tmp / "img" / f"{name}{i}.png")
    lines.append({"messages": [{"role": "user", "content": [{"type": "image", "path": f"img/{name}{i}.png"},
                                                             {"type": "text", "text": "which"}]},
                               {"role": "assistant", "content": "abcab"}]})
  path = tmp / f"{name}.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
  return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("eval_images")
  tok = train_tokenizer(["which abc"], user_defined_symbols=tuple(TRAINED_IMAGE_TOKENS.values()))
  tok = tok.with_config(TRAINED_IMAGE_TOKENS).with_chat_template(TEMPLATE)
  config = get_preset("tiny", vocab_size=tok.vocab_size, canvas_length=CANVAS, vision=VISION, image_token_id=6,
                      boi_token_id=4, eoi_token_id=5)
  model = init_model(config, seed=1)
  data = {}
  for name, blank in (("pictures", False), ("blank", True)):
    path = _write(tmp, name, blank)
    data_cfg = SFTDataConfig(path=path, max_prompt_length=32, canvas_length=CANVAS, batch_size=1,
                             image_processor=PROCESSOR)
    data[name] = loop.load_eval_data(path, data_cfg, tok, N)
  return tok, model, data, tmp


def test_eval_equals_generate_with_the_same_images(setup):
  tok, model, data, tmp = setup
  d = data["pictures"]
  assert d.records.images is not None and d.records.images.num_images.tolist() == [1] * N
  pixels, positions = example_images(d.records, 2)
  expected = preprocess_images([str(tmp / "img" / "pictures2.png")], PROCESSOR)
  np.testing.assert_array_equal(pixels, expected.pixel_values)
  np.testing.assert_array_equal(positions, expected.image_position_ids)
  rng = jax.random.key(7)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, np.arange(N))  # the evaluation's key of example i
  out = hd.generate(model, d.records.prompt_ids, SAMPLING, rng=keys, attention_mask=d.records.prompt_mask,
                    **batch_images(d.records, range(N)))
  direct = [tok.decode(row[d.records.prompt_ids.shape[1]:]) for row in np.asarray(out.sequences)]
  task = TextTask()
  for batch_size in (2, N):  # the refilling stream with 2 slots, and one batch
    texts, _ = loop.generate_texts(model, tok, d, SAMPLING, task, batch_size=batch_size, rng=rng)
    assert texts == direct
  mesh = jax.make_mesh((1,), ("data",))
  texts, _ = loop.generate_texts(model, tok, d, SAMPLING, task, batch_size=2, rng=rng, mesh=mesh)
  assert texts == direct


def test_the_pixels_are_used(setup):
  tok, model, data, _ = setup
  rng = jax.random.key(7)
  got = {name: loop.generate_texts(model, tok, d, SAMPLING, TextTask(), batch_size=N, rng=rng)[0]
         for name, d in data.items()}
  assert got["pictures"] != got["blank"]
  report = loop.run_evaluation(model, tok, data["pictures"], TextTask(), loop.eval_runs(
      _EvalCfg(), CANVAS), batch_size=N, seed=7)
  assert report["runs"][0]["metrics"]["exact_match"] >= 0.0


class _EvalCfg:
  """The evaluation section fields `eval_runs` reads."""

  sampling = SAMPLING
  step_budgets = (3,)
  early_stopping_steps = 3
