"""Matmul throughput of XLA (and torch) on this CPU, for the ceilings quoted in docs/results.md.

  python scripts/measure_matmul_peak.py          # float32
  python scripts/measure_matmul_peak.py --bf16   # also bfloat16 operands with float32 accumulation (AMX)

Shapes: a large square product (the machine's peak), the products of the Sudoku-size decoder step at batch 8
(648 x 128 x 256) and batch 1 (81 x 128 x 256, 81 x 128 x 768), and with `--bf16` the training step's
projection at batch 32 (2592 x 128 x 384) in its three forms: forward `x W`, input gradient `g W^T` and weight
gradient `x^T g`, the last both as a plain dot (XLA:CPU computes it in float32 on upcast copies) and through
`hackable_diffusion.model.matmul.row_major_transpose` (what `ModelConfig.matmul_dtype='bfloat16'` runs).
Best of 20 calls, compile excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hackable_diffusion.model import matmul

BF16 = jnp.bfloat16
NN, NT, TN = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))


def best_seconds(fn, *args, reps: int = 20) -> float:
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def operands(shape_a, shape_b, seed: int = 0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape_a, np.float32)), jnp.asarray(rng.standard_normal(shape_b, np.float32))


def gflops(m: int, k: int, n: int, seconds: float) -> str:
  return f"{2 * m * k * n / seconds / 1e9:.1f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--bf16", action="store_true", help="also bf16 x bf16 -> f32 products and the training forms")
  args = parser.parse_args()
  print("| m x k x n | float32 GFLOP/s |" + (" bf16 -> f32 GFLOP/s |" if args.bf16 else ""))
  for m, k, n in [(2048, 2048, 2048), (648, 128, 256), (81, 128, 256), (81, 128, 768), (2592, 128, 384)]:
    a, b = operands((m, k), (k, n))
    row = f"| {m} x {k} x {n} | {gflops(m, k, n, best_seconds(lambda a, b: a @ b, a, b))} |"
    if args.bf16:
      row += f" {gflops(m, k, n, best_seconds(lambda a, b: matmul.bf16_dot(a, b), a, b))} |"
    print(row, flush=True)
  if args.bf16:
    t, k, n = 2592, 128, 384  # tokens x hidden x (q + k + v) of the Sudoku training step
    x, w = operands((t, k), (k, n))
    g, _ = operands((t, n), (1, 1), seed=1)
    dot = lambda a, b, dims, **kw: jax.lax.dot_general(a, b, dims, **kw)  # noqa: E731
    forms = {
        "forward x W": ((x, w), lambda x, w: dot(x, w, NN), lambda x, w: matmul.bf16_dot(x, w)),
        "input gradient g W^T": ((g, w), lambda g, w: dot(g, w, NT), lambda g, w: matmul.bf16_dot(g, w, True)),
        "weight gradient x^T g, plain dot": ((x, g), lambda x, g: dot(x, g, TN),
                                             lambda x, g: dot(x.astype(BF16), g.astype(BF16), TN,
                                                              preferred_element_type=jnp.float32)),
        "weight gradient x^T g, row_major_transpose": ((x, g), lambda x, g: dot(x, g, TN), matmul.bf16_dot_tn),
    }
    print(f"\ntraining forms at {t} x {k} x {n} (ms, best of 20)\n| form | float32 ms | bf16 -> f32 ms | speed-up |")
    for name, (xs, f32, b16) in forms.items():
      s32, s16 = best_seconds(f32, *xs), best_seconds(b16, *xs)
      print(f"| {name} | {s32 * 1e3:.3f} | {s16 * 1e3:.3f} | {s32 / s16:.2f}x |", flush=True)
  import torch

  a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
  for dtype in (torch.float32, torch.bfloat16) if args.bf16 else (torch.float32,):
    x, y = a.to(dtype), b.to(dtype)
    times = []
    for _ in range(5):
      start = time.perf_counter()
      x @ y
      times.append(time.perf_counter() - start)
    print(f"torch 2048^3 {dtype}: {2 * 2048 ** 3 / min(times) / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
  main()
