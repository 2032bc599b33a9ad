"""Sudoku pictures (tasks/sudoku/render.py): a pure function of the digits, the generator and the split; the digits
are drawn where their cells are; the test split's fonts are held out from training; bad input is one line."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.tasks.sudoku import render

PUZZLE = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def _pixels(digits: str, seed: int, split: str = "train", **config) -> np.ndarray:
  return np.asarray(render.render_puzzle(digits, np.random.default_rng(seed), split, render.RenderConfig(**config)))


def test_same_inputs_same_picture_and_size():
  a, b = _pixels(PUZZLE, 3), _pixels(PUZZLE, 3)
  assert a.shape == (144, 144) and a.dtype == np.uint8
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, _pixels(PUZZLE, 4))  # another draw: another style, rotation, noise
  assert _pixels(PUZZLE, 0, cell_px=24).shape == (216, 216)


def test_digits_ink_their_cells_only():
  # no rotation or noise: a given's cell interior holds ink, a blank's is white
  pixels = _pixels(PUZZLE, 0, max_rotation=0.0, noise=0.0)
  for i, ch in enumerate(PUZZLE):
    r, c = divmod(i, 9)
    inner = pixels[16 * r + 3:16 * r + 13, 16 * c + 3:16 * c + 13]
    assert (inner.min() < 128) == (ch != "0"), (i, ch)


def test_font_split_is_deterministic_and_disjoint():
  train, test = render.font_styles("train"), render.font_styles("test")
  assert train and test and not set(train) & set(test)
  assert render.font_styles("validation") == train
  assert len(train) + len(test) == (1 + len(render.font_files())) * len(render.SIZES) * len(render.STROKES)
  if len(render.font_files()) >= 2:  # whole faces held out
    assert not {s.source for s in train} & {s.source for s in test}


def test_bad_input_is_one_line(tmp_path):
  bad_font = tmp_path / "broken.ttf"
  bad_font.write_bytes(b"not a font")
  for call, match in ((lambda: render.render_puzzle("123", np.random.default_rng(0)), "exactly 81"),
                      (lambda: render.render_puzzle("x" * 81, np.random.default_rng(0)), "exactly 81"),
                      (lambda: render.render_puzzle(PUZZLE, np.random.default_rng(0), "dev"), "render split"),
                      (lambda: render.load_font(str(bad_font), 12), "broken.ttf: cannot read the font")):
    with pytest.raises(ConfigError, match=match) as e:
      call()
    assert "\n" not in str(e.value)


def test_returns_a_grayscale_pil_image():
  image = render.render_puzzle("." * 81, np.random.default_rng(0), "test")
  assert isinstance(image, PIL.Image.Image) and image.mode == "L"
