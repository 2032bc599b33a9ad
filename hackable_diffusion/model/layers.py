"""Building blocks of the DiffusionGemma backbone: RMSNorm, RoPE, the dense MLP (the router and experts: `moe.py`).

Numerics follow transformers' `modeling_diffusion_gemma.py` (Gemma-4 text blocks): norms in fp32 with a plain
`weight` (initialised to ones, not `1 + weight`), GELU-tanh gated MLPs, a softmax router with renormalised
top-k weights times a per-expert scale. Parameters carry logical axis names (`embed`, `heads`, `kv`, `mlp`,
`vocab`, `expert`) that `hackable_diffusion.sharding` maps to mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.model import matmul
from hackable_diffusion.model.config import RopeConfig
from hackable_diffusion.sharding import vocab

Array = jax.Array


class Buffer(nnx.Variable):
  """A saved, non-trainable tensor (HF buffers such as `layer_scalar`)."""


def param(rngs: nnx.Rngs, init, shape: Sequence[int], dtype, axes: tuple[str | None, ...]) -> nnx.Param:
  """A parameter with logical-axis metadata (`out_sharding`), created without eager sharding."""
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=axes)


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, dtype, param_dtype,
           std: float, matmul_dtype: str = "auto") -> nnx.Linear:
  """A bias-free projection `x @ kernel` with `kernel: [d_in, d_out]` (HF stores the transpose).

  `matmul_dtype='bfloat16'`: the product (and its gradients) with bfloat16 operands, accumulated in float32
  (`model/matmul.py`)."""
  extra = {"dot_general": matmul.bf16_dot_general} if matmul_dtype == "bfloat16" else {}
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
      kernel_init=nnx.with_partitioning(nnx.initializers.normal(std), axes), rngs=rngs, **extra,
  )


def embed_lookup(table: Array, ids: Array) -> Array:
  """table [V, H] (logical axes `vocab`, `embed`), ids [B, ...] -> `table[ids]` [B, ..., H]. Under a mesh the
  lookup runs on each device's vocabulary shard and never replicates the table (`sharding.vocab`)."""
  return vocab.embed_lookup(table, ids)


def gelu_tanh(x: Array) -> Array:
  return jax.nn.gelu(x, approximate=True)


def gated_gelu(pre: Array) -> Array:
  """pre [..., 2I] (gate, then up) -> `gelu_tanh(gate) * up` [..., I]: the expert MLPs' activation."""
  half = pre.shape[-1] // 2
  return gelu_tanh(pre[..., :half]) * pre[..., half:]


def rms_normalize(x: Array, eps: float) -> Array:
  """`x * (mean(x^2) + eps) ** -0.5` in fp32 (transformers uses `pow(-0.5)`, not rsqrt)."""
  x32 = x.astype(jnp.float32)
  return x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis; `with_scale=False` has no weight. Output in the input dtype."""

  def __init__(self, dim: int, *, eps: float, with_scale: bool = True, param_dtype=jnp.float32,
               axis_name: str | None = "embed"):
    self.eps = eps
    self.with_scale = with_scale
    if with_scale:
      self.weight = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis_name,))

  def __call__(self, x: Array) -> Array:
    y = rms_normalize(x, self.eps)
    if self.with_scale:
      y = y * self.weight[...].astype(jnp.float32)
    return y.astype(x.dtype)


# ---- rotary embeddings -------------------------------------------------------------------------------------------
def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Array:
  """Inverse frequencies `[head_dim // 2]` (zeros where a `proportional` rope leaves dimensions unrotated)."""
  if rope.rope_type == "default":
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv = 1.0 / (rope.theta ** exponents)
  else:  # proportional
    rotated = int(rope.partial_rotary_factor * head_dim // 2)
    exponents = jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim
    inv = jnp.concatenate([1.0 / (rope.theta ** exponents), jnp.zeros((head_dim // 2 - rotated,), jnp.float32)])
  return inv / rope.factor


def rope_cos_sin(positions: Array, inv_freq: Array, dtype) -> tuple[Array, Array]:
  """positions [B, L] int -> cos, sin [B, L, head_dim] (rotate-half layout: frequencies repeated twice)."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x [B, L, N, D]; cos/sin [B, L, D]. Rotate-half convention (not interleaved)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def tokens_2d(x: Array) -> Array:
  """x [..., D] -> [tokens, D].

  Projections run on 2-D token matrices: the weight gradient of a projection applied to a 3-D `[B, L, D]` input
  contracts two axes, which XLA:CPU lowers with a separate transposing copy of the activation gradient (several
  times slower than the 2-D form, whose transposition the matmul absorbs).
  """
  return x.reshape(-1, x.shape[-1])


# ---- feed-forward -----------------------------------------------------------------------------------------------
class MLP(nnx.Module):
  """Gated GELU-tanh MLP: `down(gelu_tanh(gate x) * up x)`."""

  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float,
               matmul_dtype: str = "auto"):
    kw = dict(dtype=dtype, param_dtype=param_dtype, std=std, matmul_dtype=matmul_dtype)
    self.gate_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.up_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.down_proj = linear(rngs, intermediate, hidden, ("mlp", "embed"), **kw)

  def __call__(self, x: Array) -> Array:
    """x [..., H] -> [..., H] (computed on the flattened `[tokens, H]` matrix, see `tokens_2d`)."""
    flat = tokens_2d(x)
    return self.down_proj(gelu_tanh(self.gate_proj(flat)) * self.up_proj(flat)).reshape(x.shape)
