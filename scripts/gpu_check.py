"""GPU checks of the DiffusionGemma 26B-A4B shape with random bf16 weights: one prepared command for a lent GPU.

    python scripts/gpu_check.py [--out=gpu_check.json] [--bandwidth_gbs=4800] [--moe_impl=grouped]

Measures, on the first accelerator:
  1. decoder forwards per second (one denoising step's forward: canvas 256 over a 256-token prompt cache, with
     self-conditioning logits) at batch 1 and 8, against the HBM roofline: bytes of the weights one forward reads
     (every non-expert weight, the tied embedding as the LM head, and the experts the batch's tokens route to -
     expected distinct experts per layer under uniform top-k routing) / memory bandwidth;
  2. one LoRA train step (the recipe: r8 on all linear layers, remat, tiled loss, batch 8 as `--accum` micro-batches)
     - seconds per step and the device's peak bytes in use;
  3. `hd.generate` tokens per second at batch 1 with the default sampler (256 new tokens, early stopping).
Prints a markdown table (docs/results.md has the current one) and writes it as JSON with `--out`.

It refuses on a CPU backend (one line, exit status 2): the numbers mean nothing there. `--allow_cpu --preset=tiny`
runs the same code on a tiny model (tests/test_benchmark_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hackable_diffusion as hd
from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig
from hackable_diffusion.lora.adapters import ALL_LINEAR, LoraConfig, apply_lora
from hackable_diffusion.model.config import ModelConfig, get_preset
from hackable_diffusion.training.optimizer import OptimizerConfig, make_optimizer
from hackable_diffusion.training.step import init_train_state, make_train_step

PROMPT = CANVAS = 256
# HBM bandwidth (GB/s) by device kind, used when --bandwidth_gbs is not given (vendor data sheets)
BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0,
                 "TPU v5p": 2765.0, "TPU v5 lite": 819.0, "TPU v6 lite": 1640.0}
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
  """Expected number of distinct experts `tokens` tokens route to, each picking `top_k` of `num_experts` uniformly."""
  return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def weight_bytes(state: nnx.State) -> tuple[int, int]:
  """(bytes of the expert weights, bytes of every other weight) of a model's state."""
  expert = other = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    n = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
    if any(a == "experts" and b in EXPERT_PARAMS for a, b in zip(names, names[1:])):  # not the dense MLP's down_proj
      expert += n
    else:
      other += n
  return expert, other


def forward_bytes(config: ModelConfig, state: nnx.State, tokens: int) -> float:
  """Bytes of weights one decoder forward over `tokens` canvas tokens reads (the roofline's numerator)."""
  expert, other = weight_bytes(state)
  share = expected_distinct(config.num_experts, config.top_k_experts, tokens) / config.num_experts
  return other + expert * share


def bandwidth(flag: float | None) -> tuple[float, str]:
  if flag:
    return flag * 1e9, "--bandwidth_gbs"
  kind = jax.devices()[0].device_kind
  for name, gbs in BANDWIDTH_GBS.items():
    if name.lower() in kind.lower():
      return gbs * 1e9, f"{kind} data sheet"
  raise SystemExit(f"error: unknown device kind {kind!r}: pass --bandwidth_gbs=<HBM GB/s>")


def timed(fn: Callable[[], Any], repeats: int) -> float:
  """Seconds per call (after one warm-up call that compiles)."""
  jax.block_until_ready(fn())
  t = time.perf_counter()
  for _ in range(repeats):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / repeats


def peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# ---- the three checks --------------------------------------------------------------------------------------------
def check_forwards(model: hd.DiffusionGemma, batch: int, bw: float, repeats: int) -> dict[str, Any]:
  cfg = model.config
  rng = np.random.default_rng(batch)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, PROMPT)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, CANVAS)), jnp.int32)
  graphdef, state = nnx.split(model)

  @jax.jit
  def encode(state, prompt):
    m = nnx.merge(graphdef, state)
    return m.encode(prompt, m.init_cache(batch, PROMPT))[1]

  @jax.jit
  def decode(state, cache, canvas, sc):
    return nnx.merge(graphdef, state).decode(canvas, cache, sc, jnp.ones((batch,), bool))

  cache = encode(state, prompt)
  sc = jnp.zeros((batch, CANVAS, cfg.vocab_size), jnp.float32)
  seconds = timed(lambda: decode(state, cache, canvas, sc), repeats)
  read = forward_bytes(cfg, state, batch * CANVAS)
  roofline = bw / read
  return {"check": f"decoder forward, batch {batch}", "forwards_per_s": 1.0 / seconds,
          "roofline_forwards_per_s": roofline, "ratio": (1.0 / seconds) / roofline, "weight_bytes_read": read}


