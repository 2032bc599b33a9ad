"""SFT records tokenized into fixed-shape arrays (`SFTRecords`, built by `load_records`) and the batches gathered
from them (`SFTBatch`).

Records are streamed from data/text_records.py and tokenized once at load time, `CHUNK_RECORDS` at a time, into
fixed-size numpy arrays; the texts are not kept (an index of byte offsets reads one back when asked, `RecordTexts`),
so memory is the arrays plus 16 bytes a record:

* prompt: `[bos] + tokens(prompt text)`, LEFT-padded to `max_prompt_length` (the model takes left-padded prompts
  with a 2-D attention mask, see docs/design.md, "Model"); bos is not added twice when the prompt text already
  starts with it (chat templates write `{{ bos_token }}` themselves);
* completion: `tokens(completion text) + [eos]`, RIGHT-padded to `max_canvases * canvas_length`; the training step
  cuts it into canvases and picks one valid canvas per example (docs/reference.md, "Training recipe").

The loss is only ever on the completion (the decoder canvas and the encoder's next-token loss over it): prompt
tokens are context. What the two texts are:

* prompt/completion record: prompt text = the record's prompt with `chat_template` applied (a Python format string
  with `{prompt}`; or a jinja template / 'tokenizer' (= the tokenizer's own chat template), applied to
  `[{'role': 'user', 'content': prompt}]` with the generation prompt); completion text = the completion as written.
* chat record (data/chat.py `split_chat`): prompt text = the jinja template (`chat_template` when it is jinja, else
  the tokenizer's, i.e. the checkpoint's `chat_template.jinja`) applied to every message before the final assistant
  message, with `add_generation_prompt=True` (exactly what the model is given at inference); completion text = the
  final assistant turn as the template renders it (its text and end-of-turn markup, e.g. `answer<turn|>\\n`), then
  eos. Earlier assistant turns of a multi-turn record are in the prompt and not in the loss; only the final
  assistant turn is trained on. The completion is cut from the rendering of that final assistant message alone, so
  no user, system or tool text can be in the loss; a record whose last message is not from the assistant is an
  error. Image parts of the earlier turns become `boi + image tokens + eoi` in the prompt and their pixels are read
  per batch (data/sft_images.py); a prompt with images is never truncated.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from hackable_diffusion.data.chat import ChatTemplate, format_prompt, split_chat
from hackable_diffusion.data.images import ImageProcessorConfig
from hackable_diffusion.data.sft_data_config import SFTDataConfig
from hackable_diffusion.data.sft_images import (LazyImageTokens, RecordImages, check_record_image_tokens,
                                                expand_record_images, record_images)
from hackable_diffusion.data.text_records import RecordFields, RecordIndex, RecordTexts, TextRecord, iter_records
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import DataError


# ------------------------------------------------------------------------------------------ batch
def num_valid_canvases(completion_mask, canvas_length: int):
  """[B, N*C] bool -> [B] int32: ceil(completion length / C), at least 1 (numpy in, numpy out)."""
  xp = jnp if isinstance(completion_mask, jax.Array) else np
  length = xp.sum(completion_mask.astype(xp.int32), axis=-1)
  return xp.maximum((length + canvas_length - 1) // canvas_length, 1).astype(xp.int32)


@struct.dataclass
class SFTBatch:
  """One SFT batch (numpy arrays out of the pipeline; a pytree, so `jax.device_put` works).

  prompt_ids [B, P] int32 (left-padded), prompt_mask [B, P] bool (True on real tokens),
  completion_ids [B, N*C] int32 (right-padded), completion_mask [B, N*C] bool (True on real
  completion tokens, eos included). With images (data/sft_images.py): pixel_values [B, M, max_patches, 3 p^2]
  float32 and image_position_ids [B, M, max_patches, 2] int32, M images per example (empty ones padded at (-1, -1)).
  """

  prompt_ids: Any
  prompt_mask: Any
  completion_ids: Any
  completion_mask: Any
  completion_pinned: Any = None  # optional [B, N*C] bool: tokens known at sampling time (infilling)
  pixel_values: Any = None  # optional [B, M, max_patches, 3 p^2] float32
  image_position_ids: Any = None  # optional [B, M, max_patches, 2] int32

  def num_valid_canvases(self, canvas_length: int):
    """[B] int32: canvases holding at least one completion token (at least 1)."""
    return num_valid_canvases(self.completion_mask, canvas_length)


# ------------------------------------------------------------------------------------------ records
def _select(texts: Sequence[Any], idx: np.ndarray) -> Sequence[Any]:
  return texts.select(idx) if isinstance(texts, RecordTexts) else [texts[i] for i in idx]


@dataclasses.dataclass(frozen=True)
class SFTRecords:
  """All records of a dataset, tokenized: arrays of R rows plus the raw texts (for evaluation).

  `sources[i]` is `(file, line_number)` of record i; `stats` counts skipped/truncated records. `prompts`,
  `completions` and `sources` are read from the data files when indexed (`RecordTexts`: an index of offsets is
  kept, not the texts), so memory grows with the token arrays only.
  """

  prompt_ids: np.ndarray        # [R, P] int32, left-padded
  prompt_lengths: np.ndarray    # [R] int32
  completion_ids: np.ndarray    # [R, N*C] int32, right-padded
  completion_lengths: np.ndarray  # [R] int32 (eos included)
  prompts: Sequence[str]        # raw prompt texts (before the chat template)
  completions: Sequence[str]    # raw completion texts
  sources: Sequence[tuple[str, int]]
  stats: dict[str, int]
  completion_pinned: np.ndarray | None = None  # [R, N*C] bool when `pinned_field` is set
  images: RecordImages | None = None  # when the examples take images (`max_images` > 0)

  def __len__(self) -> int:
    return int(self.prompt_ids.shape[0])

  @property
  def prompt_mask(self) -> np.ndarray:
    """[R, P] bool."""
    return _left_mask(self.prompt_lengths, self.prompt_ids.shape[1])

  @property
  def completion_mask(self) -> np.ndarray:
    """[R, N*C] bool."""
    return _right_mask(self.completion_lengths, self.completion_ids.shape[1])

  def batch(self, indices) -> SFTBatch:
    """Gathers rows `indices` into an `SFTBatch` of numpy arrays."""
    idx = np.asarray(indices, dtype=np.int64)
    return SFTBatch(
        prompt_ids=self.prompt_ids[idx],
        prompt_mask=_left_mask(self.prompt_lengths[idx], self.prompt_ids.shape[1]),
        completion_ids=self.completion_ids[idx],
        completion_mask=_right_mask(self.completion_lengths[idx], self.completion_ids.shape[1]),
        completion_pinned=None if self.completion_pinned is None else self.completion_pinned[idx],
        **({} if self.images is None else self.images.batch(idx, self.prompt_ids[idx])),
    )

  def text_record(self, i: int) -> TextRecord:
    """Record `i` as read from its data file (its texts and other JSON fields, e.g. Sudoku's `givens`)."""
    if isinstance(self.prompts, RecordTexts):
      return self.prompts.index.record(i)
    return TextRecord(prompt=self.prompts[i], completion=self.completions[i], pinned=None, source=self.sources[i],
                      fields={})

  def select(self, indices) -> 'SFTRecords':
    """A subset of the records (e.g. one host's shard)."""
    idx = np.asarray(indices, dtype=np.int64)
    return dataclasses.replace(
        self,
        prompt_ids=self.prompt_ids[idx], prompt_lengths=self.prompt_lengths[idx],
        completion_ids=self.completion_ids[idx], completion_lengths=self.completion_lengths[idx],
        completion_pinned=None if self.completion_pinned is None else self.completion_pinned[idx],
        images=None if self.images is None else self.images.select(idx),
        prompts=_select(self.prompts, idx), completions=_select(self.completions, idx),
        sources=_select(self.sources, idx))


def _left_mask(lengths: np.ndarray, width: int) -> np.ndarray:
  return np.arange(width)[None, :] >= (width - lengths)[:, None]


def _right_mask(lengths: np.ndarray, width: int) -> np.ndarray:
  return np.arange(width)[None, :] < lengths[:, None]


# ------------------------------------------------------------------------------------------ tokenization
def _jinja_template(config: SFTDataConfig, tokenizer: Tokenizer) -> ChatTemplate | None:
  """The jinja template of chat records: the config's when it is jinja, else the tokenizer's (or None)."""
  if config.chat_template_kind == 'jinja':
    return ChatTemplate(source=config.chat_template, origin='chat_template',
                        special_tokens=tokenizer.special_tokens)
  return tokenizer.chat_template


def _record_texts(records: list[TextRecord], config: SFTDataConfig, tokenizer: Tokenizer, stats: dict[str, int],
                  tokens: LazyImageTokens) -> tuple[list[int], list[str], list[str], list[bool], list[int]]:
  """(positions of the kept records, prompt texts, completion texts, whether each prompt text is a rendered jinja
  template, images per record).

  A record whose chat template fails (it raised, or no prompt/completion split exists) is a `DataError` naming file
  and line, or skipped under `on_malformed='skip'`; a missing template is always an error."""
  kind = config.chat_template_kind
  template = _jinja_template(config, tokenizer)
  processor = config.image_processor or ImageProcessorConfig()
  kept, prompts, completions, templated, num_images = [], [], [], [], []
  for position, r in enumerate(records):
    where = f'{r.source[0]}:{r.source[1]}'
    needs_jinja = r.messages is not None or kind in ('jinja', 'tokenizer')
    if needs_jinja and template is None:
      what = 'a chat record' if r.messages is not None else f'chat_template={config.chat_template!r}'
      raise DataError(f'{where}: {what} needs a jinja chat template, but the tokenizer has none (no '
                      f'chat_template.jinja or tokenizer_config.json chat_template beside it) and chat_template '
                      f'is not a jinja template')
    images = 0
    try:
      if r.messages is not None:
        split = split_chat(template, list(r.messages), where)
        prompt, images = expand_record_images(r, split.prompt, processor, tokens, where)
        completion = split.completion
      elif needs_jinja:
        prompt = template.render([{'role': 'user', 'content': r.prompt}], add_generation_prompt=True, where=where)
        completion = r.completion
      else:
        prompt, completion = format_prompt(config.chat_template, r.prompt), r.completion
    except DataError as e:
      if config.on_malformed == 'error':
        raise DataError(f"{e}; set on_malformed='skip' to skip such records") from None
      stats['skipped_malformed'] += 1
      continue
    kept.append(position)
    prompts.append(prompt)
    completions.append(completion)
    templated.append(needs_jinja)
    num_images.append(images)
  return kept, prompts, completions, templated, num_images


def _encode(tokenizer: Tokenizer, texts: list[str], parse_special: list[bool]) -> list[list[int]]:
  """Token ids of each text; texts written by a chat template have their control tokens parsed as such."""
  out: list[list[int]] = [[] for _ in texts]
  for flag in (False, True):
    idx = [i for i, f in enumerate(parse_special) if f == flag]
    if idx:
      for i, ids in zip(idx, tokenizer.encode_batch([texts[i] for i in idx], parse_special_tokens=flag)):
        out[i] = ids
  return out


# records read, templated and tokenized this many at a time: memory holds one chunk's texts, not the dataset's
CHUNK_RECORDS = 1024


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
  chunk: list[Any] = []
  for item in items:
    chunk.append(item)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


@dataclasses.dataclass(frozen=True)
class _Rows:
  """The token arrays (and the index) of one chunk of records."""

  prompt_ids: np.ndarray
  completion_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_lengths: np.ndarray
  completion_pinned: np.ndarray | None
  num_images: np.ndarray
  file_ids: np.ndarray
  offsets: np.ndarray
  linenos: np.ndarray


def _tokenize_chunk(chunk: list[tuple[int, TextRecord]], file_id: int, config: SFTDataConfig, tokenizer: Tokenizer,
                    stats: dict[str, int], first_unk: list[str], tokens: LazyImageTokens) -> _Rows:
  """Templates and tokenizes one chunk of `(offset, record)` into padded rows (errors as `load_records` says)."""
  records = [r for _, r in chunk]
  kept, prompt_texts, completion_texts, templated, num_images = _record_texts(records, config, tokenizer, stats,
                                                                              tokens)
  records = [records[k] for k in kept]
  pins = [r.pinned for r in records]
  sources = [r.source for r in records]
  prompt_tokens = _encode(tokenizer, prompt_texts, templated)
  completion_tokens = _encode(tokenizer, completion_texts, [r.messages is not None for r in records])

  num = len(records)
  P, cap = config.max_prompt_length, config.completion_capacity
  pad = tokenizer.pad_id
  prompt_ids = np.full((num, P), pad, np.int32)
  completion_ids = np.full((num, cap), pad, np.int32)
  prompt_lengths = np.zeros((num,), np.int32)
  completion_lengths = np.zeros((num,), np.int32)
  completion_pinned = np.zeros((num, cap), bool) if config.pinned_field is not None else None
  truncate = config.on_overlength == 'truncate'
  unk = tokenizer.unk_id
  for i, (pt, ct) in enumerate(zip(prompt_tokens, completion_tokens)):
    unknown = pt.count(unk) + ct.count(unk) if unk >= 0 else 0
    if unknown:  # characters the tokenizer does not know (a run of them is one unk token): counted and logged
      stats['unk_tokens'] += unknown
      first_unk[0] = first_unk[0] or '{}:{}'.format(*sources[i])
    if completion_pinned is not None:
      if len(pins[i]) != len(ct):
        f, n = sources[i]
        raise DataError(f'{f}:{n}: {config.pinned_field!r} has {len(pins[i])} entries but the completion has '
                        f'{len(ct)} tokens (one 0/1 per completion token, eos excluded)')
      width = min(len(ct), cap)
      completion_pinned[i, :width] = np.frombuffer(pins[i].encode(), np.uint8)[:width] == ord('1')
    if config.add_bos and not (pt and pt[0] == tokenizer.bos_id):
      pt = [tokenizer.bos_id] + pt
    check_record_image_tokens(pt, ct, num_images[i], tokens, sources[i])
    if config.append_eos:
      ct = ct + [tokenizer.eos_id]
    if len(pt) > P:
      if num_images[i]:
        f, n = sources[i]
        raise DataError(f'{f}:{n}: prompt with {num_images[i]} image(s) is {len(pt)} tokens, longer than '
                        f'max_prompt_length={P} (a prompt with images is never truncated); raise max_prompt_length')
      if not truncate:
        f, n = sources[i]
        fix = ("the model's attention structure reads exactly that many prompt tokens (e.g. one per grid cell, "
               "no separators)" if config.min_prompt_length == P else
               "raise max_prompt_length or set on_overlength='truncate'")
        raise DataError(f'{f}:{n}: prompt is {len(pt)} tokens, longer than max_prompt_length={P}; {fix}')
      pt = pt[len(pt) - P:]
      stats['truncated_prompts'] += 1
    if len(ct) > cap:
      if not truncate:
        f, n = sources[i]
        raise DataError(
            f'{f}:{n}: completion is {len(ct)} tokens{" (eos included)" if config.append_eos else ""},'
            f' longer than max_canvases*canvas_length={config.max_canvases}*{config.canvas_length}'
            f"={cap}; raise max_canvases or set on_overlength='truncate'")
      ct = ct[:cap]
      stats['truncated_completions'] += 1
    if len(pt) < config.min_prompt_length:
      f, n = sources[i]
      unknown = pt.count(unk) if unk >= 0 else 0
      hint = (f' ({unknown} of its tokens are unk: characters the tokenizer does not know, a run of them one token)'
              if unknown else '')
      raise DataError(f'{f}:{n}: prompt is {len(pt)} tokens{hint}, fewer than min_prompt_length='
                      f"{config.min_prompt_length} (the model's attention structure reads that many prompt slots)")
    if pt:
      prompt_ids[i, P - len(pt):] = pt
    completion_ids[i, :len(ct)] = ct
    prompt_lengths[i] = len(pt)
    completion_lengths[i] = len(ct)

  return _Rows(prompt_ids=prompt_ids, completion_ids=completion_ids, prompt_lengths=prompt_lengths,
               completion_lengths=completion_lengths, completion_pinned=completion_pinned,
               num_images=np.asarray(num_images, np.int32).reshape(num), file_ids=np.full((num,), file_id, np.int32),
               offsets=np.asarray([chunk[k][0] for k in kept], np.int64).reshape(num),
               linenos=np.asarray([n for _, n in sources], np.int32).reshape(num))


def load_records(path: str | Sequence[str] | None, config: SFTDataConfig,
                 tokenizer: Tokenizer) -> SFTRecords:
  """Reads and tokenizes every record of `path` (default: `config.path`) into an `SFTRecords`.

  The files are streamed (`CHUNK_RECORDS` records at a time): memory holds the token arrays and an index of byte
  offsets, never every record's texts. Raises `DataError` (one line, naming file and line) for a missing or empty
  file, and, depending on `config.on_malformed` / `config.on_overlength`, for malformed or over-long records.
  """
  if path is not None:
    config = dataclasses.replace(config, path=path)
  if tokenizer.pad_id < 0:
    raise ValueError('the tokenizer has no pad id; SFT batches need one')
  if (config.add_bos and tokenizer.bos_id < 0) or (config.append_eos and tokenizer.eos_id < 0):
    raise ValueError('add_bos/append_eos need a tokenizer with bos/eos ids')
  stats = {'skipped_malformed': 0, 'truncated_prompts': 0, 'truncated_completions': 0, 'unk_tokens': 0}
  fields = RecordFields(prompt_field=config.prompt_field, completion_field=config.completion_field,
                        pinned_field=config.pinned_field, on_malformed=config.on_malformed,
                        messages_field=config.messages_field)
  rows: list[_Rows] = []
  first_unk = ['']
  tokens = LazyImageTokens(tokenizer)
  for file_id, p in enumerate(config.paths):
    read = 0
    for chunk in _chunks(iter_records(p, fields, stats), CHUNK_RECORDS):
      read += len(chunk)
      rows.append(_tokenize_chunk(chunk, file_id, config, tokenizer, stats, first_unk, tokens))
      del chunk  # before the next one is read
    if not read:
      what = 'no records' if not stats['skipped_malformed'] else 'no valid records'
      raise DataError(f'{p}: {what} (empty file or only blank/skipped lines)')
  num = sum(len(r.offsets) for r in rows)
  if not num:
    raise DataError(f'{", ".join(config.paths)}: no valid records (every record was skipped)')

  def joined(name: str) -> np.ndarray:
    return np.concatenate([getattr(r, name) for r in rows])

  msg = (f'SFT data {", ".join(config.paths)}: {num} records; skipped_malformed='
         f'{stats["skipped_malformed"]}, truncated_prompts={stats["truncated_prompts"]}, '
         f'truncated_completions={stats["truncated_completions"]}, unk_tokens={stats["unk_tokens"]}'
         + (f' (characters the tokenizer does not know, first at {first_unk[0]})' if first_unk[0] else ''))
  (logging.warning if any(stats.values()) else logging.info)(msg)
  index = RecordIndex(paths=tuple(os.fspath(p) for p in config.paths), file_ids=joined('file_ids'),
                      offsets=joined('offsets'), linenos=joined('linenos'), fields=fields)
  images = record_images(config, index, joined('num_images'), tokens)
  return SFTRecords(prompt_ids=joined('prompt_ids'), prompt_lengths=joined('prompt_lengths'),
                    completion_ids=joined('completion_ids'), completion_lengths=joined('completion_lengths'),
                    prompts=RecordTexts(index, 'prompt'), completions=RecordTexts(index, 'completion'),
                    sources=RecordTexts(index, 'source'), stats=stats,
                    completion_pinned=None if config.pinned_field is None else joined('completion_pinned'),
                    images=images)

