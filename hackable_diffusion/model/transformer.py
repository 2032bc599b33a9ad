"""`DiffusionGemma`: one set of Gemma-4 weights run as a causal encoder and as a bidirectional decoder.

The encoder runs causally over the prompt (and, in block-autoregressive generation, over committed canvases)
and writes a KV cache; the decoder denoises a canvas attending to that cache and to the whole canvas, with a
self-conditioning MLP on its input. Logits are computed by the tied embedding in fp32 and soft-capped
(`tanh(logits / cap) * cap`). Same meaning as transformers' `DiffusionGemmaForBlockDiffusion`.

A model whose config has a `vision` tower also takes images: `image_features` runs the tower once per prompt and
`encode(..., image_features=...)` puts the soft tokens in place of the prompt's `image_token_id` tokens
(`model.vision`); the decoder never sees pixels. With `use_bidirectional_attention == "vision"` the tokens of each
image also attend to each other in that encoder pass (`model.vision_attention`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import hackable_diffusion.sharding.logical as sharding
from hackable_diffusion.model import head, layers, matmul, moe, remat, scan, structure, vision, vision_attention
from hackable_diffusion.model.attention import Attention, decoder_prefix_mask
from hackable_diffusion.model.kv_cache import KVCache
from hackable_diffusion.model.config import FULL, SLIDING, ModelConfig

Array = jax.Array
_RESIDUAL = ("batch", None, None)  # residual stream [B, L, H]: sharded over the batch axes under a mesh


def _dtype(name: str):
  return jnp.dtype(name)


def _remat(fn: Callable, policy: str) -> Callable:
  """`fn(layer, ...)` rematerialised per `ModelConfig.remat` (identity for 'none').

  'nothing_saveable' keeps only the layer's inputs (`remat.recompute_in_backward`, effective on every backend);
  other policies are `jax.checkpoint`'s, which XLA:CPU does not honour (see `hackable_diffusion.model.remat`).
  """
  if policy == "none":
    return fn
  if policy == "nothing_saveable":
    def run(layer, *args):
      graphdef, state = nnx.split(layer)
      return remat.recompute_in_backward(lambda st, *a: fn(nnx.merge(graphdef, st), *a))(state, *args)
    return run
  return nnx.remat(fn, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=True)


def _layer_type(layer: DecoderLayer) -> str:
  return SLIDING if layer.self_attn.is_sliding else FULL


def _run_layers(stack: nnx.List | scan.ScannedLayers, fn: Callable, x: Array, cache: KVCache
                ) -> tuple[Array, tuple[tuple[Array, ...], tuple[Array, ...]]]:
  """`x, (k_i, v_i) = fn(layer_i, x, (keys_i, values_i))` over the layers in order: unrolled, or one scan over the
  layer period when the layers are stacked (`model.scan.stack_layers`; `cache` then in the stacked layout). Returns
  `x` and the outputs' keys and values in the cache's layout (`fn` may return None: then `((), ())`)."""
  per_layer = list(zip(cache.keys, cache.values))
  if isinstance(stack, scan.ScannedLayers):
    x, outs = stack.run(fn, x, per_layer)
  else:
    outs = []
    for layer, inputs in zip(stack, per_layer):
      x, out = fn(layer, x, inputs)
      outs.append(out)
  if any(out is None for out in outs):
    return x, ((), ())
  keys, values = zip(*outs)
  return x, (tuple(keys), tuple(values))


def _encode_layer(layer: DecoderLayer, *args):
  return layer.encode(*args)


def _decode_layer(layer: DecoderLayer, *args):
  return layer.decode(*args)


class DecoderLayer(nnx.Module):
  """One transformer block (same weights in both modes).

  `h = x + post_attention_norm(attn(input_norm(x)))`; `dense = post_ffw_norm_1(mlp(pre_ffw_norm(h)))`;
  `moe = post_ffw_norm_2(experts(pre_ffw_norm_2(h), router(h)))`; `out = (h + post_ffw_norm(dense + moe)) * s`
  where `s` is the saved `layer_scalar` (the encoder's own copy in encoder mode).
  """

  def __init__(self, config: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
    dtype, pdtype = _dtype(config.dtype), _dtype(config.param_dtype)
    h, eps, std = config.hidden_size, config.rms_norm_eps, config.initializer_range
    self.self_attn = Attention(config, layer_idx, rngs=rngs, dtype=dtype, param_dtype=pdtype)
    self.mlp = layers.MLP(h, config.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=pdtype, std=std,
                          matmul_dtype=config.matmul_dtype)
    self.router = moe.Router(h, config.num_experts, config.top_k_experts, eps=eps, rngs=rngs, dtype=dtype,
                             param_dtype=pdtype, std=std)
    self.experts = moe.Experts(h, config.moe_intermediate_size, config.num_experts, rngs=rngs, dtype=dtype,
                               param_dtype=pdtype, std=std, impl=config.moe_impl,
                               matmul_dtype=config.matmul_dtype)
    norm = lambda: layers.RMSNorm(h, eps=eps, param_dtype=pdtype)  # noqa: E731
    self.input_layernorm = norm()
    self.post_attention_layernorm = norm()
    self.pre_feedforward_layernorm = norm()
    self.post_feedforward_layernorm = norm()
    self.pre_feedforward_layernorm_2 = norm()
    self.post_feedforward_layernorm_1 = norm()
    self.post_feedforward_layernorm_2 = norm()
    self.layer_scalar = layers.Buffer(jnp.ones((1,), pdtype))
    self.encoder_layer_scalar = layers.Buffer(jnp.ones((1,), pdtype))

  def feed_forward(self, h: Array) -> Array:
    """h [B, L, H] (residual after attention) -> h + post_ffw_norm(dense + moe)."""
    dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
    flat = h.reshape(-1, h.shape[-1])
    weights, idx = self.router(flat)
    moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, idx).reshape(h.shape)
    moe = self.post_feedforward_layernorm_2(moe)
    return h + self.post_feedforward_layernorm(dense + moe)

  def encode(self, x, cos, sin, cache_k, cache_v, start, valid, blocks=None):
    attn, cache_k, cache_v = self.self_attn.encode(self.input_layernorm(x), cos, sin, cache_k, cache_v, start, valid,
                                                   blocks)
    h = x + self.post_attention_layernorm(attn)
    out = self.feed_forward(h) * self.encoder_layer_scalar[...].astype(x.dtype)
    return out, cache_k, cache_v

  def decode(self, x, cos, sin, cache_k, cache_v, prefix_mask, canvas_mask):
    attn = self.self_attn.decode(self.input_layernorm(x), cos, sin, cache_k, cache_v, prefix_mask, canvas_mask)
    h = x + self.post_attention_layernorm(attn)
    return self.feed_forward(h) * self.layer_scalar[...].astype(x.dtype)


class SelfConditioning(nnx.Module):
  """`post_norm_noscale(embeds + down(gelu_tanh(gate n) * up n))` with `n = pre_norm(soft_embeddings)`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    dtype, pdtype = _dtype(config.dtype), _dtype(config.param_dtype)
    h, eps = config.hidden_size, config.rms_norm_eps
    self.pre_norm = layers.RMSNorm(h, eps=eps, param_dtype=pdtype)
    self.post_norm = layers.RMSNorm(h, eps=eps, with_scale=False)
    self.mlp = layers.MLP(h, config.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=pdtype,
                          std=config.initializer_range, matmul_dtype=config.matmul_dtype)

  def __call__(self, embeds: Array, soft: Array) -> Array:
    return self.post_norm(embeds + self.mlp(self.pre_norm(soft)))


class DiffusionGemma(nnx.Module):
  """The DiffusionGemma text backbone (Flax NNX). See `__call__`, `encode`, `decode`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    pdtype = _dtype(config.param_dtype)
    self.dtype = _dtype(config.dtype)
    with nnx.use_eager_sharding(False):
      self.embed_tokens = layers.param(rngs, nnx.initializers.normal(config.initializer_range),
                                       (config.vocab_size, config.hidden_size), pdtype, ("vocab", "embed"))
      self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs) for i in range(config.num_hidden_layers)])
      self.norm = layers.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pdtype)
      self.self_conditioning = SelfConditioning(config, rngs=rngs)
      if config.vision is not None:
        self.vision_tower = vision.VisionTower(config.vision, rngs=rngs, dtype=self.dtype, param_dtype=pdtype)
        self.embed_vision = vision.MultimodalEmbedder(config.vision, config.hidden_size, rngs=rngs, dtype=self.dtype,
                                                      param_dtype=pdtype, std=config.initializer_range)

  @property
  def has_vision(self) -> bool:
    return self.config.vision is not None

  # ---- pieces ----------------------------------------------------------------------------------------------------
  def embed(self, ids: Array) -> Array:
    """ids [B, L] -> [B, L, H]: `embed[ids] * sqrt(hidden)` with the scale cast to the weight dtype. On a mesh the
    lookup runs per device on its vocabulary shard (`layers.embed_lookup`): the table is never replicated."""
    w = self.embed_tokens[...]
    scale = jnp.asarray(math.sqrt(self.config.hidden_size), w.dtype)
    return (layers.embed_lookup(w, ids) * scale).astype(self.dtype)

  def lm_logits(self, hidden: Array) -> Array:
    """hidden [B, L, H] (final-normed) -> soft-capped fp32 logits [B, L, V] through the tied embedding."""
    w = self.embed_tokens[...].astype(self.dtype)
    if self.config.matmul_dtype == "bfloat16":
      logits = matmul.bf16_matmul(layers.tokens_2d(hidden), w, True).reshape(*hidden.shape[:-1], -1)  # [B, L, V]
    else:
      logits = (layers.tokens_2d(hidden) @ w.T).reshape(*hidden.shape[:-1], -1).astype(jnp.float32)  # [B, L, V]
    cap = self.config.final_logit_softcapping
    return logits if cap is None else jnp.tanh(logits / cap) * cap

  def head_spec(self, batch: int, length: int, budget_mib: float) -> head.HeadSpec:
    """The tiling of the output head for `[batch, length]` positions within `budget_mib` MiB of fp32 logits per
    tile (see `hackable_diffusion.model.head`); `spec.tile >= length` means one tile (use the plain path)."""
    return head.HeadSpec(self.dtype, self.config.final_logit_softcapping,
                         head.tile_positions(batch, length, self.config.vocab_size, budget_mib))

  def soft_embeddings(self, logits: Array, tile_mib: float = 256.0) -> Array:
    """logits [B, C, V] -> `softmax(logits) @ embed * embed_scale` [B, C, H], over tiles of positions holding at
    most `tile_mib` MiB of fp32 probabilities (one tile, the plain computation, at small vocabularies)."""
    w = self.embed_tokens[...]
    tile = head.tile_positions(logits.shape[0], logits.shape[1], logits.shape[2], tile_mib)
    if tile < logits.shape[1]:
      return head.soft_embeddings_of_logits(logits, w, self.dtype, tile)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(w.dtype)
    scale = jnp.asarray(math.sqrt(self.config.hidden_size), w.dtype).astype(self.dtype)
    if self.config.matmul_dtype == "bfloat16":
      soft = matmul.bf16_matmul(layers.tokens_2d(probs), w).reshape(*probs.shape[:-1], -1)  # [B, C, H]
    else:
      soft = (layers.tokens_2d(probs) @ w).reshape(*probs.shape[:-1], -1)  # [B, C, H]
    return soft.astype(self.dtype) * scale

  def image_features(self, pixel_values: Array, image_position_ids: Array) -> tuple[Array, Array]:
    """pixel_values [N, P, 3 p^2], image_position_ids [N, P, 2] -> (soft tokens in the text width [N, P / k^2, H],
    mask [N, P / k^2]): transformers' `get_image_features(...).pooler_output`, kept per image with a mask."""
    if not self.has_vision:
      raise ValueError("this model has no vision tower (its config has no vision); it cannot take images")
    soft, mask = self.vision_tower(pixel_values, image_position_ids)
    return self.embed_vision(soft), mask

  def _rope(self, positions: Array) -> dict[str, tuple[Array, Array]]:
    cfg = self.config
    inv_freq = {
        SLIDING: layers.rope_inv_freq(cfg.sliding_rope, cfg.head_dim),
        FULL: layers.rope_inv_freq(cfg.full_rope, cfg.global_head_dim),
    }
    return {t: layers.rope_cos_sin(positions, f, self.dtype) for t, f in inv_freq.items()}

  def init_cache(self, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache with room for `capacity` positions per row, in the layout the layers read (stacked when they
    are scanned)."""
    return KVCache.empty(self.config, batch_size, capacity, dtype or self.dtype, self._cache_groups())

  def _cache_groups(self) -> int:
    return self.layers.groups if isinstance(self.layers, scan.ScannedLayers) else 0

  def _in_layout(self, cache: KVCache) -> KVCache:
    """`cache` in the layout the layers read (a copy only for a cache made for the other form of the model)."""
    return cache.regrouped(self._cache_groups())

  # ---- modes -----------------------------------------------------------------------------------------------------
  def encode(self, input_ids: Array, cache: KVCache, attention_mask: Array | None = None,
             image_features: tuple[Array, Array] | None = None) -> tuple[Array, KVCache]:
    """Causal encoder pass that appends `input_ids [B, L]` to `cache` at each row's `cache.length`.

    attention_mask [B, L] (False = padding; left padding allowed). Returns the final-normed hidden states
    [B, L, H] (for the encoder's autoregressive loss) and the updated cache. Positions are `length + arange(L)`.
    image_features: `image_features(...)`'s (features, mask), whose valid soft tokens replace the embeddings of the
    `image_token_id` tokens of `input_ids` in row-major order (as many as there are; `vision.num_soft_tokens`).
    With `config.use_bidirectional_attention == "vision"`, each run of consecutive image tokens of this pass is one
    bidirectional block (`vision_attention.image_blocks`): what transformers does given the processor's
    `mm_token_type_ids`, which its `generate` always passes with the prompt's images. A pass without
    `image_features` stays causal, as transformers without `mm_token_type_ids`.
    """
    b, l = input_ids.shape
    start = cache.length
    positions = start[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]  # [B, L]
    mask_new = jnp.ones((b, l), bool) if attention_mask is None else attention_mask.astype(bool)
    valid = jax.vmap(lambda v, m, s: jax.lax.dynamic_update_slice_in_dim(v, m, s, axis=0))(cache.valid, mask_new,
                                                                                             start)
    rope = self._rope(positions)
    x = self.embed(input_ids)
    blocks = None
    if image_features is not None:
      x = vision.scatter_image_features(x, input_ids, *image_features, self.config.image_token_id)
      if self.config.use_bidirectional_attention == "vision":  # a block is at most one image's soft-token slots
        blocks = vision_attention.image_blocks(input_ids, mask_new, self.config.image_token_id, start,
                                               reach=image_features[0].shape[1])
    x = sharding.constrain(x, _RESIDUAL)
    run = _remat(_encode_layer, "none" if scan.is_linked(self.layers) else self.config.remat)

    def one(layer, x, kv):
      x, k, v = run(layer, x, *rope[_layer_type(layer)], *kv, start, valid, blocks)
      return sharding.constrain(x, _RESIDUAL), (k, v)

    cache = self._in_layout(cache)
    x, (keys, values) = _run_layers(self.layers, one, x, cache)
    new_cache = cache.replace(keys=keys, values=values, valid=valid, length=start + l)
    return self.norm(x), new_cache

  def decode(self, canvas: Array, cache: KVCache, self_conditioning_logits: Array | None = None,
             self_conditioning_mask: Array | None = None, canvas_attention_mask: Array | None = None) -> Array:
    """Bidirectional decoder pass over `canvas [B, C]` reading (never writing) `cache` -> logits [B, C, V] fp32.

    self_conditioning_logits [B, C, V]: the previous step's logits (None: zero soft embedding, i.e. SC off).
    self_conditioning_mask [B] bool: rows where False get a zero soft embedding.
    canvas_attention_mask [B|1, N|1, C, P + C] bool: optional task structure restricting canvas-to-canvas attention
    and, with P > 0, the canvas's view of the first P cache slots (not part of the DiffusionGemma architecture; see
    `hackable_diffusion.model.structure`).
    """
    soft = None if self_conditioning_logits is None else self.soft_embeddings(self_conditioning_logits)
    return self.lm_logits(self.decode_hidden(canvas, cache, soft, self_conditioning_mask, canvas_attention_mask))

  def decode_hidden(self, canvas: Array, cache: KVCache, self_conditioning_embeddings: Array | None = None,
                    self_conditioning_mask: Array | None = None, canvas_attention_mask: Array | None = None) -> Array:
    """`decode` up to the final norm: hidden states [B, C, H] (logits = `lm_logits` of them).

    self_conditioning_embeddings [B, C, H]: `soft_embeddings` of the previous logits (None: zeros, SC off).
    """
    b, c = canvas.shape
    x = self.embed(canvas)
    if self_conditioning_embeddings is None:
      soft = jnp.zeros_like(x)
    else:
      soft = self_conditioning_embeddings.astype(x.dtype)
      if self_conditioning_mask is not None:
        soft = soft * self_conditioning_mask.astype(soft.dtype)[:, None, None]
    x = sharding.constrain(self.self_conditioning(x, soft), _RESIDUAL)
    if canvas_attention_mask is None and self.config.attention_structure is not None:
      canvas_attention_mask = jnp.asarray(structure.canvas_mask(self.config))
    positions = cache.length[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    rope = self._rope(positions)
    prefix = {
        SLIDING: decoder_prefix_mask(cache.valid, cache.length, self.config.sliding_window),
        FULL: decoder_prefix_mask(cache.valid, cache.length, None),
    }
    run = _remat(_decode_layer, "none" if scan.is_linked(self.layers) else self.config.remat)

    def one(layer, x, kv):
      t = _layer_type(layer)
      return sharding.constrain(run(layer, x, *rope[t], *kv, prefix[t], canvas_attention_mask), _RESIDUAL), None

    x, _ = _run_layers(self.layers, one, x, self._in_layout(cache))
    return self.norm(x)

  def __call__(self, input_ids: Array, decoder_input_ids: Array, attention_mask: Array | None = None,
               self_conditioning_logits: Array | None = None, self_conditioning_mask: Array | None = None,
               pixel_values: Array | None = None, image_position_ids: Array | None = None) -> Array:
    """Encode the prompt `[B, P]`, denoise the canvas `[B, C]` -> logits `[B, C, V]` fp32 (soft-capped).

    Same meaning as transformers' `DiffusionGemmaForBlockDiffusion.forward(...).logits` with the decoder mask
    being `attention_mask` extended with ones over the canvas (what its `generate` passes). `pixel_values` /
    `image_position_ids`: the prompt's images (`image_features`), one soft token per image token of `input_ids`.
    """
    cache = self.init_cache(input_ids.shape[0], input_ids.shape[1])
    images = None if pixel_values is None else self.image_features(pixel_values, image_position_ids)
    _, cache = self.encode(input_ids, cache, attention_mask, images)
    return self.decode(decoder_input_ids, cache, self_conditioning_logits, self_conditioning_mask)


def init_model(config: ModelConfig, seed: int = 0) -> DiffusionGemma:
  """Fresh random `DiffusionGemma`, initialised inside one compiled function.

  Same parameters as `DiffusionGemma(config, rngs=nnx.Rngs(seed))` (to rounding: the compiled initialisers fuse
  their arithmetic), but much faster than running them eagerly op by op (seconds even for a tiny model on CPU).
  """
  graphdef, make = _initializer(config)
  return nnx.merge(graphdef, make(jax.random.key(seed)))  # nnx.Rngs(seed) draws from this same key


@functools.lru_cache(maxsize=8)
def _initializer(config: ModelConfig) -> tuple[nnx.GraphDef, Callable[[jax.Array], nnx.State]]:
  """The model's graph and its compiled initialiser (key -> state), built once per config: a second model of the
  same config (another seed, a test's fresh copy) costs one run, not another trace and compile (seconds on CPU)."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: DiffusionGemma(config, rngs=nnx.Rngs(0))))

  @jax.jit
  def make(key: jax.Array) -> nnx.State:
    return nnx.split(DiffusionGemma(config, rngs=nnx.Rngs(key)))[1]

  return graphdef, make


def forward(model: DiffusionGemma, input_ids: Array, decoder_input_ids: Array, attention_mask: Array | None = None,
            self_conditioning_logits: Array | None = None, self_conditioning_mask: Array | None = None,
            pixel_values: Array | None = None, image_position_ids: Array | None = None) -> Array:
  """`model(...)` compiled (one compilation per model graph and input shape).

  A `jax.jit` over the model's split state: `nnx.jit` would also return the (unchanged) state, i.e. write a copy of
  every parameter per call (a second model's worth of memory per call). With images, their soft-token count is
  checked against the prompt's image tokens first (`vision.check_image_tokens`).
  """
  if pixel_values is not None:
    pixel_values, image_position_ids = vision.check_image_tokens(model.config, input_ids, pixel_values,
                                                                 image_position_ids)
  graphdef, state = nnx.split(model)
  return _forward(graphdef, state, input_ids, decoder_input_ids, attention_mask, self_conditioning_logits,
                  self_conditioning_mask, pixel_values, image_position_ids)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, *args):
  return nnx.merge(graphdef, state)(*args)
