"""QLoRA: a quantized base (FP8 / int4 / NVFP4, `lora.qlora`) under LoRA adapters (JAX only; the checkpoint and PEFT
side is in tests/interop/test_qlora_interop.py).

The references are independent of the code under test: the dense value of every quantized weight recomputed in
numpy from the stored values and scales (the scale broadcast over its own axis and block), compressed-tensors-
equivalent FP8 quantization (`interop.quantized_export.quantize_fp8`, checked bit for bit against the library in
tests/interop/test_fp8_export.py), and the dense model run with the numpy-dequantized weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion import lora
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.interop import quantized_export
from hackable_diffusion.lora import qlora
from hackable_diffusion.model import moe
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, forward, init_model
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import abstract_train_state, make_train_step
from test_lora import model_inputs, randomize_adapters, train_adapters

CFG = get_preset("tiny")
ALL = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")
BLOCK = 16  # divides every input width of the tiny config (16, 32, 64)
MODES = ("fp8", "int4", "nvfp4")
QTYPES = {"fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "nvfp4": jnp.float4_e2m1fn}


def _config(mode: str, **kw) -> lora.LoraConfig:
  return lora.LoraConfig(rank=2, alpha=6.0, target_modules=ALL, base_quantization=mode, base_block_size=BLOCK, **kw)


def numpy_dequantized(values, scale, table=None, out_axis: int = -1) -> np.ndarray:
  """values * scale in float32, the scale repeated over its block (numpy only). NVFP4: the scale bytes looked up
  in the table `[(E,) G, 256]` of their output-axis group."""
  v = np.asarray(jnp.asarray(values).astype(jnp.float32))  # typed values (qlora.typed)
  s = np.asarray(scale)
  if table is not None:
    t = np.asarray(table)
    out, groups = s.shape[out_axis], t.shape[-2]
    shape = [1] * s.ndim
    shape[out_axis] = out
    index = (np.arange(out) // (out // groups)).reshape(shape) * 256 + s.astype(np.int64)
    flat = t.reshape(*t.shape[:-2], -1)
    s = flat[index] if flat.ndim == 1 else np.stack([flat[e][index[e]] for e in range(flat.shape[0])])
  s = s.astype(np.float32)
  for axis, (n, m) in enumerate(zip(v.shape, s.shape)):
    if m not in (1, n):
      s = np.repeat(s, n // m, axis=axis)
  return v * s


def _dense_weights(model) -> dict[tuple, np.ndarray]:
  """Module path (+ expert tensor) -> numpy-dequantized dense weight of every quantized module."""
  out = {}
  for path, m in qlora.quantization_targets(model):
    if isinstance(m, qlora.QuantizedLinear):
      out[(*path, "kernel")] = numpy_dequantized(qlora.typed(m.kernel[...], m.qtype), m.kernel_scale[...],
                                                  _table(m, "kernel"))
    elif isinstance(m, qlora.QuantizedExperts):
      for name in qlora.EXPERT_PARAMS:
        out[(*path, name)] = numpy_dequantized(qlora.typed(getattr(m, name)[...], m.qtype),
                                                getattr(m, f"{name}_scale")[...], _table(m, name), out_axis=-2)
  return out


def _table(module, name: str):
  var = getattr(module, f"{name}_table")
  return None if var is None else var[...]


def _with_weights(dense_model, weights: dict[tuple, np.ndarray]):
  """A copy of the dense model with the given weights (an independent reference for the quantized forward)."""
  model = nnx.clone(dense_model)
  for path, value in weights.items():
    var = qlora.module_at(model, path[:-1])
    getattr(var, path[-1]).value = jnp.asarray(value, jnp.float32)
  return model


def _weight(model, path):
  return np.asarray(getattr(qlora.module_at(model, path[:-1]), path[-1])[...], np.float32)


@pytest.fixture(scope="module")
def base():
  return init_model(CFG, 0)


@pytest.fixture(scope="module", params=MODES)
def quantized(request, base):
  """(mode, the QLoRA-wrapped model: B = 0, so its output is the quantized base's)."""
  return request.param, lora.apply_lora(base, _config(request.param), rngs=nnx.Rngs(1))


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    (dict(base_quantization="int8"), "base_quantization='int8'"), (dict(base_quantization="nf4"), "nf4"),
    (dict(base_block_size=0), "base_block_size=0"), (dict(base_block_size=True), "base_block_size=True"),
])
def test_config_validation_one_line(kwargs, needle):
  with pytest.raises(ConfigError) as e:
    lora.LoraConfig(**kwargs)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_nvfp4_on_a_width_not_divisible_by_16_is_one_line():
  narrow = init_model(get_preset("tiny", hidden_size=24, intermediate_size=48, moe_intermediate_size=24), 0)
  with pytest.raises(ConfigError) as e:
    lora.apply_lora(narrow, lora.LoraConfig(base_quantization="nvfp4"), rngs=nnx.Rngs(0))
  msg = str(e.value)
  assert "\n" not in msg and "input width 24" in msg and "NVFP4's block" in msg and "layers.0." in msg


