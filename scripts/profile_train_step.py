"""Where our compiled train step spends its time on XLA:CPU: one step under `jax.profiler`, per-thunk times.

XLA:CPU runs a compiled program as a sequence of "thunks" (a fused loop, a matmul, a while loop, ...), some of them
concurrently. This script traces one step of `scripts/benchmark_train.py`'s train step, reads the Perfetto trace
that `jax.profiler.trace(create_perfetto_trace=True)` writes, and joins each thunk with the compiled HLO (its
output shape and the JAX operation it came from, `transpose(jvp(...))` meaning the backward pass). Durations are
per thunk, so concurrent thunks overlap and nested ones (the body of a `while`) are also counted in their loop:
the sums exceed the step's wall time.

  python scripts/profile_train_step.py --size=100m
  python scripts/profile_train_step.py --size=sudoku --top=40
  python scripts/profile_train_step.py --size=sudoku --matmul_dtype=bfloat16    # bf16 products (AMX)

It shows, for instance, the transposing copies that 3-D projections cost (why `model/layers.py` projects 2-D
token matrices).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax

from benchmark_train import SIZES, make_batch, make_our_step
from hackable_diffusion.model.matmul import MATMUL_DTYPES
from hackable_diffusion.model.transformer import init_model

_SKIP = ("ThunkExecutor", "Await", "PjitFunction", "$")


def thunk_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
  """(total microseconds, count) per thunk name in the Perfetto trace under `trace_dir`."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise SystemExit(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no Perfetto trace")
  with gzip.open(sorted(files)[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not any(e["name"].startswith(s) or s in e["name"] for s in _SKIP):
      total[e["name"]] += e.get("dur", 0)
      count[e["name"]] += 1
  return total, count


def hlo_index(hlo: str) -> dict[str, tuple[str, str]]:
  """HLO instruction name -> (output shape, JAX op_name)."""
  index = {}
  for name, shape, rest in re.findall(r"^\s+(?:ROOT )?%([\w.\-]+) = (\S+) (.*)$", hlo, re.M):
    op = re.search(r'op_name="([^"]*)"', rest)
    index[name] = (re.sub(r"\{.*", "", shape), op.group(1) if op else "")
  return index


def kind(name: str) -> str:
  if name.startswith(("ynn_fusion", "dot", "xnn_fusion")):
    return "matmul"
  if name.startswith("while"):
    return "while loop (its body is also counted in the other rows)"
  return "elementwise / copy / reduce"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="100m", choices=sorted(SIZES))
  parser.add_argument("--top", type=int, default=25, help="thunks to list")
  parser.add_argument("--matmul_dtype", default="auto", choices=MATMUL_DTYPES, help="ModelConfig.matmul_dtype")
  args = parser.parse_args(argv)

  size = SIZES[args.size]
  batch = make_batch(size)
  key = jax.random.key(1)
  model = init_model(size.model.replace(matmul_dtype=args.matmul_dtype), 0)
  compiled, state, compile_s, _, _ = make_our_step(model, batch, key)
  state, metrics = compiled(state, batch, key)  # warm-up
  jax.block_until_ready((state, metrics))
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      state, metrics = compiled(state, batch, key)
      jax.block_until_ready((state, metrics))
    wall = time.perf_counter() - start
    total, count = thunk_times(trace_dir)
  index = hlo_index(compiled.as_text())
  total = collections.Counter({k: v for k, v in total.items() if k in index})  # thunks only (not runtime events)

  print(f"{size.label}: compile {compile_s:.1f} s, traced step {wall:.2f} s (profiling included), "
        f"{sum(count.values())} thunk runs, {sum(total.values()) / 1e3:.0f} ms of thunk time\n")
  by_kind = collections.Counter()
  for name, us in total.items():
    by_kind[kind(name)] += us
  print("| kind | ms |\n|---|---|")
  for k, us in by_kind.most_common():
    print(f"| {k} | {us / 1e3:,.0f} |")
  print(f"\n| thunk | ms | runs | output shape | from (JAX op) |\n|---|---|---|---|---|")
  for name, us in total.most_common(args.top):
    shape, op = index.get(name, ("?", ""))
    print(f"| {name} | {us / 1e3:,.1f} | {count[name]} | {shape[:60]} | {op[-90:]} |")
  return 0


if __name__ == "__main__":
  from hackable_diffusion import hugepages

  hugepages.reexec_with_malloc_hugepages()  # as the CLIs do (HD_MALLOC_HUGEPAGES=0: without)
  sys.exit(main())
