"""The Sudoku rules as a sampler checker (`sampling.checker`): flags every cell that breaks them.

The canvas holds the 81 cells in row order at positions 0..80 (one token per cell); later positions (EOS, padding)
are not checked. A cell is flagged when its token is not one of the digits 1-9, or when its digit appears in
another cell of its row, column or 3x3 box (every copy of a repeated digit is flagged). Traced inside the denoising
loop: the unit-membership matrix is a constant, the digit ids a traced field.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hackable_diffusion.errors import ConfigError

Array = jax.Array

NUM_CELLS = 81


def unit_matrix() -> np.ndarray:
  """`[27, 81]` int32: row `u` marks the cells of unit `u` (9 rows, then 9 columns, then 9 boxes)."""
  cells = np.arange(NUM_CELLS)
  row, col = cells // 9, cells % 9
  box = (row // 3) * 3 + col // 3
  units = np.zeros((27, NUM_CELLS), np.int32)
  units[row, cells] = 1
  units[9 + col, cells] = 1
  units[18 + box, cells] = 1
  return units


@flax.struct.dataclass
class SudokuChecker:
  """`checker(canvas [B, C]) -> [B, C] bool` for canvases whose first 81 positions are a grid in row order.

  digit_ids: `[9]` the token ids of '1'..'9' (`SudokuChecker.for_tokenizer`).
  units: False flags the cells whose digit repeats (and non-digits); True flags every cell of a row, column or box
    that holds a repeat (the wrong digit need not be one of the copies: one wrong cell elsewhere can force a clash).
    Static (part of the compile key).
  """

  digit_ids: Any
  units: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def for_tokenizer(cls, tokenizer: Any, units: bool = False) -> SudokuChecker:
    """The checker for `tokenizer`'s ids of the characters '1'..'9' (one token per digit)."""
    ids = np.asarray(tokenizer.token_ids_for("123456789"), np.int32)
    if ids.shape != (9,):
      raise ConfigError(f"sudoku checker: the tokenizer gives {ids.shape[0]} ids for the digits '1'..'9'; expected one "
                        f"token per digit")
    return cls(digit_ids=ids, units=units)

  def __call__(self, canvas: Array) -> Array:
    canvas = jnp.asarray(canvas, jnp.int32)
    batch, length = canvas.shape
    if length < NUM_CELLS:
      raise ValueError(f"sudoku checker: canvas of {length} positions; the grid needs {NUM_CELLS}")
    cells = canvas[:, :NUM_CELLS]  # [B, 81]
    one_hot = (cells[..., None] == jnp.asarray(self.digit_ids, jnp.int32)).astype(jnp.int32)  # [B, 81, 9]
    units = jnp.asarray(unit_matrix())  # [27, 81]
    counts = jnp.einsum("uc,bcd->bud", units, one_hot)  # [B, 27, 9] copies of each digit in each unit
    if self.units:  # every cell of a unit with a repeat
      unit_bad = jnp.any(counts > 1, axis=-1).astype(jnp.int32)  # [B, 27]
      clash = jnp.einsum("uc,bu->bc", units, unit_bad) > 0  # [B, 81]
    else:  # the cells whose digit repeats in one of their units
      repeated = jnp.einsum("uc,bud->bcd", units, (counts > 1).astype(jnp.int32))  # [B, 81, 9]
      clash = jnp.any((one_hot > 0) & (repeated > 0), axis=-1)  # [B, 81]
    bad = clash | ~jnp.any(one_hot > 0, axis=-1)  # or the cell holds no digit
    return jnp.concatenate([bad, jnp.zeros((batch, length - NUM_CELLS), bool)], axis=1)


__all__ = ["NUM_CELLS", "SudokuChecker", "unit_matrix"]
