"""Sudoku SFT data on disk: ``train.jsonl``, ``validation.jsonl``, ``test.jsonl``.

Each line is ``{"prompt": <81 chars, '0' = blank>, "completion": <81 digits>, "givens": int, "pinned": <81 0/1>}``
(``pinned`` marks the givens: the data pipeline's ``pinned_field`` for infilling-style training), the
format `hackable_diffusion.data.sft` reads. Each split has its own seed derived from ``(seed, split)``,
so the validation and test puzzles do not change when ``num_train`` does; splits are disjoint (a puzzle
already in test, then validation, is redrawn in the later split). Files are written to temporary names
and renamed at the end, so an interrupted run leaves no partial file.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tqdm

from hackable_diffusion.files import write_atomic
from hackable_diffusion.tasks.sudoku import formatting, generator

__all__ = ['SPLITS', 'dataset_paths', 'ensure_dataset', 'split_seed', 'write_dataset']

SPLITS = ('train', 'validation', 'test')
_DEDUPE_ORDER = ('test', 'validation', 'train')  # earlier splits keep a puzzle that repeats later
_MAX_REDRAW_ROUNDS = 100


def dataset_paths(out_dir: str | os.PathLike[str]) -> dict[str, pathlib.Path]:
  """``{split: out_dir/<split>.jsonl}``."""
  root = pathlib.Path(out_dir)
  return {split: root / f'{split}.jsonl' for split in SPLITS}


def split_seed(seed: int, split: str) -> int:
  """The generator seed of one split, derived from the dataset seed."""
  state = np.random.SeedSequence([seed, SPLITS.index(split)]).generate_state(1, dtype=np.uint64)
  return int(state[0])


def write_dataset(
    out_dir: str | os.PathLike[str],
    *,
    num_train: int,
    num_validation: int,
    num_test: int,
    seed: int = 0,
    bucket_weights: Mapping[str, float] | None = None,
    train_bucket_weights: Mapping[str, float] | None = None,
    config: generator.GeneratorConfig = generator.GeneratorConfig(),
    workers: int = 1,
    chunk_size: int = 64,
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict[str, pathlib.Path]:
  """Generates the three splits and writes them as JSONL; returns ``{split: path}``.

  Args:
    out_dir: created if missing.
    num_train, num_validation, num_test: puzzles per split (0 writes an empty file).
    seed: dataset seed; the output is a pure function of the arguments except ``workers`` and
      ``show_progress``.
    bucket_weights: difficulty mix, e.g. ``{'easy': 1, 'medium': 1, 'hard': 2}`` (default equal);
      every split gets exact counts (see `generator.assign_buckets`).
    train_bucket_weights: the training split's own mix (default ``bucket_weights``); validation and test keep
      ``bucket_weights``, so a training curriculum does not change what is measured.
    config: givens range per bucket.
    workers: generator processes.
    chunk_size: puzzles per task sent to a worker.
    overwrite: replace existing files; otherwise any existing split file raises `FileExistsError`.
    show_progress: tqdm progress bar.
  """
  counts = {'train': num_train, 'validation': num_validation, 'test': num_test}
  for split, n in counts.items():
    if n < 0:
      raise ValueError(f'num_{split} must be >= 0, got {n}')
  paths = dataset_paths(out_dir)
  existing = [str(p) for p in paths.values() if p.exists()]
  if existing and not overwrite:
    raise FileExistsError(f'refusing to overwrite {existing}; pass overwrite=True (--overwrite)')
  pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)

  seen: set[str] = set()
  tmp_paths = {split: p.with_name(f'{p.name}.tmp-{os.getpid()}') for split, p in paths.items()}
  try:
    with tqdm.tqdm(total=sum(counts.values()), unit='puzzle', disable=not show_progress) as bar:
      for split in _DEDUPE_ORDER:
        bar.set_description(split)
        data = _generate_split(
            counts[split],
            seed=split_seed(seed, split),
            seen=seen,
            bucket_weights=(train_bucket_weights if split == 'train' and train_bucket_weights is not None
                            else bucket_weights),
            config=config,
            workers=workers,
            chunk_size=chunk_size,
            progress=bar.update,
        )
        _write_jsonl(tmp_paths[split], data)
    for split in SPLITS:
      os.replace(tmp_paths[split], paths[split])
  finally:
    for tmp in tmp_paths.values():
      tmp.unlink(missing_ok=True)
  return paths


def ensure_dataset(out_dir: str | os.PathLike[str], **kwargs) -> dict[str, pathlib.Path]:
  """Returns the split paths, writing them with `write_dataset(out_dir, **kwargs)` if none exist.

  Existing files are used as they are (their generation arguments are not checked). Some but not all
  split files present raises `FileExistsError`.
  """
  paths = dataset_paths(out_dir)
  present = [p.exists() for p in paths.values()]
  if all(present):
    return paths
  if any(present):
    missing = [str(p) for p, ok in zip(paths.values(), present) if not ok]
    raise FileExistsError(f'{out_dir} holds an incomplete Sudoku dataset (missing {missing}); delete it')
  return write_dataset(out_dir, **kwargs)


def _generate_split(
    n: int,
    *,
    seed: int,
    seen: set[str],
    bucket_weights: Mapping[str, float] | None,
    config: generator.GeneratorConfig,
    workers: int,
    chunk_size: int,
    progress: Callable[[int], object],
) -> generator.SudokuDataset:
  """``n`` puzzles whose prompts are not in ``seen`` (nor repeated); adds them to ``seen``."""
  data = generator.generate_dataset(
      n,
      seed=seed,
      bucket_weights=bucket_weights,
      config=config,
      workers=workers,
      chunk_size=chunk_size,
      progress=progress,
  )
  puzzles, solutions = data.puzzles.copy(), data.solutions.copy()
  buckets = data.buckets
  next_index = n
  todo = _claim(puzzles, range(n), seen)
  # Redraw repeats in the same bucket, from indices past the split's own.
  for _ in range(_MAX_REDRAW_ROUNDS):
    if not todo:
      break
    extra = generator.generate_bucketed(
        [buckets[k] for k in todo],
        seed=seed,
        start_index=next_index,
        config=config,
        workers=workers,
        chunk_size=chunk_size,
    )
    next_index += len(todo)
    puzzles[todo] = extra.puzzles
    solutions[todo] = extra.solutions
    todo = _claim(puzzles, todo, seen)
  if todo:
    raise RuntimeError(f'{len(todo)} puzzles still repeat after {_MAX_REDRAW_ROUNDS} redraws')
  givens = np.count_nonzero(puzzles, axis=1).astype(np.int32)
  return generator.SudokuDataset(puzzles=puzzles, solutions=solutions, givens=givens)


def _claim(puzzles: np.ndarray, rows: Sequence[int], seen: set[str]) -> list[int]:
  """Adds the prompts of ``rows`` to ``seen``; returns the rows whose prompt was already there."""
  repeats = []
  for k in rows:
    prompt = formatting.puzzle_to_prompt(puzzles[k])
    if prompt in seen:
      repeats.append(k)
    else:
      seen.add(prompt)
  return repeats


def _write_jsonl(path: pathlib.Path, data: generator.SudokuDataset) -> None:
  """One JSON record per puzzle, written atomically and never through a symbolic link (`files.write_atomic`)."""
  write_atomic(path, ''.join(json.dumps(formatting.to_record(puzzle, solution)) + '\n'
                             for puzzle, solution in zip(data.puzzles, data.solutions)))
