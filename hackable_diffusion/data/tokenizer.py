"""Tokenizers behind one interface: a SentencePiece `tokenizer.model`, or a Hugging Face `tokenizer.json`
(the `tokenizers` library, no torch), with the checkpoint's special tokens and chat template.

This module owns `Tokenizer` and `train_tokenizer`; the pieces it is built from have their own modules:
data/tokenizer_backends.py (the SentencePiece and `tokenizers` wrappers, SentencePiece training),
data/tokenizer_files.py (finding the tokenizer file, reading the config files beside it; its file names and
`find_tokenizer_file` are re-exported here) and data/special_tokens.py (resolving and checking the special ids).

`Tokenizer.load(path)` takes a directory (a checkpoint or a run's workdir: `tokenizer.json` is preferred over
`tokenizer.model`, as transformers' fast tokenizer is), or either file. Beside it, it reads
`tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`, the chat template),
`special_tokens_map.json`, `chat_template.jinja` and `generation_config.json`, and checks that they agree: a named
token must be in the vocabulary (and, for a SentencePiece model, be the model's own special id); the generation
config's `bos_token_id`/`pad_token_id` must equal the tokenizer's and its `eos_token_id` (an id or a list, e.g.
Gemma 4's `[1, 106]`: `<eos>` and `<turn|>`) must contain the tokenizer's eos. A mismatch is a one-line
`CheckpointError` naming the file, key and ids. Extra eos ids of the generation config are `eos_ids` (decode stops
at any of them).

DiffusionGemma configs use pad 0, eos 1, bos 2 (and the Gemma tokenizer has unk 3); `train_tokenizer`
gives a freshly trained SentencePiece model the same special ids, so a model config and a small task tokenizer agree.

For character-level tasks (Sudoku) the trained model is a `char` model with no dummy prefix and
identity normalisation: `encode('530070000')` is exactly one id per character, with no leading '▁'.
A space inside a text is the piece '▁' (SentencePiece's whitespace symbol) and decodes back to ' '.

`encode` never adds bos/eos (like transformers with `add_special_tokens=False`); `apply_chat_template` renders a
conversation with the chat template (data/chat.py) and encodes it as transformers' `apply_chat_template` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

from hackable_diffusion.data.chat import CHAT_TEMPLATE_FILENAME, ChatTemplate, Message, read_chat_template
from hackable_diffusion.data.special_tokens import SPECIAL_TOKEN_NAMES, resolve_special_tokens
from hackable_diffusion.data.tokenizer_backends import (Backend, SentencePieceBackend, TokenizersBackend, load_backend,
                                                        train_sentencepiece)
from hackable_diffusion.data.tokenizer_files import (GENERATION_CONFIG_FILENAME, SPECIAL_TOKENS_MAP_FILENAME,
                                                     TOKENIZER_CONFIG_FILENAME, TOKENIZER_FILENAME,
                                                     TOKENIZER_JSON_FILENAME, find_tokenizer_file,
                                                     locate_tokenizer_file, read_tokenizer_configs)
from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.files import write_atomic

__all__ = [
    'GENERATION_CONFIG_FILENAME', 'SPECIAL_TOKENS_MAP_FILENAME', 'TOKENIZER_CONFIG_FILENAME', 'TOKENIZER_FILENAME',
    'TOKENIZER_JSON_FILENAME', 'Tokenizer', 'find_tokenizer_file', 'train_tokenizer',
]

_WHITESPACE_PIECE = '\u2581'  # '▁'


# ------------------------------------------------------------------------------------------ tokenizer
class Tokenizer:
  """One interface over a SentencePiece model or a `tokenizer.json`, with special ids and a chat template.

  Build it with `Tokenizer.load(path)`, `train_tokenizer(...)`, `Tokenizer.from_tokenizers(...)` or
  `Tokenizer(model_proto_bytes)` (a SentencePiece model). Special ids are -1 when the tokenizer has none.
  """

  def __init__(self, model_proto: bytes, *, chat_template: str | None = None):
    self._setup(SentencePieceBackend(model_proto), config={}, generation_config={}, where='<model_proto>',
                template=None if chat_template is None else (chat_template, '<chat_template>'))

  def _setup(self, backend: Backend, *, config: Mapping[str, Any], generation_config: Mapping[str, Any], where: str,
             template: tuple[str, str] | None, config_path: str = TOKENIZER_CONFIG_FILENAME,
             generation_path: str = GENERATION_CONFIG_FILENAME) -> None:
    self._backend = backend
    self._config = dict(config)
    self._generation_config = dict(generation_config)
    special = resolve_special_tokens(backend, config=config, generation_config=generation_config, where=where,
                                     config_path=config_path, generation_path=generation_path)
    self._ids = special.ids
    self._special_tokens = special.tokens
    self._eos_ids = special.eos_ids
    self._chat_template = None
    if template is not None:
      try:
        self._chat_template = ChatTemplate(source=template[0], origin=template[1],
                                           special_tokens=dict(self._special_tokens))
      except ValueError as e:
        raise CheckpointError(str(e)) from None

  # ---------------------------------------------------------------- construction / persistence
  @classmethod
  def from_tokenizers(cls, tokenizer: tokenizers.Tokenizer | str, *,
                      tokenizer_config: Mapping[str, Any] | None = None,
                      generation_config: Mapping[str, Any] | None = None,
                      chat_template: str | None = None, where: str = TOKENIZER_JSON_FILENAME) -> 'Tokenizer':
    """A tokenizer over a `tokenizers.Tokenizer` (or the text of a `tokenizer.json`).

    `tokenizer_config` gives the named special tokens (`{'bos_token': '<bos>', ...}`, as in
    tokenizer_config.json); `generation_config` the ids checked against them; `chat_template` a jinja template
    (default: `tokenizer_config['chat_template']`).
    """
    if isinstance(tokenizer, str):
      backend = TokenizersBackend.from_str(tokenizer)
    else:
      backend = TokenizersBackend(tokenizers.Tokenizer.from_str(tokenizer.to_str()))
    config = dict(tokenizer_config or {})
    template = None
    if chat_template is not None:
      template = (chat_template, '<chat_template>')
    elif isinstance(config.get('chat_template'), str):
      template = (config['chat_template'], f'{TOKENIZER_CONFIG_FILENAME}:chat_template')
    tok = cls.__new__(cls)
    tok._setup(backend, config=config, generation_config=dict(generation_config or {}), where=where,
               template=template)
    return tok

  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> 'Tokenizer':
    """Loads `tokenizer.json` or a SentencePiece model: a directory holding one (tokenizer.json first), or the
    file itself; the config files beside it (module docstring) are read too."""
    path = locate_tokenizer_file(path)
    directory = os.path.dirname(path) or '.'
    backend = load_backend(path)
    files = read_tokenizer_configs(directory)
    tok = cls.__new__(cls)
    tok._setup(backend, config=files.config, generation_config=files.generation_config, where=path,
               template=read_chat_template(directory, files.config), config_path=files.config_path,
               generation_path=files.generation_path)
    return tok

  def save(self, directory: str | os.PathLike[str]) -> str:
    """Writes the tokenizer into `directory` (created): `tokenizer.model` or `tokenizer.json`, plus
    `tokenizer_config.json` and `chat_template.jinja` when there is a config or template (what transformers'
    `from_pretrained` reads). Returns the path of the tokenizer file."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    out = self._backend.save(directory)
    config = {k: v for k, v in self._config.items() if k != 'chat_template'}
    if self._backend.kind == 'tokenizers':
      named = {k: v for k, v in self._special_tokens.items() if k[:-len('_token')] in SPECIAL_TOKEN_NAMES}
      config = {**named, **config}
      config.setdefault('tokenizer_class', 'PreTrainedTokenizerFast')
    if config:
      write_atomic(os.path.join(directory, TOKENIZER_CONFIG_FILENAME),
                   json.dumps(config, indent=2, ensure_ascii=False) + '\n')
    if self._chat_template is not None:
      write_atomic(os.path.join(directory, CHAT_TEMPLATE_FILENAME), self._chat_template.source)
    return out

  @property
  def kind(self) -> str:
    """'sentencepiece' or 'tokenizers'."""
    return self._backend.kind

  @property
  def model_proto(self) -> bytes:
    """The serialized SentencePiece model (SentencePiece tokenizers only)."""
    if not isinstance(self._backend, SentencePieceBackend):
      raise AttributeError('model_proto: this tokenizer is a tokenizer.json, not a SentencePiece model')
    return self._backend.model_proto

  # ---------------------------------------------------------------- ids
  @property
  def vocab_size(self) -> int:
    return self._backend.vocab_size()

  @property
  def pad_id(self) -> int:
    return self._ids['pad']

  @property
  def eos_id(self) -> int:
    return self._ids['eos']

  @property
  def bos_id(self) -> int:
    return self._ids['bos']

  @property
  def unk_id(self) -> int:
    return self._ids['unk']

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Every id that ends a generation: eos, then the generation config's other eos ids (e.g. end of turn)."""
    return self._eos_ids

  def check_model_ids(self, *, pad_token_id: int | None, eos_token_id: int | Sequence[int] | None,
                      bos_token_id: int | None, where: str = 'the model config') -> None:
    """Raises a one-line `CheckpointError` when a model's special ids (e.g. a checkpoint's config.json) disagree
    with this tokenizer: bos and pad must be equal, the tokenizer's eos must be one of the model's eos ids."""
    for name, model_id in (('bos', bos_token_id), ('pad', pad_token_id)):
      ours = self._ids[name]
      if model_id is not None and ours >= 0 and int(model_id) != ours:
        raise CheckpointError(f'{where}: {name}_token_id {model_id} does not match the tokenizer\'s {name} token '
                              f'{self._special_tokens.get(f"{name}_token")!r} (id {ours})')
    if eos_token_id is not None and self.eos_id >= 0:
      model_eos = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
      if self.eos_id not in model_eos:
        raise CheckpointError(f'{where}: eos_token_id {eos_token_id!r} does not contain the tokenizer\'s eos token '
                              f'{self._special_tokens.get("eos_token")!r} (id {self.eos_id})')

  @property
  def special_tokens(self) -> dict[str, str]:
    """The named special tokens (`{'bos_token': '<bos>', ...}`) the chat template is rendered with."""
    return dict(self._special_tokens)

  def id_to_piece(self, token_id: int) -> str:
    return self._backend.id_to_piece(token_id)

  def piece_to_id(self, piece: str) -> int:
    """The id of a piece (token string); the unk id when the vocabulary has no such piece."""
    i = self._backend.piece_to_id(piece)
    return self.unk_id if i is None else i

  # ---------------------------------------------------------------- encode / decode
  def encode(self, text: str) -> list[int]:
    """Text -> token ids (no bos/eos added)."""
    if not isinstance(text, str):
      raise TypeError(f'encode expects a str, got {type(text).__name__}')
    return self._backend.encode_batch([text], False)[0]

  def encode_batch(self, texts: Sequence[str], *, parse_special_tokens: bool = False) -> list[list[int]]:
    """Many texts -> token ids. `parse_special_tokens`: control tokens written as text (e.g. '<bos>' from a chat
    template) become their ids also for a SentencePiece model (a tokenizer.json always matches its added tokens)."""
    return self._backend.encode_batch(list(texts), parse_special_tokens)

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True, skip_special_tokens: bool = True) -> str:
    """Token ids -> text.

    Pad ids are dropped; with `stop_at_eos` everything from the first id of `eos_ids` on is dropped. Ids outside
    `[0, vocab_size)` (a model's embedding table can be larger than the tokenizer) decode as unk (dropped when there
    is no unk). Accepts a list, tuple or 1-D numpy/JAX array. `skip_special_tokens` drops a tokenizer.json's
    special tokens (SentencePiece always drops its control pieces).
    """
    out = []
    size = self.vocab_size
    pad, unk = self.pad_id, self.unk_id
    stops = set(self._eos_ids)
    for i in (int(x) for x in ids):
      if stop_at_eos and i in stops:
        break
      if i == pad:
        continue
      if not 0 <= i < size:
        if unk < 0:
          continue
        i = unk
      out.append(i)
    return self._backend.decode(out, skip_special_tokens)

  def token_ids_for(self, chars: Iterable[str]) -> list[int]:
    """Ids of the single-character pieces for `chars` (e.g. `'0123456789'` -> the 10 digit ids).

    A space maps to the whitespace piece ('▁' in SentencePiece). Raises ValueError naming a character that has
    no piece of its own in this vocabulary.
    """
    ids = []
    for c in chars:
      if len(c) != 1:
        raise ValueError(f'token_ids_for expects single characters, got {c!r}')
      if isinstance(self._backend, SentencePieceBackend):
        i = self._backend.piece_to_id(_WHITESPACE_PIECE if c == ' ' else c)
      else:
        encoded = self.encode(c)
        i = encoded[0] if len(encoded) == 1 and self._backend.decode(encoded, False) == c else None
      if i is None or i == self.unk_id:
        raise ValueError(f'character {c!r} has no single-character piece in this tokenizer')
      ids.append(i)
    return ids

  # ---------------------------------------------------------------- chat template
  @property
  def chat_template(self) -> ChatTemplate | None:
    """The checkpoint's jinja chat template (with this tokenizer's special tokens), or None."""
    return self._chat_template

  def with_config(self, updates: Mapping[str, Any]) -> 'Tokenizer':
    """A copy of this tokenizer whose `tokenizer_config.json` entries also hold `updates` (e.g. the named image
    tokens `image_token` / `boi_token` / `eoi_token` of a trained character model), its special tokens resolved
    and checked again; `save` writes them."""
    tok = self.__class__.__new__(self.__class__)
    template = None if self._chat_template is None else (self._chat_template.source, self._chat_template.origin)
    tok._setup(self._backend, config={**self._config, **updates}, generation_config=self._generation_config,
               where=f'<{self.kind} tokenizer>', template=template)
    return tok

  def with_chat_template(self, template: str, origin: str = '<chat_template>') -> 'Tokenizer':
    """A copy of this tokenizer that uses `template` (jinja) as its chat template."""
    tok = self.__class__.__new__(self.__class__)
    tok.__dict__.update(self.__dict__)
    try:
      tok._chat_template = ChatTemplate(source=template, origin=origin, special_tokens=dict(self._special_tokens))
    except ValueError as e:
      raise CheckpointError(str(e)) from None
    return tok

  def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                          tokenize: bool = True, where: str = '', **kwargs: Any) -> list[int] | str:
    """Renders a conversation with the chat template and encodes it, as transformers' `apply_chat_template`
    (`add_special_tokens=False`: the template writes bos itself). `kwargs` reach the template."""
    if self._chat_template is None:
      raise CheckpointError(f'{where + ": " if where else ""}this tokenizer has no chat template '
                            f'({CHAT_TEMPLATE_FILENAME} or tokenizer_config.json chat_template)')
    text = self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, where=where, **kwargs)
    return self.encode_batch([text], parse_special_tokens=True)[0] if tokenize else text

  def __repr__(self) -> str:
    return (f'Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, pad_id={self.pad_id}, '
            f'eos_id={self.eos_id}, bos_id={self.bos_id}, unk_id={self.unk_id})')


