"""QLoRA with checkpoints and the trainer: loading a base quantized tensor by tensor (FP8 and NVFP4 checkpoints kept as
stored), the PEFT export of a QLoRA model in transformers + peft, the merged export, and `hd.SFTTrainer` with a
quantized base.

The FP8 and NVFP4 checkpoints are the ones tests/interop/test_quantized.py builds with compressed-tensors itself.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_hf_model, max_abs_diff
from flax import nnx
from safetensors.torch import load_file
from test_quantized import checkpoints, source  # noqa: F401 - fixtures: compressed-tensors FP8 checkpoints

import hackable_diffusion as hd
from hackable_diffusion import lora
from hackable_diffusion.errors import CheckpointError
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.interop.qlora_load import load_pretrained_quantized
from hackable_diffusion.lora import qlora
from hackable_diffusion.model import moe
from hackable_diffusion.model.transformer import forward
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.runs import run as run_lib

peft = pytest.importorskip("peft")

SLIDE, FULL = "sliding_attention", "full_attention"
HF_KW = dict(canvas=6, layer_types=[SLIDE, FULL, FULL])  # conftest's tiny model: 3 layers, 4 experts top-2
EVERYTHING = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")
BLOCK = 16
P, C = 9, 6


def _inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  return rng.integers(3, 125, (2, P)), rng.integers(3, 125, (2, C)), (3 * rng.standard_normal((2, C, 128))).astype(
      np.float32)


def _ours(model, ids, canvas, sc) -> np.ndarray:
  return np.asarray(forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(canvas, jnp.int32),
                            self_conditioning_logits=jnp.asarray(sc)))


def _theirs(model, ids, canvas, sc) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), decoder_input_ids=torch.tensor(canvas),
                 self_conditioning_logits=torch.tensor(sc)).logits.float().numpy()


def _stored(path: str) -> dict[str, torch.Tensor]:
  out = {}
  for name in os.listdir(path):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, name)))
  return out


def _quantized_state(model) -> dict[str, np.ndarray]:
  state = nnx.state(model, qlora.QuantizedBase)
  return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


# ---- loading -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme, layout", [("FP8_DYNAMIC", "fused"), ("FP8", "experts")])
def test_fp8_checkpoint_keeps_its_stored_values_and_scales(checkpoints, scheme, layout):  # noqa: F811
  """Per-channel (FP8_DYNAMIC) and per-tensor (FP8) scales, fused experts (dense: quantized at load) and per-expert
  FP8 experts (kept): the stored float8 bytes are the device's, and the logits equal the dequantizing loader's."""
  path = checkpoints(scheme, layout)
  model = load_pretrained_quantized(path, "fp8")
  stored = _stored(path)
  q = model.layers[1].self_attn.q_proj
  w = stored["model.decoder.layers.1.self_attn.q_proj.weight"]  # float8 [out, in]
  s = stored["model.decoder.layers.1.self_attn.q_proj.weight_scale"].float().numpy()
  np.testing.assert_array_equal(np.asarray(q.kernel[...]).T.view(np.uint8), w.view(torch.uint8).numpy())
  np.testing.assert_array_equal(np.asarray(q.kernel_scale[...]).T, np.broadcast_to(s.reshape(-1, 1), (w.shape[0], 1)))
  experts = model.layers[0].experts
  if layout == "experts":  # expert 1's up_proj: rows I..2I of gate_up_proj, kept as stored
    up = stored["model.decoder.layers.0.experts.1.up_proj.weight"]
    inter = up.shape[0]
    np.testing.assert_array_equal(np.asarray(experts.gate_up_proj[...])[1, inter:].view(np.uint8),
                                  up.view(torch.uint8).numpy())
  assert experts.qtype == jnp.float8_e4m3fn and experts.gate_up_proj[...].dtype == jnp.uint8  # the raw bytes
  ids, canvas, sc = _inputs()
  dense = hd.load_pretrained(path)  # fp8 * scale in float32, the dequantizing path
  np.testing.assert_allclose(_ours(model, ids, canvas, sc), _ours(dense, ids, canvas, sc), rtol=0,
                             atol=1e-5 if layout == "experts" else 0.5)
  if layout == "experts":
    return
  # fused experts are stored dense: quantized at load, so only they differ from the dense load (by FP8 rounding)
  dense_experts = qlora.quantize_base(dense, qlora.QuantizationSpec(mode="fp8"))
  np.testing.assert_allclose(_ours(model, ids, canvas, sc), _ours(dense_experts, ids, canvas, sc), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["fp8", "int4"])
def test_dense_checkpoint_is_quantized_tensor_by_tensor(hf_factory, mode):
  """Loading quantized equals loading dense and quantizing (bit for bit), with no dense copy on the device."""
  _, path = hf_factory("qlora_base", **HF_KW)
  spec = qlora.QuantizationSpec(mode=mode, block_size=BLOCK)
  loaded = load_pretrained_quantized(path, mode, block_size=BLOCK)
  reference = qlora.quantize_base(hd.load_pretrained(path), spec)
  got, expected = _quantized_state(loaded), _quantized_state(reference)
  assert set(got) == set(expected) and len(got) == 2 * (7 + 6 + 6 + 3 + 3 * 2)  # values + scales
  for name in expected:
    assert got[name].dtype == expected[name].dtype, name
    np.testing.assert_array_equal(got[name].astype(np.float32), expected[name].astype(np.float32), err_msg=name)
  np.testing.assert_array_equal(np.asarray(loaded.embed_tokens[...]), np.asarray(reference.embed_tokens[...]))
  assert type(loaded.layers[0].router.proj) is nnx.Linear


@pytest.mark.parametrize("layout", ["fused", "experts"])
def test_nvfp4_checkpoint_into_int4_equals_quantizing_the_dequantized_load(checkpoints, layout):  # noqa: F811
  """An NVFP4 checkpoint (compressed-tensors, per-expert NVFP4 experts too) read into an int4 base: every weight is
  decompressed as the dense loader does (equal to compressed-tensors' own decompression, tests/interop/
  test_quantized.py), then quantized onto the int4 grid - bit for bit `quantize_base` of the dense load; the 4-bit
  NVFP4 values are not kept as they are (a second rounding)."""
  path = checkpoints("NVFP4", layout)
  loaded = load_pretrained_quantized(path, "int4", block_size=16)
  reference = qlora.quantize_base(hd.load_pretrained(path), qlora.QuantizationSpec(mode="int4", block_size=16))
  got, expected = _quantized_state(loaded), _quantized_state(reference)
  assert set(got) == set(expected) and got
  for name in expected:
    assert got[name].dtype == expected[name].dtype, name
    np.testing.assert_array_equal(got[name].astype(np.float32), expected[name].astype(np.float32), err_msg=name)
  assert qlora.base_quantization(loaded) == "int4"


@pytest.mark.parametrize("layout", ["fused", "experts"])
def test_nvfp4_checkpoint_is_kept_as_stored(checkpoints, layout):  # noqa: F811
  """An NVFP4 checkpoint read in 'nvfp4' mode keeps its FP4 codes, float8 block scales and global scale as stored
  (compared with the checkpoint's bytes, read here with safetensors); every quantized weight's dense value, rounded
  to bfloat16, is bit for bit the dense loader's (which equals compressed-tensors' own decompression,
  tests/interop/test_quantized.py): no second rounding, unlike the int4 route. Per-expert NVFP4 experts are kept;
  fused experts (stored dense) are quantized to NVFP4 at load."""
  path = checkpoints("NVFP4", layout)
  model = load_pretrained_quantized(path, "nvfp4")
  dense = hd.load_pretrained(path)
  stored = _stored(path)
  q = model.layers[1].self_attn.q_proj
  name = "model.decoder.layers.1.self_attn.q_proj"
  codes = stored[f"{name}.weight_packed"].numpy()  # uint8 [out, in / 2], two FP4 codes a byte
  ours = np.asarray(qlora.typed(q.kernel[...], q.qtype)).astype(np.float32).T  # [out, in]
  lo, hi = codes & 0x0F, codes >> 4
  np.testing.assert_array_equal(ours[:, 0::2], np.arange(16, dtype=np.uint8).view(jnp.float4_e2m1fn)[lo].astype(
      np.float32))
  np.testing.assert_array_equal(ours[:, 1::2], np.arange(16, dtype=np.uint8).view(jnp.float4_e2m1fn)[hi].astype(
      np.float32))
  np.testing.assert_array_equal(np.asarray(q.kernel_scale[...]).T, stored[f"{name}.weight_scale"].view(
      torch.uint8).numpy())
  global_scale = stored[f"{name}.weight_global_scale"].float().numpy().reshape(())
  fp8_values = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
  with np.errstate(invalid="ignore"):  # the table: every float8 value over the global scale, correctly rounded
    np.testing.assert_array_equal(np.asarray(q.kernel_table[...]), (fp8_values / global_scale)[None])
  kept = 0
  for module_path, module in qlora.quantization_targets(model):
    assert qlora.is_quantized(module) and module.quantization == "nvfp4", module_path
    reference = qlora.module_at(dense, module_path)
    for param in (["kernel"] if isinstance(module, qlora.QuantizedLinear) else list(qlora.EXPERT_PARAMS)):
      value = module.dequantized_kernel(jnp.float32) if param == "kernel" else module.dequantized(param, jnp.float32)
      expected = np.asarray(getattr(reference, param)[...], np.float32)
      as_bf16 = np.asarray(value.astype(jnp.bfloat16).astype(jnp.float32))
      if param != "kernel" and layout == "fused":  # stored dense: quantized here (within NVFP4's error)
        assert np.abs(as_bf16 - expected).max() <= 0.2 * np.abs(expected).max(), (module_path, param)
        continue
      np.testing.assert_array_equal(as_bf16, expected, err_msg=f"{module_path} {param}")
      kept += 1
  assert kept >= 7 + 6 + 6 + 3  # every linear layer (and, per expert, the experts)
  if layout == "experts":  # the tiled kernel decodes one expert at a time: gate and up rows use their own table
    experts = model.layers[0].experts
    table = np.asarray(experts.gate_up_proj_table[...])  # [E, 2, 256]: gate's and up's global scales differ
    assert table.shape[1] == 2 and not np.array_equal(table[:, 0], table[:, 1])
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, experts.down_proj.shape[1])), jnp.float32)
    weights = jnp.asarray(rng.random((16, 2)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, experts.gate_up_proj.shape[0], (16, 2)), jnp.int32)
    tiled = experts(x, weights, idx)  # QuantizedExperts' tiled path (the CPU default)
    on_dequantized = moe.experts_forward("dense", x, weights, idx, experts.dequantized("gate_up_proj", jnp.float32),
                                         experts.dequantized("down_proj", jnp.float32))
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(on_dequantized), rtol=1e-5, atol=1e-6)
  ids, canvas, sc = _inputs()
  ours, theirs = _ours(model, ids, canvas, sc), _ours(dense, ids, canvas, sc)
  errors = _position_errors(theirs, ours)
  print(f"NVFP4 kept ({layout}): per-position max |diff| / max |logit| median {np.median(errors):.4f} "
        f"max {errors.max():.4f}")
  if layout == "experts":  # every weight the dense load's up to its bf16 rounding (measured: max 0.013)
    assert errors.max() <= 0.03
  else:  # the fused experts (stored dense) quantized to NVFP4 here: NVFP4's error (measured: median 0.098, max 0.22)
    assert np.median(errors) <= 0.2 and errors.max() <= 0.45


# ---- export ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["fp8", "int4", "nvfp4"])
def trained(request, hf_factory, tmp_path_factory):
  """(mode, base path, a QLoRA model with random adapters on everything, its PEFT export directory)."""
  mode = request.param
  _, path = hf_factory("qlora_base", **HF_KW)
  config = lora.LoraConfig(rank=2, alpha=6, target_modules=EVERYTHING, base_quantization=mode, base_block_size=BLOCK)
  model = lora.apply_lora(load_pretrained_quantized(path, mode, block_size=BLOCK), config, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(0.1 * rng.standard_normal(v.shape), v.dtype)
  out = str(tmp_path_factory.mktemp(f"qlora_peft_{mode}"))
  export_lib.export_peft(model, out, path)
  return mode, path, model, out


def _position_errors(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """max |a - b| over the vocabulary at each position, relative to the largest |logit| of `a` there."""
  return (np.max(np.abs(a - b), axis=-1) / np.max(np.abs(a), axis=-1)).reshape(-1)


def test_peft_export_of_qlora_loads_in_peft(trained):
  """The adapter applies to the dense base in transformers + peft: there it gives exactly our adapters on the dense
  base; against the QLoRA model it differs by the quantization error, which is the base's own (the dense base vs
  the quantized base, no adapters): measured on the conftest model (embedding x10, weights std 0.1) and asserted
  to stay within twice that (median over positions)."""
  mode, path, model, out = trained
  ref = peft.PeftModel.from_pretrained(make_hf_model(0, **HF_KW), out).eval()
  ids, canvas, sc = _inputs()
  theirs = _theirs(ref, ids, canvas, sc)
  dense_base = hd.load_pretrained(path)
  dense = lora.apply_lora(dense_base, lora.LoraConfig(rank=2, alpha=6, target_modules=EVERYTHING), rngs=nnx.Rngs(1))
  nnx.update(dense, nnx.state(model, nnx.LoRAParam))  # the trained adapters on the dense base
  assert max_abs_diff(theirs, _ours(dense, ids, canvas, sc)) <= 1e-4
  adapted = _position_errors(theirs, _ours(model, ids, canvas, sc))
  base_only = _position_errors(_ours(dense_base, ids, canvas, sc),
                               _ours(qlora.quantize_base(nnx.clone(dense_base), qlora.QuantizationSpec(
                                   mode=mode, block_size=BLOCK)), ids, canvas, sc))
  print(f"QLoRA {mode}: per-position max |diff| / max |logit|: adapted (PEFT on the dense base vs ours on the "
        f"quantized base) median {np.median(adapted):.3f} max {adapted.max():.3f}; base alone median "
        f"{np.median(base_only):.3f} max {base_only.max():.3f}")
  assert 0 < np.median(adapted) <= 2 * np.median(base_only)


def test_merged_export_is_the_merge_of_the_dequantized_base(trained, tmp_path):
  mode, path, model, _ = trained
  out = str(tmp_path / "merged")
  export_lib.export_merged(model, out, dtype="float32")
  loaded = hd.load_pretrained(out)
  merged = lora.merge(model)
  for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(merged))):
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))
  ids, canvas, sc = _inputs(1)
  assert max_abs_diff(_ours(loaded, ids, canvas, sc), _ours(model, ids, canvas, sc)) <= 2e-5
  assert qlora.base_quantization(model) == mode  # export does not change the trained model


# ---- the trainer -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [pytest.param("int4", marks=pytest.mark.slow), "nvfp4"])  # the same trainer path
def test_sft_trainer_trains_and_resumes_a_quantized_base(tmp_path, mode):
  """`hd.SFTConfig(lora=hd.LoraConfig(base_quantization=mode))`: the trainer builds the quantized base, trains the
  adapters, checkpoints the 4-bit base (a fresh init's frozen weights are saved; NVFP4's scale tables too) and
  restores it bit for bit."""
  records = [{"prompt": s, "completion": "".join(sorted(s))} for s in ("3141", "2718", "1618", "5772") * 4]
  config = hd.get_preset("tiny", canvas_length=6, vocab_size=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
  args = hd.SFTConfig(output_dir=str(tmp_path / "run"), max_steps=2, batch_size=4, eval_at_end=False,
                      max_prompt_length=6, learning_rate=1e-2,
                      lora=hd.LoraConfig(rank=2, target_modules="all-linear", base_quantization=mode,
                                         base_block_size=BLOCK))
  with hd.SFTTrainer(model=config, train_dataset=records, args=args, progress=False) as trainer:
    metrics = trainer.train()
    assert np.isfinite(metrics["loss"])
    model = trainer.model
    assert qlora.base_quantization(model) == mode
    assert isinstance(model.layers[0].self_attn.q_proj, lora.QLoRALinear)
    before = _quantized_state(model)
  restored = run_lib.load_run(str(tmp_path / "run")).model
  after = _quantized_state(restored)
  assert set(after) == set(before)
  for name in before:
    assert after[name].dtype == before[name].dtype
    np.testing.assert_array_equal(after[name].astype(np.float32), before[name].astype(np.float32), err_msg=name)
  ids, canvas = jnp.asarray([[2, 5, 7, 9]], jnp.int32), jnp.asarray([[6, 5, 8, 11, 3, 1]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(restored(ids, canvas)), np.asarray(model(ids, canvas)))


def test_trainer_loads_a_checkpoint_quantized_tensor_by_tensor(hf_factory, tmp_path, monkeypatch):
  """A run with `model.checkpoint=<HF dir>` and `lora.base_quantization='fp8'` builds its base with the quantizing
  loader (never the dense `load_pretrained`), exactly as `load_pretrained_quantized` reads it."""
  _, path = hf_factory("qlora_base", **HF_KW)

  def dense_load(*args, **kwargs):
    raise AssertionError("the dense loader ran: the base reached the device unquantized")

  monkeypatch.setattr(run_lib, "load_pretrained", dense_load)
  cfg = config_lib.load_config_file("sudoku_lora.py", {"model.checkpoint": path, "lora.base_quantization": "fp8",
                                                       "lora.base_block_size": BLOCK})
  exp = run_lib.as_experiment_config(cfg)
  model = run_lib.build_model(exp, None)
  assert qlora.base_quantization(model) == "fp8"
  expected = _quantized_state(load_pretrained_quantized(path, "fp8", block_size=BLOCK))
  got = _quantized_state(model)
  assert set(got) == set(expected) and got
  for name in expected:
    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_save_pretrained_refuses_a_quantized_base(hf_factory, tmp_path):
  _, path = hf_factory("qlora_base", **HF_KW)
  model = load_pretrained_quantized(path, "int4", block_size=BLOCK)
  with pytest.raises(CheckpointError, match="base is quantized") as e:
    hd.save_pretrained(model, str(tmp_path / "out"))
  assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "out" / "config.json")


def _with_value(path: str, out, name: str, index: tuple[int, ...], value: float) -> str:
  """A copy of the checkpoint `path` in `out` with element `index` of the stored tensor `name` set to `value`."""
  from safetensors.torch import save_file

  for file in os.listdir(path):
    if not file.endswith(".safetensors"):
      (out / file).write_bytes(open(os.path.join(path, file), "rb").read())
      continue
    tensors = load_file(os.path.join(path, file))
    if name in tensors:
      tensor = tensors[name]
      tensors[name] = tensor.float().index_put_(tuple(torch.tensor([i]) for i in index),
                                                torch.tensor([value])).to(tensor.dtype)
    save_file(tensors, str(out / file), metadata={"format": "pt"})
  return str(out)


@pytest.mark.parametrize("mode, scheme, name", [
    ("int4", None, "model.decoder.layers.1.self_attn.q_proj.weight"),  # dense, quantized at load
    ("int4", None, "model.decoder.embed_tokens.weight"),  # dense, not a quantization target
    ("fp8", "FP8_DYNAMIC", "model.decoder.layers.1.self_attn.q_proj.weight"),  # float8 values kept as stored
    ("fp8", "FP8_DYNAMIC", "model.decoder.layers.1.self_attn.q_proj.weight_scale"),  # its scales
    ("nvfp4", "NVFP4", "model.decoder.layers.1.self_attn.q_proj.weight_scale"),  # NVFP4 block scales kept as stored
])
def test_quantized_load_refuses_non_finite_values(hf_factory, checkpoints, tmp_path, mode, scheme, name):  # noqa: F811
  path = hf_factory("qlora_base", **HF_KW)[1] if scheme is None else checkpoints(scheme, "fused")
  bad = _with_value(path, tmp_path, name, (2, 0), float("nan"))
  with pytest.raises(CheckpointError) as e:
    load_pretrained_quantized(bad, mode, block_size=BLOCK)
  msg = str(e.value)
  weight = name[:name.index(".weight")] + ".weight"  # the error names the weight the part belongs to
  assert "\n" not in msg and repr(weight) in msg and "model.safetensors" in msg, msg
  model = load_pretrained_quantized(bad, mode, block_size=BLOCK, check_finite=False)
  assert qlora.base_quantization(model) == mode
