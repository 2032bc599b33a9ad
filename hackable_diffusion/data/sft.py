"""JSONL prompt/completion or chat records -> fixed-shape SFT batches for a block-diffusion model: the grain
batching pipeline (`SFTDataset`, `make_sft_dataset`).

The stages have their own modules, and their public names are re-exported here: data/sft_data_config.py
(`SFTDataConfig`), data/text_records.py (`read_records`: JSONL lines -> `TextRecord`s, prompt/completion or chat),
data/sft_records.py (`load_records`: records -> the padded token arrays of `SFTRecords`; `SFTBatch`),
data/sft_images.py (the images of chat records: read and preprocessed per batch in the grain map, each example padded
to `max_images` images).

Batching goes through grain: `MapDataset.range(n).shuffle(seed).repeat(num_epochs).batch(B)`, so
the order is a pure function of the seed, and the iterator state is a small JSON-serialisable dict
(`{'next_index': k}`) that the trainer stores next to its orbax checkpoint to resume exactly.
Epochs are joined before batching: with `num_epochs=None` no record is ever dropped and a batch can
straddle two epochs (each epoch is a fresh permutation).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import grain
import numpy as np

from hackable_diffusion.data.chat import chat_template_kind, format_prompt
from hackable_diffusion.data.sft_data_config import SFTDataConfig
from hackable_diffusion.data.sft_records import SFTBatch, SFTRecords, load_records, num_valid_canvases
from hackable_diffusion.data.text_records import TextRecord, read_records
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import DataError

__all__ = [
    'DataError', 'SFTBatch', 'SFTDataConfig', 'SFTDataset', 'SFTRecords', 'TextRecord', 'chat_template_kind',
    'format_prompt', 'load_records', 'make_sft_dataset', 'num_valid_canvases', 'read_records',
]


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
