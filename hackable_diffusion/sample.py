"""Sample completions from a trained run (or a HF checkpoint) with the entropy-bounded diffusion sampler.

  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="5895382"
  python -m hackable_diffusion.sample --workdir=runs/tiny                 (interactive: one prompt per line)
  python -m hackable_diffusion.sample --checkpoint=HF_DIR [--tokenizer=PATH] [--dtype=bfloat16] --prompt="..."
  python -m hackable_diffusion.sample --workdir=runs/tiny --prompt="..." --live   (watch the canvas converge)
  python -m hackable_diffusion.sample --workdir=runs/sudoku --prompt="53..7....6..195....98....6.8...6...3..."
  python -m hackable_diffusion.sample --checkpoint=HF_DIR --prompt="..." --seed_canvas="The ____ sat on the mat"

With --workdir the prompt gets the run's chat template (and bos) exactly as in training, is left-padded to the
run's `data.max_prompt_length` as in training and evaluation, and the sampler defaults come from the run's eval
section (the evaluation's early-stopping run; `--steps=N --noearly_stopping` is its `steps_N` run). A prompt
training would refuse is refused here too, with one line (`encode_prompt`): longer than the run's
`data.max_prompt_length` in tokens (unless the run truncates, with `data.on_overlength='truncate'`), or, on a
Sudoku task, not a puzzle.

The task: the run's evaluation task (`eval.task`, else `data.generator`), or `--task=NAME` (any `get_task` name;
e.g. `--task=sudoku` with --checkpoint). Its sampler hooks apply exactly as in evaluation
(`evaluation.loop.generate_texts`): `seed_canvas` starts the canvases (Sudoku: the givens pinned, uniform noise
elsewhere) and `allowed_token_ids` restricts the sampled tokens (Sudoku: the digits 1-9).

Sudoku: a puzzle is 81 cells in row order, a digit 1-9 or a blank ('.', '0' or '_'); whitespace, newlines and
the box separators '|', '-', '+' (as `formatting.render_grid` draws them) are ignored, so a pasted grid works
(`tasks.sudoku.formatting.parse_puzzle`). A wrong cell count, a bad character or two equal givens in a row,
column or box is a one-line error. The answer is printed as a grid, then a line saying whether it is valid (a
complete grid with no clash that keeps every given).

Keys: prompt `j` of a call samples with its own key `fold_in(key(--seed), --example_index + j)`, the key evaluation
uses for its example number `i` (`eval.seed`; a row's result depends on its own key only). So
`--seed=<eval.seed> --example_index=i` with the prompts of evaluation examples i, i+1, ... (in order) reproduces
`evaluate`'s completions for them. Interactive mode samples each prompt on its own, `--seed` increasing by one.

Infilling (text): `--seed_canvas=TEXT` starts the completion from TEXT, where every `--placeholder` character
(default '_') is one free token position (uniform noise at the start) and the rest of TEXT, tokenized piece by
piece between the placeholders (no bos), is pinned: those tokens never change (`--nopinned`: they only start
the canvas, the sampler may change them). Positions after TEXT, up to whole canvases, are free. It replaces the
task's start canvas; the task's allowed tokens still apply (pinned tokens are kept even if not allowed).

The completion goes to stdout (a Sudoku answer as a grid and its verdict), statistics to stderr.
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
                            "apply, e.g. sudoku (default: the run's evaluation task; none with --checkpoint).")
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
  from hackable_diffusion.training import run as run_lib

  if not os.path.isdir(_WORKDIR.value):
    raise ConfigError(f"{_WORKDIR.value}: no such workdir")
  return run_lib.as_experiment_config(cli.workdir_config(_WORKDIR.value))


def _load(run_cfg: Any) -> tuple[Any, Any]:
  """(model, tokenizer) of --workdir (`run_cfg` its config) or --checkpoint (`run_cfg` None)."""
  from hackable_diffusion.training import run as run_lib

  if run_cfg is not None:
    run = run_lib.load_run(_WORKDIR.value, run_cfg, _STEP.value)
    tokenizer = run.tokenizer
    if _TOKENIZER.value:
      tokenizer = _load_tokenizer(_TOKENIZER.value)
    print(f"loaded {_WORKDIR.value} at step {run.step}", file=sys.stderr)
    return run.model, tokenizer
  from hackable_diffusion.interop.hf import load_pretrained

  model = load_pretrained(_CHECKPOINT.value, dtype=_DTYPE.value)
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


def run_task_name(run_cfg: Any) -> str:
  """The task a run was trained and evaluated on (`eval.task`, else `data.generator`; '' without a run)."""
  if run_cfg is None:
    return ""
  return str(run_cfg.eval.task or run_cfg.data.generator or "")


def resolve_task(run_cfg: Any, name: str | None = None) -> Any:
  """The task whose hooks sampling applies: `name` (a `get_task` name; the run's own task arguments when it is
  the run's task), else the run's evaluation task (`training.run.eval_task`); None without either."""
  from hackable_diffusion.tasks.base import get_task
  from hackable_diffusion.training import run as run_lib

  if name:
    if run_cfg is not None and name == run_task_name(run_cfg):
      return run_lib.eval_task(run_cfg)
    return get_task(name)
  return run_lib.eval_task(run_cfg) if run_cfg is not None else None


def task_prompt(text: str, task_name: str) -> str:
  """The prompt as task `task_name` writes it in its training data; ConfigError for one it could not be.

  Sudoku's prompts are the 81 cells in row order, '0' for a blank: a puzzle in any notation
  `tasks.sudoku.formatting.parse_puzzle` reads ('.', '0' or '_' blanks; whitespace and '|', '-', '+' separators)
  is normalised to that; a wrong cell count, a bad character or clashing givens is refused. Other tasks: as is.
  """
  if task_name != "sudoku":
    return text
  from hackable_diffusion.tasks.sudoku import formatting

  try:
    grid = formatting.parse_puzzle(text)
  except ValueError as e:
    shown = " ".join(text.split())
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise ConfigError(f"prompt {shown!r} ({len(text)} characters) is not a Sudoku puzzle: {e}; a puzzle is 81 cells "
                      "in row order, a digit 1-9 or a blank ('.', '0' or '_'), separators (whitespace, '|', '-', "
                      "'+') ignored") from None
  return formatting.puzzle_to_prompt(grid)


def encode_prompt(tokenizer: Any, text: str, run_cfg: Any, chat_template: str | None = None, *,
                  task_name: str | None = None) -> list[int]:
  """Prompt token ids as training builds them (task format, chat template, bos), within the run's limits.

  `chat_template`: None = the run's. `task_name`: the task whose prompt format applies (None: the run's).
  Refused with a one-line ConfigError: an empty prompt, one the task would not write (`task_prompt`), and one
  longer than `data.max_prompt_length` tokens (training's rule: with `data.on_overlength='truncate'` it keeps the
  last tokens instead, with a warning).
  """
  text = task_prompt(text, run_task_name(run_cfg) if task_name is None else task_name)
  template = chat_template if chat_template is not None else (run_cfg.data.chat_template if run_cfg is not None
                                                              else "")
  from hackable_diffusion.data.chat import chat_template_kind, format_prompt

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
    print(f"warning: the prompt is {len(ids)} tokens; keeping the last {limit} (data.max_prompt_length, "
          "data.on_overlength='truncate', as in training)", file=sys.stderr)
    ids = ids[len(ids) - limit:]
  unknown = sum(i == tokenizer.unk_id for i in ids)
  if unknown:
    print(f"warning: {unknown} prompt token(s) are unknown to the tokenizer", file=sys.stderr)
  return ids


def infill_canvas(tokenizer: Any, text: str, *, placeholder: str, num_tokens: int, vocab_size: int, rows: int,
                  pinned: bool, seed: int) -> tuple[Any, Any]:
  """(seed ids `[rows, num_tokens]` int32, pinned `[rows, num_tokens]` bool) for `--seed_canvas=text`.

  Each `placeholder` character of `text` is one free position; the text between placeholders is tokenized piece
  by piece (`tokenizer.encode`, no bos) and pinned when `pinned`. Free positions, and those after the text, start
  as uniform noise over `vocab_size` (`np.random.default_rng(seed)`); every row gets the same canvas.
  """
  import numpy as np

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


def live_view(tokenizer: Any):
  """A `generate` callback printing the first row's argmax canvas after every denoising step (to stderr).

  Create it once: the callback is part of the sampler's compile-cache key."""
  def show(info):
    text = tokenizer.decode(info.argmax_canvas[0], stop_at_eos=False)
    print(f"[canvas {info.canvas_index} step {info.step:3d}] {text}", file=sys.stderr, flush=True)
  return show


