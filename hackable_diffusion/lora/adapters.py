"""LoRA adapters added from the outside: `LoraConfig` + `apply_lora(model, config, rngs=...)`.

Targeted `nnx.Linear` submodules are replaced by `LoRALinear`, a subclass that keeps the original `kernel` Param
(same object, same path `...q_proj.kernel`) and adds `lora_a [in, r]` and `lora_b [r, out]` as `nnx.LoRAParam`:

    y = x @ kernel + (dropout(x) @ lora_a @ lora_b) * alpha / r

Expert tensors (3-D Params `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) get per-expert factors with the
semantics of PEFT's `target_parameters` (`peft.tuners.lora.layer.ParamWrapper`, peft 0.21): for a Param `W` of
shape `[E, out, in]` (the row-major `F.linear` layout transformers uses), `W[e] + scale * (A[e] @ B[e]).T` with
`A: [E, in, r]`, `B: [E, r, out]` (see `hackable_diffusion.interop.peft` for the exact PEFT tensor layout).

Base parameter paths are unchanged, so a checkpoint of the base loads into the wrapped model, and "train only
the adapters" is the optimizer filter `nnx.LoRAParam`. Initialisation follows PEFT: `B = 0` (the wrapped model
computes exactly the base logits), `A ~ U(-1/sqrt(in), 1/sqrt(in))` (PEFT's `kaiming_uniform_(a=sqrt(5))`).
Scale = `alpha / rank` (PEFT's default, not rsLoRA). One adapter serves encoder and decoder mode: the weights are
shared, so is the adapter.

Dropout (on the adapter input, as PEFT) needs an explicit key and is off otherwise: the train step passes one with
`rest = set_dropout_key(rest, key)` on the non-trainable state *before* differentiating (a pure tree update; NNX
forbids mutating variables inside `jax.grad`). Evaluation and sampling never set a key, so they see no dropout.
Each adapter folds its own index into the key. Expert adapters have no dropout (PEFT cannot express it either).

The vision tower's projections and its projector are `ClippableLinear`s (transformers' `Gemma4ClippableLinear`: an
`nn.Linear` between an input and an output clamp). A targeted one becomes `LoRAClippableLinear`, whose update is
added between the clamps: `clip_out(clip_in(x) @ kernel + lora(clip_in(x)))`, what peft computes when it wraps the
inner `...q_proj.linear`. They are selected only by a `target_modules` entry naming `vision_tower` or
`embed_vision` (`targets.entry_matches`; e.g. `VISION_TARGETS`), so the tower stays frozen by default.

QLoRA (`LoraConfig.base_quantization='fp8' | 'int4' | 'nvfp4'`): `apply_lora` first quantizes the base
(`lora.qlora`: every linear layer but the router, and the experts; a base already quantized, e.g. by
`interop.qlora_load`, is kept) and wraps the quantized modules with `QLoRALinear` / `QLoRAExperts`: the same
adapters on a base dequantized inside the layer's forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.lora import qlora
from hackable_diffusion.model import moe
from hackable_diffusion.model import scan
from hackable_diffusion.model.vision_layers import ClippableLinear
from hackable_diffusion.targets import entry_matches, is_module_name, is_vision_target

Array = jax.Array
ALL_LINEAR = "all-linear"
# attention q/k/v/o and the dense MLP of every layer; not the router, the experts or the self-conditioning MLP
DEFAULT_TARGETS = (r"^layers\.\d+\.self_attn\.(q|k|v|o)_proj$", r"^layers\.\d+\.mlp\.(gate|up|down)_proj$")
# the vision tower's linears (attention, MLP, patch embedding) and its projector into the text model
VISION_TARGETS = (r"^vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|o)|mlp\.(gate|up|down))_proj$",
                  r"^vision_tower\.patch_embedder\.input_proj$", r"^embed_vision\.embedding_projection$")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # also the nesting order of PEFT's ParamWrappers
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Which modules get adapters and how large they are.

  rank: r >= 1. alpha: scale numerator (scale = alpha / rank). dropout: on the adapter input, in [0, 1).
  r / lora_alpha / lora_dropout: PEFT's names of rank / alpha / dropout (init-only aliases; giving both names with
    different values is a ConfigError).
  target_modules: which adaptable paths get adapters. Paths are dotted, e.g. `layers.3.self_attn.q_proj`,
    `layers.3.mlp.down_proj`, `layers.3.router.proj`, `layers.3.experts.gate_up_proj` (3-D expert Params),
    `self_conditioning.mlp.gate_proj`, `vision_tower.encoder.layers.0.self_attn.q_proj`,
    `vision_tower.patch_embedder.input_proj` or `embed_vision.embedding_projection`. Vision paths are selected only by
    entries containing `vision_tower` / `embed_vision` (`VISION_TARGETS`, or the names themselves). Each entry of
    a list/tuple is one of:
    - `"all-linear"`: every linear layer of the text model except the router, including the self-conditioning MLP;
      experts and the vision tower excluded;
    - a module name (letters, digits, `_` and `.` only), as PEFT matches a list: a path is selected when it, or
      the path of a module containing it, equals the name or ends with "." + name (`["q_proj", "v_proj"]`;
      `"experts"` selects the expert Params, `"self_attn"` every attention projection);
    - any other string: a regex searched (`re.search`) in the path.
    A single string other than "all-linear" is a regex that must match the whole path, as PEFT's `str` form
    (stored as the anchored regex `^(?:...)$`). Every entry must select something.
  param_dtype: dtype of the adapter parameters (float32 keeps small updates of a bf16 model exact).
  base_quantization: 'none' (the base as it is), 'fp8', 'int4' or 'nvfp4' (QLoRA: the frozen base quantized on the
    device, dequantized inside each layer's forward; see `lora.qarrays`). base_block_size: input elements per int4
    scale (NVFP4's blocks are 16).
  """

  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  target_modules: tuple[str, ...] = DEFAULT_TARGETS
  param_dtype: str = "float32"
  base_quantization: str = qlora.NONE
  base_block_size: int = 64
  r: dataclasses.InitVar[int | None] = None
  lora_alpha: dataclasses.InitVar[float | None] = None
  lora_dropout: dataclasses.InitVar[float | None] = None

  def __post_init__(self, r: int | None, lora_alpha: float | None, lora_dropout: float | None):
    for alias, name, value in (("r", "rank", r), ("lora_alpha", "alpha", lora_alpha),
                               ("lora_dropout", "dropout", lora_dropout)):
      if value is None:
        continue
      given, default = getattr(self, name), _FIELD_DEFAULTS[name]
      if given != default and given != value:
        raise ConfigError(f"LoraConfig.{alias}={value!r} and {name}={given!r} disagree: give one of the two names")
      object.__setattr__(self, name, value)
    if isinstance(self.target_modules, str):
      one = self.target_modules
      object.__setattr__(self, "target_modules", (one if one == ALL_LINEAR or not one else f"^(?:{one})$",))
    elif isinstance(self.target_modules, (list, tuple, set, frozenset)):
      object.__setattr__(self, "target_modules", tuple(self.target_modules))
    else:
      raise ConfigError(f"LoraConfig.target_modules={self.target_modules!r} is invalid: expected a list of module "
                        "names / regexes, one regex string, or 'all-linear'")
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ConfigError(f"LoraConfig.rank={self.rank!r} is invalid: must be an integer >= 1 (rank 0 adds no adapter)")
    if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not (
        math.isfinite(self.alpha) and self.alpha > 0):
      raise ConfigError(f"LoraConfig.alpha={self.alpha!r} is invalid: must be a finite number > 0")
    if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
      raise ConfigError(f"LoraConfig.dropout={self.dropout!r} is invalid: must be in [0, 1)")
    if not self.target_modules:
      raise ConfigError("LoraConfig.target_modules is empty: give module names, regexes over module paths or "
                        "'all-linear'")
    for pattern in self.target_modules:
      if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"LoraConfig.target_modules entry {pattern!r} is invalid: expected a non-empty regex")
      if pattern != ALL_LINEAR:
        try:
          re.compile(pattern)
        except re.error as e:
          raise ConfigError(f"LoraConfig.target_modules entry {pattern!r} is not a valid regex ({e})") from None
    if self.param_dtype not in _DTYPES:
      raise ConfigError(f"LoraConfig.param_dtype={self.param_dtype!r} is invalid: expected one of {_DTYPES}")
    if self.base_quantization not in qlora.MODES:
      raise ConfigError(f"LoraConfig.base_quantization={self.base_quantization!r} is invalid: expected one of "
                        f"{qlora.MODES}")
    if not isinstance(self.base_block_size, int) or isinstance(self.base_block_size, bool) or self.base_block_size < 1:
      raise ConfigError(f"LoraConfig.base_block_size={self.base_block_size!r} is invalid: expected an integer >= 1")

  @property
  def quantization(self) -> qlora.QuantizationSpec | None:
    """The base quantization (`lora.qlora`), None for 'none'."""
    if self.base_quantization == qlora.NONE:
      return None
    return qlora.QuantizationSpec(mode=self.base_quantization, block_size=self.base_block_size)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LoraConfig)}
