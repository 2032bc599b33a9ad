"""scripts/sudoku_transformers.py, the main job's export solved in plain transformers, against `hd.generate` on a
small checkpoint: the prompt the export's own tokenizer files build equals the one a run trains on, and with the
givens pinned and sampling restricted to the digits (its `PinnedDigits` logits processor vs `hd.generate`'s `pinned`
/ `allowed_token_ids`) both samplers give the same canvases in the deterministic regime (temperature ~1e-4: the
argmax; entropy bound 1e9: every position accepted)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import hackable_diffusion as hd
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.tasks.sudoku import formatting, solver
from hackable_diffusion.tasks.sudoku.cell_prompt import cell_prompt

torch = pytest.importorskip("torch")
hf_gen = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
sudoku_transformers = pytest.importorskip("sudoku_transformers")  # scripts/ (tests/conftest.py puts it on the path)

PUZZLES = ["530070000600195000098000060800060003400803001700020006060000280000419005000080079",
           "000260701680070090190004500820100040004602900050003028009300074040050036703018000"]
SOLUTIONS = ["534678912672195348198342567859761423426853791713924856961537284287419635345286179",
             "435269781682571493197834562826195347374682915951743628519326874248957136763418259"]
STEPS = 4


@pytest.fixture(scope="module")
def export(hf_factory, tmp_path_factory):
  """A tiny random DiffusionGemma with an 81-token canvas, saved with the tokenizer a main-job run trains (and its
  chat template): what `export --format=merged` of such a run holds."""
  ref, path = hf_factory("sudoku_transformers", vocab=256, canvas=81)
  work = tmp_path_factory.mktemp("sudoku_tokenizer")
  data = work / "train.jsonl"
  grids = [formatting.parse_grid(p) for p in PUZZLES]
  data.write_text("".join(json.dumps(formatting.to_record(g, solver.solve(g))) + "\n" for g in grids), encoding="utf-8")
  raw = config_lib.load_config_file("sudoku.py", {"data.train_path": str(data)})
  tok = run_lib.build_tokenizer(config_lib.ExperimentConfig.from_config_dict(raw), str(work), str(data))
  out = tmp_path_factory.mktemp("sudoku_export")
  shutil.copytree(path, out, dirs_exist_ok=True)
  for name in ("tokenizer.model", "chat_template.jinja"):
    shutil.copy(work / name, out / name)
  return ref, str(out), tok


def test_the_exports_files_build_the_training_prompt(export):
  _, path, tok = export
  encode = sudoku_transformers.PromptEncoder(path)
  for puzzle in PUZZLES:
    assert encode(puzzle) == tok.encode(cell_prompt(formatting.parse_grid(puzzle)))
    assert encode(puzzle.replace("0", ".")) == encode(puzzle)
  assert encode.digit_ids() == list(tok.token_ids_for("123456789"))


def test_pinned_digits_in_transformers_equal_hd_generate(export):
  ref, path, tok = export
  encode = sudoku_transformers.PromptEncoder(path)
  digit_ids = encode.digit_ids()
  grids = np.stack([sudoku_transformers.grid_of(p) for p in PUZZLES])
  prompt_ids = np.asarray([encode(p) for p in PUZZLES])
  seed, pinned = sudoku_transformers.start_canvas(grids, digit_ids, 256, np.random.default_rng(0))
  theirs = sudoku_transformers.generate(
      ref, prompt_ids, seed, pinned, digit_ids, STEPS, t_min=1e-4, t_max=2e-4, pad_token_id=0,
      sampler_config=hf_gen.EntropyBoundSamplerConfig(entropy_bound=1e9))
  cfg = hd.SamplingConfig(t_min=1e-4, t_max=2e-4, entropy_bound=1e9, max_new_tokens=81, max_denoising_steps=STEPS,
                          early_stopping=False, pad_token_id=0)
  ours = hd.generate(hd.load_pretrained(path), prompt_ids, cfg, rng=jax.random.key(0), seed_canvas=seed,
                     pinned=pinned, allowed_token_ids=digit_ids)
  ours = np.asarray(ours.sequences)[:, prompt_ids.shape[1]:]
  np.testing.assert_array_equal(theirs, ours)
  assert np.all(theirs[pinned] == seed[pinned])  # the givens held
  assert set(np.unique(theirs)) <= set(digit_ids)  # digits only
  assert os.path.isfile(os.path.join(path, "config.json"))
