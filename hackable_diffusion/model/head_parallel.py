"""The tiled cross-entropy over a mesh, split by vocabulary: no device ever holds the whole embedding or its gradient.

Left to XLA's partitioner, `head.cross_entropy` on a batch-sharded mesh gathers the whole embedding `E [V, H]` on
every device (FSDP splits it along H), and its written backward pass forms, per tile, the whole fp32 gradient
`[V, H]` of the device's tokens and all-reduces it: at the released vocabulary that is 2.75 GiB per buffer, the
peak of a full fine-tuning step (docs/scaling.md), and an all-reduce of the whole embedding per tile.

Here (Megatron's vocabulary-parallel cross-entropy) the roles are swapped inside `jax.shard_map`: every device
gathers the hidden states of all the batch's tokens (`[B, L, H]`: at the 26B-A4B's batch of 64 x 256, 184 MiB
fp32) and keeps its own slice of the vocabulary, `E[V/n, H]` (n = all devices; one all-to-all re-splits the
embedding). Each device computes the logits of its slice for every token; the log-sum-exp, the target logit and
the argmax are combined over devices (pmax / psum / pmin of `[B, l]` values). In the backward pass each device's
embedding gradient is its slice's, complete (it saw every token), and the hidden-state gradient is reduce-scattered
back to the devices that own the rows. Values and gradients equal `head.cross_entropy` (sums in another order).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hackable_diffusion.model import head
from hackable_diffusion.sharding.local import row_axes
from hackable_diffusion.sharding.logical import active_mesh

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class VocabLayout:
  """Static split of the vocabulary-parallel head: `rows` split the batch, `vocab` (every mesh axis of size > 1,
  in mesh order) split the vocabulary."""

  mesh: Mesh
  rows: tuple[str, ...]
  vocab: tuple[str, ...]


def vocab_layout(batch: int, vocab: int) -> VocabLayout | None:
  """The layout under the active mesh, or None where the plain head is used: outside a mesh, when the batch is not
  split, or when the devices do not divide the vocabulary."""
  mesh = active_mesh()
  rows = row_axes(batch) if mesh is not None else ()
  if not rows:
    return None
  axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
  if vocab % math.prod(mesh.shape[a] for a in axes):
    return None
  return VocabLayout(mesh, rows, axes)


def _own_rows(x: Array, layout: VocabLayout, rows: int) -> Array:
  """x [B, ...] (every device's rows, gathered) -> this device's `rows` rows."""
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(layout.rows) * rows, rows, axis=0)


def _gather_rows(x: Array, layout: VocabLayout) -> Array:
  return jax.lax.all_gather(x, layout.rows, axis=0, tiled=True)


def _tile_stats(h: Array, w: Array, t: Array, offset: Array, vocab: int, spec: head.HeadSpec, axes):
  """One tile on one device: h [B, l, H], w [V/n, H] (rows `offset...`), t [B, l] -> (z [B, l, V/n] fp32 logits of
  the slice, lse [B, l], target logit [B, l], argmax [B, l]) over the whole vocabulary."""
  z = head.logits(h, w, spec)
  m = jax.lax.pmax(jnp.max(z, axis=-1), axes)
  lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1), axes))
  local = t - offset
  mine = (local >= 0) & (local < z.shape[-1])
  picked = jnp.take_along_axis(z, jnp.clip(local, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
  target = jax.lax.psum(jnp.where(mine, picked, 0.0), axes)
  best = jnp.max(z, axis=-1)
  index = jnp.argmax(z, axis=-1).astype(jnp.int32) + offset
  top = jax.lax.pmax(best, axes)
  pred = jax.lax.pmin(jnp.where(best == top, index, vocab), axes)  # the first index of the maximum, as argmax
  return z, lse, target, pred


def _per_device_forward(h, w, t, *, layout: VocabLayout, spec: head.HeadSpec, vocab: int):
  b, length = h.shape[:2]
  h_all, t_all = _gather_rows(h, layout), _gather_rows(t, layout)
  offset = (jax.lax.axis_index(layout.vocab) * w.shape[0]).astype(jnp.int32)

  def body(_, xs):
    _, lse, target, pred = _tile_stats(xs[0], w, xs[1], offset, vocab, spec, layout.vocab)
    return None, (lse - target, pred, lse)

  _, out = jax.lax.scan(body, None, (head.tiles(h_all, spec.tile), head.tiles(t_all, spec.tile)))
  ce, pred, lse = (_own_rows(head.untile(x, length), layout, b) for x in out)
  return ce, pred, lse


def _per_device_backward(h, w, t, lse, g, *, layout: VocabLayout, spec: head.HeadSpec, vocab: int):
  b, length = h.shape[:2]
  h_all, t_all, lse_all, g_all = (_gather_rows(x, layout) for x in (h, t, lse, g))
  offset = (jax.lax.axis_index(layout.vocab) * w.shape[0]).astype(jnp.int32)
  wc = w.astype(spec.dtype)

  def body(d_w, xs):
    h_t, t_t, lse_t, g_t = xs  # [B, l, H], [B, l], [B, l], [B, l]
    z = head.logits(h_t, w, spec)
    onehot = (jnp.arange(z.shape[-1], dtype=jnp.int32) + offset) == t_t[..., None]
    d_z = g_t[..., None] * (jnp.exp(z - lse_t[..., None]) - onehot.astype(jnp.float32))  # [B, l, V/n]
    if spec.softcap is not None:
      d_z = d_z * (1.0 - jnp.square(z / spec.softcap))
    d_z2 = d_z.reshape(-1, d_z.shape[-1]).astype(spec.dtype)
    d_h = (d_z2 @ wc).reshape(h_t.shape).astype(jnp.float32)  # this slice's part of every token's gradient
    d_w = d_w + (d_z2.T @ h_t.reshape(-1, h_t.shape[-1]).astype(spec.dtype)).astype(jnp.float32)
    return d_w, d_h

  xs = tuple(head.tiles(x, spec.tile) for x in (h_all, t_all, lse_all, g_all))
  d_w, d_h = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  d_h = jax.lax.psum_scatter(head.untile(d_h, length), layout.rows, scatter_dimension=0, tiled=True)
  others = tuple(a for a in layout.vocab if a not in layout.rows)
  if others:  # devices along these hold the same rows and other vocabulary slices
    d_h = jax.lax.psum(d_h, others)
  return d_h.astype(h.dtype), d_w.astype(w.dtype)


def _specs(layout: VocabLayout):
  rows, vocab = PartitionSpec(layout.rows), PartitionSpec(layout.vocab)
  return rows, vocab


def _forward(hidden, embed, targets, spec, layout):
  rows, vocab = _specs(layout)
  fn = functools.partial(_per_device_forward, layout=layout, spec=spec, vocab=embed.shape[0])
  return jax.shard_map(fn, mesh=layout.mesh, in_specs=(rows, vocab, rows), out_specs=(rows, rows, rows),
                       check_vma=False)(hidden, embed, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cross_entropy(hidden, embed, targets, spec, layout):
  ce, pred, _ = _forward(hidden, embed, targets, spec, layout)
  return ce, pred


def _cross_entropy_fwd(hidden, embed, targets, spec, layout):
  ce, pred, lse = _forward(hidden, embed, targets, spec, layout)
  return (ce, pred), (hidden, embed, targets, lse)


def _cross_entropy_bwd(spec, layout, residuals, cotangents):
  hidden, embed, targets, lse = residuals
  rows, vocab = _specs(layout)
  fn = functools.partial(_per_device_backward, layout=layout, spec=spec, vocab=embed.shape[0])
  d_h, d_e = jax.shard_map(fn, mesh=layout.mesh, in_specs=(rows, vocab, rows, rows, rows), out_specs=(rows, vocab),
                           check_vma=False)(hidden, embed, targets, lse, cotangents[0])
  return d_h, d_e, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _tile_probs(h: Array, w: Array, spec: head.HeadSpec, axes) -> Array:
  """One tile: h [B, l, H], w [V/n, H] -> softmax over the whole vocabulary, this slice's columns [B, l, V/n] fp32."""
  z = head.logits(h, w, spec)
  m = jax.lax.pmax(jnp.max(z, axis=-1), axes)
  e = jnp.exp(z - m[..., None])
  return e / jax.lax.psum(jnp.sum(e, axis=-1), axes)[..., None]


def _per_device_soft(h, w, *, layout: VocabLayout, spec: head.HeadSpec):
  b, length = h.shape[:2]
  scale = jnp.asarray(math.sqrt(w.shape[1]), w.dtype).astype(spec.dtype)

  def body(_, h_t):
    probs = _tile_probs(h_t, w, spec, layout.vocab).astype(w.dtype)
    part = (probs.reshape(-1, probs.shape[-1]) @ w).astype(jnp.float32)  # this slice's share of probs @ E
    return None, jax.lax.psum(part, layout.vocab).reshape(*h_t.shape[:-1], -1).astype(w.dtype)

  _, out = jax.lax.scan(body, None, head.tiles(_gather_rows(h, layout), spec.tile))
  return _own_rows(head.untile(out, length), layout, b).astype(spec.dtype) * scale


def _per_device_soft_backward(h, w, g, *, layout: VocabLayout, spec: head.HeadSpec):
  scale = jnp.asarray(math.sqrt(w.shape[1]), w.dtype).astype(spec.dtype)
  h_all, g_all = _gather_rows(h, layout), _gather_rows(g, layout)

  def body(d_w, xs):
    h_t, g_t = xs  # [B, l, H] each
    probs = _tile_probs(h_t, w, spec, layout.vocab).astype(w.dtype)
    d_soft = (g_t * scale).astype(w.dtype)  # through `.astype(dtype) * scale`
    d_w = d_w + (probs.reshape(-1, probs.shape[-1]).T @ d_soft.reshape(-1, d_soft.shape[-1])).astype(jnp.float32)
    return d_w, None

  d_w, _ = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32),
                        (head.tiles(h_all, spec.tile), head.tiles(g_all, spec.tile)))
  return d_w.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _soft_embeddings(hidden, embed, spec, layout):
  rows, vocab = _specs(layout)
  fn = functools.partial(_per_device_soft, layout=layout, spec=spec)
  return jax.shard_map(fn, mesh=layout.mesh, in_specs=(rows, vocab), out_specs=rows, check_vma=False)(hidden, embed)