def train_tokenizer(
    texts: Iterable[str],
    out_path: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int | None = None,
    model_type: str = 'char',
    user_defined_symbols: Sequence[str] = (),
    pad_id: int = 0,
    eos_id: int = 1,
    bos_id: int = 2,
    unk_id: int = 3,
) -> Tokenizer:
  """Trains a SentencePiece model in-process (no files read, no network) and returns it.

  Args:
    texts: training sentences. For `model_type='char'` every distinct character becomes a piece.
    out_path: where to write the model: a directory (-> `<dir>/tokenizer.model`) or a file path
      ending in `.model`. None keeps it in memory only (use `Tokenizer.save` later).
    vocab_size: None for `char` = exactly the specials + user symbols + distinct characters;
      required for `bpe`/`unigram`/`word`.
    model_type: 'char' (default), 'bpe', 'unigram' or 'word'.
    user_defined_symbols: extra pieces that are always kept whole (e.g. '<sep>').
    pad_id, eos_id, bos_id, unk_id: the special ids; defaults match DiffusionGemma configs.

  Whitespace: no dummy prefix, identity normalisation and no whitespace collapsing, so a text is
  tokenised exactly as written (a ' ' becomes the piece '▁' and decodes back to ' ').
  """
  tok = Tokenizer(train_sentencepiece(texts, vocab_size=vocab_size, model_type=model_type,
                                      user_defined_symbols=user_defined_symbols, pad_id=pad_id, eos_id=eos_id,
                                      bos_id=bos_id, unk_id=unk_id))
  if out_path is not None:
    out_path = os.fspath(out_path)
    if out_path.endswith('.model'):
      os.makedirs(os.path.dirname(out_path) or '.', exist_ok=True)
      write_atomic(out_path, tok.model_proto)
    else:
      tok.save(out_path)
  return tok
