"""Peak host memory of exporting a LoRA run, relative to the model's bytes (the CPU path of the export CLI).

  python scripts/benchmark_export.py [--hidden=1024 --layers=12 --experts=32 --vocab=32768]
      [--modes=merged,fp8,peft,merge-first]

Each mode runs in a fresh process that builds the model as the export CLI holds a LoRA run (bfloat16 base, float32
adapters on every linear layer and the experts, layers stacked as `ModelConfig.scan_layers` keeps them) from
random weights, resets the process's peak RSS (`/proc/self/clear_refs`), exports, and reads the peak (`VmHWM`):

- merged: `export_merged(..., dtype='bfloat16')` (adapters folded in layer by layer while writing);
- fp8: the same with `quantize='fp8'` (quantized tensor by tensor);
- peft: `export_peft` of a model whose base is shapes only, as `--format=peft` of a workdir reads it
  (`runs.run.load_run_adapters`): the adapters alone;
- merge-first: `save_pretrained(lora.merge(model))`, i.e. a merged copy of the whole model before writing (what
  streaming avoids), for comparison.

Reported per mode: the model's bytes (base + adapters), one layer's bytes, the RSS before exporting (interpreter,
libraries, the model and what building it left), the peak during the export, the export's extra memory
(peak - before) as a fraction of the model and in layers, and `1 + extra / model`: the host peak relative to the
model for a process that holds just the model. The "implied 26B" column scales the extra memory by the 26B's
(larger) layers: an upper bound, since the extra does not grow with the layers (compare `--layers=12` and
`--layers=30 --hidden=768`). The machine's other processes do not count (RSS is per process); a loaded machine only
slows the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("merged", "fp8", "peft", "merge-first")


def _status_mib(field: str) -> float:
  """VmRSS / VmHWM of this process in MiB (not ru_maxrss, which cannot be reset and survives exec)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _config(a: argparse.Namespace):
  from hackable_diffusion.model.config import ModelConfig

  layer_types = tuple(("sliding_attention",) * 5 + ("full_attention",)) * (a.layers // 6) + ("sliding_attention",) * (
      a.layers % 6)
  return ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                     num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                     global_head_dim=256, num_global_key_value_heads=2, sliding_window=512, num_experts=a.experts,
                     top_k_experts=4, moe_intermediate_size=a.hidden // 2, layer_types=layer_types,
                     param_dtype="bfloat16", dtype="bfloat16", scan_layers=True)


def _lora_config():
  from hackable_diffusion import lora

  return lora.LoraConfig(rank=16, alpha=32, target_modules=("all-linear", "experts"))


def _random_adapters(model) -> None:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  key = jax.random.key(1)
  for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
    v.value = 0.01 * jax.random.normal(jax.random.fold_in(key, i), v.shape, jnp.float32).astype(v.dtype)


def _build(a: argparse.Namespace, shapes_only: bool):
  """The LoRA model as a run holds it: adapters on a bf16 base, layers stacked; `shapes_only`: the base as shapes."""
  from flax import nnx

  from hackable_diffusion import lora
  from hackable_diffusion.model import scan
  from hackable_diffusion.model.transformer import DiffusionGemma, init_model

  cfg = _config(a)
  if shapes_only:
    abstract = nnx.eval_shape(lambda: scan.stack_layers(lora.apply_lora(
        DiffusionGemma(cfg, rngs=nnx.Rngs(0)), _lora_config(), rngs=nnx.Rngs(1))))
    graphdef, adapters, rest = nnx.split(abstract, nnx.LoRAParam, ...)
    import jax
    import jax.numpy as jnp

    adapters = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), adapters)
    model = nnx.merge(graphdef, adapters, rest)
  else:
    model = scan.stack_layers(lora.apply_lora(init_model(cfg, 0), _lora_config(), rngs=nnx.Rngs(1)), donate=True)
  _random_adapters(model)
  return model, cfg


def _nbytes(state) -> int:
  from flax import nnx

  return sum(v.size * v.dtype.itemsize for _, v in nnx.to_flat_state(state))


def base_bytes(cfg) -> tuple[int, int]:
  """(the base model's bytes, one layer's bytes on average) from shapes alone."""
  from flax import nnx

  from hackable_diffusion.model.transformer import DiffusionGemma

  base = nnx.eval_shape(lambda: DiffusionGemma(cfg, rngs=nnx.Rngs(0)))
  return _nbytes(nnx.state(base)), _nbytes(nnx.state(base.layers)) // cfg.num_hidden_layers


