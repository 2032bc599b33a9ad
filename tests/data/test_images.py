"""Image preprocessing and image prompts vs transformers' Gemma 4 image processor and `Gemma4Processor` (the class
transformers' AutoProcessor uses for diffusion_gemma), with the released checkpoint's processor settings."""

import json
import os

import numpy as np
import PIL.Image
import pytest
from tokenizers import processors
from test_chat import SPECIALS, TOKENIZER_CONFIG, bytelevel_bpe, write_checkpoint_dir

from hackable_diffusion.data.image_prompts import (encode_chat_with_images, encode_prompt_with_images,
                                                   expand_image_placeholders, image_paths, image_tokens)
from hackable_diffusion.data.images import (ImageProcessorConfig, load_image, num_soft_tokens, preprocess_images,
                                            read_image_processor_config, resized_size)
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import CheckpointError, ConfigError, DataError

# The released checkpoint's processor_config.json, "image_processor" section (the Gemma 4 processor settings).
RELEASED_IMAGE_PROCESSOR = {
    'do_convert_rgb': True, 'do_normalize': False, 'do_rescale': True, 'do_resize': True,
    'image_mean': [0.0, 0.0, 0.0], 'image_std': [1.0, 1.0, 1.0], 'image_processor_type': 'Gemma4ImageProcessor',
    'image_seq_length': 280, 'max_soft_tokens': 280, 'patch_size': 16, 'pooling_kernel_size': 3, 'resample': 3,
    'rescale_factor': 0.00392156862745098,
}
PIL_KEYS = ('do_convert_rgb', 'do_normalize', 'do_rescale', 'do_resize', 'image_mean', 'image_std',
            'max_soft_tokens', 'patch_size', 'pooling_kernel_size', 'resample', 'rescale_factor')

# Gemma4Processor also wants the audio tokens; '<|video|>' it adds itself when missing.
IMAGE_SPECIALS = SPECIALS + ['<|audio|>', '<|audio>', '<audio|>', '<|video|>']
IMAGE_TOKENIZER_CONFIG = {**TOKENIZER_CONFIG, 'extra_special_tokens': {
    'eoi_token': '<image|>', 'audio_token': '<|audio|>', 'boa_token': '<|audio>', 'eoa_token': '<audio|>'}}