def sample(model: Any, tokenizer: Any, prompts: list[str], run_cfg: Any, *, seed: int, callback: Any = None,
           chat_template: str | None = None, task: Any = None, example_index: int = 0,
           seed_canvas: str | None = None, placeholder: str = "_", pinned: bool = True) -> list[str]:
  """Completions of `prompts`, prompt `j` sampled with the key `fold_in(key(seed), example_index + j)`.

  `task`: whose hooks apply (`resolve_task`; None: the run's evaluation task, none without a run): its
  `seed_canvas` (unless `seed_canvas` text is given, see `infill_canvas`) and `allowed_token_ids`, as evaluation
  applies them. Every prompt is checked (`encode_prompt`) before anything is sampled.
  """
  import jax
  import numpy as np

  from hackable_diffusion.sampling.generate import generate
  from hackable_diffusion.tasks.base import EvalRecord

  if task is None:
    task = resolve_task(run_cfg)
  task_name = task.name if task is not None else ""
  texts = [task_prompt(p, task_name) for p in prompts]
  encoded = [encode_prompt(tokenizer, t, run_cfg, chat_template, task_name=task_name) for t in texts]
  width = max(len(e) for e in encoded)
  if run_cfg is not None:  # training's and evaluation's left padding
    width = max(width, run_cfg.data.max_prompt_length)
  ids = np.full((len(encoded), width), tokenizer.pad_id if tokenizer.pad_id >= 0 else 0, np.int32)
  mask = np.zeros((len(encoded), width), bool)
  for i, e in enumerate(encoded):  # left padding
    ids[i, width - len(e):] = e
    mask[i, width - len(e):] = True
  max_new = _MAX_NEW.value or (run_cfg.eval.max_new_tokens or run_cfg.data.max_canvases * model.config.canvas_length
                               if run_cfg is not None else 256)
  config = _sampling_config(run_cfg, max_new)
  canvas = config.canvas_length or model.config.canvas_length
  num_tokens = -(-config.max_new_tokens // canvas) * canvas  # whole canvases, as evaluation seeds them
  if seed_canvas is not None:
    seeded = infill_canvas(tokenizer, seed_canvas, placeholder=placeholder, num_tokens=num_tokens,
                           vocab_size=model.config.vocab_size, rows=len(prompts), pinned=pinned, seed=seed)
  elif task is not None:
    seeded = task.seed_canvas([EvalRecord(prompt=t, completion="") for t in texts], tokenizer, num_tokens)
  else:
    seeded = None
  kwargs: dict[str, Any] = {}
  if seeded is not None:
    kwargs.update(seed_canvas=np.asarray(seeded[0]), pinned=np.asarray(seeded[1]))
  allowed = task.allowed_token_ids(tokenizer) if task is not None else None
  rows = jax.numpy.arange(example_index, example_index + len(prompts))
  rng = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), rows)  # one key per prompt, as evaluation
  out = generate(model, ids, config, rng=rng, attention_mask=mask, allowed_token_ids=allowed, callback=callback,
                 **kwargs)
  seqs = np.asarray(out.sequences)[:, width:]
  steps = np.asarray(out.denoising_steps)
  for i in range(len(prompts)):
    print(f"[{i}] denoising steps per canvas {steps[i].tolist()}, tokens per forward "
          f"{float(out.tokens_per_forward[i]):.2f}", file=sys.stderr)
  return [tokenizer.decode(s) for s in seqs]


