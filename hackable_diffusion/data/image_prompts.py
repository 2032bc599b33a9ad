"""Prompts with images: each image placeholder becomes `boi`, one image token per soft token, `eoi`.

A prompt marks where an image goes with the tokenizer's `image_token` ('<|image|>' for Gemma 4); a chat message
marks it with a content part `{'type': 'image', 'path': ...}`, which the chat template writes as that placeholder.
As transformers' `Gemma4Processor` (5.23.0 `models/gemma4/processing_gemma4.py`, `replace_image_token`), the i-th
placeholder of the text is replaced by

  boi_token + image_token * num_soft_tokens(image i) + eoi_token

and the text is then tokenised with its special tokens parsed. The model later writes the vision tower's features
over the image-token positions, so the number of image tokens must equal the image's soft tokens
(data/images.py `num_soft_tokens`); a prompt whose placeholders do not match its images is a one-line `DataError`.

Image paths in chat messages are local files. Relative paths resolve against a data folder (e.g. the folder of a
JSONL file); with a data folder every image must lie inside it (after following links), so a record cannot read
files elsewhere. URLs and inline images are refused.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hackable_diffusion.data.chat import Message, image_parts, short_repr, validate_messages
from hackable_diffusion.data.images import ImageBatch, ImageInput, ImageProcessorConfig, preprocess_images
from hackable_diffusion.data.special_tokens import ImageTokens, resolve_image_tokens
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import CheckpointError, DataError

IMAGE_PATH_KEY = 'path'  # the key of an image part that names its file
_OTHER_IMAGE_KEYS = ('url', 'image', 'base64')  # what transformers also takes, refused here


def image_tokens(tokenizer: Tokenizer) -> ImageTokens:
  """The tokenizer's image placeholder, begin- and end-of-image tokens and their ids (one-line `CheckpointError`
  when its config names none)."""
  return resolve_image_tokens(tokenizer.special_tokens,
                              lambda text: tokenizer.encode_batch([text], parse_special_tokens=True)[0])


def check_placeholder_count(text: str, num_images: int, tokens: ImageTokens, where: str = 'prompt') -> None:
  """A one-line `DataError` starting with `where` unless `text` holds exactly one `tokens.image` per image."""
  found = text.count(tokens.image)
  if found != num_images:
    raise DataError(f'{where}: {found} image placeholder(s) {tokens.image!r} in the prompt but {num_images} '
                    f'image(s); each image needs exactly one placeholder')


def expand_image_placeholders(text: str, num_soft_tokens: Sequence[int], tokens: ImageTokens,
                              where: str = 'prompt') -> str:
  """`text` with its i-th `tokens.image` replaced by `tokens.expansion(num_soft_tokens[i])`; a one-line
  `DataError` starting with `where` when the number of placeholders differs from the number of images."""
  check_placeholder_count(text, len(num_soft_tokens), tokens, where)
  pieces = text.split(tokens.image)
  out = [pieces[0]]
  for count, piece in zip(num_soft_tokens, pieces[1:]):
    out += [tokens.expansion(count), piece]
  return ''.join(out)


def resolve_image_path(path: Any, data_dir: str | os.PathLike[str] | None, where: str) -> str:
  """The file of an image part's `path`: relative paths resolve against `data_dir` (the working directory when
  None); with a `data_dir` the file must lie inside it. One-line `DataError` starting with `where` otherwise."""
  if not isinstance(path, str) or not path:
    raise DataError(f'{where}: an image path must be a non-empty string, got {short_repr(path)}')
  full = path if data_dir is None else os.path.join(os.fspath(data_dir), path)
  if data_dir is not None:
    root = os.path.realpath(data_dir)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
      raise DataError(f'{where}: image path {path!r} is outside the data folder {os.fspath(data_dir)}')
  if not os.path.isfile(full):
    raise DataError(f'{where}: image {path!r} not found ({full})')
  return full


def image_paths(messages: Sequence[Message], data_dir: str | os.PathLike[str] | None = None,
                where: str = 'messages') -> list[str]:
  """The files of a conversation's image parts, in order (`resolve_image_path`)."""
  paths = []
  for i, part in image_parts(messages):
    other = [k for k in _OTHER_IMAGE_KEYS if k in part]
    if IMAGE_PATH_KEY not in part:
      raise DataError(f'{where}: message {i} has an image part without a local "path"'
                      + (f' (got {", ".join(other)}: URLs and inline images are not supported)' if other else ''))
    paths.append(resolve_image_path(part[IMAGE_PATH_KEY], data_dir, f'{where}: message {i}'))
  return paths


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
  """A prompt with its images, as transformers' processor returns them.

  Attributes:
    input_ids: the prompt's token ids, each image expanded to boi + image tokens + eoi.
    images: the preprocessed images (`pixel_values`, `image_position_ids`, `num_soft_tokens`), in prompt order.
    text: the prompt text before expansion (one image placeholder per image).
  """

  input_ids: list[int]
  images: ImageBatch
  text: str


