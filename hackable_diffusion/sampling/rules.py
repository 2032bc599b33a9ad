"""Acceptance rules: which positions of a denoised canvas are kept at a step (all others are re-noised).

A rule is a small frozen object called inside the compiled denoising loop (`sampling/denoise.py`) as

    accept = rule(token_entropy [B, C] float32, processed_logits [B, C, V] float32, step [] int32,
                  num_steps [] int32) -> [B, C] bool

where `processed_logits` are the temperature-scaled logits the step sampled from, `token_entropy` their
per-position entropies and `step` counts down from `num_steps` (first step) to 1 (last). The built-in rules are
`flax.struct.dataclass`es: pytrees whose numeric fields are *leaves*, so `generate` passes them to the compiled
loop as traced arguments. The compile key is the rule's class (its tree structure) and the dtypes of its
fields: `EntropyBound(0.1)`, an equal `EntropyBound(0.1)` and `EntropyBound(0.5)` share one compiled program.
A field that must change the traced program (a Python branch, a shape) is declared
`flax.struct.field(pytree_node=False)` and becomes part of the compile key. A rule that is not a pytree node
(e.g. a plain function) is treated as wholly static: it must be hashable, and a new object recompiles.

Rules validate their fields in `__post_init__` only when those are Python / numpy numbers: inside the compiled
loop the same class is rebuilt around traced arrays.

Select a rule by name from `SamplingConfig(acceptance=..., acceptance_args=...)` (`make_rule`), or pass an
object to `generate(..., acceptance=rule)`. A new rule is a class like these anywhere importable, named as
`'package.module:Class'` (any callable returning a rule works as the factory).
"""

from __future__ import annotations

import math
import numbers
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hackable_diffusion import specs
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import entropy_bound as eb

Array = jax.Array


@runtime_checkable
class AcceptanceRule(Protocol):
  """`(token_entropy [B, C], processed_logits [B, C, V], step [], num_steps []) -> accept [B, C] bool`."""

  def __call__(self, token_entropy: Array, processed_logits: Array, step: Array, num_steps: Array) -> Array:
    ...


def _concrete(value: Any) -> bool:
  """True for a Python / numpy number (validated); False for arrays and tracers (a rule rebuilt in the loop)."""
  return isinstance(value, numbers.Number)


@flax.struct.dataclass
class EntropyBound:
  """Accept the lowest-entropy positions whose entropy sum *before* them is `<= bound` (Ben-Hamu et al. 2025,
  arXiv:2505.24857; transformers' `EntropyBoundSampler`). The most certain position is always accepted;
  `math.inf` accepts every position. This is the default rule, with `bound = SamplingConfig.entropy_bound`."""

  bound: Any = 0.1

  def __post_init__(self):
    b = self.bound
    if _concrete(b) and (isinstance(b, bool) or not isinstance(b, numbers.Real) or math.isnan(b) or b <= 0):
      raise ConfigError(f"EntropyBound.bound={b!r} is invalid: must be a float > 0 (math.inf accepts every position)")

  def __call__(self, token_entropy: Array, processed_logits: Array, step: Array, num_steps: Array) -> Array:
    return eb.accept_entropy_bound(token_entropy, self.bound)


@flax.struct.dataclass
class TopK:
  """Accept the `k` lowest-entropy positions of each row (ties keep position order)."""

  k: Any

  def __post_init__(self):
    k = self.k
    if _concrete(k) and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
      raise ConfigError(f"TopK.k={k!r} is invalid: must be an integer >= 1")

  def __call__(self, token_entropy: Array, processed_logits: Array, step: Array, num_steps: Array) -> Array:
    return eb.accept_top_k(token_entropy, self.k)


@flax.struct.dataclass
class ConfidenceThreshold:
  """Accept the positions whose top probability (under the processed logits) is `>= threshold`, plus the most
  confident position of each row so that every step makes progress (Fast-dLLM style)."""

  threshold: Any = 0.9

  def __post_init__(self):
    t = self.threshold
    if _concrete(t) and (isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t <= 1):
      raise ConfigError(f"ConfidenceThreshold.threshold={t!r} is invalid: must be a probability in (0, 1]")

  def __call__(self, token_entropy: Array, processed_logits: Array, step: Array, num_steps: Array) -> Array:
    return eb.accept_confidence_threshold(processed_logits, self.threshold)