# ---- adapter modules --------------------------------------------------------------------------------------------
def _axes(var: nnx.Variable) -> tuple[Any, ...] | None:
  return var.get_metadata().get("out_sharding")


def _lora_param(value: Array, axes: tuple[Any, ...] | None) -> nnx.LoRAParam:
  with nnx.use_eager_sharding(False):
    return nnx.LoRAParam(value, out_sharding=axes) if axes is not None else nnx.LoRAParam(value)


class LoRADropoutKey(nnx.Variable):
  """The dropout key of a step, shared by every adapter: uint32 `[*key_data, on]` (`on` = 0: no dropout)."""


def _dropout_off() -> Array:
  return jnp.zeros((jax.random.key_data(jax.random.key(0)).size + 1,), jnp.uint32)


def set_dropout_key(target: Any, key: Array | None) -> Any:
  """Turns adapter dropout on with `key` (a `jax.random.key`), or off with None.

  `target`: an `nnx.State` (returns an updated copy: use this inside a jitted step, before `jax.grad`) or a
  module (updated in place, outside transformations). A target without dropout adapters is returned unchanged.
  """
  value = _dropout_off() if key is None else jnp.concatenate(
      [jax.random.key_data(key).reshape(-1).astype(jnp.uint32), jnp.ones((1,), jnp.uint32)])
  if isinstance(target, nnx.Module):
    for _, var in nnx.iter_graph(target):
      if isinstance(var, LoRADropoutKey):
        var.value = value
    return target
  return jax.tree.map(lambda v: v.replace(value) if isinstance(v, LoRADropoutKey) else v, target,
                      is_leaf=lambda v: isinstance(v, nnx.Variable))


