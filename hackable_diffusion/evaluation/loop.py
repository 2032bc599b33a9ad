"""Generation-based evaluation: accuracy against the denoising-step budget, as a report (a dict).

For each step budget `N` of the config (`eval.step_budgets`) the sampler runs with early stopping off and
`max_denoising_steps=N`; one more run uses early stopping with `eval.early_stopping_steps` as the cap (the
setting of transformers' `generate`). Every run decodes the completions, scores them with the `Task`, and
records the mean denoising steps per canvas and tokens per forward: the quantities the published Sudoku recipes
report (accuracy at 32 / 64 / 96 denoising steps and with early stopping, mean denoising steps per canvas;
docs/reference.md, "Sudoku benchmark").

With `mesh=` every `generate` call samples on that device mesh: the model's variables stay in the shardings they
have (a train state's training shardings; nothing is gathered onto one device), and each batch of `eval.batch_size`
examples (padded to a multiple of the mesh's batch shards, data x fsdp x expert, by repeating its first row) is
split over the batch axes. Every process runs the same programs on the same (whole) evaluation data; only the
generated tokens come back to the host. The results are those of one device: a row's random draws depend on the
key and the row only (threefry's partitionable bits), not on the batch it is padded into.

Prompts with images (chat records whose user turns hold image parts, read with the data's image processor: the
`records.images` of `EvalData`) sample with their preprocessed pixels, as `generate(..., pixel_values=...,
image_position_ids=...)` takes them: each example passes its own images (`evaluation.images`), so its completion
does not depend on the batch either.

The report is written, plotted and summarised by `evaluation.report`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from hackable_diffusion import sharding as sharding_lib
from hackable_diffusion.data.sft import SFTDataConfig, SFTRecords, load_records
from hackable_diffusion.data.tokenizer import Tokenizer
from hackable_diffusion.errors import ConfigError, DataError
from hackable_diffusion.evaluation import report as report_lib
from hackable_diffusion.evaluation.images import batch_images, example_images
from hackable_diffusion.evaluation import tries as tries_lib
from hackable_diffusion.tasks.base import EvalRecord, Task
from hackable_diffusion.tasks.base import checker as task_checker
from hackable_diffusion.sampling.checker import Checker
from hackable_diffusion.sampling.config import SamplingConfig
from hackable_diffusion.sampling.generate import generate
from hackable_diffusion.sampling.stream import StreamRequest, generate_stream, longest_first



@dataclasses.dataclass(frozen=True)
class EvalData:
  """Tokenized evaluation examples (`records`, left-padded prompts) and their texts/fields (`examples`)."""

  records: SFTRecords
  examples: list[EvalRecord]

  def __len__(self) -> int:
    return len(self.examples)


def load_eval_data(path: str, data_config: SFTDataConfig, tokenizer: Tokenizer, num_examples: int) -> EvalData:
  """The first `num_examples` records of a JSONL file, tokenized like the training data.

  Fields other than the prompt/completion (e.g. Sudoku's `givens`) are kept in `EvalRecord.fields`.
  """
  records = load_records(path, data_config, tokenizer)
  n = min(num_examples, len(records))
  records = records.select(np.arange(n))
  examples = []
  for i in range(n):
    text = records.text_record(i)  # read again from its line (a DataError if the file changed meanwhile)
    examples.append(EvalRecord(prompt=text.prompt, completion=text.completion, fields=dict(text.fields)))
  return EvalData(records=records, examples=examples)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRun:
  """One sampler setting of an evaluation."""

  name: str
  sampling: SamplingConfig
  task: Task | None = None  # overrides the evaluation's task (an ablation, e.g. Sudoku without pinned givens)
  ablation: str | None = None
  checker: bool = False  # the sampler re-noises what the task's checker flags (`eval.checker`)
  samples_per_prompt: int = 1  # tries per example, the first valid one kept (`eval.samples_per_prompt`)


def ablation_runs(eval_cfg: Any, max_new_tokens: int, make_task: Callable[[Mapping[str, Any]], Task]) -> list[EvalRun]:
  """One fixed-step run per entry of `eval_cfg.ablations` (name -> task-argument overrides), at
  `eval_cfg.ablation_steps` (0: none); `make_task(overrides)` builds the overridden task."""
  if not eval_cfg.ablations or not eval_cfg.ablation_steps:
    return []
  steps = int(eval_cfg.ablation_steps)
  sampling = eval_runs(eval_cfg, max_new_tokens)[0].sampling.replace(max_denoising_steps=steps, early_stopping=False)
  return [EvalRun(name=f"steps_{steps}/{name}", sampling=sampling.replace(
                  checker_confidence=False, checker_forget=False, checker_restarts=0, checker_step_budget=None),
                  task=make_task(dict(args)), ablation=name) for name, args in eval_cfg.ablations.items()]


def eval_runs(eval_cfg: Any, max_new_tokens: int) -> list[EvalRun]:
  """The runs of `eval_cfg` (an `EvalSection`, whose `sampling` is the sampler of every run): one per step budget
  without early stopping, one with early stopping."""
  base = eval_cfg.sampling.replace(max_new_tokens=max_new_tokens)
  extra = dict(checker=bool(getattr(eval_cfg, "checker", False)),
               samples_per_prompt=int(getattr(eval_cfg, "samples_per_prompt", 1)))
  runs = [EvalRun(name=f"steps_{n}", sampling=base.replace(max_denoising_steps=int(n), early_stopping=False), **extra)
          for n in sorted(set(eval_cfg.step_budgets))]
  runs.append(EvalRun(name="early_stopping",
                      sampling=base.replace(max_denoising_steps=int(eval_cfg.early_stopping_steps),
                                            early_stopping=True), **extra))
  return runs


def batch_rows(batch_size: int, num_examples: int, mesh: Mesh | None = None) -> int:
  """Rows of every generated batch: `batch_size` (at most the number of examples), rounded up to a multiple of
  the mesh's batch shards (data x fsdp x expert) so that the batch splits over them."""
  rows = max(1, min(batch_size, num_examples))
  shards = 1 if mesh is None else sharding_lib.num_batch_shards(mesh)
  return -(-rows // shards) * shards


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  if x.shape[0] == rows:
    return x
  reps = np.repeat(x[:1], rows - x.shape[0], axis=0)
  return np.concatenate([x, reps], axis=0)


def _pinned_from_records(records: SFTRecords, sl: slice, num_tokens: int,
                         vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(seed canvas, pinned) from the data's pinned completion tokens (`data.pinned_field`): pinned positions hold
  their token, all others uniform noise (the reference completion must not leak into the start canvas), example
  `i`'s drawn from a generator seeded with `[i, 7]` (the same in any batch)."""
  ids = records.completion_ids[sl, :num_tokens]
  pins = records.completion_pinned[sl, :num_tokens] & records.completion_mask[sl, :num_tokens]
  pad = num_tokens - ids.shape[1]
  if pad > 0:
    ids = np.pad(ids, ((0, 0), (0, pad)))
    pins = np.pad(pins, ((0, 0), (0, pad)))
  noise = np.zeros(ids.shape, np.int32)  # [rows, num_tokens]
  for row, i in enumerate(range(sl.start, sl.stop)):
    noise[row] = np.random.default_rng([i, 7]).integers(0, vocab_size, size=num_tokens)
  return np.where(pins, ids, noise).astype(np.int32), pins


def _check_per_record(task: Task, batch: tuple[Any, Any], alone: tuple[Any, Any] | None, sl: slice) -> None:
  """The last example of `sl` must get the same start canvas in its batch (`batch`) as alone (`alone`): a hook that
  draws its noise per call or by batch position would make the results depend on `eval.batch_size`."""
  same = alone is not None and all(np.array_equal(np.asarray(b)[-1], np.asarray(a)[0]) for b, a in zip(batch, alone))
  if not same:
    raise ConfigError(f"task {task.name!r}: seed_canvas gives example {sl.stop - 1} another start canvas in a batch of "
                      f"{sl.stop - sl.start} than alone; make each row depend on its own record only (draw any noise "
                      f"from the record, e.g. a generator seeded with its prompt), so results do not depend on "
                      f"eval.batch_size")


def _start_canvas(model: Any, tokenizer: Tokenizer, data: EvalData, sampling: SamplingConfig, task: Task,
                  sl: slice) -> tuple[np.ndarray, np.ndarray] | None:
  """(seed ids, pinned) [rows, whole canvases] for the examples `sl`: the task's `seed_canvas` hook, else the
  data's pinned completion tokens (`pinned_field`), else None (uniform noise)."""
  canvas = sampling.canvas_length or model.config.canvas_length
  num_tokens = -(-sampling.max_new_tokens // canvas) * canvas  # whole canvases
  seeded = task.seed_canvas(data.examples[sl], tokenizer, num_tokens)
  if seeded is not None and sl.stop - sl.start > 1:
    _check_per_record(task, seeded, task.seed_canvas(data.examples[sl.stop - 1:sl.stop], tokenizer, num_tokens),
                      sl)
  if seeded is None and data.records.completion_pinned is not None:
    seeded = _pinned_from_records(data.records, sl, num_tokens, model.config.vocab_size)
  return seeded


# the settings that decide what a run samples (besides its step cap and early stopping), recorded in its report entry
SAMPLER_FIELDS = ("t_min", "t_max", "entropy_bound", "confidence_threshold", "stability_threshold", "acceptance",
                  "self_conditioning", "checker_confidence", "checker_forget", "checker_restarts",
                  "checker_step_budget")


def sampler_fields(sampling: SamplingConfig) -> dict[str, Any]:
  """`SAMPLER_FIELDS` of `sampling` (JSON-ready; an infinite entropy bound is written as the string 'inf')."""
  out = {name: getattr(sampling, name) for name in SAMPLER_FIELDS}
  if out["entropy_bound"] == float("inf"):
    out["entropy_bound"] = "inf"
  out["acceptance_args"] = dict(sampling.acceptance_args)
  return out


def one_width(sampling: SamplingConfig) -> SamplingConfig:
  """`sampling` without prompt-length buckets, as the evaluation samples: its prompts all have one width (the data's
  `max_prompt_length`), so every call compiles for that width anyway, and a bucket would only add padding to every
  encoder pass and keys to every decoder step (Sudoku: 81 prompt tokens padded to 128, ~15% of the evaluation's
  time). Bucketing changes no result (docs/sampling.md, Compilation)."""
  return sampling.replace(prompt_length_buckets=())


def trajectory_texts(model: Any, tokenizer: Tokenizer, data: EvalData, sampling: SamplingConfig, task: Task, *,
                     rng: jax.Array, mesh: Mesh | None = None, checker: Checker | None = None) -> list[str]:
  """The first example's argmax canvas after every denoising step, decoded (batch 1 - on a mesh padded to its
  batch shards -, the task's sampler hooks; `checker`: re-noising by it, without restarts). Steps after the row
  stopped are not repeated: the list has one entry per step the sampler took."""
  sampling = one_width(sampling).replace(checker_restarts=0, checker_step_budget=None)
  if checker is None:
    sampling = sampling.replace(checker_confidence=False, checker_forget=False)
  canvas = sampling.canvas_length or model.config.canvas_length
  rows = batch_rows(1, 1, mesh)
  kwargs: dict[str, Any] = {}
  seeded = _start_canvas(model, tokenizer, data, sampling, task, slice(0, 1))
  if seeded is not None:  # the first canvas only
    kwargs.update(seed_canvas=_pad_rows(np.asarray(seeded[0])[:, :canvas], rows),
                  pinned=_pad_rows(np.asarray(seeded[1])[:, :canvas], rows))
  kwargs.update(batch_images(data.records, [0] * rows))  # the padding rows repeat the first example, images included
  out = generate(model, _pad_rows(data.records.prompt_ids[:1], rows), sampling.replace(max_new_tokens=canvas),
                 rng=rng, attention_mask=_pad_rows(data.records.prompt_mask[:1], rows),
                 allowed_token_ids=task.allowed_token_ids(tokenizer), return_trajectory=True, mesh=mesh,
                 checker=checker, **kwargs)
  taken = int(np.asarray(out.denoising_steps)[0, 0])
  frames = np.asarray(out.trajectory)[0, :taken, 0]  # [steps, C]
  return [tokenizer.decode(f) for f in frames]


def generate_texts(model: Any, tokenizer: Tokenizer, data: EvalData, sampling: SamplingConfig, task: Task, *,
                   batch_size: int, rng: jax.Array, mesh: Mesh | None = None, checker: Checker | None = None,
                   samples_per_prompt: int = 1,
                   valid: Checker | None = None) -> tuple[list[str], dict[str, float]]:
  """Generates a completion for every example; returns the decoded texts and sampler statistics.

  `checker`: the sampler re-noises what it flags (`generate(checker=...)`). `samples_per_prompt = N > 1` (needs
  `valid`, a checker): up to N tries per example, a further try only for the examples `valid` rejected in every
  earlier one (`evaluation.tries`); an example keeps its first valid try, else its first. Statistics:
  `mean_denoising_steps` and `tokens_per_forward` of the kept tries; `forwards_per_example` (decoder forwards per
  example over every try) and `tries_per_example`.

  Example `i` samples with its own key `fold_in(rng, i)` (the per-row loop, `sampling.denoise_rows`), so its
  completion does not depend on the batch it runs in. On one device the examples stream through `batch_size` slots
  (`generate_stream`: a row that stops early leaves and the next example takes its slot, so the time follows the
  steps actually taken; with early stopping and pins, the examples with the most free cells enter first,
  `longest_first`, so short rows fill the tail); on a mesh, batches of `batch_size` examples are padded to
  `batch_rows(batch_size, n, mesh)` rows (repeating the first row) and split over its batch axes (see the module
  docstring). Both give the same completions, sampled at the prompts' width (`one_width`: no bucket padding).
  Start canvases: the task's `seed_canvas` hook (called per batch of `batch_size` examples), else the data's pinned
  completion tokens (`pinned_field`) with noise drawn per example, else noise from each example's key. With the
  built-in tasks an example's completion therefore does not depend on `batch_size`.
  """
  if samples_per_prompt > 1 and valid is None:
    raise ConfigError(f"eval.samples_per_prompt={samples_per_prompt} needs a task with a checker (to tell a valid "
                      f"try), task {getattr(task, 'name', type(task).__name__)!r} has none")
  n = len(data)

  def sample(indices: np.ndarray, keys: jax.Array) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
    part = data if len(indices) == n else EvalData(records=data.records.select(indices),
                                                   examples=[data.examples[i] for i in indices])
    return _sample_examples(model, part, sampling, task, tokenizer, keys, batch_size=batch_size, mesh=mesh,
                            checker=checker)

  tried = tries_lib.sample_tries(sample, n, rng, samples_per_prompt, valid)
  texts = [tokenizer.decode(t) for t in tried.new_tokens]
  steps_per_canvas = [s[s > 0].mean() if (s > 0).any() else 0.0 for s in tried.step_rows]
  stats = {"mean_denoising_steps": float(np.mean(steps_per_canvas)),
           "tokens_per_forward": float(np.mean(tried.tokens_per_forward)),
           "forwards_per_example": float(tried.forwards.mean()), "tries_per_example": float(tried.tries.mean())}
  return texts, stats


def _sample_examples(model: Any, data: EvalData, sampling: SamplingConfig, task: Task, tokenizer: Tokenizer,
                     keys: jax.Array, *, batch_size: int, mesh: Mesh | None,
                     checker: Checker | None) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
  """(new tokens, forwards per canvas, tokens per forward) of every example of `data`, example `i` with `keys[i]`
  (the sampling of `generate_texts`)."""
  n = len(data)
  prompt_ids, prompt_mask = data.records.prompt_ids, data.records.prompt_mask
  width = prompt_ids.shape[1]
  sampling = one_width(sampling)
  allowed = task.allowed_token_ids(tokenizer)
  per = min(batch_size, n)  # examples per batch: the same batches (and seed canvases) with and without a mesh
  seeds, pins = [], []
  for start in range(0, n, per):
    seeded = _start_canvas(model, tokenizer, data, sampling, task, slice(start, min(start + per, n)))
    if seeded is not None:
      seeds.append(np.asarray(seeded[0]))
      pins.append(np.asarray(seeded[1]))
  seed_ids = np.concatenate(seeds) if seeds else None
  pinned = np.concatenate(pins) if pins else None
  if mesh is None:
    # with early stopping, the examples with the most free cells enter first (less tail; the same completions)
    order = longest_first(pinned) if pinned is not None and sampling.early_stopping else np.arange(n)
    requests = (StreamRequest(prompt_ids[i], prompt_mask[i], None if seed_ids is None else seed_ids[i],
                              None if pinned is None else pinned[i], keys[i], *example_images(data.records, int(i)))
                for i in order)  # lazily: an example's images are read when it enters a slot
    outs = sorted(generate_stream(model, requests, sampling, rng=keys[0], batch_size=per, prompt_length=width,
                                  allowed_token_ids=allowed, checker=checker), key=lambda o: order[o.index])
    new_tokens = [o.sequence[int(prompt_mask[order[o.index]].sum()):] for o in outs]
    step_rows = [o.denoising_steps for o in outs]
    tpf = [o.tokens_per_forward for o in outs]
  else:
    new_tokens, step_rows, tpf = _generate_on_mesh(model, data, sampling, allowed, keys, seed_ids, pinned,
                                                   batch_size=batch_size, mesh=mesh, checker=checker)
  return new_tokens, step_rows, tpf


def _generate_on_mesh(model: Any, data: EvalData, sampling: SamplingConfig, allowed: Any, keys: jax.Array,
                      seed_ids: np.ndarray | None, pinned: np.ndarray | None, *, batch_size: int,
                      mesh: Mesh,
                      checker: Checker | None = None) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
  """`generate` over batches on `mesh` with one key per example: (new tokens, forwards per canvas, tokens per
  forward) per example."""
  n = len(data)
  prompt_ids, prompt_mask = data.records.prompt_ids, data.records.prompt_mask
  per = min(batch_size, n)
  bs = batch_rows(batch_size, n, mesh)  # rows per batch: `per`, on a mesh rounded up to its batch shards
  new_tokens, step_rows, tpf = [], [], []
  for start in range(0, n, per):
    sl = slice(start, min(start + per, n))
    rows = sl.stop - sl.start
    kwargs: dict[str, Any] = {}
    if seed_ids is not None:
      kwargs.update(seed_canvas=_pad_rows(seed_ids[sl], bs), pinned=_pad_rows(pinned[sl], bs))
    row_index = np.concatenate([np.arange(sl.start, sl.stop), np.full(bs - rows, sl.start)])
    kwargs.update(batch_images(data.records, row_index))  # the padding rows repeat the first row, images included
    row_keys = keys[row_index]
    out = generate(model, _pad_rows(prompt_ids[sl], bs), sampling, rng=row_keys,
                   attention_mask=_pad_rows(prompt_mask[sl], bs), allowed_token_ids=allowed, mesh=mesh, checker=checker,
                   **kwargs)
    steps = np.asarray(out.denoising_steps)[:rows]
    canvas = out.sequences.shape[1] - prompt_ids.shape[1]
    canvas //= steps.shape[1]
    for tokens, row_steps in zip(np.asarray(out.sequences)[:rows, prompt_ids.shape[1]:], steps):
      ran = max(int((row_steps > 0).sum()), 1)  # the canvases after the row ended are all pad: as the stream
      new_tokens.append(tokens[:ran * canvas])
      step_rows.append(row_steps[:ran])
    tpf += [float(x) for x in np.asarray(out.tokens_per_forward)[:rows]]  # float64 mean, as the stream path
  return new_tokens, step_rows, tpf


def run_evaluation(model: Any, tokenizer: Tokenizer, data: EvalData, task: Task, runs: Sequence[EvalRun], *,
                   batch_size: int, seed: int = 0, step: int | None = None, out_dir: str | None = None,
                   num_samples: int = 8, log: Callable[[str], Any] | None = None,
                   mesh: Mesh | None = None) -> dict[str, Any]:
  """Runs every sampler setting, scores it with `task`, and (with `out_dir`) writes the report and plot.

  `mesh`: sample on that device mesh (see the module docstring). Multi-host: every process calls this with the
  same arguments but `out_dir` (None on the processes that write nothing); they run the same programs, the
  trajectory's included.

  Returns the report: `{'step', 'task', 'primary_metric', 'num_examples', 'runs': [{'name',
  'max_denoising_steps', 'early_stopping', 'ablation', 'sampling' (`sampler_fields`), 'metrics',
  'mean_denoising_steps', 'tokens_per_forward', 'seconds'}...], 'samples': [...]}` (samples: prompt / target /
  prediction of the early-stopping run).
  """
  if len(data) == 0:
    raise DataError("evaluation data holds no example")
  rng = jax.random.key(seed)
  report: dict[str, Any] = {"step": step, "task": getattr(task, "name", type(task).__name__),
                            "primary_metric": task.primary_metric, "num_examples": len(data), "runs": []}
  samples: list[str] = []
  for run in runs:
    t0 = time.perf_counter()
    run_task = run.task or task
    task_checker = _run_checker(run, run_task, tokenizer)
    texts, stats = generate_texts(model, tokenizer, data, run.sampling, run_task, batch_size=batch_size, rng=rng,
                                  mesh=mesh, checker=task_checker if run.checker else None,
                                  samples_per_prompt=run.samples_per_prompt, valid=task_checker)
    metrics = {k: float(v) for k, v in run_task.metrics(texts, data.examples).items()}
    seconds = time.perf_counter() - t0
    report["runs"].append({"name": run.name, "max_denoising_steps": run.sampling.max_denoising_steps,
                           "early_stopping": run.sampling.early_stopping, "ablation": run.ablation,
                           "sampling": sampler_fields(run.sampling), "checker": run.checker,
                           "samples_per_prompt": run.samples_per_prompt,
                           "metrics": metrics, **stats, "seconds": round(seconds, 3)})
    if run.ablation is None:
      samples = texts
    if log is not None:
      shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
      log(f"eval {run.name}: {shown}, steps/canvas={stats['mean_denoising_steps']:.1f} ({seconds:.1f}s)")
  report["samples"] = [{"prompt": e.prompt, "target": e.completion, "prediction": p}
                       for e, p in zip(data.examples[:num_samples], samples[:num_samples])]
  main_runs = [r for r in runs if r.ablation is None]
  # on a mesh every process samples the trajectory (a collective program), whether or not it writes the report
  if (out_dir is not None or mesh is not None) and main_runs:
    # the first example's canvas after every step of the last main run (early stopping by default)
    run = main_runs[-1]
    steps = trajectory_texts(model, tokenizer, data, run.sampling, task, rng=jax.random.fold_in(rng, 1_000_003),
                             mesh=mesh, checker=_run_checker(run, task, tokenizer) if run.checker else None)
    report["trajectory"] = {"run": run.name, "prompt": data.examples[0].prompt,
                            "target": data.examples[0].completion, "steps": steps}
  if out_dir is not None:
    report_lib.write_report(report, out_dir, task=task)
  return report


def _run_checker(run: EvalRun, task: Task, tokenizer: Tokenizer) -> Checker | None:
  """The task's checker when `run` uses one (re-noising or several tries); a one-line error when it has none."""
  if not run.checker and run.samples_per_prompt <= 1:
    return None
  found = task_checker(task, tokenizer)
  if found is None:
    raise ConfigError(f"eval.checker / eval.samples_per_prompt need a task with a checker; task "
                      f"{getattr(task, 'name', type(task).__name__)!r} has none (its checker(tokenizer) hook)")
  return found


__all__ = ["EvalData", "EvalRun", "SAMPLER_FIELDS", "ablation_runs", "batch_rows", "eval_runs", "generate_texts",
           "load_eval_data", "one_width", "run_evaluation", "sampler_fields", "trajectory_texts"]
