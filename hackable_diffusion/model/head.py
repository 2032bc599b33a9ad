"""The tied output head, computed in tiles of positions so that `[B, L, V]` fp32 logits never exist at once.

Logits are `softcap(h @ E^T)` with `E [V, H]` the embedding (see `DiffusionGemma.lm_logits`). At the released
vocabulary (262,144) one fp32 logits tensor of a batch of 8 canvases of 256 is 2 GiB, and autodiff keeps several
per use (softmax, one-hot, their difference). Here a `[B, L, H]` hidden state is split along L into `n` tiles of
`[B, l, H]` (the batch axis stays whole, so a batch-sharded mesh keeps every device busy on every tile):

- `cross_entropy`: per-position CE and argmax, with a written VJP that recomputes each tile's logits in the
  backward pass and accumulates the embedding gradient in fp32 (MaxText's "vocabulary tiling" idea);
- `positionwise`: any per-position function of the logits (the ELBO term), each tile under `jax.checkpoint`
  inside a scan, so autodiff also recomputes tile by tile;
- `soft_embeddings`: `softmax(logits) @ E` (the self-conditioning input), no gradient.

On a mesh that splits the batch the loss runs `cross_entropy` and `soft_embeddings` split by vocabulary instead
(`model.head_parallel`), so no device holds the whole embedding or its gradient.

Callers use the plain computation when one tile covers L (`DiffusionGemma.head_spec`; the Sudoku default), so
small-vocabulary runs are unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """Static settings of the head: compute dtype of the matmul, softcap (None: off), positions per tile."""

  dtype: jnp.dtype
  softcap: float | None
  tile: int


def tile_positions(batch: int, length: int, vocab: int, budget_mib: float) -> int:
  """Positions per tile such that one fp32 logits tile `[batch, l, vocab]` stays within `budget_mib` MiB.

  `budget_mib <= 0` means untiled (`length`). At least 1 position per tile.
  """
  if budget_mib <= 0:
    return length
  per_position = batch * vocab * 4
  return max(1, min(length, int(budget_mib * 2**20) // per_position))


def logits(hidden: Array, embed: Array, spec: HeadSpec) -> Array:
  """hidden [..., H], embed [V, H] -> soft-capped fp32 logits [..., V] (the model's `lm_logits`)."""
  w = embed.astype(spec.dtype)
  out = (hidden.reshape(-1, hidden.shape[-1]) @ w.T).reshape(*hidden.shape[:-1], -1).astype(jnp.float32)
  return out if spec.softcap is None else jnp.tanh(out / spec.softcap) * spec.softcap


def tiles(x: Array, tile: int) -> Array:
  """x [B, L, ...] -> [n, B, tile, ...] (L padded with zeros to a multiple of `tile`)."""
  b, length = x.shape[:2]
  n = -(-length // tile)
  pad = n * tile - length
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(b, n, tile, *x.shape[2:]), 1, 0)


def untile(x: Array, length: int) -> Array:
  """[n, B, tile, ...] -> [B, L, ...]."""
  n, b, tile = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, n * tile, *x.shape[3:])[:, :length]


# ---- cross-entropy -----------------------------------------------------------------------------------------------
def cross_entropy(hidden: Array, embed: Array, targets: Array, spec: HeadSpec) -> tuple[Array, Array]:
  """hidden [B, L, H], embed [V, H], targets [B, L] -> (CE [B, L] fp32, argmax [B, L] int32) of the logits.

  Differentiable in hidden and embed (the argmax is not). Values and gradients equal autodiff of
  `logsumexp(z) - z[target]` with `z = logits(hidden)`; the embedding gradient is accumulated over tiles in fp32.
  """
  return _cross_entropy(hidden, embed, targets.astype(jnp.int32), spec)


def _ce_tile(h: Array, w: Array, t: Array, spec: HeadSpec):
  """One tile: h [B, l, H], t [B, l] -> (ce, argmax, z fp32 logits [B, l, V], lse [B, l])."""
  z = logits(h, w, spec)
  lse = jax.nn.logsumexp(z, axis=-1)
  target_logit = jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0]
  return lse - target_logit, jnp.argmax(z, axis=-1).astype(jnp.int32), z, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(hidden: Array, embed: Array, targets: Array, spec: HeadSpec) -> tuple[Array, Array]:
  length = hidden.shape[1]

  def body(_, xs):
    ce, pred, _, _ = _ce_tile(xs[0], embed, xs[1], spec)
    return None, (ce, pred)

  _, (ce, pred) = jax.lax.scan(body, None, (tiles(hidden, spec.tile), tiles(targets, spec.tile)))
  return untile(ce, length), untile(pred, length)


