"""compressed-tensors FP8 / NVFP4 checkpoints (the vLLM serving formats): dequantized weights equal the library's own
decompression, logits equal transformers loading the same checkpoint with `CompressedTensorsConfig(dequantize=True)`.

The checkpoints are tiny random DiffusionGemmas compressed by `compressed-tensors` itself (a test-only dependency),
with the experts either fused (`experts.gate_up_proj`, left dense as the library only compresses `nn.Linear`) or
one `nn.Linear` per expert (`experts.N.gate_proj/up_proj/down_proj`, quantized; the vLLM / llm-compressor layout).
transformers cannot load the per-expert layout for DiffusionGemma (it has no conversion mapping for it): there the
reference is transformers running the library's decompression of those experts, stacked into the fused layout.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import compressed_tensors  # noqa: E402,F401 - a test extra (pyproject), never skipped
import torch  # noqa: E402
from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             apply_quantization_config)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402
from conftest import make_hf_model, max_abs_diff  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import hackable_diffusion as hd  # noqa: E402
from hackable_diffusion.errors import CheckpointError  # noqa: E402
from hackable_diffusion.interop import quantized  # noqa: E402
from hackable_diffusion.interop.names import hf_tensor_names, iter_variables  # noqa: E402
from hackable_diffusion.model.transformer import forward  # noqa: E402

SLIDE, FULL = "sliding_attention", "full_attention"
SCHEMES = ("FP8_DYNAMIC", "FP8", "NVFP4")  # per-channel FP8, per-tensor FP8 (+ static input scales), NVFP4
WEIGHT_PARTS = ("weight", "weight_scale", "weight_packed", "weight_global_scale")


# ---- building checkpoints with compressed-tensors ----------------------------------------------------------------
def _calibrate(module: torch.nn.Module) -> None:
  """Min-max weight scales (what llm-compressor's default observer computes) for every quantized Linear."""
  for _, m in module.named_modules():
    scheme = getattr(m, "quantization_scheme", None)
    if scheme is None or scheme.weights is None:
      continue
    w, args = m.weight.data, scheme.weights
    if args.strategy == "channel":
      lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "tensor":
      lo, hi = w.amin(), w.amax()
    else:  # tensor_group (NVFP4)
      groups = w.unflatten(-1, (-1, args.group_size))
      lo, hi = groups.amin(-1), groups.amax(-1)
    global_scale = None
    if hasattr(m, "weight_global_scale"):
      global_scale = generate_gparam(w.amin(), w.amax())
      m.weight_global_scale.data.copy_(global_scale)
    scale, _ = calculate_qparams(lo, hi, args, global_scale=global_scale)
    m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))


def compress_with_library(module: torch.nn.Module, scheme: str) -> ModelCompressor:
  """Quantizes every Linear of `module` (but the vision tower and the tied lm_head) with the preset `scheme` and
  compresses it in place, as llm-compressor does before saving."""
  config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])},
                              ignore=["lm_head", "re:.*vision.*"], quantization_status="frozen")
  apply_quantization_config(module, config, show_progress=False)
  _calibrate(module)
  compressor = ModelCompressor.from_pretrained_model(module)
  compressor.compress_model(module)
  return compressor


def _linear_experts(ref) -> torch.nn.Module:
  """The decoder experts of `ref` as one `nn.Linear` per expert and projection, named as in vLLM checkpoints
  (`model.decoder.layers.L.experts.N.gate_proj.weight`)."""
  root = torch.nn.Module()
  root.model = torch.nn.Module()
  root.model.decoder = torch.nn.Module()
  layers = torch.nn.ModuleList()
  for layer in ref.model.decoder.layers:
    gate_up, down = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    experts = torch.nn.ModuleList()
    for e in range(gate_up.shape[0]):
      expert = torch.nn.Module()
      for name, w in (("gate_proj", gate_up[e, :inter]), ("up_proj", gate_up[e, inter:]), ("down_proj", down[e])):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data.copy_(w)
        setattr(expert, name, linear)
      experts.append(expert)
    holder = torch.nn.Module()
    holder.experts = experts
    layers.append(holder)
  root.model.decoder.layers = layers
  return root


