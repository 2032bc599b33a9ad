"""Sampling typed prompts with a run's model (or a Hugging Face checkpoint's) as training and evaluation see them.

`sample(model, tokenizer, prompts, run_cfg, ...)` is what `python -m hackable_diffusion.sample` calls (the CLI only
parses flags, loads the model and prints); from Python:

  run = runs.run.load_run("runs/tiny")
  out = runs.sampling.sample(run.model, run.tokenizer, ["5895382"], run.config, seed=0)
  out.completions                                  # decoded texts, one per prompt

With a run config (`run_cfg`; None for a checkpoint without one) a prompt is encoded as training encodes it (the
task's prompt format, the chat template, bos; `encode_prompt`), refused with one line where training would refuse
it, and left-padded to `data.max_prompt_length` as in training and evaluation; the sampler defaults are the run's
evaluation sampler (`default_sampling`: `eval.sampling` at `eval.early_stopping_steps`, the evaluation's
early-stopping run).

The task (`resolve_task`: the run's evaluation task, or any `get_task` name) applies its hooks exactly as
evaluation does (`evaluation.loop.generate_texts`): `parse_prompt` turns the typed text into the prompt its data
holds, `seed_canvas` starts the canvases (e.g. givens pinned) and `allowed_token_ids` restricts the sampled
tokens. Infilling (`seed_canvas` text, `infill_canvas`) replaces the task's start canvas; its allowed tokens still
apply.

Keys: prompt `j` samples with `fold_in(key(seed), example_index + j)`, the key evaluation uses for its example
number `i` (`eval.seed`), so `seed=<eval.seed>, example_index=i` with the prompts of evaluation examples i, i+1,
... reproduces evaluation's completions for them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hackable_diffusion.data.chat import chat_template_kind, format_prompt
from hackable_diffusion.errors import ConfigError
from hackable_diffusion.runs import run as run_lib
from hackable_diffusion.runs.config import ExperimentConfig
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.generate import generate
from hackable_diffusion.tasks import base as task_lib
from hackable_diffusion.tasks.base import EvalRecord, Task

DEFAULT_MAX_NEW_TOKENS = 256  # without a run: tokens to generate
DEFAULT_STEPS = 48  # without a run: max_denoising_steps per canvas


def _warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class Samples:
  """What `sample` returns: per prompt, its completion, the prompt as the task writes it, the denoising steps of
  each canvas and the tokens accepted per forward pass."""

  completions: list[str]
  prompts: list[str]
  denoising_steps: np.ndarray  # [B, canvases]
  tokens_per_forward: np.ndarray  # [B]

  def records(self) -> list[EvalRecord]:
    """The `EvalRecord` of each prompt (no reference completion), as a task's `render` takes it."""
    return [EvalRecord(prompt=p, completion="") for p in self.prompts]


# ---- the task --------------------------------------------------------------------------------------------------
def run_task_name(run_cfg: ExperimentConfig | None) -> str:
  """The task a run was trained and evaluated on (`eval.task`, else `data.generator`; '' without a run)."""
  if run_cfg is None:
    return ""
  return str(run_cfg.eval.task or run_cfg.data.generator or "")


def resolve_task(run_cfg: ExperimentConfig | None, name: str | None = None) -> Task | None:
  """The task whose hooks sampling applies: `name` (a `get_task` name; the run's own task arguments when it is
  the run's task), else the run's evaluation task (`runs.run.eval_task`); None without either."""
  if name:
    if run_cfg is not None and name == run_task_name(run_cfg):
      return run_lib.eval_task(run_cfg)
    return task_lib.get_task(name)
  return run_lib.eval_task(run_cfg) if run_cfg is not None else None


