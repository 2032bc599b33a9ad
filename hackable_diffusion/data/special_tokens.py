"""A tokenizer's special tokens: which pieces are bos/eos/unk/pad, from its config files, checked for agreement.

`resolve_special_tokens` takes a backend (data/tokenizer_backends.py) and the contents of `tokenizer_config.json`
and `generation_config.json` (data/tokenizer_files.py reads them). A named token (`bos_token`, ...) must be in the
vocabulary (and, for a SentencePiece model, be the model's own special id); a token the config does not name is the
backend's own special id, else the generation config's `<name>_token_id`. The generation config's
`bos_token_id`/`pad_token_id` must equal the tokenizer's and its `eos_token_id` (an id or a list, e.g. Gemma 4's
`[1, 106]`: `<eos>` and `<turn|>`) must contain the tokenizer's eos. A mismatch is a one-line `CheckpointError`
naming the file, key and ids. Extra eos ids of the generation config are `eos_ids` (decode stops at any of them).

`resolve_image_tokens` finds the tokens an image takes in a prompt (Gemma 4 names them `image_token` '<|image|>',
`boi_token` '<|image>' and `eoi_token` '<image|>' in tokenizer_config.json); data/image_prompts.py uses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from hackable_diffusion.data.tokenizer_backends import Backend
from hackable_diffusion.data.tokenizer_files import GENERATION_CONFIG_FILENAME, TOKENIZER_CONFIG_FILENAME
from hackable_diffusion.errors import CheckpointError

SPECIAL_TOKEN_NAMES = ('bos', 'eos', 'unk', 'pad')  # named special tokens whose ids the tokenizer exposes
IMAGE_TOKEN_KEYS = ('image_token', 'boi_token', 'eoi_token')  # an image's placeholder, begin and end tokens


def token_content(value: Any) -> str | None:
  """A special token of a tokenizer config: a string or an AddedToken dict `{"content": ...}`."""
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get('content'), str):
    return value['content']
  return None


def named_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
  """Every named special token of a tokenizer config, as transformers 5 collects them for chat templates: the
  `*_token` keys (bos_token, image_token, ...) and the named entries of `extra_special_tokens` /
  `model_specific_special_tokens` dicts."""
  named: dict[str, str] = {}
  for key, value in config.items():
    content = token_content(value)
    if key.endswith('_token') and content is not None:
      named[key] = content
  for key in ('extra_special_tokens', 'model_specific_special_tokens'):
    extra = config.get(key)
    if isinstance(extra, dict):
      named.update({k: c for k, v in extra.items() if (c := token_content(v)) is not None})
  return named


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """The resolved special tokens of a tokenizer."""

  ids: dict[str, int]  # 'bos'/'eos'/'unk'/'pad' -> id, -1 when the tokenizer has none
  tokens: dict[str, str]  # the named special tokens ({'bos_token': '<bos>', ...}) a chat template is rendered with
  eos_ids: tuple[int, ...]  # eos, then the generation config's other eos ids


def resolve_special_tokens(backend: Backend, *, config: Mapping[str, Any], generation_config: Mapping[str, Any],
                           where: str, config_path: str = TOKENIZER_CONFIG_FILENAME,
                           generation_path: str = GENERATION_CONFIG_FILENAME) -> SpecialTokens:
  """The special tokens of `backend` under a tokenizer config and a generation config (module docstring); raises
  `CheckpointError` naming `config_path` / `generation_path` (and the tokenizer file `where`) on a mismatch."""
  ids = backend.special_ids()
  size = backend.vocab_size()
  tokens = named_special_tokens(config)
  for name in SPECIAL_TOKEN_NAMES:
    token = tokens.get(f'{name}_token')
    if token is None:
      continue
    tid = backend.piece_to_id(token)
    if tid is None:
      raise CheckpointError(f'{config_path}: {name}_token {token!r} is not in the vocabulary of {where}')
    if backend.kind == 'sentencepiece' and ids[name] >= 0 and tid != ids[name]:
      raise CheckpointError(f'{config_path}: {name}_token {token!r} is id {tid} but the SentencePiece model '
                            f'{where} has {name} id {ids[name]}')
    ids[name] = tid
  for name in SPECIAL_TOKEN_NAMES:
    if ids[name] < 0:  # no named token: the piece of the generation config's id
      gen = generation_config.get(f'{name}_token_id')
      gen = gen[0] if isinstance(gen, list) and gen else gen
      if isinstance(gen, int) and 0 <= gen < size:
        ids[name] = gen
    if ids[name] >= 0 and f'{name}_token' not in tokens:
      tokens[f'{name}_token'] = backend.id_to_piece(ids[name])
  eos_ids = _check_generation_config(generation_config, generation_path, size, ids, tokens)
  return SpecialTokens(ids=ids, tokens=tokens, eos_ids=eos_ids)


def _check_generation_config(gen: Mapping[str, Any], path: str, size: int, ids: Mapping[str, int],
                             tokens: Mapping[str, str]) -> tuple[int, ...]:
  """The eos ids (the tokenizer's first); raises CheckpointError when the generation config disagrees."""
  for name in ('bos', 'pad'):
    value = gen.get(f'{name}_token_id')
    if value is not None and ids[name] >= 0 and value != ids[name]:
      raise CheckpointError(f'{path}: {name}_token_id {value!r} does not match the tokenizer\'s {name} token '
                            f'{tokens.get(f"{name}_token")!r} (id {ids[name]})')
  eos = gen.get('eos_token_id')
  listed = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else []
  for tid in listed:
    if not isinstance(tid, int) or not 0 <= tid < size:
      raise CheckpointError(f'{path}: eos_token_id {eos!r} has an id outside the vocabulary [0, {size})')
  if listed and ids['eos'] >= 0 and ids['eos'] not in listed:
    raise CheckpointError(f'{path}: eos_token_id {eos!r} does not contain the tokenizer\'s eos token '
                          f'{tokens.get("eos_token")!r} (id {ids["eos"]})')
  first = [ids['eos']] if ids['eos'] >= 0 else []
  return tuple(dict.fromkeys(first + listed))


# ------------------------------------------------------------------------------------------ image tokens
@dataclasses.dataclass(frozen=True)
class ImageTokens:
  """The tokens of an image in a prompt: `boi`, then `image` once per soft token, then `eoi` (transformers'
  `Gemma4Processor.replace_image_token`). A prompt marks where an image goes with one `image` token."""

  image: str
  boi: str
  eoi: str
  image_id: int
  boi_id: int
  eoi_id: int

  def expansion(self, num_soft_tokens: int) -> str:
    """The text an image's placeholder becomes."""
    return self.boi + self.image * num_soft_tokens + self.eoi

  def check_model_ids(self, *, image_token_id: int | None, boi_token_id: int | None, eoi_token_id: int | None,
                      where: str = 'the model config') -> None:
    """Raises a one-line `CheckpointError` when a model config's image token ids differ from the tokenizer's."""
    for name, model_id, ours, token in (('image_token_id', image_token_id, self.image_id, self.image),
                                        ('boi_token_id', boi_token_id, self.boi_id, self.boi),
                                        ('eoi_token_id', eoi_token_id, self.eoi_id, self.eoi)):
      if model_id is not None and int(model_id) != ours:
        raise CheckpointError(f'{where}: {name} {model_id} does not match the tokenizer\'s {token!r} (id {ours})')


def resolve_image_tokens(tokens: Mapping[str, str], encode: Callable[[str], list[int]],
                         where: str = TOKENIZER_CONFIG_FILENAME) -> ImageTokens:
  """The image tokens among a tokenizer's named special tokens; `encode` (special tokens parsed) must give each
  one id. A one-line `CheckpointError` naming `where` and the key when one is missing or not a single token."""
  found: dict[str, tuple[str, int]] = {}
  for key in IMAGE_TOKEN_KEYS:
    token = tokens.get(key)
    if not token:
      raise CheckpointError(f'{where}: no {key} (the tokenizer has no image tokens, so it cannot take images; '
                            f'expected {", ".join(IMAGE_TOKEN_KEYS)})')
    ids = encode(token)
    if len(ids) != 1:
      raise CheckpointError(f'{where}: {key} {token!r} is not a single token of the vocabulary (encodes to {ids})')
    found[key] = (token, ids[0])
  (image, image_id), (boi, boi_id), (eoi, eoi_id) = (found[k] for k in IMAGE_TOKEN_KEYS)
  return ImageTokens(image=image, boi=boi, eoi=eoi, image_id=image_id, boi_id=boi_id, eoi_id=eoi_id)