def _save_shards(tensors: dict[str, torch.Tensor], path: str, num: int) -> None:
  """`tensors` in `num` shard files with an index; a layer's parts land in different files."""
  os.remove(os.path.join(path, "model.safetensors"))
  names = sorted(tensors)
  weight_map = {}
  for i in range(num):
    file = f"model-{i + 1:05d}-of-{num:05d}.safetensors"
    shard = {n: tensors[n].contiguous() for n in names[i::num]}
    save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture(scope="module")
def source():
  return make_hf_model(0, layer_types=[SLIDE, FULL, FULL])


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
  """(scheme, layout) -> checkpoint directory, built once per module."""
  cache: dict[tuple[str, str], str] = {}

  def build(scheme: str, layout: str) -> str:
    if (scheme, layout) in cache:
      return cache[scheme, layout]
    fused = cache.get((scheme, "fused"))
    if fused is None:
      model = copy.deepcopy(source)
      compressor = compress_with_library(model, scheme)
      fused = str(tmp_path_factory.mktemp(f"{scheme}_fused"))
      model.save_pretrained(fused)
      compressor.update_config(fused)
      cache[scheme, "fused"] = fused
    if layout == "experts":  # the fused checkpoint with its dense experts replaced by per-expert quantized ones
      path = str(tmp_path_factory.mktemp(f"{scheme}_experts"))
      tensors = load_file(os.path.join(fused, "model.safetensors"))
      tensors = {k: v for k, v in tensors.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
      experts = _linear_experts(source)
      compress_with_library(experts, scheme)
      tensors.update(experts.state_dict())
      for name in os.listdir(fused):
        if name != "model.safetensors":
          with open(os.path.join(fused, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
            dst.write(src.read())
      save_file({}, os.path.join(path, "model.safetensors"))
      _save_shards(tensors, path, 3)
      cache[scheme, layout] = path
    return cache[scheme, layout]

  return build


# ---- the reference: compressed-tensors' own decompression --------------------------------------------------------
def _stored(path: str) -> dict[str, torch.Tensor]:
  index = os.path.join(path, "model.safetensors.index.json")
  files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [
      "model.safetensors"]
  out = {}
  for file in files:
    out.update(load_file(os.path.join(path, file)))
  return out


def _ct_decompress(path: str, tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
  """compressed-tensors' decompression of the layer `prefix` (e.g. 'model.decoder.layers.0.mlp.up_proj.')."""
  qc = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
  group = qc["config_groups"]["group_0"]
  compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])
  state = {part: tensors[prefix + part] for part in WEIGHT_PARTS if prefix + part in tensors}
  return compressor.decompress(state, QuantizationScheme.model_validate(group))["weight"]


def _quantized_prefixes(tensors: dict[str, torch.Tensor]) -> list[str]:
  return sorted(k[: -len("weight_scale")] for k in tensors
                if k.endswith(".weight_scale") and k.startswith("model.decoder."))


def _variable(model, name: str) -> np.ndarray:
  path, transpose = hf_tensor_names(model)[name]
  value = np.asarray(dict(iter_variables(model))[path][...].astype(jnp.float32))
  return value.T if transpose else value


def _expert_reference(path: str, tensors: dict[str, torch.Tensor], layer: int, num: int) -> dict[str, np.ndarray]:
  """compressed-tensors' decompression of one layer's per-expert weights, stacked into the fused layout."""
  p = f"model.decoder.layers.{layer}.experts."
  gate_up = [torch.cat([_ct_decompress(path, tensors, f"{p}{e}.gate_proj."),
                        _ct_decompress(path, tensors, f"{p}{e}.up_proj.")]) for e in range(num)]
  down = [_ct_decompress(path, tensors, f"{p}{e}.down_proj.") for e in range(num)]
  return {p + "gate_up_proj": torch.stack(gate_up).float().numpy(), p + "down_proj": torch.stack(down).float().numpy()}


def _reference_model(checkpoints, scheme: str, layout: str):
  """transformers loading the checkpoint with `CompressedTensorsConfig(dequantize=True)` (per-expert layout: the
  fused checkpoint's model, with its experts replaced by the decompressed per-expert weights)."""
  from transformers import DiffusionGemmaForBlockDiffusion
  from transformers.utils.quantization_config import CompressedTensorsConfig

  ref = DiffusionGemmaForBlockDiffusion.from_pretrained(
      checkpoints(scheme, "fused"), quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
  if layout == "experts":
    path = checkpoints(scheme, layout)
    tensors = _stored(path)
    with torch.no_grad():
      for i, layer in enumerate(ref.model.decoder.layers):
        stacked = _expert_reference(path, tensors, i, layer.experts.gate_up_proj.shape[0])
        p = f"model.decoder.layers.{i}.experts."
        for module in (layer, ref.model.encoder.language_model.layers[i]):
          module.experts.gate_up_proj.copy_(torch.from_numpy(stacked[p + "gate_up_proj"]))
          module.experts.down_proj.copy_(torch.from_numpy(stacked[p + "down_proj"]))
  return ref


def _logits_pair(ref, ours) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(1)
  ids, canvas = rng.integers(3, 125, (2, 9)), rng.integers(3, 125, (2, 6))
  with torch.no_grad():
    expected = ref(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.numpy()
  got = np.asarray(forward(ours, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32)))
  return got, expected


# ---- tests -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["fused", "experts"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_weights_equal_compressed_tensors(checkpoints, scheme, layout):
  path = checkpoints(scheme, layout)
  tensors = _stored(path)
  ours = hd.load_pretrained(path)  # float32, the checkpoint's dtype
  assert ours.config.param_dtype == "float32"
  prefixes = [p for p in _quantized_prefixes(tensors) if ".experts." not in p]
  assert len(prefixes) >= 20  # attention, MLP and router projections of 3 layers, self-conditioning MLP
  for prefix in prefixes:
    expected = _ct_decompress(path, tensors, prefix).float().numpy()
    # FP8: exact; NVFP4: compressed-tensors decompresses to bfloat16 and so do we (`quantized.dequantize`)
    np.testing.assert_array_equal(_variable(ours, prefix + "weight"), expected, err_msg=prefix)
  if layout == "experts":
    for i in range(3):
      for name, expected in _expert_reference(path, tensors, i, 4).items():
        np.testing.assert_array_equal(_variable(ours, name), expected, err_msg=name)
  else:  # dense experts load as stored
    name = "model.decoder.layers.1.experts.gate_up_proj"
    np.testing.assert_array_equal(_variable(ours, name), tensors[name].numpy())


@pytest.mark.parametrize("layout", ["fused", "experts"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_equal_transformers(checkpoints, scheme, layout):
  ref = _reference_model(checkpoints, scheme, layout)
  ours = hd.load_pretrained(checkpoints(scheme, layout))
  got, expected = _logits_pair(ref, ours)
  assert np.abs(expected).max() > 1.0
  assert max_abs_diff(got, expected) <= 1e-4, (scheme, layout)


def test_quantization_changes_the_weights(checkpoints, source):
  # the comparison above is not vacuous: NVFP4 weights really are 4-bit (far from the source), FP8 close to it
  w = source.model.decoder.layers[0].mlp.up_proj.weight.detach().numpy()
  for scheme, (lo, hi) in (("FP8_DYNAMIC", (1e-5, 0.05)), ("NVFP4", (0.02, 0.3))):
    ours = hd.load_pretrained(checkpoints(scheme, "fused"))
    rel = np.abs(_variable(ours, "model.decoder.layers.0.mlp.up_proj.weight") - w).max() / np.abs(w).max()
    assert lo < rel < hi, (scheme, rel)


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "NVFP4"])
def test_bf16_load_equals_bf16_decompression(checkpoints, scheme):
  path = checkpoints(scheme, "experts")
  tensors = _stored(path)
  ours = hd.load_pretrained(path, dtype=jnp.bfloat16)
  prefix = "model.decoder.layers.2.self_attn.q_proj."
  expected = _ct_decompress(path, tensors, prefix).to(torch.bfloat16).float().numpy()
  np.testing.assert_array_equal(_variable(ours, prefix + "weight"), expected)
  name = "model.decoder.layers.0.experts.down_proj"
  expected = _expert_reference(path, tensors, 0, 4)[name]
  np.testing.assert_array_equal(_variable(ours, name), np.asarray(jnp.asarray(expected, jnp.bfloat16), np.float32))


_MESH_WORKER = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import jax, numpy as np
from flax import nnx
import hackable_diffusion as hd
from hackable_diffusion import sharding as sh
path = sys.argv[1]
host = hd.load_pretrained(path)
mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=2, tensor=1, expert=2))
sharded = hd.load_pretrained(path, mesh=mesh)
out = {}
for name, a, b in (("experts", host.layers[0].experts.gate_up_proj, sharded.layers[0].experts.gate_up_proj),
                   ("down_proj", host.layers[1].mlp.down_proj.kernel, sharded.layers[1].mlp.down_proj.kernel),
                   ("q_proj", host.layers[2].self_attn.q_proj.kernel, sharded.layers[2].self_attn.q_proj.kernel)):
  b = b[...]
  out[name] = {"equal": bool(np.array_equal(np.asarray(a[...]), np.asarray(b))), "devices": len(b.sharding.device_set),
               "shard_shapes": sorted({s.data.shape for s in b.addressable_shards})}
state = nnx.state(sharded)
out["shardings_match"] = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
                             zip(jax.tree.leaves(state), jax.tree.leaves(sh.state_shardings(mesh, state))))
