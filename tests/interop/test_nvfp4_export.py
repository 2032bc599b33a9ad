"""NVFP4 export (`save_pretrained(..., quantize='nvfp4' | 'nvfp4-linear')`, `export --quantize=nvfp4`).

- the tensors are the ones compressed-tensors itself writes for its NVFP4A16 preset (packed E2M1 codes, float8
  block scales per 16 inputs, float32 global scale), bit for bit, with the global scale shared by the weights vLLM
  fuses (q/k/v, gate/up, each expert's gate/up); the experts packed per expert in 'nvfp4';
- transformers 5.23 loads 'nvfp4-linear' with `CompressedTensorsConfig(dequantize=True)` (no missing or unexpected
  key, logits equal to our loader's); its plain `from_pretrained` of any NVFP4 DiffusionGemma fails while tying
  the encoder to the decoder (the test pins that, the library's own save included);
- `hd.load_pretrained` reads both back within NVFP4 error.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import make_hf_model, max_abs_diff
from interop.test_fp8_export import (LAYER_TYPES, export_cli, expert_names, inputs, library_reference, our_logits,
                                     plain_transformers, relative_error, stored, torch_logits)
from interop.test_quantized import _variable

import hackable_diffusion as hd
from hackable_diffusion.interop import quantized, quantized_export

PARTS = ("weight_packed", "weight_scale", "weight_global_scale")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(source model, its HF directory, {mode: our float32 export}, the library's NVFP4A16 tensors)."""
  source = make_hf_model(0, layer_types=LAYER_TYPES)
  base = str(tmp_path_factory.mktemp("nvfp4_base"))
  source.save_pretrained(base)
  model = hd.load_pretrained(base)
  outs = {}
  for mode in ("nvfp4", "nvfp4-linear"):
    outs[mode] = str(tmp_path_factory.mktemp(mode))
    hd.save_pretrained(model, outs[mode], dtype="float32", quantize=mode, vision_source=base)
  return source, base, outs, library_reference(source, "NVFP4A16")


def _check_equal_to_library(ours, library, names):
  for name in names:
    a, b = ours[name], library[name]
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == torch.float8_e4m3fn:
      a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b), name


def test_nvfp4_linear_tensors_equal_compressed_tensors(exported):
  _, _, outs, library = exported
  ours = stored(outs["nvfp4-linear"])
  packed = sorted(k for k in ours if k.endswith("weight_packed"))
  assert packed == sorted(k for k in library if k.endswith("weight_packed") and ".experts." not in k)
  assert any(k.startswith("model.encoder.language_model.") for k in packed)
  assert not any(".router." in k or "self_conditioning" in k for k in packed)
  _check_equal_to_library(ours, library, [k[: -len("weight_packed")] + part for k in packed for part in PARTS])
  assert not any(k.endswith("input_global_scale") for k in ours)  # weights only (NVFP4A16)
  assert ours["model.decoder.layers.0.experts.gate_up_proj"].dtype == torch.float32
  config = json.load(open(os.path.join(outs["nvfp4-linear"], "config.json")))["quantization_config"]
  assert config == quantized_export.quantization_config("nvfp4-linear")
  assert quantized.parse_quantization_config({"quantization_config": config}, "config.json").kinds == {"nvfp4"}


def test_nvfp4_experts_are_packed_per_expert_equal_to_compressed_tensors(exported):
  source, _, outs, library = exported
  ours = stored(outs["nvfp4"])
  num, layers = source.config.text_config.num_experts, source.config.text_config.num_hidden_layers
  names = expert_names(ours)
  assert names == expert_names(library) and len(names) == layers * num * 3 * len(PARTS)
  assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in ours)
  p = "model.decoder.layers.1.experts.3."
  assert ours[p + "up_proj.weight_packed"].dtype == torch.uint8 and tuple(ours[p + "up_proj.weight_packed"].shape) == (
      16, 16)
  assert ours[p + "down_proj.weight_scale"].dtype == torch.float8_e4m3fn and tuple(
      ours[p + "down_proj.weight_scale"].shape) == (32, 1)
  _check_equal_to_library(ours, library, names)


def test_nvfp4_global_scales_are_shared_as_vllm_fuses(exported):
  _, _, outs, _ = exported
  ours = stored(outs["nvfp4"])
  groups: dict[str, set[float]] = {}
  for k, v in ours.items():
    if k.endswith("weight_global_scale") and k.startswith("model.decoder."):
      key = re.sub(r"\.(gate|up)_proj\.", ".gate_up.", re.sub(r"\.[qkv]_proj\.", ".qkv.", k))
      groups.setdefault(key, set()).add(float(v))
  assert all(len(values) == 1 for values in groups.values()), groups
  q, k = (ours[f"model.decoder.layers.1.self_attn.{p}_proj.weight_global_scale"] for p in "qk")
  assert torch.equal(q, k) and not torch.equal(q, ours["model.decoder.layers.1.self_attn.o_proj.weight_global_scale"])


