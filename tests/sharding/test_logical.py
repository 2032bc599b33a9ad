"""`sharding.logical`: the logical-axis rules, placement of states and batches (one device; the multi-device
checks are in test_multi_device.py)."""

from __future__ import annotations

import jax
from flax import nnx

from hackable_diffusion.model.config import get_preset
from hackable_diffusion.model.transformer import DiffusionGemma
from hackable_diffusion.sharding import logical
from hackable_diffusion.sharding.mesh import make_mesh
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state

TINY = get_preset("tiny")
P = jax.sharding.PartitionSpec


def test_logical_rules():
  assert logical.logical_to_mesh_spec(("embed", "heads")) == P("fsdp", "tensor")
  assert logical.logical_to_mesh_spec(("expert", "mlp", "embed")) == P("expert", "tensor", "fsdp")
  assert logical.logical_to_mesh_spec(("vocab", "embed")) == P("tensor", "fsdp")
  assert logical.logical_to_mesh_spec(("batch", None, None)) == P(("data", "fsdp", "expert"))
  assert logical.logical_to_mesh_spec(None) == P()
  sizes = {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
  assert logical.logical_to_mesh_spec(("embed", "heads"), mesh=sizes) == P("fsdp")  # size-1 axes dropped
  assert logical.logical_to_mesh_spec(("batch",), mesh=sizes) == P(("data", "fsdp"))
  # a mesh axis is used once per spec; unknown names are replicated; mesh axis names map to themselves
  rules = (("a", ("fsdp",)), ("b", ("fsdp",)))
  assert logical.logical_to_mesh_spec(("a", "b"), rules=rules) == P("fsdp")
  assert logical.logical_to_mesh_spec(("nonsense", "tensor")) == P(None, "tensor")


def test_non_divisible_dimension_is_replicated_and_logged_once(caplog):
  sizes = {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
  logical._LOGGED.clear()
  with caplog.at_level("WARNING"):
    assert logical.logical_to_mesh_spec(("embed", "heads"), mesh=sizes, shape=(6, 8)) == P(None, "tensor")
    assert logical.logical_to_mesh_spec(("embed", "heads"), mesh=sizes, shape=(6, 8)) == P(None, "tensor")
  messages = [r.getMessage() for r in caplog.records if "not divisible" in r.getMessage()]
  assert len(messages) == 1 and "(6, 8)" in messages[0], messages


def test_state_shardings_follow_variable_metadata():
  tx, _ = make_optimizer(OptimizerConfig())
  abstract = jax.eval_shape(lambda: init_train_state(DiffusionGemma(TINY, rngs=nnx.Rngs(0)), tx)[1])
  mesh = make_mesh()
  shardings = logical.state_shardings(mesh, abstract)
  # same structure as the state (so it can be jit's in/out shardings), opt_state included
  assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
  assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(shardings))
  target = logical.abstract_with_shardings(abstract, shardings)
  assert all(x.sharding is not None for x in jax.tree.leaves(target))


def test_process_batch_shard_on_one_process():
  assert logical.process_batch_shard(make_mesh()) == (0, 1)


def test_constrain_is_the_identity_without_a_mesh():
  x = jax.numpy.ones((2, 3, 4))
  assert logical.constrain(x, ("batch", None, None)) is x