# The test chat template (tests/data/test_chat.py) with Gemma 4's image branch: an image part is written as the
# image placeholder between blank lines.
IMAGE_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<|turn>' + role + '\n' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] | trim -}}
  {%- else -%}
    {%- for item in message['content'] -%}
      {%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}
      {%- elif item['type'] == 'image' -%}{{- '\n\n<|image|>\n\n' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}
"""

SIZES = [(37, 61), (200, 90), (5, 400), (400, 5), (768, 768), (240, 240), (9, 13), (48, 1000)]  # (height, width)


def rgb(height, width, seed=0, channels=3):
  """A smooth gradient plus noise: resampling filters differ visibly on it (pure noise would average out)."""
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[0:height, 0:width]
  base = (x * 7 + y * 3)[..., None] * np.arange(1, channels + 1)
  return ((base + rng.integers(0, 60, (height, width, channels))) % 256).astype(np.uint8)


def hf_image_processor(**overrides):
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
  settings = {k: RELEASED_IMAGE_PROCESSOR[k] for k in PIL_KEYS}
  return Gemma4ImageProcessorPil(**{**settings, **overrides})


def assert_same_batch(ours, theirs):
  for name in ('pixel_values', 'image_position_ids'):
    a, b = getattr(ours, name), np.asarray(theirs[name])
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_array_equal(a, b, err_msg=name)
  if 'num_soft_tokens_per_image' in theirs:  # the processor drops it from its output (its counts are in the ids)
    assert list(ours.num_soft_tokens) == [int(n) for n in theirs['num_soft_tokens_per_image']]


@pytest.fixture(scope='module')
def images_dir(tmp_path_factory):
  """Image files: PNGs, a JPEG whose EXIF orientation rotates it, a palette GIF with transparency."""
  d = tmp_path_factory.mktemp('images')
  PIL.Image.fromarray(rgb(60, 90, 1)).save(d / 'wide.png')
  PIL.Image.fromarray(rgb(120, 40, 2)).save(d / 'tall.png')
  exif = PIL.Image.Exif()
  exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
  PIL.Image.fromarray(rgb(50, 80, 3)).save(d / 'rotated.jpg', exif=exif, quality=90)
  PIL.Image.fromarray(rgb(30, 30, 4, channels=4), 'RGBA').save(d / 'alpha.png')
  (d / 'sub').mkdir()
  PIL.Image.fromarray(rgb(70, 70, 5)).save(d / 'sub' / 'square.png')
  return d


# ------------------------------------------------------------------------------------------ pixels
@pytest.mark.parametrize('max_soft_tokens', [70, 280])
def test_pixel_values_and_positions_equal_transformers(max_soft_tokens):
  images = [PIL.Image.fromarray(rgb(h, w, i)) for i, (h, w) in enumerate(SIZES)]
  images += [PIL.Image.fromarray(rgb(50, 70, 9, channels=4), 'RGBA'),  # composited onto white
             PIL.Image.fromarray(rgb(50, 70, 10)[..., 0], 'L')]  # grey -> RGB
  ours = preprocess_images(images, ImageProcessorConfig(max_soft_tokens=max_soft_tokens))
  theirs = hf_image_processor(max_soft_tokens=max_soft_tokens)(images, return_tensors='np')
  assert_same_batch(ours, theirs)
  assert ours.pixel_values.shape == (len(images), max_soft_tokens * 9, 768)
  # padding patches: zeros at (-1, -1), after the real ones
  for i, n in enumerate(ours.num_soft_tokens):
    real = n * 9
    assert (ours.image_position_ids[i, real:] == -1).all() and (ours.image_position_ids[i, :real] >= 0).all()
    assert not ours.pixel_values[i, real:].any()


def test_files_and_arrays_equal_transformers(images_dir):
  from transformers.image_utils import load_image as hf_load_image
  paths = [str(images_dir / n) for n in ('wide.png', 'rotated.jpg', 'alpha.png', 'tall.png')]
  ours = preprocess_images(paths)
  assert_same_batch(ours, hf_image_processor()([hf_load_image(p) for p in paths], return_tensors='np'))
  assert load_image(images_dir / 'rotated.jpg').size == (50, 80)  # (width, height): EXIF rotation applied
  arrays = [rgb(33, 77, 1), rgb(64, 20, 2)[..., :1]]  # uint8 [H, W, 3] and [H, W, 1]
  assert_same_batch(preprocess_images(arrays), hf_image_processor()(arrays, return_tensors='np'))
  grey = rgb(21, 22, 3)[..., 0]  # [H, W]: as the grey PIL image
  assert_same_batch(preprocess_images([grey]), hf_image_processor()([PIL.Image.fromarray(grey)], return_tensors='np'))


def test_other_processor_settings_equal_transformers():
  settings = dict(patch_size=8, pooling_kernel_size=2, max_soft_tokens=140, resample=2, do_normalize=True,
                  image_mean=(0.5, 0.25, 0.125), image_std=(0.5, 2.0, 0.3))
  images = [PIL.Image.fromarray(rgb(h, w, i)) for i, (h, w) in enumerate(SIZES[:4])]
  ours = preprocess_images(images, ImageProcessorConfig(**settings))
  assert_same_batch(ours, hf_image_processor(**settings)(images, return_tensors='np'))


def test_soft_token_counts_and_sizes_equal_transformers():
  from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
  sizes = [(h, w) for h in (1, 7, 48, 97, 480, 1080, 4000) for w in (1, 13, 48, 640, 1920, 9000)]
  for max_soft_tokens in (70, 280, 1120):
    config = ImageProcessorConfig(max_soft_tokens=max_soft_tokens)
    for h, w in sizes:
      expected = get_aspect_ratio_preserving_size(h, w, patch_size=16, max_patches=config.max_patches,
                                                  pooling_kernel_size=3)
      assert resized_size(h, w, config) == expected, (h, w)
      assert num_soft_tokens(h, w, config) == expected[0] // 16 * (expected[1] // 16) // 9
  assert num_soft_tokens(480, 640) == 266 and num_soft_tokens(1000, 1000) == 256


def test_released_processor_config_is_the_default(tmp_path):
  (tmp_path / 'processor_config.json').write_text(json.dumps(
      {'image_processor': RELEASED_IMAGE_PROCESSOR, 'image_seq_length': 280, 'processor_class': 'Gemma4Processor'}))
  assert read_image_processor_config(tmp_path) == ImageProcessorConfig()
  assert ImageProcessorConfig().max_patches == 2520 and ImageProcessorConfig().patch_dim == 768
  empty = preprocess_images([])
  assert empty.pixel_values.shape == (0, 2520, 768) and empty.image_position_ids.shape == (0, 2520, 2)
  assert read_image_processor_config(tmp_path / 'nothing_here') is None
  (tmp_path / 'processor_config.json').write_text(json.dumps({'image_processor': {'max_soft_tokens': 100}}))
  with pytest.raises(ConfigError) as e:
    read_image_processor_config(tmp_path)
  assert 'processor_config.json' in str(e.value) and 'max_soft_tokens' in str(e.value) and '\n' not in str(e.value)


# ------------------------------------------------------------------------------------------ prompts
@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A tokenizer.json whose post-processor adds bos (as Gemma's does), the image tokens and an image template."""
  raw = bytelevel_bpe(IMAGE_SPECIALS)
  raw.post_processor = processors.TemplateProcessing(single='<bos> $A', special_tokens=[('<bos>', 2)])
  return write_checkpoint_dir(tmp_path_factory.mktemp('image_tokenizer'), raw, IMAGE_TEMPLATE,
                              extra_special_tokens=IMAGE_TOKENIZER_CONFIG['extra_special_tokens'])


@pytest.fixture(scope='module')
def processor(checkpoint):
  """transformers' Gemma4Processor over the same files, with the released image processor settings."""
  from transformers import PreTrainedTokenizerFast
  from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
  from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
  from transformers.video_processing_utils import BaseVideoProcessor

  class ImageTextProcessor(Gemma4Processor):
    """Gemma4Processor; the video processor's class check is skipped (the video processor needs torchvision,
    which images do not use)."""

    def check_argument_for_proper_class(self, argument_name, argument):
      if argument_name == 'video_processor':
        return type(argument)
      return super().check_argument_for_proper_class(argument_name, argument)

  return ImageTextProcessor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=hf_image_processor(),
                            tokenizer=PreTrainedTokenizerFast.from_pretrained(str(checkpoint)),
                            video_processor=BaseVideoProcessor(), chat_template=IMAGE_TEMPLATE,
                            image_seq_length=280)


