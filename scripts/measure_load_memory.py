"""Peak host memory of `hd.load_pretrained` relative to the checkpoint size (streaming check).

  python scripts/measure_load_memory.py [--hidden=512 --layers=8 --vocab=32768]

Writes a random checkpoint with `hd.save_pretrained` in a first process, then loads it in a fresh process and
reports (peak RSS after load - RSS after importing jax/flax) / checkpoint bytes. Two full copies would be >= 2.0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _status_mb(field: str) -> float:
  """VmRSS / VmHWM (peak) of this process. Not ru_maxrss: that survives exec, i.e. it starts at the parent's peak."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return 0.0


def _load(path: str) -> None:
  import jax  # noqa: F401
  import hackable_diffusion as hd
  from hackable_diffusion.interop import hf

  # Baseline after the imports and the abstract (shape-only) model that loading builds first: what remains is
  # the memory the weights themselves take while streaming.
  from flax import nnx
  from hackable_diffusion.model.transformer import DiffusionGemma

  config = hf.load_config(path)
  nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0)))
  base = _status_mb("VmRSS")
  model = hd.load_pretrained(path)
  peak = _status_mb("VmHWM")
  size = hf.checkpoint_nbytes(path) / 2**20
  print(json.dumps({"checkpoint_mb": round(size, 1), "baseline_rss_mb": round(base, 1), "peak_rss_mb": round(peak, 1),
                    "ratio": round((peak - base) / size, 2), "params_m": round(model.config.num_parameters() / 1e6, 1)}))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--load", default="")
  a = p.parse_args()
  if a.load:
    _load(a.load)
    return
  import hackable_diffusion as hd
  from hackable_diffusion.model.transformer import init_model

  cfg = hd.ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       global_head_dim=128, num_experts=8, top_k_experts=2, moe_intermediate_size=a.hidden,
                       layer_types=tuple(["sliding_attention"] * (a.layers - 1) + ["full_attention"]))
  with tempfile.TemporaryDirectory() as d:
    hd.save_pretrained(init_model(cfg, 0), d)
    subprocess.run([sys.executable, __file__, f"--load={d}"], check=True, env=dict(os.environ))


if __name__ == "__main__":
  main()
