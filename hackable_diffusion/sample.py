"""Sample completions from a trained run (or a HF checkpoint) with the entropy-bounded diffusion sampler.

  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="5895382"
  python -m hackable_diffusion.sample --workdir=runs/tiny                 (interactive: one prompt per line)
  python -m hackable_diffusion.sample --checkpoint=HF_DIR [--tokenizer=PATH] [--dtype=bfloat16] --prompt="..."
  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="..." --live   (watch the canvas converge)
  python -m hackable_diffusion.sample --checkpoint=HF_DIR --prompt="..." --seed_canvas="The ____ sat on the mat"

This module parses the flags, loads the model and prints; the sampling itself is `runs.sampling.sample`, which
Python code calls directly (see there for every rule below).

With --workdir the prompt gets the run's chat template (and bos) exactly as in training, is left-padded to the
run's `data.max_prompt_length` as in training and evaluation, and the sampler defaults come from the run's eval
section (the evaluation's early-stopping run; `--steps=N --noearly_stopping` is its `steps_N` run). A prompt
training would refuse is refused here too, with one line (`runs.sampling.encode_prompt`): longer than the run's
`data.max_prompt_length` in tokens (unless the run truncates, with `data.on_overlength='truncate'`), or one the
task cannot read as its prompt (its `parse_prompt` hook).

The task: the run's evaluation task (`eval.task`, else `data.generator`), or `--task=NAME` (any `get_task` name,
e.g. with --checkpoint). Its hooks apply exactly as in evaluation (`evaluation.loop.generate_texts`):
`parse_prompt` reads the typed prompt (a task may accept several notations, see docs/sampling.md),
`seed_canvas` starts the canvases (e.g. given cells pinned, uniform noise elsewhere) and `allowed_token_ids`
restricts the sampled tokens. Its `render` shows each answer (e.g. a grid and a line saying whether it is
valid), and its `prompt_complete` lets an interactive prompt span lines (a pasted grid).

Keys: prompt `j` of a call samples with its own key `fold_in(key(--seed), --example_index + j)`, the key evaluation
uses for its example number `i` (`eval.seed`; a row's result depends on its own key only). So
`--seed=<eval.seed> --example_index=i` with the prompts of evaluation examples i, i+1, ... (in order) reproduces
`evaluate`'s completions for them. Interactive mode samples each prompt on its own, `--seed` increasing by one.

Infilling (text): `--seed_canvas=TEXT` starts the completion from TEXT, where every `--placeholder` character
(default '_') is one free token position (uniform noise at the start) and the rest of TEXT, tokenized piece by
piece between the placeholders (no bos), is pinned: those tokens never change (`--nopinned`: they only start
the canvas, the sampler may change them). Positions after TEXT, up to whole canvases, are free. It replaces the
task's start canvas; the task's allowed tokens still apply (pinned tokens are kept even if not allowed).

The completions go to stdout (as the task renders them), statistics to stderr. On a GPU, JAX may reserve 0.95 of
its memory (XLA_PYTHON_CLIENT_MEM_FRACTION, set to 0.95 unless already set); set the variable to change it.
"""

from __future__ import annotations

from hackable_diffusion import hugepages

if __name__ == "__main__":  # before JAX is imported (through cli below): huge pages for malloc
  hugepages.reexec_with_malloc_hugepages()

import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from absl import flags  # noqa: E402

from hackable_diffusion import cli  # noqa: E402
from hackable_diffusion.errors import ConfigError  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by hackable_diffusion.train.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A HF DiffusionGemma directory or Hub id (instead of "
                                  "--workdir).")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer.model (default: the workdir's, or the one inside "
                                 "--checkpoint).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "Parameter dtype of --checkpoint "
                           "(auto: the dtype it was saved in). A --workdir samples in the dtype it trained in.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of the workdir (default: the latest).")
_TASK = flags.DEFINE_string("task", None, "Task whose sampler hooks (start canvas, allowed tokens) and prompt format "
                            "apply (default: the run's evaluation task; none with --checkpoint).")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text (repeat for a batch); none: interactive.")
_CHAT_TEMPLATE = flags.DEFINE_string("chat_template", None, "Format string with {prompt}, a jinja chat template, "
                                     "or 'tokenizer' (the checkpoint's chat template) (default: the run's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate (default: the run's completion "
                                "length, or 256).")
_STEPS = flags.DEFINE_integer("steps", None, "max_denoising_steps per canvas (default: the run's "
                              "eval.early_stopping_steps, or 48).")
