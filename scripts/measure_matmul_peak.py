"""fp32 matmul throughput of XLA (and torch) on this CPU, for the ceilings quoted in docs/benchmarks.md.

  python scripts/measure_matmul_peak.py

Shapes: a large square product (the machine's peak) and the products of the Sudoku-size decoder step at batch 8
(648 x 128 x 256) and batch 1 (81 x 128 x 256, 81 x 128 x 768). Best of 20 calls, compile excluded.
"""
import time, jax, jax.numpy as jnp, numpy as np
def bench(m,k,n,reps=20):
  a=jnp.asarray(np.random.randn(m,k).astype(np.float32)); b=jnp.asarray(np.random.randn(k,n).astype(np.float32))
  f=jax.jit(lambda a,b: a@b); jax.block_until_ready(f(a,b)); ts=[]
  for _ in range(reps):
    t=time.perf_counter(); jax.block_until_ready(f(a,b)); ts.append(time.perf_counter()-t)
  return 2*m*k*n/min(ts)/1e9
for s in [(2048,2048,2048),(648,128,256),(81,128,256),(81,128,768)]:
  print(s, round(bench(*s),1), "GFLOP/s")
import torch
a=torch.randn(2048,2048); b=torch.randn(2048,2048); ts=[]
for _ in range(5):
  t=time.perf_counter(); a@b; ts.append(time.perf_counter()-t)
print("torch 2048^3", round(2*2048**3/min(ts)/1e9,1))
