"""Sample completions from a trained run (or a HF checkpoint) with the entropy-bounded diffusion sampler.

  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="5895382"
  python -m hackable_diffusion.sample --workdir=runs/tiny                 (interactive: one prompt per line)
  python -m hackable_diffusion.sample --checkpoint=HF_DIR [--tokenizer=PATH] --prompt="..."
  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="..." --live   (watch the canvas converge)

With --workdir the prompt gets the run's chat template (and bos) exactly as in training, and the sampler
defaults come from the run's eval section. A prompt training would refuse is refused here too, with one line
(`encode_prompt`): longer than the run's `data.max_prompt_length` in tokens (unless the run truncates, with
`data.on_overlength='truncate'`), or, on a Sudoku run, not an 81-cell puzzle. The completion goes to stdout,
statistics to stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from absl import flags

from hackable_diffusion import cli
from hackable_diffusion.errors import ConfigError

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by hackable_diffusion.train.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A HF DiffusionGemma directory (instead of --workdir).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.model (default: the workdir's, or the one inside "
                                 "--checkpoint).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of the workdir (default: the latest).")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat for a batch); none: interactive.")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "Format string with {prompt} (default: the run's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate (default: the run's completion "
                                "length, or 256).")
_STEPS = flags.DEFINE_integer("steps", None, "max_denoising_steps per canvas (default: the run's "
                              "eval.early_stopping_steps, or 48).")
_ENTROPY = flags.DEFINE_float("entropy_bound", None, "Entropy bound of the acceptance rule (default 0.1).")
_T_MIN = flags.DEFINE_float("t_min", None, "Temperature of the last step (default 0.4).")
_T_MAX = flags.DEFINE_float("t_max", None, "Temperature of the first step (default 0.8).")
_EARLY = flags.DEFINE_bool("early_stopping", True, "Stop a canvas once it is stable and confident.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_LIVE = flags.DEFINE_bool("live", False, "Print the argmax canvas after every denoising step.")


def _sampling_config(run_cfg: Any, max_new_tokens: int) -> Any:
  """The run's evaluation sampler (`eval.sampling`; defaults without a run) with the command line's changes."""
  from hackable_diffusion.sampling.config import SamplingConfig

  base = run_cfg.eval.sampling if run_cfg is not None else SamplingConfig()
  changes: dict[str, Any] = dict(
      max_new_tokens=max_new_tokens, early_stopping=_EARLY.value,
      max_denoising_steps=_STEPS.value or (run_cfg.eval.early_stopping_steps if run_cfg is not None else 48))
  for flag, name in ((_ENTROPY, "entropy_bound"), (_T_MIN, "t_min"), (_T_MAX, "t_max")):
    if flag.value is not None:
      changes[name] = flag.value
  try:
    return base.replace(**changes)
  except ValueError as e:
    raise ConfigError(" ".join(str(e).split())) from None


def _load() -> tuple[Any, Any, Any]:
  """(model, tokenizer, ExperimentConfig or None)."""
  from hackable_diffusion.data.tokenizer import TOKENIZER_FILENAME
  from hackable_diffusion.training import run as run_lib

  if bool(_WORKDIR.value) == bool(_CHECKPOINT.value):
    raise ConfigError("pass exactly one of --workdir (a training run) and --checkpoint (a HF directory)")
  if _WORKDIR.value:
    run = run_lib.load_run(_WORKDIR.value, None, _STEP.value)
    tokenizer = run.tokenizer
    if _TOKENIZER.value:
      tokenizer = _load_tokenizer(_TOKENIZER.value)
    print(f"loaded {_WORKDIR.value} at step {run.step}", file=sys.stderr)
    return run.model, tokenizer, run.config
  from hackable_diffusion.interop.hf import load_pretrained

  model = load_pretrained(_CHECKPOINT.value)
  path = _TOKENIZER.value or os.path.join(_CHECKPOINT.value, TOKENIZER_FILENAME)
  return model, _load_tokenizer(path), None


def _load_tokenizer(path: str):
  from hackable_diffusion.data.tokenizer import Tokenizer

  try:
    return Tokenizer.load(path)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"tokenizer: {e} (pass --tokenizer=PATH)") from None


def run_task_name(run_cfg: Any) -> str:
  """The task a run was trained and evaluated on (`eval.task`, else `data.generator`; '' without a run)."""
  if run_cfg is None:
    return ""
  return str(run_cfg.eval.task or run_cfg.data.generator or "")


def task_prompt(text: str, run_cfg: Any) -> str:
  """The prompt as the run's task writes it in its training data; ConfigError for one it could not be.

  A Sudoku run's prompts are the 81 cells in row order, '0' for a blank: a puzzle with '.' blanks or whitespace
  is normalised to that (`tasks.sudoku.formatting.parse_grid`), anything else (13 digits, 123 characters) refused.
  """
  if run_task_name(run_cfg) != "sudoku":
    return text
  from hackable_diffusion.tasks.sudoku import formatting

  try:
    grid = formatting.parse_grid(text)
  except ValueError as e:
    shown = text if len(text) <= 40 else text[:37] + "..."
    raise ConfigError(f"prompt {shown!r} ({len(text)} characters) is not a Sudoku puzzle: {e}; this run's prompts "
                      "are the 81 cells in row order, '0' or '.' for a blank") from None
  return "".join(str(int(v)) for v in grid)


def encode_prompt(tokenizer: Any, text: str, run_cfg: Any, chat_template: str | None = None) -> list[int]:
  """Prompt token ids as training builds them (task format, chat template, bos), within the run's limits.

  `chat_template`: None = the run's. Refused with a one-line ConfigError: an empty prompt, one the run's task
  would not write (`task_prompt`), and one longer than `data.max_prompt_length` tokens (training's rule: with
  `data.on_overlength='truncate'` it keeps the last tokens instead, with a warning).
  """
  text = task_prompt(text, run_cfg)
  template = chat_template if chat_template is not None else (run_cfg.data.chat_template if run_cfg is not None
                                                              else "")
  ids = tokenizer.encode(template.format(prompt=text) if template else text)
  if run_cfg is not None and run_cfg.data.add_bos and tokenizer.bos_id >= 0:
    ids = [tokenizer.bos_id] + ids
  if not ids:
    raise ConfigError("the prompt is empty after tokenization")
  if run_cfg is not None and len(ids) > run_cfg.data.max_prompt_length:
    limit = run_cfg.data.max_prompt_length
    if run_cfg.data.on_overlength != "truncate":
      raise ConfigError(f"the prompt is {len(ids)} tokens, longer than the run's data.max_prompt_length={limit} "
                        "(training refuses such prompts); shorten it")
    print(f"warning: the prompt is {len(ids)} tokens; keeping the last {limit} (data.max_prompt_length, "
          "data.on_overlength='truncate', as in training)", file=sys.stderr)
    ids = ids[len(ids) - limit:]
  unknown = sum(i == tokenizer.unk_id for i in ids)
  if unknown:
    print(f"warning: {unknown} prompt token(s) are unknown to the tokenizer", file=sys.stderr)
  return ids


def live_view(tokenizer: Any):
  """A `generate` callback printing the first row's argmax canvas after every denoising step (to stderr).

  Create it once: the callback is part of the sampler's compile-cache key."""
  def show(info):
    text = tokenizer.decode(info.argmax_canvas[0], stop_at_eos=False)
    print(f"[canvas {info.canvas_index} step {info.step:3d}] {text}", file=sys.stderr, flush=True)
  return show


