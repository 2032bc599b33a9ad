"""LoRA wrapping, merging, splitting and training (JAX only; the PEFT comparisons are in tests/interop)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hackable_diffusion import lora
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.model import matmul
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma, forward, init_model
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state, make_train_step, state_to_model

CFG = get_preset("tiny")
ALL = lora.DEFAULT_TARGETS + ("experts", "self_conditioning")


def _flat(state) -> dict[str, np.ndarray]:
  return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def randomize_adapters(model, seed: int, std: float = 0.3) -> None:
  """Every adapter factor of `model` drawn from N(0, std^2) (B is zero after `apply_lora`: no effect yet)."""
  rng = np.random.default_rng(seed)
  for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    v.value = jnp.asarray(std * rng.standard_normal(v.shape), v.dtype)


def model_inputs(seed: int = 0):
  """(prompt ids [2, 5], canvas [2, C], self-conditioning logits [2, C, V]) for the tiny config."""
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(3, 60, (2, 5)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, 60, (2, CFG.canvas_length)), jnp.int32)
  sc = jnp.asarray(3 * rng.standard_normal((2, CFG.canvas_length, CFG.vocab_size)), jnp.float32)
  return ids, canvas, sc


@pytest.fixture(scope="module")
def base():
  return init_model(CFG, 0)


@pytest.fixture(scope="module")
def wrapped(base):
  return lora.apply_lora(base, lora.LoraConfig(rank=2, alpha=6.0, target_modules=ALL), rngs=nnx.Rngs(1))


# ---- config --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, needle", [
    (dict(rank=0), "rank=0"), (dict(rank=-1), "rank=-1"), (dict(rank=2.0), "rank=2.0"), (dict(alpha=0), "alpha=0"),
    (dict(alpha=float("nan")), "alpha=nan"), (dict(dropout=1.0), "dropout=1.0"), (dict(dropout=-0.1), "dropout"),
    (dict(target_modules=()), "target_modules"), (dict(target_modules=("(",)), "'('"),
    (dict(param_dtype="int8"), "param_dtype"),
])
def test_config_validation_one_line(kwargs, needle):
  with pytest.raises(ValueError) as e:
    lora.LoraConfig(**kwargs)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_rank_zero_message_is_clear():
  with pytest.raises(ValueError, match=r"^LoraConfig.rank=0 is invalid: must be an integer >= 1"):
    lora.LoraConfig(rank=0)


def test_scale_is_alpha_over_rank_and_string_target_becomes_tuple():
  cfg = lora.LoraConfig(rank=4, alpha=16, target_modules="all-linear")
  assert cfg.scale == 4.0 and cfg.target_modules == ("all-linear",)


def test_peft_names_are_aliases():
  cfg = lora.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
  assert cfg == lora.LoraConfig(rank=4, alpha=16, dropout=0.05, target_modules=("q_proj", "v_proj"))
  assert lora.LoraConfig(rank=4, r=4).rank == 4  # both names, same value
  for kwargs, needle in ((dict(rank=4, r=8), "LoraConfig.r=8 and rank=4 disagree"),
                         (dict(alpha=8, lora_alpha=4), "LoraConfig.lora_alpha=4 and alpha=8 disagree"),
                         (dict(dropout=0.1, lora_dropout=0.2), "LoraConfig.lora_dropout=0.2 and dropout=0.1"),
                         (dict(r=0), "LoraConfig.rank=0 is invalid"), (dict(target_modules=3), "LoraConfig.target_modules=3")):
    with pytest.raises(ConfigError, match=f"^{re.escape(needle)}") as e:
      lora.LoraConfig(**kwargs)
    assert "\n" not in str(e.value)
  assert "r" not in dataclasses.asdict(cfg) and dataclasses.replace(cfg, rank=2).rank == 2


def test_target_modules_matching(base):
  """A list entry that is a module name matches as PEFT's list form (the path, or a containing module's path,
  equals it or ends with '.' + name); other entries are regexes searched in the path; a single string is a regex
  over the whole path (PEFT's str form)."""
  def targets(spec):
    return lora.resolve_targets(base, lora.LoraConfig(target_modules=spec))

  qv = targets(["q_proj", "v_proj"])
  assert qv == [n for n in targets("all-linear") if n.endswith((".q_proj", ".v_proj"))] and len(qv) == 3
  assert targets(["self_attn.q_proj"]) == targets(["q_proj"]) == targets((r"\.q_proj$",))
  assert set(targets(["experts"])) == {f"layers.{i}.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
  assert set(targets(["layers.0.mlp"])) == {f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
  assert targets([r"layers\.1\.self_attn"]) == [n for n in targets("all-linear") if n.startswith("layers.1.self_attn.")]
  # a single string: full match (PEFT), stored anchored; a regex list entry: searched
  assert lora.LoraConfig(target_modules=r".*\.(q|v)_proj").target_modules == (r"^(?:.*\.(q|v)_proj)$",)
  assert targets(r".*\.(q|v)_proj") == qv
  assert targets([r"(q|v)_proj"]) == qv
  with pytest.raises(ConfigError, match=r"^LoraConfig.target_modules regex '\^\(\?:q_proj\)\$' matches no module"):
    targets("q_proj")  # as in PEFT, a string must match the whole path
  with pytest.raises(ConfigError, match=r"^LoraConfig.target_modules module name 'attn' matches no module"):
    targets(["attn"])  # a name matches whole path components only (`self_attn` is one)
  # the shipped configs still select what they did
  assert set(targets(("self_attn.(q|k|v|o)_proj", "mlp.(gate|up|down)_proj"))) == set(targets(lora.DEFAULT_TARGETS)) | {
      f"self_conditioning.mlp.{p}_proj" for p in ("gate", "up", "down")}


def test_default_targets_and_all_linear(base):
  default = lora.resolve_targets(base, lora.LoraConfig())
  assert "layers.0.self_attn.v_proj" in default and "layers.1.self_attn.q_proj" in default
  assert "layers.1.self_attn.v_proj" not in default  # full-attention layers have no v_proj
  assert "layers.0.mlp.down_proj" in default
  assert not [n for n in default if "router" in n or "experts" in n or "self_conditioning" in n]
  assert len(default) == 2 * 6 + 1  # q,k,o + 3 MLP per layer, v only on the sliding layer
  every = lora.resolve_targets(base, lora.LoraConfig(target_modules="all-linear"))
  assert set(every) == set(default) | {f"self_conditioning.mlp.{p}_proj" for p in ("gate", "up", "down")}
  experts = lora.resolve_targets(base, lora.LoraConfig(target_modules=(r"experts\.down",)))
  assert experts == ["layers.0.experts.down_proj", "layers.1.experts.down_proj"]


def test_regex_matching_nothing_names_it_and_lists_paths(base):
  with pytest.raises(ValueError) as e:
    lora.apply_lora(base, lora.LoraConfig(target_modules=(r"self_attn\.q_proj", r"attn\.qkv")), rngs=nnx.Rngs(0))
  msg = str(e.value)
  assert "'attn\\\\.qkv'" in msg and "layers.0.self_attn.q_proj" in msg and "layers.0.experts.gate_up_proj" in msg
  assert "\n" not in msg


# ---- wrapping ------------------------------------------------------------------------------------------------------
def test_base_paths_unchanged_and_adapters_separate(base, wrapped):
  before = _flat(nnx.state(base))
  base_state, adapter_state = lora.split(wrapped)
  after = _flat(base_state)
  assert set(after) == set(before)
  for k in before:
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)
  names = set(_flat(adapter_state))
  assert "layers.0.self_attn.q_proj.lora_a" in names and "layers.0.self_attn.q_proj.lora_b" in names
  assert "layers.1.experts.gate_up_proj_lora_a" in names and "self_conditioning.mlp.up_proj.lora_b" in names
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(adapter_state))
  q = wrapped.layers[0].self_attn.q_proj
  assert isinstance(q, nnx.Linear) and q.lora_a.shape == (32, 2) and q.lora_b.shape == (2, 32)
  assert q.lora_a.get_metadata()["out_sharding"] == ("embed", None)
  ex = wrapped.layers[0].experts
  assert ex.gate_up_proj_lora_a.shape == (4, 32, 2) and ex.gate_up_proj_lora_b.shape == (4, 2, 32)
  assert ex.down_proj_lora_a.shape == (4, 16, 2) and ex.down_proj_lora_b.shape == (4, 2, 32)
  # PEFT init: B = 0, A ~ U(-1/sqrt(in), 1/sqrt(in)) and not degenerate
  a = np.asarray(q.lora_a[...])
  assert np.all(np.abs(a) <= 1 / np.sqrt(32)) and a.std() > 0.3 / np.sqrt(32)
  assert not np.any(np.asarray(q.lora_b[...]))
  assert lora.adapter_num_params(wrapped) == sum(v.size for v in _flat(adapter_state).values())
  # the input model was not modified
  assert not lora.has_lora(base) and type(base.layers[0].self_attn.q_proj) is nnx.Linear
  with pytest.raises(ValueError, match="already has LoRA"):
    lora.apply_lora(wrapped, lora.LoraConfig(), rngs=nnx.Rngs(0))


def test_zero_init_keeps_logits(base, wrapped):
  ids, canvas, sc = model_inputs()
  a = np.asarray(forward(base, ids, canvas, self_conditioning_logits=sc))
  b = np.asarray(forward(wrapped, ids, canvas, self_conditioning_logits=sc))
  # B = 0 adds exact zeros; any difference is XLA fusing a different graph differently
  assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, np.abs(a).max())


