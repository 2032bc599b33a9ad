"""SentencePiece tokenizer: load an existing `tokenizer.model` or train a tiny one in-process.

DiffusionGemma configs use pad 0, eos 1, bos 2 (and the Gemma tokenizer has unk 3); `train_tokenizer`
gives a freshly trained model the same special ids, so a model config and a small task tokenizer agree.

For character-level tasks (Sudoku) the trained model is a `char` model with no dummy prefix and
identity normalisation: `encode('530070000')` is exactly one id per character, with no leading '▁'.
A space inside a text is the piece '▁' (SentencePiece's whitespace symbol) and decodes back to ' '.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import sentencepiece as spm

TOKENIZER_FILENAME = 'tokenizer.model'
_WHITESPACE_PIECE = '\u2581'  # '▁'
_SPECIAL_IDS = ('pad_id', 'eos_id', 'bos_id', 'unk_id')


class Tokenizer:
  """A thin wrapper around `sentencepiece.SentencePieceProcessor`.

  Build it with `Tokenizer.load(path)` (a `.model` file or a directory holding `tokenizer.model`) or
  with `train_tokenizer(...)`; `Tokenizer(model_proto_bytes)` also works.
  """

  def __init__(self, model_proto: bytes):
    if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
      raise ValueError('Tokenizer needs the serialized SentencePiece model as non-empty bytes.')
    self._model_proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self._model_proto)
    except (RuntimeError, OSError) as e:
      raise ValueError(f'not a valid SentencePiece model: {e}'.replace('\n', ' ')) from e

  # ---------------------------------------------------------------- construction / persistence
  @classmethod
  def load(cls, path: str | os.PathLike[str]) -> 'Tokenizer':
    """Loads a SentencePiece model file, or `<dir>/tokenizer.model` when `path` is a directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, TOKENIZER_FILENAME)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'tokenizer model not found: {path}')
    with open(path, 'rb') as f:
      data = f.read()
    try:
      return cls(data)
    except ValueError as e:
      raise ValueError(f'{path}: {e}') from e

  def save(self, directory: str | os.PathLike[str]) -> str:
    """Writes the model as `<directory>/tokenizer.model` (creating the directory); returns the path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, TOKENIZER_FILENAME)
    with open(out, 'wb') as f:
      f.write(self._model_proto)
    return out

  @property
  def model_proto(self) -> bytes:
    """The serialized SentencePiece model."""
    return self._model_proto

  # ---------------------------------------------------------------- ids
  @property
  def vocab_size(self) -> int:
    return self._sp.GetPieceSize()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  def id_to_piece(self, token_id: int) -> str:
    return self._sp.IdToPiece(int(token_id))

  def piece_to_id(self, piece: str) -> int:
    return self._sp.PieceToId(piece)

  # ---------------------------------------------------------------- encode / decode
  def encode(self, text: str) -> list[int]:
    """Text -> token ids (no bos/eos added)."""
    if not isinstance(text, str):
      raise TypeError(f'encode expects a str, got {type(text).__name__}')
    return self._sp.EncodeAsIds(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Many texts -> token ids (SentencePiece encodes the list in C++, in parallel)."""
    threads = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
                         else (os.cpu_count() or 1), 8))
    return self._sp.Encode(list(texts), out_type=int, num_threads=threads)

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
    """Token ids -> text.

    Pad ids are dropped; with `stop_at_eos` everything from the first eos on is dropped. Ids outside
    `[0, vocab_size)` (a model's embedding table can be larger than the tokenizer) decode as unk.
    Accepts a list, tuple or 1-D numpy/JAX array.
    """
    out = []
    size = self.vocab_size
    pad, eos, unk = self.pad_id, self.eos_id, self.unk_id
    for i in (int(x) for x in ids):
      if stop_at_eos and i == eos:
        break
      if i == pad:
        continue
      out.append(i if 0 <= i < size else unk)
    return self._sp.DecodeIds(out)

  def token_ids_for(self, chars: Iterable[str]) -> list[int]:
    """Ids of the single-character pieces for `chars` (e.g. `'0123456789'` -> the 10 digit ids).

    A space maps to the whitespace piece '▁'. Raises ValueError naming a character that has no
    piece of its own in this vocabulary.
    """
    ids = []
    for c in chars:
      if len(c) != 1:
        raise ValueError(f'token_ids_for expects single characters, got {c!r}')
      piece = _WHITESPACE_PIECE if c == ' ' else c
      i = self._sp.PieceToId(piece)
      if self._sp.IdToPiece(i) != piece:
        raise ValueError(f'character {c!r} has no single-character piece in this tokenizer')
      ids.append(i)
    return ids

  def __repr__(self) -> str:
    return (f'Tokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, eos_id={self.eos_id}, '
            f'bos_id={self.bos_id}, unk_id={self.unk_id})')


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
  if model_type not in ('char', 'bpe', 'unigram', 'word'):
    raise ValueError(f"model_type must be one of 'char', 'bpe', 'unigram', 'word', got {model_type!r}")
  specials = dict(pad_id=pad_id, eos_id=eos_id, bos_id=bos_id, unk_id=unk_id)
  used = [v for v in specials.values() if v >= 0]
  if len(set(used)) != len(used):
    raise ValueError(f'special ids must be distinct, got {specials}')
  if unk_id < 0:
    raise ValueError(f'unk_id must be >= 0 (SentencePiece requires an unk piece), got {unk_id}')
  texts = [t for t in texts]
  for i, t in enumerate(texts):
    if not isinstance(t, str):
      raise TypeError(f'texts[{i}] is {type(t).__name__}, expected str')
  if not any(texts):
    raise ValueError('train_tokenizer needs at least one non-empty text')
  user_defined_symbols = list(user_defined_symbols)
  if vocab_size is None:
    if model_type != 'char':
      raise ValueError(f'vocab_size is required for model_type={model_type!r}')
    chars = set()
    for t in texts:
      chars.update(t)
    # SentencePiece maps ' ' to '▁'; a char model holds one piece per distinct character.
    vocab_size = len(used) + len(user_defined_symbols) + len(chars)
  if vocab_size <= len(used) + len(user_defined_symbols):
    raise ValueError(f'vocab_size={vocab_size} leaves no room for pieces beyond the special ids')

  writer = io.BytesIO()
  max_len = max(len(t.encode('utf-8')) for t in texts)
  spm.SentencePieceTrainer.Train(
      sentence_iterator=iter(texts),
      model_writer=writer,
      model_type=model_type,
      vocab_size=vocab_size,
      hard_vocab_limit=model_type != 'char',
      character_coverage=1.0,
      user_defined_symbols=user_defined_symbols,
      add_dummy_prefix=False,
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      split_by_whitespace=model_type != 'char',
      allow_whitespace_only_pieces=True,
      max_sentence_length=max(4192, max_len + 1),
      byte_fallback=False,
      num_threads=1,
      minloglevel=2,
      **specials,
  )
  tok = Tokenizer(writer.getvalue())
  if out_path is not None:
    out_path = os.fspath(out_path)
    if out_path.endswith('.model'):
      os.makedirs(os.path.dirname(out_path) or '.', exist_ok=True)
      with open(out_path, 'wb') as f:
        f.write(tok.model_proto)
    else:
      tok.save(out_path)
  return tok
