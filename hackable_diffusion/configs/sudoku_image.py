"""Picture Sudoku: the main job's model and recipe, reading the puzzle from a picture through a vision tower trained
from scratch with it.

  python -m hackable_diffusion.train --config=configs/sudoku_image.py --workdir=runs/sudoku_image

The puzzles are configs/sudoku.py's (30k training, 30% easy / 70% medium; validation and test half and half), each
drawn as a 144x144 grayscale picture (`tasks/sudoku/render.py`: fonts, line widths, a rotation of up to 3 degrees,
noise; the test split in fonts held out from training) into workdir/data/img/ as PNG files; a record is a chat
turn holding the picture and "Solve:", answered by the 81 solution digits (`tasks/sudoku/image_task.py`).

What differs from the main job:
- the vision tower (`model.overrides.vision`): 16-pixel patches, pooling 1, so each of the 81 cells of the picture is
  one patch and one soft token, in row-major order; 2 layers of width 64. `data.image_processor` feeds the pictures
  at their own size (no resize), so the prompt is boi, 81 image tokens, eoi and the instruction: canvas cell i reads
  its own cell's soft token at a fixed offset, and the tower's 2-D position embedding names the cell, as the
  cell-identity prompt of the text job does;
- the tower trains with the model (`train.train_vision='all'`); the tokenizer is trained with Gemma 4's image tokens
  (ids 4-6, named in `model.overrides`);
- nothing is pinned: the givens are not known to the sampler, the model transcribes them. The evaluation reports
  `transcription_accuracy` (given cells answered with the picture's digit) next to the solved rate, per bucket.
"""

import ml_collections

from hackable_diffusion.configs import sudoku

INSTRUCTION = "Solve:"
CELL_PX = 16  # pixels per cell = the tower's patch: one soft token per cell
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=16, patch_size=CELL_PX, pooling_kernel_size=1, position_embedding_size=16)


def get_config() -> ml_collections.ConfigDict:
  config = sudoku.get_config()
  config.model.overrides.update(vision=VISION, boi_token_id=4, eoi_token_id=5, image_token_id=6)
  config.data.generator = "sudoku_image"
  config.data.generator_args.update(instruction=INSTRUCTION, cell_px=CELL_PX)
  config.data.chat_template = "task"  # the task's template: the picture's placeholder, then the instruction
  config.data.pinned_field = ""  # the givens are in the picture only
  config.data.max_prompt_length = 2 + 81 + len(INSTRUCTION)  # boi, a soft token per cell, eoi, the instruction
  config.data.image_processor = ml_collections.ConfigDict(dict(max_soft_tokens=140, do_resize=False))
  config.train.train_vision = "all"
  config.eval.update(task="sudoku_image", ablations=ml_collections.ConfigDict(dict(all_tokens=dict(digits_only=False))))
  return config
