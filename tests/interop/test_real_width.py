"""Numerics at the real width: a 2-layer DiffusionGemma at the widths of DiffusionGemma 26B-A4B.

hidden 2816, 16 heads; sliding layer: 8 kv heads of head_dim 256; full layer: 2 kv heads of head_dim 512 (k = v);
128 experts top-8 of width 704; dense MLP 2112; vocabulary 262,144 (the tied embedding alone is 2.95 GB in fp32).
transformers builds it from random weights; we load the checkpoint in fp32 and in bf16 and compare logits, then run
one LoRA train step (full objective, remat, vocabulary-tiled loss) on the fp32 model: XLA:CPU computes bf16 matmuls
on f32 copies of their weights, so a bf16 step would need ~3x the model's memory on this CPU (not on a GPU).

Every stage runs in its own process (`real_width_worker.py`: one model alive at a time, a fresh XLA configuration,
and an RSS watchdog):
  1. reference: the torch fp32 model (seeded; perturbed norms / scalars), with every weight truncated to a
     bf16-representable value, so the fp32 model and the bf16 checkpoint hold the *same* weights (the bf16
     comparisons then measure compute precision only, and the one saved file, bf16 like the released checkpoints,
     serves every stage). Its fp32 logits; the checkpoint; transformers' own bf16 model
     (`from_pretrained(dtype=bfloat16)`, as a user would run it) and its logits.
  2. fp32: ours loaded in fp32 (cast on load) vs the fp32 reference, plus two deliberate breakages that must show;
     one LoRA train step.
  3. bf16: ours loaded in bf16 vs the fp32 reference, against transformers' bf16 error.

Run: `pytest -m slow tests/interop/test_real_width.py -s` (prints the measurements).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_width_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP32_REL_TOL = 1e-4  # max |ours - reference| / max |reference logit|
# Our bf16 error may exceed transformers' own bf16 error (both vs the fp32 reference, same weights) by at most this
# factor. Two bf16 implementations round at different places (fusions, accumulation order, which ops are upcast),
# so their errors agree in size, not value; 1.5x leaves room for that, while a real mistake (a wrong weight, a
# dropped term) gives errors the size of the logits themselves (see the fp32 breakage checks: >1000x the tolerance).
BF16_MARGIN = 1.5


def _run(stage: str, directory: str) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, WORKER, stage, directory], capture_output=True, text=True, timeout=1800,
                        env=env, cwd=ROOT)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  assert proc.returncode == 0 and lines, f"{stage}: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  out = json.loads(lines[-1])
  print(f"\n{stage}: {json.dumps(out)}")
  return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("real_width"))
  out = _run("reference", directory)
  # logits that are neither trivial nor saturated by the 30.0 softcap
  assert 3.0 < out["max_abs_logit"] < 25.0 and out["logit_std"] > 0.5, out
  assert out["hf_bf16_max"] > 0, out
  return directory, out


def test_fp32_logits_match_transformers_and_a_lora_step_runs(reference):
  out = _run("fp32", reference[0])
  assert out["finite"]
  assert out["err"] <= FP32_REL_TOL * out["scale"], out
  # the comparison sees loader-type mistakes: both breakages move the logits far past the tolerance
  assert min(out["err_router_rolled"], out["err_gate_up_swapped"]) > 100 * FP32_REL_TOL * out["scale"], out
  # the LoRA step: finite, applied, only the adapters moved
  assert out["adapters_are_lora_params"] and {"layers/0/self_attn/q_proj", "layers/1/self_attn/q_proj",
                                              "layers/1/mlp/down_proj"} <= set(out["adapter_modules"]), out
  assert out["step_finite"] and out["step"] == 1 and out["grad_norm"] > 0, out
  assert 0 < out["loss"] < 1e3, out
  assert out["lora_b_were_zero"] and out["lora_b_count"] > 0 and out["lora_b_changed"] == out["lora_b_count"], out
  assert out["base_unchanged"], out


def test_bf16_logits_within_transformers_own_bf16_error(reference):
  directory, ref = reference
  out = _run("bf16", directory)
  assert out["finite"] and out["ours_max"] > 0  # it really computed in bf16
  assert out["ours_max"] <= BF16_MARGIN * ref["hf_bf16_max"], (out, ref)
  assert out["ours_rms"] <= BF16_MARGIN * ref["hf_bf16_rms"], (out, ref)
