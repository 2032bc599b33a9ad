"""Solve Sudoku puzzles with an exported main-job model in plain transformers: no hackable_diffusion code runs.

  python -m hackable_diffusion.export --workdir=runs/sudoku --out=exported/sudoku --format=merged
  python scripts/sudoku_transformers.py --model=exported/sudoku --puzzles=runs/sudoku/data/test.jsonl \
      [--num=300] [--steps=32] [--batch=50] [--seed=0]

The prompt is built from the export's own files: `chat_template.jinja` rendered by transformers' jinja renderer
(the cell-identity prompt) and `tokenizer.model` (sentencepiece). The canvas starts from the givens at their cells
and uniform noise elsewhere; `PinnedDigits`, a transformers `LogitsProcessor`, does what `hd.generate`'s `pinned`
and `allowed_token_ids` do (a given: logit 0 on its digit and -1e9 elsewhere; a blank: -1e9 outside the digits
1-9). The sampler is transformers' `generate` with the export's generation_config.json (temperatures, entropy
bound), run for exactly `--steps` steps. Prints the solved rate (every row, column and box a permutation of 1-9,
every given kept) overall and per bucket (easy >= 40 givens, medium 30-39, hard < 30).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

DISALLOWED = -1e9  # the finite logit `hd.generate` gives a token outside the allowed set (as vLLM does)
DIGITS = "123456789"


def read_puzzles(path: str, num: int) -> list[tuple[str, str]]:
  """(puzzle, solution) digit strings of the first `num` records of a JSONL file ('0' / '.' blanks)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        out.append((r["prompt"], r["completion"]))
      if len(out) == num:
        break
  return out


def grid_of(text: str) -> np.ndarray:
  """81 cells of a puzzle string -> [81] ints (0 = blank); whitespace and '|', '-', '+' skipped."""
  cells = [0 if ch in "0._" else int(ch) for ch in text if ch in "0._" + DIGITS]
  if len(cells) != 81:
    raise ValueError(f"expected 81 cells, got {len(cells)} in {text[:30]!r}...")
  return np.asarray(cells, np.int64)


class PromptEncoder:
  """The export's chat template (transformers' renderer) + sentencepiece model: a puzzle string -> token ids."""

  def __init__(self, model_dir: str):
    import sentencepiece as spm

    self.sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "tokenizer.model"))
    with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
      self.template = f.read()

  def __call__(self, puzzle: str) -> list[int]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([[{"role": "user", "content": puzzle}]], chat_template=self.template,
                                        add_generation_prompt=True)
    return self.sp.encode(rendered[0])

  def digit_ids(self) -> list[int]:
    return [self.sp.piece_to_id(d) for d in DIGITS]


def make_processor(seed, pinned, digit_ids):
  """A `LogitsProcessor` that restricts every position to the digits and makes pinned positions certain."""
  import torch
  from transformers import LogitsProcessor

  class PinnedDigits(LogitsProcessor):
    def __init__(self):
      self.masks = None  # (allowed [V], one-hot seed [B, C, V]), built at the first step (V from the logits)

    def __call__(self, input_ids, scores):  # scores [B, C, V]
      if self.masks is None:
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        allowed[torch.tensor(digit_ids)] = True
        self.masks = allowed, torch.nn.functional.one_hot(seed, scores.shape[-1]).bool()
      allowed, one_hot = self.masks
      scores = torch.where(allowed, scores, torch.full_like(scores, DISALLOWED))
      certain = torch.where(one_hot, torch.zeros_like(scores), torch.full_like(scores, DISALLOWED))
      return torch.where(pinned[..., None], certain, scores)

  return PinnedDigits()


def start_canvas(grids: np.ndarray, digit_ids: list[int], vocab: int, rng: np.random.Generator):
  """The givens at their cells (pinned), uniform noise over the vocabulary elsewhere: (seed, pinned) [B, 81]."""
  noise = rng.integers(0, vocab, size=grids.shape)
  ids = np.asarray(digit_ids)[np.maximum(grids, 1) - 1]
  return np.where(grids > 0, ids, noise), grids > 0


def generate(model, prompt_ids: np.ndarray, seed: np.ndarray, pinned: np.ndarray, digit_ids: list[int], steps: int,
             **sampler) -> np.ndarray:
  """transformers' `generate` of one 81-cell canvas for each prompt ([B, P], no padding), exactly `steps` steps
  (no early stop); `sampler`: further generate arguments (t_min, t_max, sampler_config, ...). -> canvas ids [B, 81]."""
  import torch
  from transformers import LogitsProcessorList

  seed_t, pinned_t = torch.tensor(seed), torch.tensor(pinned)
  processors = LogitsProcessorList([make_processor(seed_t, pinned_t, digit_ids)])
  with torch.no_grad():
    out = model.generate(torch.tensor(prompt_ids), decoder_input_ids=seed_t, logits_processor=processors,
                         max_new_tokens=81, max_denoising_steps=steps, stability_threshold=steps + 1, **sampler)
  return out.sequences[:, prompt_ids.shape[1]:].numpy()


def solved(grid: np.ndarray, puzzle: np.ndarray) -> bool:
  """Every row, column and box a permutation of 1-9, and every given kept."""
  g = grid.reshape(9, 9)
  units = list(g) + list(g.T) + [g[r:r + 3, c:c + 3].ravel() for r in (0, 3, 6) for c in (0, 3, 6)]
  return all(sorted(u.tolist()) == list(range(1, 10)) for u in units) and bool(np.all(grid[puzzle > 0] ==
                                                                                      puzzle[puzzle > 0]))


def main(argv: list[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True, help="a merged export (config.json, weights, tokenizer files)")
  parser.add_argument("--puzzles", required=True, help="JSONL with 'prompt' (81 cells) and 'completion'")
  parser.add_argument("--num", type=int, default=300)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--batch", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  a = parser.parse_args(argv)
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  torch.manual_seed(a.seed)
  model = DiffusionGemmaForBlockDiffusion.from_pretrained(a.model, dtype=torch.float32).eval()
  encode = PromptEncoder(a.model)
  digit_ids = encode.digit_ids()
  rng = np.random.default_rng(a.seed)
  puzzles = read_puzzles(a.puzzles, a.num)
  results = []
  for start in range(0, len(puzzles), a.batch):
    chunk = puzzles[start:start + a.batch]
    grids = np.stack([grid_of(p) for p, _ in chunk])
    prompt_ids = np.asarray([encode(p) for p, _ in chunk])
    seed, pinned = start_canvas(grids, digit_ids, model.config.text_config.vocab_size, rng)
    canvas = generate(model, prompt_ids, seed, pinned, digit_ids, a.steps)
    to_digit = {t: i + 1 for i, t in enumerate(digit_ids)}
    for row, g in zip(canvas, grids):
      answer = np.asarray([to_digit.get(int(t), -1) for t in row])
      results.append((int(np.sum(g > 0)), solved(answer, g)))
  givens = np.asarray([n for n, _ in results])
  ok = np.asarray([s for _, s in results])
  buckets = {"all": givens >= 0, "easy": givens >= 40, "medium": (givens >= 30) & (givens < 40), "hard": givens < 30}
  report = {name: float(ok[m].mean()) for name, m in buckets.items() if m.any()}
  report |= {f"{name}/count": int(m.sum()) for name, m in buckets.items()}
  print(json.dumps(report))
  return report


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
