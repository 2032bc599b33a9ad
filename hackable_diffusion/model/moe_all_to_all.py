"""Expert parallelism by all-to-all dispatch: each token's K assignments travel to the devices that hold their
experts and their outputs travel back (`jax.lax.ragged_all_to_all`, both ways ragged: no capacity, no drops).

Runs inside `jax.shard_map` over the `expert` mesh axis (n devices, E/n experts each), with the tokens split over
that axis. Per device, with T tokens and K experts per token (A = T*K assignments):

  1. sort the A assignments by expert; since a device holds a contiguous range of experts, this also groups them by
     destination device: `send_sizes [n]`, `input_offsets [n]`;
  2. the n x n matrix of send sizes (an all-gather of n integers per device) gives every device where its blocks
     land on the others (`output_offsets`) and what it receives (`recv_sizes`);
  3. one ragged all-to-all sends the assignments' rows (and one more their expert ids) into a buffer of
     n * T * min(K, E/n) rows, the most one device can receive;
  4. the received rows, sorted by local expert, go through the grouped MLP;
  5. the reverse ragged all-to-all brings each output row back to its token's device, where the rows are weighted
     and summed over k in float32.

Bytes moved per device: about 2 * T * K rows (in and out, with the routing's imbalance), against 2 * n * T rows for
the all-gather + reduce-scatter of `moe.expert_parallel_experts`: fewer when n > K. XLA:CPU does not implement
`ragged-all-to-all`; on CPU `ragged_exchange` runs an equivalent program built from all-gathers and scatters, so
the dispatch, the offsets and the gradients are tested on fake CPU devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def exclusive_cumsum(a: Array, axis: int = 0) -> Array:
  """[a0, a1, ...] -> [0, a0, a0 + a1, ...] along `axis`."""
  return jnp.cumsum(a, axis=axis) - a


def ragged_exchange(operand: Array, output: Array, input_offsets: Array, send_sizes: Array, output_offsets: Array,
                    recv_sizes: Array, *, axis: str, native: bool) -> Array:
  """`jax.lax.ragged_all_to_all` over mesh axis `axis` (n devices; the four index arrays [n]). `native=False`: the
  same function from an all-gather of every device's operand and one masked scatter per source device (for
  XLA:CPU, which has no `ragged-all-to-all`; n x the operand's bytes, meant for tests and CPU meshes)."""
  if native:
    output = jax.lax.pcast(output, (axis,), to="varying")  # what each device receives differs
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)
  del recv_sizes  # implied by the senders' sizes
  me = jax.lax.axis_index(axis)
  operands = jax.lax.all_gather(operand, axis)  # [n, A, ...]
  starts, sizes, lands = (jax.lax.all_gather(a, axis)[:, me] for a in (input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(operand.shape[0])  # [A]
  for source in range(operands.shape[0]):  # n is static
    valid = rows < sizes[source]
    src = jnp.minimum(starts[source] + rows, operand.shape[0] - 1)
    dst = jnp.where(valid, lands[source] + rows, output.shape[0])  # out of range: dropped
    output = output.at[dst].set(operands[source][src], mode="drop")
  return output


def all_to_all_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array, *, axis: str,
                       mlp: Callable[[Array, Array, Array, Array], Array], native: bool) -> Array:
  """The expert mixture of this device's tokens, computed by the devices that hold the experts (per device, inside
  `jax.shard_map`). x [T, H], weights/idx [T, K] (global expert ids), gate_up [E_l, 2I, H] / down [E_l, H, I]
  (this device's experts, E = n * E_l) -> float32 [T, H]. `mlp(rows, gate_up, down, group_sizes)`: the grouped
  MLP (`moe.grouped_mlp`: rows grouped by expert; rows past the groups give 0)."""
  tokens, top_k = idx.shape
  num_local = gate_up.shape[0]
  n = jax.lax.axis_size(axis)
  me = jax.lax.axis_index(axis)
  flat = idx.reshape(-1).astype(jnp.int32)  # [A] global expert ids
  order = jnp.argsort(flat, stable=True)  # [A] by expert, hence by destination device
  experts = flat[order]  # [A]
  send_sizes = jnp.bincount(experts // num_local, length=n).astype(jnp.int32)  # [n]
  input_offsets = exclusive_cumsum(send_sizes)
  sizes = jax.lax.all_gather(send_sizes, axis)  # [n source, n destination]
  output_offsets = exclusive_cumsum(sizes, axis=0)[me]  # [n] where my block starts on each destination
  recv_sizes = sizes[:, me]  # [n] from each source
  recv_offsets = exclusive_cumsum(recv_sizes)  # [n] where each source's block starts here
  back_offsets = exclusive_cumsum(sizes, axis=1)[:, me]  # [n] where that block came from on its source
  capacity = n * tokens * min(top_k, num_local)  # the most rows one device can receive

  def there(operand, fill):
    out = jnp.full((capacity,) + operand.shape[1:], fill, operand.dtype)
    return ragged_exchange(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes, axis=axis,
                           native=native)

  rows = there(x[order // top_k], 0)  # [R, H] received rows, by source then expert
  local = there(experts, -1) - me * num_local  # [R] local expert ids; empty rows fall outside [0, E_l)
  key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # empty rows sort last
  by_expert = jnp.argsort(key, stable=True)  # [R]
  group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [E_l]
  ys = mlp(rows[by_expert], gate_up, down, group_sizes)  # [R, H]
  ys = jnp.zeros_like(ys).at[by_expert].set(ys)  # back in received order
  back = jnp.zeros((order.shape[0], ys.shape[-1]), ys.dtype)
  back = ragged_exchange(ys, back, recv_offsets, recv_sizes, back_offsets, send_sizes, axis=axis,
                         native=native)  # [A, H] in this device's sorted order
  w = weights.reshape(-1)[order].astype(jnp.float32)  # [A]
  return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[order // top_k].add(back.astype(jnp.float32) * w[:, None])
