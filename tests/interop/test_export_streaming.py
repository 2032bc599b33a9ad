"""The streamed merged export (`hf_write.save_merged`, `export_merged`) writes the files that merging the whole
model first and writing every shard with safetensors' own `save_file` writes, byte for byte: same file names, same
index, same bytes in every file, for LoRA adapters on a stacked model (linear layers, experts, self-conditioning),
a QLoRA base, bf16 / fp32 and the FP8 / NVFP4 formats, several shards or one. The reference (`reference_export`)
is the non-streaming algorithm: `lora.merge` of the whole model (each expert tensor in one step), every tensor in
memory, `save_file` per shard. Also: the writer's checks (links, its plan, no temporary file left), a PEFT adapter
read from a stacked model whose base is shapes only, and extra tensors (a vision tower) appended to an export.
"""

from __future__ import annotations

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from hackable_diffusion import lora
from hackable_diffusion.errors import CheckpointError, UnsafePathError
from hackable_diffusion.interop import hf_write, quantized_export
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.interop import safetensors_io as sio
from hackable_diffusion.interop.names import hf_name, is_vision, iter_variables
from hackable_diffusion.lora import qlora
from hackable_diffusion.lora.qarrays import QuantizationSpec
from hackable_diffusion.model import scan
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model

merge_lib = importlib.import_module("hackable_diffusion.lora.merge")  # the package's `merge` is the function
EVERYTHING = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")
LAYER_TYPES = ("sliding_attention", "full_attention") * 2


def _with_adapters(base, quantization: str = "none"):
  model = lora.apply_lora(base, lora.LoraConfig(rank=2, alpha=6, target_modules=EVERYTHING,
                                                base_quantization=quantization), rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(0.1 * rng.standard_normal(v.shape), v.dtype)
  return model


@pytest.fixture(scope="module")
def models(hf_factory):
  """{name: model}, and a HF directory (written by transformers) whose vision tower the exports copy."""
  base = init_model(get_preset("tiny", num_hidden_layers=4, layer_types=LAYER_TYPES), 0)
  _, vision = hf_factory("streaming_vision", canvas=8)
  return {"stacked": scan.stack_layers(_with_adapters(base)), "qlora": _with_adapters(base, "fp8"),
          "plain": base}, vision


def reference_export(model, path: str, *, dtype: str, quantize: str | None, max_shard_size: int,
                     vision_source: str) -> None:
  """The whole merged model in memory, every stored tensor computed, cut into shards, each written by
  safetensors' `save_file`, and the index."""
  merged = scan.unstack_layers(lora.merge(model), on_host=True)
  s = quantized_export.scheme(quantize) if quantize else None
  values = [(hf_name(p)[0], np.asarray(v[...]).T if hf_name(p)[1] else np.asarray(v[...]))
            for p, v in iter_variables(merged)]
  amax: dict[str, float] = {}
  for name, value in values:
    group = quantized_export.fused_group(name)
    if group:
      amax[group] = max(amax.get(group, 0.0), float(np.max(np.abs(value.astype(np.float32)))))
  tensors = []
  for name, value in values:
    if s is not None and quantized_export.is_quantized(name, s):
      tensors += list(quantized_export.quantized_tensors(name, value.astype(np.float32), s, dtype, amax))
    else:
      tensors.append((name, np.asarray(jnp.asarray(value, jnp.dtype(dtype)))))
  with safe_open(os.path.join(vision_source, "model.safetensors"), "np") as f:
    tensors += [(n, np.asarray(jnp.asarray(f.get_tensor(n), jnp.dtype(dtype)))) for n in f.keys() if is_vision(n)]
  shards, size = [{}], 0
  for name, array in tensors:
    if size and size + array.nbytes > max_shard_size:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(array)  # save_file writes an array's buffer as it lies in memory
    size += array.nbytes
  os.makedirs(path)
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, fname))
  total = sum(a.nbytes for _, a in tensors)
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


CASES = [  # model, dtype, quantize, max_shard_size
    ("stacked", "bfloat16", None, 40_000),
    ("stacked", "float32", None, 1 << 30),
    ("stacked", "bfloat16", "fp8", 30_000),
    ("stacked", "float32", "nvfp4", 1 << 30),
    ("qlora", "bfloat16", "fp8-linear", 50_000),
    ("plain", "float32", "nvfp4-linear", 60_000),
]


@pytest.mark.parametrize("name,dtype,quantize,max_shard_size", CASES)
def test_streamed_export_equals_whole_model_export_byte_for_byte(models, tmp_path, name, dtype, quantize,
                                                                 max_shard_size):
  by_name, vision = models
  model = by_name[name]
  ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(merge_lib, "MERGE_CHUNK_BYTES", 1)  # the experts merged one at a time (the reference: at once)
    patch.setattr(merge_lib, "HOST_CHUNK_BYTES", 1)
    hf_write.save_merged(model, ours, dtype=dtype, quantize=quantize, max_shard_size=max_shard_size,
                         vision_source=vision)
  reference_export(model, ref, dtype=dtype, quantize=quantize, max_shard_size=max_shard_size, vision_source=vision)
  files = sorted(os.listdir(ref))
  assert sorted(os.listdir(ours)) == sorted(files + ["config.json"])
  assert (len(files) > 1) == (max_shard_size < 1 << 30), files  # the small limits do cut several shards
  for fname in files:
    a, b = open(os.path.join(ours, fname), "rb").read(), open(os.path.join(ref, fname), "rb").read()
    if fname.endswith(".json"):
      assert json.loads(a) == json.loads(b)
    else:
      assert a == b, fname


