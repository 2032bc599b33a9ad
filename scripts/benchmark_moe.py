"""Speed of the MoE implementations (`ModelConfig.moe_impl`, see `hackable_diffusion/model/moe.py`) on the current
backend, and what the ragged kernel's program moves on GPU/TPU.

Impls timed: dense (every expert on every token: the baseline), tiled (expert-sorted tiles in a loop: what
`moe_impl='auto'` runs on CPU), ragged (sorted tokens through `jax.lax.ragged_dot_general` on the stored HF layout),
grouped (what 'auto' runs on GPU/TPU: tokamax's kernels where installed, else batched expert tiles; see
`hackable_diffusion/model/moe_grouped.py`). `expert_parallel` (ragged per device under `shard_map` over the `expert` mesh axis;
'auto' under a mesh with expert > 1) needs a mesh and is checked in tests/sharding/test_moe_mesh.py, not timed here.

Four measurements, each impl on identical parameters and inputs, timed in interleaved rounds (one call of each
impl per round, so that load on a shared machine hits all alike); reported: the minimum wall time, the minimum CPU
time of this process (`time.process_time`, all threads; steadier than wall time when other processes compete for
the cores) and both as a ratio to the dense path run in the same process.

  layer   one MoE block (router + experts) on T tokens, forward and gradient (w.r.t. input and parameters)
  decode  a full decoder forward (`model.decode`) over B x C canvas tokens, reading a 32-token encoded prompt
  train   value_and_grad of the SFT loss (`diffusion_loss`: encoder + two decoder passes) of the Sudoku model
  cost    no timing: the MoE step at the 26B-A4B expert shape (128 experts top-8, hidden 2816,
          moe_intermediate 704, bf16) lowered for 'cuda' and 'tpu' (on any machine). ragged: ragged dots in the
          program and bytes of transposes / copies of weight-sized arrays (0: the weights are read as stored).
          ragged / gathered / dense: matmul FLOPs as a multiple of the selected experts' (`--parts=flops`,
          forward and gradient), XLA's cost analysis of the lowered program (FLOPs, bytes), whether it has a
          `ragged-dot` (XLA:GPU densifies it: E x the rows), and tokamax's kernels' row bound

Sizes: `sudoku` (`get_preset('sudoku')`: hidden 128, moe_intermediate 128, 4 experts top-2) and `100m` (hidden
512, moe_intermediate 512, 8 experts top-2, 8 layers, vocab 32k; scripts/benchmark_train.py's ~100M config).
Token counts 81 (1 x 81), 648 (8 x 81), 2048 (8 x 256) and, for the Sudoku training batch, 2592 (32 x 81).

  python scripts/benchmark_moe.py                          # everything (minutes on a 2-core CPU)
  python scripts/benchmark_moe.py --parts=layer --sizes=100m --tokens=2048
  python scripts/benchmark_moe.py --parts=cost --tokens=2048
  python scripts/benchmark_moe.py --parts=flops --tokens=2048
  python scripts/benchmark_moe.py --smoke                  # tiny shapes, one round (tests)

XLA:CPU has no ragged-dot kernel (jax lowers it to a dense masked dot over all experts), so ragged is slower than
dense on CPU by design. The current numbers are in docs/results.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.data.sft import SFTBatch
from hackable_diffusion.diffusion.loss import LossConfig, diffusion_loss
from hackable_diffusion.model import moe
from hackable_diffusion.model.config import FULL, SLIDING, ModelConfig, get_preset
from hackable_diffusion.model.transformer import init_model

S, F = SLIDING, FULL
SIZES: dict[str, ModelConfig] = {
    "sudoku": get_preset("sudoku"),
    "100m": ModelConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=1, sliding_window=512,
        num_experts=8, top_k_experts=2, moe_intermediate_size=512, layer_types=(S, S, S, F, S, S, S, F),
        canvas_length=256),
    "micro": get_preset("tiny", sliding_window=64),
}
CANVAS: dict[int, tuple[int, int]] = {81: (1, 81), 648: (8, 81), 2048: (8, 256), 2592: (32, 81), 16: (2, 8)}
PROMPT = 32


def time_interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
  """Each callable once per round (after one warm-up call) -> {name: (min wall s, min process CPU s)}."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  wall: dict[str, list[float]] = {k: [] for k in fns}
  cpu: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      c0, t0 = time.process_time(), time.perf_counter()
      jax.block_until_ready(fn())
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return {k: (min(wall[k]), min(cpu[k])) for k in fns}