def test_prompt_with_images_equals_processor(checkpoint, processor, images_dir):
  tok = Tokenizer.load(checkpoint)
  paths = [str(images_dir / 'wide.png'), str(images_dir / 'tall.png')]
  text = 'Compare <|image|> with\n<|image|> please'
  ours = encode_prompt_with_images(tok, text, paths, add_bos=True)
  theirs = processor(text=text, images=paths, return_tensors='np')
  assert ours.input_ids == theirs['input_ids'][0].tolist()
  assert_same_batch(ours.images, theirs)
  tokens = image_tokens(tok)
  assert ours.input_ids.count(tokens.image_id) == sum(ours.images.num_soft_tokens)
  assert ours.input_ids.count(tokens.boi_id) == ours.input_ids.count(tokens.eoi_id) == 2


@pytest.mark.parametrize('add_generation_prompt', [True, False])
def test_chat_with_images_equals_processor_chat_template(checkpoint, processor, images_dir, add_generation_prompt):
  tok = Tokenizer.load(checkpoint)
  messages = [
      {'role': 'user', 'content': [{'type': 'image', 'path': 'rotated.jpg'},
                                   {'type': 'text', 'text': 'What animal is this?'}]},
      {'role': 'assistant', 'content': 'A cat.'},
      {'role': 'user', 'content': [{'type': 'text', 'text': 'And these two?'},
                                   {'type': 'image', 'path': 'sub/square.png'},
                                   {'type': 'image', 'path': 'alpha.png'}]},
  ]
  ours = encode_chat_with_images(tok, messages, data_dir=images_dir, add_generation_prompt=add_generation_prompt)
  absolute = [{**m, 'content': [{**p, 'path': str(images_dir / p['path'])} if p['type'] == 'image' else p
                                for p in m['content']]} if isinstance(m['content'], list) else m for m in messages]
  theirs = processor.apply_chat_template(absolute, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_dict=True, return_tensors='np')
  assert ours.input_ids == theirs['input_ids'][0].tolist()
  assert_same_batch(ours.images, theirs)
  assert ours.text.count('<|image|>') == 3 and len(ours.images) == 3