def test_block_size_that_does_not_divide_names_the_layer(base):
  with pytest.raises(ConfigError) as e:
    lora.apply_lora(base, lora.LoraConfig(base_quantization="int4", base_block_size=24), rngs=nnx.Rngs(0))
  msg = str(e.value)
  assert "\n" not in msg and "base_block_size=24" in msg and "layers.0." in msg


def test_other_mode_on_a_quantized_base_is_refused(base):
  fp8 = qlora.quantize_base(nnx.clone(base), qlora.QuantizationSpec(mode="fp8"))
  with pytest.raises(ConfigError, match="already quantized as 'fp8'"):
    lora.apply_lora(fp8, _config("int4"), rngs=nnx.Rngs(0))
  same = lora.apply_lora(fp8, _config("fp8"), rngs=nnx.Rngs(0))  # kept as it is
  assert same.layers[0].self_attn.q_proj.qtype == jnp.float8_e4m3fn


# ---- the stored format ---------------------------------------------------------------------------------------------
def test_base_is_quantized_everywhere_but_the_router(quantized):
  mode, model = quantized
  qtype = jnp.dtype(QTYPES[mode])
  pack = 1 if mode == "fp8" else 2  # stored as raw bytes: float8 one value per byte, 4-bit two along the last axis
  layer = model.layers[0]
  for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj, model.self_conditioning.mlp.gate_proj):
    assert isinstance(m, lora.QLoRALinear) and m.kernel[...].dtype == jnp.uint8
    assert m.kernel.shape == (m.in_features, m.out_features // pack)
    values = qlora.typed(m.kernel[...], m.qtype)
    assert values.dtype == qtype and values.shape == (m.in_features, m.out_features)
  experts = layer.experts
  assert isinstance(experts, lora.QLoRAExperts) and experts.down_proj[...].dtype == jnp.uint8
  assert experts.weight_shape("down_proj") == (4, 32, experts.intermediate)  # [E, H, I]
  assert experts.down_proj.shape == (4, 32, experts.intermediate // pack)
  assert type(layer.router.proj) is nnx.Linear and layer.router.proj.kernel[...].dtype == jnp.float32
  assert model.embed_tokens[...].dtype == jnp.float32
  # not a Param: no optimizer filter can select the base; the adapters are the only LoRAParams
  assert not any(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(nnx.state(model, qlora.QuantizedBase)))
  # the scales: per output channel (fp8), per block of BLOCK (int4) / 16 (nvfp4) inputs and output channel
  q = layer.self_attn.q_proj  # kernel [32, 32]
  assert q.kernel_scale.shape == ((1, 32) if mode == "fp8" else (32 // BLOCK, 32))
  assert layer.experts.gate_up_proj_scale.shape == ((4, 32, 1) if mode == "fp8" else (4, 32, 32 // BLOCK))
  if mode == "nvfp4":  # float8 block scales (as bytes) and a table of their quotients by the global scale
    assert q.kernel_scale[...].dtype == jnp.uint8 and q.kernel_table[...].dtype == jnp.float32
    assert q.kernel_table.shape == (1, 256) and layer.experts.gate_up_proj_table.shape == (4, 1, 256)
    codes = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
      ratio = np.asarray(q.kernel_table[...])[0] / codes  # one global scale per tensor: a constant 1 / global
    finite = np.isfinite(ratio) & (codes != 0)
    np.testing.assert_allclose(ratio[finite], ratio[finite][0], rtol=2**-23)
  else:
    assert q.kernel_table is None and layer.experts.down_proj_table is None


def test_dequantized_weights_are_within_half_a_step_of_the_dense_ones(base, quantized):
  """A wrong scale axis or block would put whole rows off by far more than half a quantization step."""
  mode, model = quantized
  weights = _dense_weights(model)
  assert len(weights) == 7 + 6 + 3 + 2 * 2  # linears (a full layer has no v_proj), self-conditioning MLP, experts
  for path, deq in weights.items():
    dense = _weight(base, path)
    module = qlora.module_at(model, path[:-1])
    # the forward's dequantization is the numpy one (qwix: values * scales broadcast over their blocks)
    ours = module.dequantized_kernel(jnp.float32) if path[-1] == "kernel" else module.dequantized(path[-1],
                                                                                                  jnp.float32)
    np.testing.assert_array_equal(np.asarray(ours), deq)
    name = path[-1]
    step = numpy_dequantized(np.ones(dense.shape, np.float32), getattr(module, f"{name}_scale")[...],
                              _table(module, name), -1 if name == "kernel" else -2)
    err = np.abs(deq - dense)
    if mode == "int4":  # round to the nearest of 16 levels of `scale` (bf16 scale: 2^-9 relative on top)
      assert np.all(err <= 0.5 * step + 8 * step * 2.0**-8), path
    elif mode == "nvfp4":  # E2M1 levels 0 .. 6 in steps of 0.5 / 1 / 2 of `step` (the block scale rounded to e4m3)
      assert np.all(err <= step + np.abs(dense) * 2.0**-3), path
    else:  # e4m3: 3 mantissa bits, relative error 2^-4; below the normal range an absolute 2^-10 * scale
      assert np.all(err <= np.maximum(np.abs(dense) * 2.0**-4, step * 2.0**-9) * 1.0001), path
    assert np.max(err) > 0  # really quantized


def test_fp8_matches_compressed_tensors_channel_quantization(base):
  """qwix's FP8 per-channel quantization against compressed-tensors' (`quantized_export.quantize_fp8`, checked against the
  library itself): the scales `max|row| / 448` agree to one float32 ulp (qwix's division may round differently)
  and so the float8 values are the same, except (rarely) a value on a rounding boundary, one float8 step away."""
  model = qlora.quantize_base(nnx.clone(base), qlora.QuantizationSpec(mode="fp8"))
  total = differ = 0
  for path, m in qlora.quantization_targets(model):
    if isinstance(m, qlora.QuantizedLinear):
      dense = _weight(base, (*path, "kernel")).T  # torch layout [out, in]
      values, scale = quantized_export.quantize_fp8(dense, "float32")
      np.testing.assert_allclose(np.asarray(m.kernel_scale[...]).T, scale, rtol=2.4e-7, atol=0)
      ours = np.asarray(qlora.typed(m.kernel[...], m.qtype)).T.astype(np.float32)
      theirs = values.astype(np.float32)
      diff = ours != theirs
      total, differ = total + diff.size, differ + int(diff.sum())
      assert np.all(np.abs(ours - theirs)[diff] <= np.abs(theirs)[diff] * 2.0**-3 + 2.0**-9), path
  assert differ <= 1e-3 * total, (differ, total)


def test_logits_equal_the_dense_model_on_dequantized_weights(base, quantized):
  """The quantized forward == the unquantized model run with the numpy-dequantized weights; its distance to the
  dense model's logits is the quantization error (measured here: fp8 ~0.06-0.08, int4 ~0.2-0.25 on logits of
  max |.| ~0.5 of this random tiny model, whose weights are all noise)."""
  mode, model = quantized
  ids, canvas, sc = model_inputs()
  ours = np.asarray(forward(model, ids, canvas, self_conditioning_logits=sc))
  reference = _with_weights(base, _dense_weights(model))
  np.testing.assert_allclose(ours, np.asarray(forward(reference, ids, canvas, self_conditioning_logits=sc)),
                             rtol=0, atol=2e-6)
  dense = np.asarray(forward(base, ids, canvas, self_conditioning_logits=sc))
  err = float(np.max(np.abs(ours - dense)))
  scale = float(np.max(np.abs(dense)))
  bound = {"fp8": 0.25, "int4": 0.75, "nvfp4": 0.75}[mode]  # relative to the largest logit
  print(f"QLoRA {mode}: max |logits - dense| = {err:.4f} (max |logit| {scale:.3f}, "
        f"rel {err / scale:.3f}; mean {float(np.mean(np.abs(ours - dense))):.4f})")
  assert 0 < err <= bound * scale


# ---- merge -------------------------------------------------------------------------------------------------------
def test_merge_equals_merge_of_the_dequantized_base(base, quantized):
  mode, qlora_model = quantized
  model = nnx.clone(qlora_model)
  randomize_adapters(model, 2)
  merged = lora.merge(model)
  assert not lora.has_lora(merged) and qlora.base_quantization(merged) == "none"
  assert not nnx.state(merged, qlora.QuantizedBase)
  weights = _dense_weights(model)
  for path, m in lora.lora_modules(model):
    if isinstance(m, lora.LoRALinear):
      a, b = np.asarray(m.lora_a[...]), np.asarray(m.lora_b[...])
      weights[(*path, "kernel")] = weights[(*path, "kernel")] + m.scale * (a @ b)
    else:
      for name in m.targets:
        a, b = np.asarray(getattr(m, f"{name}_lora_a")[...]), np.asarray(getattr(m, f"{name}_lora_b")[...])
        weights[(*path, name)] = weights[(*path, name)] + m.scale * np.einsum("eir,ero->eoi", a, b)
  for path, expected in weights.items():
    np.testing.assert_allclose(_weight(merged, path), expected, rtol=1e-6, atol=1e-7, err_msg=str(path))
  # every other variable is the base's, and the merged model computes what the adapted quantized one does: up to fp32
  # rounding through the layers (W + s*AB summed once vs Wx + s*B(Ax); measured up to 2.2e-5 on outputs of magnitude
  # ~0.4, nvfp4), while the adapters move the outputs by ~0.67, so a merge that dropped or mis-scaled them fails
  ids, canvas, sc = model_inputs(1)
  np.testing.assert_allclose(np.asarray(forward(merged, ids, canvas, self_conditioning_logits=sc)),
                             np.asarray(forward(model, ids, canvas, self_conditioning_logits=sc)), rtol=0, atol=1e-4)
  assert {p for p, _ in nnx.to_flat_state(nnx.state(merged))} == {p for p, _ in nnx.to_flat_state(nnx.state(base))}


def test_bf16_base_merges_back_to_bf16(base):
  bf16 = init_model(CFG.replace(param_dtype="bfloat16", dtype="bfloat16"), 0)
  model = lora.apply_lora(bf16, _config("int4"), rngs=nnx.Rngs(0))
  assert model.layers[0].experts.param_dtype == "bfloat16"
  merged = lora.merge(model)
  assert merged.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  assert merged.layers[0].experts.gate_up_proj[...].dtype == jnp.bfloat16


# ---- training ------------------------------------------------------------------------------------------------------
def _raw(state) -> dict[str, bytes]:
  return {".".join(map(str, p)): np.asarray(v[...]).tobytes() for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("mode", ["fp8", pytest.param("int4", marks=pytest.mark.slow),  # one format in the default
                                  pytest.param("nvfp4", marks=pytest.mark.slow)])  # tier: the step is shared
def test_step_trains_only_adapters_and_lowers_the_loss(base, mode):
  model, _, initial, state, losses = train_adapters(base, _config(mode, dropout=0.1), 15)
  rest_before, params_before = _raw(initial.rest), _raw(initial.params)
  assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
  rest_after = _raw(state.rest)
  quantized_keys = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, qlora.QuantizedBase))}
  assert quantized_keys and quantized_keys <= set(rest_after)
  assert rest_after == rest_before  # the quantized base (and every other frozen variable) bit-identical
  params_after = _raw(state.params)
  assert sum(params_after[k] != params_before[k] for k in params_after) == len(params_after)


def _step_arguments(mode: str) -> int:
  """Argument bytes of the compiled LoRA step (the base in bf16, or quantized) of a mid-size tiny config."""
  cfg = get_preset("tiny", hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32,
                   global_head_dim=32, param_dtype="bfloat16", dtype="bfloat16", vocab_size=64)
  config = lora.LoraConfig(rank=4, target_modules=lora.ALL_LINEAR, base_quantization=mode, base_block_size=64)
  model = nnx.eval_shape(lambda: lora.apply_lora(DiffusionGemma(cfg, rngs=nnx.Rngs(0)), config, rngs=nnx.Rngs(1)))
  graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
  tx, _ = make_optimizer(OptimizerConfig())
  state = abstract_train_state(params, rest, tx)
  step = make_train_step(graphdef, tx, LossConfig(), jit=False)
  b, p, c = 2, 4, cfg.canvas_length
  batch = SFTBatch(prompt_ids=jax.ShapeDtypeStruct((b, p), jnp.int32), prompt_mask=jax.ShapeDtypeStruct((b, p), bool),
                   completion_ids=jax.ShapeDtypeStruct((b, c), jnp.int32),
                   completion_mask=jax.ShapeDtypeStruct((b, c), bool))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  compiled = jax.jit(step, donate_argnums=0).lower(state, batch, key).compile()
  return compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.slow  # three real-width-ish compiles; test_qlora_experts.py checks the per-expert growth
def test_compiled_step_holds_less_with_a_quantized_base():
  """The compiled step's arguments (base + adapters + Adam state + batch): a bf16 base > FP8 > int4 (measured at
  hidden 128: 1.73 / 1.01 / 0.64 MiB; the embedding, norms and router stay bf16 in all three)."""
  sizes = {mode: _step_arguments(mode) for mode in ("none", "fp8", "int4")}
  print("compiled step arguments:", {k: f"{v / 2**20:.2f} MiB" for k, v in sizes.items()})
  assert sizes["int4"] < sizes["fp8"] < 0.8 * sizes["none"]


def test_experts_subclass_the_model_experts(quantized):
  _, model = quantized
  assert isinstance(model.layers[0].experts, moe.Experts)


def _toy_step_temporaries(layers: int, qtype, tie: bool, width: int = 512) -> int:
  """Temporaries of a compiled step of `layers` remat'd layers `h -> tanh(h @ dequantize(W) + h @ A @ B)`, as
  QuantizedLinear computes them, gradients to the adapters only, over 2 micro-batches (a scan)."""
  from hackable_diffusion.model import remat

  def loss(x, qs, ss, ab):
    h = x
    for i in range(layers):
      def layer(st, h):
        q, s, a, b = st
        w = qlora.dequantize(q, s, qtype, jnp.float32, qlora.input_tie(h) if tie else None)
        return jnp.tanh(h @ w + (h @ a) @ b)
      h = remat.recompute_in_backward(layer)((qs[i], ss[i], ab[0][i], ab[1][i]), h)
    return jnp.sum(h ** 2)

  def step(x, qs, ss, ab):
    def body(g, xm):
      return jax.tree.map(jnp.add, g, jax.grad(loss, argnums=3)(xm, qs, ss, ab)), None
    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, ab), x)[0]

  stored = jax.eval_shape(lambda: qlora.stored(jnp.zeros((layers, width, width), qtype), qtype))  # as the modules
  shapes = (jax.ShapeDtypeStruct((2, 8, width), jnp.float32), stored,
            jax.ShapeDtypeStruct((layers, 1, width), jnp.float32),
            (jax.ShapeDtypeStruct((layers, width, 4), jnp.float32), jax.ShapeDtypeStruct((layers, 4, width),
                                                                                        jnp.float32)))
  return jax.jit(step).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("qtype", [jnp.float8_e4m3fn, jnp.int4])
def test_dequantized_weights_are_not_kept_across_layers(qtype):
  """The input tie keeps XLA from hoisting each layer's dequantization out of the micro-batch loop or merging the
  remat recomputation into the forward pass: without it every layer's dense float32 weight stays alive (the
  temporaries grow by a whole dense weight per layer); with it by about the quantized weight's own size (XLA:CPU,
  measured: fp8 0.02, int4 0.02 dense float32 weights per layer; int4 was 0.14, a copy of its bytes, when stored as
  jnp.int4 rather than packed in uint8)."""
  dense = 512 * 512 * 4
  grow = {tie: (_toy_step_temporaries(8, qtype, tie) - _toy_step_temporaries(4, qtype, tie)) / 4 for tie in (0, 1)}
  print(f"{jnp.dtype(qtype).name}: temporaries per layer {grow[0] / dense:.2f} dense weights without the tie, "
        f"{grow[1] / dense:.2f} with it")
  assert grow[0] >= 0.9 * dense and grow[1] <= 0.05 * dense


@pytest.mark.parametrize("mode", ["int4", "nvfp4"])
def test_an_odd_output_width_is_kept_unpacked_and_dequantizes_like_the_packed_path(mode):
  """4-bit values pack two per byte along the output axis; an odd width keeps them unpacked (and the tie is added
  in their own dtype). Reference: the same columns inside an even-width weight, which takes the packed path (an
  extra column of smaller magnitude leaves NVFP4's per-tensor global scale and every other column unchanged)."""
  from hackable_diffusion.lora import qarrays  # noqa: PLC0415
  spec = qarrays.QuantizationSpec(mode=mode, block_size=16)
  w = np.random.default_rng(0).standard_normal((32, 6)).astype(np.float32)
  w[:, 5] *= 0.01
  odd_q, odd_table = qarrays.quantize_weight(w[:, :5], spec, in_axis=0, out_axes=(1,))
  even_q, even_table = qarrays.quantize_weight(w, spec, in_axis=0, out_axes=(1,))
  odd_stored, even_stored = qarrays.stored(odd_q.qvalue, odd_q.qtype), qarrays.stored(even_q.qvalue, even_q.qtype)
  assert odd_stored.dtype != jnp.uint8 and odd_stored.shape == (32, 5)  # unpacked
  assert even_stored.dtype == jnp.uint8 and even_stored.shape == (32, 3)  # packed
  assert qarrays.logical_shape(odd_stored, odd_q.qtype) == (32, 5)
  tie = jnp.zeros((), jnp.float32)

  def deq(q, values, table):
    scale = qarrays.stored(q.scale, jnp.float8_e4m3fn) if table is not None else q.scale
    return np.asarray(qarrays.dequantize(values, scale, q.qtype, jnp.float32, tie=tie, table=table))

  odd, even = deq(odd_q, odd_stored, odd_table), deq(even_q, even_stored, even_table)
  np.testing.assert_array_equal(odd, even[:, :5])
  assert np.abs(odd - w[:, :5]).max() > 0 and np.abs(odd - w[:, :5]).max() < 0.5 * np.abs(w).max()
