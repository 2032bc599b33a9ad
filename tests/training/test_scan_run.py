"""A run with `ModelConfig.scan_layers` (and remat, so its training steps run linked passes): trains like the
unrolled run without remat, resumes its stacked checkpoint, exports layer by layer (a merged checkpoint that loads
back with the same logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.interop import export as export_lib
from hackable_diffusion.model import scan
from hackable_diffusion.runs import config as config_lib
from hackable_diffusion.training import logging as log_lib
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.training import trainer as trainer_lib

pytestmark = pytest.mark.usefixtures("shared_xla_cache")  # tests/conftest.py

LAYERS = ("sliding_attention", "full_attention") * 2  # 2 groups of the 2-layer period


def _config(scanned: bool, steps: int):
  cfg = config_lib.load_config_file("tiny.py", {"train.steps": steps, "train.log_every": 1,
                                                "train.checkpoint_every": 5, "train.eval_at_end": False,
                                                "optimizer.decay_steps": 10})
  cfg.unlock()
  # scanned with remat 'nothing_saveable': the step's passes are linked (one gradient buffer, `scan.link_passes`)
  cfg.model.overrides = ml_collections.ConfigDict(dict(canvas_length=8, num_hidden_layers=len(LAYERS),
                                                       layer_types=LAYERS, scan_layers=scanned,
                                                       remat="nothing_saveable" if scanned else "none"))
  cfg.lock()
  return cfg


@pytest.mark.slow  # two CLI training runs; tests/model/test_scan.py covers the scanned step, save and export
def test_a_scanned_run_trains_resumes_and_exports_like_the_unrolled_run(tmp_path):
  unrolled, scanned = str(tmp_path / "unrolled"), str(tmp_path / "scanned")
  trainer_lib.train(_config(False, 10), unrolled, progress=False)
  trainer_lib.train(_config(True, 5), scanned, progress=False)
  trainer_lib.train(_config(True, 10), scanned, progress=False)  # resumes the stacked checkpoint of step 5

  def losses(workdir):
    return {r["step"]: r["train/loss"] for r in log_lib.read_metrics(workdir)}

  a, b = losses(unrolled), losses(scanned)
  assert sorted(a) == sorted(b) == list(range(1, 11))
  np.testing.assert_allclose([b[s] for s in sorted(b)], [a[s] for s in sorted(a)], rtol=1e-4)

  ref, run = run_lib.load_run(unrolled).model, run_lib.load_run(scanned).model
  assert scan.is_scanned(run) and not scan.is_scanned(ref)
  want = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
  got = dict(nnx.to_flat_state(nnx.state(scan.unstack_layers(run), nnx.Param)))
  assert got.keys() == want.keys()
  scale = max(float(jnp.abs(v.get_value()).max()) for v in want.values())
  for path, v in want.items():  # 10 Adam steps from fp32-rounding-level differences in the gradients
    np.testing.assert_allclose(np.asarray(got[path].get_value()), np.asarray(v.get_value()), atol=1e-4 * scale,
                               err_msg=str(path))

  out = str(tmp_path / "merged")
  export_lib.export_model(run, out, "merged", dtype="float32")
  loaded = hd.load_pretrained(out, dtype="float32")
  assert not scan.is_scanned(loaded) and len(loaded.layers) == len(LAYERS)
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 14, (2, 5)), jnp.int32)
  canvas = jnp.asarray(np.random.default_rng(1).integers(3, 14, (2, 8)), jnp.int32)
  np.testing.assert_allclose(np.asarray(loaded(ids, canvas)), np.asarray(run(ids, canvas)), rtol=1e-5, atol=1e-5)
  assert jax.tree.structure(nnx.state(loaded, nnx.Param)) == jax.tree.structure(nnx.state(ref, nnx.Param))

  # fine-tuning that checkpoint with LoRA and scanned layers: the trainer loads it unrolled (`load_pretrained(...,
  # stack=False)`), adds the adapters, then stacks; the adapters start at zero, so the forward is the checkpoint's
  cfg = _config(True, 1)
  cfg.unlock()
  cfg.model.checkpoint, cfg.model.preset = out, ""
  cfg.model.overrides = ml_collections.ConfigDict(dict(scan_layers=True))
  cfg.lora = ml_collections.ConfigDict(dict(enabled=True, rank=2, target_modules=("all-linear",)))
  cfg.lock()
  exp = config_lib.ExperimentConfig.from_config_dict(cfg)
  tuned, filt = run_lib.apply_lora(exp, run_lib.build_model(exp, None))
  assert scan.is_scanned(tuned) and filt is nnx.LoRAParam and nnx.state(tuned, nnx.LoRAParam)
  np.testing.assert_allclose(np.asarray(tuned(ids, canvas)), np.asarray(loaded(ids, canvas)), rtol=1e-5, atol=1e-5)
