"""`sharding.memory`: per-device bytes of a training state against hand-written arithmetic, and the docs table."""

from __future__ import annotations

import os

import jax
import pytest
from flax import nnx
from tiny_shards import TINY_BUFFERS, tiny_lora_elements, tiny_param_elements

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora import DEFAULT_TARGETS
from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.sharding import memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = get_preset("tiny")

# the meshes of the memory table in docs/scaling.md (axis sizes; missing axes are 1)
DOC_MESHES = (
    {"fsdp": 8},
    {"fsdp": 4, "tensor": 2},
    {"expert": 8},
    {"fsdp": 2, "expert": 4},
    {"data": 2, "fsdp": 8},
    {"fsdp": 16},
)


def model_fn(config):
  return lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_states():
  """The tiny model's variables as shapes, fp32 and bf16 parameters (traced once for every mesh)."""
  return (memory.abstract_state(model_fn(TINY)),
          memory.abstract_state(model_fn(TINY.replace(param_dtype="bfloat16"))))


@pytest.mark.parametrize("mesh", [
    {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
    {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1},
    {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2},
    {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8},  # 4 experts over 8: replicated
    {"data": 1, "fsdp": 16, "tensor": 1, "expert": 1},  # hidden 32 over 16
])
def test_memory_estimate_matches_hand_arithmetic(tiny_states, mesh):
  fp32, bf16_state = tiny_states
  f, t, e = mesh["fsdp"], mesh["tensor"], mesh["expert"]
  p = tiny_param_elements(f, t, e)
  full = memory.memory_estimate(fp32, mesh)
  assert full.params == 4 * (p + TINY_BUFFERS)
  assert full.grads == 4 * p
  assert full.optimizer == 2 * 4 * p
  assert full.adapters == 0
  assert full.num_trainable == tiny_param_elements()
  lora = memory.memory_estimate(fp32, mesh, lora_rank=8, lora_targets=DEFAULT_TARGETS)
  n = tiny_lora_elements(8, f, t)
  assert lora.num_trainable == tiny_lora_elements(8)
  assert (lora.params, lora.adapters, lora.grads, lora.optimizer) == (4 * (p + TINY_BUFFERS), 4 * n, 4 * n, 8 * n)
  bf16 = memory.memory_estimate(bf16_state, mesh)
  assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * (p + TINY_BUFFERS), 2 * p, 8 * p)


def test_memory_estimate_takes_a_model_function():
  mesh = {"fsdp": 2}
  assert memory.memory_estimate(model_fn(TINY), mesh) == memory.memory_estimate(
      memory.abstract_state(model_fn(TINY)), mesh)


def test_lora_estimate_needs_targets_that_match(tiny_states):
  with pytest.raises(ConfigError, match=r"lora_rank=8 needs lora_targets"):
    memory.memory_estimate(tiny_states[0], {}, lora_rank=8)
  with pytest.raises(ConfigError, match=r"entry 'nonsense' matches no 2-D kernel"):
    memory.memory_estimate(tiny_states[0], {}, lora_rank=8, lora_targets=(*DEFAULT_TARGETS, "nonsense"))


def test_lora_estimate_matches_real_adapters(tiny_states):
  """The estimate's adapters are what `lora.apply_lora` creates (shapes, count and sharding)."""
  from hackable_diffusion.lora.adapters import LoraConfig, apply_lora
  from hackable_diffusion.model.transformer import init_model

  model = apply_lora(init_model(TINY, 0), LoraConfig(rank=8), rngs=nnx.Rngs(0))
  adapters = nnx.state(model, nnx.LoRAParam)
  for mesh in ({"fsdp": 1}, {"fsdp": 2, "tensor": 2}, {"fsdp": 16, "tensor": 8}):
    estimate = memory.memory_estimate(tiny_states[0], mesh, lora_rank=8, lora_targets=DEFAULT_TARGETS)
    assert estimate.adapters == memory.per_device_bytes(adapters, mesh), mesh
  assert estimate.num_trainable == sum(x.size for x in jax.tree.leaves(adapters))
  # PEFT's module-name form selects the same kernels in both (every q_proj, none of the others)
  names = apply_lora(init_model(TINY, 0), LoraConfig(rank=8, target_modules=["q_proj"]), rngs=nnx.Rngs(0))
  q_only = memory.memory_estimate(tiny_states[0], {}, lora_rank=8, lora_targets=["q_proj"])
  assert 0 < q_only.num_trainable == sum(x.size for x in jax.tree.leaves(nnx.state(names, nnx.LoRAParam)))
  assert q_only.num_trainable < estimate.num_trainable


def test_scaling_doc_table_is_current():
  """docs/scaling.md shows `memory_table` of the 26B-A4B preset; regenerate it when rules or the model change."""
  state = memory.abstract_state(model_fn(get_preset("diffusion_gemma_26b_a4b")))
  table = memory.memory_table(state, DOC_MESHES, lora_targets=DEFAULT_TARGETS)
  with open(os.path.join(ROOT, "docs", "scaling.md"), encoding="utf-8") as f:
    doc = f.read()
  assert table in doc, "docs/scaling.md is stale; paste this table:\n" + table
  full = memory.memory_estimate(state, {"fsdp": 8})
  assert 25.2e9 < full.num_params < 25.3e9  # the public 26B-A4B shape
  assert abs(full.params - 2 * full.num_params / 8) < 0.01 * full.params  # bf16, ~all of it split 8 ways