def _adapter_input(x: Array, rate: float, key_var: LoRADropoutKey | None, index: int) -> Array:
  """`x` with adapter dropout applied when the shared key is on (PEFT's dropout on the adapter input)."""
  if rate <= 0:
    return x
  data = key_var[...]
  key = jax.random.fold_in(jax.random.wrap_key_data(data[:-1]), index)
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  dropped = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
  return jnp.where(data[-1] > 0, dropped, x)


def _set_factors(module: Any, kernel: nnx.Variable, lora_a: Array, lora_b: Array, scale: float, dropout: float,
                 dropout_key: LoRADropoutKey | None, dropout_index: int) -> None:
  """The adapter state of a 2-D adapter module (`LoRALinear`, `LoRAClippableLinear`) whose `in_features` /
  `out_features` are set: factors `lora_a [in, r]`, `lora_b [r, out]` sharded like `kernel`'s axes, scale, dropout."""
  if lora_a.shape[0] != module.in_features or lora_b.shape[1] != module.out_features:
    raise ValueError(f"lora_a {lora_a.shape} / lora_b {lora_b.shape} do not fit a [{module.in_features}, "
                     f"{module.out_features}] kernel")
  module.rank, module.scale, module.dropout_rate = lora_a.shape[1], float(scale), float(dropout)
  if dropout > 0 and dropout_key is None:
    raise ValueError(f"{type(module).__name__} with dropout needs the shared LoRADropoutKey variable")
  module.dropout_key = dropout_key if dropout > 0 else None
  module.dropout_index = int(dropout_index)
  axes = _axes(kernel) or (None, None)
  module.lora_a = _lora_param(lora_a, (axes[0], None))
  module.lora_b = _lora_param(lora_b, (None, axes[1]))