def test_merge_equals_adapter_logits_and_returns_a_plain_model(base, wrapped):
  model = nnx.clone(wrapped)
  randomize_adapters(model, 0)
  ids, canvas, sc = model_inputs(1)
  with_adapter = np.asarray(forward(model, ids, canvas, self_conditioning_logits=sc))
  plain = np.asarray(forward(base, ids, canvas, self_conditioning_logits=sc))
  assert np.max(np.abs(with_adapter - plain)) > 0.05  # the adapter really does something
  merged = lora.merge(model)
  assert nnx.graphdef(merged) == nnx.graphdef(base)  # exactly the un-adapted structure
  assert type(merged.layers[0].experts).__name__ == "Experts" and not lora.has_lora(merged)
  got = np.asarray(forward(merged, ids, canvas, self_conditioning_logits=sc))
  assert np.max(np.abs(got - with_adapter)) <= 1e-4
  # the merged kernel is W + (alpha / r) * A @ B
  q = model.layers[0].self_attn.q_proj
  expect = np.asarray(q.kernel[...]) + 3.0 * np.asarray(q.lora_a[...]) @ np.asarray(q.lora_b[...])
  np.testing.assert_allclose(np.asarray(merged.layers[0].self_attn.q_proj.kernel[...]), expect, rtol=1e-6, atol=1e-6)
  ex = model.layers[1].experts
  a, b = np.asarray(ex.down_proj_lora_a[...]), np.asarray(ex.down_proj_lora_b[...])
  expect = np.asarray(ex.down_proj[...]) + 3.0 * np.einsum("eir,ero->eoi", a, b)
  np.testing.assert_allclose(np.asarray(merged.layers[1].experts.down_proj[...]), expect, rtol=1e-6, atol=1e-6)
  # split + nnx.merge rebuilds the adapted model
  base_state, adapter_state = lora.split(model)
  again = nnx.merge(nnx.graphdef(model), base_state, adapter_state)
  np.testing.assert_array_equal(np.asarray(again.layers[0].self_attn.q_proj.lora_b[...]),
                                np.asarray(q.lora_b[...]))


