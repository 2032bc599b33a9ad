"""JSONL SFT data read into `TextRecord`s: `read_records`, the project's one parser of SFT data (training, tokenizer
training, evaluation).

Each JSONL line is an object with either a prompt and a completion string, or a chat conversation under
`messages_field` (default 'messages': a list of `{"role", "content"}` with roles system/developer/user/assistant/
tool, ending in an assistant message). A line with both prompt and completion fields is a prompt/completion record.
A chat record's messages are validated here (data/chat.py `validate_messages`; the last message must be the
assistant turn to train on, with a user message before it); its chat template splits it into the prompt and
completion texts when it is tokenized (data/sft_records.py). Blank lines are ignored; a malformed line is a one-line
`DataError` naming file and line, or is skipped and counted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.data.chat import message_text, short_repr, validate_messages
from hackable_diffusion.errors import DataError
from hackable_diffusion.files import iter_jsonl


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


def read_records(path: str, *, prompt_field: str = 'prompt', completion_field: str = 'completion',
                 pinned_field: str | None = None, on_malformed: str = 'error',
                 stats: dict[str, int] | None = None, messages_field: str = 'messages') -> list[TextRecord]:
  """The records of one JSONL file (the project's one reader of SFT data: training, tokenizer training, evaluation).

  A line with both prompt and completion fields is a prompt/completion record; else a line with `messages_field`
  is a chat record (module docstring). A line that is not valid UTF-8 / JSON, not an object, lacks a string field,
  or has malformed messages (not a list, a message without role or content, an unknown role, not ending in an
  assistant message) raises a one-line `DataError` naming file and line (`on_malformed='error'`) or is skipped and
  counted in `stats['skipped_malformed']`.
  """
  out = []
  for lineno, obj, problem in iter_jsonl(path, error=DataError):
    messages = None
    if problem is None:
      if not isinstance(obj, dict):
        problem = f'expected a JSON object, got {type(obj).__name__}'
      elif messages_field in obj and not (prompt_field in obj and completion_field in obj):
        checked = _chat_problem(obj[messages_field], f'{path}:{lineno}')
        if isinstance(checked, str):
          problem = f'field {messages_field!r}: {checked}'
        else:
          messages = checked
      else:
        for field in (prompt_field, completion_field):
          if field not in obj:
            problem = (f'missing field {field!r} (keys: {short_repr(sorted(obj))}; set prompt_field/completion_field '
                       f'if the data uses other names, or give chat records a {messages_field!r} list)')
            break
          if not isinstance(obj[field], str):
            problem = f'field {field!r} must be a string, got {type(obj[field]).__name__} {short_repr(obj[field])}'
            break
      if problem is None and pinned_field is not None:
        pin = obj.get(pinned_field)
        if pin is None:
          problem = (f"missing field {pinned_field!r} (pinned_field; set data.pinned_field='' for data without "
                     f"pinned tokens)")
        elif not isinstance(pin, str) or set(pin) - {'0', '1'}:
          problem = f"field {pinned_field!r} (pinned_field) must be a string of '0'/'1', got {short_repr(pin)}"
    if problem is not None:
      if on_malformed == 'error':
        raise DataError(f"{path}:{lineno}: {problem}; set on_malformed='skip' to skip such lines")
      if stats is not None:
        stats['skipped_malformed'] = stats.get('skipped_malformed', 0) + 1
      continue
    source = (os.fspath(path), lineno)
    pinned = obj[pinned_field] if pinned_field is not None else None
    if messages is not None:
      extra = {k: v for k, v in obj.items() if k != messages_field}
      users = [m for m in messages[:-1] if m['role'] == 'user']
      out.append(TextRecord(prompt=message_text(users[-1]), completion=message_text(messages[-1]), pinned=pinned,
                            source=source, fields=extra, messages=tuple(messages)))
      continue
    extra = {k: v for k, v in obj.items() if k not in (prompt_field, completion_field)}
    out.append(TextRecord(prompt=obj[prompt_field], completion=obj[completion_field], pinned=pinned,
                          source=source, fields=extra))
  return out