def _soft_embeddings_fwd(hidden, embed, spec, layout):
  return _soft_embeddings(hidden, embed, spec, layout), (hidden, embed)


def _soft_embeddings_bwd(spec, layout, residuals, cotangent):
  hidden, embed = residuals
  rows, vocab = _specs(layout)
  fn = functools.partial(_per_device_soft_backward, layout=layout, spec=spec)
  d_e = jax.shard_map(fn, mesh=layout.mesh, in_specs=(rows, vocab, rows), out_specs=vocab,
                      check_vma=False)(hidden, embed, cotangent)
  return jnp.zeros_like(hidden), d_e  # the probabilities are constants (`head.soft_embeddings`)


_soft_embeddings.defvjp(_soft_embeddings_fwd, _soft_embeddings_bwd)


def soft_embeddings(hidden: Array, embed: Array, spec: head.HeadSpec, layout: VocabLayout | None = None) -> Array:
  """`head.soft_embeddings` (hidden [B, L, H] -> `softmax(logits) @ embed * sqrt(H)` [B, L, H] in `spec.dtype`, the
  probabilities constants, the embedding's gradient kept) split by vocabulary over `layout`: each device's slice
  of the probabilities times its slice of the embedding, summed over devices. By default the active mesh's layout
  (`vocab_layout`), and `head.soft_embeddings` itself where there is none."""
  layout = layout or vocab_layout(hidden.shape[0], embed.shape[0])
  if layout is None:
    return head.soft_embeddings(hidden, embed, spec)
  return _soft_embeddings(jax.lax.stop_gradient(hidden), embed, spec, layout)


def cross_entropy(hidden: Array, embed: Array, targets: Array, spec: head.HeadSpec,
                  layout: VocabLayout | None = None) -> tuple[Array, Array]:
  """`head.cross_entropy` (hidden [B, L, H], embed [V, H], targets [B, L] -> (CE [B, L] fp32, argmax [B, L] int32),
  differentiable in hidden and embed) split by vocabulary over `layout`; by default the active mesh's
  (`vocab_layout`), and `head.cross_entropy` itself where there is none."""
  layout = layout or vocab_layout(hidden.shape[0], embed.shape[0])
  if layout is None:
    return head.cross_entropy(hidden, embed, targets, spec)
  return _cross_entropy(hidden, embed, targets.astype(jnp.int32), spec, layout)


__all__ = ["VocabLayout", "cross_entropy", "soft_embeddings", "vocab_layout"]
