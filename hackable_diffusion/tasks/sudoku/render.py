"""A Sudoku puzzle as a picture: 9x9 printed digits on a grid, with the variation a photo or scan brings (PIL only).

`render_puzzle(digits, rng, split)` draws the 81 cells (row-major, '0' or '.' for a blank) as a grayscale image of
`9 * cell_px` pixels a side, cell `(r, c)` covering pixels `[cell_px * r, cell_px * (r + 1))` before the rotation, so
a vision tower whose soft token covers `cell_px` pixels sees one cell per token. Each picture draws, from `rng`:
a font style of its split (`font_styles`), the thin and box line widths, the digits' ink level and a 1-pixel jitter
per digit, a rotation of at most `max_rotation` degrees about the centre and Gaussian pixel noise. A pure function of
its arguments: the same digits, generator state and split give the same picture.

Fonts are those every machine has: PIL's built-in font (`ImageFont.load_default(size=...)`, with FreeType) and any
TrueType / OpenType file under PIL's package folder or /usr/share/fonts, each at a few sizes and stroke widths. The
list is sorted, so it is the same on every run of one machine; every `TEST_EVERY`-th font is held out for the
'test' split (faces the model never saw in training), the others are the 'train' split's ('validation' uses train
fonts). Machines with other fonts draw other pictures.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

from hackable_diffusion.errors import ConfigError

CELLS = 81
SIDE = 9
FONT_DIRS = ("/usr/share/fonts",)  # searched with PIL's own package folder
FONT_SUFFIXES = (".ttf", ".otf")
SIZES = (0.6, 0.7, 0.8)  # glyph size as a fraction of the cell
STROKES = (0, 1)  # extra stroke width in pixels (1: a bold look)
TEST_EVERY = 3  # every third style (by its place in the sorted list) is held out for the test split
SPLITS = ("train", "validation", "test")
BUILTIN = "builtin"  # the font source of PIL's built-in font


@dataclasses.dataclass(frozen=True)
class FontStyle:
  """One way to print digits: `source` (`BUILTIN` or a font file), size as a fraction of the cell, stroke width."""

  source: str
  size: float
  stroke: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderConfig:
  """The picture's geometry and the range of its variation.

  cell_px: pixels per cell side (the picture is `9 * cell_px` square). thin / thick: line widths in pixels of the
  cell and box lines, each drawn per picture from the range. max_rotation: degrees. noise: the most standard
  deviation of the Gaussian pixel noise (in levels of 255). ink: the darkest and lightest digit ink level.
  """

  cell_px: int = 16
  thin: tuple[int, int] = (1, 1)
  thick: tuple[int, int] = (2, 3)
  max_rotation: float = 3.0
  noise: float = 12.0
  ink: tuple[int, int] = (0, 70)

  def __post_init__(self):
    if not isinstance(self.cell_px, int) or self.cell_px < 8:
      raise ConfigError(f"RenderConfig.cell_px={self.cell_px!r}; expected an integer >= 8")
    for name in ("thin", "thick", "ink"):
      lo, hi = getattr(self, name)
      if not 0 <= lo <= hi:
        raise ConfigError(f"RenderConfig.{name}={getattr(self, name)!r}; expected (low, high) with 0 <= low <= high")
    if self.max_rotation < 0 or self.noise < 0:
      raise ConfigError(f"RenderConfig max_rotation={self.max_rotation} and noise={self.noise} must be >= 0")


def font_files(dirs: tuple[str, ...] = FONT_DIRS) -> tuple[str, ...]:
  """Every font file (`FONT_SUFFIXES`) under PIL's package folder and `dirs`, sorted by path (none is fine)."""
  found = []
  for root_dir in (os.path.dirname(PIL.__file__), *dirs):
    for root, _, names in os.walk(root_dir):
      found += [os.path.join(root, n) for n in names if n.lower().endswith(FONT_SUFFIXES)]
  return tuple(sorted(set(found)))


