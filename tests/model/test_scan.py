"""Scanned layers (`model.scan`): same function and gradients as the unrolled model, the same names and shardings
once unstacked, one period compiled instead of every layer, and smaller compiled temporaries with remat."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import hackable_diffusion as hd
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss, draw_noise
from hackable_diffusion.errors import ConfigError
from hackable_diffusion import lora as lora_lib
from hackable_diffusion.interop import peft
from hackable_diffusion.lora.adapters import LoraConfig, apply_lora
from hackable_diffusion.model import scan
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, init_model
from hackable_diffusion.sharding import logical

PATTERN = ("sliding_attention", "full_attention")
GROUPS = 2  # 4 layers: two periods are enough to check the stacking order, and compile faster than three
LAST = 2 * GROUPS - 1  # the last layer: block 1 of group GROUPS - 1
VOCAB, CANVAS = 64, 8


def _config(remat: str = "none", **kw):
  return get_preset("tiny", num_hidden_layers=2 * GROUPS, layer_types=PATTERN * GROUPS, remat=remat,
                    vocab_size=VOCAB, canvas_length=CANVAS, **kw)


def _model(remat: str = "none", *, lora: LoraConfig | None = None, scanned: bool = False, seed: int = 0):
  model = init_model(_config(remat), seed=seed)
  if lora is not None:
    model = apply_lora(model, lora, rngs=nnx.Rngs(1))
  if scanned:
    model = scan.stack_layers(model)
  return model


def _batch(b=3, p=5, w=CANVAS, seed=0):
  rng = np.random.default_rng(seed)
  return SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, VOCAB, (b, p)), jnp.int32),
                  prompt_mask=jnp.asarray(np.arange(p)[None] >= rng.integers(0, 2, (b, 1))),
                  completion_ids=jnp.asarray(rng.integers(3, VOCAB, (b, w)), jnp.int32),
                  completion_mask=jnp.asarray(np.arange(w)[None] < rng.integers(1, w + 1, (b, 1))))


def _flat(state) -> dict:
  return {tuple(path): np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
          for path, v in nnx.to_flat_state(state)}


def _grads(model, filt, linked: bool = False):
  """(loss, gradients of the `filt` variables by path, layer by layer) of the diffusion loss on a fixed batch;
  `linked`: the passes share one gradient buffer (`scan.link_passes`, what a training step runs)."""
  batch, key, cfg = _batch(), jax.random.key(1), LossConfig()
  noise = draw_noise(key, batch, CANVAS, VOCAB, cfg)
  graphdef, params, rest = nnx.split(model, filt, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest)
    return diffusion_loss(scan.link_passes(m) if linked else m, batch, key, cfg, noise=noise)[0]

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  as_model = scan.unstack_layers(nnx.merge(graphdef, grads, rest))  # gradients named layer by layer
  return float(value), _flat(nnx.state(as_model, filt))


_LORA = LoraConfig(rank=2, target_modules=("all-linear", "experts"))


@functools.cache
def _unrolled_grads(with_lora: bool) -> tuple[float, dict]:
  """The reference of the gradient tests: the unrolled model without remat (computed once per fine-tuning kind)."""
  return _grads(_model(lora=_LORA if with_lora else None), nnx.LoRAParam if with_lora else nnx.Param)


@pytest.mark.parametrize("lora,remat,linked", [
    pytest.param(None, "none", False, marks=pytest.mark.slow),  # unlinked forms: minutes of compiling
    pytest.param(_LORA, "nothing_saveable", False, marks=pytest.mark.slow),
    (None, "nothing_saveable", True), (_LORA, "nothing_saveable", True)],
                         ids=["full", "lora-remat", "full-linked", "lora-linked"])
def test_scanned_gradients_equal_the_unrolled_model(lora, remat, linked):
  """Loss and every gradient (full fine-tuning: all parameters; LoRA: the adapters, experts included) of the
  scanned model (without remat; with remat; with linked passes, which share one gradient buffer and recompute in
  their own backward pass) equal the unrolled model without remat (fp32, <= 1e-5 of the largest)."""
  filt = nnx.Param if lora is None else nnx.LoRAParam
  ref_loss, ref = _unrolled_grads(lora is not None)
  scale = max(float(np.abs(g).max()) for g in ref.values())
  assert scale > 0 and len(ref) > 10
  loss, got = _grads(_model(remat, lora=lora, scanned=True), filt, linked)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert got.keys() == ref.keys()
  for path, g in ref.items():
    np.testing.assert_allclose(got[path], g, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))


def test_stack_then_unstack_gives_the_model_back():
  """Every variable (path, dtype, value bit for bit) and the graph itself (LoRA adapters' static dropout indices,
  which stacking resets, included) come back; the scanned model holds one stacked block per period position."""
  model = _model(lora=LoraConfig(rank=2, target_modules=("all-linear", "experts")))
  graphdef, state = nnx.split(model)
  before = _flat(state)
  scanned = scan.stack_layers(_model(lora=LoraConfig(rank=2, target_modules=("all-linear", "experts"))))
  assert scan.is_scanned(scanned) and len(scanned.layers.blocks) == len(PATTERN)
  kernel = scanned.layers.blocks[1].self_attn.q_proj.kernel[...]
  assert kernel.shape == (GROUPS, *model.layers[1].self_attn.q_proj.kernel[...].shape)
  np.testing.assert_array_equal(kernel[GROUPS - 1], model.layers[LAST].self_attn.q_proj.kernel[...])
  back = scan.unstack_layers(scanned)
  back_graphdef, back_state = nnx.split(back)
  assert back_graphdef == graphdef
  after = _flat(back_state)
  assert after.keys() == before.keys()
  for path, value in before.items():
    assert after[path].dtype == value.dtype
    np.testing.assert_array_equal(after[path], value, err_msg=str(path))


def test_stacked_variables_shard_like_their_layers():
  """A stacked variable's logical axes are its layer's with a leading replicated (layer) axis, so on any mesh its
  partition spec is the layer's with `None` in front."""
  unrolled = dict(nnx.to_flat_state(nnx.state(_model().layers[1])))
  stacked = dict(nnx.to_flat_state(nnx.state(scan.stack_layers(_model()).layers.blocks[1])))
  assert stacked.keys() == unrolled.keys()
  mesh = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2}
  sharded = 0
  for path, var in unrolled.items():
    axes, stacked_axes = logical.variable_axes(var), logical.variable_axes(stacked[path])
    if axes is None:
      assert stacked_axes is None
      continue
    assert stacked_axes == (None, *axes)
    spec = logical.logical_to_mesh_spec(axes, mesh=mesh, shape=var.get_value().shape)
    stacked_spec = logical.logical_to_mesh_spec(stacked_axes, mesh=mesh, shape=stacked[path].get_value().shape)
    assert stacked_spec == (PartitionSpec(None, *spec) if len(spec) else PartitionSpec())
    sharded += len(spec) > 0
  assert sharded > 5


