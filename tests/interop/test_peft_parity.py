"""Our LoRA against peft 0.21 on transformers' DiffusionGemma: export, import, and PEFT's own merge."""

from __future__ import annotations

import json
import re
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, max_abs_diff
from flax import nnx
from safetensors.torch import load_file, save_file

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.interop import peft as peft_io
from hackable_diffusion.model.transformer import forward

peft = pytest.importorskip("peft")

SLIDE, FULL = "sliding_attention", "full_attention"
HF_KW = dict(canvas=6, layer_types=[SLIDE, FULL, FULL])  # conftest's default tiny model: 3 layers, 4 experts top-2
EVERYTHING = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")
P, C = 9, 6


def _inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  ids, canvas = rng.integers(3, 125, (2, P)), rng.integers(3, 125, (2, C))
  sc = (3 * rng.standard_normal((2, C, 128))).astype(np.float32)
  return ids, canvas, sc


def torch_logits(model, ids, canvas, sc) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                 self_conditioning_logits=torch.tensor(sc)).logits.float().numpy()


def our_logits(model, ids, canvas, sc) -> np.ndarray:
  return np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            self_conditioning_logits=jnp.asarray(sc)))


def randomize(model, seed: int, std: float = 0.1) -> None:
  """Random non-zero A and B (B is zero after apply_lora)."""
  rng = np.random.default_rng(seed)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(std * rng.standard_normal(v.shape), v.dtype)


@pytest.fixture(scope="module")
def base(hf_factory):
  ref, path = hf_factory("lora_base", **HF_KW)
  return path, hd.load_pretrained(path)


@pytest.fixture(scope="module")
def adapted(base, tmp_path_factory):
  """Ours with adapters on attention, dense MLP, experts and the self-conditioning MLP, exported as PEFT."""
  path, ours = base
  model = lora.apply_lora(ours, lora.LoraConfig(rank=2, alpha=6, target_modules=EVERYTHING), rngs=nnx.Rngs(1))
  randomize(model, 0)
  out = str(tmp_path_factory.mktemp("peft_export"))
  peft_io.save_adapter(model, out, path)
  return model, out


def test_export_loads_in_peft_with_equal_logits(base, adapted):
  path, ours = base
  model, out = adapted
  ids, canvas, sc = _inputs()
  mine = our_logits(model, ids, canvas, sc)
  assert max_abs_diff(mine, our_logits(ours, ids, canvas, sc)) > 0.5  # the adapter changes the logits a lot
  ref = peft.PeftModel.from_pretrained(make_hf_model(0, **{k: v for k, v in HF_KW.items()}), out).eval()
  got = torch_logits(ref, ids, canvas, sc)
  assert max_abs_diff(got, mine) <= 1e-4
  # peft wrapped both modes, the experts through ParamWrapper, and not the vision tower
  names = dict(ref.named_modules())
  assert type(names["base_model.model.model.encoder.language_model.layers.1.self_attn.q_proj"]).__name__ == "Linear"
  assert "lora_A" in dict(names["base_model.model.model.decoder.layers.2.mlp.down_proj"].named_children())
  assert type(names["base_model.model.model.decoder.layers.0.experts"]).__name__ == "ParamWrapper"
  assert not [n for n, m in names.items() if "vision" in n and hasattr(m, "lora_A")]


def test_adapter_files_layout(adapted):
  model, out = adapted
  config = json.load(open(f"{out}/adapter_config.json"))
  assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 6
  assert config["task_type"] is None and config["base_model_name_or_path"]
  rx = re.compile(config["target_modules"])
  assert rx.fullmatch("model.decoder.layers.2.self_attn.o_proj")
  assert rx.fullmatch("model.encoder.language_model.layers.0.self_attn.v_proj")
  assert rx.fullmatch("model.decoder.self_conditioning.up_proj")
  assert not rx.fullmatch("model.encoder.language_model.layers.1.self_attn.v_proj")  # full layers have no v_proj
  assert not rx.fullmatch("model.encoder.vision_tower.encoder.layers.0.self_attn.q_proj.linear")
  assert not rx.fullmatch("model.decoder.layers.0.router.proj")
  assert "model.encoder.language_model.layers.1.experts.gate_up_proj" in config["target_parameters"]
  tensors = load_file(f"{out}/adapter_model.safetensors")
  q = model.layers[0].self_attn.q_proj
  for mode in ("model.decoder.layers.0", "model.encoder.language_model.layers.0"):
    np.testing.assert_array_equal(tensors[f"base_model.model.{mode}.self_attn.q_proj.lora_A.weight"].numpy(),
                                  np.asarray(q.lora_a[...]).T)
    assert tuple(tensors[f"base_model.model.{mode}.self_attn.q_proj.lora_B.weight"].shape) == (32, 2)
  # experts: gate_up_proj is the inner wrapper (base_layer), [r*E, in] / [out, r*E]
  assert tuple(tensors["base_model.model.model.decoder.layers.0.experts.base_layer.lora_A.weight"].shape) == (8, 32)
  assert tuple(tensors["base_model.model.model.decoder.layers.0.experts.lora_A.weight"].shape) == (8, 16)
  assert not [k for k in tensors if "self_conditioning" in k and "encoder" in k]


