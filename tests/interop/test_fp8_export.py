"""FP8 export (`save_pretrained(..., quantize='fp8' | 'fp8-linear')`, `export --format=merged --quantize=...`).

- the tensors are the ones compressed-tensors itself writes for its FP8_DYNAMIC preset, bit for bit, with the
  same layers dense (router, self-conditioning, embedding, norms, vision), the experts included in 'fp8' (one
  tensor per expert and projection);
- 'fp8-linear' loads in plain transformers (`from_pretrained`, no quantization_config argument) with no missing or
  unexpected key and finite logits within FP8 error; 'fp8' does not (transformers has no loader for quantized
  DiffusionGemma experts: the test pins which keys it reports), and `hd.load_pretrained` reads both back.

Also the helpers of tests/interop/test_nvfp4_export.py: the library's own quantization of the same model with the
export's `ignore` list and NVFP4 global scales shared as vLLM fuses the layers.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from conftest import make_hf_model, max_abs_diff
from interop.test_quantized import _linear_experts, _variable
from safetensors.torch import load_file

import hackable_diffusion as hd
from hackable_diffusion.interop import quantized_export
from hackable_diffusion.model.transformer import forward

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLIDE, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDE, FULL, FULL]


# ---- the library's quantization of the same model (the reference) ----------------------------------------------
def _fused_key(name: str) -> str:
  """The vLLM fused matrix a module joins (q/k/v, gate/up, also per expert), else its own name."""
  return re.sub(r"\.(gate|up)_proj$", ".gate_up", re.sub(r"\.[qkv]_proj$", ".qkv", name))


def library_compress(module: torch.nn.Module, preset: str) -> dict[str, torch.Tensor]:
  """compressed-tensors' `preset` on every Linear of `module` but those the export leaves dense (its `ignore`),
  min-max weight scales (llm-compressor's default observer), NVFP4 global scales shared by the layers vLLM fuses
  (llm-compressor's fused-global-scale update); returns the compressed state dict."""
  config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                              ignore=quantized_export.IGNORE, quantization_status="frozen")
  apply_quantization_config(module, config, show_progress=False)
  quantized = {n: m for n, m in module.named_modules() if getattr(m, "quantization_scheme", None) is not None}
  amax: dict[str, float] = {}
  for name, m in quantized.items():
    amax[_fused_key(name)] = max(amax.get(_fused_key(name), 0.0), float(m.weight.detach().abs().max()))
  for name, m in quantized.items():
    w, args = m.weight.data, m.quantization_scheme.weights
    global_scale = None
    if args.strategy == "channel":
      lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:  # tensor_group (NVFP4)
      groups = w.unflatten(-1, (-1, args.group_size))
      lo, hi = groups.amin(-1), groups.amax(-1)
      a = torch.tensor(amax[_fused_key(name)])
      global_scale = generate_gparam(-a, a)
      m.weight_global_scale.data.copy_(global_scale)
    scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
    m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
  ModelCompressor.from_pretrained_model(module).compress_model(module)
  return {k: v for k, v in module.state_dict().items() if "vision" not in k}


def library_reference(source, preset: str) -> dict[str, torch.Tensor]:
  """The library's compression of `source` (fused experts stay dense) plus of its experts as one Linear each."""
  tensors = library_compress(copy.deepcopy(source), preset)
  tensors.update(library_compress(_linear_experts(source), preset))
  return tensors


def stored(path: str) -> dict[str, torch.Tensor]:
  return load_file(os.path.join(path, "model.safetensors"))


def inputs(seed: int = 3):
  rng = np.random.default_rng(seed)
  return rng.integers(3, 125, (2, 9)), rng.integers(3, 125, (2, 6))


def torch_logits(model, ids, canvas) -> np.ndarray:
  with torch.no_grad():
    return model.eval()(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.float().numpy()


def our_logits(path: str, ids, canvas) -> np.ndarray:
  return np.asarray(forward(hd.load_pretrained(path), jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32)))


def relative_error(got: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
  """(max, median) of |got - exact| over the largest |exact| logit."""
  diff, scale = np.abs(got - exact), float(np.max(np.abs(exact)))
  return float(diff.max()) / scale, float(np.median(diff)) / scale


def plain_transformers(path: str):
  """transformers' `from_pretrained` as users call it (compressed-tensors installed, no quantization_config)."""
  from transformers import DiffusionGemmaForBlockDiffusion

  return DiffusionGemmaForBlockDiffusion.from_pretrained(path, output_loading_info=True)


def export_cli(args: list[str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "hackable_diffusion.export", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def expert_names(tensors) -> list[str]:
  """The per-expert tensor names (`...experts.N.proj.part`)."""
  return sorted(k for k in tensors if re.search(r"\.experts\.\d+\.", k))


# ---- FP8 ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(source model, its HF directory, {mode: our float32 export}, the library's FP8_DYNAMIC tensors)."""
  source = make_hf_model(0, layer_types=LAYER_TYPES)
  base = str(tmp_path_factory.mktemp("fp8_base"))
  source.save_pretrained(base)
  model = hd.load_pretrained(base)
  outs = {}
  for mode in ("fp8", "fp8-linear"):
    outs[mode] = str(tmp_path_factory.mktemp(mode))
    hd.save_pretrained(model, outs[mode], dtype="float32", quantize=mode, vision_source=base)
  return source, base, outs, library_reference(source, "FP8_DYNAMIC")


def _check_equal_to_library(ours: dict[str, torch.Tensor], library: dict[str, torch.Tensor], names: list[str]):
  for name in names:
    assert ours[name].dtype == library[name].dtype, name
    if ours[name].dtype == torch.float8_e4m3fn:
      assert torch.equal(ours[name].view(torch.uint8), library[name].view(torch.uint8)), name
    else:
      torch.testing.assert_close(ours[name], library[name], rtol=0, atol=0, msg=name)


def test_fp8_linear_tensors_equal_compressed_tensors(exported):
  """Every linear layer the library quantizes (with the export's ignore list) we quantize, bit for bit, under the
  decoder's and the encoder's names; the router, self-conditioning MLP and experts stay dense."""
  _, _, outs, library = exported
  ours = stored(outs["fp8-linear"])
  scales = sorted(k for k in ours if k.endswith("weight_scale"))
  assert scales == sorted(k for k in library if k.endswith("weight_scale") and ".experts." not in k)
  assert any(k.startswith("model.encoder.language_model.") for k in scales)
  assert not any(".router." in k or "self_conditioning" in k for k in scales)
  _check_equal_to_library(ours, library, scales + [k[: -len("_scale")] for k in scales])
  fp8 = {k for k, v in ours.items() if v.dtype == torch.float8_e4m3fn}
  assert fp8 == {k[: -len("_scale")] for k in scales}
  assert ours["model.decoder.layers.0.experts.gate_up_proj"].dtype == torch.float32
  config = json.load(open(os.path.join(outs["fp8-linear"], "config.json")))["quantization_config"]
  assert config == quantized_export.quantization_config("fp8-linear")
  assert quantized_export.IGNORE_EXPERTS in config["ignore"]


def test_fp8_experts_are_float8_per_expert_equal_to_compressed_tensors(exported):
  source, _, outs, library = exported
  ours = stored(outs["fp8"])
  num, layers = source.config.text_config.num_experts, source.config.text_config.num_hidden_layers
  names = expert_names(ours)
  assert names == expert_names(library) and len(names) == layers * num * 3 * 2  # 3 projections, weight + scale
  assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in ours)
  weight = ours["model.decoder.layers.1.experts.3.up_proj.weight"]
  assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == (16, 32)
  assert tuple(ours["model.decoder.layers.1.experts.3.down_proj.weight_scale"].shape) == (32, 1)
  _check_equal_to_library(ours, library, names)
  # the vLLM layout: decoder names only (vLLM maps encoder and decoder names to the same parameter)
  assert not any(k.startswith("model.encoder.language_model.") and k.endswith("weight_scale") for k in ours)
  assert quantized_export.IGNORE_EXPERTS not in json.load(open(os.path.join(outs["fp8"], "config.json")))[
      "quantization_config"]["ignore"]


def test_fp8_linear_loads_in_plain_transformers_within_fp8_error(exported):
  """Plain `from_pretrained`: no missing / unexpected keys, finite logits. compressed-tensors also quantizes the
  activations per token (FP8 dynamic, as vLLM serves it), so its logits differ from our weight-only dequantized
  forward; with `dequantize=True` they equal ours."""
  from transformers import DiffusionGemmaForBlockDiffusion
  from transformers.utils.quantization_config import CompressedTensorsConfig

  source, _, outs, _ = exported
  model, info = plain_transformers(outs["fp8-linear"])
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  ids, canvas = inputs()
  got, exact = torch_logits(model, ids, canvas), torch_logits(source, ids, canvas)
  assert np.isfinite(got).all()
  # FP8 weights and activations on a tiny random model with the embedding x10, which shows every error (measured
  # ranges: docs/results.md); a missing scale or a wrong layer gives NaN or a median error of order 100%
  worst, typical = relative_error(got, exact)
  assert 0 < worst <= 1.0 and typical <= 0.06, (worst, typical)
  dequantized = DiffusionGemmaForBlockDiffusion.from_pretrained(
      outs["fp8-linear"], quantization_config=CompressedTensorsConfig(dequantize=True))
  mine = our_logits(outs["fp8-linear"], ids, canvas)
  assert max_abs_diff(mine, torch_logits(dequantized, ids, canvas)) <= 1e-4


def test_fp8_with_experts_is_not_loadable_by_transformers(exported):
  """transformers 5.23 reports the per-expert tensors unexpected and the fused experts missing (it has no loader
  for quantized DiffusionGemma experts): the reason for 'fp8-linear'. If this starts to pass, update docs."""
  _, _, outs, _ = exported
  _, info = plain_transformers(outs["fp8"])
  assert {k.rsplit(".", 1)[-1] for k in info["missing_keys"] if "experts" in k} == {"gate_up_proj", "down_proj"}
  assert info["unexpected_keys"] and all(re.search(r"\.experts\.\d+\.", k) for k in info["unexpected_keys"])


def test_our_loader_reads_both_fp8_exports_within_fp8_error(exported):
  source, _, outs, _ = exported
  ids, canvas = inputs()
  exact = torch_logits(source, ids, canvas)
  linear, full = our_logits(outs["fp8-linear"], ids, canvas), our_logits(outs["fp8"], ids, canvas)
  # FP8 weights only (measured ranges: docs/results.md)
  for got in (linear, full):
    worst, typical = relative_error(got, exact)
    assert 0 < worst <= 1.0 and typical <= 0.06, (worst, typical)
  assert max_abs_diff(linear, full) > 0  # the experts are quantized in 'fp8' only
  model = hd.load_pretrained(outs["fp8"])
  tensors = stored(outs["fp8"])
  p = "model.decoder.layers.2.experts.1."
  expected = (tensors[p + "down_proj.weight"].float() * tensors[p + "down_proj.weight_scale"]).numpy()
  np.testing.assert_array_equal(_variable(model, "model.decoder.layers.2.experts.down_proj")[1], expected)


def test_export_cli_fp8_from_a_bf16_checkpoint(tmp_path):
  """The CLI on a bfloat16 checkpoint: 'fp8-linear' loads in plain transformers with logits within FP8 error of
  the bf16 model's; a PEFT export with --quantize is refused with one line."""
  source = make_hf_model(1, layer_types=LAYER_TYPES).to(torch.bfloat16)
  base = tmp_path / "bf16"
  source.save_pretrained(base)
  out = tmp_path / "merged_fp8"
  res = export_cli([f"--checkpoint={base}", f"--out={out}", "--format=merged", "--quantize=fp8-linear"])
  assert res.returncode == 0, res.stderr[-2000:]
  assert "quantized: fp8-linear" in res.stdout
  config = json.loads((out / "config.json").read_text())
  assert config["quantization_config"] == quantized_export.quantization_config("fp8-linear")
  tensors = stored(str(out))
  assert tensors["model.decoder.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16  # the checkpoint's
  model, info = plain_transformers(str(out))
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  ids, canvas = inputs(5)
  got, exact = torch_logits(model, ids, canvas), torch_logits(source, ids, canvas)
  assert np.isfinite(got).all()
  # FP8 weights and activations of a bf16 model (measured ranges: docs/results.md)
  worst, typical = relative_error(got, exact)
  assert worst <= 1.0 and typical <= 0.06, (worst, typical)
  res = export_cli([f"--checkpoint={base}", f"--out={tmp_path / 'p'}", "--format=peft", "--quantize=fp8"])
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 1 and len(lines) == 1 and "--quantize" in lines[0]