# ---- prompts and start canvases --------------------------------------------------------------------------------
def encode_prompt(tokenizer: Any, text: str, run_cfg: ExperimentConfig | None, chat_template: str | None = None,
                  *, task: Task | None = None, warn: Callable[[str], Any] = _warn) -> list[int]:
  """Prompt token ids as training builds them (task format, chat template, bos), within the run's limits.

  `chat_template`: None = the run's. `task`: the task whose prompt format applies (None: the run's evaluation
  task). Refused with a one-line ConfigError: an empty prompt, one the task would not write (its
  `parse_prompt`), and one longer than `data.max_prompt_length` tokens (training's rule: with
  `data.on_overlength='truncate'` it keeps the last tokens instead, with a warning).
  """
  text = task_lib.parse_prompt(task if task is not None else resolve_task(run_cfg), text)
  template = chat_template if chat_template is not None else (run_cfg.data.chat_template if run_cfg is not None
                                                              else "")
  kind = chat_template_kind(template or None)
  if kind in ("jinja", "tokenizer"):  # the same prompt as training (data/sft.py): user turn + generation prompt
    tok = tokenizer.with_chat_template(template, "--chat_template") if kind == "jinja" else tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
  else:
    ids = tokenizer.encode(format_prompt(template or None, text))
  if run_cfg is not None and run_cfg.data.add_bos and tokenizer.bos_id >= 0 and ids[:1] != [tokenizer.bos_id]:
    ids = [tokenizer.bos_id] + ids
  if not ids:
    raise ConfigError("the prompt is empty after tokenization")
  if run_cfg is not None and len(ids) > run_cfg.data.max_prompt_length:
    limit = run_cfg.data.max_prompt_length
    if run_cfg.data.on_overlength != "truncate":
      raise ConfigError(f"the prompt is {len(ids)} tokens, longer than the run's data.max_prompt_length={limit} "
                        "(training refuses such prompts); shorten it")
    warn(f"the prompt is {len(ids)} tokens; keeping the last {limit} (data.max_prompt_length, "
         "data.on_overlength='truncate', as in training)")
    ids = ids[len(ids) - limit:]
  unknown = sum(i == tokenizer.unk_id for i in ids)
  if unknown:
    warn(f"{unknown} prompt token(s) are unknown to the tokenizer")
  return ids


