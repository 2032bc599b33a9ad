"""Building blocks of the DiffusionGemma backbone: RMSNorm, RoPE, dense MLP, router and experts.

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

from hackable_diffusion.model.config import RopeConfig

Array = jax.Array


class Buffer(nnx.Variable):
  """A saved, non-trainable tensor (HF buffers such as `layer_scalar`)."""


def param(rngs: nnx.Rngs, init, shape: Sequence[int], dtype, axes: tuple[str | None, ...]) -> nnx.Param:
  """A parameter with logical-axis metadata (`out_sharding`), created without eager sharding."""
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=axes)


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, dtype, param_dtype,
           std: float) -> nnx.Linear:
  """A bias-free projection `x @ kernel` with `kernel: [d_in, d_out]` (HF stores the transpose)."""
  return nnx.Linear(
      d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
      kernel_init=nnx.with_partitioning(nnx.initializers.normal(std), axes), rngs=rngs,
  )


def gelu_tanh(x: Array) -> Array:
  return jax.nn.gelu(x, approximate=True)


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


# ---- feed-forward -----------------------------------------------------------------------------------------------
class MLP(nnx.Module):
  """Gated GELU-tanh MLP: `down(gelu_tanh(gate x) * up x)`."""

  def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float):
    kw = dict(dtype=dtype, param_dtype=param_dtype, std=std)
    self.gate_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.up_proj = linear(rngs, hidden, intermediate, ("embed", "mlp"), **kw)
    self.down_proj = linear(rngs, intermediate, hidden, ("mlp", "embed"), **kw)

  def __call__(self, x: Array) -> Array:
    return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
  """Top-k softmax router. Reads the un-normed residual stream.

  `h = rmsnorm_noscale(x) * scale * hidden**-0.5`; `p = softmax(proj h)` in fp32; top-k, renormalised to sum 1,
  times `per_expert_scale[idx]`.
  """

  def __init__(self, hidden: int, num_experts: int, top_k: int, *, eps: float, rngs: nnx.Rngs, dtype, param_dtype,
               std: float):
    self.eps, self.top_k, self.hidden = eps, top_k, hidden
    self.proj = linear(rngs, hidden, num_experts, ("embed", None), dtype=dtype, param_dtype=param_dtype, std=std)
    self.scale = nnx.Param(jnp.ones((hidden,), param_dtype), out_sharding=("embed",))
    self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), param_dtype), out_sharding=(None,))

  def __call__(self, x: Array) -> tuple[Array, Array]:
    """x [T, H] -> (weights [T, K] float32, indices [T, K] int32)."""
    h = rms_normalize(x, self.eps).astype(x.dtype)
    h = h * self.scale[...].astype(x.dtype) * jnp.asarray(self.hidden ** -0.5, x.dtype)
    probs = jax.nn.softmax(self.proj(h).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, self.top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * self.per_expert_scale[...].astype(jnp.float32)[idx]
    return weights, idx.astype(jnp.int32)


class Experts(nnx.Module):
  """Per-expert gated MLPs stored as 3-D tensors in the HF layout.

  `gate_up_proj [E, 2I, H]` (gate rows first, then up), `down_proj [E, H, I]`.
  """

  def __init__(self, hidden: int, intermediate: int, num_experts: int, *, rngs: nnx.Rngs, dtype, param_dtype,
               std: float, impl: str):
    init = nnx.initializers.normal(std)
    self.gate_up_proj = param(rngs, init, (num_experts, 2 * intermediate, hidden), param_dtype,
                              ("expert", "mlp", "embed"))
    self.down_proj = param(rngs, init, (num_experts, hidden, intermediate), param_dtype, ("expert", "embed", "mlp"))
    self.dtype, self.impl, self.intermediate = dtype, impl, intermediate

  def __call__(self, x: Array, weights: Array, idx: Array) -> Array:
    """x [T, H], weights/idx [T, K] -> [T, H]."""
    if self.impl == "ragged":
      return self._ragged(x, weights, idx)
    return self._dense(x, weights, idx)

  def _dense(self, x: Array, weights: Array, idx: Array) -> Array:
    num_experts = self.gate_up_proj.shape[0]
    gate_up = self.gate_up_proj[...].astype(self.dtype)
    down = self.down_proj[...].astype(self.dtype)
    # combine[T, E]: routing weight of each expert for each token (0 when not selected)
    combine = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=1)
    h = jnp.einsum("th,eih->eti", x, gate_up)  # [E, T, 2I]
    h = gelu_tanh(h[..., : self.intermediate]) * h[..., self.intermediate:]
    y = jnp.einsum("eti,ehi->eth", h, down)  # [E, T, H]
    return jnp.einsum("eth,te->th", y.astype(jnp.float32), combine).astype(x.dtype)

  def _ragged(self, x: Array, weights: Array, idx: Array) -> Array:
    tokens, top_k = idx.shape
    num_experts = self.gate_up_proj.shape[0]
    flat_expert = idx.reshape(-1)  # [T*K]
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    xs = x[token_of]  # [T*K, H] sorted by expert
    gate_up = jnp.swapaxes(self.gate_up_proj[...].astype(self.dtype), 1, 2)  # [E, H, 2I]
    h = jax.lax.ragged_dot(xs, gate_up, group_sizes)
    h = gelu_tanh(h[:, : self.intermediate]) * h[:, self.intermediate:]
    down = jnp.swapaxes(self.down_proj[...].astype(self.dtype), 1, 2)  # [E, I, H]
    y = jax.lax.ragged_dot(h, down, group_sizes).astype(jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)