def show_completion(completion: str, prompt: str, task_name: str) -> str:
  """What stdout gets for one completion: the text; for Sudoku the answer as a grid (`render_grid`) and a line
  saying whether it solves the puzzle (`solution_verdict`)."""
  if task_name != "sudoku":
    return completion
  from hackable_diffusion.tasks.sudoku import formatting, metrics

  answer = metrics.parse_prediction(completion)
  _, verdict = formatting.solution_verdict(answer, formatting.parse_grid(task_prompt(prompt, task_name)))
  return f"{formatting.render_grid(answer)}\n{verdict}"


def _sample_and_show(model: Any, tokenizer: Any, prompts: Sequence[str], run_cfg: Any, task: Any, *, seed: int,
                     callback: Any) -> str:
  completions = sample(model, tokenizer, list(prompts), run_cfg, seed=seed, callback=callback,
                       chat_template=_CHAT_TEMPLATE.value, task=task, example_index=_EXAMPLE_INDEX.value,
                       seed_canvas=_SEED_CANVAS.value, placeholder=_PLACEHOLDER.value, pinned=_PINNED.value)
  name = task.name if task is not None else ""
  sep = "\n\n" if name == "sudoku" else "\n"
  return sep.join(show_completion(c, p, name) for c, p in zip(completions, prompts))


def _read_prompt(task_name: str) -> str | None:
  """One interactive prompt (None: the user ended). A Sudoku puzzle may span lines (a pasted grid): lines are
  read until they hold 81 cells (`formatting.count_cells`) or one is empty."""
  try:
    text = input("prompt> ")
  except EOFError:
    return None
  if not text.strip():
    return None
  if task_name == "sudoku":
    from hackable_diffusion.tasks.sudoku import formatting, solver

    while formatting.count_cells(text) < solver.NUM_CELLS:
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
  run_cfg = _run_config()
  task = resolve_task(run_cfg, _TASK.value)
  task_name = task.name if task is not None else ""
  for text in _PROMPT.value or ():  # refused before the (slow) model loading
    task_prompt(text, task_name)
  model, tokenizer = _load(run_cfg)
  callback = live_view(tokenizer) if _LIVE.value else None
  if _PROMPT.value:
    print(_sample_and_show(model, tokenizer, _PROMPT.value, run_cfg, task, seed=_SEED.value, callback=callback))
    return
  seed = _SEED.value
  print("interactive: one prompt per line (a Sudoku grid may span lines), an empty line or Ctrl-D ends",
        file=sys.stderr)
  while True:
    text = _read_prompt(task_name)
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
