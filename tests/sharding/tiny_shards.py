"""Hand-written per-device element counts of `get_preset('tiny')` (independent of the sharding helpers)."""

from __future__ import annotations


def _d(n: int, k: int) -> int:
  """A dimension of size `n` split `k` ways: `n // k` when it divides, else whole (replicated)."""
  return n // k if n % k == 0 else n


def tiny_param_elements(fsdp: int = 1, tensor: int = 1, expert: int = 1) -> int:
  """Elements of every `nnx.Param` of `get_preset('tiny')` held by one device.

  embed -> fsdp; heads, kv, mlp, vocab -> tensor; expert -> expert; a dimension that does not divide is whole.
  tiny: vocab 64, hidden 32, mlp 64, 2 layers (sliding: 4 heads x 8, 2 kv heads; full: 4 heads x 16, 1 kv head,
  no v_proj), 4 experts x 16.
  """
  v, h, i, e, im = 64, 32, 64, 4, 16
  d = _d
  hf = d(h, fsdp)
  mlp = 2 * hf * d(i, tensor) + d(i, tensor) * hf  # gate, up [H, I]; down [I, H]
  router = hf * e + hf + e  # proj [H, E] (E unsharded), scale [H], per_expert_scale [E]
  experts = d(e, expert) * d(2 * im, tensor) * hf + d(e, expert) * hf * d(im, tensor)
  per_layer = mlp + router + experts + 7 * hf  # + 7 RMSNorm weights [H]
  sliding = 2 * hf * d(4 * 8, tensor) + 2 * hf * d(2 * 8, tensor) + 2 * 8  # q, o; k, v; q/k norms [head_dim]
  full = 2 * hf * d(4 * 16, tensor) + hf * d(1 * 16, tensor) + 2 * 16  # q, o; k (no v)
  embed = d(v, tensor) * hf
  final_norm = hf
  self_conditioning = hf + mlp  # pre_norm [H] + MLP
  return embed + sliding + full + 2 * per_layer + final_norm + self_conditioning


TINY_BUFFERS = 2 * 2  # layer_scalar + encoder_layer_scalar per layer, [1] each, replicated


def tiny_lora_elements(rank: int, fsdp: int = 1, tensor: int = 1) -> int:
  """A [d_in, r] + B [r, d_out] for q/k/v/o and the dense MLP of both layers, held by one device.

  A keeps the kernel's input axis, B its output axis: `embed` -> fsdp; `heads`, `kv`, `mlp` -> tensor.
  """
  h, i = 32, 64
  e_, t_ = (lambda n: _d(n, fsdp)), (lambda n: _d(n, tensor))
  mlp = 2 * (e_(h) + t_(i)) + (t_(i) + e_(h))  # gate, up [H, I]; down [I, H]
  sliding = (e_(h) + t_(32)) + 2 * (e_(h) + t_(16)) + (t_(32) + e_(h))  # q; k, v; o
  full = (e_(h) + t_(64)) + (e_(h) + t_(16)) + (t_(64) + e_(h))  # q; k; o (no v_proj)
  return rank * (sliding + full + 2 * mlp)