def row(label: str, times: dict[str, tuple[float, float]]) -> str:
  """A markdown row: `wall / cpu ms (wall ratio / cpu ratio vs dense)` per impl."""
  dw, dc = times["dense"]
  cells = [f"{w * 1e3:.1f} / {c * 1e3:.1f} ({w / dw:.2f} / {c / dc:.2f})" for w, c in times.values()]
  return f"| {label} | " + " | ".join(cells) + " |"


# ------------------------------------------------------------------------------------------------------ pieces
def layer_fns(cfg: ModelConfig, impls: list[str], tokens: int) -> dict[str, dict[str, Callable[[], Any]]]:
  """{'fwd'|'grad': {impl: thunk}} for one router + experts block on `tokens` random rows."""
  h = cfg.hidden_size
  kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, std=0.02)
  with nnx.use_eager_sharding(False):
    router = moe.Router(h, cfg.num_experts, cfg.top_k_experts, eps=cfg.rms_norm_eps, rngs=nnx.Rngs(0), **kw)
  x = jax.random.normal(jax.random.key(1), (tokens, h), jnp.float32)  # [T, H]
  out: dict[str, dict[str, Callable[[], Any]]] = {"fwd": {}, "grad": {}}
  for impl in impls:
    with nnx.use_eager_sharding(False):
      experts = moe.Experts(h, cfg.moe_intermediate_size, cfg.num_experts, rngs=nnx.Rngs(2), impl=impl, **kw)
    graphdef, params = nnx.split((router, experts))

    def block(params, x, graphdef=graphdef):
      r, e = nnx.merge(graphdef, params)
      return e(x, *r(x))

    fwd = jax.jit(block)
    grad = jax.jit(jax.grad(lambda p, x, block=block: jnp.sum(block(p, x) ** 2), argnums=(0, 1)))
    out["fwd"][impl] = lambda fwd=fwd, params=params: fwd(params, x)
    out["grad"][impl] = lambda grad=grad, params=params: grad(params, x)
  return out


def decode_fns(cfg: ModelConfig, impls: list[str], tokens: int) -> dict[str, Callable[[], Any]]:
  """{impl: thunk} running `model.decode` over a B x C canvas after a 32-token encoded prompt."""
  b, c = CANVAS[tokens]
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, PROMPT)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, c)), jnp.int32)
  out = {}
  for impl in impls:
    model = init_model(cfg.replace(moe_impl=impl), seed=0)
    _, cache = model.encode(prompt, model.init_cache(b, PROMPT))
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, canvas, cache, graphdef=graphdef: nnx.merge(graphdef, state).decode(canvas, cache))
    out[impl] = lambda fn=fn, state=state, cache=cache: fn(state, canvas, cache)
  return out


def train_fns(cfg: ModelConfig, impls: list[str], batch_size: int) -> dict[str, Callable[[], Any]]:
  """{impl: thunk} computing value_and_grad of the SFT loss (prompt and completion of one canvas each)."""
  rng = np.random.default_rng(0)
  p = c = cfg.canvas_length
  ids = lambda n: jnp.asarray(rng.integers(3, cfg.vocab_size, (batch_size, n)), jnp.int32)  # noqa: E731
  batch = SFTBatch(prompt_ids=ids(p), prompt_mask=jnp.ones((batch_size, p), bool), completion_ids=ids(c),
                   completion_mask=jnp.ones((batch_size, c), bool))
  loss_config = LossConfig(variant="flat", self_conditioning_prob=0.5, encoder_ar_weight=1.0)
  key = jax.random.key(0)
  out = {}
  for impl in impls:
    graphdef, params, rest = nnx.split(init_model(cfg.replace(moe_impl=impl), seed=0), nnx.Param, ...)

    def loss(params, rest, graphdef=graphdef):
      return diffusion_loss(nnx.merge(graphdef, params, rest), batch, key, loss_config)[0]

    fn = jax.jit(jax.value_and_grad(loss))
    out[impl] = lambda fn=fn, params=params, rest=rest: fn(params, rest)
  return out