def test_peft_merge_and_unload_is_wrong_ours_is_right(base, adapted):
  """transformers ties encoder and decoder weights, peft merges each mode's copy into the same tensor: W + 2*delta."""
  path, _ = base
  model, out = adapted
  ids, canvas, sc = _inputs(1)
  with_adapter = our_logits(model, ids, canvas, sc)
  ours_merged = our_logits(lora.merge(model), ids, canvas, sc)
  assert max_abs_diff(ours_merged, with_adapter) <= 1e-4
  ref = peft.PeftModel.from_pretrained(make_hf_model(0, **HF_KW), out).eval()
  assert max_abs_diff(torch_logits(ref, ids, canvas, sc), with_adapter) <= 1e-4
  peft_merged = torch_logits(ref.merge_and_unload(), ids, canvas, sc)
  wrong = max_abs_diff(peft_merged, with_adapter)
  print(f"peft merge_and_unload max |diff| = {wrong:.3f}")
  assert wrong > 0.1
  # ... and it is exactly "every tied layer update added twice" (the decoder-only self-conditioning MLP once)
  twice = lora.merge(model)
  layers_only = tuple(p for p in EVERYTHING if p != "self_conditioning")
  again = lora.apply_lora(twice, lora.LoraConfig(rank=2, alpha=6, target_modules=layers_only), rngs=nnx.Rngs(0))
  src, dst = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))), nnx.state(again, nnx.LoRAParam)
  for p, v in nnx.to_flat_state(dst):
    v.value = src[p][...]
  nnx.update(again, dst)
  assert max_abs_diff(peft_merged, our_logits(lora.merge(again), ids, canvas, sc)) <= 1e-4


def _peft_made_adapter(out_dir: str, *, tie: bool, **hf_kw) -> None:
  """An adapter made by peft itself: regex over both modes + expert target_parameters, random A and B."""
  ref = make_hf_model(0, **hf_kw)
  regex = (r"model\.(encoder\.language_model|decoder)\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)"
           r"_proj)|model\.decoder\.self_conditioning\.(gate|up|down)_proj")
  config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=regex, init_lora_weights=False,
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])
  model = peft.get_peft_model(ref, config)
  params = dict(model.named_parameters())
  with torch.no_grad():
    for name, p in params.items():
      if "lora_" in name:
        # crc32, not hash(): str hashes change per process (PYTHONHASHSEED), and so would the weights
        p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    if tie:  # our model has one set of weights: the encoder copy must equal the decoder copy
      for name, p in params.items():
        if "lora_" in name and ".encoder.language_model." in name:
          p.copy_(params[name.replace(".encoder.language_model.", ".decoder.")])
  model.save_pretrained(out_dir)
  return model


def test_peft_made_adapter_imports_with_equal_logits(base, tmp_path):
  path, ours = base
  ref = _peft_made_adapter(str(tmp_path), tie=True, **HF_KW).eval()
  model = peft_io.load_adapter(ours, str(tmp_path))
  names = [lora.adapters.path_str(p) for p, _ in lora.lora_modules(model)]
  assert "layers.1.experts" in names and "self_conditioning.mlp.up_proj" in names
  assert model.layers[1].experts.targets == ("gate_up_proj", "down_proj")
  ids, canvas, sc = _inputs(2)
  expected = torch_logits(ref, ids, canvas, sc)
  assert max_abs_diff(expected, our_logits(ours, ids, canvas, sc)) > 0.5
  assert max_abs_diff(our_logits(model, ids, canvas, sc), expected) <= 1e-4
  # and through hd.load_pretrained(adapter=...)
  again = hd.load_pretrained(path, adapter=str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again.layers[0].experts.down_proj_lora_b[...]),
                                np.asarray(model.layers[0].experts.down_proj_lora_b[...]))


# ---- bad inputs ----------------------------------------------------------------------------------------------------
def _one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  return msg


def test_untied_peft_adapter_is_refused(base, tmp_path):
  _, ours = base
  _peft_made_adapter(str(tmp_path), tie=False, **HF_KW)
  with pytest.raises(peft_io.AdapterError) as e:
    peft_io.load_adapter(ours, str(tmp_path))
  assert "differs from decoder copy" in _one_line(e) and "one set of weights" in str(e.value)


def test_adapter_for_a_different_base_shape(base, tmp_path):
  _, ours = base
  ref = make_hf_model(0, **HF_KW, intermediate_size=48)
  config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=r"model\.(encoder\.language_model|decoder)\.layers\.\d+"
                           r"\.mlp\.up_proj", init_lora_weights=False)
  peft.get_peft_model(ref, config).save_pretrained(str(tmp_path))
  with pytest.raises(peft_io.AdapterError) as e:
    peft_io.load_adapter(ours, str(tmp_path))
  msg = _one_line(e)
  assert "lora_B.weight" in msg and "mlp.up_proj" in msg and "(48, 2)" in msg and "(64, 2)" in msg


def test_adapter_missing_encoder_copy_and_unknown_module(adapted, base, tmp_path):
  _, ours = base
  _, out = adapted
  tensors = load_file(f"{out}/adapter_model.safetensors")
  config = open(f"{out}/adapter_config.json").read()
  (tmp_path / "adapter_config.json").write_text(config)
  dropped = {k: v for k, v in tensors.items() if "encoder.language_model.layers.2.mlp.up_proj" not in k}
  save_file(dropped, str(tmp_path / "adapter_model.safetensors"))
  with pytest.raises(peft_io.AdapterError) as e:
    peft_io.load_adapter(ours, str(tmp_path))
  assert "layers.2.mlp.up_proj" in _one_line(e) and "no encoder copy" in str(e.value)
  extra = dict(tensors)
  extra["base_model.model.model.decoder.layers.7.mlp.up_proj.lora_A.weight"] = torch.zeros(2, 32)
  save_file(extra, str(tmp_path / "adapter_model.safetensors"))
  with pytest.raises(peft_io.AdapterError) as e:
    peft_io.load_adapter(ours, str(tmp_path))
  assert "layers.7.mlp.up_proj" in _one_line(e)
