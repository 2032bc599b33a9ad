"""Picture Sudoku: the puzzle is a picture in the user turn, the answer the 81 solution digits.

`ImageSudokuTask` (built in as `data.generator='sudoku_image'`, configs/sudoku_image.py) generates the same puzzles
as `SudokuTask` (text files kept under `data/text/`), draws each one (`render.render_puzzle`: the test split with the
held-out fonts) into `data/img/<split>/<index>.png` and writes chat records

  {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/train/000000.png"},
                                             {"type": "text", "text": "Solve:"}]},
                {"role": "assistant", "content": "<81 solution digits>"}],
   "puzzle": "<81 cells, 0 = blank>", "givens": 36}

The givens are not pinned: the model reads them from the picture, so its answer is scored twice, as a solution
(`solved_rate`, `cell_accuracy` on the blank cells, per difficulty bucket, as the text task) and as a transcription
(`transcription_accuracy`: the fraction of given cells whose answered digit is the picture's, per bucket too).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from hackable_diffusion.files import write_atomic
from hackable_diffusion.tasks.base import EvalRecord, check_lengths, data_spec_matches, write_data_spec
from hackable_diffusion.tasks.sudoku import dataset, formatting, generator, metrics, render
from hackable_diffusion.tasks.sudoku.task import SudokuTask

TEXT_DIR = "text"  # the text splits the pictures are drawn from, under the data folder
IMAGE_DIR = "img"
PUZZLE_FIELD = "puzzle"
# the chat template: an image part is the image placeholder, a text part its text; the generation prompt is empty,
# so the completion is the assistant's 81 digits
TEMPLATE = ("{%- for m in messages -%}{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}"
            "{%- for p in m['content'] -%}{%- if p['type'] == 'image' -%}<|image|>{%- else -%}{{ p['text'] }}"
            "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}")


def image_path(split: str, index: int) -> str:
  """The picture of puzzle `index` of `split`, relative to the data folder."""
  return f"{IMAGE_DIR}/{split}/{index:06d}.png"


def chat_record(puzzle: str, solution: str, path: str, instruction: str) -> dict[str, Any]:
  """One picture-Sudoku chat record (module docstring)."""
  user = [{"type": "image", "path": path}, {"type": "text", "text": instruction}]
  return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": solution}],
          PUZZLE_FIELD: puzzle, "givens": int(sum(ch != "0" for ch in puzzle))}


def _render_chunk(out_dir: str, split: str, seed: int, start: int, puzzles: Sequence[str],
                  config: render.RenderConfig) -> None:
  """Draws puzzles `start...` of `split` into their PNG files; picture i from a generator seeded [seed, split, i]."""
  split_index = dataset.SPLITS.index(split)
  for offset, puzzle in enumerate(puzzles):
    i = start + offset
    image = render.render_puzzle(puzzle, np.random.default_rng([seed, split_index, i]), split, config)
    image.save(os.path.join(out_dir, image_path(split, i)), format="PNG")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageSudokuTask(SudokuTask):
  """`SudokuTask`'s puzzles as pictures (module docstring). instruction: the text after the picture; cell_px: pixels
  per cell (the picture is 9 * cell_px square); pin_givens False: the sampler does not know the givens."""

  instruction: str = "Solve:"
  cell_px: int = 16
  pin_givens: bool = False
  name: str = "sudoku_image"

  def render_config(self) -> render.RenderConfig:
    return render.RenderConfig(cell_px=self.cell_px)

  def _image_spec(self) -> dict[str, Any]:
    fonts = {split: [dataclasses.astuple(s) for s in render.font_styles(split)] for split in ("train", "test")}
    return {**self._spec(), "task": "sudoku_image", "instruction": self.instruction,
            "render": dataclasses.asdict(self.render_config()), "fonts": fonts}

  def make_data(self, out_dir: str, progress: bool = True) -> dict[str, str]:
    """Writes `out_dir/{train,validation,test}.jsonl` and their pictures (once; again when the generation or
    drawing arguments or the machine's fonts change)."""
    text = super().make_data(os.path.join(out_dir, TEXT_DIR), progress)
    paths = {split: os.path.join(out_dir, f"{split}.jsonl") for split in dataset.SPLITS}
    spec = self._image_spec()
    if data_spec_matches(out_dir, spec) and all(os.path.isfile(p) for p in paths.values()):
      return paths
    for split in dataset.SPLITS:
      with open(text[split], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
      self._render_split(out_dir, split, [r["prompt"] for r in rows])
      records = [chat_record(r["prompt"], r["completion"], image_path(split, i), self.instruction)
                 for i, r in enumerate(rows)]
      write_atomic(paths[split], "".join(json.dumps(r) + "\n" for r in records))
    write_data_spec(out_dir, spec)
    return paths

  def _render_split(self, out_dir: str, split: str, puzzles: list[str], chunk: int = 500) -> None:
    """The pictures of one split, in `workers` processes (the files do not depend on their number)."""
    os.makedirs(os.path.join(out_dir, IMAGE_DIR, split), exist_ok=True)
    config = self.render_config()
    starts = range(0, len(puzzles), chunk)
    if self.workers <= 1 or len(puzzles) <= chunk:
      for s in starts:
        _render_chunk(out_dir, split, self.seed, s, puzzles[s:s + chunk], config)
      return
    # spawned, not forked: a fork of a process running JAX threads can deadlock
    with futures.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
      for done in [pool.submit(_render_chunk, out_dir, split, self.seed, s, puzzles[s:s + chunk], config)
                   for s in starts]:
        done.result()

  # ---- sampling hooks: the puzzle is in the record's `puzzle` field, not in its prompt text ----------------------
  def seed_canvas(self, records: Sequence[EvalRecord], tokenizer: Any,
                  num_tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """As `SudokuTask.seed_canvas` for the records' puzzles: noise drawn per puzzle; givens pinned only with
    `pin_givens` (an oracle ablation: by default the model reads them from the picture)."""
    as_text = [EvalRecord(prompt=r.fields[PUZZLE_FIELD], completion=r.completion, fields=r.fields) for r in records]
    return super().seed_canvas(as_text, tokenizer, num_tokens)

  def chat_template(self) -> str:
    return TEMPLATE

  def parse_prompt(self, text: str) -> str:
    return text

  def prompt_complete(self, text: str) -> bool:
    return True

  def render(self, completion: str, record: EvalRecord) -> str:
    return formatting.render_grid(metrics.parse_prediction(completion))

  def plot_trajectory(self, trajectory: Mapping[str, Any], path: str) -> str | None:
    return None  # the trajectory's prompt is the instruction; the puzzle is in the picture

  def metrics(self, predictions: Sequence[str], records: Sequence[EvalRecord]) -> dict[str, float]:
    """`SudokuTask.metrics` of the records' puzzles, plus `transcription_accuracy` overall and per bucket."""
    check_lengths(predictions, records)
    preds = np.stack([metrics.parse_prediction(p) for p in predictions])
    puzzles = np.stack([formatting.parse_grid(r.fields[PUZZLE_FIELD]) for r in records])
    solutions = np.stack([formatting.parse_grid(r.completion) for r in records])
    out = {k: float(v) for k, v in metrics.sudoku_metrics(preds, puzzles, solutions).items()}
    return out | transcription_metrics(preds, puzzles)


def transcription_metrics(preds: np.ndarray, puzzles: np.ndarray) -> dict[str, float]:
  """`transcription_accuracy`: answered digit == the picture's, pooled over the given cells, overall and under each
  bucket's prefix (NaN for a group without givens)."""
  givens = puzzles > 0
  right = (preds == puzzles) & givens
  buckets = np.array([generator.difficulty_bucket(int(g)) for g in givens.sum(1)], dtype=object)
  groups = {"": np.ones(len(puzzles), bool)} | {f"{b}/": buckets == b for b in generator.BUCKETS}
  out = {}
  for prefix, sel in groups.items():
    total = int(givens[sel].sum())
    out[f"{prefix}transcription_accuracy"] = float(right[sel].sum() / total) if total else float("nan")
  return out


__all__ = ["ImageSudokuTask", "TEMPLATE", "chat_record", "image_path", "transcription_metrics"]