def weight_copy_bytes(hlo: str, weight_sizes: set[int]) -> int:
  """Bytes (read + write) of transposes / copies of arrays with a weight's element count in an HLO module."""
  itemsize = {"f32": 4, "bf16": 2, "f16": 2}
  moved = 0
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?\S+ = (\w+)\[([\d,]*)\]\S* (?:transpose|copy)\(", line)
    if m and m.group(1) in itemsize:
      n = math.prod(int(d) for d in m.group(2).split(",") if d)
      moved += 2 * itemsize[m.group(1)] * n if n in weight_sizes else 0
  return moved


def cost_rows(tokens: int) -> list[str]:
  """The ragged MoE step at the 26B-A4B expert shape, lowered for 'cuda' and 'tpu' (abstract shapes: nothing is
  allocated): ragged dots and weight-copy bytes, forward and gradient (w.r.t. input and both weights)."""
  cfg = get_preset("diffusion_gemma_26b_a4b")
  e, i, h, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.top_k_experts
  bf16 = jnp.bfloat16
  gate_up, down = jax.ShapeDtypeStruct((e, 2 * i, h), bf16), jax.ShapeDtypeStruct((e, h, i), bf16)
  x = jax.ShapeDtypeStruct((tokens, h), bf16)
  weights, idx = jax.ShapeDtypeStruct((tokens, k), jnp.float32), jax.ShapeDtypeStruct((tokens, k), jnp.int32)
  weight_bytes = 2 * (e * 2 * i * h + e * h * i)

  def loss(x, weights, idx, gate_up, down):
    return jnp.sum(moe.ragged_experts(x, weights, idx, gate_up, down).astype(jnp.float32) ** 2)

  rows = []
  for mode, fn in (("fwd", loss), ("grad", jax.grad(loss, argnums=(0, 3, 4)))):
    traced = jax.jit(fn).trace(x, weights, idx, gate_up, down)
    for platform in ("cuda", "tpu"):
      hlo = traced.lower(lowering_platforms=(platform,)).as_text(dialect="hlo")
      moved = weight_copy_bytes(hlo, {e * 2 * i * h, e * h * i})
      rows.append(f"| ragged {mode}, T={tokens}, {platform} | {hlo.count('ragged-dot(')} ragged dots | "
                  f"{moved / 2**20:.1f} MiB weight copies (weights {weight_bytes / 2**20:.0f} MiB) |")
  return rows


def dot_flops(jaxpr) -> int:
  """2 * M * N * K summed over every dot_general of a jaxpr, its sub-jaxprs (custom VJPs, scans) included."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    elif eqn.primitive.name == "ragged_dot_general":  # what a grouped GEMM does: each row times its group only
      numbers = eqn.params["ragged_dot_dimension_numbers"]
      (contract, _), _ = numbers.dot_dimension_numbers
      lhs = eqn.invars[0].aval.shape
      groups = 1 if numbers.rhs_group_dimensions else eqn.invars[2].aval.shape[0]  # ragged contraction: [G, ...]
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract) // groups
    for p in eqn.params.values():
      for j in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          total += dot_flops(inner)
  return total


def flops_rows(tokens: int) -> list[str]:
  """Matmul FLOPs of each MoE kernel at the 26B-A4B expert shape as a multiple of the selected experts' FLOPs
  (forward; gradient w.r.t. input and weights: 3 passes; a ragged dot counted as a grouped GEMM), the lowered
  'cuda' program's XLA cost analysis and whether it holds a `ragged-dot` (densified by XLA:GPU into E x the
  rows)."""
  from hackable_diffusion.model import moe_grouped

  cfg = get_preset("diffusion_gemma_26b_a4b")
  e, i, h, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.top_k_experts
  bf16 = jnp.bfloat16
  args = (jax.ShapeDtypeStruct((tokens, h), bf16), jax.ShapeDtypeStruct((tokens, k), jnp.float32),
          jax.ShapeDtypeStruct((tokens, k), jnp.int32), jax.ShapeDtypeStruct((e, 2 * i, h), bf16),
          jax.ShapeDtypeStruct((e, h, i), bf16))
  active = 2 * tokens * k * (2 * i * h + h * i)
  rows = [f"| kernel, T={tokens} (x top-{k}) | matmul FLOPs / selected experts' | cuda program: XLA FLOPs, "
          f"bytes | ragged-dot in program |", "|---|---|---|---|"]
  kernels = {"ragged": moe.ragged_experts, "grouped (gathered tiles)": moe_grouped.gathered_experts,
             "dense": moe.dense_experts}
  for name, kernel in kernels.items():
    def loss(*a, kernel=kernel):
      return jnp.sum(kernel(*a).astype(jnp.float32) ** 2)

    for mode, fn, passes in (("fwd", loss, 1), ("grad", jax.grad(loss, argnums=(0, 3, 4)), 3)):
      ratio = dot_flops(jax.make_jaxpr(fn)(*args).jaxpr) / (passes * active)
      lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
      cost = lowered.cost_analysis() or {}
      ragged = lowered.as_text(dialect="hlo").count("ragged-dot(")
      note = f"{ragged} (XLA:GPU runs each as {e} x its rows)" if ragged else "0"
      rows.append(f"| {name} {mode} | {ratio:.2f} | {cost.get('flops', 0) / 1e9:.0f} GFLOP, "
                  f"{cost.get('bytes accessed', 0) / 2**30:.1f} GiB | {note} |")
  for kernel, block_m in (("tokamax Mosaic GPU (sm90/sm100 heuristic block_m 64)", 64),
                          ("tokamax Triton (heuristic block_m 128)", 128)):
    bound = (tokens * k + e * (block_m - 1)) / (tokens * k)  # each group's rows in whole blocks of block_m
    rows.append(f"| {kernel} fwd | <= {bound:.2f} (kernel tiling bound) | custom call | 0 |")
  return rows


# -------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default="sudoku,100m")
  ap.add_argument("--tokens", default="81,648,2048")
  ap.add_argument("--impls", default="dense,tiled,ragged",
                  help="comma list of dense, tiled, ragged, grouped; dense is always run (the baseline)")
  ap.add_argument("--parts", default="layer,decode,train",
                  help="comma list of layer, decode, train; or 'cost' or 'flops' alone")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--smoke", action="store_true", help="micro config, 16 tokens, one round")
  args = ap.parse_args(argv)
  if args.smoke:
    args.sizes, args.tokens, args.rounds = "micro", "16", 1
  impls = ["dense"] + [i for i in args.impls.split(",") if i != "dense"]
  if set(impls) - {"dense", "tiled", "ragged", "grouped"}:
    ap.error(f"--impls={args.impls!r}; expected a comma list of dense, tiled, ragged, grouped")
  if args.parts == "flops":
    for tokens in (int(t) for t in args.tokens.split(",")):
      print("\n".join(flops_rows(tokens)), flush=True)
    return
  if args.parts == "cost":
    for tokens in (int(t) for t in args.tokens.split(",")):
      print("\n".join(cost_rows(tokens)), flush=True)
    return
  sizes = args.sizes.split(",")
  token_counts = [int(t) for t in args.tokens.split(",")]
  parts = args.parts.split(",")
  print(f"backend {jax.default_backend()}, {os.cpu_count()} CPUs, load average {os.getloadavg()}, "
        f"rounds {args.rounds}")
  print("each cell: min wall / min process-CPU ms (ratio to dense: wall / CPU)\n")
  print("| measurement | " + " | ".join(impls) + " |")
  print("|---" * (len(impls) + 1) + "|")
  for size in sizes:
    cfg = SIZES[size]
    for tokens in token_counts:
      if "layer" in parts:
        fns = layer_fns(cfg, impls, tokens)
        for mode in ("fwd", "grad"):
          print(row(f"{size} MoE layer {mode}, T={tokens}", time_interleaved(fns[mode], args.rounds)), flush=True)
      if "decode" in parts:
        b, c = CANVAS[tokens]
        label = f"{size} decode {b}x{c}"
        print(row(label, time_interleaved(decode_fns(cfg, impls, tokens), args.rounds)), flush=True)
    if "train" in parts and size in ("sudoku", "micro"):
      batch_size = 2 if args.smoke else 32
      tokens = batch_size * cfg.canvas_length
      label = f"{size} value_and_grad(SFT loss), batch {batch_size} ({tokens} canvas tokens)"
      print(row(label, time_interleaved(train_fns(cfg, impls, batch_size), args.rounds)), flush=True)
  print(f"\nload average {os.getloadavg()}")


if __name__ == "__main__":
  main()
