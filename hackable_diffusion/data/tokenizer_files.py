"""Where a tokenizer's files are, and reading the config files beside them.

A checkpoint (or a run's workdir) holds its tokenizer as `tokenizer.json` (Hugging Face `tokenizers`) or
`tokenizer.model` (SentencePiece). `find_tokenizer_file` picks one in a directory (`tokenizer.json` first, as
transformers' fast tokenizer does) and `locate_tokenizer_file` accepts a directory or the file itself.
`read_tokenizer_configs` reads the JSON files beside it: `tokenizer_config.json` (named special tokens, the chat
template), the legacy `special_tokens_map.json` (it only fills the tokens tokenizer_config.json does not name) and
`generation_config.json`. What they say about special tokens is resolved and checked in data/special_tokens.py;
`chat_template.jinja` is read by data/chat.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import read_json

TOKENIZER_FILENAME = 'tokenizer.model'  # SentencePiece
TOKENIZER_JSON_FILENAME = 'tokenizer.json'  # Hugging Face tokenizers
TOKENIZER_CONFIG_FILENAME = 'tokenizer_config.json'
SPECIAL_TOKENS_MAP_FILENAME = 'special_tokens_map.json'
GENERATION_CONFIG_FILENAME = 'generation_config.json'


def find_tokenizer_file(directory: str | os.PathLike[str]) -> str | None:
  """The tokenizer file of a directory (`tokenizer.json`, else `tokenizer.model`), or None."""
  for name in (TOKENIZER_JSON_FILENAME, TOKENIZER_FILENAME):
    path = os.path.join(os.fspath(directory), name)
    if os.path.isfile(path):
      return path
  return None


def locate_tokenizer_file(path: str | os.PathLike[str]) -> str:
  """The tokenizer file of `path`: a directory's (`find_tokenizer_file`) or `path` itself; raises
  FileNotFoundError when there is none."""
  path = os.fspath(path)
  if os.path.isdir(path):
    found = find_tokenizer_file(path)
    if found is None:
      raise FileNotFoundError(f'tokenizer model not found: {os.path.join(path, TOKENIZER_FILENAME)} '
                              f'(nor {TOKENIZER_JSON_FILENAME})')
    path = found
  if not os.path.isfile(path):
    raise FileNotFoundError(f'tokenizer model not found: {path}')
  return path


@dataclasses.dataclass(frozen=True)
class TokenizerConfigs:
  """The config files beside a tokenizer file ({} for a missing one) and their paths (named in errors)."""

  config: Mapping[str, Any]  # tokenizer_config.json, with special_tokens_map.json's extra tokens
  config_path: str
  generation_config: Mapping[str, Any]  # generation_config.json
  generation_path: str


def read_tokenizer_configs(directory: str) -> TokenizerConfigs:
  """Reads the config files of the tokenizer in `directory`; a malformed file is a `CheckpointError`."""
  config_path = os.path.join(directory, TOKENIZER_CONFIG_FILENAME)
  config = read_json(config_path, error=CheckpointError) if os.path.isfile(config_path) else {}
  map_path = os.path.join(directory, SPECIAL_TOKENS_MAP_FILENAME)
  if os.path.isfile(map_path):  # legacy file: fills the tokens tokenizer_config.json does not name
    config = {**read_json(map_path, error=CheckpointError), **config}
  gen_path = os.path.join(directory, GENERATION_CONFIG_FILENAME)
  generation = read_json(gen_path, error=CheckpointError) if os.path.isfile(gen_path) else {}
  return TokenizerConfigs(config=config, config_path=config_path, generation_config=generation,
                          generation_path=gen_path)
