"""The SFT objective of a block-diffusion DiffusionGemma (docs/reference.md, "Training recipe").

Per example: the encoder runs causally over prompt + clean completion (teacher forcing) and writes the KV cache;
one valid canvas of the completion is chosen uniformly, corrupted with the uniform-state process at a random
time `t`, and denoised by the decoder, which attends to the prompt, the clean canvases before it, and itself.

Loss = diffusion term on the chosen canvas + `encoder_ar_weight` * next-token cross-entropy of the encoder over
the completion. The diffusion term is a `LossTerm` (`LossConfig.variant`, config key `diffusion.loss_variant`): a
built-in name of `LOSS_TERMS` or 'package.module:Factory' naming a researcher's own term (`Factory()` returns it).
- `flat` (default; the gemma JAX adapter / TRL / NeMo recipes): mean cross-entropy over every valid position of
  the canvas, corrupted or not, without a 1/t weight.
- `corrupted`: mean cross-entropy over the valid positions that were resampled (MDLM-style "loss on noised
  tokens only", as used by masked-diffusion SFT).
- `elbo`: the continuous-time negative ELBO of the uniform-state process (UDLM, Schiff et al. 2024, "Simple
  Guidance Mechanisms for Discrete Diffusion Models", eq. 14; Duo, Sahoo et al. 2025), derived from the CTMC
  path-measure KL with reverse rates `R(z->y) = (beta_t / N) * xbar_y / xbar_z`, `xbar = N alpha_t x + 1 - alpha_t`,
  `beta_t = -alpha'_t / alpha_t`, and the model's rates using `x_theta = softmax(logits)` in place of `x`.

Images (a batch with `pixel_values`, data/sft_images.py): the vision tower runs once per batch on every example's
images and its soft tokens take the place of the prompt's image tokens in the encoder pass (`batch_image_features`);
the decoder reads them through the KV cache, as at sampling time.

Self-conditioning: with probability `self_conditioning_prob` per example, a first decoder pass without
self-conditioning is run, its logits (gradient stopped) feed the second pass; otherwise the second pass has a
zero soft embedding (identical to the first pass). The loss is on the second pass.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp

from hackable_diffusion import specs
from hackable_diffusion.data.sft import SFTBatch, num_valid_canvases
from hackable_diffusion.diffusion import corruption
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import head, head_parallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """The SFT objective's settings (config section `diffusion`; `variant` is the key `loss_variant`).

  variant: the diffusion term, a `LOSS_TERMS` name ('flat', 'corrupted', 'elbo') or 'package.module:Factory'
    (`Factory()` returns a `LossTerm`). schedule: the keep-probability schedule ('linear', 'cosine'). time_eps: `t ~
    U(eps, 1 - eps)`. time_min: a floor on the training times, `t ~ U(max(eps, time_min), 1 - eps)` (0: the
    published recipe); the canvases below it are almost clean, and a small model learns them long before the rest.
    self_conditioning_prob: per-example probability of a self-conditioned second pass.
    encoder_ar_weight: weight of the encoder's next-token loss (0: the last canvas is not encoded).
    self_conditioning_passes: decoder passes without gradient before the trained one: 1 (the published recipe)
    computes the self-conditioning input without self-conditioning; each further pass feeds the previous pass's
    logits back as its self-conditioning input (every row), as sampling does from step to step.
    encoder_gradients: False stops the gradient at the KV cache the encoder writes: the encoder pass runs forward
    only (no backward), and the shared weights learn through the decoder alone (needs encoder_ar_weight=0).
    logits_tile_mib: the most fp32 logits (MiB) alive at once in the loss: the diffusion term, the encoder's
    next-token term and the self-conditioning input are computed over tiles of positions of at most this size (see
    `hackable_diffusion.model.head`); 0 = never tile. The default, 256 MiB, is one tile at small vocabularies (the
    Sudoku run is unchanged) and 128 positions of a batch of 2 at the released 262,144 (docs/scaling.md).
  """

  variant: str = "flat"
  schedule: str = "linear"
  time_eps: float = 1e-4
  time_min: float = 0.0
  self_conditioning_prob: float = 0.5
  encoder_ar_weight: float = 1.0
  encoder_gradients: bool = True
  self_conditioning_passes: int = 1
  logits_tile_mib: float = 256.0

  def __post_init__(self):
    get_loss_term(self.variant)
    try:
      corruption.get_schedule(self.schedule)
    except ValueError as e:
      raise ConfigError(f"diffusion.schedule={self.schedule!r}: {e}") from None
    for name in ("time_eps", "time_min"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"diffusion.{name}={value!r}; expected a number")
    if not 0.0 <= self.time_eps < 0.5:
      raise ConfigError(f"diffusion.time_eps={self.time_eps}; expected a value in [0, 0.5)")
    if not 0.0 <= self.time_min < 1.0 - self.time_eps:
      raise ConfigError(f"diffusion.time_min={self.time_min}; expected a value in [0, 1 - time_eps)")
    if not 0.0 <= self.self_conditioning_prob <= 1.0:
      raise ConfigError(f"diffusion.self_conditioning_prob={self.self_conditioning_prob}; expected [0, 1]")
    if self.encoder_ar_weight < 0:
      raise ConfigError(f"diffusion.encoder_ar_weight={self.encoder_ar_weight}; expected >= 0")
    if isinstance(self.self_conditioning_passes, bool) or not isinstance(self.self_conditioning_passes, int) \
        or self.self_conditioning_passes < 1:
      raise ConfigError(f"diffusion.self_conditioning_passes={self.self_conditioning_passes!r}; expected an integer "
                        ">= 1")
    if not isinstance(self.encoder_gradients, bool):
      raise ConfigError(f"diffusion.encoder_gradients={self.encoder_gradients!r}; expected True or False")
    if not self.encoder_gradients and self.encoder_ar_weight > 0:
      raise ConfigError(f"diffusion.encoder_gradients=False with encoder_ar_weight={self.encoder_ar_weight}: the "
                        "encoder's next-token loss would get no gradient (set encoder_ar_weight=0)")
    if not self.logits_tile_mib >= 0:
      raise ConfigError(f"diffusion.logits_tile_mib={self.logits_tile_mib}; expected >= 0 (0 = no tiling)")

  @property
  def term(self) -> LossTerm:
    """The diffusion term `variant` names."""
    return get_loss_term(self.variant)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoisedCanvas:
  """The random draws of one loss evaluation (so an independent implementation can reuse them).

  canvas_index [B] int32, t [B] f32, clean/noisy [B, C] int32, valid/corrupted/pinned [B, C] bool,
  use_sc [B] bool. Pinned positions (tokens known at sampling time) are never corrupted and not in the loss.
  """

  canvas_index: jax.Array
  t: jax.Array
  clean: jax.Array
  noisy: jax.Array
  valid: jax.Array
  corrupted: jax.Array
  use_sc: jax.Array
  pinned: jax.Array

  @property
  def free(self) -> jax.Array:
    """[B, C] bool: the positions the model has to predict (valid and not pinned)."""
    return self.valid & ~self.pinned


def draw_noise(key: jax.Array, batch: SFTBatch, canvas_length: int, vocab_size: int,
               config: LossConfig) -> NoisedCanvas:
  """Chooses a canvas per example, a time, the corruption and the self-conditioning coin."""
  k_canvas, k_time, k_noise, k_sc = jax.random.split(key, 4)
  n_valid = num_valid_canvases(batch.completion_mask, canvas_length)
  index = corruption.choose_canvas(k_canvas, n_valid)
  clean, valid = corruption.gather_canvas(batch.completion_ids, batch.completion_mask, index, canvas_length)
  if batch.completion_pinned is None:
    pinned = jnp.zeros(clean.shape, bool)
  else:
    pinned, _ = corruption.gather_canvas(batch.completion_pinned, batch.completion_mask, index, canvas_length)
    pinned = pinned.astype(bool) & valid
  b = clean.shape[0]
  t = corruption.sample_time(k_time, b, config.time_eps, config.time_min)
  alpha = corruption.get_schedule(config.schedule).alpha(t)
  noisy, corrupted = corruption.corrupt_uniform(k_noise, clean, alpha, vocab_size, protected_mask=pinned)
  use_sc = jax.random.bernoulli(k_sc, config.self_conditioning_prob, (b,))
  return NoisedCanvas(index, t, clean, noisy, valid, corrupted, use_sc, pinned)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [..., V], targets [...] int -> per-position CE `logsumexp(logits) - logits[target]` [...] in fp32.

  The gradient `g * (softmax(logits) - onehot(target))` is written out (one fused pass over the logits): autodiff
  of log_softmax + take_along_axis materialises a scattered one-hot, the softmax and their sum as separate
  `[..., V]` arrays, which at a 32k vocabulary is memory traffic the size of several matmuls on CPU.
  """
  return _cross_entropy_fp32(logits.astype(jnp.float32), targets)  # the cast's own gradient restores the dtype