def _cross_entropy_fwd(hidden: Array, embed: Array, targets: Array, spec: HeadSpec):
  return _cross_entropy(hidden, embed, targets, spec), (hidden, embed, targets)


def _cross_entropy_bwd(spec: HeadSpec, residuals, cotangents):
  hidden, embed, targets = residuals
  g_ce = cotangents[0]  # [B, L]; the argmax has no gradient
  length = hidden.shape[1]
  w = embed.astype(spec.dtype)

  def body(d_embed, xs):
    h, t, g = xs  # [B, l, H], [B, l], [B, l]
    _, _, z, lse = _ce_tile(h, embed, t, spec)
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32) == t[..., None]
    d_z = g[..., None] * (jnp.exp(z - lse[..., None]) - onehot.astype(jnp.float32))  # [B, l, V]
    if spec.softcap is not None:
      d_z = d_z * (1.0 - jnp.square(z / spec.softcap))  # d/da cap * tanh(a / cap)
    d_z2 = d_z.reshape(-1, d_z.shape[-1]).astype(spec.dtype)  # [B*l, V]
    h2 = h.reshape(-1, h.shape[-1])
    d_h = (d_z2 @ w).reshape(h.shape).astype(hidden.dtype)
    d_embed = d_embed + (d_z2.T @ h2.astype(spec.dtype)).astype(jnp.float32)
    return d_embed, d_h

  d_embed, d_h = jax.lax.scan(body, jnp.zeros(embed.shape, jnp.float32),
                              (tiles(hidden, spec.tile), tiles(targets, spec.tile), tiles(g_ce, spec.tile)))
  return untile(d_h, length), d_embed.astype(embed.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# ---- other functions of the logits -------------------------------------------------------------------------------
def positionwise(fn: Callable[..., Array], hidden: Array, embed: Array, spec: HeadSpec, *per_position: Array) -> Array:
  """`fn(logits [B, l, V] fp32, *tiles of per_position [B, l, ...]) -> [B, l]` over tiles -> [B, L].

  Each tile runs under `jax.checkpoint`, so the backward pass recomputes its logits instead of keeping them.
  """
  length = hidden.shape[1]

  @jax.checkpoint
  def one(h, *xs):
    return fn(logits(h, embed, spec), *xs)

  def body(_, xs):
    return None, one(*xs)

  _, out = jax.lax.scan(body, None, tuple(tiles(x, spec.tile) for x in (hidden, *per_position)))
  return untile(out, length)


def _soft_tile(z: Array, w: Array, dtype) -> Array:
  """z [B, l, V] logits (constants) -> `softmax(z) @ w * sqrt(H)` [B, l, H] in `dtype` (`w`'s gradient kept)."""
  scale = jnp.asarray(math.sqrt(w.shape[1]), w.dtype).astype(dtype)
  probs = jax.lax.stop_gradient(jax.nn.softmax(z.astype(jnp.float32), axis=-1)).astype(w.dtype)
  soft = (probs.reshape(-1, probs.shape[-1]) @ w).reshape(*probs.shape[:-1], -1)
  return soft.astype(dtype) * scale


def soft_embeddings(hidden: Array, embed: Array, spec: HeadSpec) -> Array:
  """hidden [B, L, H] -> `softmax(logits) @ embed * sqrt(H)` [B, L, H] in `spec.dtype`.

  The same computation as `DiffusionGemma.soft_embeddings(stop_gradient(lm_logits(hidden)))`, one tile of logits
  at a time: the probabilities are constants (a previous pass, its gradient stopped); the embedding still gets the
  gradient of `probs @ embed`, each tile's probabilities recomputed in the backward pass.
  """
  hidden = jax.lax.stop_gradient(hidden)

  @jax.checkpoint
  def one(h, w):
    return _soft_tile(logits(h, w, spec), w, spec.dtype)

  _, out = jax.lax.scan(lambda _, h: (None, one(h, embed)), None, tiles(hidden, spec.tile))
  return untile(out, hidden.shape[1])


def soft_embeddings_of_logits(z: Array, embed: Array, dtype, tile: int) -> Array:
  """z [B, L, V] logits -> `softmax(z) @ embed * sqrt(H)` [B, L, H], `tile` positions at a time (the sampler's
  self-conditioning input: no `[B, L, V]` probabilities beside the logits)."""
  _, out = jax.lax.scan(lambda _, t: (None, _soft_tile(t, embed, dtype)), None, tiles(z, tile))
  return untile(out, z.shape[1])