def check_lora_step(model: hd.DiffusionGemma, batch: int, accum: int, repeats: int) -> dict[str, Any]:
  cfg = model.config
  lora_model = apply_lora(model, LoraConfig(rank=8, alpha=16.0, target_modules=ALL_LINEAR), rngs=nnx.Rngs(1))
  tx, _ = make_optimizer(OptimizerConfig())
  graphdef, state = init_train_state(lora_model, tx, trainable=nnx.LoRAParam)
  step = make_train_step(graphdef, tx, LossConfig(logits_tile_mib=256.0), grad_accum_steps=accum)
  rng = np.random.default_rng(0)
  data = SFTBatch(prompt_ids=jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, PROMPT)), jnp.int32),
                  prompt_mask=jnp.ones((batch, PROMPT), bool),
                  completion_ids=jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, CANVAS)), jnp.int32),
                  completion_mask=jnp.ones((batch, CANVAS), bool))
  holder = {"state": state}

  def one():
    holder["state"], metrics = step(holder["state"], data, jax.random.key(0))
    return metrics["loss"]

  seconds = timed(one, repeats)
  peak = peak_bytes()
  return {"check": f"LoRA train step, batch {batch} ({accum} micro-batches)", "seconds_per_step": seconds,
          "peak_gib": None if peak is None else peak / 2**30}


def check_generate(model: hd.DiffusionGemma, repeats: int) -> dict[str, Any]:
  cfg = model.config
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (1, PROMPT)), jnp.int32)
  sampling = hd.SamplingConfig(max_new_tokens=CANVAS)
  outs = []

  def one():
    outs.append(hd.generate(model, prompt, sampling, rng=jax.random.key(len(outs))))
    return outs[-1].sequences

  seconds = timed(one, repeats)
  steps = float(np.mean(np.asarray(outs[-1].denoising_steps)))
  return {"check": "hd.generate, batch 1, 256 new tokens", "tokens_per_s": CANVAS / seconds,
          "denoising_steps": steps}


def build_model(preset: str, moe_impl: str) -> hd.DiffusionGemma:
  """The preset with random bf16 weights, initialised on the device (never on the host)."""
  cfg = get_preset(preset, dtype="bfloat16", param_dtype="bfloat16", moe_impl=moe_impl, remat="nothing_saveable")
  return nnx.jit(lambda: hd.DiffusionGemma(cfg, rngs=nnx.Rngs(0)))()


def print_table(rows: list[dict[str, Any]]) -> None:
  print("| check | measured | roofline / peak memory | ratio |")
  print("|---|---|---|---|")
  for r in rows:
    if "forwards_per_s" in r:
      print(f"| {r['check']} | {r['forwards_per_s']:.2f} forwards/s | {r['roofline_forwards_per_s']:.2f} forwards/s "
            f"({r['weight_bytes_read'] / 2**30:.1f} GiB of weights) | {r['ratio']:.2f} |")
    elif "seconds_per_step" in r:
      peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB peak"
      print(f"| {r['check']} | {r['seconds_per_step']:.2f} s/step | {peak} | |")
    else:
      print(f"| {r['check']} | {r['tokens_per_s']:.1f} tokens/s | {r['denoising_steps']:.1f} denoising steps | |")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="diffusion_gemma_26b_a4b")
  parser.add_argument("--moe_impl", default="grouped", choices=("grouped", "ragged", "tiled", "dense"))
  parser.add_argument("--bandwidth_gbs", type=float, default=None, help="HBM bandwidth (default: by device kind)")
  parser.add_argument("--accum", type=int, default=4, help="micro-batches of the LoRA step (the recipe: 4)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default=None, help="also write the rows as JSON")
  parser.add_argument("--allow_cpu", action="store_true", help="run on a CPU backend anyway (tests, tiny presets)")
  args = parser.parse_args(argv)
  backend = jax.default_backend()
  if backend == "cpu" and not args.allow_cpu:
    print(f"error: gpu_check measures an accelerator, but JAX's backend is 'cpu' ({jax.devices()[0].device_kind}); "
          "run it on a GPU/TPU machine", file=sys.stderr)
    return 2
  bw, source = bandwidth(args.bandwidth_gbs or (100.0 if backend == "cpu" else None))
  print(f"device: {jax.devices()[0].device_kind} ({backend}); HBM bandwidth {bw / 1e9:.0f} GB/s ({source}); "
        f"preset {args.preset}, moe_impl {args.moe_impl}", flush=True)
  model = build_model(args.preset, args.moe_impl)
  rows = [check_forwards(model, b, bw, args.repeats) for b in (1, 8)]
  rows.append(check_generate(model, max(1, args.repeats // 2)))
  rows.append(check_lora_step(model, 8, args.accum, max(1, args.repeats // 2)))  # last: it adds adapters
  print_table(rows)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump({"device": jax.devices()[0].device_kind, "bandwidth_bytes_per_s": bw, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
