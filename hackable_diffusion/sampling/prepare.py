"""`prepare`: every input of a `generate` call (one `GenerateRequest`) validated and normalised into one `Prepared`.

Checks (one-line `ValueError`s naming the argument and the bad value or shape): the config type, the PRNG key,
token ids inside the vocabulary, 2-D integer ids, mask shapes and values, seed canvases of whole canvases no longer
than the generation, pins only with a seed canvas and of its shape, a non-empty allowed set (ids or a `[V]` /
`[B, V]` mask), the task structure's shape, a callable callback, a valid acceptance rule (`ConfigError`), a
mesh that can split the batch, and images the model can take (one image token per soft token of the images).
Nothing is placed on a device here; `generate` does that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hackable_diffusion import sharding as sharding_lib
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.model import structure as structure_lib
from hackable_diffusion.model import vision
from hackable_diffusion.sampling import checker as checker_lib
from hackable_diffusion.sampling import rules
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.denoise import DenoiseStatic, StepInfo

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class GenerateRequest:
  """The inputs of one `generate` call as given, before any check (the meaning of each: `generate`'s arguments).

  What `prepare` takes: `generate` builds one from its arguments, `generate_stream` one per row.
  """

  input_ids: Any
  rng: Array
  config: SamplingConfig | None = None
  attention_mask: Any = None
  seed_canvas: Any = None
  pinned: Any = None
  allowed_token_ids: Sequence[int] | Any = None
  canvas_attention_mask: Any = None
  acceptance: rules.AcceptanceRule | None = None
  checker: Any = None
  callback: Callable[[StepInfo], Any] | None = None
  return_trajectory: bool = False
  mesh: Mesh | None = None
  pixel_values: Any = None
  image_position_ids: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Prepared:
  """The validated inputs of one `generate` call (host numpy arrays unless noted).

  rng: the call's key; row_keys: `[B, ...]` uint32 key data when `rng` holds one key per row (the per-row loop,
  `sampling.denoise_rows`), else None; key_impl: the keys' implementation name.
  config: the `SamplingConfig`, resolved against the model (eos / pad / canvas length filled in).
  input_ids: `[B, P]` int32. attention_mask: `[B, P]` bool, False on prompt padding.
  seed_canvas: `[B, k * C]` int32 or None. pinned: `[B, k * C]` bool or None (only with a seed canvas).
  allowed: `[B, V]` bool or None. structure: `[B|1, N|1, C, P + C]` bool jax array or None.
  rule: the acceptance rule; rule_arg: the rule with its leaves as traced-ready arrays (None for a static rule).
  checker_arg: the checker and its restart settings as the loop's traced argument (`checker.CheckerArg`), or None.
  static: the options that select the compiled denoising program.
  pixel_values: `[N, P, 3 p^2]` float32 and image_position_ids: `[N, P, 2]` int32, the prompts' images (None:
  none), checked against the prompts' image tokens.
  """

  config: SamplingConfig
  vocab_size: int
  rng: Array
  row_keys: np.ndarray | None
  key_impl: str
  input_ids: np.ndarray
  attention_mask: np.ndarray
  seed_canvas: np.ndarray | None
  pinned: np.ndarray | None
  allowed: np.ndarray | None
  structure: Array | None
  rule: rules.AcceptanceRule
  rule_arg: Any
  checker_arg: Any
  callback: Callable[[StepInfo], Any] | None
  return_trajectory: bool
  mesh: Mesh | None
  static: DenoiseStatic
  pixel_values: np.ndarray | None = None
  image_position_ids: np.ndarray | None = None

  # ---- derived ----------------------------------------------------------------------------------------------------
  @property
  def batch(self) -> int:
    return self.input_ids.shape[0]

  @property
  def prompt_length(self) -> int:
    return self.input_ids.shape[1]

  @property
  def canvas_length(self) -> int:
    return self.config.canvas_length

  @property
  def num_canvases(self) -> int:
    return self.config.num_canvases()

  @property
  def eos_ids(self) -> np.ndarray:
    """`[E]` int64, the EOS ids (empty when there is none)."""
    return np.asarray(self.config.eos_token_ids, np.int64)

  @property
  def pad_token_id(self) -> int | None:
    return self.config.pad_token_id

  @property
  def bucket_length(self) -> int:
    return self.config.bucket_prompt_length(self.prompt_length)

  @property
  def cache_capacity(self) -> int:
    """KV-cache slots: the bucketed prompt and every canvas but the last (which is never encoded)."""
    return self.bucket_length + (self.num_canvases - 1) * self.canvas_length

  def padded_prompt(self) -> tuple[np.ndarray, np.ndarray]:
    """(ids `[B, bucket]` int32, mask `[B, bucket]` bool): the prompt padded *after* its tokens to its bucket.

    The encoder writes the padding slots as padding and the cache length is rewound to the prompt length, so the
    next canvas overwrites them and positions are exactly those of the unpadded prompt.
    """
    ids = np.zeros((self.batch, self.bucket_length), np.int32)
    ids[:, :self.prompt_length] = self.input_ids
    mask = np.zeros((self.batch, self.bucket_length), bool)
    mask[:, :self.prompt_length] = self.attention_mask
    return ids, mask

  def canvas_seed(self, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(seed `[B, C]` int32, pins `[B, C]` bool, whether canvas `k` starts from the seed)."""
    c = self.canvas_length
    has_seed = self.seed_canvas is not None and (k + 1) * c <= self.seed_canvas.shape[1]
    if not has_seed:
      return np.zeros((self.batch, c), np.int32), np.zeros((self.batch, c), bool), False
    sl = slice(k * c, (k + 1) * c)
    pins = self.pinned[:, sl] if self.pinned is not None else np.zeros((self.batch, c), bool)
    return self.seed_canvas[:, sl], pins, True