def test_bfloat16_products_survive_adapters_and_merge(base):
  """A model with `matmul_dtype='bfloat16'` keeps its bf16 projections and tiled experts through `apply_lora` and
  `merge` (the merged graph is the bf16 base's, which differs from the float32 base's)."""
  base16 = init_model(dataclasses.replace(CFG, matmul_dtype="bfloat16"), 0)
  assert nnx.graphdef(base16) != nnx.graphdef(base)
  model = lora.apply_lora(base16, lora.LoraConfig(rank=2, alpha=6.0, target_modules=ALL), rngs=nnx.Rngs(1))
  assert model.layers[0].self_attn.q_proj.dot_general is matmul.bf16_dot_general
  assert model.layers[1].experts.matmul_dtype == "bfloat16"
  merged = lora.merge(model)
  assert nnx.graphdef(merged) == nnx.graphdef(base16)


def test_dropout_only_with_an_explicit_key():
  m = init_model(CFG, 0)
  cfg = lora.LoraConfig(rank=2, dropout=0.5, target_modules=(r"layers\.0\.mlp\.(up|gate)_proj",))
  wrapped = lora.apply_lora(m, cfg, rngs=nnx.Rngs(0))
  randomize_adapters(wrapped, 1)
  up, gate = wrapped.layers[0].mlp.up_proj, wrapped.layers[0].mlp.gate_proj
  assert up.dropout_key is gate.dropout_key  # one shared variable
  x = jnp.ones((4, 32))
  clean = x @ up.kernel[...] + up.scale * (x @ up.lora_a[...] @ up.lora_b[...])
  np.testing.assert_allclose(np.asarray(up(x)), np.asarray(clean), rtol=1e-5, atol=1e-5)  # no key: no dropout

  @jax.jit
  def apply(params, rest, key):  # what a train step does: a pure update of the state, then merge
    rest = lora.set_dropout_key(rest, key)
    return nnx.merge(graphdef, params, rest).layers[0].mlp.up_proj(x)

  graphdef, params, rest = nnx.split(wrapped, nnx.LoRAParam, ...)
  y0 = np.asarray(apply(params, rest, jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(apply(params, rest, jax.random.key(0))), y0)  # the key decides the mask
  assert np.max(np.abs(np.asarray(apply(params, rest, jax.random.key(1))) - y0)) > 1e-3
  assert np.max(np.abs(y0 - np.asarray(clean))) > 1e-3
  np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, params, rest).layers[0].mlp.up_proj(x)),
                             np.asarray(clean), rtol=1e-5, atol=1e-5)  # the stored state still has dropout off
  lora.set_dropout_key(wrapped, jax.random.key(0))  # in place, on a module
  np.testing.assert_allclose(np.asarray(up(x)), y0, rtol=1e-6)
  lora.set_dropout_key(wrapped, None)
  np.testing.assert_allclose(np.asarray(up(x)), np.asarray(clean), rtol=1e-5, atol=1e-5)


