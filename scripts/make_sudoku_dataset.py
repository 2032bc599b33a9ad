r"""Writes a Sudoku SFT dataset: train.jsonl, validation.jsonl, test.jsonl.

  python scripts/make_sudoku_dataset.py --out_dir=data/sudoku --num_train=100000 \
      --num_validation=1000 --num_test=1000 --seed=0 --workers=2

Each line is {"prompt": <81 chars, '0' = blank>, "completion": <81 digits>, "givens": int}. A thin
wrapper over `hackable_diffusion.tasks.sudoku.write_dataset`.
"""

from __future__ import annotations

import os

from absl import app, flags

from hackable_diffusion.tasks import sudoku

_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Directory for the three JSONL files.', required=True)
_NUM_TRAIN = flags.DEFINE_integer('num_train', 100_000, 'Training puzzles.', lower_bound=0)
_NUM_VALIDATION = flags.DEFINE_integer('num_validation', 1_000, 'Validation puzzles.', lower_bound=0)
_NUM_TEST = flags.DEFINE_integer('num_test', 1_000, 'Test puzzles.', lower_bound=0)
_SEED = flags.DEFINE_integer('seed', 0, 'Dataset seed.', lower_bound=0)
_WORKERS = flags.DEFINE_integer('workers', os.cpu_count() or 1, 'Generator processes.', lower_bound=1)
_EASY_WEIGHT = flags.DEFINE_float('easy_weight', 1.0, 'Share of easy puzzles (>= 40 givens).', lower_bound=0)
_MEDIUM_WEIGHT = flags.DEFINE_float('medium_weight', 1.0, 'Share of medium puzzles (30-39).', lower_bound=0)
_HARD_WEIGHT = flags.DEFINE_float('hard_weight', 1.0, 'Share of hard puzzles (< 30 givens).', lower_bound=0)
_EASY_GIVENS = flags.DEFINE_list('easy_givens', ['40', '50'], 'Target givens range lo,hi for easy.')
_MEDIUM_GIVENS = flags.DEFINE_list('medium_givens', ['30', '39'], 'Target givens range lo,hi for medium.')
_HARD_GIVENS = flags.DEFINE_list('hard_givens', ['22', '29'], 'Target givens range lo,hi for hard.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace existing split files.')


def _givens_range(flag: flags.FlagHolder) -> tuple[int, int]:
  values = flag.value
  if len(values) != 2:
    raise app.UsageError(f'--{flag.name} needs two comma-separated ints lo,hi, got {values}')
  try:
    return int(values[0]), int(values[1])
  except ValueError as e:
    raise app.UsageError(f'--{flag.name} needs two comma-separated ints lo,hi, got {values}') from e


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  try:
    config = sudoku.GeneratorConfig(
        easy_givens=_givens_range(_EASY_GIVENS),
        medium_givens=_givens_range(_MEDIUM_GIVENS),
        hard_givens=_givens_range(_HARD_GIVENS),
    )
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  bucket_weights = {'easy': _EASY_WEIGHT.value, 'medium': _MEDIUM_WEIGHT.value, 'hard': _HARD_WEIGHT.value}
  try:
    paths = sudoku.write_dataset(
        _OUT_DIR.value,
        num_train=_NUM_TRAIN.value,
        num_validation=_NUM_VALIDATION.value,
        num_test=_NUM_TEST.value,
        seed=_SEED.value,
        bucket_weights=bucket_weights,
        config=config,
        workers=_WORKERS.value,
        overwrite=_OVERWRITE.value,
    )
  except (FileExistsError, ValueError) as e:
    raise app.UsageError(str(e)) from e
  for split, path in paths.items():
    print(f'{split}: {path}')


if __name__ == '__main__':
  app.run(main)