def _count_equations(jaxpr) -> int:
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in jax.core.jaxprs_in_params(eqn.params):
      n += _count_equations(sub)
  return n


def test_the_scanned_forward_traces_one_period():
  """The traced program of the scanned model holds the layers of one period once (the scan body), not every
  layer: about 1/GROUPS of the unrolled program's equations in the layers."""
  ids, canvas = jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, CANVAS), jnp.int32)
  counts = {}
  for scanned in (False, True):
    graphdef, state = nnx.split(_model(scanned=scanned))
    jaxpr = jax.make_jaxpr(lambda st, g=graphdef: nnx.merge(g, st)(ids, canvas))(state)
    counts[scanned] = _count_equations(jaxpr.jaxpr)
  assert counts[True] < counts[False] * (1.5 / GROUPS), counts


def _temp_bytes(remat: str, scanned: bool) -> int:
  groups = 3  # the measurement in the docstring below
  cfg = get_preset("tiny", num_hidden_layers=2 * groups, layer_types=PATTERN * groups, remat=remat, vocab_size=256,
                   canvas_length=32, hidden_size=64, intermediate_size=128, moe_intermediate_size=32)

  def make():
    model = apply_lora(DiffusionGemma(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=4), rngs=nnx.Rngs(0))
    return scan.stack_layers(model) if scanned else model

  graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.LoRAParam, ...)
  b, p, w = 2, 32, 64
  batch = SFTBatch(prompt_ids=jax.ShapeDtypeStruct((b, p), jnp.int32), prompt_mask=jax.ShapeDtypeStruct((b, p), bool),
                   completion_ids=jax.ShapeDtypeStruct((b, w), jnp.int32),
                   completion_mask=jax.ShapeDtypeStruct((b, w), bool))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

  def step(params, rest, batch, key):
    return jax.grad(lambda pr: diffusion_loss(nnx.merge(graphdef, pr, rest), batch, key, LossConfig())[0])(params)

  return jax.jit(step).lower(params, rest, batch, key).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # three compiles of a LoRA step; tests/model/test_remat.py keeps the unscanned check