def _delta(module: Any) -> Array:
  return module.scale * (module.lora_a[...].astype(jnp.float32) @ module.lora_b[...].astype(jnp.float32))


class LoRALinear(nnx.Linear):
  """`nnx.Linear` + a low-rank update; the base `kernel` (and `bias`) Variables are the wrapped layer's own.

  Built from an existing layer (`LoRALinear(base, lora_a=..., lora_b=..., scale=...)`); its initialiser is not run.
  `x [..., in] -> x @ kernel + (dropout(x) @ lora_a @ lora_b) * scale [..., out]`.
  """

  def __init__(self, base: nnx.Linear, *, lora_a: Array, lora_b: Array, scale: float, dropout: float = 0.0,
               dropout_key: LoRADropoutKey | None = None, dropout_index: int = 0):
    # The attributes nnx.Linear.__call__ reads, taken from `base` (its initialiser is deliberately not re-run).
    for name in ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision", "dot_general",
                 "promote_dtype", "preferred_element_type"):
      setattr(self, name, getattr(base, name))
    self.kernel = base.kernel
    self.bias = base.bias if base.use_bias else nnx.data(None)
    for name in getattr(base, "QUANTIZED_ATTRS", ()):  # a quantized base: its scales (QLoRALinear)
      setattr(self, name, getattr(base, name))
    _set_factors(self, base.kernel, lora_a, lora_b, scale, dropout, dropout_key, dropout_index)

  def delta(self) -> Array:
    """The kernel update `scale * lora_a @ lora_b` [in, out] in float32."""
    return _delta(self)

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    y = super().__call__(inputs, out_sharding=out_sharding)
    x = _adapter_input(inputs, self.dropout_rate, self.dropout_key, self.dropout_index)
    dtype = self.dtype or y.dtype
    h = x.astype(dtype) @ self.lora_a[...].astype(dtype)
    return y + ((h @ self.lora_b[...].astype(dtype)) * jnp.asarray(self.scale, dtype)).astype(y.dtype)


class LoRAClippableLinear(ClippableLinear):
  """A vision `ClippableLinear` + a low-rank update added between its clamps (its `kernel` and bounds are the wrapped
  layer's own Variables): `clip_out(x' @ kernel + (dropout(x') @ lora_a @ lora_b) * scale)`, `x' = clip_in(x)`."""

  def __init__(self, base: ClippableLinear, *, lora_a: Array, lora_b: Array, scale: float, dropout: float = 0.0,
               dropout_key: LoRADropoutKey | None = None, dropout_index: int = 0):
    self.dtype, self.clipped = base.dtype, base.clipped
    self.in_features, self.out_features = base.in_features, base.out_features
    self.kernel = base.kernel
    if base.clipped:
      self.input_min, self.input_max = base.input_min, base.input_max
      self.output_min, self.output_max = base.output_min, base.output_max
    _set_factors(self, base.kernel, lora_a, lora_b, scale, dropout, dropout_key, dropout_index)

  def delta(self) -> Array:
    """The kernel update `scale * lora_a @ lora_b` [in, out] in float32."""
    return _delta(self)

  def project(self, x: Array) -> Array:
    y = super().project(x)
    h = _adapter_input(x, self.dropout_rate, self.dropout_key, self.dropout_index)
    h = (h @ self.lora_a[...].astype(self.dtype)) @ self.lora_b[...].astype(self.dtype)
    return y + (h * jnp.asarray(self.scale, self.dtype)).astype(y.dtype)