# ---- checks -------------------------------------------------------------------------------------------------------
def _int_array(name: str, value: Any, ndim: int) -> np.ndarray:
  arr = np.asarray(value)
  if arr.ndim != ndim or not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool):
    raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape} dtype {arr.dtype}")
  return arr.astype(np.int64)


def _check_ids(name: str, arr: np.ndarray, vocab: int) -> None:
  if arr.size and (arr.min() < 0 or arr.max() >= vocab):
    bad = arr.min() if arr.min() < 0 else arr.max()
    raise ValueError(f"{name} holds token id {int(bad)} outside the vocabulary [0, {vocab})")


def _bool_array(name: str, value: Any, shape: tuple[int, ...], like: str) -> np.ndarray:
  arr = np.asarray(value)
  if arr.shape != shape:
    raise ValueError(f"{name} has shape {arr.shape}, expected {shape} (the shape of {like})")
  if not (arr.dtype == bool or np.isin(arr, (0, 1)).all()):
    raise ValueError(f"{name} must be bool or hold only 0 and 1")
  return arr.astype(bool)


def _allowed_mask(allowed: Any, batch: int, vocab: int) -> np.ndarray:
  arr = np.asarray(allowed)
  if arr.size == 0:
    raise ValueError("allowed_token_ids is empty: at least one token must be allowed")
  if arr.dtype == bool:
    if arr.shape not in ((vocab,), (batch, vocab)):
      raise ValueError(f"allowed_token_ids as a mask must have shape ({vocab},) or ({batch}, {vocab}), got {arr.shape}")
    mask = np.broadcast_to(arr, (batch, vocab))
    empty = np.flatnonzero(~mask.any(-1))
    if empty.size:
      raise ValueError(f"allowed_token_ids mask allows no token for row {int(empty[0])}")
    return np.ascontiguousarray(mask)
  if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"allowed_token_ids must be a sequence of ids or a bool mask, got shape {arr.shape} "
                     f"dtype {arr.dtype}")
  _check_ids("allowed_token_ids", arr, vocab)
  mask = np.zeros((batch, vocab), bool)
  mask[:, arr] = True
  return mask