def test_scan_with_remat_shrinks_the_compiled_temporaries():
  """A LoRA gradient step compiled on this CPU keeps far less with the layers scanned and rematerialised than
  unrolled without remat (measured: 4.3 vs 17.7 MiB; unrolled with remat 7.9 MiB, not compiled here: slow)."""
  plain = _temp_bytes("none", False)
  scanned = _temp_bytes("nothing_saveable", True)
  assert scanned < 0.4 * plain, (scanned, plain)


def test_exports_of_a_scanned_model_equal_the_unrolled_ones(tmp_path):
  """PEFT adapter tensors and a merged Hugging Face checkpoint written from the scanned model are those of the
  unrolled model (names and values), and a PEFT adapter read into a scanned model gives it the same forward."""
  lora = LoraConfig(rank=2, target_modules=("all-linear", "experts"))
  unrolled = _model(lora=lora)
  # non-zero adapters: lora_b starts at zero
  for var in jax.tree.leaves(nnx.state(unrolled, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    var.set_value(var.get_value() + 0.01)
  scanned = scan.stack_layers(nnx.clone(unrolled))
  ref, ref_fields = peft.adapter_state(unrolled)
  got, got_fields = peft.adapter_state(scanned)
  assert got_fields == ref_fields and got.keys() == ref.keys()
  for name, t in ref.items():
    np.testing.assert_array_equal(got[name], t, err_msg=name)
  hd.save_pretrained(lora_lib.merge(unrolled), str(tmp_path / "ref"))
  merged_scanned = scan.stack_layers(lora_lib.merge(scanned))  # written from the stacked form (on the host)
  hd.save_pretrained(merged_scanned, str(tmp_path / "got"))
  host = scan.unstack_layers(merged_scanned, on_host=True)
  assert isinstance(host.layers[LAST].self_attn.q_proj.kernel.get_value(), np.ndarray)  # a host view, no device copy
  from safetensors.numpy import load_file
  a, b = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(tmp_path / "got" / "model.safetensors"))
  assert a.keys() == b.keys() and any(f".layers.{LAST}." in k for k in a)
  for name in a:
    np.testing.assert_array_equal(b[name], a[name], err_msg=name)
  peft.save_adapter(unrolled, str(tmp_path / "adapter"))
  loaded = peft.load_adapter(scan.stack_layers(_model()), str(tmp_path / "adapter"))
  assert scan.is_scanned(loaded)
  ids, canvas = _batch().prompt_ids, _batch().completion_ids
  np.testing.assert_allclose(np.asarray(loaded(ids, canvas)), np.asarray(unrolled(ids, canvas)), rtol=1e-5, atol=1e-5)


def test_load_pretrained_with_scan_layers_returns_stacked_layers(tmp_path):
  """`hd.load_pretrained(path, scan_layers=True)` returns the layers stacked (a PEFT adapter applied first) with the
  unrolled model's forward; `stack=False` (what the trainer uses, to add its adapters first) leaves them unrolled."""
  lora = LoraConfig(rank=2, target_modules=("all-linear",))
  base = _model()
  hd.save_pretrained(base, str(tmp_path / "base"))
  adapted = apply_lora(nnx.clone(base), lora, rngs=nnx.Rngs(1))
  for var in jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    var.set_value(var.get_value() + 0.01)
  peft.save_adapter(adapted, str(tmp_path / "adapter"))
  ids, canvas = _batch().prompt_ids, _batch().completion_ids
  for adapter, ref in ((None, base), (str(tmp_path / "adapter"), adapted)):
    got = hd.load_pretrained(str(tmp_path / "base"), dtype="float32", adapter=adapter, scan_layers=True)
    assert scan.is_scanned(got) and got.config.scan_layers
    np.testing.assert_allclose(np.asarray(got(ids, canvas)), np.asarray(ref(ids, canvas)), rtol=1e-5, atol=1e-5)
  kept = hd.load_pretrained(str(tmp_path / "base"), dtype="float32", scan_layers=True, stack=False)
  assert not scan.is_scanned(kept) and len(kept.layers) == 2 * GROUPS


def test_generate_with_a_scanned_model_gives_the_unrolled_sequences():
  """The sampler (encode writes the cache through the scan; the denoising loop decodes through it) gives the same
  sequences for the same key."""
  cfg = hd.SamplingConfig(max_new_tokens=2 * CANVAS, max_denoising_steps=6)
  ids = _batch().prompt_ids
  out = [hd.generate(_model(scanned=s), ids, cfg, rng=jax.random.key(3)).sequences for s in (False, True)]
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out[0]))


