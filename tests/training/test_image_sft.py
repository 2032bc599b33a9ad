"""Fine-tuning with images: chat JSONL records whose user turns hold image files become batches with their pixels
(padded to a fixed number of images per example), `hd.SFTTrainer` trains LoRA on them with the vision tower frozen
(or adapters on the tower, when named), the loss depends on the pixels, and the PEFT export loaded by peft on
transformers gives our logits with the same `pixel_values`. Bad input (unreadable image, a path outside the data
folder, an image in the final assistant turn, an image-token count that does not match) is one line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import tokenizers
import vision_reference as vr
from flax import nnx
from tokenizers import models, pre_tokenizers

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.data.images import ImageProcessorConfig
from hackable_diffusion.data.sft import SFTDataConfig, make_sft_dataset
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.diffusion.loss import LossConfig, batch_image_features, diffusion_loss
from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.model.transformer import forward
from hackable_diffusion.runs import config as config_lib

pytestmark = pytest.mark.usefixtures("shared_xla_cache")

SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|turn>": 5, "<turn|>": 6,
            "<|image>": vr.BOI, "<image|>": vr.EOI, "<|image|>": vr.IMAGE}
WORDS = ["user", "model", "what", "color", "is", "this", "and", "that", "red", "green", "blue", "yellow", "same",
         "different"]
TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "image_token": "<|image|>", "boi_token": "<|image>",
                    "extra_special_tokens": {"eoi_token": "<image|>"}, "tokenizer_class": "PreTrainedTokenizerFast"}
# image parts become the image placeholder, as Gemma 4's template writes them
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %} {% endfor %}{% endif %}"
            "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
# a larger position table than vision_reference's, for non-square images (up to 20 patches a side here)
VISION = dict(vr.VISION, position_embedding_size=32)
PROCESSOR = {"image_processor": {"patch_size": 2, "pooling_kernel_size": 2, "max_soft_tokens": 70,
                                 "do_normalize": False, "rescale_factor": 1 / 255}}
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (20, 40, 230), "yellow": (230, 220, 20)}
MAX_PROMPT = 160


def _tokenizer_json() -> str:
  """A word-level tokenizer: the specials at their ids (image tokens = the model's), WORDS after them, filler ids."""
  vocab = dict(SPECIALS)
  free = [i for i in range(vr.VOCAB) if i not in SPECIALS.values()]
  vocab.update({w: i for w, i in zip(WORDS, free)})
  vocab.update({f"w{i}": i for i in free[len(WORDS):]})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(list(SPECIALS))
  return tok.to_str()


def _reference(path: str):
  """A tiny transformers DiffusionGemma with a vision tower (non-trivial norms and scalars), saved into `path`."""
  import torch
  from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

  torch.manual_seed(0)
  config = DiffusionGemmaConfig(text_config=dict(vr.TEXT), vision_config=VISION, boi_token_id=vr.BOI,
                                eoi_token_id=vr.EOI, image_token_id=vr.IMAGE, canvas_length=vr.CANVAS)
  model = DiffusionGemmaForBlockDiffusion(config).eval()
  gen = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or "position_embedding_table" in name:
        p.add_(0.3 * torch.randn(p.shape, generator=gen))
      if "embed_tokens" in name:
        p.mul_(10.0)
    for name, b in model.named_buffers():  # finite clipping bounds (the loader refuses the default infinities)
      if name.endswith(("input_min", "output_min")):
        b.fill_(-2.0)
      elif name.endswith(("input_max", "output_max")):
        b.fill_(2.0)
  model.save_pretrained(path)


def _image(path, size: tuple[int, int], color: tuple[int, int, int], seed: int) -> None:
  rng = np.random.default_rng(seed)
  pixels = np.clip(np.asarray(color)[None, None] + rng.integers(-25, 25, (*size, 3)), 0, 255).astype(np.uint8)
  PIL.Image.fromarray(pixels).save(path)


def _user(*parts) -> dict:
  return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


def _img(name: str) -> dict:
  return {"type": "image", "path": name}


def _write_jsonl(path, records) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(checkpoint dir: the model, its tokenizer and image processor; the data folder; the training JSONL)."""
  ckpt = tmp_path_factory.mktemp("vision_ckpt")
  _reference(str(ckpt))
  (ckpt / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
  (ckpt / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG), encoding="utf-8")
  (ckpt / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
  (ckpt / "processor_config.json").write_text(json.dumps(PROCESSOR), encoding="utf-8")
  data = tmp_path_factory.mktemp("image_data")
  (data / "img").mkdir()
  for i, (name, color) in enumerate(COLORS.items()):
    _image(data / "img" / f"{name}.png", (24, 24), color, i)
    _image(data / "img" / f"{name}_wide.png", (20, 30), color, 10 + i)  # 12 x 20 patches: 60 soft tokens
  records = [
      {"messages": [_user(_img("img/red.png"), "what color is this"), {"role": "assistant", "content": "red"}]},
      {"messages": [_user(_img("img/blue.png"), "and", _img("img/green_wide.png"), "what color is that"),
                    {"role": "assistant", "content": "green"}]},
      {"messages": [_user(_img("img/yellow_wide.png"), "what color is this"),
                    {"role": "assistant", "content": "yellow"}]},
      {"messages": [_user(_img("img/red_wide.png"), "and", _img("img/red.png"), "same"),
                    {"role": "assistant", "content": "same"}]},
  ]
  return str(ckpt), data, _write_jsonl(data / "train.jsonl", records)


def _data_config(path: str, **kw) -> SFTDataConfig:
  return SFTDataConfig(path=path, max_prompt_length=MAX_PROMPT, canvas_length=vr.CANVAS, batch_size=2, shuffle=False,
                       prefetch_batches=0, image_processor=ImageProcessorConfig.from_dict(PROCESSOR["image_processor"]),
                       **kw)


# ---- data ---------------------------------------------------------------------------------------------------------
def test_batches_hold_the_images_padded_to_max_images(setup):
  ckpt, _, train = setup
  tok = Tokenizer.load(ckpt)
  data = make_sft_dataset(_data_config(train), tok)
  batch = data[0]
  assert batch.pixel_values.shape == (2, 2, 280, 12) and batch.pixel_values.dtype == np.float32
  assert batch.image_position_ids.shape == (2, 2, 280, 2) and batch.image_position_ids.dtype == np.int32
  # record 0: one image, so its second image is padding everywhere; record 1: 64 + 60 soft tokens
  assert (batch.image_position_ids[0, 1] == -1).all() and not batch.pixel_values[0, 1].any()
  assert (batch.image_position_ids[0, 0, :256] >= 0).all() and (batch.image_position_ids[1, 1, :240] >= 0).all()
  assert [int((row == vr.IMAGE).sum()) for row in batch.prompt_ids] == [64, 124]
  assert int((batch.prompt_ids[0] == vr.BOI).sum()) == 1 and int((batch.prompt_ids[1] == vr.EOI).sum()) == 2
  # the loss is only on the final assistant turn: "green" + end of turn + eos
  assert tok.decode([int(t) for t in batch.completion_ids[1][batch.completion_mask[1]]]).split()[0] == "green"
  assert data.records.images.num_images.tolist() == [1, 2, 1, 2]  # no pixels are held, only the counts
  # a fixed max_images pads further; fewer than a record has is one line
  assert make_sft_dataset(_data_config(train, max_images=3), tok)[0].pixel_values.shape[1] == 3
  with pytest.raises(DataError, match=r"train.jsonl:2: the record has 2 images, more than max_images=1"):
    make_sft_dataset(_data_config(train, max_images=1), tok)


def test_bad_image_records_are_one_line_errors(setup, tmp_path):
  ckpt, data, _ = setup
  tok = Tokenizer.load(ckpt)
  (data / "img" / "broken.png").write_bytes(b"not a png at all")
  outside = tmp_path / "elsewhere.png"
  _image(outside, (24, 24), (0, 0, 0), 0)
  cases = {
      "unreadable": ([_user(_img("img/broken.png"), "what"), {"role": "assistant", "content": "red"}],
                     r"broken.png: cannot read the image"),
      "outside": ([_user(_img(str(outside)), "what"), {"role": "assistant", "content": "red"}],
                  r"is outside the data folder"),
      "missing": ([_user(_img("img/nope.png"), "what"), {"role": "assistant", "content": "red"}], r"not found"),
      "assistant": ([_user(_img("img/red.png"), "what"),
                     {"role": "assistant", "content": [_img("img/red.png"), {"type": "text", "text": "red"}]}],
                    r"the final assistant turn holds an image part"),
      "count": ([_user(_img("img/red.png"), "what <|image|>"), {"role": "assistant", "content": "red"}],
                r"2 image placeholder\(s\) '<\|image\|>' in the prompt but 1 image\(s\)"),
      "text_token": ([_user("what <|image|>"), {"role": "assistant", "content": "red"}],
                     r"holds 1 image token\(s\) '<\|image\|>' but the record has no image parts"),
  }
  good = {"messages": [_user(_img("img/blue.png"), "what"), {"role": "assistant", "content": "blue"}]}
  for name, (messages, message) in cases.items():
    path = _write_jsonl(data / f"bad_{name}.jsonl", [good, {"messages": messages}])
    with pytest.raises(DataError, match=message) as info:
      make_sft_dataset(_data_config(path), tok)
    assert str(info.value).startswith(path + ":2: ") and "\n" not in str(info.value), (name, str(info.value))
  # an image replaced after loading: the pipeline reads it per batch and says which record
  _image(data / "img" / "late.png", (24, 24), (5, 5, 5), 0)
  path = _write_jsonl(data / "late.jsonl", [{"messages": [_user(_img("img/late.png"), "what"),
                                                          {"role": "assistant", "content": "red"}]}] * 2)
  loaded = make_sft_dataset(_data_config(path), tok)
  _image(data / "img" / "late.png", (20, 30), (5, 5, 5), 0)
  with pytest.raises(DataError, match=r"late.jsonl:1: the prompt holds 64 image tokens but its 1 image\(s\) give 60"):
    loaded[0]


def test_config_keys_and_vision_training_switch():
  base = {"model": {"preset": "tiny"}, "data": {"train_path": "x.jsonl"}}
  cfg = config_lib.ExperimentConfig.from_config_dict(base)
  assert cfg.data.max_images == -1 and cfg.frozen_modules == ("vision_tower", "embed_vision")
  cfg = config_lib.ExperimentConfig.from_config_dict({**base, "train": {"train_vision": "projector"}})
  assert cfg.frozen_modules == ("vision_tower",)
  with pytest.raises(ConfigError, match=r"^train.train_vision='all' needs full fine-tuning"):
    config_lib.ExperimentConfig.from_config_dict({**base, "train": {"train_vision": "all"},
                                                  "lora": {"enabled": True, "rank": 2}})
  with pytest.raises(ConfigError, match=r"^data.max_images=-3"):
    config_lib.ExperimentConfig.from_config_dict({**base, "data": {"train_path": "x.jsonl", "max_images": -3}})


# ---- training ----------------------------------------------------------------------------------------------------
def _args(out, **kw) -> hd.SFTConfig:
  settings = dict(max_steps=2, batch_size=2, learning_rate=1e-2, warmup_steps=0, logging_steps=1, save_steps=2,
                  eval_at_end=False, max_prompt_length=MAX_PROMPT, report_to="none")
  return hd.SFTConfig(output_dir=str(out), **{**settings, **kw})


@pytest.fixture(scope="module")
def lora_run(setup, tmp_path_factory):
  ckpt, _, train = setup
  out = tmp_path_factory.mktemp("image_lora")
  trainer = hd.SFTTrainer(model=ckpt, train_dataset=train, progress=False, args=_args(out / "run"),
                          peft_config=hd.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
  trainer.train()
  yield trainer, out
  trainer.close()


def _vision_state(model) -> dict[str, np.ndarray]:
  """The vision tower's and its projection's weights by path."""
  state = {"vision_tower": nnx.state(model.vision_tower, nnx.Param),
           "embed_vision": nnx.state(model.embed_vision, nnx.Param)}
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}


def _loss_fn(model, key):
  """`batch -> loss` of `model` at a fixed key (no self-conditioning), compiled once."""
  graphdef, state = nnx.split(model)
  cfg = LossConfig(self_conditioning_prob=0.0)
  fn = jax.jit(lambda s, b: diffusion_loss(nnx.merge(graphdef, s), b, key, cfg)[0])
  return lambda batch: float(fn(state, jax.tree.map(jnp.asarray, batch)))


def test_lora_steps_use_the_images_and_keep_the_tower(setup, lora_run):
  ckpt, _, _ = setup
  trainer, _ = lora_run
  assert trainer.trainer.step == 2
  model = trainer.model
  base = hd.load_pretrained(ckpt)
  before, after = _vision_state(base), _vision_state(model)
  assert before and before.keys() == after.keys()
  assert all(np.array_equal(before[k], after[k]) for k in before)  # frozen: bit for bit
  batch = trainer.trainer.train_data[0]
  loss_of = _loss_fn(model, jax.random.key(3))
  real = batch.image_position_ids[..., :1] >= 0
  other = batch.replace(pixel_values=np.where(real, 1.0 - batch.pixel_values, 0.0).astype(np.float32))
  loss, loss_other = loss_of(batch), loss_of(other)
  assert np.isfinite(loss) and abs(loss - loss_other) > 1e-4 * abs(loss)
  assert loss_of(batch) == loss  # same key, same pixels: same loss
  # the padding image of row 0 gives no soft token: one per image token of the batch, in order
  graphdef, state = nnx.split(model)
  _, mask = jax.jit(lambda s, p, q: batch_image_features(nnx.merge(graphdef, s), p, q))(
      state, batch.pixel_values, batch.image_position_ids)
  assert np.asarray(mask).reshape(2, -1).sum(-1).tolist() == [64, 124]


def test_a_step_with_vision_lora_trains_its_adapters_and_keeps_the_tower(setup, tmp_path):
  """Adapters on the tower and the projector (named in target_modules) train; the tower's weights do not."""
  ckpt, _, train = setup
  config = hd.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", *lora.VISION_TARGETS])
  with hd.SFTTrainer(model=ckpt, train_dataset=train, progress=False, args=_args(tmp_path / "run", max_steps=1),
                     peft_config=config) as trainer:
    trainer.train()
    model = trainer.model
  vision_b = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
              if str(p[0]) in ("vision_tower", "embed_vision") and p[-1] == "lora_b"}
  assert len(vision_b) == 2 * 7 + 2  # 2 layers x 7 projections, input_proj, the projector
  assert all(np.abs(b).max() > 0 for b in vision_b.values())  # B starts at zero: one step moved every one
  before, after = _vision_state(hd.load_pretrained(ckpt)), _vision_state(model)
  assert before and before.keys() < after.keys()  # `after` holds the adapters too (an nnx.LoRAParam is a Param)
  assert all(np.array_equal(before[k], after[k]) for k in before)  # the tower's own weights: bit for bit


