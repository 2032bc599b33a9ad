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

from hackable_diffusion.configs import sudoku

# head 0 of every layer reads only the cell's own prompt character (is it a given), heads 1-5 the whole prompt; all
# heads see the canvas peers (row, column, box)
OWN_CELL_STRUCTURE = "hackable_diffusion.tasks.sudoku.structure:own_cell_peer_mask"
HEADS = 6  # the preset's 4 + 2: the own-cell head is added capacity, not taken from the others


def get_config() -> ml_collections.ConfigDict:
  config = sudoku.get_config()  # the main job's data, recipe, steps, evaluation and sampler
  # the preset's RoPE; matmul_dtype 'bfloat16' runs bf16 products (AMX / AVX512-BF16 CPUs), listed to show the choice
  config.model.overrides = ml_collections.ConfigDict(dict(
      canvas_length=81, attention_structure=OWN_CELL_STRUCTURE, num_attention_heads=HEADS, matmul_dtype="auto"))
  config.data.chat_template = ""  # the 81-digit prompt, as the data write it (the structure reads its 81 slots)
  return config
