"""Picture Sudoku: the puzzle is a picture in the user turn, the answer the 81 solution digits.

`ImageSudokuTask` (built in as `data.generator='sudoku_image'`, configs/sudoku_image.py) generates the same puzzles
as `SudokuTask` (text files kept under `data/text/`), draws each one (`render.render_puzzle`: the test split with the
held-out fonts) into `data/img/<split>/<index>.png` and writes chat records

  {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/train/000000.png"},
                                             {"type": "text", "text": "Solve:"}]},
                {"role": "assistant", "content": "<81 solution digits>"}],
   "puzzle": "<81 cells, 0 = blank>", "givens": 36}

With `transcribe` > 0 the training split also holds `round(transcribe * num_train)` transcription records: the
picture of a training puzzle (chosen by a generator seeded with the task's seed) with `transcribe_instruction`,
answered by the puzzle itself (its 81 cells, '0' for a blank). Their loss asks canvas cell i for the content of
picture cell i alone, the most direct signal for the vision tower to learn the digits from; the validation and test
splits hold solve records only. The two instructions have the same length, so the prompt's layout (and the offset
from a canvas cell to its soft token) is the same for both.

With `transcribe_first` > 0 the training file is a curriculum, read in its order (`data.shuffle=False`): its first
`transcribe_first` records (at most all of them) are transcription records, the rest (the solve records and the
other transcription records) follow in an order shuffled by the task's seed. Transcription alone first teaches the
model where each cell's soft token is and the tower what the digits look like, before the solve records (whose
answer at a blank cell depends on the whole grid) join.

The pictures are drawn once per picture spec (`data/img/data_spec.json`: the puzzles, the drawing settings and the
fonts); the records are rewritten when their own settings (the instructions, the transcription records) change.

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

from hackable_diffusion.errors import ConfigError
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
  per cell (the picture is 9 * cell_px square); transcribe: transcription records added to the training split, as a
  share of num_train, with `transcribe_instruction` (as long as `instruction`); transcribe_first: how many of them
  open the training file, the rest of it shuffled (module docstring); pin_givens False: the sampler does not know
  the givens."""

  instruction: str = "Solve:"
  transcribe: float = 0.0
  transcribe_instruction: str = "Given:"
  transcribe_first: int = 0
  cell_px: int = 16
  pin_givens: bool = False
  name: str = "sudoku_image"

  def __post_init__(self):
    super().__post_init__()
    if not 0.0 <= self.transcribe <= 1.0:
      raise ConfigError(f"sudoku_image transcribe={self.transcribe!r}; expected a share of num_train in [0, 1]")
    if self.transcribe and (len(self.transcribe_instruction) != len(self.instruction)
                            or self.transcribe_instruction == self.instruction):
      raise ConfigError(f"sudoku_image transcribe_instruction={self.transcribe_instruction!r} must differ from "
                        f"instruction={self.instruction!r} and have its length (the same prompt layout)")
    if not isinstance(self.transcribe_first, int) or isinstance(self.transcribe_first, bool) or \
        self.transcribe_first < 0:
      raise ConfigError(f"sudoku_image transcribe_first={self.transcribe_first!r}; expected an integer >= 0")

  def transcription_indices(self) -> np.ndarray:
    """The training puzzles (sorted indices) that also give a transcription record."""
    count = round(self.transcribe * self.num_train)
    return np.sort(np.random.default_rng([self.seed, 7]).choice(self.num_train, count, replace=False))

  def render_config(self) -> render.RenderConfig:
    return render.RenderConfig(cell_px=self.cell_px)

  def _image_spec(self) -> dict[str, Any]:
    """What the pictures depend on: the puzzles, the drawing settings and the fonts."""
    fonts = {split: [dataclasses.astuple(s) for s in render.font_styles(split)] for split in ("train", "test")}
    return {**self._spec(), "task": "sudoku_image", "render": dataclasses.asdict(self.render_config()),
            "fonts": fonts}

  def _records_spec(self) -> dict[str, Any]:
    return {**self._image_spec(), "instruction": self.instruction,
            **({"transcribe": self.transcribe, "transcribe_instruction": self.transcribe_instruction,
                "transcribe_first": self.transcribe_first} if self.transcribe else {})}

  def make_data(self, out_dir: str, progress: bool = True) -> dict[str, str]:
    """Writes `out_dir/{train,validation,test}.jsonl` and their pictures (the pictures once, again when the
    generation or drawing arguments or the machine's fonts change; the records also when their settings change)."""
    text = super().make_data(os.path.join(out_dir, TEXT_DIR), progress)
    paths = {split: os.path.join(out_dir, f"{split}.jsonl") for split in dataset.SPLITS}
    spec = self._records_spec()
    if data_spec_matches(out_dir, spec) and all(os.path.isfile(p) for p in paths.values()):
      return paths
    rows = {}
    for split in dataset.SPLITS:
      with open(text[split], encoding="utf-8") as f:
        rows[split] = [json.loads(line) for line in f]
    image_dir = os.path.join(out_dir, IMAGE_DIR)
    if not data_spec_matches(image_dir, self._image_spec()):
      for split in dataset.SPLITS:
        self._render_split(out_dir, split, [r["prompt"] for r in rows[split]])
      write_data_spec(image_dir, self._image_spec())
    for split in dataset.SPLITS:
      records = [chat_record(r["prompt"], r["completion"], image_path(split, i), self.instruction)
                 for i, r in enumerate(rows[split])]
      if split == "train":
        records = self._curriculum(records, [
            chat_record(rows[split][i]["prompt"], rows[split][i]["prompt"], image_path(split, int(i)),
                        self.transcribe_instruction) for i in self.transcription_indices()])
      write_atomic(paths[split], "".join(json.dumps(r) + "\n" for r in records))
    write_data_spec(out_dir, spec)
    return paths

  def _curriculum(self, solve: list[dict[str, Any]], transcription: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training records in file order: all solve records then the transcription records, or with
    `transcribe_first` that many transcription records first and the rest shuffled (seeded)."""
    if not self.transcribe_first:
      return solve + transcription
    rest = solve + transcription[self.transcribe_first:]
    order = np.random.default_rng([self.seed, 8]).permutation(len(rest))
    return transcription[:self.transcribe_first] + [rest[i] for i in order]

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