def encode_prompt_with_images(tokenizer: Tokenizer, text: str, images: Sequence[ImageInput], *,
                              config: ImageProcessorConfig = ImageProcessorConfig(), add_bos: bool = False,
                              where: str = 'prompt') -> ImagePrompt:
  """A prompt text with one `image_token` per image -> ids and images, as `processor(text=text, images=images)`.

  `add_bos` prepends the bos id (transformers' Gemma tokenizer adds it to a plain prompt; a chat template writes
  it itself). Raises a one-line `DataError` when placeholders and images differ in number or an image cannot be
  read, and a `CheckpointError` when the tokenizer has no image tokens.
  """
  tokens = image_tokens(tokenizer)
  check_placeholder_count(text, len(images), tokens, where)  # before any image is read
  batch = preprocess_images(list(images), config)
  ids = tokenizer.encode_batch([expand_image_placeholders(text, batch.num_soft_tokens, tokens, where)],
                               parse_special_tokens=True)[0]
  if add_bos:
    if tokenizer.bos_id < 0:
      raise CheckpointError(f'{where}: add_bos is set but the tokenizer has no bos token')
    ids = [tokenizer.bos_id] + ids
  return ImagePrompt(input_ids=ids, images=batch, text=text)


def encode_chat_with_images(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                            data_dir: str | os.PathLike[str] | None = None,
                            config: ImageProcessorConfig = ImageProcessorConfig(),
                            add_generation_prompt: bool = True, where: str = 'messages',
                            **template_kwargs: Any) -> ImagePrompt:
  """A conversation whose messages may hold `{'type': 'image', 'path': ...}` parts -> ids and images, as
  transformers' `processor.apply_chat_template(messages, tokenize=True, return_dict=True)`.

  The chat template renders the conversation (`template_kwargs` reach it), then each image placeholder it wrote
  is expanded. One-line `DataError` starting with `where` for a bad image path (missing, outside `data_dir`, a URL)
  or a template that writes a different number of placeholders than there are image parts.
  """
  messages = validate_messages(list(messages), where)
  paths = image_paths(messages, data_dir, where)
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       where=where, **template_kwargs)
  tokens = image_tokens(tokenizer)
  if text.count(tokens.image) != len(paths):
    raise DataError(f'{where}: the chat template wrote {text.count(tokens.image)} image placeholder(s) '
                    f'{tokens.image!r} for {len(paths)} image part(s)')
  return encode_prompt_with_images(tokenizer, text, paths, config=config, where=where)


__all__ = ['IMAGE_PATH_KEY', 'ImagePrompt', 'check_placeholder_count', 'encode_chat_with_images',
           'encode_prompt_with_images', 'expand_image_placeholders', 'image_paths', 'image_tokens',
           'resolve_image_path']
