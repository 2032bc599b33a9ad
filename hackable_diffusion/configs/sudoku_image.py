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
- the tower's initialisation (from scratch; exported weights and config.json are standard): its position table
  starts N(0, 1) instead of all ones, so every cell's soft token differs from the first step and the text model can
  tell its cell's token from the others; `initializer_range` 0.1 instead of 0.02 makes the pixels, not the shared
  position and layer terms, a large part of each soft token, and the tower learns digits faster;
- a transcription curriculum (`data.generator_args.transcribe*`, `tasks/sudoku/image_task.py`): 15,000 records
  "Given:" answered by the puzzle itself ('0' for a blank) join the 30,000 solve records; the first WARMUP steps
  read transcription records only (`data.shuffle=False`: the task writes the file in curriculum order), so the
  model first learns where each cell's token is and what digit it shows, from a loss that asks canvas cell i for
  picture cell i alone; then the solve records and the other transcription records, shuffled;
- peak learning rate 1e-3, half the main job's, a gentler start for the tower trained from scratch while the
  warm-up's loss leaves its plateau (docs/sudoku.md); 1,400 steps, one pass over the 45,000 records;
- the tower trains with the model (`train.train_vision='all'`); the tokenizer is trained with Gemma 4's image tokens
  (ids 4-6, named in `model.overrides`);
- nothing is pinned: the givens are not known to the sampler, the model transcribes them. The evaluation (200 test
  puzzles at 32 steps and with early stopping) reports `transcription_accuracy` (given cells answered with the
  picture's digit) next to the solved rate, per bucket. Results: docs/sudoku.md.
"""

import ml_collections

from hackable_diffusion.configs import sudoku

INSTRUCTION = "Solve:"
TRANSCRIBE_INSTRUCTION = "Given:"  # as long as INSTRUCTION: the same prompt layout
TRANSCRIBE = 0.5  # transcription records added to the training split, as a share of its puzzles
WARMUP = 300  # steps of transcription records only, at the start of the (unshuffled, curriculum-ordered) file
STEPS = 1400  # one pass over the training file (30,000 solve + 15,000 transcription records, 32 a step)
PEAK_LR = 1e-3
CELL_PX = 16  # pixels per cell = the tower's patch: one soft token per cell
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=16, patch_size=CELL_PX, pooling_kernel_size=1, position_embedding_size=16, initializer_range=0.1,
              position_embedding_init_std=1.0)


def get_config() -> ml_collections.ConfigDict:
  config = sudoku.get_config()
  config.model.overrides.update(vision=VISION, boi_token_id=4, eoi_token_id=5, image_token_id=6)
  config.data.generator = "sudoku_image"
  config.data.generator_args.update(instruction=INSTRUCTION, cell_px=CELL_PX, transcribe=TRANSCRIBE,
                                    transcribe_instruction=TRANSCRIBE_INSTRUCTION,
                                    transcribe_first=WARMUP * config.train.batch_size)
  config.data.shuffle = False  # the task's file order is the curriculum (it shuffles all but the warm-up)
  config.data.chat_template = "task"  # the task's template: the picture's placeholder, then the instruction
  config.data.pinned_field = ""  # the givens are in the picture only
  config.data.max_prompt_length = 2 + 81 + len(INSTRUCTION)  # boi, a soft token per cell, eoi, the instruction
  config.data.image_processor = ml_collections.ConfigDict(dict(max_soft_tokens=140, do_resize=False))
  config.train.train_vision = "all"
  config.train.steps = STEPS
  config.optimizer.peak_lr = PEAK_LR
  config.eval.update(task="sudoku_image", num_examples=200, step_budgets=(32,),
                     ablations=ml_collections.ConfigDict(dict(all_tokens=dict(digits_only=False))))
  return config
