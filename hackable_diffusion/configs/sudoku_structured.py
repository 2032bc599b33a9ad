"""Research variant of the main job: Sudoku with a task attention structure (cannot be exported).

  python -m hackable_diffusion.train --config=configs/sudoku_structured.py --workdir=runs/sudoku_structured

The same data, model size, recipe, steps and sampler as configs/sudoku.py, but the 81-digit prompt (no chat
template), the default RoPE and, instead, two choices outside the standard architecture:
- `attention_structure=OWN_CELL_STRUCTURE`: canvas cells attend only to their row/column/box peers and the prompt;
  head 0 of each layer reads only the cell's own prompt character, the other heads the whole prompt. transformers
  and vLLM have no such mask: `export` refuses this model;
- two more attention heads (6) for the own-cell head.
The givens are pinned (`data.pinned_field`). Results, for comparison with the main job: docs/results.md.
"""

import ml_collections

from hackable_diffusion.configs import base

# head 0 of every layer reads only the cell's own prompt character (is it a given), heads 1-5 the whole prompt; all
# heads see the canvas peers (row, column, box)
OWN_CELL_STRUCTURE = "hackable_diffusion.tasks.sudoku.structure:own_cell_peer_mask"
HEADS = 6  # the preset's 4 + 2: the own-cell head is added capacity, not taken from the others
STEPS = 2200
# the sampler's temperature schedule: linear from T_MAX at the first step towards T_MIN at the step cap (rows that
# settle early sample hot, rows that do not cool down), with the early-stopping confidence threshold (a row stops
# once the mean entropy of its temperature-scaled logits is below it)
T_MIN, T_MAX = 0.4, 2.0
CONFIDENCE = 0.14
CAP = 32  # the early-stopping run's step cap: rows that never settle stop here


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.preset = "sudoku"  # hidden 128, 4 layers (2 sliding + 2 full), 4 heads, 4 experts top-2
  # matmul_dtype 'bfloat16' runs bf16 products (AMX / AVX512-BF16 CPUs); listed to show the choice
  config.model.overrides = ml_collections.ConfigDict(dict(
      canvas_length=81, attention_structure=OWN_CELL_STRUCTURE, num_attention_heads=HEADS, matmul_dtype="auto"))
  # the training split's own mix: more medium puzzles than the validation and test splits
  base.sudoku_task(config, num_train=30_000, train_easy=0.3, train_medium=0.7, train_hard=0.0)
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
