"""The vocabulary-parallel head (`model.head_parallel`) on 8 fake CPU devices == `model.head` on one device.

`tests/model/head_parallel_worker.py` runs in a subprocess (JAX fixes its device count at start-up) and reports JSON;
the assertions live here:
- on meshes fsdp=8, data=2 x fsdp=4, data=2 x fsdp=2 x tensor=2 and fsdp=4 x expert=2: the tiled cross-entropy
  (values, argmax, gradients in hidden and embedding) and the self-conditioning soft embeddings (values, embedding
  gradient) equal the single-device head (softcap on, 3 tiles with the last padded);
- the compiled gradient of both heads on fsdp=8 (vocabulary 4,096, hidden 64, embedding split along H as the
  model's rules place it) holds no array of the whole embedding's shape, where the single-device head under the
  same mesh holds many (gathered embedding, whole gradient per tile and its all-reduce);
- the tiny model's diffusion loss with tiled logits (all three heads) and its gradients on fsdp=8 == one device;
- no layout (the plain head) outside a mesh, for a batch the mesh does not split, and for a vocabulary the
  devices do not divide.
Tolerance: `max |got - want| <= 1e-5 * max(1, max |want|)` (sums in another order).
"""

from __future__ import annotations

import pytest

from device_workers import close, run_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return run_worker("tests/model/head_parallel_worker.py", tmp_path_factory.mktemp("head_parallel"))


def test_vocabulary_parallel_head_equals_one_device(results):
  assert results["devices"] == 8
  cases = results["equality"]
  assert len(cases) == 4
  assert cases["data2_fsdp2_tensor2"]["vocab"] == ["data", "fsdp", "tensor"]  # a vocabulary axis not splitting rows
  for name, c in cases.items():
    assert c["pred_equal"], name
    for what in ("ce", "soft", "value", "grad_h", "grad_e"):
      assert c[f"scale_{what}"] > 0.5, (name, what)  # real values are compared, not zeros
      assert close(c[f"err_{what}"], c[f"scale_{what}"]), (name, what, c)


def test_the_models_tiled_loss_on_a_mesh_equals_one_device(results):
  """The tiny model's diffusion loss with tiled logits (diffusion term, encoder AR term, self-conditioning input) and
  every parameter gradient on fsdp=8, where the loss takes the vocabulary-parallel head, equal one device."""
  m = results["model"]
  assert m["taken"]
  # the diffusion and AR cross-entropies and the soft embeddings, each forward and backward, run per device
  assert m["manual_computations"] >= 6, m
  assert m["scale_grad_embed"] > 0
  for what in ("value", "grad", "grad_embed"):
    assert close(m[f"err_{what}"], m[f"scale_{what}"]), (what, m)


def test_no_device_holds_the_whole_embedding_or_its_gradient(results):
  assert results["whole_plain"] > 0  # the check sees them where they exist
  assert results["whole_parallel"] == 0


def test_plain_head_where_the_vocabulary_cannot_be_split(results):
  assert results["layout_outside_mesh"]
  assert results["layout_unsplit_batch"]
  assert results["layout_indivisible_vocab"]