def _check_key(rng: Any, batch: int) -> tuple[np.ndarray | None, str]:
  """Checks `rng`: one key, or one key per row (`[B]` typed keys / `[B, 2]` uint32). Returns (the per-row key data
  `[B, ...]` uint32 or None for a single key, the key implementation's name)."""
  is_typed = isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  is_raw = isinstance(rng, jax.Array) and rng.dtype == jnp.uint32 and rng.ndim in (1, 2) and rng.shape[-1] == 2
  if is_typed and rng.ndim == 0 or is_raw and rng.ndim == 1:
    return None, str(jax.random.key_impl(rng)) if is_typed else "threefry2x32"
  if is_typed and rng.shape == (batch,) or is_raw and rng.shape == (batch, 2):
    data = jax.random.key_data(rng) if is_typed else rng
    return np.asarray(data), str(jax.random.key_impl(rng)) if is_typed else "threefry2x32"
  raise ValueError(f"rng must be a jax.random key (e.g. jax.random.key(0)) or one key per row (shape ({batch},)), "
                   f"got {type(rng).__name__} with shape {getattr(rng, 'shape', None)}")


def _check_mesh(mesh: Any, batch: int) -> None:
  if mesh is None:
    return
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh (see sharding.make_mesh), got {type(mesh).__name__}")
  shards = sharding_lib.num_batch_shards(mesh)
  if batch % shards:
    raise ValueError(f"generate: batch of {batch} rows is not divisible by the {shards} batch shards of mesh "
                     f"{dict(mesh.shape)} (data x fsdp x expert); pad the batch to a multiple of {shards}")


def _rule(config: SamplingConfig, acceptance: Any) -> tuple[rules.AcceptanceRule, Any]:
  """(the rule, its traced argument or None when it is static)."""
  rule = config.acceptance_rule() if acceptance is None else acceptance
  rules.check_rule(rule)
  if rules.is_static(rule):
    return rule, None
  return rule, jax.tree.map(lambda v: rules.traced_leaf(v, "acceptance: rule"), rule)


def _checker(config: SamplingConfig, checker: Any, trajectory: bool) -> tuple[Any, dict[str, Any]]:
  """(the loop's traced checker argument or None, the `DenoiseStatic` checker fields). Checker options without a
  checker, and restarts with a trajectory, are one-line errors."""
  if checker is None:
    if config.uses_checker:
      raise ValueError("generate: SamplingConfig sets checker_* options but no checker was given "
                       "(generate(..., checker=...), or a task's checker hook)")
    return None, {}
  try:
    arg = checker_lib.checker_arg(checker, config.checker_restarts, config.checker_budget())
  except ConfigError as e:
    raise ConfigError(f"generate: {e}") from None
  restarts = config.checker_restarts > 0
  if restarts and trajectory:
    raise ValueError("generate: return_trajectory cannot be combined with SamplingConfig.checker_restarts > 0 "
                     "(restarted rows have no single trajectory)")
  return arg, dict(has_checker=True, static_checker=checker if arg.checker is None else None,
                   checker_confidence=config.checker_confidence, checker_forget=config.checker_forget,
                   checker_restarts=restarts)


# ---- prepare ------------------------------------------------------------------------------------------------------
def _check_structured_prompt(model: Any, structure: Array | None, mask: np.ndarray, canvas_len: int) -> None:
  """A one-line error when an attention structure constrains the first `P` prompt slots and a row has padding
  there: its prompt is shorter than the batch's, so left padding moved its tokens out of the slots the structure
  addresses (e.g. a Sudoku grid read by the own-cell head)."""
  if structure is not None:
    width = structure.shape[-1] - canvas_len
  elif getattr(model.config, "attention_structure", None) is not None:
    width = structure_lib.prompt_width(model.config)
  else:
    return
  padded = ~mask[:, :width]
  if padded.any():
    row, slot = (int(i) for i in np.argwhere(padded)[0])
    raise ValueError(f"the attention structure constrains the first {width} prompt slots, but row {row} has left "
                     f"padding in slot {slot} (its prompt is {int(mask[row].sum())} tokens, the batch's "
                     f"{mask.shape[1]}): every prompt needs real tokens in those slots")


