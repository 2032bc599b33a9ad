"""A layer scan whose backward pass adds every layer's weight gradient into one buffer, shared across passes.

DiffusionGemma runs the same stacked layers twice in a training step: the encoder over the prompt, then the decoder
over the canvas. Differentiated by autodiff, each scan's backward pass writes its own stacked gradient of the layers
(the transpose of a scan stacks per-iteration cotangents), and the two are summed only after both exist: the
26B-A4B's stacked fp32 layer gradients are 10.6 GiB per device on fsdp=8, and two of them are alive together at the
peak of a full fine-tuning step (docs/scaling.md).

`scan_layers` runs the layers forward like `jax.lax.scan` and returns the stacked weights unchanged as a third
output: the *link*. A later pass that reads its weights from the link hands its gradient back through the link's
cotangent, and this pass's backward scan starts from it and adds each layer's gradient in place
(`dynamic_update_slice` on a loop carry), so a chain of passes keeps one gradient buffer. The backward pass
recomputes each layer from its saved input (the 'nothing_saveable' policy): the forward keeps only the layers'
input carries. A pass whose outputs carry no gradient (a stopped self-conditioning pass) hands the link's
cotangent through without recomputing anything. Only the weights being differentiated get a buffer (a LoRA run's
frozen base has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# layer(j, weights of one layer of block j, carry, inputs of that layer) -> (carry, outputs)
Layer = Callable[[int, Any, Any, Any], tuple[Any, Any]]


def _is_zero(x: Any) -> bool:
  return isinstance(x, SymbolicZero)


def _zeros(x: Any) -> jax.Array:
  return jnp.zeros(x.aval.shape, x.aval.dtype) if _is_zero(x) else x


def _differentiable(p: Any) -> bool:
  return p.perturbed and jnp.issubdtype(jnp.result_type(p.value), jnp.inexact)


def scan_layers(layer: Layer, weights: Sequence[Any], x: Any, per_block: Sequence[Any]
                ) -> tuple[Any, list[Any], list[Any]]:
  """Runs `x, out = layer(j, w, x, inputs)` for blocks j = 0..p-1 per scan iteration over `[groups]`.

  weights: p pytrees whose arrays stack the `groups` layers of block j on a leading axis; per_block: p pytrees of
  per-layer inputs stacked the same way. Returns `(x, outs, link)`: the final carry, the outputs stacked per block,
  and `weights` itself (identical values; read a later pass's weights from it to share the gradient buffer).
  """
  p = len(weights)
  if len(per_block) != p:
    raise ValueError(f"scan_layers: {len(per_block)} per-block inputs for {p} blocks of weights")
  w_leaves, w_tree = jax.tree.flatten(list(weights))
  i_leaves, i_tree = jax.tree.flatten(list(per_block))
  w_pos = [_block_positions(w_tree, j) for j in range(p)]  # flat positions of block j's leaves
  i_pos = [_block_positions(i_tree, j) for j in range(p)]

  def forward(w_flat, carry, i_flat, keep_inputs: bool):
    def body(c, xs):
      w_group, i_group = jax.tree.unflatten(w_tree, xs[0]), jax.tree.unflatten(i_tree, xs[1])
      outs, saved = [], []
      for j in range(p):
        saved.append(c)
        c, out = layer(j, w_group[j], c, i_group[j])
        outs.append(out)
      return c, (outs, saved if keep_inputs else None)
    return jax.lax.scan(body, carry, (list(w_flat), list(i_flat)))

  def layer_vjp(j, w_group, i_group, w_diff, i_diff, start, dc, ct_out):
    """(d weights, d carry, d inputs) of layer j of a group, recomputed from its input `start`; only the
    differentiated weights / inputs (`*_diff`: flat positions) get cotangents."""
    def of(wd, c, idd):
      w = dict(zip(w_pos[j], w_group[j])) | dict(zip(w_diff, wd))
      i = dict(zip(i_pos[j], i_group[j])) | dict(zip(i_diff, idd))
      return layer(j, jax.tree.unflatten(w_tree.children()[j], [w[k] for k in w_pos[j]]), c,
                   jax.tree.unflatten(i_tree.children()[j], [i[k] for k in i_pos[j]]))

    wd = [dict(zip(w_pos[j], w_group[j]))[k] for k in w_diff]
    idd = [dict(zip(i_pos[j], i_group[j]))[k] for k in i_diff]
    return jax.vjp(of, wd, start, idd)[1]((dc, ct_out))

  @jax.custom_vjp
  def run(w_flat, carry, i_flat):
    carry, (outs, _) = forward(w_flat, carry, i_flat, False)
    return carry, outs, list(w_flat)

  def fwd(w_flat, carry, i_flat):
    is_primal = lambda v: hasattr(v, "perturbed")  # noqa: E731
    c_val = jax.tree.map(lambda v: v.value, carry, is_leaf=is_primal)
    out, (outs, saved) = forward([v.value for v in w_flat], c_val, [v.value for v in i_flat], True)
    flags = (tuple(_differentiable(v) for v in w_flat), tuple(_differentiable(v) for v in i_flat),
             any(v.perturbed for v in jax.tree.leaves(carry, is_leaf=is_primal)))
    w_vals = [v.value for v in w_flat]
    return (out, outs, w_vals), (w_vals, [v.value for v in i_flat], saved, flags)

  def bwd(res, cts):
    w_vals, i_vals, saved, (w_diff, i_diff, c_diff) = res
    ct_carry, ct_outs, ct_link = cts
    if all(_is_zero(c) for c in jax.tree.leaves((ct_carry, ct_outs), is_leaf=_is_zero)):
      # nothing downstream depends on this pass: hand the link's cotangent through
      return [None if _is_zero(c) else c for c in ct_link], None, [None] * len(i_vals)
    dw_idx = [k for k, d in enumerate(w_diff) if d]
    di_idx = [k for k, d in enumerate(i_diff) if d]

    def body(state, xs):
      dc, acc = state
      g, w_flat, i_flat, saved_g, ct_g = xs
      w_group = [[w_flat[k] for k in w_pos[j]] for j in range(p)]
      i_group = [[i_flat[k] for k in i_pos[j]] for j in range(p)]
      d_w, d_i = {}, {}
      for j in reversed(range(p)):
        # the recomputation starts from the input offset by 0 * (an element of the cotangent): XLA can then
        # neither run it before the later layer's backward (keeping every layer's residuals at once) nor merge it
        # with the forward pass (see `hackable_diffusion.model.remat`)
        tie = jnp.zeros((), jnp.float32) * jax.tree.leaves(dc)[0].reshape(-1)[0].astype(jnp.float32)
        start = jax.tree.map(lambda v: v + tie.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.inexact) else v,
                             saved_g[j])
        w_diff_j = [k for k in w_pos[j] if w_diff[k]]
        i_diff_j = [k for k in i_pos[j] if i_diff[k]]
        d_wj, dc, d_ij = layer_vjp(j, w_group, i_group, w_diff_j, i_diff_j, start, dc, ct_g[j])
        d_w.update(zip(w_diff_j, d_wj))
        d_i.update(zip(i_diff_j, d_ij))
      # this group's gradient added into its slice of the stacked buffer, in place
      acc = [jax.lax.dynamic_update_index_in_dim(a, jax.lax.dynamic_index_in_dim(a, g, 0, False)
                                                 + d_w[k].astype(a.dtype), g, 0) for a, k in zip(acc, dw_idx)]
      return (dc, acc), [d_i[k] for k in di_idx]

    groups = jax.tree.leaves((w_vals, i_vals))[0].shape[0]
    start = (jax.tree.map(_zeros, ct_carry, is_leaf=_is_zero), [_zeros(ct_link[k]) for k in dw_idx])
    xs = (jnp.arange(groups), list(w_vals), list(i_vals), saved, jax.tree.map(_zeros, ct_outs, is_leaf=_is_zero))
    (dc, acc), d_inputs = jax.lax.scan(body, start, xs, reverse=True)
    dw_out, di_out = [None] * len(w_vals), [None] * len(i_vals)
    for k, a in zip(dw_idx, acc):
      dw_out[k] = a
    for k, d in zip(di_idx, d_inputs):
      di_out[k] = d
    return dw_out, (dc if c_diff else None), di_out

  run.defvjp(fwd, bwd, symbolic_zeros=True)
  carry, outs, link = run(list(w_leaves), x, list(i_leaves))
  return carry, outs, jax.tree.unflatten(w_tree, link)


def _block_positions(tree: Any, j: int) -> list[int]:
  """The flat leaf positions of block `j` in the flattening of a list of pytrees (`tree` its treedef)."""
  sizes = [child.num_leaves for child in tree.children()]
  return list(range(sum(sizes[:j]), sum(sizes[:j + 1])))


__all__ = ["Layer", "scan_layers"]