_ENTROPY = flags.DEFINE_float("entropy_bound", None, "Entropy bound of the acceptance rule (default 0.1).")
_T_MIN = flags.DEFINE_float("t_min", None, "Temperature of the last step (default 0.4).")
_T_MAX = flags.DEFINE_float("t_max", None, "Temperature of the first step (default 0.8).")
_EARLY = flags.DEFINE_bool("early_stopping", True, "Stop a canvas once it is stable and confident.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (evaluation's: the run's eval.seed).")
_EXAMPLE_INDEX = flags.DEFINE_integer("example_index", 0, "Sample prompt j with the key of evaluation example "
                                      "number example_index + j: fold_in(key(seed), example_index + j).")
_SEED_CANVAS = flags.DEFINE_string("seed_canvas", None, "Infilling: the completion's start; each --placeholder "
                                   "character is a free token, the rest is pinned (see --pinned).")
_PLACEHOLDER = flags.DEFINE_string("placeholder", "_", "The character of --seed_canvas marking a free position.")
_PINNED = flags.DEFINE_bool("pinned", True, "Pin the non-placeholder tokens of --seed_canvas (false: they only "
                            "start the canvas).")
_LIVE = flags.DEFINE_bool("live", False, "Print the argmax canvas after every denoising step.")
_MOE_IMPL = flags.DEFINE_enum("moe_impl", None, ["auto", "tiled", "dense", "ragged", "grouped", "expert_parallel",
                                                "all_to_all"],
                              "How the MoE experts run (ModelConfig.moe_impl). Default: 'auto' for --checkpoint "
                              "(grouped matmuls on a GPU or TPU, the tiled scan on a CPU); a --workdir keeps its "
                              "run's model.moe_impl unless this is given (the values agree to float rounding).")


def _sampling_config(run_cfg: Any, model_config: Any) -> Any:
  """The run's evaluation sampler (`eval.sampling`; defaults without a run) with the command line's changes."""
  from hackable_diffusion.runs import sampling

  return sampling.default_sampling(run_cfg, model_config, max_new_tokens=_MAX_NEW.value,
                                   max_denoising_steps=_STEPS.value, early_stopping=_EARLY.value,
                                   entropy_bound=_ENTROPY.value, t_min=_T_MIN.value, t_max=_T_MAX.value)


def _run_config() -> Any:
  """The ExperimentConfig of --workdir (its config.json; read before the model, to check prompts early), or None
  with --checkpoint."""
  if bool(_WORKDIR.value) == bool(_CHECKPOINT.value):
    raise ConfigError("pass exactly one of --workdir (a training run) and --checkpoint (a HF directory)")
  if not _WORKDIR.value:
    return None
  if _DTYPE.value != "auto":
    raise ConfigError(f"--dtype={_DTYPE.value} applies to --checkpoint; a --workdir samples in the dtype it "
                      "trained in (export it with hackable_diffusion.export to load it in another dtype)")
  from hackable_diffusion.runs import run as run_lib
  from hackable_diffusion.runs.config import ExperimentConfig

  if not os.path.isdir(_WORKDIR.value):
    raise ConfigError(f"{_WORKDIR.value}: no such workdir")
  trust = cli.trust_requested()
  config = cli.workdir_config(_WORKDIR.value, trust_remote_code=trust)
  if _MOE_IMPL.value:
    cli.set_model_overrides(config, {"moe_impl": _MOE_IMPL.value})
  return ExperimentConfig.from_config_dict(config, trust_remote_code=trust)


def _load(run_cfg: Any) -> tuple[Any, Any]:
  """(model, tokenizer) of --workdir (`run_cfg` its config) or --checkpoint (`run_cfg` None)."""
  from hackable_diffusion.runs import run as run_lib

  if run_cfg is not None:
    run = run_lib.load_run(_WORKDIR.value, run_cfg, _STEP.value)
    tokenizer = run.tokenizer
    if _TOKENIZER.value:
      tokenizer = _load_tokenizer(_TOKENIZER.value)
    print(f"loaded {_WORKDIR.value} at step {run.step}", file=sys.stderr)
    return run.model, tokenizer
  from hackable_diffusion.interop.hf import load_pretrained

  model = load_pretrained(_CHECKPOINT.value, dtype=_DTYPE.value, moe_impl=_MOE_IMPL.value or "auto")
  print(f"loaded {_CHECKPOINT.value} ({model.config.param_dtype})", file=sys.stderr)
  from hackable_diffusion.hub import resolve_model_path

  # a directory (a Hub id: its cached snapshot): its tokenizer.json or tokenizer.model
  path = _TOKENIZER.value or resolve_model_path(_CHECKPOINT.value)
  return model, _load_tokenizer(path)