print(json.dumps(out))
"""


def test_sharded_load_dequantizes_on_fake_devices(checkpoints):
  # `load_pretrained(mesh=)` (`place_in_shards`) on 4 fake CPU devices: quantized and per-expert weights are read
  # whole with their scales, dequantized, stacked and sliced into their shards; equal to the one-device load
  path = checkpoints("NVFP4", "experts")
  proc = subprocess.run([sys.executable, "-c", _MESH_WORKER, path], capture_output=True, text=True, timeout=600,
                        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report.pop("shardings_match") is True  # every variable in the sharding its logical axes give
  for name, r in report.items():
    assert r["equal"], (name, r)
  assert report["experts"]["devices"] == 4 and len(report["experts"]["shard_shapes"]) == 1
  assert any(shape != [4, 32, 32] for shape in report["experts"]["shard_shapes"]), report  # really split


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "NVFP4"])
def test_bf16_checkpoint_bf16_scales(source, tmp_path, scheme):
  # the published checkpoints are bfloat16: FP8 scales are then bfloat16 too, and the product is rounded to bfloat16
  model = copy.deepcopy(source).to(torch.bfloat16)
  compressor = compress_with_library(model, scheme)
  model.save_pretrained(str(tmp_path))
  compressor.update_config(str(tmp_path))
  tensors = _stored(str(tmp_path))
  ours = hd.load_pretrained(str(tmp_path))  # 'auto': the checkpoint's bfloat16
  assert ours.config.param_dtype == "bfloat16"
  prefixes = [p for p in _quantized_prefixes(tensors) if ".experts." not in p]
  if scheme == "FP8_DYNAMIC":
    assert tensors[prefixes[0] + "weight_scale"].dtype == torch.bfloat16
  for prefix in prefixes:
    expected = _ct_decompress(str(tmp_path), tensors, prefix)
    assert expected.dtype == torch.bfloat16
    np.testing.assert_array_equal(_variable(ours, prefix + "weight"), expected.float().numpy(), err_msg=prefix)


def test_dequantize_nvfp4_unrounded_is_within_half_a_bf16_ulp(checkpoints):
  path = checkpoints("NVFP4", "fused")
  tensors = _stored(path)
  prefix = "model.decoder.layers.0.mlp.gate_proj."
  parts = {p: prefix + p for p in WEIGHT_PARTS if prefix + p in tensors}
  raw = lambda n: tensors[n].view(torch.uint8).numpy() if tensors[n].dtype == torch.float8_e4m3fn else (  # noqa: E731
      tensors[n].numpy())  # numpy has no float8: the scales as raw bytes
  weight = quantized.read_quantized(parts, raw)
  assert weight.kind == quantized.NVFP4 and weight.data.shape == (64, 16) and weight.shape == (64, 32)
  exact = quantized.dequantize(weight, nvfp4_rounding=None)
  rounded = quantized.dequantize(weight)
  np.testing.assert_array_equal(rounded, _ct_decompress(path, tensors, prefix).float().numpy())
  assert np.all(np.abs(exact - rounded) <= np.abs(exact) * 2.0 ** -8)  # bf16: 8 significant bits
  assert not np.array_equal(exact, rounded)


# ---- refusals ----------------------------------------------------------------------------------------------------
def _copy(src: str, dst) -> None:
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f:
      (dst / name).write_bytes(f.read())


def _one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  return msg


@pytest.mark.parametrize("edit, field", [
    (lambda q: q.update(quant_method="fp8"), "quant_method='fp8'"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status='frozen'"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme="),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config="),
    (lambda q: q.update(something_new=1), "something_new=1"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128]),
     "config_groups.group_0.weights.block_structure"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
     "config_groups.group_0.weights.strategy='group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int"), "config_groups.group_0.weights.type='int'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False),
     "config_groups.group_0.weights.symmetric=False"),
    (lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
     "config_groups.group_0.output_activations="),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"), "config_groups.group_0.format="),
])
def test_unsupported_quantization_config_names_the_field(checkpoints, tmp_path, edit, field):
  _copy(checkpoints("FP8_DYNAMIC", "fused"), tmp_path)
  config = json.load(open(tmp_path / "config.json"))
  edit(config["quantization_config"])
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert field in _one_line(e) and "config.json" in str(e.value)


def test_fp8_weight_without_scale_is_refused(checkpoints, tmp_path):
  _copy(checkpoints("FP8_DYNAMIC", "fused"), tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  del tensors["model.decoder.layers.1.mlp.up_proj.weight_scale"]
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "'model.decoder.layers.1.mlp.up_proj.weight'" in _one_line(e) and "F8_E4M3 without a weight_scale" in str(
      e.value)


def test_quantized_tensors_without_quantization_config_are_refused(checkpoints, tmp_path):
  _copy(checkpoints("NVFP4", "fused"), tmp_path)
  config = json.load(open(tmp_path / "config.json"))
  del config["quantization_config"]
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "weight_scale" in _one_line(e) and "no quantization_config" in str(e.value)


def test_missing_expert_names_the_tensor(checkpoints, tmp_path):
  _copy(checkpoints("FP8_DYNAMIC", "experts"), tmp_path)
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  for part in ("weight", "weight_scale"):
    name = f"model.decoder.layers.2.experts.3.up_proj.{part}"
    file = str(tmp_path / index["weight_map"][name])
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    del index["weight_map"][name]
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "missing tensor 'model.decoder.layers.2.experts.3.up_proj.weight'" in _one_line(e)


def test_quantized_lm_head_is_unexpected(checkpoints, tmp_path):
  # a separately stored (and quantized) lm_head cannot be represented by a model whose head is tied to the embedding
  _copy(checkpoints("FP8_DYNAMIC", "fused"), tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  tensors["lm_head.weight"] = tensors["model.decoder.layers.0.mlp.up_proj.weight"].clone()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "unexpected tensor 'lm_head.weight'" in _one_line(e)


def test_quantized_encoder_copy_alone_loads(checkpoints, tmp_path):
  # transformers writes both tied copies of a compressed layer; either one alone is enough
  path = checkpoints("NVFP4", "fused")
  _copy(path, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  prefix = "model.decoder.layers.1.mlp.up_proj."
  for part in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
    del tensors[prefix + part]
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  np.testing.assert_array_equal(_variable(hd.load_pretrained(str(tmp_path)), prefix + "weight"),
                                _variable(hd.load_pretrained(path), prefix + "weight"))