# The names `SamplingConfig.acceptance` accepts besides 'package.module:Factory'.
BUILTIN_RULES: Mapping[str, Callable[..., AcceptanceRule]] = types.MappingProxyType({
    "entropy_bound": EntropyBound,
    "top_k": TopK,
    "confidence_threshold": ConfidenceThreshold,
})


def resolve_factory(spec: str) -> Callable[..., AcceptanceRule]:
  """The rule factory named by `spec`: a `BUILTIN_RULES` name, an installed `hackable_diffusion.acceptance_rules`
  plugin or `'package.module:Factory'` (imported; see `specs.resolve`).

  Raises `ConfigError` (one line) for an unknown name or a spec that cannot be imported.
  """
  if not isinstance(spec, str) or not spec:
    raise ConfigError(f"acceptance={spec!r} is invalid: expected one of {sorted(BUILTIN_RULES)} or "
                      f"'package.module:Factory'")
  factory = specs.resolve("acceptance_rules", spec, what="acceptance", builtins=BUILTIN_RULES)
  if not callable(factory):
    raise ConfigError(f"acceptance={spec!r}: {spec.partition(':')[2]!r} is not callable")
  return factory


def make_rule(spec: str, args: Mapping[str, Any] | None = None) -> AcceptanceRule:
  """`factory(**args)` for the factory `resolve_factory(spec)` names; `ConfigError` on bad arguments."""
  factory = resolve_factory(spec)
  args = dict(args or {})
  try:
    rule = factory(**args)
  except (TypeError, ValueError) as e:  # ConfigError is a ValueError
    msg = " ".join(str(e).split()) or type(e).__name__
    raise ConfigError(f"acceptance_args={args!r} is invalid for acceptance={spec!r}: {msg}") from None
  check_rule(rule, f"acceptance={spec!r}")
  return rule


def traced_leaf(value: Any, what: str) -> jax.Array:
  """A numeric field of a rule or checker as a strongly typed array (bool / int32 / float32), so that a Python `0.1`
  and a numpy `0.5` compile the same program (weak types and 64-bit numpy scalars would change the compile key).
  `what` names the owner in the one-line error for a field that is not a number."""
  arr = value if isinstance(value, jax.Array) else np.asarray(value)
  kind = arr.dtype.kind
  if kind == "b":
    return jnp.asarray(arr, bool)
  if kind in "iu":
    return jnp.asarray(arr, jnp.int32)
  if kind == "f":
    return jnp.asarray(arr, jnp.float32)
  raise ConfigError(f"{what} field {value!r} is not a number or an array of numbers (mark non-numeric fields "
                    f"flax.struct.field(pytree_node=False))")


def is_static(rule: Any) -> bool:
  """True when `rule` (or a checker) is not a pytree node (e.g. a plain function): it is then part of the compile
  key."""
  return jax.tree_util.treedef_is_leaf(jax.tree.structure(rule))


def check_rule(rule: Any, what: str = "acceptance") -> None:
  """`ConfigError` unless `rule` is callable and, when static, hashable (it is part of the compile key)."""
  if not callable(rule):
    raise ConfigError(f"{what}: expected an acceptance rule (a callable, see sampling.rules), got "
                      f"{type(rule).__name__}")
  if is_static(rule):
    try:
      hash(rule)
    except TypeError:
      raise ConfigError(f"{what}: a rule that is not a pytree must be hashable (it is part of the compile key), "
                        f"got an unhashable {type(rule).__name__}") from None
  else:
    try:
      hash(jax.tree.structure(rule))
    except TypeError:
      raise ConfigError(f"{what}: the static fields of {type(rule).__name__} must be hashable (they are part of "
                        f"the compile key)") from None


__all__ = ["AcceptanceRule", "BUILTIN_RULES", "ConfidenceThreshold", "EntropyBound", "TopK", "check_rule",
           "is_static", "make_rule", "resolve_factory", "traced_leaf"]
