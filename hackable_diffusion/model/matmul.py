"""Matrix products with bfloat16 operands and float32 accumulation (`ModelConfig.matmul_dtype='bfloat16'`).

On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) XLA:CPU runs a `bf16 x bf16 -> f32` dot through
YNNPACK's AMX kernels, 2-5x its float32 dot on this project's CPU (`python scripts/measure_matmul_peak.py
--bf16`; on AVX512-BF16 without AMX, AMD Zen 4, ~1.7x on large products). It does so only when the left operand
contracts its minor (last) axis; a weight gradient `x^T g` contracts the token axis, which is the major axis of both
operands, and XLA then silently computes the dot in float32 on upcast copies (slower than a plain float32 dot). The
transposition XLA would fold into the dot is therefore materialised behind an optimisation barrier
(`row_major_transpose`).

`bf16_matmul` is differentiable with a hand-written backward pass: the output gradient is rounded to bfloat16 too,
so the forward product, the input gradient and the weight gradient are all `bf16 x bf16 -> f32` dots (the usual
bf16 mixed-precision recipe; the parameters, the optimizer and everything outside the products stay float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

MATMUL_DTYPES = ("auto", "bfloat16")  # 'auto': the compute dtype's own product (float32 models: float32)
_BF16 = jnp.bfloat16
_NN = (((1,), (0,)), ((), ()))  # [M, K] x [K, N]
_NT = (((1,), (1,)), ((), ()))  # [M, K] x [N, K]


def row_major_transpose(x: Array) -> Array:
  """x [M, K] -> x^T [K, M] as a physical copy the next dot reads row-major.

  A plain transpose reaches XLA as a layout change of its operand, which XLA:CPU's bf16 dot cannot read (it then
  upcasts the dot to float32); reshaping to `[K, M, 1]` behind an optimisation barrier forces the copy.
  """
  m, k = x.shape
  return jax.lax.optimization_barrier(x.T.reshape(k, m, 1)).reshape(k, m)


def bf16_dot(a: Array, b: Array, transpose_b: bool = False) -> Array:
  """a [M, K] x (b [K, N] | b [N, K] when `transpose_b`) -> [M, N] float32 from bfloat16-rounded operands.

  Not differentiable on its own terms (use `bf16_matmul`); for hand-written backward passes."""
  return jax.lax.dot_general(a.astype(_BF16), b.astype(_BF16), _NT if transpose_b else _NN,
                             preferred_element_type=jnp.float32)


def bf16_dot_tn(a: Array, b: Array) -> Array:
  """a [M, K], b [M, N] -> a^T b [K, N] float32 (a weight gradient), bfloat16 operands read row-major."""
  return bf16_dot(row_major_transpose(a.astype(_BF16)), b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bf16_matmul(a: Array, b: Array, transpose_b: bool = False) -> Array:
  """a [M, K] x (b [K, N] | b [N, K]^T) -> [M, N] float32; operands and output gradient rounded to bfloat16,
  every product accumulated in float32. Gradients come back in the operands' dtypes."""
  return bf16_dot(a, b, transpose_b)


def _bf16_matmul_fwd(a, b, transpose_b):
  a16, b16 = a.astype(_BF16), b.astype(_BF16)
  # zero-size arrays carry the operands' dtypes to the backward pass
  return bf16_dot(a16, b16, transpose_b), (a16, b16, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _bf16_matmul_bwd(transpose_b, residuals, g):
  a16, b16, a_dtype, b_dtype = residuals
  g16 = g.astype(_BF16)  # [M, N]
  if transpose_b:  # out = a b^T, b [N, K]: da = g b, db = g^T a
    da, db = bf16_dot(g16, b16), bf16_dot_tn(g16, a16)
  else:  # out = a b, b [K, N]: da = g b^T, db = a^T g
    da, db = bf16_dot(g16, b16, transpose_b=True), bf16_dot_tn(a16, g16)
  return da.astype(a_dtype.dtype), db.astype(b_dtype.dtype)


bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def bf16_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None, preferred_element_type=None,
                     out_sharding=None) -> Array:
  """A `jax.lax.dot_general` for `nnx.Linear(dot_general=...)`: lhs [..., K] x kernel [K, N] -> [..., N] in
  lhs's dtype, through `bf16_matmul` (`precision` / `preferred_element_type` are ignored: the products are
  bfloat16 with float32 accumulation by construction)."""
  del precision, preferred_element_type
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or lhs_batch or rhs_batch:
    raise ValueError(f"bf16_dot_general: only x[..., K] @ kernel[K, N]; got dimension numbers {dimension_numbers}")
  if out_sharding is not None:
    raise ValueError("bf16_dot_general: out_sharding is not supported")
  out = bf16_matmul(lhs.reshape(-1, lhs.shape[-1]), rhs)  # [tokens, N]
  return out.reshape(*lhs.shape[:-1], rhs.shape[-1]).astype(lhs.dtype)


