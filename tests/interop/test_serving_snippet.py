"""docs/checkpoints.md's transformers serving snippet runs as written on a merged export of a tiny model."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import hackable_diffusion as hd
from hackable_diffusion.interop import export as export_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serving_snippet() -> str:
  text = open(os.path.join(REPO, "docs", "checkpoints.md"), encoding="utf-8").read()
  m = re.search(r"<!-- serve-snippet[^>]*-->\n```python\n(.*?)```", text, re.S)
  assert m, "docs/checkpoints.md lost its transformers serving snippet"
  return m.group(1)


@pytest.fixture(scope="module")
def merged_export(hf_factory, tmp_path_factory):
  _, path = hf_factory("serving_base")
  out = tmp_path_factory.mktemp("serving") / "exports" / "merged"
  export_lib.export_merged(hd.load_pretrained(path), str(out))  # the default: bf16, as served
  return str(out), hd.load_pretrained(path).config


def test_serving_snippet_runs_on_a_merged_export(merged_export, monkeypatch):
  from transformers import DiffusionGemmaForBlockDiffusion

  out, config = merged_export
  _, info = DiffusionGemmaForBlockDiffusion.from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  monkeypatch.chdir(os.path.dirname(os.path.dirname(out)))  # the snippet names exports/merged
  scope: dict = {}
  exec(compile(serving_snippet(), "docs/checkpoints.md", "exec"), scope)  # noqa: S102 - the documented snippet
  new = scope["new_tokens"].numpy()
  canvases = -(-8 // config.canvas_length)  # max_new_tokens rounds up to whole canvases
  assert new.shape == (1, canvases * config.canvas_length)
  assert np.all((new >= 0) & (new < config.vocab_size))
  assert float(scope["out"].tokens_per_forward[0]) > 0