def adapter_bytes(cfg) -> int:
  """The bytes of the benchmark's adapters (`_lora_config`) on a model of `cfg`, from shapes alone."""
  from flax import nnx

  from hackable_diffusion import lora
  from hackable_diffusion.model.transformer import DiffusionGemma

  abstract = nnx.eval_shape(lambda: lora.apply_lora(DiffusionGemma(cfg, rngs=nnx.Rngs(0)), _lora_config(),
                                                    rngs=nnx.Rngs(1)))
  return _nbytes(nnx.state(abstract, nnx.LoRAParam))


def child(a: argparse.Namespace) -> None:
  import jax  # noqa: F401

  from hackable_diffusion import lora
  from hackable_diffusion.interop import export as export_lib
  from hackable_diffusion.interop import hf_write

  imports = _status_mib("VmRSS")
  model, cfg = _build(a, shapes_only=a.child == "peft")
  from flax import nnx

  base, layer = base_bytes(cfg)
  adapters = _nbytes(nnx.state(model, nnx.LoRAParam))
  before = _status_mib("VmRSS")
  _reset_peak()
  t0 = time.perf_counter()
  if a.child == "merged":
    export_lib.export_merged(model, a.out, dtype="bfloat16")
  elif a.child == "fp8":
    export_lib.export_merged(model, a.out, dtype="bfloat16", quantize="fp8")
  elif a.child == "peft":
    export_lib.export_peft(model, a.out, "base")
  else:
    hf_write.save_pretrained(lora.merge(model), a.out, dtype="bfloat16")
  seconds = time.perf_counter() - t0
  peak = _status_mib("VmHWM")
  model_mib = (base + adapters) / 2**20
  print(json.dumps({"mode": a.child, "model_mib": round(model_mib, 1), "adapters_mib": round(adapters / 2**20, 1),
                    "layer_mib": round(layer / 2**20, 1), "imports_rss_mib": round(imports, 1),
                    "before_rss_mib": round(before, 1), "peak_rss_mib": round(peak, 1),
                    "overhead": round((peak - before) / model_mib, 3),
                    "overhead_layers": round((peak - before) / (layer / 2**20), 2),
                    "peak_over_model": round((peak - imports) / model_mib, 3), "seconds": round(seconds, 1)}))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--experts", type=int, default=32)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  p.add_argument("--out", default="", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.child:
    child(a)
    return
  modes = [m for m in a.modes.split(",") if m]
  unknown = sorted(set(modes) - set(MODES))
  if unknown:
    sys.exit(f"error: unknown --modes {unknown}; choose from {MODES}")
  from hackable_diffusion.model.config import get_preset

  big_cfg = get_preset("diffusion_gemma_26b_a4b")
  big, big_layer = (b / 2**30 for b in base_bytes(big_cfg))
  big_adapters = adapter_bytes(big_cfg) / 2**30
  rows = []
  for mode in modes:
    with tempfile.TemporaryDirectory() as d:
      args = [sys.executable, __file__, f"--child={mode}", f"--out={os.path.join(d, 'out')}", f"--hidden={a.hidden}",
              f"--layers={a.layers}", f"--experts={a.experts}", f"--vocab={a.vocab}"]
      res = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
      if res.returncode:
        sys.exit(f"error: mode {mode} failed:\n{res.stderr[-3000:]}")
      row = json.loads(res.stdout.strip().splitlines()[-1])
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"\n26B preset: {big:.1f} GiB in bf16, {big_layer:.2f} GiB a layer, {big_adapters:.2f} GiB of these "
        "adapters. Implied (an upper bound): the model held plus the export's extra memory in 26B layers; for peft the "
        "adapters held plus the extra memory in adapters' bytes.")
  print("\n| mode | model MiB | layer MiB | RSS before MiB | peak RSS MiB | extra / model | extra in layers | "
        "1 + extra / model | s | implied 26B host peak |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if r["mode"] == "peft":
      implied = big_adapters * (1 + r["overhead"] * r["model_mib"] / r["adapters_mib"])
    else:
      implied = big + r["overhead_layers"] * big_layer
    print(f"| {r['mode']} | {r['model_mib']} | {r['layer_mib']} | {r['before_rss_mib']} | {r['peak_rss_mib']} | "
          f"{r['overhead']} | {r['overhead_layers']} | {1 + r['overhead']:.2f} | {r['seconds']} | "
          f"{implied:.1f} GiB |")


if __name__ == "__main__":
  main()
