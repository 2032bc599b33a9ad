"""FP8 export (`save_pretrained(..., quantize='fp8')`, `export --format=merged --quantize=fp8`): the tensors
compressed-tensors itself writes for its FP8_DYNAMIC preset, a config transformers + compressed-tensors loads with no
missing or unexpected keys, and logits within FP8 error of the unquantized model."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, max_abs_diff
from interop.test_quantized import compress_with_library
from safetensors.torch import load_file

import hackable_diffusion as hd
from hackable_diffusion.interop import fp8_export
from hackable_diffusion.model.transformer import forward

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLIDE, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(transformers source model, its HF directory, our FP8 export of it, compressed-tensors' FP8_DYNAMIC of it)."""
  source = make_hf_model(0, layer_types=[SLIDE, FULL, FULL])
  base = str(tmp_path_factory.mktemp("fp8_base"))
  source.save_pretrained(base)
  ours = str(tmp_path_factory.mktemp("fp8_ours"))
  hd.save_pretrained(hd.load_pretrained(base), ours, dtype="float32", quantize="fp8", vision_source=base)
  library = copy.deepcopy(source)
  compress_with_library(library, "FP8_DYNAMIC")
  return source, base, ours, {k: v for k, v in library.state_dict().items() if "vision" not in k}


def test_tensors_equal_compressed_tensors_fp8_dynamic(exported):
  """Every tensor the library quantizes we quantize, bit for bit (per-channel min-max scales), and nothing else."""
  _, _, ours, library = exported
  stored = load_file(os.path.join(ours, "model.safetensors"))
  quantized = sorted(k for k in stored if k.endswith("weight_scale"))
  assert quantized and quantized == sorted(k for k in library if k.startswith("model.decoder") and
                                           k.endswith("weight_scale"))
  for scale_name in quantized:
    name = scale_name[:-len("_scale")]
    assert stored[name].dtype == torch.float8_e4m3fn and fp8_export.is_fp8_target(name)
    torch.testing.assert_close(stored[scale_name], library[scale_name], rtol=0, atol=0)
    assert torch.equal(stored[name].view(torch.uint8), library[name].view(torch.uint8)), name
  assert not any(v.dtype == torch.float8_e4m3fn for k, v in stored.items() if not fp8_export.is_fp8_target(k))


def test_transformers_loads_it_and_logits_are_within_fp8_error(exported):
  from transformers import DiffusionGemmaForBlockDiffusion
  from transformers.utils.quantization_config import CompressedTensorsConfig

  source, base, ours, _ = exported
  ref, info = DiffusionGemmaForBlockDiffusion.from_pretrained(
      ours, quantization_config=CompressedTensorsConfig(dequantize=True), output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  rng = np.random.default_rng(3)
  ids, canvas = rng.integers(3, 125, (2, 9)), rng.integers(3, 125, (2, 6))
  with torch.no_grad():
    fp8_logits = ref.eval()(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.numpy()
    exact = source(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.numpy()
  # our loader reads the FP8 export back to the same dequantized model as transformers
  mine = np.asarray(forward(hd.load_pretrained(ours), jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32)))
  assert max_abs_diff(mine, fp8_logits) <= 1e-4
  # FP8 error (the weights are bit for bit the library's FP8_DYNAMIC ones, test above): e4m3 keeps 3 mantissa bits,
  # a relative rounding of up to 1/16 per weight; on this tiny random model (embedding x10, so every error shows)
  # measured max 0.54 at a logit scale of 4.3 (12%), median 0.067 (1.6%)
  scale = float(np.max(np.abs(exact)))
  diff = np.abs(fp8_logits - exact)
  assert 0 < float(diff.max()) <= 0.15 * scale and float(np.median(diff)) <= 0.03 * scale, (diff.max(), scale)


def test_export_cli_quantize_fp8(exported, tmp_path):
  _, base, _, _ = exported
  out = tmp_path / "merged_fp8"
  res = subprocess.run([sys.executable, "-m", "hackable_diffusion.export", f"--checkpoint={base}", f"--out={out}",
                        "--format=merged", "--quantize=fp8"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert res.returncode == 0, res.stderr[-2000:]
  config = json.loads((out / "config.json").read_text())
  assert config["quantization_config"] == fp8_export.fp8_quantization_config()
  assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
  stored = load_file(str(out / "model.safetensors"))
  assert stored["model.decoder.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16  # the checkpoint's
  res = subprocess.run([sys.executable, "-m", "hackable_diffusion.export", f"--checkpoint={base}",
                        f"--out={tmp_path / 'p'}", "--format=peft", "--quantize=fp8"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1 and len(lines) == 1 and "--quantize" in lines[0]