# the adapter modules of 2-D linear layers (`delta()`, `lora_a [in, r]`, `lora_b [r, out]`)
LINEAR_ADAPTERS = (LoRALinear, LoRAClippableLinear)


class LoRAExperts(moe.Experts):
  """`moe.Experts` whose 3-D weights get per-expert low-rank updates (PEFT `target_parameters` semantics).

  For each targeted Param `P [E, out, in]` (HF layout): `<P>_lora_a [E, in, r]`, `<P>_lora_b [E, r, out]` and
  the effective weight `P[e] + scale * (a[e] @ b[e]).T`. The base Params keep their paths.
  """

  def __init__(self, base: moe.Experts, *, factors: Mapping[str, tuple[Array, Array]], scale: float):
    self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
    self.dtype, self.impl, self.intermediate = base.dtype, base.impl, base.intermediate
    self.matmul_dtype = base.matmul_dtype
    for name in getattr(base, "QUANTIZED_ATTRS", ()):  # a quantized base: its scales (QLoRAExperts)
      setattr(self, name, getattr(base, name))
    self.targets = tuple(p for p in EXPERT_PARAMS if p in factors)
    self.scale = float(scale)
    for name in self.targets:
      var = getattr(base, name)
      a, b = factors[name]
      e, d_out, d_in = base.weight_shape(name)
      if a.shape[:2] != (e, d_in) or b.shape[0] != e or b.shape[2] != d_out:
        raise ValueError(f"{name}: lora_a {a.shape} / lora_b {b.shape} do not fit a {(e, d_out, d_in)} expert tensor")
      self.rank = a.shape[2]
      axes = _axes(var) or (None, None, None)
      setattr(self, f"{name}_lora_a", _lora_param(a, (axes[0], axes[2], None)))
      setattr(self, f"{name}_lora_b", _lora_param(b, (axes[0], None, axes[1])))

  def delta(self, name: str, experts: slice = slice(None)) -> Array:
    """The update of Param `name` [E, out, in] in float32 (`experts`: of those experts only, the same values)."""
    a = getattr(self, f"{name}_lora_a")[...][experts].astype(jnp.float32)
    b = getattr(self, f"{name}_lora_b")[...][experts].astype(jnp.float32)
    return self.scale * jnp.einsum("eir,ero->eoi", a, b)

  def expert_weights(self, **base_kwargs: Any) -> tuple[Array, Array]:
    """The base weights (as `moe.Experts` reads them; `base_kwargs` go to a quantized base's `expert_weights`) plus
    the low-rank updates, in the compute dtype."""
    eff = dict(zip(EXPERT_PARAMS, super().expert_weights(**base_kwargs)))
    for name in self.targets:
      a = getattr(self, f"{name}_lora_a")[...].astype(self.dtype)
      b = getattr(self, f"{name}_lora_b")[...].astype(self.dtype)
      eff[name] = eff[name] + jnp.einsum("eir,ero->eoi", a, b) * jnp.asarray(self.scale, self.dtype)
    return eff["gate_up_proj"], eff["down_proj"]


class QLoRALinear(LoRALinear, qlora.QuantizedLinear):
  """`LoRALinear` on a `qlora.QuantizedLinear`: the base output is `x @ dequantize(kernel)`, computed inside the
  layer; `delta()` and the adapter path are `LoRALinear`'s."""


class QLoRAExperts(LoRAExperts, qlora.QuantizedExperts):
  """`LoRAExperts` on `qlora.QuantizedExperts`: the base weights are dequantized in `expert_weights`, then the
  low-rank updates are added."""


