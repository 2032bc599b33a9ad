"""`SamplingConfig`: every knob of entropy-bounded block diffusion sampling, validated up front.

Defaults and meanings follow transformers' `DiffusionGemmaGenerationConfig` (5.23) for DiffusionGemma:
`max_new_tokens=256`, `max_denoising_steps=48`, `entropy_bound=0.1`, a linear temperature from `t_max=0.8`
(first step) towards `t_min=0.4`, `stability_threshold=1`, `confidence_threshold=0.005`. Fields left `None`
(`eos_token_id`, `pad_token_id`, `canvas_length`) are filled from the model config by `resolve`. The acceptance
rule is chosen by name (`acceptance`, `acceptance_args`; see `sampling.rules`). Invalid values raise a one-line
`hackable_diffusion.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

from hackable_diffusion.errors import ConfigError
from hackable_diffusion.sampling import rules


def _default_buckets() -> tuple[int, ...]:
  return tuple(2**i for i in range(4, 14))  # 16, 32, ..., 8192


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fail(name: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"SamplingConfig.{name}={value!r} is invalid: {allowed}")


def _hashable(value: Any) -> Any:
  """Lists (e.g. from a JSON config) -> tuples, recursively, so that the config stays hashable."""
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """Settings of `hackable_diffusion.generate` (entropy-bounded sampler + block-autoregressive outer loop).

  Attributes:
    max_new_tokens: tokens to generate; rounded *up* to whole canvases (as transformers does).
    max_denoising_steps: denoising steps per canvas, `N`; step `n` runs from `N` (first) down to 1.
    entropy_bound: accept the lowest-entropy positions whose entropy sum *before* them is `<= entropy_bound`
      (`math.inf` accepts every position at every step).
    t_min, t_max: linear temperature `T(n) = t_min + (t_max - t_min) * n / N`; `T(N) = t_max`. Note the last
      step uses `t_min + (t_max - t_min) / N`, not `t_min` (transformers' exact schedule).
    stability_threshold: a row may stop once its argmax canvas equals the previous `stability_threshold`
      argmax canvases (0: always stable).
    confidence_threshold: ... and the mean token entropy of its temperature-scaled logits is below this.
    eos_token_id: id or ids that end a sequence (None: from the model config via `resolve`).
    pad_token_id: id written after EOS (None: from the model config via `resolve`).
    canvas_length: tokens per canvas (block); None: the model's `canvas_length`.
    early_stopping: False disables the stable-and-confident stop, so every canvas runs exactly
      `max_denoising_steps` steps (benchmarks, step-budget evaluations).
    self_conditioning: False decodes every step with the self-conditioning input off (a zero soft embedding, as
      at the first step), for a model trained without it (`diffusion.self_conditioning_prob=0`). transformers
      always feeds it (True).
    prompt_length_buckets: prompts are padded up to the next bucket so one compiled program serves many
      prompt lengths (padding is masked; results do not change). Longer prompts round up to a multiple of
      the largest bucket. `()` disables bucketing.
    acceptance: the acceptance rule: 'entropy_bound' (default), 'top_k', 'confidence_threshold' (see
      `sampling.rules.BUILTIN_RULES`) or 'package.module:Factory' (imported; `Factory(**acceptance_args)` must
      return a rule). `acceptance_rule()` builds it.
    acceptance_args: keyword arguments of the rule (a dict at construction; stored as a sorted tuple of
      `(name, value)` pairs so the config stays hashable), e.g. `{'k': 8}` for 'top_k'. 'entropy_bound' without
      a `bound` takes `entropy_bound` above.
    checker_confidence: with a checker (`generate(..., checker=...)`, `sampling.checker`), also raise the entropy
      of the positions it flags to `log V` and let no row stop early while it has a flagged position (flagged
      positions are re-noised whether or not this is set). Needs a checker.
    checker_forget: with a checker, flagged positions also lose their self-conditioning input (zero, as at the
      first step), so the next step does not see the rejected prediction there.
    checker_restarts: with a checker, a row that ends a canvas with a flagged position starts it again from noise
      (pins kept), at most this many times per canvas (0: never). Needs a checker.
    checker_step_budget: decoder forwards per row and canvas, restarts included (None: `(checker_restarts + 1) *
      max_denoising_steps`); an attempt still running when the budget is spent ends there. Needs
      `checker_restarts > 0`.
  """

  max_new_tokens: int = 256
  max_denoising_steps: int = 48
  entropy_bound: float = 0.1
  t_min: float = 0.4
  t_max: float = 0.8
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  canvas_length: int | None = None
  early_stopping: bool = True
  self_conditioning: bool = True
  prompt_length_buckets: tuple[int, ...] = dataclasses.field(default_factory=_default_buckets)
  acceptance: str = "entropy_bound"
  acceptance_args: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
  checker_confidence: bool = False
  checker_forget: bool = False
  checker_restarts: int = 0
  checker_step_budget: int | None = None

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> SamplingConfig:
    """A config from a plain mapping of field names (e.g. a config-file section); unknown keys -> `ConfigError`."""
    if not isinstance(values, Mapping):
      raise ConfigError(f"SamplingConfig: expected a mapping of field names, got {type(values).__name__}")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(fields))
    if unknown:
      raise ConfigError(f"SamplingConfig: unknown key(s) {unknown}; valid keys: {', '.join(fields)}")
    return cls(**dict(values))

  def __post_init__(self):
    for name in ("max_new_tokens", "max_denoising_steps"):
      value = getattr(self, name)
      if not _is_int(value) or value <= 0:
        _fail(name, value, "must be a positive integer")
    if self.canvas_length is not None and (not _is_int(self.canvas_length) or self.canvas_length <= 0):
      _fail("canvas_length", self.canvas_length, "must be a positive integer or None (take it from the model)")
    if not _is_real(self.entropy_bound) or math.isnan(self.entropy_bound) or self.entropy_bound <= 0:
      _fail("entropy_bound", self.entropy_bound, "must be a float > 0 (math.inf accepts every position)")
    for name in ("t_min", "t_max"):
      value = getattr(self, name)
      if not _is_real(value) or not math.isfinite(value) or value < 0:
        _fail(name, value, "must be a finite float >= 0")
    if self.t_max <= 0:
      _fail("t_max", self.t_max, "must be > 0 (it is the temperature of the first step)")
    if self.t_min > self.t_max:
      _fail("t_min", self.t_min, f"must be <= t_max={self.t_max} (the temperature decreases over the steps)")
    if not _is_int(self.stability_threshold) or self.stability_threshold < 0:
      _fail("stability_threshold", self.stability_threshold, "must be an integer >= 0")
    if (not _is_real(self.confidence_threshold) or not math.isfinite(self.confidence_threshold)
        or self.confidence_threshold <= 0):
      _fail("confidence_threshold", self.confidence_threshold,
            "must be a finite float > 0 (use early_stopping=False to never stop early)")
    if not isinstance(self.early_stopping, bool):
      _fail("early_stopping", self.early_stopping, "must be a bool")
    if not isinstance(self.self_conditioning, bool):
      _fail("self_conditioning", self.self_conditioning, "must be a bool")
    eos = self.eos_token_id
    if eos is not None:
      if _is_int(eos):
        if eos < 0:
          _fail("eos_token_id", eos, "must be >= 0")
        object.__setattr__(self, "eos_token_id", int(eos))
      elif isinstance(eos, (tuple, list)):
        if not eos or not all(_is_int(e) and e >= 0 for e in eos):
          _fail("eos_token_id", eos, "a sequence of ids must be non-empty and hold integers >= 0")
        object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))
      else:
        _fail("eos_token_id", eos, "must be an int, a sequence of ints, or None")
    if self.pad_token_id is not None and (not _is_int(self.pad_token_id) or self.pad_token_id < 0):
      _fail("pad_token_id", self.pad_token_id, "must be an integer >= 0 or None")
    buckets = self.prompt_length_buckets
    if not isinstance(buckets, (tuple, list)) or not all(_is_int(b) and b > 0 for b in buckets):
      _fail("prompt_length_buckets", buckets, "must be a tuple of positive integers")
    buckets = tuple(int(b) for b in buckets)
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
      _fail("prompt_length_buckets", buckets, "must be strictly increasing")
    object.__setattr__(self, "prompt_length_buckets", buckets)
    self._check_acceptance()
    self._check_checker()

  def _check_checker(self) -> None:
    for name in ("checker_confidence", "checker_forget"):
      if not isinstance(getattr(self, name), bool):
        _fail(name, getattr(self, name), "must be a bool")
    if not _is_int(self.checker_restarts) or self.checker_restarts < 0:
      _fail("checker_restarts", self.checker_restarts, "must be an integer >= 0 (0: no restarts)")
    budget = self.checker_step_budget
    if budget is not None:
      if not _is_int(budget) or budget < 1:
        _fail("checker_step_budget", budget, "must be a positive integer or None")
      if self.checker_restarts == 0:
        _fail("checker_step_budget", budget, "needs checker_restarts > 0 (it caps the forwards of the restarts)")

  @property
  def uses_checker(self) -> bool:
    """Whether a checker option is set (then `generate` needs a checker)."""
    return self.checker_confidence or self.checker_forget or self.checker_restarts > 0

  def checker_budget(self) -> int:
    """Decoder forwards per row and canvas with checker restarts (`checker_step_budget` or its default)."""
    if self.checker_step_budget is not None:
      return self.checker_step_budget
    return (self.checker_restarts + 1) * self.max_denoising_steps

  def _check_acceptance(self) -> None:
    if not isinstance(self.acceptance, str) or not self.acceptance:
      _fail("acceptance", self.acceptance, f"expected one of {sorted(rules.BUILTIN_RULES)} or 'package.module:Factory'")
    args = () if self.acceptance_args is None else self.acceptance_args
    if isinstance(args, Mapping) or hasattr(args, "items"):  # a dict, or e.g. an ml_collections ConfigDict
      args = tuple(args.items())
    if not isinstance(args, (tuple, list)) or not all(
        isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str) for a in args):
      _fail("acceptance_args", self.acceptance_args, "must be a mapping of keyword arguments")
    names = [a[0] for a in args]
    if len(set(names)) != len(names):
      _fail("acceptance_args", self.acceptance_args, "repeats an argument name")
    args = tuple(sorted((name, _hashable(value)) for name, value in args))
    try:
      hash(args)
    except TypeError:
      _fail("acceptance_args", dict(args), "values must be numbers, strings, booleans or sequences of them")
    object.__setattr__(self, "acceptance_args", args)
    try:
      self.acceptance_rule()
    except ConfigError as e:
      raise ConfigError(f"SamplingConfig.{e}") from None

  # ---- derived --------------------------------------------------------------------------------------------------
  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """The EOS ids as a tuple (empty when there is none)."""
    if self.eos_token_id is None:
      return ()
    return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

  def acceptance_rule(self) -> rules.AcceptanceRule:
    """The acceptance rule `acceptance` / `acceptance_args` name (`EntropyBound(entropy_bound)` by default)."""
    args = dict(self.acceptance_args)
    if self.acceptance == "entropy_bound":
      args.setdefault("bound", self.entropy_bound)
    return rules.make_rule(self.acceptance, args)

  def num_canvases(self, canvas_length: int | None = None) -> int:
    """Canvases needed for `max_new_tokens` (rounded up)."""
    c = canvas_length or self.canvas_length
    if c is None:
      raise ConfigError("SamplingConfig.canvas_length is None; call resolve(model_config) first")
    return -(-self.max_new_tokens // c)

  def bucket_prompt_length(self, length: int) -> int:
    """The padded prompt length for a prompt of `length` tokens."""
    if not self.prompt_length_buckets:
      return length
    for b in self.prompt_length_buckets:
      if length <= b:
        return b
    top = self.prompt_length_buckets[-1]
    return -(-length // top) * top

  def replace(self, **changes: Any) -> SamplingConfig:
    return dataclasses.replace(self, **changes)

  def resolve(self, model_config: Any) -> SamplingConfig:
    """Fills `eos_token_id`, `pad_token_id`, `canvas_length` that are None from a model config.

    `model_config` is a `ModelConfig` (or anything with `canvas_length`, `pad_token_id`, `eos_token_id`,
    `vocab_size` attributes). Ids are checked against its vocabulary.
    """
    changes: dict[str, Any] = {}
    for name in ("eos_token_id", "pad_token_id", "canvas_length"):
      if getattr(self, name) is None and getattr(model_config, name, None) is not None:
        changes[name] = getattr(model_config, name)
    out = self.replace(**changes) if changes else self
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None:
      for tid in out.eos_token_ids:
        if tid >= vocab:
          _fail("eos_token_id", out.eos_token_id, f"must be < vocab_size={vocab}")
      if out.pad_token_id is not None and out.pad_token_id >= vocab:
        _fail("pad_token_id", out.pad_token_id, f"must be < vocab_size={vocab}")
    return out
