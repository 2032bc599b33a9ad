"""Sudoku with the pure DiffusionGemma architecture (no task attention structure): exportable to transformers/vLLM.

  python -m hackable_diffusion.train --config=configs/sudoku_pure.py --workdir=runs/sudoku_pure
  python -m hackable_diffusion.export --workdir=runs/sudoku_pure --out=exported/sudoku --format=merged

Same data (training mix 30% easy / 70% medium), recipe and steps as configs/sudoku.py; `attention_structure`
differs (None: the model has to discover the row/column/box structure itself), the model keeps the preset's 4 heads
(configs/sudoku.py's two extra heads serve its own-cell structure, which an exportable model cannot have) and the
sampler keeps the default schedule. For comparing the structured model with the exportable one; results in
docs/sudoku.md.
"""

import ml_collections

from hackable_diffusion.configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.preset = "sudoku"  # hidden 128, 4 layers (2 sliding + 2 full), 4 heads, 4 experts top-2
  config.model.overrides = ml_collections.ConfigDict(dict(canvas_length=81, attention_structure=None))
  base.sudoku_task(config, num_train=30_000, train_easy=0.3, train_medium=0.7, train_hard=0.0)
  config.train.steps = 2200  # as configs/sudoku.py
  return config
