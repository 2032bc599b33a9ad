"""The layers of the Gemma 4 vision encoder: projections, 2-D rotary embedding, attention, MLP, encoder layer.

Numerics follow transformers 5.23.0 `models/gemma4/modeling_gemma4.py` (`Gemma4Vision*`): RMSNorms in fp32 with a
plain `weight`, q/k normed per head (with a scale) and v normed without one, attention scores unscaled (the norms
set their size), softmax in fp32, every patch attending to every non-padding patch of its image, and the head
dimension split in two halves rotated by the patch's x and y position.

The projections are `ClippableLinear`s, not `nnx.Linear`: QLoRA's quantization walks the `nnx.Linear` modules of the
text model only, so the tower stays dense. LoRA can target them (`lora.adapters.LoRAClippableLinear`, only when a
`target_modules` entry names `vision_tower` / `embed_vision`): the update is added inside the clipping, as peft does
when it wraps transformers' inner `nn.Linear` (`...q_proj.linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.model import layers
from hackable_diffusion.model.vision_config import VisionConfig

Array = jax.Array


class ClippableLinear(nnx.Module):
  """`x @ kernel` (`kernel [in, out]`), with the input and output clamped to saved scalar bounds when `clipped`
  (transformers' `Gemma4ClippableLinear`; its bounds default to +-inf)."""

  def __init__(self, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, clipped: bool, rngs: nnx.Rngs,
               dtype, param_dtype, std: float):
    self.dtype = dtype
    self.in_features, self.out_features = d_in, d_out
    self.kernel = layers.param(rngs, nnx.initializers.normal(std), (d_in, d_out), param_dtype, axes)
    self.clipped = clipped
    if clipped:
      inf = jnp.asarray(jnp.inf, jnp.float32)
      self.input_min, self.input_max = layers.Buffer(-inf), layers.Buffer(inf)
      self.output_min, self.output_max = layers.Buffer(-inf), layers.Buffer(inf)

  def __call__(self, x: Array) -> Array:
    """x [..., in] -> [..., out] in the compute dtype."""
    x = x.astype(self.dtype)
    if self.clipped:
      x = jnp.clip(x, self.input_min[...].astype(x.dtype), self.input_max[...].astype(x.dtype))
    y = self.project(x)
    if self.clipped:
      y = jnp.clip(y, self.output_min[...].astype(y.dtype), self.output_max[...].astype(y.dtype))
    return y

  def project(self, x: Array) -> Array:
    """The linear part, between the two clips: x [..., in] (compute dtype) -> `x @ kernel` [..., out] (a LoRA
    subclass adds its update here, i.e. inside the clipping)."""
    return (layers.tokens_2d(x) @ self.kernel[...].astype(self.dtype)).reshape(*x.shape[:-1], -1)


def axial_cos_sin(positions: Array, config: VisionConfig, dtype) -> tuple[Array, Array]:
  """positions [N, L, 2] int (x, y; -1 on padding) -> cos, sin [N, L, head_dim]: the first half of each head
  rotates by x, the second by y, each half with `head_dim / 4` frequencies `theta ** (-4i / head_dim)` repeated
  twice (rotate-half layout within the half)."""
  half = config.head_dim // 2
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [D/4]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, L, 2, D/4]
  fx, fy = freqs[..., 0, :], freqs[..., 1, :]
  emb = jnp.concatenate([fx, fx, fy, fy], axis=-1)  # [N, L, D]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_axial_rope(x: Array, cos: Array, sin: Array) -> Array:
  """x [N, L, heads, D]; cos/sin [N, L, D]: rotate-half RoPE on each half of the head dimension separately."""
  half = x.shape[-1] // 2
  parts = [layers.apply_rope(x[..., s], cos[..., s], sin[..., s]) for s in (slice(0, half), slice(half, None))]
  return jnp.concatenate(parts, axis=-1)


class VisionAttention(nnx.Module):
  """Bidirectional multi-head attention over the patches of each image (grouped-query when kv heads < heads)."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    h, d, std = config.hidden_size, config.head_dim, config.initializer_range
    self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
    kw = dict(clipped=config.use_clipped_linears, rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)
    self.q_proj = ClippableLinear(h, self.heads * d, ("embed", "heads"), **kw)
    self.k_proj = ClippableLinear(h, self.kv_heads * d, ("embed", "kv"), **kw)
    self.v_proj = ClippableLinear(h, self.kv_heads * d, ("embed", "kv"), **kw)
    self.o_proj = ClippableLinear(self.heads * d, h, ("heads", "embed"), **kw)
    self.q_norm = layers.RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype, axis_name=None)
    self.k_norm = layers.RMSNorm(d, eps=config.rms_norm_eps, param_dtype=param_dtype, axis_name=None)
    self.v_norm = layers.RMSNorm(d, eps=config.rms_norm_eps, with_scale=False)

  def __call__(self, x: Array, cos: Array, sin: Array, valid: Array) -> Array:
    """x [N, L, H]; cos/sin [N, L, D]; valid [N, L] bool (False on padding patches, never attended to)."""
    n, l, _ = x.shape
    q = apply_axial_rope(self.q_norm(self.q_proj(x).reshape(n, l, self.heads, self.head_dim)), cos, sin)
    k = apply_axial_rope(self.k_norm(self.k_proj(x).reshape(n, l, self.kv_heads, self.head_dim)), cos, sin)
    v = self.v_norm(self.v_proj(x).reshape(n, l, self.kv_heads, self.head_dim))
    group = self.heads // self.kv_heads
    q = q.reshape(n, l, self.kv_heads, group, self.head_dim)
    scores = jnp.einsum("nqkgd,nskd->nkgqs", q, k).astype(jnp.float32)  # [N, KV, G, L, L]
    scores = jnp.where(valid[:, None, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("nkgqs,nskd->nqkgd", probs, v).reshape(n, l, self.heads * self.head_dim)
    return self.o_proj(out)


class VisionMLP(nnx.Module):
  """Gated GELU-tanh MLP: `down(gelu_tanh(gate x) * up x)`."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    h, i = config.hidden_size, config.intermediate_size
    kw = dict(clipped=config.use_clipped_linears, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
              std=config.initializer_range)
    self.gate_proj = ClippableLinear(h, i, ("embed", "mlp"), **kw)
    self.up_proj = ClippableLinear(h, i, ("embed", "mlp"), **kw)
    self.down_proj = ClippableLinear(i, h, ("mlp", "embed"), **kw)

  def __call__(self, x: Array) -> Array:
    return self.down_proj(layers.gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nnx.Module):
  """`h = x + post_attention_norm(attn(input_norm(x)))`; `out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))`."""

  def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
    self.self_attn = VisionAttention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.mlp = VisionMLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    norm = lambda: layers.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)  # noqa: E731
    self.input_layernorm = norm()
    self.post_attention_layernorm = norm()
    self.pre_feedforward_layernorm = norm()
    self.post_feedforward_layernorm = norm()

  def __call__(self, x: Array, cos: Array, sin: Array, valid: Array) -> Array:
    h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, valid))
    return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


__all__ = ["ClippableLinear", "VisionAttention", "VisionEncoderLayer", "VisionMLP", "apply_axial_rope",
           "axial_cos_sin"]
