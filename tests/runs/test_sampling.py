"""`runs.sampling`: prompts encoded and checked as training does, infilling canvases (the sampling itself, on a
trained run, in tests/test_sample_cli.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import sampling


class CharTokenizer:
  """One token per character (ids 3..), as the char tokenizer of the tiny and Sudoku runs; 0 pad, 1 unk, 2 bos."""

  pad_id, unk_id, bos_id, eos_id = 0, 1, 2, -1

  def encode(self, text: str) -> list[int]:
    return [3 + ord(c) if c.isprintable() else self.unk_id for c in text]


def _run_config(name: str, **overrides):
  return config_lib.ExperimentConfig.from_config_dict(config_lib.load_config_file(name, overrides))


def test_sample_refuses_prompts_training_would_refuse(capsys):
  tok = CharTokenizer()
  sudoku = _run_config("sudoku_structured.py")  # the 81-digit prompt (sudoku.py's template: tests/tasks/sudoku)
  puzzle = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
  assert len(puzzle) == 81
  assert sampling.encode_prompt(tok, puzzle, sudoku) == tok.encode(puzzle)
  dotted = puzzle.replace("0", ".")
  grid = "\n".join(" ".join(dotted[r * 9:(r + 1) * 9]) for r in range(9))  # '.' blanks and whitespace: same cells
  assert sampling.encode_prompt(tok, grid, sudoku) == tok.encode(puzzle)
  for bad, why in (("1234567890123", r"\(13 characters\) is not a Sudoku puzzle: expected 81 cells .*got 13"),
                   ("1" * 123, r"\(123 characters\) is not a Sudoku puzzle: expected 81 cells .*got 123"),
                   (puzzle[:-1] + "x", r"is not a Sudoku puzzle: invalid character 'x' at position 80")):
    with pytest.raises(ConfigError, match=r"^prompt '.*' (\(81 characters\) )?" + why) as err:
      sampling.encode_prompt(tok, bad, sudoku)
    assert "\n" not in str(err.value)
  with pytest.raises(ConfigError, match="13 characters"):  # sample() checks every prompt before using the model
    sampling.sample(None, tok, [puzzle, "1234567890123"], sudoku, seed=0)

  tiny = _run_config("tiny.py")  # digits task, data.max_prompt_length=8, on_overlength='error'
  assert sampling.encode_prompt(tok, "5895382", tiny) == tok.encode("5895382")
  with pytest.raises(ConfigError, match=r"^the prompt is 9 tokens, longer than the run's "
                     r"data\.max_prompt_length=8 \(training refuses such prompts\); shorten it$"):
    sampling.encode_prompt(tok, "123456789", tiny)
  with_bos = _run_config("tiny.py", **{"data.add_bos": True})
  with pytest.raises(ConfigError, match=r"is 10 tokens"):  # bos and chat template count, as in training
    sampling.encode_prompt(tok, "123456", with_bos, chat_template="[{prompt}]x")
  with pytest.raises(ConfigError, match="max_prompt_length=8"):
    sampling.sample(None, tok, ["123456789"], tiny, seed=0)
  truncating = _run_config("tiny.py", **{"data.on_overlength": "truncate"})
  assert sampling.encode_prompt(tok, "123456789", truncating) == tok.encode("23456789")  # training keeps the end
  assert "keeping the last 8" in capsys.readouterr().err
  # without a run (a HF checkpoint) there are no run limits
  assert sampling.encode_prompt(tok, "1" * 123, None) == tok.encode("1" * 123)


def test_infill_canvas_pins_the_text_and_frees_the_placeholders():
  tok = CharTokenizer()
  ids, pins = sampling.infill_canvas(tok, "ab__c", placeholder="_", num_tokens=8, vocab_size=7, rows=2,
                                       pinned=True, seed=0)
  assert ids.shape == pins.shape == (2, 8) and ids.dtype == np.int32
  assert pins[0].tolist() == [True, True, False, False, True, False, False, False]
  assert ids[0, [0, 1, 4]].tolist() == tok.encode("abc") and (ids[0, pins[0] == 0] < 7).all()  # noise elsewhere
  assert np.array_equal(ids[0], ids[1]) and np.array_equal(pins[0], pins[1])
  ids2, pins2 = sampling.infill_canvas(tok, "ab##c", placeholder="#", num_tokens=8, vocab_size=7, rows=1,
                                         pinned=False, seed=0)
  assert not pins2.any() and np.array_equal(ids2[0], ids[0])  # --nopinned: the same start, nothing pinned
  with pytest.raises(ConfigError, match=r"--seed_canvas is 9 tokens, more than the 8"):
    sampling.infill_canvas(tok, "abc______", placeholder="_", num_tokens=8, vocab_size=7, rows=1, pinned=True,
                             seed=0)
  with pytest.raises(ConfigError, match=r"--placeholder='__': expected one character"):
    sampling.infill_canvas(tok, "a", placeholder="__", num_tokens=8, vocab_size=7, rows=1, pinned=True, seed=0)