def sample(model: Any, tokenizer: Any, prompts: list[str], run_cfg: Any, *, seed: int, callback: Any = None,
           chat_template: str | None = None) -> list[str]:
  """Completions of `prompts`; every prompt is checked (`encode_prompt`) before anything is sampled."""
  import jax
  import numpy as np

  from hackable_diffusion.sampling.generate import generate

  encoded = [encode_prompt(tokenizer, p, run_cfg, chat_template) for p in prompts]
  width = max(len(e) for e in encoded)
  ids = np.full((len(encoded), width), tokenizer.pad_id if tokenizer.pad_id >= 0 else 0, np.int32)
  mask = np.zeros((len(encoded), width), bool)
  for i, e in enumerate(encoded):  # left padding
    ids[i, width - len(e):] = e
    mask[i, width - len(e):] = True
  max_new = _MAX_NEW.value or (run_cfg.eval.max_new_tokens or run_cfg.data.max_canvases * model.config.canvas_length
                               if run_cfg is not None else 256)
  config = _sampling_config(run_cfg, max_new)
  out = generate(model, ids, config, rng=jax.random.key(seed), attention_mask=mask, callback=callback)
  seqs = np.asarray(out.sequences)[:, width:]
  steps = np.asarray(out.denoising_steps)
  for i in range(len(prompts)):
    print(f"[{i}] denoising steps per canvas {steps[i].tolist()}, tokens per forward "
          f"{float(out.tokens_per_forward[i]):.2f}", file=sys.stderr)
  return [tokenizer.decode(s) for s in seqs]


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --name=value")
  model, tokenizer, run_cfg = _load()
  callback = live_view(tokenizer) if _LIVE.value else None
  if _PROMPT.value:
    for text in sample(model, tokenizer, list(_PROMPT.value), run_cfg, seed=_SEED.value, callback=callback,
                       chat_template=_CHAT_TEMPLATE.value):
      print(text)
    return
  seed = _SEED.value
  print("interactive: one prompt per line, an empty line or Ctrl-D ends", file=sys.stderr)
  while True:
    try:
      line = input("prompt> ")
    except EOFError:
      break
    if not line.strip():
      break
    try:
      print(sample(model, tokenizer, [line], run_cfg, seed=seed, callback=callback,
                   chat_template=_CHAT_TEMPLATE.value)[0], flush=True)
    except ConfigError as e:  # a refused prompt: say why, ask for the next one
      print(cli.error_line(e), file=sys.stderr, flush=True)
      continue
    seed += 1


def run() -> None:
  cli.run_cli(main)


if __name__ == "__main__":
  run()