def _lora_linear_class(base: nnx.Linear | ClippableLinear) -> type[LoRALinear] | type[LoRAClippableLinear]:
  if isinstance(base, ClippableLinear):
    return LoRAClippableLinear
  return QLoRALinear if isinstance(base, qlora.QuantizedLinear) else LoRALinear


def _lora_experts_class(base: moe.Experts) -> type[LoRAExperts]:
  return QLoRAExperts if isinstance(base, qlora.QuantizedExperts) else LoRAExperts


AdapterModule = LoRALinear | LoRAClippableLinear | LoRAExperts


# ---- finding targets --------------------------------------------------------------------------------------------
def path_str(path: tuple[Any, ...]) -> str:
  return ".".join(str(p) for p in path)


def targetable(model: nnx.Module) -> dict[str, tuple[tuple[Any, ...], str | None]]:
  """Every adaptable path -> (module path, expert Param name or None), in model order.

  Linear layers: `layers.0.self_attn.q_proj` -> (('layers', 0, 'self_attn', 'q_proj'), None) (also the vision
  tower's `ClippableLinear`s: `vision_tower.encoder.layers.0.mlp.up_proj`, `embed_vision.embedding_projection`);
  expert Params: `layers.0.experts.gate_up_proj` -> (('layers', 0, 'experts'), 'gate_up_proj').
  """
  out: dict[str, tuple[tuple[Any, ...], str | None]] = {}
  for path, node in sorted(nnx.iter_graph(model), key=lambda pn: _sort_key(pn[0])):
    if isinstance(node, (nnx.Linear, ClippableLinear)):
      out[path_str(path)] = (tuple(path), None)
    elif isinstance(node, moe.Experts):
      for name in EXPERT_PARAMS:
        out[path_str((*path, name))] = (tuple(path), name)
  return out


def _sort_key(path: tuple[Any, ...]) -> tuple[Any, ...]:
  return tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p)) for p in path)


def _is_all_linear(name: str, param: str | None) -> bool:
  return param is None and ".router." not in f".{name}." and not is_vision_target(name)


def resolve_targets(model: nnx.Module, config: LoraConfig) -> list[str]:
  """The adaptable paths `config.target_modules` selects (ConfigError for an entry that selects nothing)."""
  candidates = targetable(model)
  chosen: set[str] = set()
  for pattern in config.target_modules:
    if pattern == ALL_LINEAR:
      hits = {n for n, (_, p) in candidates.items() if _is_all_linear(n, p)}
    else:
      hits = {n for n in candidates if entry_matches(pattern, n)}
    if not hits:
      examples = _examples(candidates)
      what = "module name" if is_module_name(pattern) else "regex"
      raise ConfigError(f"LoraConfig.target_modules {what} {pattern!r} matches no module; valid paths look like "
                        f"{', '.join(examples)} ({len(candidates)} in all)")
    chosen |= hits
  return [n for n in candidates if n in chosen]


def _examples(candidates: Mapping[str, Any]) -> list[str]:
  layer0 = [n for n in candidates if n.startswith("layers.0.")]
  rest = [n for n in candidates if not n.startswith("layers.") and not is_vision_target(n)]
  tower = [n for n in candidates if n.startswith("vision_tower.encoder.layers.0.")]
  projector = [n for n in candidates if n.startswith("embed_vision.")]
  return layer0 + rest[:3] + tower[:1] + projector


def lora_modules(model: nnx.Module) -> Iterator[tuple[tuple[Any, ...], AdapterModule]]:
  """(path, module) of every adapter-carrying module, in model order."""
  for path, node in sorted(nnx.iter_graph(model), key=lambda pn: _sort_key(pn[0])):
    if isinstance(node, (*LINEAR_ADAPTERS, LoRAExperts)):
      yield tuple(path), node


def has_lora(model: nnx.Module) -> bool:
  return next(lora_modules(model), None) is not None