def test_a_scanned_model_keeps_its_cache_stacked():
  """`init_cache` of a scanned model is stacked (`keys[j]`: `[groups, B, S, ...]`, layers j, j + period, ...);
  encoding writes the numbers the unrolled model writes layer by layer, and either model decodes from either layout
  (a cache of the other layout is converted) with the same logits."""
  batch = _batch()
  unrolled, scanned = _model(), _model(scanned=True)
  caches = {}
  for name, m in (("unrolled", unrolled), ("scanned", scanned)):
    _, caches[name] = m.encode(batch.prompt_ids, m.init_cache(3, 5), batch.prompt_mask)
  assert caches["unrolled"].groups == 0 and len(caches["unrolled"].keys) == 2 * GROUPS
  assert caches["scanned"].groups == GROUPS and [k.shape[:2] for k in caches["scanned"].keys] == [(GROUPS, 3)] * 2
  per_layer = caches["scanned"].regrouped(0)
  for got, ref in zip(per_layer.keys + per_layer.values, caches["unrolled"].keys + caches["unrolled"].values):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(caches["unrolled"].regrouped(GROUPS).keys[1][GROUPS - 1]),
                                np.asarray(caches["unrolled"].keys[LAST]))  # block 1 of the last group
  # row replacement along the stacked batch axis (axis 1) == the same rows replaced layer by layer
  which, other = jnp.array([True, False, True]), scanned.init_cache(3, 5)
  picked, ref_picked = caches["scanned"].where_rows(which, other).regrouped(0), caches["unrolled"].where_rows(
      which, other.regrouped(0))
  for got, ref in zip(picked.keys + picked.values, ref_picked.keys + ref_picked.values):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
  assert not np.asarray(picked.keys[LAST])[1].any() and np.asarray(picked.keys[LAST])[0].any()
  with pytest.raises(ValueError, match=f"groups=3 is invalid for {2 * GROUPS} layers"):
    caches["unrolled"].regrouped(3)
  canvas = batch.completion_ids
  ref = np.asarray(unrolled.decode(canvas, caches["unrolled"]))
  for m, cache in ((scanned, caches["scanned"]), (scanned, caches["unrolled"]), (unrolled, caches["scanned"])):
    np.testing.assert_allclose(np.asarray(m.decode(canvas, cache)), ref, rtol=1e-5, atol=1e-5)


