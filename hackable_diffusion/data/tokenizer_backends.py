"""The two backends behind `Tokenizer` (data/tokenizer.py), and training a SentencePiece model.

`SentencePieceBackend` wraps a serialized SentencePiece model (`tokenizer.model`); `TokenizersBackend` wraps a
Hugging Face `tokenizer.json` (the `tokenizers` library, no torch). Both have one small interface: `kind`,
`vocab_size()`, `special_ids()` (-1 for none), `id_to_piece`, `piece_to_id` (None for an unknown piece),
`encode_batch` (no bos/eos added), `decode` and `save`. `load_backend` reads either file.

`train_sentencepiece` trains a SentencePiece model in-process (no files read, no network) with no dummy prefix,
identity normalisation and no whitespace collapsing, so a text is tokenised exactly as written; `train_tokenizer`
(data/tokenizer.py) wraps it.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable, Sequence

import sentencepiece as spm
import tokenizers

from hackable_diffusion.data.tokenizer_files import TOKENIZER_FILENAME, TOKENIZER_JSON_FILENAME
from hackable_diffusion.files import write_atomic


class SentencePieceBackend:
  """`sentencepiece.SentencePieceProcessor` over a serialized model."""

  kind = 'sentencepiece'

  def __init__(self, model_proto: bytes):
    if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
      raise ValueError('Tokenizer needs the serialized SentencePiece model as non-empty bytes.')
    self.model_proto = bytes(model_proto)
    self.sp = spm.SentencePieceProcessor()
    try:
      self.sp.LoadFromSerializedProto(self.model_proto)
    except (RuntimeError, OSError) as e:
      raise ValueError(f'not a valid SentencePiece model: {e}'.replace('\n', ' ')) from e
    self._control_re: re.Pattern[str] | None | bool = False  # built on first use (a 262k-piece scan)

  def _controls(self) -> re.Pattern[str] | None:
    """Control pieces (bos/eos/pad) are never matched in text by SentencePiece; a rendered chat template names
    them as text (`{{ bos_token }}`), so encoding one splits on them first, as transformers does."""
    if self._control_re is False:
      pieces = [self.sp.IdToPiece(i) for i in range(self.sp.GetPieceSize()) if self.sp.IsControl(i)]
      self._control_re = re.compile('(' + '|'.join(map(re.escape, sorted(pieces, key=len, reverse=True))) + ')'
                                    ) if pieces else None
    return self._control_re

  def vocab_size(self) -> int:
    return self.sp.GetPieceSize()

  def special_ids(self) -> dict[str, int]:
    return {'pad': self.sp.pad_id(), 'eos': self.sp.eos_id(), 'bos': self.sp.bos_id(), 'unk': self.sp.unk_id()}

  def id_to_piece(self, token_id: int) -> str:
    return self.sp.IdToPiece(int(token_id))

  def piece_to_id(self, piece: str) -> int | None:
    i = self.sp.PieceToId(piece)
    return i if self.sp.IdToPiece(i) == piece else None

  def encode_batch(self, texts: Sequence[str], parse_special_tokens: bool) -> list[list[int]]:
    controls = self._controls() if parse_special_tokens else None
    if controls is not None:
      return [self._encode_with_controls(controls, t) for t in texts]
    threads = max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
                         else (os.cpu_count() or 1), 8))
    return self.sp.Encode(list(texts), out_type=int, num_threads=threads)

  def _encode_with_controls(self, controls: re.Pattern[str], text: str) -> list[int]:
    out: list[int] = []
    for i, part in enumerate(controls.split(text)):
      if i % 2:
        out.append(self.sp.PieceToId(part))
      elif part:
        out += self.sp.EncodeAsIds(part)
    return out

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    del skip_special_tokens  # SentencePiece always drops control pieces
    return self.sp.DecodeIds(ids)

  def save(self, directory: str) -> str:
    return write_atomic(os.path.join(directory, TOKENIZER_FILENAME), self.model_proto)


class TokenizersBackend:
  """A `tokenizers.Tokenizer` (the content of a `tokenizer.json`); padding/truncation in the file are ignored."""

  kind = 'tokenizers'

  def __init__(self, tok: tokenizers.Tokenizer):
    self.tok = tok
    self.tok.no_padding()
    self.tok.no_truncation()

  @classmethod
  def from_str(cls, text: str) -> 'TokenizersBackend':
    try:
      return cls(tokenizers.Tokenizer.from_str(text))
    except Exception as e:  # the Rust parser raises a plain Exception
      raise ValueError(f'not a valid tokenizer.json: {" ".join(str(e).split())}') from None

  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def special_ids(self) -> dict[str, int]:
    unk = getattr(self.tok.model, 'unk_token', None)
    unk_id = self.tok.token_to_id(unk) if isinstance(unk, str) else None
    return {'pad': -1, 'eos': -1, 'bos': -1, 'unk': -1 if unk_id is None else unk_id}

  def id_to_piece(self, token_id: int) -> str:
    piece = self.tok.id_to_token(int(token_id))
    return '' if piece is None else piece

  def piece_to_id(self, piece: str) -> int | None:
    return self.tok.token_to_id(piece)

  def encode_batch(self, texts: Sequence[str], parse_special_tokens: bool) -> list[list[int]]:
    del parse_special_tokens  # added tokens in a text are always matched (transformers' default)
    return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def save(self, directory: str) -> str:
    return write_atomic(os.path.join(directory, TOKENIZER_JSON_FILENAME), self.tok.to_str())


Backend = SentencePieceBackend | TokenizersBackend


def load_backend(path: str) -> Backend:
  """The backend of a tokenizer file: a `.json` file is a `tokenizer.json`, anything else a SentencePiece model.
  A file that is neither raises a one-line ValueError naming `path`."""
  with open(path, 'rb') as f:
    data = f.read()
  try:
    if path.endswith('.json'):
      try:
        text = data.decode('utf-8-sig')
      except UnicodeDecodeError as e:
        raise ValueError(f'not valid UTF-8 (byte {e.start})') from None
      return TokenizersBackend.from_str(text)
    return SentencePieceBackend(data)
  except ValueError as e:
    raise ValueError(f'{path}: {e}') from e


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int | None, model_type: str,
                        user_defined_symbols: Sequence[str], pad_id: int, eos_id: int, bos_id: int,
                        unk_id: int) -> bytes:
  """Trains a SentencePiece model in-process and returns it serialized (arguments: `train_tokenizer`)."""
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
  return writer.getvalue()
