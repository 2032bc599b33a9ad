"""JSONL prompt/completion records -> fixed-shape SFT batches for a block-diffusion model.

Each JSONL line is an object with a prompt and a completion string. All records are tokenized once at
load time (the datasets this targets are small: up to a few hundred thousand short records) into
fixed-size numpy arrays:

* prompt: `[bos] + tokens(chat_template.format(prompt=...))`, LEFT-padded to `max_prompt_length`
  (the model takes left-padded prompts with a 2-D attention mask, see DESIGN §2);
* completion: `tokens(completion) + [eos]`, RIGHT-padded to `max_canvases * canvas_length`; the
  training step cuts it into canvases and picks one valid canvas per example (REFERENCE §3).

Batching goes through grain: `MapDataset.range(n).shuffle(seed).repeat(num_epochs).batch(B)`, so
the order is a pure function of the seed, and the iterator state is a small JSON-serialisable dict
(`{'next_index': k}`) that the trainer stores next to its orbax checkpoint to resume exactly.
Epochs are joined before batching: with `num_epochs=None` no record is ever dropped and a batch can
straddle two epochs (each epoch is a fresh permutation).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import DataError
from hackable_diffusion.files import iter_jsonl


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
  """Where the SFT data is and how to shape it.

  Attributes:
    path: one JSONL path or a sequence of paths (read in order, concatenated).
    prompt_field / completion_field: the JSON keys holding the two strings.
    chat_template: None, or a Python format string with a `{prompt}` placeholder applied to the
      prompt text before tokenizing (e.g. '<start_of_turn>user\\n{prompt}<end_of_turn>\\n...').
    max_prompt_length: P, prompt tokens after left padding (bos included when `add_bos`).
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
  """

  path: str | Sequence[str]
  prompt_field: str = 'prompt'
  completion_field: str = 'completion'
  chat_template: str | None = None
  max_prompt_length: int
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

  def __post_init__(self):
    paths = (self.path,) if isinstance(self.path, (str, os.PathLike)) else tuple(self.path)
    if not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
      raise ValueError(f'path must be a path or a non-empty sequence of paths, got {self.path!r}')
    object.__setattr__(self, 'path', paths[0] if len(paths) == 1 else paths)
    for name in ('prompt_field', 'completion_field'):
      v = getattr(self, name)
      if not isinstance(v, str) or not v:
        raise ValueError(f'{name} must be a non-empty string, got {v!r}')
    if self.chat_template is not None:
      if not isinstance(self.chat_template, str):
        raise ValueError(f'chat_template must be a string or None, got {self.chat_template!r}')
      try:
        self.chat_template.format(prompt='x')
      except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f'chat_template must be a format string whose only field is {{prompt}}, '
                         f'got {self.chat_template!r} ({type(e).__name__}: {e})') from e
      if '{prompt}' not in self.chat_template:
        raise ValueError(f'chat_template must contain {{prompt}}, got {self.chat_template!r}')
    for name in ('max_prompt_length', 'canvas_length', 'max_canvases', 'batch_size'):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f'{name} must be a positive integer, got {v!r}')
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

  @property
  def paths(self) -> tuple[str, ...]:
    return tuple(map(os.fspath, (self.path,) if isinstance(self.path, (str, os.PathLike))
                     else self.path))

  @property
  def completion_capacity(self) -> int:
    """N * C: completion tokens per example (eos included)."""
    return self.max_canvases * self.canvas_length


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
  completion tokens, eos included).
  """

  prompt_ids: Any
  prompt_mask: Any
  completion_ids: Any
  completion_mask: Any
  completion_pinned: Any = None  # optional [B, N*C] bool: tokens known at sampling time (infilling)

  def num_valid_canvases(self, canvas_length: int):
    """[B] int32: canvases holding at least one completion token (at least 1)."""
    return num_valid_canvases(self.completion_mask, canvas_length)


