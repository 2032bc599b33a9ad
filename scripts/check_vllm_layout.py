"""Checks the tensors of bf16 / FP8 / NVFP4 exports against what vLLM 0.33.0's DiffusionGemma loads; prints sizes.

  python scripts/check_vllm_layout.py            # export a tiny random model in every format, PASS/FAIL table
  python scripts/check_vllm_layout.py --list     # also list every exported tensor (name, shape, dtype)
  python scripts/check_vllm_layout.py --sizes [--preset=diffusion_gemma_26b_a4b]
                                                 # bytes per component and format, from abstract shapes
  python scripts/check_vllm_layout.py --errors   # logit error of each format on a tiny random model
                                                 # (needs transformers + compressed-tensors)

vLLM needs a GPU build, so the rules below are read from its source (vLLM 0.33.0 wheel) and encoded here:

1. Names (`DiffusionGemmaForBlockDiffusion.hf_to_vllm_mapper`, `model_executor/models/diffusion_gemma.py`):
   `model.decoder.self_conditioning.` -> `self_conditioning.`, `model.decoder.` and
   `model.encoder.language_model.` -> `model.` (the encoder copy and the decoder load the same parameter),
   `model.encoder.vision_tower.` -> `vision_tower.`, `model.encoder.embed_vision.` -> `embed_vision.`.
2. Stacked projections (`_gemma4_layer_weights_mapper`, `model_executor/models/gemma4.py`): `mlp.gate_proj` /
   `mlp.up_proj` -> `mlp.gate_up_proj` shards 0 / 1; `self_attn.{q,k,v}_proj` -> `self_attn.qkv_proj` shards q / k /
   v, except on full-attention layers (`attention_k_eq_v`, set in `DiffusionGemmaForBlockDiffusion.__init__`),
   which take `q_proj` and `k_proj` only (K loaded into the K and V shards) and have no `v_proj`.
3. Experts (`RoutedExperts.load_weights` and `build_expert_params_mapping`,
   `model_executor/layers/fused_moe/routed_experts.py`): a fused 3-D `experts.gate_up_proj` -> `experts.w13_weight`
   (chunked into w1 / w3), `experts.down_proj` -> `experts.w2_weight`, dense only (the fused mapping names the
   weight alone); per expert `experts.N.gate_proj.<part>` / `up_proj.<part>` -> `experts.w13_<part>` (shards w1 /
   w3 of expert N), `experts.N.down_proj.<part>` -> `experts.w2_<part>`.
4. Which modules are quantized (`CompressedTensorsConfig.get_quant_method` / `get_scheme_dict`,
   `layers/quantization/compressed_tensors/compressed_tensors.py`; `should_ignore_layer`, `.../utils.py`): the
   `LinearBase` layers built with the quantization config - qkv_proj, o_proj, mlp.gate_up_proj, mlp.down_proj - and
   the experts (`_add_fused_moe_to_target_scheme_map`: target `Linear` covers `RoutedExperts`;
   `CompressedTensorsMoEMethod.get_moe_method` checks `experts.0.gate_proj` against `ignore`), unless `ignore`
   matches them. Built without a quantization config, hence dense whatever the config says: the router projection
   (`Gemma4Router.proj`, a `GateLinear` without `quant_config`, gemma4.py) and the self-conditioning MLP
   (`DiffusionGemmaSelfConditioning`, plain `nn.Linear`, diffusion_gemma.py); any extra part there (a
   `weight_scale`) is "no module or parameter named" (`AutoWeightsLoader._load_module`, `models/utils.py`).
5. Parameters of a quantized module: FP8 channel-wise (`CompressedTensorsW8A8Fp8`, `schemes/compressed_tensors_w8a8_
   fp8.py`): `weight` float8 `[out, in]`, `weight_scale` `[out, 1]` (dynamic activations: no `input_scale`);
   experts (`CompressedTensorsW8A8Fp8MoEMethod.create_weights`, `compressed_tensors_moe/compressed_tensors_moe_w8a8_
   fp8.py`): `w13_weight` / `w2_weight` float8, `w13_weight_scale [E, 2I, 1]`, `w2_weight_scale [E, H, 1]`.
   NVFP4 weights-only (`CompressedTensorsW4A4Fp4(use_a16=True)`, `schemes/compressed_tensors_w4a4_nvfp4.py`):
   `weight_packed` uint8 `[out, in/2]`, `weight_scale` float8 `[out, in/16]`, `weight_global_scale` `[1]` per shard,
   no `input_global_scale`; a fused layer uses one global scale (`process_weights_after_loading` takes the max and
   warns when the shards differ), so q/k/v and gate/up must share theirs; experts (`CompressedTensorsW4A4Nvfp4MoE
   Method`, `compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py`): `w13_weight_packed`, `w13_weight_scale`,
   `w13_weight_global_scale [E, 2]` (one per w1 / w3 shard, which must match), `w2_*` likewise.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_reference

import numpy as np  # noqa: E402

FORMATS = (None, "fp8", "nvfp4", "fp8-linear", "nvfp4-linear")
PREFIXES = (("model.decoder.self_conditioning.", "self_conditioning."), ("model.decoder.", "model."),
            ("model.encoder.language_model.", "model."), ("model.encoder.vision_tower.", "vision_tower."),
            ("model.encoder.embed_vision.", "embed_vision."))
QUANTIZED_MODULES = re.compile(r"^model\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)$")
PARTS = {None: ("weight",), "fp8": ("weight", "weight_scale"),
         "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale")}


def vllm_name(name: str, layer_types: list[str]) -> tuple[str, str, object] | None:
  """HF tensor name -> (vLLM module, part, shard id), by rules 1-3; None for a name vLLM has no place for."""
  for old, new in PREFIXES:
    if name.startswith(old):
      name = new + name[len(old):]
      break
  else:
    return None
  m = re.match(r"^(model\.layers\.(\d+)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$", name)
  if m:
    w = "w2" if m[4] == "down_proj" else "w13"
    return f"{m[1]}.{w}", m[5], (int(m[3]), {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[m[4]])
  m = re.match(r"^(model\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$", name)
  if m:
    return f"{m[1]}.{'w13' if m[2] == 'gate_up_proj' else 'w2'}", "weight", "fused"
  m = re.match(r"^(model\.layers\.(\d+)\.self_attn)\.([qkv])_proj\.(\w+)$", name)
  if m:
    if layer_types[int(m[2])] == "full_attention" and m[3] == "v":
      return None  # k_eq_v layers have no v_proj
    return f"{m[1]}.qkv_proj", m[4], m[3]
  m = re.match(r"^(model\.layers\.\d+\.mlp)\.(gate|up)_proj\.(\w+)$", name)
  if m:
    return f"{m[1]}.gate_up_proj", m[3], {"gate": 0, "up": 1}[m[2]]
  module, _, part = name.rpartition(".")
  return module, part, None


def _ignored(module: str, ignore: list[str]) -> bool:
  for pattern in ignore:
    if pattern.startswith("re:") and re.match(pattern[3:], module) or pattern == module:
      return True
  return False


def expected_kind(module: str, config: dict) -> str | None:
  """Rule 4: 'fp8' / 'nvfp4' for a module vLLM builds quantized under this checkpoint's config, else None."""
  qc = config.get("quantization_config")
  if qc is None:
    return None
  bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
  kind = "fp8" if bits == 8 else "nvfp4"
  ignore = qc.get("ignore", [])
  experts = re.match(r"^(model\.layers\.\d+\.experts)\.w(13|2)$", module)
  if experts:
    return None if _ignored(experts[1] + ".0.gate_proj", ignore) else kind
  if QUANTIZED_MODULES.match(module):
    return None if _ignored(module, ignore) else kind
  return None


