"""Chat messages and the checkpoint's jinja chat template, rendered as transformers' `apply_chat_template` does.

A conversation is a list of messages `{'role': ..., 'content': ...}` with a role in `ROLES` and a content that is
a string or a list of content parts (`{'type': 'text', 'text': ...}`, `{'type': 'image', 'path': ...}`, as in
transformers; the template writes an image part as its image placeholder, which data/image_prompts.py expands).
`ChatTemplate.render` compiles the template in the same sandboxed jinja2 environment as transformers 5
(`trim_blocks`, `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text) and passes it `messages`, `add_generation_prompt`,
`tools`/`documents` (None) and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...), so the text is
exactly what transformers renders.

For SFT (data/sft.py) a chat record is split into the encoder prompt and the decoder completion by `split_chat`:

  prompt     = render(messages[:-1], add_generation_prompt=True)   # what a user sends at inference
  completion = the final assistant turn as the template renders it, less its generation header

i.e. `render(messages) = render(messages[:-1]) + turn`, and the completion is `turn` without the longest prefix it
shares with the generation header `render(messages[:-1], add_generation_prompt=True)[len(render(messages[:-1])):]`.
When the prompt is a prefix of the whole conversation (most templates) this is `render(messages)[len(prompt):]`,
as TRL computes it; a template whose generation header differs from the start of a rendered assistant turn (e.g. an
empty thought channel added only when prompting) still gives the assistant's text plus its end-of-turn markup.
Only the final message may be in the loss, and it must be an assistant message; earlier assistant turns are
context in the prompt. The completion text therefore never contains a user, system or tool message.

Errors are one-line `DataError`s prefixed with where the conversation came from (`file:line`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import string
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from hackable_diffusion.errors import CheckpointError, DataError
from hackable_diffusion.files import read_json

ROLES = ('system', 'developer', 'user', 'assistant', 'tool')
CHAT_TEMPLATE_FILENAME = 'chat_template.jinja'
CHAT_TEMPLATE_JSON_FILENAME = 'chat_template.json'
IMAGE_PART_TYPE = 'image'  # a content part `{'type': 'image', 'path': ...}` (data/image_prompts.py)
# Names a message's reasoning is passed under (transformers copies the first one found into the others).
_REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')

Message = Mapping[str, Any]


# ------------------------------------------------------------------------------------------ messages
def short_repr(value: Any, limit: int = 60) -> str:
  """`repr(value)` cut to `limit` characters, for one-line error messages (repr escapes newlines)."""
  r = repr(value)
  return r if len(r) <= limit else r[:limit] + '...'


def validate_messages(messages: Any, where: str) -> list[dict[str, Any]]:
  """Checks a conversation and returns it as plain dicts (keys whose value is None dropped, as transformers does).

  Raises a one-line `DataError` starting with `where` for: not a non-empty list, a message that is not an object,
  lacks `role` or `content`, has a role outside `ROLES`, or a content that is neither a string nor a list of parts.
  """
  if not isinstance(messages, list) or not messages:
    raise DataError(f'{where}: messages must be a non-empty list of {{"role", "content"}} objects, '
                    f'got {short_repr(messages)}')
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise DataError(f'{where}: message {i} must be an object with "role" and "content", got {short_repr(m)}')
    m = {k: v for k, v in m.items() if v is not None}
    for key in ('role', 'content'):
      if key not in m and not (key == 'content' and ('tool_calls' in m or _reasoning(m) is not None)):
        raise DataError(f'{where}: message {i} has no {key!r} (keys: {short_repr(sorted(m))})')
    role = m['role']
    if role not in ROLES:
      raise DataError(f'{where}: message {i} has unknown role {short_repr(role)} (expected one of {", ".join(ROLES)})')
    content = m.get('content', '')
    if not isinstance(content, str) and not (
        isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get('type'), str) for p in content)):
      raise DataError(f'{where}: message {i} ({role}) content must be a string or a list of '
                      f'{{"type": ...}} parts, got {short_repr(content)}')
    out.append(_alias_reasoning(m))
  return out


def _reasoning(m: Mapping[str, Any]) -> Any:
  return next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)


def _alias_reasoning(m: dict[str, Any]) -> dict[str, Any]:
  reasoning = _reasoning(m)
  return m if reasoning is None else {'thinking': reasoning, **m, 'reasoning_content': reasoning}


def image_parts(messages: Sequence[Message]) -> list[tuple[int, Mapping[str, Any]]]:
  """`(message index, part)` of every `{'type': 'image', ...}` content part, in conversation order (the order in
  which transformers' processor pairs images with the template's image placeholders)."""
  return [(i, p) for i, m in enumerate(messages) if isinstance(m.get('content'), list)
          for p in m['content'] if isinstance(p, Mapping) and p.get('type') == IMAGE_PART_TYPE]


def message_text(message: Mapping[str, Any]) -> str:
  """The text of a message: its string content, or its text parts joined."""
  content = message.get('content', '')
  if isinstance(content, str):
    return content
  return ''.join(p.get('text', '') for p in content if p.get('type') == 'text')


# ------------------------------------------------------------------------------------------ template
class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body unchanged."""

  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_render'), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