def test_expansion_is_boi_image_tokens_eoi(checkpoint):
  tokens = image_tokens(Tokenizer.load(checkpoint))
  assert (tokens.image, tokens.boi, tokens.eoi) == ('<|image|>', '<|image>', '<image|>')
  assert expand_image_placeholders('a<|image|>b<|image|>', [2, 1], tokens) == \
      'a<|image><|image|><|image|><image|>b<|image><|image|><image|>'
  tokens.check_model_ids(image_token_id=tokens.image_id, boi_token_id=tokens.boi_id, eoi_token_id=None)
  with pytest.raises(CheckpointError, match=r"config.json: boi_token_id 5 does not match the tokenizer's '<\|image>'"):
    tokens.check_model_ids(image_token_id=None, boi_token_id=5, eoi_token_id=None, where='config.json')


# ------------------------------------------------------------------------------------------ bad input
def one_line_error(error_type, fn, *args, **kwargs) -> str:
  with pytest.raises(error_type) as e:
    fn(*args, **kwargs)
  msg = str(e.value)
  assert '\n' not in msg, msg
  return msg


def test_unreadable_or_missing_image_is_one_line_naming_it(tmp_path):
  (tmp_path / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not really a png')
  for name, expected in (('broken.png', 'cannot read the image'), ('missing.png', 'not found')):
    msg = one_line_error(DataError, preprocess_images, [str(tmp_path / name)])
    assert str(tmp_path / name) in msg and expected in msg, msg
  msg = one_line_error(DataError, preprocess_images, [np.zeros((4, 4, 3), np.float32)])
  assert 'image 0' in msg and 'uint8' in msg
  assert 'max_soft_tokens' in one_line_error(ConfigError, ImageProcessorConfig, max_soft_tokens=256)


def test_bad_image_paths_in_messages(images_dir, tmp_path):
  outside = tmp_path / 'outside.png'
  PIL.Image.fromarray(rgb(8, 8)).save(outside)
  os.symlink(outside, images_dir / 'link.png')
  cases = [('../outside.png', 'outside the data folder'), (str(outside), 'outside the data folder'),
           ('link.png', 'outside the data folder'), ('nope.png', "image 'nope.png' not found")]
  for path, expected in cases:
    messages = [{'role': 'user', 'content': [{'type': 'image', 'path': path}]}]
    msg = one_line_error(DataError, image_paths, messages, images_dir, 'chat.jsonl:3')
    assert msg.startswith('chat.jsonl:3: message 0') and path in msg and expected in msg, msg
  url = [{'role': 'user', 'content': [{'type': 'image', 'url': 'https://example.com/cat.png'}]}]
  assert 'URLs and inline images are not supported' in one_line_error(DataError, image_paths, url, images_dir)
  assert image_paths([{'role': 'user', 'content': [{'type': 'image', 'path': 'sub/square.png'}]}],
                     images_dir) == [os.path.join(images_dir, 'sub/square.png')]


def test_placeholder_count_must_match_images(checkpoint, images_dir):
  tok = Tokenizer.load(checkpoint)
  path = str(images_dir / 'wide.png')
  msg = one_line_error(DataError, encode_prompt_with_images, tok, 'two <|image|> <|image|>', [path], where='p:1')
  assert msg.startswith('p:1: 2 image placeholder(s)') and '1 image(s)' in msg
  assert '0 image placeholder(s)' in one_line_error(DataError, encode_prompt_with_images, tok, 'none', [path])
  # a template that does not write image parts (test_chat's) leaves the image without a placeholder
  from test_chat import TEMPLATE
  messages = [{'role': 'user', 'content': [{'type': 'image', 'path': 'wide.png'}, {'type': 'text', 'text': 'hi'}]}]
  msg = one_line_error(DataError, encode_chat_with_images, tok.with_chat_template(TEMPLATE), messages,
                       data_dir=images_dir, where='chat.jsonl:1')
  assert msg.startswith('chat.jsonl:1: the chat template wrote 0 image placeholder(s)') and '1 image part' in msg


def test_tokenizer_without_image_tokens(tmp_path, images_dir):
  directory = write_checkpoint_dir(tmp_path / 'plain', bytelevel_bpe(), IMAGE_TEMPLATE,
                                   image_token=None, boi_token=None, extra_special_tokens={})
  msg = one_line_error(CheckpointError, encode_prompt_with_images, Tokenizer.load(directory), 'x', [])
  assert 'no image_token' in msg