@jax.custom_vjp
def _cross_entropy_fp32(logits: jax.Array, targets: jax.Array) -> jax.Array:
  return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits: jax.Array, targets: jax.Array):
  lse = jax.nn.logsumexp(logits, axis=-1)  # [...]
  target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return lse - target_logit, (logits, targets, lse)


def _cross_entropy_bwd(residuals, g: jax.Array):
  logits, targets, lse = residuals
  onehot = jnp.arange(logits.shape[-1], dtype=jnp.int32) == targets[..., None].astype(jnp.int32)
  d_logits = g[..., None] * (jnp.exp(logits - lse[..., None]) - onehot.astype(jnp.float32))
  return d_logits, None


_cross_entropy_fp32.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def top1_correct(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [..., V], targets [...] -> [...] bool: the target holds the largest logit (`argmax == target` but for
  exact ties with an earlier token, which count as correct here).

  Written with the maximum and the target's logit that `cross_entropy`'s forward pass computes on the same fp32
  logits, so XLA computes them once: the metric costs no pass over `[..., V]` of its own (an argmax is one more
  read of the logits, a visible share of a train step at a large vocabulary). The tiled head path keeps its tiles'
  argmax (computed there anyway), so on an exact tie the two paths' metrics can differ; the loss never does.
  """
  z = logits.astype(jnp.float32)
  target_logit = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return target_logit >= jnp.max(z, axis=-1)


def uniform_elbo_integrand(logits: jax.Array, clean: jax.Array, noisy: jax.Array, alpha: jax.Array,
                           dalpha: jax.Array) -> jax.Array:
  """Per-position continuous-time NELBO integrand of uniform-state diffusion, `[B, C]`.

  `(beta/N) [N/xbar_theta_z - N/xbar_z + sum_{y != z} (xbar_y/xbar_z) log(xbar_y xbar_theta_z / (xbar_z xbar_theta_y))]`
  with `z` the noisy token, `beta = -alpha'/alpha`. Zero iff the model puts all mass on the clean token.
  logits [B, C, V]; clean/noisy [B, C]; alpha/dalpha [B].
  """
  v = logits.shape[-1]
  a = alpha[:, None, None].astype(jnp.float32)
  log_na = jnp.log(v * a)
  log_1ma = jnp.log1p(-a)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  log_xbar_theta = jnp.logaddexp(log_na + logp, log_1ma)  # log(N a p_y + 1 - a)  [B, C, V]
  onehot = jax.nn.one_hot(clean, v, dtype=jnp.float32)
  log_xbar = jnp.where(onehot > 0, jnp.logaddexp(log_na, log_1ma), log_1ma)  # clean x is one-hot
  z = noisy[..., None].astype(jnp.int32)
  log_xbar_z = jnp.take_along_axis(log_xbar, z, axis=-1)  # [B, C, 1]
  log_xbar_theta_z = jnp.take_along_axis(log_xbar_theta, z, axis=-1)
  not_z = jax.nn.one_hot(noisy, v, dtype=jnp.float32) == 0
  ratio = jnp.exp(log_xbar - log_xbar_z)
  log_term = log_xbar + log_xbar_theta_z - log_xbar_z - log_xbar_theta
  total = jnp.sum(jnp.where(not_z, ratio * log_term, 0.0), axis=-1)
  total = total + v * jnp.exp(-log_xbar_theta_z[..., 0]) - v * jnp.exp(-log_xbar_z[..., 0])
  beta = -dalpha / alpha
  return (beta[:, None] / v) * total


@dataclasses.dataclass
class TiledLogits:
  """The decoder's logits `[B, C, V]` held as final hidden states `[B, C, H]` + the tied head, computed one tile of
  positions at a time on demand (`hackable_diffusion.model.head`), so a term never needs all of them at once.

  `cross_entropy(targets)` is computed once per targets array and shared (the loss and the accuracy metrics use it).
  """

  hidden: jax.Array  # [B, C, H]
  embed: jax.Array  # [V, H]
  spec: head.HeadSpec
  _memo: list = dataclasses.field(default_factory=list)

  def cross_entropy(self, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """targets [B, C] -> (CE [B, C] fp32, argmax [B, C] int32)."""
    for seen, out in self._memo:
      if seen is targets:
        return out
    out = head_parallel.cross_entropy(self.hidden, self.embed, targets, self.spec)
    self._memo.append((targets, out))
    return out

  def positionwise(self, fn: Callable[..., jax.Array], *per_position: jax.Array) -> jax.Array:
    """`fn(logits [B, l, V], *tiles of per_position [B, l]) -> [B, l]` over tiles -> [B, C]."""
    return head.positionwise(fn, self.hidden, self.embed, self.spec, *per_position)

  def materialize(self) -> jax.Array:
    """All logits [B, C, V] fp32 at once (for a term without a tiled form)."""
    return head.logits(self.hidden, self.embed, self.spec)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of `values` over the True positions of `mask` (same shape) -> scalar; 0 for an empty mask."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# ---- diffusion terms -------------------------------------------------------------------------------------------
class LossTerm(Protocol):
  """The diffusion term of the loss on the chosen canvas.

  `logits [B, C, V]` (the denoiser's output on `noise.noisy`), `noise` (the draws: clean/noisy/free/corrupted
  `[B, C]`, t `[B]`), `schedule` (alpha(t), dalpha(t)) -> a scalar to minimise, averaged over the positions the
  model has to predict (`noise.free`). Implementations are frozen dataclasses; a researcher's own is named in a
  config as 'package.module:Factory' (`Factory()` returns it).
  """

  def __call__(self, logits: jax.Array, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    ...


class TiledLossTerm(LossTerm, Protocol):
  """A `LossTerm` that can also be computed from `TiledLogits` (the loss then never holds `[B, C, V]` logits when
  the vocabulary is large; a term without `tiled` gets `TiledLogits.materialize()` there)."""

  def tiled(self, logits: TiledLogits, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    ...


@dataclasses.dataclass(frozen=True)
class FlatCrossEntropy:
  """'flat': mean cross-entropy over every free position of the canvas, corrupted or not, no 1/t weight."""

  def __call__(self, logits: jax.Array, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    return masked_mean(cross_entropy(logits, noise.clean), noise.free)

  def tiled(self, logits: TiledLogits, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    return masked_mean(logits.cross_entropy(noise.clean)[0], noise.free)


@dataclasses.dataclass(frozen=True)
class CorruptedCrossEntropy:
  """'corrupted': mean cross-entropy over the free positions that were resampled (MDLM-style)."""

  def __call__(self, logits: jax.Array, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    return masked_mean(cross_entropy(logits, noise.clean), noise.free & noise.corrupted)

  def tiled(self, logits: TiledLogits, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    return masked_mean(logits.cross_entropy(noise.clean)[0], noise.free & noise.corrupted)


@dataclasses.dataclass(frozen=True)
class UniformStateELBO:
  """'elbo': mean continuous-time NELBO integrand of uniform-state diffusion over the free positions (UDLM)."""

  def __call__(self, logits: jax.Array, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    integrand = uniform_elbo_integrand(logits, noise.clean, noise.noisy, schedule.alpha(noise.t),
                                       schedule.dalpha(noise.t))
    return masked_mean(integrand, noise.free)

  def tiled(self, logits: TiledLogits, noise: NoisedCanvas, schedule: corruption.Schedule) -> jax.Array:
    per_row = lambda x: jnp.broadcast_to(x[:, None], noise.clean.shape)  # noqa: E731 - [B] -> [B, C]
    integrand = logits.positionwise(
        lambda z, clean, noisy, alpha, dalpha: uniform_elbo_integrand(z, clean, noisy, alpha[:, 0], dalpha[:, 0]),
        noise.clean, noise.noisy, per_row(schedule.alpha(noise.t)), per_row(schedule.dalpha(noise.t)))
    return masked_mean(integrand, noise.free)


LOSS_TERMS: Mapping[str, Callable[[], LossTerm]] = types.MappingProxyType({
    "flat": FlatCrossEntropy,
    "corrupted": CorruptedCrossEntropy,
    "elbo": UniformStateELBO,
})


def get_loss_term(variant: str) -> LossTerm:
  """The term a `LOSS_TERMS` name, an installed `hackable_diffusion.loss_terms` plugin or 'package.module:Factory'
  names (`specs.resolve`); a one-line `ConfigError` if none."""
  if variant in LOSS_TERMS:
    return LOSS_TERMS[variant]()
  factory = specs.resolve("loss_terms", variant, what="diffusion.loss_variant", builtins=LOSS_TERMS,
                          unknown=f"diffusion.loss_variant={variant!r}; expected one of {tuple(LOSS_TERMS)}, an "
                                  "installed plugin or 'package.module:Factory'")
  if not callable(factory):
    raise ConfigError(f"diffusion.loss_variant={variant!r} is a {type(factory).__name__}, not a class or function")
  try:
    term = factory()
  except TypeError as e:
    raise ConfigError(f"diffusion.loss_variant={variant!r}: calling it with no arguments failed ({e})") from None
  if not callable(term):
    raise ConfigError(f"diffusion.loss_variant={variant!r}: calling it must return a LossTerm "
                      "(a callable (logits, noise, schedule) -> scalar)")
  return term


def batch_image_features(model, pixel_values: jax.Array, image_position_ids: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
  """pixel_values [B, M, P, D], image_position_ids [B, M, P, 2] -> the model's `image_features` of the B * M images
  in example order ([B * M, P / k^2, H], mask [B * M, P / k^2]), the mask False on every slot of an empty (all
  padding) image, so padding images give no soft tokens."""
  b, m = pixel_values.shape[:2]
  pixels = pixel_values.reshape(b * m, *pixel_values.shape[2:])
  positions = image_position_ids.reshape(b * m, *image_position_ids.shape[2:]).astype(jnp.int32)
  features, mask = model.image_features(pixels, positions)
  real = jnp.any(positions >= 0, axis=(1, 2))  # [B * M]
  return features, mask & real[:, None]


def diffusion_loss(model, batch: SFTBatch, key: jax.Array, config: LossConfig,
                   noise: NoisedCanvas | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total loss (scalar) and metrics for one batch. `noise` overrides the random draws (tests)."""
  cfg = model.config
  c, v = cfg.canvas_length, cfg.vocab_size
  prompt_len = batch.prompt_ids.shape[1]
  width = batch.completion_ids.shape[1]
  if noise is None:
    noise = draw_noise(key, batch, c, v, config)

  # Encoder: causal over prompt + clean completion; writes the cache the decoder reads. Without the AR term the
  # last canvas is never context for a decoder, so it is not encoded (a single-canvas task encodes the prompt only).
  context = width if config.encoder_ar_weight > 0 else width - c
  ids = jnp.concatenate([batch.prompt_ids, batch.completion_ids[:, :context]], axis=1).astype(jnp.int32)
  mask = jnp.concatenate([batch.prompt_mask, batch.completion_mask[:, :context]], axis=1).astype(bool)
  cache = model.init_cache(ids.shape[0], ids.shape[1])
  if batch.pixel_values is None:
    hidden, cache = model.encode(ids, cache, mask)
  else:
    images = batch_image_features(model, batch.pixel_values, batch.image_position_ids)
    hidden, cache = model.encode(ids, cache, mask, image_features=images)
  if not config.encoder_gradients:
    cache = jax.lax.stop_gradient(cache)  # the encoder runs forward only
  metrics: dict[str, jax.Array] = {}
  if config.encoder_ar_weight > 0:
    ar_hidden = hidden[:, prompt_len - 1: prompt_len + width - 1]  # [B, W, H]: predicts the completion tokens
    ar_spec = model.head_spec(ar_hidden.shape[0], width, config.logits_tile_mib)
    if ar_spec.tile >= width:
      ar_ce = cross_entropy(model.lm_logits(ar_hidden), batch.completion_ids)
    else:
      ar_ce = head_parallel.cross_entropy(ar_hidden, model.embed_tokens[...], batch.completion_ids, ar_spec)[0]
    ar_loss = masked_mean(ar_ce, batch.completion_mask)
  else:
    ar_loss = jnp.zeros((), jnp.float32)

  # Decoder: the chosen canvas sees the prompt and the clean canvases before it.
  # Slots past the last canvas's prefix (prompt + all but one canvas) are never visible to a decoder: cut them.
  dec_cache = cache.truncated(prompt_len + width - c).replace(
      length=(prompt_len + noise.canvas_index * c).astype(jnp.int32))
  spec = model.head_spec(noise.noisy.shape[0], c, config.logits_tile_mib)
  schedule = corruption.get_schedule(config.schedule)
  if spec.tile >= c:  # one tile: the logits as they are
    if config.self_conditioning_prob > 0:
      first = model.decode(noise.noisy, dec_cache)
      for _ in range(config.self_conditioning_passes - 1):
        first = model.decode(noise.noisy, dec_cache, first)
      logits = model.decode(noise.noisy, dec_cache, jax.lax.stop_gradient(first), noise.use_sc)
    else:
      logits = model.decode(noise.noisy, dec_cache)
    diff_loss = config.term(logits, noise, schedule)
    correct = top1_correct(logits, noise.clean)
  else:
    embed = model.embed_tokens[...]
    soft = None
    if config.self_conditioning_prob > 0:
      soft = head_parallel.soft_embeddings(model.decode_hidden(noise.noisy, dec_cache), embed, spec)
      for _ in range(config.self_conditioning_passes - 1):
        soft = head_parallel.soft_embeddings(model.decode_hidden(noise.noisy, dec_cache, soft), embed, spec)
    tiled = TiledLogits(model.decode_hidden(noise.noisy, dec_cache, soft, noise.use_sc), embed, spec)
    term = config.term
    diff_loss = term.tiled(tiled, noise, schedule) if hasattr(term, "tiled") else term(tiled.materialize(), noise,
                                                                                      schedule)
    correct = tiled.cross_entropy(noise.clean)[1] == noise.clean

  free = noise.free
  loss = diff_loss + config.encoder_ar_weight * ar_loss
  metrics.update(
      loss=loss,
      diffusion_loss=diff_loss,
      ar_loss=ar_loss,
      accuracy_corrupted=masked_mean(correct.astype(jnp.float32), noise.valid & noise.corrupted),
      accuracy=masked_mean(correct.astype(jnp.float32), free),
      num_tokens=jnp.sum(free.astype(jnp.float32)),
  )
  return loss, metrics