def infill_canvas(tokenizer: Any, text: str, *, placeholder: str, num_tokens: int, vocab_size: int, rows: int,
                  pinned: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(seed ids `[rows, num_tokens]` int32, pinned `[rows, num_tokens]` bool) for the infilling text `text`.

  Each `placeholder` character of `text` is one free position; the text between placeholders is tokenized piece
  by piece (`tokenizer.encode`, no bos) and pinned when `pinned`. Free positions, and those after the text, start
  as uniform noise over `vocab_size` (`np.random.default_rng(seed)`); every row gets the same canvas.
  """
  if len(placeholder) != 1:
    raise ConfigError(f"--placeholder={placeholder!r}: expected one character")
  ids: list[int] = []
  known: list[bool] = []
  for k, piece in enumerate(text.split(placeholder)):
    if k:  # one free position per placeholder character
      ids.append(-1)
      known.append(False)
    tokens = tokenizer.encode(piece) if piece else []
    ids += tokens
    known += [True] * len(tokens)
  if len(ids) > num_tokens:
    raise ConfigError(f"--seed_canvas is {len(ids)} tokens, more than the {num_tokens} the sampler generates "
                      "(--max_new_tokens rounded up to whole canvases); shorten it or raise --max_new_tokens")
  noise = np.random.default_rng(seed).integers(0, vocab_size, size=num_tokens).astype(np.int32)
  is_known = np.zeros(num_tokens, bool)
  is_known[:len(known)] = known
  start = noise.copy()
  start[:len(ids)] = np.where(is_known[:len(ids)], np.asarray(ids, np.int64), noise[:len(ids)])
  pins = is_known & pinned
  return np.tile(start, (rows, 1)), np.tile(pins, (rows, 1))


# ---- the sampler -----------------------------------------------------------------------------------------------
def default_sampling(run_cfg: ExperimentConfig | None, model_config: Any, *, max_new_tokens: int | None = None,
                     max_denoising_steps: int | None = None, early_stopping: bool = True,
                     **changes: Any) -> SamplingConfig:
  """The run's evaluation sampler (`eval.sampling`; `SamplingConfig()` without a run) with these changes.

  `max_new_tokens` None: the run's completion length (`eval.max_new_tokens`, else `data.max_canvases` canvases),
  256 without a run; `max_denoising_steps` None: `eval.early_stopping_steps`, 48 without a run; `changes`: other
  `SamplingConfig` fields (e.g. `entropy_bound`, `t_min`, `t_max`). A bad value is a one-line ConfigError.
  """
  if run_cfg is not None:
    base = run_cfg.eval.sampling
    max_new = max_new_tokens or run_cfg.eval.max_new_tokens or run_cfg.data.max_canvases * model_config.canvas_length
    steps = max_denoising_steps or run_cfg.eval.early_stopping_steps
  else:
    base, max_new, steps = SamplingConfig(), max_new_tokens or DEFAULT_MAX_NEW_TOKENS, (max_denoising_steps or
                                                                                         DEFAULT_STEPS)
  try:
    return base.replace(max_new_tokens=max_new, early_stopping=early_stopping, max_denoising_steps=steps,
                        **{k: v for k, v in changes.items() if v is not None})
  except ValueError as e:
    raise ConfigError(" ".join(str(e).split())) from None


def sample(model: Any, tokenizer: Any, prompts: Sequence[str], run_cfg: ExperimentConfig | None = None, *,
           sampling: SamplingConfig | None = None, seed: int = 0, example_index: int = 0, task: Task | None = None,
           chat_template: str | None = None, seed_canvas: str | None = None, placeholder: str = "_",
           pinned: bool = True, callback: Callable[[Any], Any] | None = None,
           warn: Callable[[str], Any] = _warn) -> Samples:
  """Completions of `prompts`, prompt `j` sampled with the key `fold_in(key(seed), example_index + j)`.

  `run_cfg`: the run's config (prompt encoding, padding and sampler defaults; None for a bare checkpoint).
  `sampling`: the sampler (None: `default_sampling(run_cfg, model.config)`). `task`: whose hooks apply
  (`resolve_task`; None: the run's evaluation task, none without a run): its `parse_prompt`, its `seed_canvas`
  (unless `seed_canvas` text is given, see `infill_canvas`) and `allowed_token_ids`, as evaluation applies them.
  `callback`: `sampling.generate`'s per-step callback (e.g. to watch the canvas converge; it is part of the
  sampler's compile-cache key, so create it once). Every prompt is checked (`encode_prompt`) before anything is
  sampled.
  """
  if task is None:
    task = resolve_task(run_cfg)
  texts = [task_lib.parse_prompt(task, p) for p in prompts]
  encoded = [encode_prompt(tokenizer, t, run_cfg, chat_template, task=task, warn=warn) for t in texts]
  width = max(len(e) for e in encoded)
  if run_cfg is not None:  # training's and evaluation's left padding
    width = max(width, run_cfg.data.max_prompt_length)
  ids = np.full((len(encoded), width), tokenizer.pad_id if tokenizer.pad_id >= 0 else 0, np.int32)
  mask = np.zeros((len(encoded), width), bool)
  for i, e in enumerate(encoded):  # left padding
    ids[i, width - len(e):] = e
    mask[i, width - len(e):] = True
  config = sampling if sampling is not None else default_sampling(run_cfg, model.config)
  canvas = config.canvas_length or model.config.canvas_length
  num_tokens = -(-config.max_new_tokens // canvas) * canvas  # whole canvases, as evaluation seeds them
  if seed_canvas is not None:
    seeded = infill_canvas(tokenizer, seed_canvas, placeholder=placeholder, num_tokens=num_tokens,
                           vocab_size=model.config.vocab_size, rows=len(texts), pinned=pinned, seed=seed)
  elif task is not None:
    seeded = task.seed_canvas([EvalRecord(prompt=t, completion="") for t in texts], tokenizer, num_tokens)
  else:
    seeded = None
  kwargs: dict[str, Any] = {}
  if seeded is not None:
    kwargs.update(seed_canvas=np.asarray(seeded[0]), pinned=np.asarray(seeded[1]))
  allowed = task.allowed_token_ids(tokenizer) if task is not None else None
  rows = jax.numpy.arange(example_index, example_index + len(texts))
  rng = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), rows)  # one key per prompt, as evaluation
  out = generate(model, ids, config, rng=rng, attention_mask=mask, allowed_token_ids=allowed, callback=callback,
                 **kwargs)
  seqs = np.asarray(out.sequences)[:, width:]
  return Samples(completions=[tokenizer.decode(s) for s in seqs], prompts=texts,
                 denoising_steps=np.asarray(out.denoising_steps), tokens_per_forward=np.asarray(out.tokens_per_forward))


def render(task: Task | None, samples: Samples) -> str:
  """The completions as shown to a person: each through the task's `render` (e.g. a grid and a verdict), one per
  line; a task's multi-line rendering is set apart from the next by a blank line."""
  shown = [task_lib.render(task, c, r) for c, r in zip(samples.completions, samples.records())]
  sep = "\n\n" if any(s != c and "\n" in s for s, c in zip(shown, samples.completions)) else "\n"
  return sep.join(shown)


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_STEPS", "Samples", "default_sampling", "encode_prompt",
           "infill_canvas", "render", "resolve_task", "run_task_name", "sample"]
