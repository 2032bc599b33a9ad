"""GPU checks of the DiffusionGemma 26B-A4B shape with random bf16 weights: one bounded session for a lent GPU.

    python scripts/gpu_check.py --out=gpu_check.json [--budget_s=480] [--bandwidth_gbs=4800] [--moe_impl=grouped]

Runs, on the first accelerator, in this order (cheapest and most informative first), writing `--out` after every
check so that a session cut short keeps what it measured:
  1. the device's own ceilings: copy bandwidth (a 1 GiB on-device copy) and bf16 matmul FLOP/s (8192^3);
  2. one MoE layer of the model's shape (2,048 tokens, top-k routing) under each `moe_impl` that applies (grouped,
     ragged, tiled): seconds per forward, before the model is built;
  3. decoder forwards per second (one denoising step's forward: canvas 256 over a 256-token prompt cache, with
     self-conditioning logits) at batch 1 and 8, against max(bytes time, FLOP time): the bytes of the weights one
     forward reads (non-expert weights, the tied embedding as the LM head, and the expected distinct experts the
     tokens route to) over the measured bandwidth, and the compiled program's FLOPs over the measured matmul rate;
     with the program's compiled memory (`memory_analysis`) beside the CPU report's figure for the same case;
  4. `hd.generate` tokens per second at batch 1 with a fixed step count (48 steps, no early stopping);
  5. one LoRA train step of the recipe (r8 on all linear layers, remat, tiled loss, batch 8 as `--accum`
     micro-batches): seconds per step, the device's peak bytes (`memory_stats`, process-wide) and compiled memory.
Layers are scanned, as the 26B recipe runs them. `--budget_s` bounds the session: a check that would start after
the budget is recorded as skipped, and a SIGALRM at the budget interrupts a running check between Python calls (a
compile in progress finishes first). The JSON schema is in docs/scaling.md.

It refuses on a CPU backend (one line, exit status 2): the numbers mean nothing there. `--allow_cpu --preset=tiny`
runs the same code on a tiny model (tests/test_benchmark_scripts.py).

Without network access: `pip download -d wheels ".[cuda12]"` where the package index is reachable, copy `wheels/`
and the repository, then `pip install --no-index --find-links=wheels -e ".[cuda12]"`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
STEPS = 48  # the generate check's fixed denoising steps per canvas
# the CPU memory report's figures for the same programs of the 26B preset (docs/results.md), GiB per device
CPU_REPORT_GIB = {"decoder forward, batch 8": 52.0, "LoRA train step": 52.7}
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


def bandwidth(flag: float | None, measured: float | None) -> tuple[float, str]:
  """Bytes per second for the roofline: --bandwidth_gbs, else the measured copy bandwidth, else the data sheet."""
  if flag:
    return flag * 1e9, "--bandwidth_gbs"
  if measured:
    return measured, "measured copy"
  kind = jax.devices()[0].device_kind
  for name, gbs in BANDWIDTH_GBS.items():
    if name.lower() in kind.lower():
      return gbs * 1e9, f"{kind} data sheet"
  raise SystemExit(f"error: unknown device kind {kind!r}: pass --bandwidth_gbs=<HBM GB/s>")


def compiled_memory(compiled) -> dict[str, float] | None:
  """Arguments / temporaries / outputs GiB of a compiled program (None where the backend reports nothing)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return {k: getattr(m, f"{k}_size_in_bytes") / 2**30 for k in ("argument", "temp", "output")}


def compiled_flops(compiled) -> float | None:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None


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


# ---- the checks ---------------------------------------------------------------------------------------------------
def check_ceilings(repeats: int, small: bool) -> dict[str, Any]:
  """The device's copy bandwidth (read + write of a 1 GiB buffer; 64 MiB when `small`) and bf16 matmul rate."""
  n = (64 if small else 1024) * 2**20 // 4
  x = jnp.ones((n,), jnp.float32)
  copy = jax.jit(lambda a: a * 1.0001)
  bw = 2 * x.nbytes / timed(lambda: copy(x), repeats)
  m = 1024 if small else 8192
  a = jnp.ones((m, m), jnp.bfloat16)
  mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32))
  flops = 2 * m**3 / timed(lambda: mm(a, a), repeats)
  return {"check": "device ceilings", "copy_bytes_per_s": bw, "bf16_matmul_flops_per_s": flops}