# ------------------------------------------------------------------------------------------ records
@dataclasses.dataclass(frozen=True)
class SFTRecords:
  """All records of a dataset, tokenized: arrays of R rows plus the raw texts (for evaluation).

  `sources[i]` is `(file, line_number)` of record i; `stats` counts skipped/truncated records.
  """

  prompt_ids: np.ndarray        # [R, P] int32, left-padded
  prompt_lengths: np.ndarray    # [R] int32
  completion_ids: np.ndarray    # [R, N*C] int32, right-padded
  completion_lengths: np.ndarray  # [R] int32 (eos included)
  prompts: list[str]            # raw prompt texts (before the chat template)
  completions: list[str]        # raw completion texts
  sources: list[tuple[str, int]]
  stats: dict[str, int]
  completion_pinned: np.ndarray | None = None  # [R, N*C] bool when `pinned_field` is set

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
    )

  def select(self, indices) -> 'SFTRecords':
    """A subset of the records (e.g. one host's shard)."""
    idx = np.asarray(indices, dtype=np.int64)
    return dataclasses.replace(
        self,
        prompt_ids=self.prompt_ids[idx], prompt_lengths=self.prompt_lengths[idx],
        completion_ids=self.completion_ids[idx], completion_lengths=self.completion_lengths[idx],
        completion_pinned=None if self.completion_pinned is None else self.completion_pinned[idx],
        prompts=[self.prompts[i] for i in idx], completions=[self.completions[i] for i in idx],
        sources=[self.sources[i] for i in idx])


def _left_mask(lengths: np.ndarray, width: int) -> np.ndarray:
  return np.arange(width)[None, :] >= (width - lengths)[:, None]


def _right_mask(lengths: np.ndarray, width: int) -> np.ndarray:
  return np.arange(width)[None, :] < lengths[:, None]


def _short(value: Any, limit: int = 60) -> str:
  r = repr(value)  # repr escapes newlines, keeping messages on one line
  return r if len(r) <= limit else r[:limit] + '...'


@dataclasses.dataclass(frozen=True)
class TextRecord:
  """One JSONL record before tokenization: the two strings, the pinned mask string, where it came from, and every
  other JSON field (e.g. Sudoku's `givens`)."""

  prompt: str
  completion: str
  pinned: str | None
  source: tuple[str, int]  # (file, line number)
  fields: Mapping[str, Any]


def read_records(path: str, *, prompt_field: str = 'prompt', completion_field: str = 'completion',
                 pinned_field: str | None = None, on_malformed: str = 'error',
                 stats: dict[str, int] | None = None) -> list[TextRecord]:
  """The records of one JSONL file (the project's one reader of SFT data: training, tokenizer training, evaluation).

  A line that is not valid UTF-8 / JSON, not an object, or lacks a string field raises a one-line `DataError`
  naming file and line (`on_malformed='error'`) or is skipped and counted in `stats['skipped_malformed']`.
  """
  out = []
  for lineno, obj, problem in iter_jsonl(path, error=DataError):
    if problem is None:
      if not isinstance(obj, dict):
        problem = f'expected a JSON object, got {type(obj).__name__}'
      else:
        for field in (prompt_field, completion_field):
          if field not in obj:
            problem = (f'missing field {field!r} (keys: {_short(sorted(obj))}; set '
                       f'prompt_field/completion_field if the data uses other names)')
            break
          if not isinstance(obj[field], str):
            problem = f'field {field!r} must be a string, got {type(obj[field]).__name__} {_short(obj[field])}'
            break
        if problem is None and pinned_field is not None:
          pin = obj.get(pinned_field)
          if not isinstance(pin, str) or set(pin) - {'0', '1'}:
            problem = f"field {pinned_field!r} (pinned_field) must be a string of '0'/'1', got {_short(pin)}"
    if problem is not None:
      if on_malformed == 'error':
        raise DataError(f"{path}:{lineno}: {problem}; set on_malformed='skip' to skip such lines")
      if stats is not None:
        stats['skipped_malformed'] = stats.get('skipped_malformed', 0) + 1
      continue
    extra = {k: v for k, v in obj.items() if k not in (prompt_field, completion_field)}
    out.append(TextRecord(prompt=obj[prompt_field], completion=obj[completion_field],
                          pinned=obj[pinned_field] if pinned_field is not None else None,
                          source=(os.fspath(path), lineno), fields=extra))
  return out


