"""Main job: a standard DiffusionGemma trained from scratch on a CPU to solve Sudoku, exportable as it is.

  python -m hackable_diffusion.train --config=configs/sudoku.py            # workdir defaults to runs/sudoku
  python -m hackable_diffusion.export --workdir=runs/sudoku --out=exported/sudoku --format=merged

Generates 30k unique-solution training puzzles (30% easy >= 40 givens, 70% medium 30-39; the validation and test
splits half and half) into workdir/data on first use, trains a char tokenizer on them, trains the scaled-down
DiffusionGemma (`sudoku` preset: 4 layers, hidden 128, 4 heads, 4 experts top-2; ~1.5M parameters) for 2,200 steps
of 32 puzzles with the SFT recipe (uniform corruption, flat CE, self-conditioning) and evaluates on 300 held-out
test puzzles at 8/16/32 denoising steps and with early stopping (step cap 32). Results: docs/results.md.

The architecture is the one transformers and vLLM run (no attention structure, standard heads); what makes it learn
on a CPU is the text it reads and one RoPE setting:
- the prompt is the cell-identity prompt (`tasks/sudoku/cell_prompt.py`): the data keep the 81-digit puzzle, the
  chat template `CELL_TEMPLATE` turns each cell into one character naming the cell and its content, so cells find
  their row, column and box peers by content; the template is saved with the tokenizer and exported;
- RoPE base 300 on every layer (`rope_type='default'`): rotations with periods near 9, 27 and 81 positions (the
  row length, three rows, the grid), so the fixed offset from a canvas cell to its own prompt cell is easy to learn;
- the givens are pinned (`data.pinned_field`): never corrupted in training, fixed at sampling (infilling).
configs/sudoku_structured.py is the research variant with a task attention structure, which cannot be exported.
"""

import ml_collections

from hackable_diffusion.configs import base

STEPS = 2200
ROPE_THETA = 300.0  # the RoPE base of every layer: frequencies 300**(-2k/32) include ~2pi/9, ~2pi/27, ~2pi/81
# the sampler's temperature schedule: linear from T_MAX at the first step towards T_MIN at the step cap (rows that
# settle early sample hot, rows that do not cool down), with the early-stopping confidence threshold (a row stops
# once the mean entropy of its temperature-scaled logits is below it)
T_MIN, T_MAX = 0.4, 2.0
CONFIDENCE = 0.14
CAP = 32  # the early-stopping run's step cap: rows that never settle stop here


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.preset = "sudoku"  # hidden 128, 4 layers (2 sliding + 2 full), 4 heads, 4 experts top-2
  rope = dict(rope_type="default", theta=ROPE_THETA)
  config.model.overrides = ml_collections.ConfigDict(dict(
      canvas_length=81, attention_structure=None, sliding_rope=rope, full_rope=rope, matmul_dtype="auto"))
  # the training split's own mix: more medium puzzles than the validation and test splits
  base.sudoku_task(config, num_train=30_000, train_easy=0.3, train_medium=0.7, train_hard=0.0)
  config.data.chat_template = "task"  # the task's cell-identity template: 81 digits -> 81 cell characters
  config.diffusion.time_min = 0.0  # t ~ U(max(time_eps, time_min), 1 - time_eps)
  config.diffusion.encoder_gradients = True  # False: the encoder runs forward only (no backward through the cache)
  config.diffusion.self_conditioning_passes = 1  # no-gradient decoder passes feeding the self-conditioned one
  config.train.steps = STEPS
  # 25 slots of the refilling sampling loop: fewer slots, less tail (docs/sampling.md)
  config.eval.update(batch_size=25, step_budgets=(8, 16, 32), early_stopping_steps=CAP)
  config.eval.sampling.update(t_min=T_MIN, t_max=T_MAX, confidence_threshold=CONFIDENCE)
  config.eval.sampling.self_conditioning = True  # False for a model trained with diffusion.self_conditioning_prob=0
  config.eval.ablation_steps = 0  # N > 0: each ablation below evaluated once at N steps (off by default)
  config.eval.ablations = base.sudoku_ablations()
  return config
