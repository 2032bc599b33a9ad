"""JSONL SFT data read into `TextRecord`s: `read_records`, the project's one parser of SFT data (training, tokenizer
training, evaluation).

Each JSONL line is an object with either a prompt and a completion string, or a chat conversation under
`messages_field` (default 'messages': a list of `{"role", "content"}` with roles system/developer/user/assistant/
tool, ending in an assistant message). A line with both prompt and completion fields is a prompt/completion record.
A chat record's messages are validated here (data/chat.py `validate_messages`; the last message must be the
assistant turn to train on, with a user message before it); its chat template splits it into the prompt and
completion texts when it is tokenized (data/sft_records.py). Blank lines are ignored; a malformed line is a one-line
`DataError` naming file and line, or is skipped and counted.

`iter_records` streams a file one line at a time; `RecordIndex` keeps where each record's line is (file, byte offset,
line number) and `RecordTexts` reads one part of a record back from it on access, so a large file's texts are never
all in memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from hackable_diffusion.data.chat import message_text, short_repr, validate_messages
from hackable_diffusion.errors import DataError
from hackable_diffusion.files import iter_jsonl_at, read_jsonl_line


@dataclasses.dataclass(frozen=True)
class TextRecord:
  """One JSONL record before tokenization: the two strings, the pinned mask string, where it came from, and every
  other JSON field (e.g. Sudoku's `givens`).

  A chat record has its validated `messages`; its `prompt`/`completion` are the last user message's and the final
  assistant message's texts (the strings a tokenizer is trained on and evaluation compares against).
  """

  prompt: str
  completion: str
  pinned: str | None
  source: tuple[str, int]  # (file, line number)
  fields: Mapping[str, Any]
  messages: tuple[Mapping[str, Any], ...] | None = None


def _chat_problem(messages: Any, where: str) -> str | list[dict[str, Any]]:
  """The validated messages of a chat record, or the problem (without the `file:line: ` prefix)."""
  try:
    checked = validate_messages(messages, where)
  except DataError as e:
    return str(e)[len(where) + 2:]
  if checked[-1]['role'] != 'assistant':
    return f"the last message must be the assistant turn to train on, got role {checked[-1]['role']!r}"
  if not any(m['role'] == 'user' for m in checked[:-1]):
    return 'no user message before the final assistant message'
  return checked


@dataclasses.dataclass(frozen=True)
class RecordFields:
  """Which JSON fields a record's parts are in, and what to do with a malformed line (`read_records`'s options)."""

  prompt_field: str = 'prompt'
  completion_field: str = 'completion'
  pinned_field: str | None = None
  on_malformed: str = 'error'
  messages_field: str = 'messages'


def parse_record(obj: Any, problem: str | None, path: str, lineno: int, fields: RecordFields
                 ) -> tuple[TextRecord | None, str | None]:
  """`(record, None)` for a line that is a valid record, else `(None, problem)` (the JSON line's `problem`, or
  what is wrong with the object)."""
  messages = None
  if problem is None:
    if not isinstance(obj, dict):
      problem = f'expected a JSON object, got {type(obj).__name__}'
    elif fields.messages_field in obj and not (fields.prompt_field in obj and fields.completion_field in obj):
      checked = _chat_problem(obj[fields.messages_field], f'{path}:{lineno}')
      if isinstance(checked, str):
        problem = f'field {fields.messages_field!r}: {checked}'
      else:
        messages = checked
    else:
      for field in (fields.prompt_field, fields.completion_field):
        if field not in obj:
          problem = (f'missing field {field!r} (keys: {short_repr(sorted(obj))}; set prompt_field/completion_field '
                     f'if the data uses other names, or give chat records a {fields.messages_field!r} list)')
          break
        if not isinstance(obj[field], str):
          problem = f'field {field!r} must be a string, got {type(obj[field]).__name__} {short_repr(obj[field])}'
          break
    if problem is None and fields.pinned_field is not None:
      pin = obj.get(fields.pinned_field)
      if pin is None:
        problem = (f"missing field {fields.pinned_field!r} (pinned_field; set data.pinned_field='' for data without "
                   f"pinned tokens)")
      elif not isinstance(pin, str) or set(pin) - {'0', '1'}:
        problem = f"field {fields.pinned_field!r} (pinned_field) must be a string of '0'/'1', got {short_repr(pin)}"
  if problem is not None:
    return None, problem
  source = (os.fspath(path), lineno)
  pinned = obj[fields.pinned_field] if fields.pinned_field is not None else None
  if messages is not None:
    extra = {k: v for k, v in obj.items() if k != fields.messages_field}
    users = [m for m in messages[:-1] if m['role'] == 'user']
    return TextRecord(prompt=message_text(users[-1]), completion=message_text(messages[-1]), pinned=pinned,
                      source=source, fields=extra, messages=tuple(messages)), None
  extra = {k: v for k, v in obj.items() if k not in (fields.prompt_field, fields.completion_field)}
  return TextRecord(prompt=obj[fields.prompt_field], completion=obj[fields.completion_field], pinned=pinned,
                    source=source, fields=extra), None


def iter_records(path: str, fields: RecordFields, stats: dict[str, int] | None = None
                 ) -> Iterator[tuple[int, TextRecord]]:
  """`(byte offset, record)` of every valid record of one JSONL file, one line in memory at a time (`read_records`
  for the rules); `record_at(path, offset, fields)` reads one again."""
  for lineno, offset, obj, problem in iter_jsonl_at(path, error=DataError):
    record, problem = parse_record(obj, problem, path, lineno, fields)
    if problem is not None:
      if fields.on_malformed == 'error':
        raise DataError(f"{path}:{lineno}: {problem}; set on_malformed='skip' to skip such lines")
      if stats is not None:
        stats['skipped_malformed'] = stats.get('skipped_malformed', 0) + 1
      continue
    yield offset, record


def record_at(path: str, offset: int, lineno: int, fields: RecordFields) -> TextRecord:
  """The record of the line at byte `offset` (line `lineno`) of `path`, as `iter_records` gave it; a line that no
  longer parses (the file changed since) is a one-line `DataError`."""
  obj, problem = read_jsonl_line(path, offset)
  record, problem = parse_record(obj, problem, path, lineno, fields)
  if problem is not None:
    raise DataError(f'{path}:{lineno}: {problem} (the file changed while in use?)')
  return record


def read_records(path: str, *, prompt_field: str = 'prompt', completion_field: str = 'completion',
                 pinned_field: str | None = None, on_malformed: str = 'error',
                 stats: dict[str, int] | None = None, messages_field: str = 'messages') -> list[TextRecord]:
  """The records of one JSONL file (the project's one reader of SFT data: training, tokenizer training, evaluation).

  A line with both prompt and completion fields is a prompt/completion record; else a line with `messages_field`
  is a chat record (module docstring). A line that is not valid UTF-8 / JSON, not an object, lacks a string field,
  or has malformed messages (not a list, a message without role or content, an unknown role, not ending in an
  assistant message) raises a one-line `DataError` naming file and line (`on_malformed='error'`) or is skipped and
  counted in `stats['skipped_malformed']`. `iter_records` streams the same records.
  """
  fields = RecordFields(prompt_field=prompt_field, completion_field=completion_field, pinned_field=pinned_field,
                        on_malformed=on_malformed, messages_field=messages_field)
  return [record for _, record in iter_records(path, fields, stats)]


@dataclasses.dataclass(frozen=True)
class RecordIndex:
  """Where each record's JSONL line is (file, byte offset, line number: 16 bytes a record, not the record's texts);
  `record(i)` parses that line again. What keeps a large dataset's memory at its token arrays."""

  paths: tuple[str, ...]
  file_ids: np.ndarray  # [R] int32, into `paths`
  offsets: np.ndarray   # [R] int64, byte offset of the record's line
  linenos: np.ndarray   # [R] int32, 1-based
  fields: RecordFields

  def __len__(self) -> int:
    return int(self.offsets.shape[0])

  def source(self, i: int) -> tuple[str, int]:
    return self.paths[int(self.file_ids[i])], int(self.linenos[i])

  def record(self, i: int) -> TextRecord:
    return record_at(self.paths[int(self.file_ids[i])], int(self.offsets[i]), int(self.linenos[i]), self.fields)

  def select(self, indices) -> RecordIndex:
    idx = np.asarray(indices, dtype=np.int64)
    return dataclasses.replace(self, file_ids=self.file_ids[idx], offsets=self.offsets[idx], linenos=self.linenos[idx])


class RecordTexts(Sequence):
  """A read-only list of one part of every record ('prompt', 'completion' or 'source'), read from the data file
  on access (through a `RecordIndex`); equal to a list holding the same items."""

  def __init__(self, index: RecordIndex, part: str):
    self.index, self.part = index, part

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[k] for k in range(*i.indices(len(self)))]
    if not -len(self) <= i < len(self):
      raise IndexError(f'record {i} of {len(self)}')
    i = int(i) % len(self)
    if self.part == 'source':
      return self.index.source(i)
    return getattr(self.index.record(i), self.part)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

  def __repr__(self) -> str:
    return f'RecordTexts({self.part!r}, {len(self)} records)'

  def select(self, indices) -> RecordTexts:
    return RecordTexts(self.index.select(indices), self.part)