# ---- wrapping ---------------------------------------------------------------------------------------------------
def apply_lora(model: nnx.Module, config: LoraConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """A copy of `model` (sharing its arrays) with adapters on the modules `config` targets.

  The copy's base Variables keep their paths; the new `nnx.LoRAParam`s are `<module>.lora_a` / `.lora_b`
  (`<experts>.<param>_lora_a` / `_lora_b` for expert tensors). `B = 0`, so logits are unchanged until trained.
  With `config.base_quantization` set, the copy's base is quantized first (`qlora.quantize_base`; the quantized
  values and scales replace the dense weights under the same paths) and the adapters sit on the quantized modules.
  """
  if has_lora(model):
    raise ValueError("model already has LoRA adapters; merge() or split() it first")
  if scan.is_scanned(model):  # stacked arrays would get per-layer-shaped factors
    raise ConfigError("apply_lora: the model's layers are stacked (scan_layers); add the adapters to the unrolled "
                      "model, then stack it (model.scan.stack_layers)")
  targets = resolve_targets(model, config)
  model = nnx.clone(model)
  if config.quantization is not None:
    model = qlora.quantize_base(model, config.quantization)
  table = targetable(model)
  # factor shapes: Linear [in, r] / [r, out]; expert Param [E, out, in] -> [E, in, r] / [E, r, out]
  specs = []
  for name in targets:
    path, param = table[name]
    if param is None:
      module = qlora.module_at(model, path)
      d_in, d_out = module.in_features, module.out_features
      specs.append(((d_in, config.rank), (config.rank, d_out), d_in))
    else:
      e, d_out, d_in = qlora.module_at(model, path).weight_shape(param)
      specs.append(((e, d_in, config.rank), (e, config.rank, d_out), d_in))
  values = _init_factors(rngs.params(), tuple(specs), config.param_dtype)
  dropout_key = LoRADropoutKey(_dropout_off()) if config.dropout > 0 else None  # one variable, shared
  experts: dict[tuple[Any, ...], dict[str, tuple[Array, Array]]] = {}
  for name, (a, b) in zip(targets, values):
    path, param = table[name]
    if param is None:
      base = qlora.module_at(model, path)
      wrapped = _lora_linear_class(base)(base, lora_a=a, lora_b=b, scale=config.scale, dropout=config.dropout,
                                         dropout_key=dropout_key, dropout_index=targets.index(name))
      qlora.set_module(model, path, wrapped)
    else:
      experts.setdefault(path, {})[param] = (a, b)
  for path, factors in experts.items():
    base = qlora.module_at(model, path)
    qlora.set_module(model, path, _lora_experts_class(base)(base, factors=factors, scale=config.scale))
  return model


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_factors(key: Array, specs: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...],
                  dtype: str) -> list[tuple[Array, Array]]:
  """All initial factors in one compiled call (eagerly, every new shape would compile its own RNG kernel).

  A ~ U(-1/sqrt(in), 1/sqrt(in)): PEFT's `kaiming_uniform_(lora_A.weight, a=sqrt(5))` on `[r, in]`; B = 0.
  """
  sizes = [math.prod(a_shape) for a_shape, _, _ in specs]
  unit = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)  # one RNG call for every factor
  out, start = [], 0
  for size, (a_shape, b_shape, fan_in) in zip(sizes, specs):
    a = (unit[start:start + size].reshape(a_shape) / math.sqrt(fan_in)).astype(dtype)  # U(-1/sqrt(in), 1/sqrt(in))
    out.append((a, jnp.zeros(b_shape, jnp.dtype(dtype))))
    start += size
  return out


__all__ = ["ALL_LINEAR", "DEFAULT_TARGETS", "EXPERT_PARAMS", "LINEAR_ADAPTERS", "LoRAClippableLinear",
           "LoRADropoutKey", "LoRAExperts", "LoRALinear", "LoraConfig", "QLoRAExperts", "QLoRALinear",
           "VISION_TARGETS", "apply_lora", "has_lora",
           "lora_modules", "path_str", "resolve_targets",
           "set_dropout_key", "targetable"]
