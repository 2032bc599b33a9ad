"""Logit parity with transformers' DiffusionGemmaForBlockDiffusion, loading and saving HF checkpoints."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import max_abs_diff
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.interop.hf import CheckpointError
from hackable_diffusion.model.transformer import forward, init_model

SLIDE, FULL = "sliding_attention", "full_attention"
# name -> (text config overrides, prompt length, canvas length). Sliding window 4 everywhere: prompts and canvases
# are longer than the window.
CONFIGS = {
    "sliding_full": (dict(layer_types=[SLIDE, FULL, FULL]), 9, 6),
    "full_other_dims": (dict(layer_types=[SLIDE, SLIDE, FULL], global_head_dim=32, num_global_key_value_heads=4,
                             head_dim=8, num_key_value_heads=1), 7, 10),
    "many_experts": (dict(layer_types=[FULL, SLIDE, FULL], num_experts=8, top_k_experts=3, sliding_window=3), 11, 5),
}


def _ids(rng: np.random.Generator, b: int, n: int, vocab: int = 125) -> np.ndarray:
  return rng.integers(3, vocab, size=(b, n)).astype(np.int64)


def _torch_logits(model, ids, canvas, mask=None, sc=None, sc_mask=None) -> np.ndarray:
  kw = {}
  if mask is not None:
    kw["attention_mask"] = torch.tensor(mask, dtype=torch.long)
    kw["decoder_attention_mask"] = torch.tensor(
        np.concatenate([mask, np.ones((mask.shape[0], canvas.shape[1]), mask.dtype)], 1), dtype=torch.long)
  if sc is not None:
    kw["self_conditioning_logits"] = torch.tensor(sc)
  if sc_mask is not None:
    kw["self_conditioning_mask"] = torch.tensor(sc_mask)
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas), **kw).logits.numpy()


def _our_logits(model, ids, canvas, mask=None, sc=None, sc_mask=None) -> np.ndarray:
  return np.asarray(forward(
      model,
      jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
      attention_mask=None if mask is None else jnp.asarray(mask, bool),
      self_conditioning_logits=None if sc is None else jnp.asarray(sc),
      self_conditioning_mask=None if sc_mask is None else jnp.asarray(sc_mask)))


@nnx.jit
def _encode(model, ids, cache):
  return model.encode(ids, cache)[1]


@nnx.jit
def _decode(model, canvas, cache):
  return model.decode(canvas, cache)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, hf_factory):
  overrides, p, c = CONFIGS[request.param]
  torch_model, path = hf_factory(request.param, canvas=c, **overrides)
  return request.param, torch_model, hd.load_pretrained(path), p, c


def test_logits_prompt_and_canvas(pair):
  name, ref, ours, p, c = pair
  rng = np.random.default_rng(1)
  ids, canvas = _ids(rng, 2, p), _ids(rng, 2, c)
  expected = _torch_logits(ref, ids, canvas)
  assert np.abs(expected).max() > 1.0, "reference logits too small for a meaningful comparison"
  assert max_abs_diff(_our_logits(ours, ids, canvas), expected) <= 1e-4, name


def test_logits_with_self_conditioning_and_row_mask(pair):
  name, ref, ours, p, c = pair
  rng = np.random.default_rng(2)
  ids, canvas = _ids(rng, 3, p), _ids(rng, 3, c)
  sc = (3 * rng.standard_normal((3, c, 128))).astype(np.float32)
  sc_mask = np.array([True, False, True])
  expected = _torch_logits(ref, ids, canvas, sc=sc, sc_mask=sc_mask)
  assert max_abs_diff(_our_logits(ours, ids, canvas, sc=sc, sc_mask=sc_mask), expected) <= 1e-4, name
  # the masked row equals "no self-conditioning" (a zero soft embedding, not zero logits)
  no_sc = _torch_logits(ref, ids, canvas)
  assert max_abs_diff(expected[1], no_sc[1]) <= 1e-5
  assert max_abs_diff(expected[0], no_sc[0]) > 1e-3


def test_logits_left_padded_batch(pair):
  name, ref, ours, p, c = pair
  rng = np.random.default_rng(3)
  ids, canvas = _ids(rng, 3, p), _ids(rng, 3, c)
  mask = np.ones((3, p), np.int64)
  mask[1, :2] = 0
  mask[2, : p - 2] = 0  # only two real tokens
  ids[mask == 0] = 0
  sc = rng.standard_normal((3, c, 128)).astype(np.float32)
  expected = _torch_logits(ref, ids, canvas, mask=mask, sc=sc)
  got = _our_logits(ours, ids, canvas, mask=mask.astype(bool), sc=sc)
  assert max_abs_diff(got, expected) <= 1e-4, name


def test_encoding_in_two_blocks_equals_one(pair):
  name, _, ours, p, c = pair
  rng = np.random.default_rng(4)
  ids = jnp.asarray(_ids(rng, 2, p), jnp.int32)
  canvas = jnp.asarray(_ids(rng, 2, c), jnp.int32)
  whole = _encode(ours, ids, ours.init_cache(2, p + 3))
  split = _encode(ours, ids[:, :3], ours.init_cache(2, p + 3))
  split = _encode(ours, ids[:, 3:], split)
  np.testing.assert_array_equal(np.asarray(split.length), [p, p])
  a = _decode(ours, canvas, whole)
  b = _decode(ours, canvas, split)
  assert max_abs_diff(a, b) <= 1e-5, name
  # and the cache really carries the prompt: a different first block changes the logits
  other = _encode(ours, ids[:, ::-1], ours.init_cache(2, p + 3))
  assert max_abs_diff(_decode(ours, canvas, other), a) > 1e-3


def test_per_layer_config_present_keeps_base_shape_on_full_layers(hf_factory):
  # transformers applies `global_head_dim` only when `per_layer_config` is absent: with an explicit (here empty)
  # `per_layer_config`, full layers have the sliding layers' head_dim and kv heads. config.json then has no
  # `global_head_dim` key, so a loader that falls back to the 512 default fails on the first full layer.
  ref, path = hf_factory("per_layer_config_empty", per_layer_config={})
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    text = json.load(f)["text_config"]
  assert text["per_layer_config"] == {} and "global_head_dim" not in text
  assert ref.model.encoder.language_model.layers[1].self_attn.head_dim == 8  # the reference's own full-layer shape
  ours = hd.load_pretrained(path)
  assert (ours.config.global_head_dim, ours.config.global_kv_heads) == (8, 2)
  rng = np.random.default_rng(4)
  ids, canvas = _ids(rng, 2, 9), _ids(rng, 2, 6)
  expected = _torch_logits(ref, ids, canvas)
  assert max_abs_diff(_our_logits(ours, ids, canvas), expected) <= 1e-4


def test_bf16_load_close_to_fp32_reference(hf_factory):
  ref, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  rng = np.random.default_rng(5)
  ids, canvas = _ids(rng, 2, 9), _ids(rng, 2, 6)
  model = hd.load_pretrained(path, dtype=jnp.bfloat16)
  assert model.embed_tokens[...].dtype == jnp.bfloat16
  expected = _torch_logits(ref, ids, canvas)
  got = _our_logits(model, ids, canvas)
  # bf16 keeps ~3 significant digits through 3 layers; logits here are O(10).
  scale = np.abs(expected).max()
  assert max_abs_diff(got, expected) <= 0.06 * scale
  assert max_abs_diff(got, expected) > 0  # it really ran in bf16


def test_bf16_checkpoint_loads(hf_factory, tmp_path):
  ref, _ = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  ref16 = ref.to(torch.bfloat16)
  try:
    ref16.save_pretrained(tmp_path)
  finally:
    ref.to(torch.float32)
  model = hd.load_pretrained(str(tmp_path), dtype=jnp.float32)
  with torch.no_grad():
    ref_w = ref16.model.decoder.layers[0].mlp.up_proj.weight.float().numpy()
  np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.up_proj.kernel[...]).T, ref_w)
  # the default dtype is the checkpoint's own: bf16 parameters and compute, the same values
  auto = hd.load_pretrained(str(tmp_path))
  assert auto.config.param_dtype == "bfloat16" and auto.config.dtype == "bfloat16"
  kernel = auto.layers[0].mlp.up_proj.kernel[...]
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(kernel.astype(jnp.float32)).T, ref_w)


def test_checkpoint_dtype_is_read_from_config_json(hf_factory, tmp_path):
  from hackable_diffusion.interop.hf import checkpoint_dtype

  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  assert checkpoint_dtype(path) == "float32"  # transformers saved the fp32 model with dtype='float32'
  assert hd.load_pretrained(path).embed_tokens[...].dtype == jnp.float32
  config = json.load(open(os.path.join(path, "config.json")))
  for record, expected in (({"torch_dtype": "bfloat16"}, "bfloat16"), ({"text_config": {"dtype": "float16"}},
                                                                       "float16"), ({}, "float32")):
    edited = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}
    edited.update(record)
    if "text_config" in record:
      edited["text_config"] = {**config["text_config"], **record["text_config"]}
    (tmp_path / "config.json").write_text(json.dumps(edited))
    assert checkpoint_dtype(str(tmp_path)) == expected, record
  (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "int8"}))
  with pytest.raises(CheckpointError, match=r"config.json: dtype='int8'; expected one of"):
    checkpoint_dtype(str(tmp_path))


def test_a_config_without_a_dtype_loads_in_float32_with_a_warning(hf_factory, tmp_path, caplog):
  from hackable_diffusion.interop.hf import checkpoint_dtype

  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  config = json.load(open(os.path.join(path, "config.json")))
  bare = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}
  bare["text_config"] = {k: v for k, v in config["text_config"].items() if k not in ("dtype", "torch_dtype")}
  (tmp_path / "config.json").write_text(json.dumps(bare))
  with caplog.at_level("WARNING"):
    assert checkpoint_dtype(str(tmp_path)) == "float32"
  assert "records no dtype" in caplog.text and "dtype='bfloat16'" in caplog.text
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert checkpoint_dtype(path) == "float32"  # recorded: no warning
  assert "records no dtype" not in caplog.text


def test_save_pretrained_loads_in_transformers(tmp_path):
  from transformers import DiffusionGemmaForBlockDiffusion

  config = hd.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                          num_global_key_value_heads=2, layer_types=(SLIDE, SLIDE, FULL), sliding_window=3,
                          num_experts=4, top_k_experts=2, moe_intermediate_size=8, canvas_length=5,
                          initializer_range=0.3)
  ours = init_model(config, 7)
  ours.layers[1].layer_scalar.value = jnp.array([0.7])
  ours.layers[1].encoder_layer_scalar.value = jnp.array([1.3])
  hd.save_pretrained(ours, str(tmp_path))
  ref, info = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path), output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  rng = np.random.default_rng(6)
  ids, canvas = _ids(rng, 2, 8, vocab=90), _ids(rng, 2, 5, vocab=90)
  sc = rng.standard_normal((2, 5, 96)).astype(np.float32)
  expected = _torch_logits(ref.eval(), ids, canvas, sc=sc)
  assert max_abs_diff(_our_logits(ours, ids, canvas, sc=sc), expected) <= 1e-4
  # and our own loader round-trips it bit for bit
  again = hd.load_pretrained(str(tmp_path))
  np.testing.assert_array_equal(_our_logits(again, ids, canvas, sc=sc), _our_logits(ours, ids, canvas, sc=sc))


def test_sharded_checkpoint_round_trip(tmp_path):
  config = hd.get_preset("tiny")
  ours = init_model(config, 3)
  hd.save_pretrained(ours, str(tmp_path), max_shard_size=20_000)
  index = json.load(open(tmp_path / "model.safetensors.index.json"))
  assert len(set(index["weight_map"].values())) > 1
  assert not (tmp_path / "model.safetensors").exists()
  again = hd.load_pretrained(str(tmp_path))
  ids, canvas = jnp.ones((1, 4), jnp.int32), jnp.arange(8, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(np.asarray(forward(again, ids, canvas)), np.asarray(forward(ours, ids, canvas)))


# ---- bad inputs ------------------------------------------------------------------------------------------------
def _one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  return msg


def _copy_checkpoint(src: str, dst) -> None:
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f:
      (dst / name).write_bytes(f.read())


def test_unknown_model_type(hf_factory, tmp_path):
  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  cfg = json.load(open(tmp_path / "config.json"))
  cfg["model_type"] = "llama"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "model_type='llama'" in _one_line(e) and "config.json" in str(e.value)


def test_truncated_safetensors(hf_factory, tmp_path):
  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  data = (tmp_path / "model.safetensors").read_bytes()
  (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "model.safetensors" in _one_line(e)


def test_wrong_shape_names_the_tensor(hf_factory, tmp_path):
  from safetensors.torch import load_file, save_file

  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  name = "model.decoder.layers.1.mlp.up_proj.weight"
  tensors[name] = tensors[name][:-1].clone()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert name in _one_line(e) and "(63, 32)" in str(e.value) and "(64, 32)" in str(e.value)


@pytest.mark.parametrize("kind", ["missing", "unexpected"])
def test_missing_and_unexpected_tensors(hf_factory, tmp_path, kind):
  from safetensors.torch import load_file, save_file

  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  if kind == "missing":
    name = "model.decoder.layers.2.router.per_expert_scale"
    del tensors[name]
  else:
    name = "model.decoder.layers.0.mlp.extra_proj.weight"
    tensors[name] = tensors["model.decoder.layers.0.mlp.up_proj.weight"].clone()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert name in _one_line(e) and kind in str(e.value)


@pytest.mark.parametrize("where", ["host", "mesh"])
def test_non_finite_weight_is_refused(hf_factory, tmp_path, where):
  # one NaN (one inf on the mesh path, read block by block) is a one-line error naming the tensor and its file;
  # check_finite=False loads it as it is
  from safetensors.torch import load_file, save_file

  from hackable_diffusion import sharding as sh

  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  name = "model.decoder.layers.1.mlp.up_proj.weight"
  tensors[name][3, 5] = float("nan") if where == "host" else -float("inf")
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  kw = {} if where == "host" else {"mesh": sh.make_mesh(sh.MeshConfig(data=1, fsdp=1, tensor=1, expert=1))}
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path), **kw)
  msg = _one_line(e)
  assert repr(name) in msg and "model.safetensors" in msg and "NaN or inf" in msg and "check_finite=False" in msg
  model = hd.load_pretrained(str(tmp_path), check_finite=False, **kw)
  kernel = np.asarray(model.layers[1].mlp.up_proj.kernel[...], np.float32)  # ours is [in, out]
  assert not np.isfinite(kernel[5, 3]) and np.isfinite(kernel).sum() == kernel.size - 1


def test_all_finite_when_the_sum_overflows():
  from hackable_diffusion.interop.placement import all_finite

  big = np.full(4, np.finfo(np.float32).max, np.float32)  # finite values whose float32 sum overflows
  big_bf16 = np.full(4, jnp.finfo(jnp.bfloat16).max, jnp.bfloat16)
  assert all_finite(big) and all_finite(big_bf16) and all_finite(np.arange(5))
  assert not all_finite(np.array([1.0, np.nan], jnp.bfloat16)) and not all_finite(np.array([np.inf, -np.inf]))


def _rewrite_header(file, edit) -> None:
  """Rewrites the safetensors header of `file` through `edit(header) -> (header bytes, declared length)`."""
  import struct

  data = file.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  text, declared = edit(json.loads(data[8:8 + n]))
  file.write_bytes(struct.pack("<Q", declared) + text + data[8 + n:])


def test_header_longer_than_the_file_is_refused(hf_factory, tmp_path):
  # a declared header length of 10**15 bytes: refused from the file's size, never allocated
  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  _rewrite_header(tmp_path / "model.safetensors", lambda h: (json.dumps(h).encode(), 10**15))
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "model.safetensors" in _one_line(e) and str(10**15) in str(e.value)


@pytest.mark.parametrize("edit", ["past_the_end", "wrong_size", "malformed"])
def test_tensor_byte_range_is_checked_against_the_file(hf_factory, tmp_path, edit):
  _, path = hf_factory("sliding_full", canvas=6, layer_types=[SLIDE, FULL, FULL])
  _copy_checkpoint(path, tmp_path)
  name = "model.decoder.layers.1.mlp.up_proj.weight"

  def change(header):
    begin, end = header[name]["data_offsets"]
    if edit == "past_the_end":
      header[name]["data_offsets"] = [begin, 10**15]
    elif edit == "wrong_size":
      header[name]["data_offsets"] = [begin, end - 2]
    else:
      del header[name]["shape"]
    text = json.dumps(header).encode()
    return text, len(text)

  _rewrite_header(tmp_path / "model.safetensors", change)
  with pytest.raises(CheckpointError) as e:
    hd.load_pretrained(str(tmp_path))
  assert "model.safetensors" in _one_line(e) and repr(name) in str(e.value)
