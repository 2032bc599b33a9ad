"""The cell-identity prompt: each cell of the puzzle as one character naming both the cell and its content.

A standard DiffusionGemma has no absolute positions (RoPE is relative), so a model reading the 81-digit prompt
must infer from relative offsets alone which cells share a row, column or box, and at the CPU budget it does not.
With one character per (cell, content) pair, the cell is in the token's embedding: a canvas cell reads its own
prompt token at a fixed offset (81 back) and the peers' tokens are found by content, which attention learns quickly.
The architecture stays the one transformers and vLLM run; only the text the model reads changes.

Cell `i` (0..80, row order) holding `v` (0 = blank, 1..9) is the character `chr(CELL_BASE + 10 * i + v)`, in
Unicode's private-use area (U+E000..U+E329: characters with no meaning of their own). The data files keep the
81-digit prompt; the conversion is the chat template `CELL_TEMPLATE` (`data.chat_template`), applied wherever a
prompt is tokenized (training, evaluation, sampling) and saved with the tokenizer, so an exported model's
`tokenizer.apply_chat_template([{"role": "user", "content": "53..7...."}])` in transformers builds the same prompt.
"""

from __future__ import annotations

import numpy as np

from hackable_diffusion.tasks.sudoku import solver

CELL_BASE = 0xE000  # the first character of Unicode's private-use area
BLANKS = "0._"  # as formatting.BLANKS: what a blank may be written as
DIGITS = "123456789"
SEPARATORS = "|-+"  # the box separators formatting.render_grid draws (whitespace is skipped too)


def cell_char(cell: int, value: int) -> str:
  """The character of cell `cell` (0..80) holding `value` (0 = blank, 1..9)."""
  if not 0 <= cell < solver.NUM_CELLS or not 0 <= value <= 9:
    raise ValueError(f"cell {cell}, value {value}: expected a cell 0..80 and a value 0..9")
  return chr(CELL_BASE + 10 * cell + value)


def cell_prompt(grid: np.ndarray) -> str:
  """``[81]`` ints in 0..9 (0 = blank) -> 81 cell characters: what `CELL_TEMPLATE` renders for that puzzle."""
  flat = solver.validate_grid(grid)
  return "".join(cell_char(i, int(v)) for i, v in enumerate(flat))


def _template() -> str:
  alphabet = "".join(chr(CELL_BASE + k) for k in range(10 * solver.NUM_CELLS))
  # the user turn's digits and blanks in order, each as its cell's character; whitespace and separators skipped;
  # any other character, or a count other than 81, raises (one line, naming the record where the data is read)
  return (
      "{%- set cells = '" + alphabet + "' -%}"
      "{%- set ns = namespace(cell=0) -%}"
      "{%- for ch in messages[-1]['content'] -%}"
      "{%- if ns.cell >= 81 and (ch in '" + DIGITS + BLANKS + "') -%}"
      "{{ raise_exception('a Sudoku puzzle has 81 cells, this one more') }}"
      "{%- elif ch in '" + DIGITS + "' -%}{{ cells[ns.cell * 10 + (ch | int)] }}{%- set ns.cell = ns.cell + 1 -%}"
      "{%- elif ch in '" + BLANKS + "' -%}{{ cells[ns.cell * 10] }}{%- set ns.cell = ns.cell + 1 -%}"
      "{%- elif not (ch.isspace() or ch in '" + SEPARATORS + "') -%}"
      "{{ raise_exception('character ' ~ (ch | tojson) ~ ' is not a digit 1-9, a blank (0 . _) or a separator') }}"
      "{%- endif -%}"
      "{%- endfor -%}"
      "{%- if ns.cell != 81 -%}"
      "{{ raise_exception('a Sudoku puzzle has 81 cells, this one ' ~ ns.cell) }}"
      "{%- endif -%}"
  )


CELL_TEMPLATE = _template()  # a jinja chat template (data.chat_template): the puzzle as cell characters

__all__ = ["CELL_BASE", "CELL_TEMPLATE", "cell_char", "cell_prompt"]