def test_nvfp4_linear_loads_in_transformers_with_dequantize(exported):
  """`dequantize=True`: no missing / unexpected key, logits equal ours. Plain `from_pretrained` fails on any NVFP4
  DiffusionGemma in transformers 5.23 (its tie step looks up `weight` on the compressed layers), the library's own
  save included; if this starts to pass, update docs."""
  from transformers import DiffusionGemmaForBlockDiffusion
  from transformers.utils.quantization_config import CompressedTensorsConfig

  source, _, outs, _ = exported
  model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(
      outs["nvfp4-linear"], quantization_config=CompressedTensorsConfig(dequantize=True), output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  ids, canvas = inputs()
  got = torch_logits(model, ids, canvas)
  assert np.isfinite(got).all()
  assert max_abs_diff(our_logits(outs["nvfp4-linear"], ids, canvas), got) <= 1e-4
  with pytest.raises(AttributeError, match="has no attribute `weight`"):
    plain_transformers(outs["nvfp4-linear"])


def test_our_loader_reads_both_nvfp4_exports_within_nvfp4_error(exported, tmp_path):
  source, base, outs, _ = exported
  ids, canvas = inputs()
  exact = torch_logits(source, ids, canvas)
  linear, full = our_logits(outs["nvfp4-linear"], ids, canvas), our_logits(outs["nvfp4"], ids, canvas)
  # NVFP4 weights only on a tiny random model with the embedding x10 (measured ranges: docs/results.md); a wrong
  # global or block scale gives a median error of order 100%. FP8 of the same model errs less.
  for got in (linear, full):
    worst, typical = relative_error(got, exact)
    assert 0 < worst <= 1.6 and typical <= 0.15, (worst, typical)
  fp8 = str(tmp_path / "fp8")
  hd.save_pretrained(hd.load_pretrained(base), fp8, dtype="float32", quantize="fp8", vision_source=base)
  assert relative_error(our_logits(fp8, ids, canvas), exact)[1] < relative_error(full, exact)[1]
  assert max_abs_diff(linear, full) > 0
  tensors = stored(outs["nvfp4"])
  p = "model.decoder.layers.2.experts.1.down_proj."
  weight = quantized.QuantizedWeight("nvfp4", tensors[p + "weight_packed"].numpy(),
                                     tensors[p + "weight_scale"].view(torch.uint8).numpy(),
                                     tensors[p + "weight_global_scale"].numpy(), (32, 16))
  ours = _variable(hd.load_pretrained(outs["nvfp4"]), "model.decoder.layers.2.experts.down_proj")
  np.testing.assert_array_equal(ours[1], quantized.dequantize(weight))


def test_nvfp4_rounding_matches_the_e2m1_grid():
  x = np.array([0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 9.0, -0.75, -0.2, -6.0, -2.9], np.float32)
  values = quantized_export.nvfp4_values(quantized_export.pack_fp4(quantized_export.fp4_codes(x)))
  np.testing.assert_array_equal(values, [0, 0.5, 1, 1, 1.5, 2, 2, 3, 4, 4, 6, 6, -1, -0.0, -6, -3])


def test_export_cli_nvfp4(exported, tmp_path):
  _, base, _, _ = exported
  out = tmp_path / "merged_nvfp4"
  res = export_cli([f"--checkpoint={base}", f"--out={out}", "--format=merged", "--quantize=nvfp4"])
  assert res.returncode == 0, res.stderr[-2000:]
  config = json.loads((out / "config.json").read_text())
  assert config["quantization_config"] == quantized_export.quantization_config("nvfp4")
  tensors = stored(str(out))
  assert tensors["model.decoder.layers.0.experts.0.gate_proj.weight_packed"].dtype == torch.uint8
  assert tensors["model.decoder.layers.0.router.proj.weight"].dtype == torch.bfloat16
  ids, canvas = inputs()
  assert np.isfinite(our_logits(str(out), ids, canvas)).all()


def _rewrite(src: str, dst, edit) -> str:
  """A copy of the export `src` in `dst` with its tensors passed through `edit(dict) -> dict`."""
  from safetensors.torch import save_file

  os.makedirs(dst, exist_ok=True)
  for name in os.listdir(src):
    if name != "model.safetensors":
      with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
        g.write(f.read())
  save_file(edit(dict(stored(src))), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  return str(dst)


def test_vllm_layout_check_passes_the_exports_and_catches_layout_errors(exported, tmp_path):
  """scripts/check_vllm_layout.py: every check passes on the exports; a quantized router, a quantized fused expert
  tensor, a missing expert, unequal q/k global scales and a stray v_proj on a full-attention layer each fail."""
  import check_vllm_layout

  _, _, outs, _ = exported
  for path in outs.values():
    assert all(ok for _, ok, _ in check_vllm_layout.check(path)), check_vllm_layout.check(path)
  nvfp4 = outs["nvfp4"]
  p = "model.decoder.layers.1."

  def quantized_router(t):
    t[p + "router.proj.weight_scale"] = torch.ones(4, 1)
    return t

  def missing_expert(t):
    return {k: v for k, v in t.items() if ".experts.3.up_proj." not in k}

  def unequal_global(t):
    t[p + "self_attn.q_proj.weight_global_scale"] = t[p + "self_attn.q_proj.weight_global_scale"] * 2
    return t

  def v_on_full(t):
    t[p + "self_attn.v_proj.weight_packed"] = t[p + "self_attn.k_proj.weight_packed"].clone()
    return t

  def fused_quantized(t):
    t[p + "experts.gate_up_proj"] = torch.zeros(4, 32, 32, dtype=torch.uint8)
    return t

  for i, edit in enumerate((quantized_router, missing_expert, unequal_global, v_on_full, fused_quantized)):
    rows = check_vllm_layout.check(_rewrite(nvfp4, tmp_path / str(i), edit))
    assert not all(ok for _, ok, _ in rows), edit.__name__
