"""`sharding.local` on one device: its axis bookkeeping and the error for a weight split it cannot gather (the
multi-device behaviour, values and gradients, is checked in test_moe_mesh.py)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from hackable_diffusion.sharding import local, logical
from hackable_diffusion.sharding.mesh import MeshConfig, make_mesh


def test_spec_axes_reads_every_entry_form():
  assert local.spec_axes(None) == ()
  assert local.spec_axes("fsdp") == ("fsdp",)
  assert local.spec_axes(("data", "fsdp")) == ("data", "fsdp")


def test_rows_are_not_split_outside_a_mesh_or_on_one_device():
  # (the split itself, on 8 devices: test_moe_mesh.py, whose temporaries check fails if rows are never split)
  assert local.row_axes(8) == ()
  with logical.activation_sharding(make_mesh(MeshConfig())):
    assert local.row_axes(8) == ()  # size-1 mesh axes split nothing


def test_the_active_rules_are_the_ones_entered():
  rules = (("batch", ("data",)), ("embed", ("tensor",)))
  assert logical.active_rules() == logical.LOGICAL_AXIS_RULES
  with logical.activation_sharding(make_mesh(MeshConfig()), rules):
    assert logical.active_rules() == rules
  assert logical.active_rules() == logical.LOGICAL_AXIS_RULES


def test_a_dimension_split_over_batch_and_other_axes_is_refused():
  # dimension 1 over fsdp (a batch axis) and tensor (not one): neither gather is right for it; the check runs
  # before any collective
  with pytest.raises(ValueError, match=r"^down_proj \(4, 4\): dimension 1 is split over mesh axes "
                     r"\('fsdp', 'tensor'\)"):
    local.gather_whole(jnp.ones((4, 4)), P(None, ("fsdp", "tensor")), ("data", "fsdp"), name="down_proj")