@pytest.mark.slow  # the train_vision='all' variant of the LoRA image steps above
def test_full_fine_tuning_trains_the_tower_when_asked(setup, tmp_path):
  ckpt, _, train = setup
  with hd.SFTTrainer(model=ckpt, train_dataset=train, progress=False,
                     args=_args(tmp_path / "run", max_steps=1, train_vision="all")) as trainer:
    trainer.train()
    after = _vision_state(trainer.model)
  before = _vision_state(hd.load_pretrained(ckpt))
  changed = [k for k in before if not np.array_equal(before[k], after[k])]
  assert any("vision_tower" in str(k) for k in changed) and any("embed_vision" in str(k) for k in changed)


def test_peft_export_gives_our_logits_with_images_on_transformers(setup, lora_run):
  import peft
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  ckpt, _, _ = setup
  trainer, out = lora_run
  adapter = str(out / "adapter")
  trainer.save_adapter(adapter)
  batch = trainer.trainer.train_data[0]
  row = 1  # two images
  ids = batch.prompt_ids[row:row + 1].astype(np.int64)
  mask = batch.prompt_mask[row:row + 1]
  pixels, positions = batch.pixel_values[row], batch.image_position_ids[row].astype(np.int64)
  canvas = np.random.default_rng(0).integers(7, 100, (1, vr.CANVAS))
  ours = np.asarray(forward(trainer.model, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            attention_mask=jnp.asarray(mask), pixel_values=pixels, image_position_ids=positions))
  ref = peft.PeftModel.from_pretrained(DiffusionGemmaForBlockDiffusion.from_pretrained(ckpt), adapter).eval()
  with torch.no_grad():
    theirs = ref(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                 attention_mask=torch.tensor(mask.astype(np.int64)),
                 decoder_attention_mask=torch.tensor(np.concatenate([mask, np.ones_like(canvas, bool)], 1).astype(
                     np.int64)),
                 pixel_values=torch.tensor(pixels), image_position_ids=torch.tensor(positions)).logits.numpy()
  scale = np.abs(theirs).max()
  assert np.abs(ours - theirs).max() <= 1e-4 * scale
  base = np.asarray(forward(hd.load_pretrained(ckpt), jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            attention_mask=jnp.asarray(mask), pixel_values=pixels, image_position_ids=positions))
  assert np.abs(base - ours).max() > 1e-3 * scale  # the adapters changed the model