def test_on_the_host_a_dense_base_is_merged_a_tensor_at_a_time_and_read_in_place(models):
  by_name, _ = models
  stacked = by_name["stacked"]
  parts = list(merge_lib.merged_parts(stacked))
  layer_parts = [p for p in parts if p[0][0][0] == "layers"]
  assert layer_parts and all(len(p) == 1 and isinstance(p[0][1], np.ndarray) for p in layer_parts)
  expected = {path: v[...] for path, v in nnx.to_flat_state(nnx.state(lora.merge(stacked)))}
  assert sorted(path for p in parts for path, _ in p) == sorted(expected)
  (path, norm), = next(p for p in layer_parts if p[0][0][-2:] == ("input_layernorm", "weight"))
  assert np.shares_memory(norm, np.asarray(stacked.layers.blocks[path[1] % stacked.layers.period]
                                           .input_layernorm.weight[...]))  # a view of the stacked base, no copy
  wholes = list(merge_lib.merged_parts(stacked, whole_layers=True))
  assert sum(p[0][0][0] == "layers" for p in wholes) == stacked.config.num_hidden_layers
  qparts = [p for p in merge_lib.merged_parts(by_name["qlora"]) if p[0][0][0] == "layers"]  # a quantized base:
  assert len(qparts) == 4 and all(isinstance(v, jax.Array) for p in qparts for _, v in p)  # a layer at a time


def test_save_pretrained_refuses_adapters_and_a_quantized_base(models, tmp_path):
  by_name, _ = models
  with pytest.raises(CheckpointError, match="LoRA adapters"):
    hf_write.save_pretrained(by_name["stacked"], str(tmp_path / "a"))
  quantized = qlora.quantize_base(nnx.clone(by_name["plain"]), QuantizationSpec(mode="fp8"))
  with pytest.raises(CheckpointError, match=r"quantized \(fp8"):
    hf_write.save_pretrained(quantized, str(tmp_path / "b"))
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_the_writer_refuses_links_checks_its_plan_and_leaves_no_temporary_file(tmp_path):
  victim = tmp_path / "victim"
  victim.write_text("keep")
  out = tmp_path / "out"
  out.mkdir()
  specs = [sio.TensorSpec("a", (2, 3), "float32"), sio.TensorSpec("b", (4,), "bfloat16")]
  os.symlink(victim, out / "model.safetensors")
  with pytest.raises(UnsafePathError), sio.ShardedWriter(str(out), specs, max_shard_size=1 << 20) as w:
    w.write("a", np.ones((2, 3), np.float32))
  assert victim.read_text() == "keep"
  os.remove(out / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"'a': float32 \(3, 2\), planned float32 \(2, 3\)"):
    with sio.ShardedWriter(str(out), specs, max_shard_size=1 << 20) as w:
      w.write("a", np.ones((3, 2), np.float32))
  with pytest.raises(CheckpointError, match="never written: \\['b'\\]"):
    with sio.ShardedWriter(str(out), specs, max_shard_size=1 << 20) as w:
      w.write("a", np.ones((2, 3), np.float32))
      w.finish()
  assert os.listdir(out) == []  # the half-written file was removed
  with sio.ShardedWriter(str(out), specs, max_shard_size=30) as w:  # one file per tensor, in any order
    w.write("b", np.ones(4, jnp.bfloat16))
    w.write("a", np.full((2, 3), 2.0, np.float32))
    files = w.finish()
  assert [os.path.basename(f) for f in files] == ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors"]
  index = json.load(open(out / "model.safetensors.index.json"))
  assert index == {"metadata": {"total_size": 32}, "weight_map": {"a": files[0].split("/")[-1],
                                                                  "b": files[1].split("/")[-1]}}
  with safe_open(files[0], "np") as f:
    np.testing.assert_array_equal(f.get_tensor("a"), np.full((2, 3), 2.0, np.float32))
  assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_peft_adapter_of_a_stacked_model_with_a_shapes_only_base(models, tmp_path):
  """The adapters are read layer by layer without touching the base: a stacked model whose base is shapes only
  writes the same adapter files as the unrolled model with its weights."""
  stacked = models[0]["stacked"]
  graphdef, adapters, rest = nnx.split(stacked, nnx.LoRAParam, ...)
  shapes_only = nnx.merge(graphdef, adapters, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), rest))
  ours = peft_io.save_adapter(shapes_only, str(tmp_path / "ours"), "base")
  ref = peft_io.save_adapter(scan.unstack_layers(stacked), str(tmp_path / "ref"), "base")
  for key in ("weights", "config"):
    assert open(ours[key], "rb").read() == open(ref[key], "rb").read(), key
  with safe_open(ours["weights"], "np") as f:
    assert len(list(f.keys())) > 20


def test_extra_tensors_are_appended_and_a_vision_tower_among_them_replaces_the_stub(models, tmp_path):
  plain = models[0]["plain"]
  extra = {"model.encoder.vision_tower.patch_embedder.input_proj.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
  hf_write.save_pretrained(plain, str(tmp_path / "tower"), dtype="bfloat16", extra_tensors=extra.items())
  with safe_open(str(tmp_path / "tower" / "model.safetensors"), "np") as f:
    vision = [k for k in f.keys() if is_vision(k)]
    assert vision == list(extra)  # the given tower only, no stub
    np.testing.assert_array_equal(f.get_tensor(vision[0]).astype(np.float32), extra[vision[0]])
    assert f.get_tensor(vision[0]).dtype == jnp.bfloat16
  hf_write.save_pretrained(plain, str(tmp_path / "stub"), extra_tensors={"model.extra.weight": np.ones(2)})
  with safe_open(str(tmp_path / "stub" / "model.safetensors"), "np") as f:
    keys = list(f.keys())
    assert "model.extra.weight" in keys and sum(is_vision(k) for k in keys) > 10  # the stub as well