class _Namespace(jinja2.utils.Namespace):
  """jinja's `namespace()` without underscore-prefixed attributes (as transformers' sandbox)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, args = args[0], args[1:]
    attrs = dict(*args, **kwargs)
    for name in attrs:
      _Namespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _Namespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith('_'):
      raise jinja2.exceptions.SecurityError(f'chat templates cannot set underscore attributes, got {name!r}')


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = _strftime_now
  env.globals['dict'] = lambda *a, **k: dict(*a, **k)
  env.globals['namespace'] = _Namespace
  return env.from_string(source)


def _one_line(e: BaseException) -> str:
  return ' '.join(f'{type(e).__name__}: {e}'.split())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
  """A jinja chat template and what it is rendered with.

  Attributes:
    source: the template text.
    origin: where it came from (a file path, or 'tokenizer_config.json:chat_template'), for error messages.
    special_tokens: the tokenizer's named special tokens passed to the template (`bos_token`, `eos_token`, ...).
  """

  source: str
  origin: str = '<string>'
  special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source.strip():
      raise ValueError(f'ChatTemplate.source must be a non-empty string, got {short_repr(self.source)}')
    try:
      _compile(self.source)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise ValueError(f'{self.origin}: not a valid jinja chat template (line {e.lineno}: {e.message})') from None

  def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False, where: str = '',
             **kwargs: Any) -> str:
    """The conversation as text (`apply_chat_template(..., tokenize=False)`); `kwargs` reach the template
    (e.g. `enable_thinking=False`) and override the special tokens. A template that raises gives a one-line
    `DataError` starting with `where`."""
    messages = validate_messages(list(messages), where or self.origin)
    variables = {**self.special_tokens, **kwargs}
    try:
      return _compile(self.source).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **variables)
    except Exception as e:  # a template is user code: any failure is the data's or the template's, not ours
      prefix = f'{where}: ' if where else ''
      raise DataError(f'{prefix}the chat template ({self.origin}) failed: {_one_line(e)}') from None


def read_chat_template(directory: str | os.PathLike[str],
                       tokenizer_config: Mapping[str, Any] | None = None) -> tuple[str, str] | None:
  """`(template text, origin)` of a checkpoint directory, in transformers 5's order: `chat_template.jinja`,
  `chat_template.json` (`{"chat_template": ...}`), then `tokenizer_config.json`'s `chat_template` (a string, or a
  list of `{"name", "template"}` from which 'default' is taken). None when there is none."""
  directory = os.fspath(directory)
  path = os.path.join(directory, CHAT_TEMPLATE_FILENAME)
  if os.path.isfile(path):
    try:
      with open(path, encoding='utf-8') as f:
        return f.read(), path
    except UnicodeDecodeError as e:
      raise CheckpointError(f'{path}: not valid UTF-8 (byte {e.start})') from None
  path = os.path.join(directory, CHAT_TEMPLATE_JSON_FILENAME)
  if os.path.isfile(path):
    found = _template_value(read_json(path).get('chat_template'), path)
    if found is not None:
      return found
  if tokenizer_config is not None:
    return _template_value(tokenizer_config.get('chat_template'),
                           os.path.join(directory, 'tokenizer_config.json') + ':chat_template')
  return None


def _template_value(value: Any, origin: str) -> tuple[str, str] | None:
  if isinstance(value, str) and value:
    return value, origin
  if isinstance(value, list):
    named = {t.get('name'): t.get('template') for t in value if isinstance(t, dict)}
    if isinstance(named.get('default'), str):
      return named['default'], f'{origin}[default]'
  return None


# ------------------------------------------------------------------------------------------ SFT split
TOKENIZER_CHAT_TEMPLATE = 'tokenizer'  # `chat_template` value: use the tokenizer's (checkpoint's) jinja template


def chat_template_kind(template: str | None) -> str | None:
  """None, 'tokenizer', 'format' (a Python format string whose field is `{prompt}`) or 'jinja' (anything else
  with `{{` or `{%`). A string that is neither is 'format' (and fails `SFTDataConfig`'s validation).
  Used by data.chat_template of the SFT data (data/sft.py) and the sampling CLI."""
  if template is None:
    return None
  if template == TOKENIZER_CHAT_TEMPLATE:
    return 'tokenizer'
  try:
    fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
  except ValueError:
    fields = None
  if fields == {'prompt'}:
    return 'format'
  return 'jinja' if ('{%' in template or '{{' in template) else 'format'


def format_prompt(template: str | None, prompt: str) -> str:
  """The prompt text of a prompt/completion record under a `{prompt}` format-string template (others: as is)."""
  return template.format(prompt=prompt) if chat_template_kind(template) == 'format' else prompt


@dataclasses.dataclass(frozen=True)
class ChatSplit:
  """A chat record as SFT text: the rendered prompt (generation prompt included) and the completion text (the
  final assistant turn with its end-of-turn markup), plus the raw last user and assistant texts (for evaluation)."""

  prompt: str
  completion: str
  last_user: str
  last_assistant: str


def split_chat(template: ChatTemplate, messages: Any, where: str, **kwargs: Any) -> ChatSplit:
  """Splits a conversation ending in an assistant message into prompt and completion text (module docstring).

  Raises a one-line `DataError` starting with `where` when the messages are malformed, the last message is not
  from the assistant, no user message precedes it, the template fails, or the template renders the history
  differently when the final turn follows (so no prompt/completion split exists).
  """
  messages = validate_messages(messages, where)
  if messages[-1]['role'] != 'assistant':
    raise DataError(f'{where}: the last message must be the assistant turn to train on, got role '
                    f'{messages[-1]["role"]!r}')
  history = messages[:-1]
  users = [m for m in history if m['role'] == 'user']
  if not users:
    raise DataError(f'{where}: no user message before the final assistant message')
  full = template.render(messages, where=where, **kwargs)
  context = template.render(history, where=where, **kwargs)
  prompt = template.render(history, add_generation_prompt=True, where=where, **kwargs)
  if not full.startswith(context) or not prompt.startswith(context):
    raise DataError(f'{where}: the chat template ({template.origin}) renders the earlier messages differently '
                    f'when the final assistant turn or the generation prompt follows; cannot split the record into '
                    f'prompt and completion')
  turn, header = full[len(context):], prompt[len(context):]
  shared = len(os.path.commonprefix([turn, header]))
  completion = turn[shared:]
  if not completion:
    raise DataError(f'{where}: the chat template ({template.origin}) renders the final assistant turn as nothing')
  return ChatSplit(prompt=prompt, completion=completion, last_user=message_text(users[-1]),
                   last_assistant=message_text(messages[-1]))


__all__ = ['CHAT_TEMPLATE_FILENAME', 'ChatSplit', 'ChatTemplate', 'IMAGE_PART_TYPE', 'Message', 'ROLES',
           'TOKENIZER_CHAT_TEMPLATE', 'chat_template_kind', 'format_prompt', 'image_parts', 'message_text',
           'read_chat_template', 'split_chat', 'validate_messages']