def load_records(path: str | Sequence[str] | None, config: SFTDataConfig,
                 tokenizer: Tokenizer) -> SFTRecords:
  """Reads and tokenizes every record of `path` (default: `config.path`) into an `SFTRecords`.

  Raises `DataError` (one line, naming file and line) for a missing or empty file, and, depending
  on `config.on_malformed` / `config.on_overlength`, for malformed or over-long records.
  """
  if path is not None:
    config = dataclasses.replace(config, path=path)
  stats = {'skipped_malformed': 0, 'truncated_prompts': 0, 'truncated_completions': 0}
  prompts, completions, sources, pins = [], [], [], []
  for p in config.paths:
    read = read_records(p, prompt_field=config.prompt_field, completion_field=config.completion_field,
                        pinned_field=config.pinned_field, on_malformed=config.on_malformed, stats=stats)
    if not read:
      what = 'no records' if not stats['skipped_malformed'] else 'no valid records'
      raise DataError(f'{p}: {what} (empty file or only blank/skipped lines)')
    prompts += [r.prompt for r in read]
    completions += [r.completion for r in read]
    pins += [r.pinned for r in read]
    sources += [r.source for r in read]

  template = config.chat_template
  formatted = [template.format(prompt=t) for t in prompts] if template else prompts
  prompt_tokens = tokenizer.encode_batch(formatted)
  completion_tokens = tokenizer.encode_batch(completions)

  num = len(prompts)
  P, cap = config.max_prompt_length, config.completion_capacity
  pad = tokenizer.pad_id
  if pad < 0:
    raise ValueError('the tokenizer has no pad id; SFT batches need one')
  if (config.add_bos and tokenizer.bos_id < 0) or (config.append_eos and tokenizer.eos_id < 0):
    raise ValueError('add_bos/append_eos need a tokenizer with bos/eos ids')
  prompt_ids = np.full((num, P), pad, np.int32)
  completion_ids = np.full((num, cap), pad, np.int32)
  prompt_lengths = np.zeros((num,), np.int32)
  completion_lengths = np.zeros((num,), np.int32)
  completion_pinned = np.zeros((num, cap), bool) if config.pinned_field is not None else None
  truncate = config.on_overlength == 'truncate'
  for i, (pt, ct) in enumerate(zip(prompt_tokens, completion_tokens)):
    if completion_pinned is not None:
      if len(pins[i]) != len(ct):
        f, n = sources[i]
        raise DataError(f'{f}:{n}: {config.pinned_field!r} has {len(pins[i])} entries but the completion has '
                        f'{len(ct)} tokens (one 0/1 per completion token, eos excluded)')
      width = min(len(ct), cap)
      completion_pinned[i, :width] = np.frombuffer(pins[i].encode(), np.uint8)[:width] == ord('1')
    if config.add_bos:
      pt = [tokenizer.bos_id] + pt
    if config.append_eos:
      ct = ct + [tokenizer.eos_id]
    if len(pt) > P:
      if not truncate:
        f, n = sources[i]
        raise DataError(
            f'{f}:{n}: prompt is {len(pt)} tokens, longer than max_prompt_length={P}; raise '
            f"max_prompt_length or set on_overlength='truncate'")
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
    if pt:
      prompt_ids[i, P - len(pt):] = pt
    completion_ids[i, :len(ct)] = ct
    prompt_lengths[i] = len(pt)
    completion_lengths[i] = len(ct)

  msg = (f'SFT data {", ".join(config.paths)}: {num} records; skipped_malformed='
         f'{stats["skipped_malformed"]}, truncated_prompts={stats["truncated_prompts"]}, '
         f'truncated_completions={stats["truncated_completions"]}')
  (logging.warning if any(stats.values()) else logging.info)(msg)
  return SFTRecords(prompt_ids=prompt_ids, prompt_lengths=prompt_lengths,
                    completion_ids=completion_ids, completion_lengths=completion_lengths,
                    prompts=prompts, completions=completions, sources=sources, stats=stats,
                    completion_pinned=completion_pinned)


