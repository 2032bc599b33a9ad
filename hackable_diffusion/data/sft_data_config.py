"""`SFTDataConfig`: where the SFT data is and how it is read, tokenized and batched, validated when it is built.

The readers are data/text_records.py (JSONL lines), data/sft_records.py (tokenized, padded arrays) and
data/sft.py (the grain batching pipeline).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from hackable_diffusion.data.chat import ChatTemplate, chat_template_kind, short_repr
from hackable_diffusion.data.images import ImageProcessorConfig

AUTO_MAX_IMAGES = -1  # `max_images`: the most images any record has


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
  """Where the SFT data is and how to shape it.

  Attributes:
    path: one JSONL path or a sequence of paths (read in order, concatenated).
    prompt_field / completion_field: the JSON keys holding the two strings.
    messages_field: the JSON key holding a chat record's list of messages (used when a line lacks the
      prompt/completion fields).
    chat_template: None; a Python format string with a `{prompt}` placeholder applied to the prompt text of
      prompt/completion records (e.g. '<|turn>user\\n{prompt}<turn|>\\n<|turn>model\\n'); a jinja chat template
      (as in a checkpoint's chat_template.jinja); or 'tokenizer' for the tokenizer's own chat template. Chat
      records always use a jinja template: this one when it is jinja, else the tokenizer's.
    max_prompt_length: P, prompt tokens after left padding (bos included when `add_bos`).
    min_prompt_length: a shorter prompt is an error naming its file and line (0: any length). A model whose
      attention structure reads the first W prompt slots (e.g. a Sudoku grid) needs W real tokens there: the
      trainer and the evaluation set W (`model.structure.prompt_width`).
    canvas_length: C, tokens per canvas (block).
    max_canvases: N; the completion capacity is N * C tokens (eos included when `append_eos`).
    append_eos / add_bos: add eos after the completion / bos before the prompt.
    on_overlength: 'error' (default) or 'truncate'. Truncation keeps the END of a prompt (where
      the chat template's generation cue is) and the START of a completion; a truncated completion
      carries no eos (it did not end there).
    on_malformed: 'error' (default) or 'skip' for lines that are not valid UTF-8 / JSON objects
      with both string fields. Blank lines are always ignored.
    batch_size, shuffle, seed, num_epochs (None = repeat forever), drop_remainder: batching.
    prefetch_batches: batches prepared ahead by one background thread (0 = none).
    pinned_field: optional JSON key of a string of '0'/'1' (one per completion token, eos excluded)
      marking completion tokens known at sampling time (infilling, e.g. Sudoku givens). Pinned tokens
      are never corrupted in training and are left out of the diffusion loss; the sampler pins them.
    max_images: images per example in a batch (chat records whose user turns hold `{"type": "image", "path": ...}`
      parts, data/sft_images.py): -1 = the most any record has (0 for text-only data); a record with fewer is
      padded with empty images (no soft tokens), one with more is an error.
    image_processor: how images become patches (the checkpoint's `processor_config.json`; None = the released
      checkpoints' settings).
  """

  path: str | Sequence[str]
  prompt_field: str = 'prompt'
  completion_field: str = 'completion'
  messages_field: str = 'messages'
  chat_template: str | None = None
  max_prompt_length: int
  min_prompt_length: int = 0
  canvas_length: int
  max_canvases: int = 1
  append_eos: bool = True
  add_bos: bool = False
  on_overlength: str = 'error'
  on_malformed: str = 'error'
  batch_size: int
  shuffle: bool = True
  seed: int = 0
  num_epochs: int | None = None
  drop_remainder: bool = True
  prefetch_batches: int = 2
  pinned_field: str | None = None
  max_images: int = AUTO_MAX_IMAGES
  image_processor: ImageProcessorConfig | None = None

  def __post_init__(self):
    paths = (self.path,) if isinstance(self.path, (str, os.PathLike)) else tuple(self.path)
    if not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
      raise ValueError(f'path must be a path or a non-empty sequence of paths, got {self.path!r}')
    object.__setattr__(self, 'path', paths[0] if len(paths) == 1 else paths)
    for name in ('prompt_field', 'completion_field', 'messages_field'):
      v = getattr(self, name)
      if not isinstance(v, str) or not v:
        raise ValueError(f'{name} must be a non-empty string, got {v!r}')
    if self.chat_template is not None:
      if not isinstance(self.chat_template, str):
        raise ValueError(f'chat_template must be a string or None, got {self.chat_template!r}')
      kind = self.chat_template_kind
      if kind == 'jinja':
        try:
          ChatTemplate(source=self.chat_template, origin='chat_template')
        except ValueError as e:
          raise ValueError(f'{e}; got {short_repr(self.chat_template)}') from None
      elif kind == 'format':
        try:
          self.chat_template.format(prompt='x')
        except (KeyError, IndexError, ValueError) as e:
          raise ValueError(f'chat_template must be a format string whose only field is {{prompt}}, a jinja '
                           f"template or 'tokenizer', got {self.chat_template!r} ({type(e).__name__}: {e})") from e
        if '{prompt}' not in self.chat_template:
          raise ValueError(f"chat_template must contain {{prompt}} (or be a jinja template or 'tokenizer'), got "
                           f'{self.chat_template!r}')
    for name in ('max_prompt_length', 'canvas_length', 'max_canvases', 'batch_size'):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f'{name} must be a positive integer, got {v!r}')
    if isinstance(self.min_prompt_length, bool) or not isinstance(self.min_prompt_length, int) or not (
        0 <= self.min_prompt_length <= self.max_prompt_length):
      raise ValueError(f'min_prompt_length must be an integer in [0, max_prompt_length={self.max_prompt_length}], '
                       f'got {self.min_prompt_length!r}')
    if self.prefetch_batches < 0:
      raise ValueError(f'prefetch_batches must be >= 0, got {self.prefetch_batches!r}')
    if self.on_overlength not in ('error', 'truncate'):
      raise ValueError(f"on_overlength must be 'error' or 'truncate', got {self.on_overlength!r}")
    if self.on_malformed not in ('error', 'skip'):
      raise ValueError(f"on_malformed must be 'error' or 'skip', got {self.on_malformed!r}")
    if self.num_epochs is not None and (isinstance(self.num_epochs, bool) or
                                        not isinstance(self.num_epochs, int) or self.num_epochs < 1):
      raise ValueError(f'num_epochs must be a positive integer or None, got {self.num_epochs!r}')
    if not isinstance(self.seed, int) or isinstance(self.seed, bool):
      raise ValueError(f'seed must be an integer, got {self.seed!r}')
    if isinstance(self.max_images, bool) or not isinstance(self.max_images, int) or self.max_images < AUTO_MAX_IMAGES:
      raise ValueError(f'max_images must be an integer >= 0, or -1 for the most images of any record, got '
                       f'{self.max_images!r}')
    if self.image_processor is not None and not isinstance(self.image_processor, ImageProcessorConfig):
      raise ValueError(f'image_processor must be an ImageProcessorConfig or None, got '
                       f'{type(self.image_processor).__name__}')

  @property
  def chat_template_kind(self) -> str | None:
    """None, 'format' (a `{prompt}` format string), 'jinja' or 'tokenizer' (the tokenizer's chat template)."""
    return chat_template_kind(self.chat_template)

  @property
  def paths(self) -> tuple[str, ...]:
    return tuple(map(os.fspath, (self.path,) if isinstance(self.path, (str, os.PathLike))
                     else self.path))

  @property
  def completion_capacity(self) -> int:
    """N * C: completion tokens per example (eos included)."""
    return self.max_canvases * self.canvas_length
