"""The pure train step: it learns, it keeps the last good state on non-finite values, it honours the filter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import init_model
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state, make_train_step, state_to_model

CFG = get_preset("tiny")


def _batch(seed: int = 0) -> SFTBatch:
  rng = np.random.default_rng(seed)
  b, p, width = 4, 4, 2 * CFG.canvas_length
  comp = np.tile(np.arange(3, 3 + width)[None], (b, 1))  # a fixed, learnable completion
  return SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, 60, (b, p)), jnp.int32), prompt_mask=jnp.ones((b, p), bool),
                  completion_ids=jnp.asarray(comp, jnp.int32), completion_mask=jnp.ones((b, width), bool))


@pytest.fixture(scope="module")
def stepper():
  tx, schedule = make_optimizer(OptimizerConfig(peak_lr=3e-3, warmup_steps=0, decay_steps=100))
  graphdef, state = init_train_state(init_model(CFG, 0), tx)
  return graphdef, state, make_train_step(graphdef, tx, LossConfig(), lr_schedule=schedule, donate=False)


def test_loss_falls_and_step_counts(stepper):
  _, state, step = stepper
  batch, losses = _batch(), []
  for i in range(40):
    state, metrics = step(state, batch, jax.random.key(i))
    losses.append(float(metrics["loss"]))
  assert int(state.step) == 40
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses


def test_non_finite_update_keeps_the_previous_state(stepper):
  graphdef, state, step = stepper
  poisoned = jax.tree.map(lambda x: x, state)
  emb = poisoned.params["embed_tokens"]
  emb.value = emb.value.at[5, 0].set(jnp.nan)
  new, metrics = step(poisoned, _batch(), jax.random.key(0))
  assert not bool(metrics["finite"])
  assert int(new.step) == int(poisoned.step)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(poisoned.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_halting_step_stays_frozen_after_a_non_finite_step():
  """With `halt_after_non_finite=True` the `healthy` flag fed back from the previous step freezes the state: a step
  whose own loss is finite changes nothing once an earlier step was not, and says so in `finite`."""
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=3e-3, warmup_steps=0))
  graphdef, state = init_train_state(init_model(CFG, 0), tx)
  step = make_train_step(graphdef, tx, LossConfig(), donate=False, halt_after_non_finite=True)
  healthy = jnp.asarray(True)
  new, metrics = step(state, _batch(), jax.random.key(0), healthy)
  assert bool(metrics["finite"]) and int(new.step) == int(state.step) + 1
  frozen, metrics = step(new, _batch(1), jax.random.key(1), jnp.asarray(False))
  assert np.isfinite(float(metrics["loss"])) and not bool(metrics["finite"])
  assert int(frozen.step) == int(new.step)
  for a, b in zip(jax.tree.leaves(frozen.params), jax.tree.leaves(new.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_only_trainable_filter_changes():
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=1e-2, warmup_steps=0))
  model = init_model(CFG, 1)
  frozen_before = np.asarray(model.layers[0].mlp.up_proj.kernel[...]).copy()
  only_norms = lambda path, var: "norm" in "/".join(map(str, path))  # noqa: E731
  graphdef, state = init_train_state(model, tx, trainable=only_norms)
  step = make_train_step(graphdef, tx, LossConfig(), donate=False)
  new, _ = step(state, _batch(), jax.random.key(0))
  after = state_to_model(graphdef, new)
  np.testing.assert_array_equal(np.asarray(after.layers[0].mlp.up_proj.kernel[...]), frozen_before)
  assert not np.array_equal(np.asarray(after.layers[0].input_layernorm.weight[...]),
                            np.asarray(state_to_model(graphdef, state).layers[0].input_layernorm.weight[...]))


def test_gradient_accumulation_runs_microbatches_and_rejects_bad_sizes():
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=1e-3, warmup_steps=0))
  graphdef, state = init_train_state(init_model(CFG, 2), tx)
  step = make_train_step(graphdef, tx, LossConfig(self_conditioning_prob=0.0), grad_accum_steps=2, donate=False)
  new, metrics = step(state, _batch(), jax.random.key(0))
  assert int(new.step) == 1
  assert float(metrics["num_tokens"]) == 4 * CFG.canvas_length  # one canvas per example, summed over micro-batches
  three = make_train_step(graphdef, tx, LossConfig(), grad_accum_steps=3, donate=False)
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    three(state, _batch(), jax.random.key(0))


def test_train_state_shapes_and_shardings(stepper):
  """`abstract_train_state` / `train_state_shardings` mirror the `TrainState` (what a mesh step and a restore need)."""
  from hackable_diffusion.sharding import make_mesh
  from hackable_diffusion.training.step import abstract_train_state, train_state_shardings

  _, state, _ = stepper
  tx, _ = make_optimizer(OptimizerConfig(peak_lr=3e-3, warmup_steps=0, decay_steps=100))
  abstract = abstract_train_state(state.params, state.rest, tx)
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((abstract.step, abstract.opt_state)))
  shardings = train_state_shardings(make_mesh(), state.params, state.rest, tx)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(shardings))


def test_mesh_and_shardings_go_together(stepper):
  from hackable_diffusion.sharding import make_mesh

  graphdef, state, _ = stepper
  tx, _ = make_optimizer(OptimizerConfig())
  with pytest.raises(ValueError, match=r"mesh=\.\.\. needs shardings"):
    make_train_step(graphdef, tx, LossConfig(), mesh=make_mesh())
  with pytest.raises(ValueError, match=r"shardings=\.\.\. needs mesh"):
    make_train_step(graphdef, tx, LossConfig(), shardings=state)


def test_the_update_writes_the_donated_state_in_place():
  """The non-finite guard is a branch (`lax.cond`), not `where(finite, new, old)` over the state: compiled with the
  state donated, a weight-heavy model's step keeps about one gradient's worth of temporaries beyond the state
  (2.00x the parameter bytes here; the select kept the old and new moments apart: 2.53x)."""
  from flax import nnx  # noqa: PLC0415

  from hackable_diffusion.model.transformer import DiffusionGemma  # noqa: PLC0415
  from hackable_diffusion.training.step import abstract_train_state  # noqa: PLC0415

  cfg = get_preset("tiny", hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_experts=8,
                   vocab_size=4096)
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: DiffusionGemma(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)
  tx, _ = make_optimizer(OptimizerConfig())
  b, shape = 2, jax.ShapeDtypeStruct
  batch = SFTBatch(prompt_ids=shape((b, 8), jnp.int32), prompt_mask=shape((b, 8), bool),
                   completion_ids=shape((b, cfg.canvas_length), jnp.int32),
                   completion_mask=shape((b, cfg.canvas_length), bool))
  step = make_train_step(graphdef, tx, LossConfig(), jit=False)
  compiled = jax.jit(step, donate_argnums=0).lower(abstract_train_state(params, rest, tx), batch,
                                                   shape((), jax.random.key(0).dtype)).compile()
  param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
  assert compiled.memory_analysis().temp_size_in_bytes < 2.25 * param_bytes


@pytest.mark.slow  # compiles scanned steps with and without linked passes
def test_master_weights_cast_each_scanned_layer_where_it_is_used():
  """With fp32 master weights and scanned layers (remat 'nothing_saveable'), each layer's slice of the master is
  cast to bf16 inside the scan: loss and gradients equal casting the whole master before the model (as
  `cast_params` does), and the compiled function carries the fp32 master into its loops with no bf16 copy of the
  stacked layers anywhere (casting the whole master first makes one: `bf16[groups, ...]` arrays)."""
  from flax import nnx  # noqa: PLC0415

  from hackable_diffusion.diffusion.loss import diffusion_loss  # noqa: PLC0415
  from hackable_diffusion.model import scan  # noqa: PLC0415
  from hackable_diffusion.training.step import cast_params, make_loss_and_grad, master_params  # noqa: PLC0415

  cfg = get_preset("tiny", num_hidden_layers=4, layer_types=("sliding_attention", "full_attention") * 2,
                   dtype="bfloat16", param_dtype="bfloat16", remat="nothing_saveable")
  graphdef, params, rest = nnx.split(scan.stack_layers(init_model(cfg, 0)), nnx.Param, ...)
  master, batch, key, loss_config = master_params(params), _batch(), jax.random.key(3), LossConfig()

  def whole_cast(p):
    return diffusion_loss(nnx.merge(graphdef, cast_params(p, params), rest), batch, key, loss_config)[0]

  ref_loss, ref = jax.jit(jax.value_and_grad(whole_cast))(master)
  # compiled once: run, and its HLO read below
  per_layer = jax.jit(make_loss_and_grad(graphdef, loss_config, params)).lower(master, rest, batch, key).compile()
  (loss, _), grads = per_layer(master, rest, batch, key)
  assert float(loss) == float(ref_loss)
  assert jax.tree.structure(grads) == jax.tree.structure(ref)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6 * float(jnp.abs(want).max()))

  hlo = per_layer.as_text()
  stacked = {tuple(x.shape) for x in jax.tree.leaves(params["layers"]) if x.ndim >= 3}
  assert stacked and any(f"f32[{','.join(map(str, s))}]" in hlo for s in stacked)  # the master enters the scan
  for shape in stacked:
    assert f"bf16[{','.join(map(str, shape))}]" not in hlo, shape


def _router_leaves(params) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat if "'router'" in jax.tree_util.keystr(p)}


def test_a_frozen_router_keeps_its_weights_and_an_unfrozen_one_learns(stepper):
  """Full fine-tuning with `frozen=('router',)` (a pretrained checkpoint's default, `train.freeze_router`): the
  routers' projection, scale and per-expert scales stay bit for bit while the other weights move; without it they
  change. The optimizer state has the same structure either way (checkpoints stay interchangeable)."""
  graphdef, state, step = stepper
  tx, schedule = make_optimizer(OptimizerConfig(peak_lr=3e-3, warmup_steps=0, decay_steps=100))
  frozen_step = make_train_step(graphdef, tx, LossConfig(), lr_schedule=schedule, donate=False, frozen=("router",))
  before = _router_leaves(state.params)
  assert len(before) == 3 * CFG.num_hidden_layers  # proj kernel, scale, per_expert_scale per layer
  frozen, _ = frozen_step(state, _batch(), jax.random.key(0))
  trained, _ = step(state, _batch(), jax.random.key(0))
  for name, value in _router_leaves(frozen.params).items():
    np.testing.assert_array_equal(value, before[name], err_msg=name)
  assert any(not np.array_equal(v, before[k]) for k, v in _router_leaves(trained.params).items())
  others = [(a, b) for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(frozen.params)[0],
                                        jax.tree.leaves(state.params)) if "router" not in jax.tree_util.keystr(p)]
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in others)
  assert jax.tree.structure(frozen.opt_state) == jax.tree.structure(trained.opt_state)


def test_the_router_is_frozen_by_default_only_when_fine_tuning_a_checkpoint_in_full():
  from hackable_diffusion.runs.config import ExperimentConfig

  def frozen(**sections):  # the router part (without LoRA the tower is frozen too: tests/training/test_image_sft)
    modules = ExperimentConfig.from_config_dict({"data": {"train_path": "x.jsonl"}, **sections}).frozen_modules
    vision = () if "lora" in sections else ("vision_tower", "embed_vision")
    assert modules[len(modules) - len(vision):] == vision
    return modules[:len(modules) - len(vision)]

  assert frozen(model={"checkpoint": "some/model"}) == ("router",)
  assert frozen(model={"preset": "tiny"}) == ()  # a fresh init: the random router must learn
  assert frozen(model={"checkpoint": "some/model"}, lora={"enabled": True}) == ()
  assert frozen(model={"checkpoint": "some/model"}, train={"freeze_router": False}) == ()
  assert frozen(model={"preset": "tiny"}, train={"freeze_router": True}) == ("router",)