@functools.lru_cache(maxsize=None)
def font_styles(split: str = "train", dirs: tuple[str, ...] = FONT_DIRS) -> tuple[FontStyle, ...]:
  """The font styles of `split`, in a fixed order: each source (`BUILTIN`, then `font_files(dirs)`) at `SIZES` x
  `STROKES`. Every `TEST_EVERY`-th source is held out for 'test' ('train' and 'validation' get the others); a machine
  with fewer than `TEST_EVERY` sources holds out every `TEST_EVERY`-th style instead, so both sides have fonts."""
  if split not in SPLITS:
    raise ConfigError(f"render split {split!r}; expected one of {SPLITS}")
  sources = (BUILTIN, *font_files(dirs))
  styles = [FontStyle(source, size, stroke) for source in sources for size in SIZES for stroke in STROKES]
  per_source = len(SIZES) * len(STROKES)
  unit = per_source if len(sources) >= TEST_EVERY else 1  # hold out whole sources, else single styles
  held_out = split == "test"
  return tuple(s for i, s in enumerate(styles) if ((i // unit) % TEST_EVERY == TEST_EVERY - 1) == held_out)


@functools.lru_cache(maxsize=256)
def load_font(source: str, pixels: int) -> PIL.ImageFont.FreeTypeFont | PIL.ImageFont.ImageFont:
  """The font of `source` at `pixels` pixels; a one-line `ConfigError` naming a file that cannot be read."""
  try:
    if source == BUILTIN:
      return PIL.ImageFont.load_default(size=pixels)
    return PIL.ImageFont.truetype(source, size=pixels)
  except (OSError, ValueError) as e:
    reason = " ".join(str(e).split()) or type(e).__name__
    raise ConfigError(f"{source}: cannot read the font ({reason})") from None


def parse_cells(digits: str) -> list[int]:
  """81 cells ('0' or '.' blank, '1'-'9') -> ints; a one-line `ConfigError` for anything else."""
  if not isinstance(digits, str) or len(digits) != CELLS or set(digits) - set(".0123456789"):
    shown = repr(digits) if not isinstance(digits, str) or len(digits) <= 20 else repr(digits[:17] + "...")
    raise ConfigError(f"cannot render {shown}: a puzzle is exactly {CELLS} characters '1'-'9', '0' or '.'")
  return [0 if ch == "." else int(ch) for ch in digits]


def _draw_grid(draw: PIL.ImageDraw.ImageDraw, config: RenderConfig, rng: np.random.Generator) -> None:
  """Cell and box lines centred on the cell borders, the outer frame inside the picture."""
  side = SIDE * config.cell_px
  thin = int(rng.integers(config.thin[0], config.thin[1] + 1))
  thick = int(rng.integers(config.thick[0], config.thick[1] + 1))
  for k in range(SIDE + 1):
    width = thick if k % 3 == 0 else thin
    if width == 0:
      continue
    at = min(max(k * config.cell_px - width // 2, 0), side - width)  # the frame stays inside the picture
    draw.rectangle([at, 0, at + width - 1, side - 1], fill=0)
    draw.rectangle([0, at, side - 1, at + width - 1], fill=0)


def _draw_digits(draw: PIL.ImageDraw.ImageDraw, cells: list[int], style: FontStyle, config: RenderConfig,
                 rng: np.random.Generator) -> None:
  """Each given digit centred in its cell (plus a jitter of up to one pixel), in one ink level."""
  font = load_font(style.source, max(4, round(style.size * config.cell_px)))
  ink = int(rng.integers(config.ink[0], config.ink[1] + 1))
  jitter = rng.integers(-1, 2, size=(CELLS, 2))
  for i, value in enumerate(cells):
    if value:
      r, c = divmod(i, SIDE)
      x = (c + 0.5) * config.cell_px + jitter[i, 0]
      y = (r + 0.5) * config.cell_px + jitter[i, 1]
      draw.text((x, y), str(value), fill=ink, font=font, anchor="mm", stroke_width=style.stroke, stroke_fill=ink)


def render_puzzle(digits: str, rng: np.random.Generator, split: str = "train",
                  config: RenderConfig = RenderConfig()) -> PIL.Image.Image:
  """The puzzle `digits` (81 cells, row-major) as a grayscale ('L') picture of `9 * config.cell_px` pixels a side,
  drawn with a font style of `split` and the variation of `config`, every random choice from `rng`."""
  cells = parse_cells(digits)
  styles = font_styles(split)
  if not styles:
    raise ConfigError(f"render split {split!r} has no font style (no font found)")
  style = styles[int(rng.integers(len(styles)))]
  side = SIDE * config.cell_px
  image = PIL.Image.new("L", (side, side), color=255)
  draw = PIL.ImageDraw.Draw(image)
  _draw_grid(draw, config, rng)
  _draw_digits(draw, cells, style, config, rng)
  angle = float(rng.uniform(-config.max_rotation, config.max_rotation))
  image = image.rotate(angle, resample=PIL.Image.Resampling.BILINEAR, fillcolor=255)
  sigma = float(rng.uniform(0.0, config.noise))
  noisy = np.asarray(image, np.float32) + rng.normal(0.0, sigma, size=(side, side)).astype(np.float32)
  return PIL.Image.fromarray(np.clip(np.rint(noisy), 0, 255).astype(np.uint8), mode="L")


__all__ = ["BUILTIN", "FontStyle", "RenderConfig", "font_files", "font_styles", "load_font", "parse_cells",
           "render_puzzle"]