def test_decoding_from_the_stacked_cache_copies_no_cache():
  """The sampler's step (a decoder pass reading the cache) of a scanned model compiles without a copy of the cache:
  its temporaries are smaller by at least the cache's size than when it is handed a per-layer cache (which it must
  stack)."""
  cfg = _config()
  graphdef, state = nnx.split(nnx.eval_shape(lambda: scan.stack_layers(DiffusionGemma(cfg, rngs=nnx.Rngs(0)))))
  b, capacity = 4, 4096
  stacked = jax.eval_shape(lambda: nnx.merge(graphdef, state).init_cache(b, capacity))
  per_layer = jax.eval_shape(lambda c: c.regrouped(0), stacked)
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((stacked.keys, stacked.values)))
  canvas = jax.ShapeDtypeStruct((b, CANVAS), jnp.int32)

  def temp(cache):
    step = jax.jit(lambda st, cache, canvas: nnx.merge(graphdef, st).decode_hidden(canvas, cache))
    return step.lower(state, cache, canvas).compile().memory_analysis().temp_size_in_bytes

  assert stacked.groups == GROUPS
  assert temp(stacked) + cache_bytes <= temp(per_layer), (temp(stacked), temp(per_layer), cache_bytes)


def test_lora_dropout_is_refused_when_scanning():
  with pytest.raises(ConfigError, match="scan_layers.*dropout|dropout.*scan"):
    _model(lora=LoraConfig(rank=2, dropout=0.1), scanned=True)


def test_adapters_on_stacked_layers_are_refused():
  with pytest.raises(ConfigError, match="stacked"):
    apply_lora(_model(scanned=True), LoraConfig(rank=2), rngs=nnx.Rngs(0))


def test_scan_layers_must_be_a_bool():
  with pytest.raises(ConfigError, match="scan_layers"):
    _config(scan_layers="yes")


# int4 (slow tier): block scales as fp8 has them, codes packed two per byte as nvfp4 has them
@pytest.mark.parametrize("mode", ["fp8", pytest.param("int4", marks=pytest.mark.slow), "nvfp4"])
def test_a_quantized_base_scans(mode):
  """QLoRA: the quantized base (codes, scales, NVFP4 scale tables) stacks like any array: same logits as the
  unrolled model, and unstacking gives its graph back."""
  lora = LoraConfig(rank=2, base_quantization=mode, base_block_size=16)
  unrolled, scanned = _model(lora=lora), scan.stack_layers(_model(lora=lora))
  batch = _batch()
  np.testing.assert_allclose(np.asarray(scanned(batch.prompt_ids, batch.completion_ids)),
                             np.asarray(unrolled(batch.prompt_ids, batch.completion_ids)), rtol=1e-6, atol=1e-6)
  assert nnx.split(scan.unstack_layers(scanned))[0] == nnx.split(unrolled)[0]


def test_layers_that_differ_in_structure_are_refused_naming_them():
  """Adapters on one layer only: layer 3 has adapters that layer 1 (same place in the 2-layer period) has not."""
  model = _model(lora=LoraConfig(rank=2, target_modules=(r"layers\.3\.self_attn\.q_proj",)))
  with pytest.raises(ConfigError) as e:
    scan.stack_layers(model)
  assert "layer 3 differs in structure from layer 1" in str(e.value) and "\n" not in str(e.value)