def prepare(model: Any, request: GenerateRequest) -> Prepared:
  """Validates and normalises the inputs of one `generate` call into a `Prepared`."""
  r = request
  if r.config is not None and not isinstance(r.config, SamplingConfig):
    raise ValueError(f"config must be a SamplingConfig, got {type(r.config).__name__}")
  config = (r.config or SamplingConfig()).resolve(model.config)
  vocab = int(model.config.vocab_size)
  ids = _int_array("input_ids", r.input_ids, 2)
  batch, prompt_len = ids.shape
  if batch == 0 or prompt_len == 0:
    raise ValueError(f"input_ids must have at least one row and one token, got shape {ids.shape}")
  row_keys, key_impl = _check_key(r.rng, batch)
  if row_keys is not None and r.return_trajectory:
    raise ValueError("generate: return_trajectory needs a single rng key (not one key per row)")
  _check_ids("input_ids", ids, vocab)
  mask = np.ones(ids.shape, bool)
  if r.attention_mask is not None:
    mask = _bool_array("attention_mask", r.attention_mask, ids.shape, "input_ids")
  canvas_len = config.canvas_length
  num_canvases = config.num_canvases()
  seeds = None
  if r.seed_canvas is not None:
    seeds = _int_array("seed_canvas", r.seed_canvas, 2)
    if seeds.shape[0] != batch or seeds.shape[1] == 0 or seeds.shape[1] % canvas_len \
        or seeds.shape[1] > num_canvases * canvas_len:
      raise ValueError(f"seed_canvas has shape {seeds.shape}; expected ({batch}, k * {canvas_len}) with "
                       f"1 <= k <= {num_canvases} canvases")
    _check_ids("seed_canvas", seeds, vocab)
  pins = None
  if r.pinned is not None:
    if seeds is None:
      raise ValueError("pinned was given without seed_canvas: pinned positions keep their seed_canvas token")
    pins = _bool_array("pinned", r.pinned, seeds.shape, "seed_canvas")
  allowed = None if r.allowed_token_ids is None else _allowed_mask(r.allowed_token_ids, batch, vocab)
  structure = None
  if r.canvas_attention_mask is not None:
    structure = jnp.asarray(r.canvas_attention_mask, bool)
    if structure.ndim != 4 or structure.shape[-2] != canvas_len or structure.shape[-1] < canvas_len:
      raise ValueError(f"canvas_attention_mask has shape {structure.shape}, expected [B|1, N|1, {canvas_len}, "
                       f"P + {canvas_len}]")
  _check_structured_prompt(model, structure, mask, canvas_len)
  if r.callback is not None and not callable(r.callback):
    raise ValueError(f"callback must be callable, got {type(r.callback).__name__}")
  rule, rule_arg = _rule(config, r.acceptance)
  _check_mesh(r.mesh, batch)
  pixels = positions = None
  if r.pixel_values is not None:
    pixels, positions = vision.check_image_tokens(model.config, ids, r.pixel_values, r.image_position_ids)
  elif r.image_position_ids is not None:
    raise ValueError("image_position_ids was given without pixel_values")
  checker_arg, checker_static = _checker(config, r.checker, r.return_trajectory)
  if checker_static.get("checker_restarts") and row_keys is None:  # restarts are the per-row loop's: one key per row
    keys = jax.random.split(r.rng, batch)
    row_keys = np.asarray(jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys)
  static = DenoiseStatic(
      vocab_size=vocab,
      stability_threshold=config.stability_threshold,
      has_pins=pins is not None,
      has_allowed=allowed is not None,
      has_structure=structure is not None,
      static_rule=rule if rule_arg is None else None,
      has_callback=r.callback is not None,
      trajectory_steps=config.max_denoising_steps if r.return_trajectory else None,
      self_conditioning=config.self_conditioning,
      **checker_static,
  )
  return Prepared(
      config=config, vocab_size=vocab, rng=r.rng, row_keys=row_keys, key_impl=key_impl,
      input_ids=ids.astype(np.int32), attention_mask=mask,
      seed_canvas=None if seeds is None else seeds.astype(np.int32), pinned=pins, allowed=allowed,
      structure=structure, rule=rule, rule_arg=rule_arg, checker_arg=checker_arg, callback=r.callback,
      return_trajectory=bool(r.return_trajectory), mesh=r.mesh, static=static, pixel_values=pixels,
      image_position_ids=positions)


__all__ = ["GenerateRequest", "Prepared", "prepare"]