def check_moe_impls(config: ModelConfig, impls: tuple[str, ...], repeats: int) -> dict[str, Any]:
  """Seconds per forward of one MoE layer of `config`'s shape over 2,048 tokens, per kernel."""
  from hackable_diffusion.model import moe

  e, k, h, i = config.num_experts, config.top_k_experts, config.hidden_size, config.moe_intermediate_size
  t = 2048
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  idx = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
  w = jnp.full((t, k), 1.0 / k, jnp.float32)
  gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * 0.02, jnp.bfloat16)
  down = jnp.asarray(rng.standard_normal((e, h, i)) * 0.02, jnp.bfloat16)
  seconds = {}
  for impl in impls:
    fn = jax.jit(lambda x, w, idx, gu, d, impl=impl: moe.experts_forward(impl, x, w, idx, gu, d))
    try:
      seconds[impl] = timed(lambda fn=fn: fn(x, w, idx, gate_up, down), repeats)
    except Exception as err:  # noqa: BLE001 - one kernel failing on this device is a result, not the end
      seconds[impl] = f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
  return {"check": f"MoE layer forward, {t} tokens", "seconds": seconds}


def check_forwards(model: hd.DiffusionGemma, batch: int, bw: float, peak_flops: float | None, repeats: int,
                   cpu_report_gib: float | None) -> dict[str, Any]:
  cfg = model.config
  rng = np.random.default_rng(batch)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, PROMPT)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, CANVAS)), jnp.int32)
  graphdef, state = nnx.split(model)

  @jax.jit
  def encode(state, prompt):
    m = nnx.merge(graphdef, state)
    return m.encode(prompt, m.init_cache(batch, PROMPT))[1]

  def decode(state, cache, canvas, sc):
    return nnx.merge(graphdef, state).decode(canvas, cache, sc, jnp.ones((batch,), bool))

  cache = encode(state, prompt)
  sc = jnp.zeros((batch, CANVAS, cfg.vocab_size), jnp.float32)
  compiled = jax.jit(decode).lower(state, cache, canvas, sc).compile()
  seconds = timed(lambda: compiled(state, cache, canvas, sc), repeats)
  read = forward_bytes(cfg, state, batch * CANVAS)
  flops = compiled_flops(compiled)
  bound = max(read / bw, (flops / peak_flops) if flops and peak_flops else 0.0)
  return {"check": f"decoder forward, batch {batch}", "forwards_per_s": 1.0 / seconds,
          "roofline_forwards_per_s": 1.0 / bound, "ratio": bound / seconds, "weight_bytes_read": read,
          "flops": flops, "compiled_gib": compiled_memory(compiled), "cpu_report_gib": cpu_report_gib}


def check_lora_step(model: hd.DiffusionGemma, batch: int, accum: int, repeats: int,
                    cpu_report_gib: float | None) -> dict[str, Any]:
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
  compiled = jax.jit(step).lower(holder["state"], data, jax.random.key(0)).compile()
  return {"check": f"LoRA train step, batch {batch} ({accum} micro-batches)", "seconds_per_step": seconds,
          "peak_gib": None if peak is None else peak / 2**30, "compiled_gib": compiled_memory(compiled),
          "cpu_report_gib": cpu_report_gib}


def check_generate(model: hd.DiffusionGemma, repeats: int) -> dict[str, Any]:
  cfg = model.config
  prompt = jnp.asarray(np.random.default_rng(1).integers(3, cfg.vocab_size, (1, PROMPT)), jnp.int32)
  sampling = hd.SamplingConfig(max_new_tokens=CANVAS, max_denoising_steps=STEPS, early_stopping=False)
  outs = []

  def one():
    outs.append(hd.generate(model, prompt, sampling, rng=jax.random.key(len(outs))))
    return outs[-1].sequences

  seconds = timed(one, repeats)
  steps = float(np.mean(np.asarray(outs[-1].denoising_steps)))
  return {"check": f"hd.generate, batch 1, 256 new tokens, {STEPS} steps", "tokens_per_s": CANVAS / seconds,
          "denoising_steps": steps}


def build_model(preset: str, moe_impl: str) -> hd.DiffusionGemma:
  """The preset with random bf16 weights, initialised on the device (never on the host)."""
  cfg = get_preset(preset, dtype="bfloat16", param_dtype="bfloat16", moe_impl=moe_impl, remat="nothing_saveable",
                   scan_layers=True)
  return nnx.jit(lambda: hd.DiffusionGemma(cfg, rngs=nnx.Rngs(0)))()


def print_table(rows: list[dict[str, Any]]) -> None:
  print("| check | measured | bound / memory | ratio |")
  print("|---|---|---|---|")
  for r in rows:
    if "skipped" in r or "error" in r:
      print(f"| {r['check']} | {r.get('skipped') or r.get('error')} | | |")
    elif "copy_bytes_per_s" in r:
      print(f"| {r['check']} | copy {r['copy_bytes_per_s'] / 1e9:.0f} GB/s | bf16 matmul "
            f"{r['bf16_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s | |")
    elif "seconds" in r:
      shown = ", ".join(f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} {v}" for k, v in r["seconds"].items())
      print(f"| {r['check']} | {shown} | | |")
    elif "forwards_per_s" in r:
      print(f"| {r['check']} | {r['forwards_per_s']:.2f} forwards/s | {r['roofline_forwards_per_s']:.2f} forwards/s "
            f"({r['weight_bytes_read'] / 2**30:.1f} GiB of weights) | {r['ratio']:.2f} |")
    elif "seconds_per_step" in r:
      peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB peak"
      print(f"| {r['check']} | {r['seconds_per_step']:.2f} s/step | {peak} | |")
    else:
      print(f"| {r['check']} | {r['tokens_per_s']:.1f} tokens/s | {r['denoising_steps']:.1f} denoising steps | |")