# ---- training ------------------------------------------------------------------------------------------------------
def sft_batch(seed: int = 0) -> SFTBatch:
  """A small SFT batch of the tiny config: random prompts, one fixed completion (easy to learn)."""
  rng = np.random.default_rng(seed)
  b, p, width = 4, 4, 2 * CFG.canvas_length
  comp = np.tile(np.arange(3, 3 + width)[None], (b, 1))
  return SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, 60, (b, p)), jnp.int32), prompt_mask=jnp.ones((b, p), bool),
                  completion_ids=jnp.asarray(comp, jnp.int32), completion_mask=jnp.ones((b, width), bool))


class Trained(NamedTuple):
  model: nnx.Module  # the adapted model before training
  graphdef: Any
  initial: Any  # the train state before the first step (kept: the steps do not donate it)
  final: Any
  losses: list[float]


def train_adapters(base: nnx.Module, config: lora.LoraConfig, steps: int) -> Trained:
  """`base` with adapters `config`, only the adapters trained `steps` steps on `sft_batch()`. The embeddings of a
  copy of `base` are scaled x25 first: the tied LM head (frozen here) must allow confident logits."""
  start = nnx.clone(base)
  start.embed_tokens.value = start.embed_tokens.value * 25
  model = lora.apply_lora(start, config, rngs=nnx.Rngs(0))
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=3e-2, warmup_steps=0, decay_steps=100, weight_decay=0.0))
  graphdef, state = init_train_state(model, tx, trainable=nnx.LoRAParam)
  assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(state.params))
  step = make_train_step(graphdef, tx, LossConfig(), donate=False)
  batch, initial, losses = sft_batch(), state, []
  for i in range(steps):
    state, metrics = step(state, batch, jax.random.key(i))
    losses.append(float(metrics["loss"]))
  return Trained(model, graphdef, initial, state, losses)