def check(path: str, list_tensors: bool = False) -> list[tuple[str, bool, str]]:
  """(check, passed, detail) rows for the export at `path`."""
  from hackable_diffusion.files import read_json
  from hackable_diffusion.interop.safetensors_io import read_header, read_tensor, weight_files

  config = read_json(os.path.join(path, "config.json"))
  text = config["text_config"]
  layer_types, num_experts = text["layer_types"], text["num_experts"]
  hidden, inter = text["hidden_size"], text["moe_intermediate_size"]
  tensors = {}
  for file in weight_files(path):
    header, start = read_header(file)
    tensors.update({name: read_tensor(file, name, header, start) for name in header if name != "__metadata__"})

  rows: list[tuple[str, bool, str]] = []
  unplaced, wrong_parts, wrong_dtypes = [], [], []
  loaded: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))  # module -> part -> shard -> array
  for name, array in sorted(tensors.items()):
    if list_tensors:
      print(f"    {name:72s} {str(tuple(array.shape)):18s} {array.dtype}")
    mapped = vllm_name(name, layer_types)
    if mapped is None:
      unplaced.append(name)
      continue
    module, part, shard = mapped
    kind = expected_kind(module, config)
    allowed = PARTS[kind] if (module.startswith("model.layers.") and (QUANTIZED_MODULES.match(module) or
                                                                        ".experts." in module)) else None
    if allowed is not None and part not in allowed:
      wrong_parts.append(f"{name} ({module} is {kind or 'dense'} in vLLM)")
      continue
    if allowed is None and part.startswith(("weight_", "input_")):
      wrong_parts.append(f"{name} ({module} is built dense in vLLM)")
      continue
    if kind is not None and shard == "fused":
      wrong_parts.append(f"{name} (a fused 3-D expert tensor loads dense only)")
      continue
    want = {("fp8", "weight"): "float8_e4m3fn", ("nvfp4", "weight_packed"): "uint8",
            ("nvfp4", "weight_scale"): "float8_e4m3fn", ("nvfp4", "weight_global_scale"): "float32"}.get((kind, part))
    if want and str(array.dtype) != want:
      wrong_dtypes.append(f"{name}: {array.dtype}, expected {want}")
    if kind is None and part == "weight" and "float8" in str(array.dtype):
      wrong_dtypes.append(f"{name}: float8 into a dense parameter")
    loaded[module][part][str(shard)] = array
  rows.append(("every tensor maps to a vLLM module (rules 1-3)", not unplaced, ", ".join(unplaced[:3])))
  rows.append(("parts match each module's scheme (rules 4-5)", not wrong_parts, "; ".join(wrong_parts[:3])))
  rows.append(("dtypes (float8 / packed uint8 / float32 global)", not wrong_dtypes, "; ".join(wrong_dtypes[:3])))

  # completeness and shapes of the quantized / stacked modules
  problems = []
  for i, kind_layer in enumerate(layer_types):
    p = f"model.layers.{i}."
    shards = ["q", "k"] if kind_layer == "full_attention" else ["q", "k", "v"]
    for module, want in ((p + "self_attn.qkv_proj", shards), (p + "mlp.gate_up_proj", ["0", "1"])):
      kind = expected_kind(module, config)
      for part in PARTS[kind]:
        got = sorted(loaded[module][part])
        if got != sorted(want):
          problems.append(f"{module}.{part}: shards {got}, expected {sorted(want)}")
    experts = p + "experts.w13"
    kind = expected_kind(experts, config)
    if kind is None:
      for w, shape in (("w13", (num_experts, 2 * inter, hidden)), ("w2", (num_experts, hidden, inter))):
        got = loaded[p + "experts." + w]["weight"].get("fused")
        if got is None or tuple(got.shape) != shape:
          problems.append(f"{p}experts.{w}_weight: {None if got is None else got.shape}, expected fused {shape}")
    else:
      for w, projs, (out, inp) in (("w13", ("w1", "w3"), (inter, hidden)), ("w2", ("w2",), (hidden, inter))):
        parts = loaded[p + "experts." + w]
        for part in PARTS[kind]:
          got = sorted(parts[part])
          want = sorted(str((e, s)) for e in range(num_experts) for s in projs)
          if got != want:
            problems.append(f"{p}experts.{w}_{part}: {len(got)} expert shards, expected {len(want)}")
        shape = {"weight": (out, inp), "weight_scale": (out, 1) if kind == "fp8" else (out, inp // 16),
                 "weight_packed": (out, inp // 2), "weight_global_scale": (1,)}
        for part, arrays in parts.items():
          bad = [k for k, a in arrays.items() if tuple(a.shape) != shape[part]]
          if bad:
            problems.append(f"{p}experts.{w}_{part}: shape {arrays[bad[0]].shape}, expected {shape[part]}")
  rows.append(("stacked shards and experts complete, shapes as vLLM allocates", not problems, "; ".join(problems[:3])))

  # rule 5: one NVFP4 global scale per fused matrix
  unequal = []
  for module, parts in loaded.items():
    scales = parts.get("weight_global_scale", {})
    by_expert: dict[object, list[float]] = defaultdict(list)
    for shard, a in scales.items():
      key = shard.split(",")[0] if shard.startswith("(") else "all"
      by_expert[key].append(float(np.asarray(a, np.float32).reshape(-1)[0]))
    unequal += [f"{module} {k}" for k, v in by_expert.items() if module.endswith(("qkv_proj", "gate_up_proj", "w13"))
                and len(set(v)) > 1]
  if any("weight_global_scale" in parts for parts in loaded.values()):
    rows.append(("NVFP4 global scale shared by fused shards", not unequal, ", ".join(unequal[:3])))

  dense_extra = [m for m in loaded if (".router." in m or m.startswith("self_conditioning.")) and
                 any(part != "weight" for part in loaded[m])]
  rows.append(("router and self-conditioning dense (built without quant config)", not dense_extra,
               ", ".join(dense_extra[:3])))
  return rows


def export_all(out_dir: str) -> dict[str | None, str]:
  from flax import nnx

  import hackable_diffusion as hd
  from hackable_diffusion.model.transformer import DiffusionGemma

  model = DiffusionGemma(hd.get_preset("tiny", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  paths = {}
  for fmt in FORMATS:
    paths[fmt] = os.path.join(out_dir, fmt or "bf16")
    hd.save_pretrained(model, paths[fmt], dtype="bfloat16", quantize=fmt)
  return paths


def sizes(preset: str) -> None:
  from flax import nnx

  import hackable_diffusion as hd
  from hackable_diffusion.interop import quantized_export as qe
  from hackable_diffusion.interop.names import hf_name, iter_variables
  from hackable_diffusion.model.transformer import DiffusionGemma

  config = hd.get_preset(preset)
  model = nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))
  table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
  for path, var in iter_variables(model):
    name, transpose = hf_name(path)
    shape = tuple(var.shape)
    if transpose:
      shape = shape[::-1]
    for fmt in FORMATS:
      s = qe.scheme(fmt) if fmt else None
      for stored, st_shape, dtype in qe.stored_shapes(name, shape, s, "bfloat16"):
        table[qe.component(stored)][fmt or "bf16"] += qe.nbytes(st_shape, dtype)
  cols = [fmt or "bf16" for fmt in FORMATS]
  print(f"{preset}: bytes per component (GiB = 2^30 bytes; vision tower not included: copied unchanged)")
  print("| component | " + " | ".join(cols) + " |")
  print("|---|" + "---:|" * len(cols))
  totals = defaultdict(int)
  for comp in qe.COMPONENTS:
    if comp not in table:
      continue
    print(f"| {comp} | " + " | ".join(f"{table[comp][c] / 2**30:.3f}" for c in cols) + " |")
    for c in cols:
      totals[c] += table[comp][c]
  print("| **total** | " + " | ".join(f"**{totals[c] / 2**30:.2f}**" for c in cols) + " |")


def errors(draws: int = 6) -> None:
  """Logit error of each export of the tests' tiny random model (3 layers, the embedding x10 so that every error
  shows; scripts/hf_reference.py), over `draws` random inputs: max and median |error| over the largest |logit|,
  read back by `hd.load_pretrained` (weights only), and by plain transformers where it loads."""
  import shutil

  import jax.numpy as jnp
  import torch
  from hf_reference import make_hf_model
  from transformers import DiffusionGemmaForBlockDiffusion

  import hackable_diffusion as hd
  from hackable_diffusion.model.transformer import forward

  tc = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
            num_experts=4, top_k_experts=2, moe_intermediate_size=16, initializer_range=0.1,
            layer_types=["sliding_attention", "full_attention", "full_attention"])
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for dtype in ("float32", "bfloat16"):
      source = make_hf_model(tc, 6, 0, embed_scale=10.0)
      if dtype == "bfloat16":
        source = source.to(torch.bfloat16)
      base = os.path.join(tmp, "base")
      shutil.rmtree(base, ignore_errors=True)
      source.save_pretrained(base)
      model = hd.load_pretrained(base)
      for fmt in FORMATS[1:]:
        out = os.path.join(tmp, fmt)
        shutil.rmtree(out, ignore_errors=True)
        hd.save_pretrained(model, out, dtype=dtype, quantize=fmt, vision_source=base)
        ours = hd.load_pretrained(out)
        plain = DiffusionGemmaForBlockDiffusion.from_pretrained(out) if fmt == "fp8-linear" else None
        got: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for seed in range(draws):
          rng = np.random.default_rng(seed)
          ids, canvas = rng.integers(3, 125, (2, 9)), rng.integers(3, 125, (2, 6))
          with torch.no_grad():
            exact = source(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.float().numpy()
            runs = {"hd.load_pretrained (weights only)": np.asarray(
                forward(ours, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32)), np.float32)}
            if plain is not None:
              runs["plain transformers (FP8 weights and activations)"] = plain.eval()(
                  input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas)).logits.float().numpy()
          scale = float(np.max(np.abs(exact)))
          for reader, logits in runs.items():
            diff = np.abs(logits - exact)
            got[reader].append((float(diff.max()) / scale, float(np.median(diff)) / scale))
        for reader, values in got.items():
          v = np.array(values)
          rows.append(f"| {fmt} ({dtype} model) | {reader} | {v[:, 0].min():.0%}-{v[:, 0].max():.0%} | "
                      f"{v[:, 1].min():.1%}-{v[:, 1].max():.1%} |")
  print(f"logit error over the largest |logit|, {draws} random inputs (min-max over the inputs)")
  print("| export | read by | max error | median error |")
  print("|---|---|---|---|")
  print("\n".join(rows))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--list", action="store_true", help="list every exported tensor")
  parser.add_argument("--sizes", action="store_true", help="print the sizes table instead")
  parser.add_argument("--errors", action="store_true", help="print the logit errors of each format instead")
  parser.add_argument("--preset", default="diffusion_gemma_26b_a4b")
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.errors:
    errors()
    return 0
  if args.sizes:
    sizes(args.preset)
    return 0
  failed, table = 0, []
  with tempfile.TemporaryDirectory() as tmp:
    for fmt, path in export_all(tmp).items():
      if args.list:
        print(f"  {fmt or 'bf16'}:")
      for what, ok, detail in check(path, args.list):
        failed += not ok
        table.append(f"| {fmt or 'bf16'} | {what} | {'PASS' if ok else 'FAIL'} | {detail} |")
  print("| format | check | result | detail |")
  print("|---|---|---|---|")
  print("\n".join(table))
  print("all PASS" if not failed else f"{failed} FAIL")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