class OverBudget(Exception):
  """Raised by SIGALRM when the session's budget runs out inside a check."""


def write_json(path: str | None, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
  """The session so far, written whole through a temporary file (a session cut short keeps every finished row)."""
  if not path:
    return
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({**header, "rows": rows}, f, indent=1)
  os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="diffusion_gemma_26b_a4b")
  parser.add_argument("--moe_impl", default="grouped", choices=("grouped", "ragged", "tiled", "dense"))
  parser.add_argument("--bandwidth_gbs", type=float, default=None, help="HBM bandwidth (default: measured)")
  parser.add_argument("--accum", type=int, default=4, help="micro-batches of the LoRA step (the recipe: 4)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--budget_s", type=float, default=480.0, help="seconds the whole session may take")
  parser.add_argument("--out", default=None, help="the JSON written after every check")
  parser.add_argument("--allow_cpu", action="store_true", help="run on a CPU backend anyway (tests, tiny presets)")
  args = parser.parse_args(argv)
  start = time.monotonic()
  backend = jax.default_backend()
  if backend == "cpu" and not args.allow_cpu:
    print(f"error: gpu_check measures an accelerator, but JAX's backend is 'cpu' ({jax.devices()[0].device_kind}); "
          "run it on a GPU/TPU machine", file=sys.stderr)
    return 2
  header = {"device": jax.devices()[0].device_kind, "backend": backend, "preset": args.preset,
            "moe_impl": args.moe_impl, "budget_s": args.budget_s, "jax": jax.__version__}
  rows: list[dict[str, Any]] = []
  is_26b = args.preset == "diffusion_gemma_26b_a4b"
  config = get_preset(args.preset)
  small = config.hidden_size < 1024
  state: dict[str, Any] = {}

  def ceilings():
    row = check_ceilings(args.repeats, small)
    state["peak_flops"] = row["bf16_matmul_flops_per_s"]
    state["bw"], header["bandwidth_source"] = bandwidth(args.bandwidth_gbs, row["copy_bytes_per_s"])
    header["bandwidth_bytes_per_s"] = state["bw"]
    return [row]

  def model():
    state["model"] = build_model(args.preset, args.moe_impl)
    return []

  def forwards():
    return [check_forwards(state["model"], b, state["bw"], state["peak_flops"], args.repeats,
                           CPU_REPORT_GIB.get(f"decoder forward, batch {b}") if is_26b else None) for b in (1, 8)]

  checks = [
      ("device ceilings", ceilings),
      ("MoE layer forward", lambda: [check_moe_impls(config, ("grouped", "ragged", "tiled"), args.repeats)]),
      ("building the model", model),
      ("decoder forward", forwards),
      ("hd.generate", lambda: [check_generate(state["model"], max(1, args.repeats // 2))]),
      ("LoRA train step", lambda: [check_lora_step(state["model"], 8, args.accum, max(1, args.repeats // 2),
                                                   CPU_REPORT_GIB["LoRA train step"] if is_26b else None)]),
  ]

  running = [False]  # the alarm interrupts a running check only; between checks the budget test below skips

  def over_budget(signum, frame):
    del signum, frame
    if running[0]:
      raise OverBudget()

  signal.signal(signal.SIGALRM, over_budget)
  signal.setitimer(signal.ITIMER_REAL, max(args.budget_s, 0.001))
  for name, check in checks:
    elapsed = time.monotonic() - start
    if elapsed >= args.budget_s or (name != "device ceilings" and "bw" not in state) or (
        name in ("decoder forward", "hd.generate", "LoRA train step") and "model" not in state):
      rows.append({"check": name, "skipped": f"budget ({elapsed:.0f} of {args.budget_s:.0f} s)"
                   if elapsed >= args.budget_s else "an earlier check did not finish"})
    else:
      t = time.monotonic()
      try:
        running[0] = True
        measured = check()
        running[0] = False
        rows.extend({**row, "wall_s": time.monotonic() - t} for row in measured)
      except OverBudget:
        running[0] = False
        rows.append({"check": name, "skipped": f"budget ran out during the check ({args.budget_s:.0f} s)"})
      print(f"[{time.monotonic() - start:.0f} s] {name}", flush=True)
    write_json(args.out, header, rows)
  signal.setitimer(signal.ITIMER_REAL, 0)
  print_table(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