def _load_tokenizer(path: str):
  from hackable_diffusion.data.tokenizer import Tokenizer

  try:
    return Tokenizer.load(path)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"tokenizer: {e} (pass --tokenizer=PATH)") from None


def live_view(tokenizer: Any):
  """A `generate` callback printing the first row's argmax canvas after every denoising step (to stderr).

  Create it once: the callback is part of the sampler's compile-cache key."""
  def show(info):
    text = tokenizer.decode(info.argmax_canvas[0], stop_at_eos=False)
    print(f"[canvas {info.canvas_index} step {info.step:3d}] {text}", file=sys.stderr, flush=True)
  return show


def _sample_and_show(model: Any, tokenizer: Any, prompts: Sequence[str], run_cfg: Any, task: Any, *, seed: int,
                     callback: Any) -> str:
  """`runs.sampling.sample` with the command line's settings; the statistics to stderr, the shown text back."""
  from hackable_diffusion.runs import sampling

  check_prompt_positions(tokenizer, prompts, model.config.max_position_embeddings)
  samples = sampling.sample(model, tokenizer, list(prompts), run_cfg, sampling=_sampling_config(run_cfg, model.config),
                            seed=seed, callback=callback, chat_template=_CHAT_TEMPLATE.value, task=task,
                            example_index=_EXAMPLE_INDEX.value, seed_canvas=_SEED_CANVAS.value,
                            placeholder=_PLACEHOLDER.value, pinned=_PINNED.value)
  for i in range(len(prompts)):
    print(f"[{i}] denoising steps per canvas {samples.denoising_steps[i].tolist()}, tokens per forward "
          f"{float(samples.tokens_per_forward[i]):.2f}", file=sys.stderr)
  return sampling.render(task, samples)


def check_prompt_positions(tokenizer: Any, prompts: Sequence[str], max_positions: int) -> None:
  """A one-line `ConfigError` for a prompt whose tokens alone (before any chat template) exceed the model's
  `max_position_embeddings`: positions past it have no rotary embedding the model was trained with."""
  for i, text in enumerate(prompts):
    n = len(tokenizer.encode(text))
    if n > max_positions:
      raise ConfigError(f"prompt {i} is {n} tokens, more than the model's max_position_embeddings={max_positions}; "
                        "shorten it")


def _read_prompt(task: Any) -> str | None:
  """One interactive prompt (None: the user ended). A prompt the task reads over several lines (a pasted grid,
  its `prompt_complete`) is read line by line until it is whole or a line is empty."""
  from hackable_diffusion.tasks import base as task_lib

  try:
    text = input("prompt> ")
  except EOFError:
    return None
  if not text.strip():
    return None
  while not task_lib.prompt_complete(task, text):
    try:
      line = input("...> ")
    except EOFError:
      break
    if not line.strip():
      break
    text += "\n" + line
  return text


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --name=value")
  from hackable_diffusion.runs import sampling
  from hackable_diffusion.tasks import base as task_lib

  run_cfg = _run_config()
  task = sampling.resolve_task(run_cfg, _TASK.value)
  for text in _PROMPT.value or ():  # refused before the (slow) model loading
    task_lib.parse_prompt(task, text)
  model, tokenizer = _load(run_cfg)
  callback = live_view(tokenizer) if _LIVE.value else None
  if _PROMPT.value:
    print(_sample_and_show(model, tokenizer, _PROMPT.value, run_cfg, task, seed=_SEED.value, callback=callback))
    return
  seed = _SEED.value
  print("interactive: one prompt per line (a pasted grid may span lines), an empty line or Ctrl-D ends",
        file=sys.stderr)
  while True:
    text = _read_prompt(task)
    if text is None:
      break
    try:
      print(_sample_and_show(model, tokenizer, [text], run_cfg, task, seed=seed, callback=callback), flush=True)
    except ConfigError as e:  # a refused prompt: say why, ask for the next one
      print(cli.error_line(e), file=sys.stderr, flush=True)
      continue
    seed += 1


def run() -> None:
  cli.run_cli(main)


if __name__ == "__main__":
  run()