def _opt_bytes(opt_state) -> tuple[int, int]:
  leaves = [x for x in jax.tree.leaves(opt_state) if hasattr(x, "shape") and x.ndim > 0]
  return len(leaves), sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


def test_training_only_adapters(base):
  _, graphdef, initial, state, losses = train_adapters(base, lora.LoraConfig(rank=4, alpha=8, target_modules=ALL), 25)
  base_before, adapters_before = _flat(initial.rest), _flat(initial.params)
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
  after_rest = _flat(state.rest)
  for k, v in base_before.items():
    np.testing.assert_array_equal(after_rest[k], v, err_msg=k)  # bitwise unchanged
  after = _flat(state.params)
  changed = [k for k in after if not np.array_equal(after[k], adapters_before[k])]
  assert len(changed) == len(after)  # every A and B moved (B leaves zero after the first step)
  # optimizer state (Adam mu/nu) exists only for the adapters
  n_adapter = sum(v.size for v in adapters_before.values())
  leaves, nbytes = _opt_bytes(state.opt_state)
  assert leaves == 2 * len(adapters_before) and nbytes == 2 * 4 * n_adapter
  trained = state_to_model(graphdef, state)
  assert lora.has_lora(trained)


def test_optimizer_state_bytes_lora_vs_full(record_property):
  """Shapes only (`eval_shape`): Adam state of LoRA (rank 8, default targets) vs full fine-tuning."""
  tx, _ = make_optimizer(OptimizerConfig())
  sizes = {}
  for preset in ("sudoku", "diffusion_gemma_26b_a4b"):
    cfg = get_preset(preset)

    def build(cfg=cfg, targets=lora.DEFAULT_TARGETS):
      return lora.apply_lora(DiffusionGemma(cfg, rngs=nnx.Rngs(0)), lora.LoraConfig(rank=8, target_modules=targets),
                             rngs=nnx.Rngs(1))

    model = nnx.eval_shape(build)
    _, lora_params, _ = nnx.split(model, nnx.LoRAParam, ...)
    _, full_params, _ = nnx.split(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), ...)
    lora_bytes = _opt_bytes(jax.eval_shape(tx.init, lora_params))[1]
    full_bytes = _opt_bytes(jax.eval_shape(tx.init, full_params))[1]
    sizes[preset] = (lora_bytes, full_bytes)
    record_property(f"opt_state_bytes_{preset}", {"lora_r8": lora_bytes, "full": full_bytes})
    print(f"{preset}: Adam state LoRA r8 {lora_bytes / 2**20:.3f} MiB vs full {full_bytes / 2**20:.1f} MiB "
          f"({full_bytes / lora_bytes:.0f}x)")
    assert lora_bytes < 0.1 * full_bytes
  assert sizes["diffusion_gemma_26b_a4b"][1] > 2**30 * 50  # full fine-tuning state alone is > 50 GiB