# ------------------------------------------------------------------------------------------ dataset
class SFTDataset:
  """Records of one host's shard + a deterministic, resumable grain pipeline over them.

  `iterator()` gives `SFTBatch`es; the iterator's `get_state()` is a JSON-serialisable dict and
  `set_state(state)` (or `iterator(state)`) resumes exactly after the last batch it had produced.
  """

  def __init__(self, records: SFTRecords, config: SFTDataConfig, *, total_records: int):
    self.records = records
    self.config = config
    self.total_records = total_records
    ds = grain.MapDataset.range(len(records))
    if config.shuffle:
      ds = ds.shuffle(seed=config.seed)
    if config.num_epochs != 1:
      ds = ds.repeat(config.num_epochs)
    ds = ds.batch(config.batch_size, drop_remainder=config.drop_remainder)
    self._map_dataset = ds.map(records.batch)

  @property
  def num_records(self) -> int:
    """Records in this shard."""
    return len(self.records)

  @property
  def stats(self) -> dict[str, int]:
    return dict(self.records.stats)

  @property
  def num_batches(self) -> int | None:
    """Batches in the whole pass, or None when repeating forever."""
    return None if self.config.num_epochs is None else len(self._map_dataset)

  def __getitem__(self, step: int) -> SFTBatch:
    """Random access: the batch the iterator yields at position `step`."""
    return self._map_dataset[step]

  def iterator(self, state: Mapping[str, Any] | None = None) -> grain.DatasetIterator:
    """A fresh iterator over SFTBatch (optionally restored from `get_state()` output)."""
    threads = 1 if self.config.prefetch_batches else 0
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=self.config.prefetch_batches)
    it = iter(self._map_dataset.to_iter_dataset(read))
    if state is not None:
      it.set_state(dict(state))
    return it

  def __iter__(self) -> Iterator[SFTBatch]:
    return self.iterator()


def make_sft_dataset(config: SFTDataConfig, tokenizer: Tokenizer, *, shard_index: int = 0,
                     shard_count: int = 1) -> SFTDataset:
  """Loads `config.path`, keeps this host's shard, and builds the batching pipeline.

  Sharding: host `shard_index` of `shard_count` takes records `shard_index::shard_count`, cut to
  `len // shard_count` so every host has the same number of records (and so of steps); at most
  `shard_count - 1` records are left out.
  """
  if not (isinstance(shard_count, int) and shard_count >= 1):
    raise ValueError(f'shard_count must be a positive integer, got {shard_count!r}')
  if not (isinstance(shard_index, int) and 0 <= shard_index < shard_count):
    raise ValueError(f'shard_index must be in [0, {shard_count}), got {shard_index!r}')
  records = load_records(None, config, tokenizer)
  total = len(records)
  per_shard = total // shard_count
  if per_shard == 0:
    raise DataError(f'{", ".join(config.paths)}: {total} records cannot fill {shard_count} shards')
  if shard_count > 1:
    records = records.select(np.arange(shard_index, total, shard_count)[:per_shard])
  dataset = SFTDataset(records, config, total_records=total)
  if dataset.num_batches == 0:
    raise DataError(
        f'{", ".join(config.paths)}: batch_size={config.batch_size} with drop_remainder=True and '
        f'num_epochs={config.num_epochs} gives no batch from {per_shard} records per shard; lower '
        f'batch_size, raise num_epochs, or set drop_remainder=False')
  return dataset
