"""Tokens/s of the refilling loop (`hd.generate_stream`) vs fixed batches (`hd.generate`), early stopping on.

Both sample every example with its own key (`fold_in(key(seed), i)`), so both give the same completions (checked and
printed: equal accuracy by construction); what differs is the time. A fixed batch runs until its slowest row stops;
the stream refills a slot as soon as its row stops. Tokens/s = examples x generated tokens / wall seconds, each
loop's median over `--repeats` full passes run in alternation (after an untimed pass over one batch of examples
that compiles both), in one process. By default the stream takes the examples longest first (most free cells first,
`longest_first`, as the evaluation does) and the fixed batches are timed both as given (the evaluation before it
refilled rows) and in that same order; `--order=as_given` feeds the stream as given. The ideal ratio is what the
rows' own step counts allow against the fixed batches as given (each batch runs to its slowest row) if a step cost
the same in both loops and the stream had no tail.

  python scripts/benchmark_refill.py --workdir=runs/sudoku          # a trained run: its evaluation set and sampler
  python scripts/benchmark_refill.py --workdir=runs/sudoku --examples=300 --batch=64 --chunk_steps=2
  python scripts/benchmark_refill.py --workdir=runs/sudoku --t_max=2.0 --t_min=0.8 --confidence_threshold=0.1
  python scripts/benchmark_refill.py --smoke                        # a random micro model (used by the tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hackable_diffusion as hd
from hackable_diffusion.errors import HackableDiffusionError
from hackable_diffusion.sampling.stream import StreamRequest, generate_stream, longest_first


def fixed_batches(model: Any, ids: np.ndarray, mask: np.ndarray, seeds: np.ndarray | None, pins: np.ndarray | None,
                  keys: jax.Array, sampling: hd.SamplingConfig, batch: int, allowed: Any,
                  order: np.ndarray | None = None) -> list[np.ndarray]:
  """Every example's new tokens through `generate` in fixed batches of `batch` (the last one padded), the
  examples taken in `order` (None: as given); returned in example order."""
  n, width = ids.shape
  order = np.arange(n) if order is None else np.asarray(order)
  out: list[Any] = [None] * n
  for start in range(0, n, batch):
    rows = order[np.arange(start, start + batch) % n]  # the last batch padded with the first examples
    kwargs = {} if seeds is None else dict(seed_canvas=seeds[rows], pinned=pins[rows])
    res = hd.generate(model, ids[rows], sampling, rng=keys[rows], attention_mask=mask[rows],
                      allowed_token_ids=allowed, **kwargs)
    for i, tokens in zip(rows[:min(batch, n - start)], np.asarray(res.sequences)[:, width:]):
      out[i] = tokens
  return out


def streamed(model: Any, ids: np.ndarray, mask: np.ndarray, seeds: np.ndarray | None, pins: np.ndarray | None,
             keys: jax.Array, sampling: hd.SamplingConfig, batch: int, allowed: Any,
             chunk_steps: int | None, order: np.ndarray | None = None) -> tuple[list[np.ndarray], list[float]]:
  """Every example's new tokens (and mean forwards per canvas) through `generate_stream` with `batch` slots, the
  examples fed in `order` (None: as given); returned in example order."""
  n, width = ids.shape
  order = np.arange(n) if order is None else np.asarray(order)
  requests = (StreamRequest(ids[i], mask[i], None if seeds is None else seeds[i], None if pins is None else pins[i],
                            keys[i]) for i in order)
  outs = sorted(generate_stream(model, requests, sampling, rng=keys[0], batch_size=batch, prompt_length=width,
                                chunk_steps=chunk_steps, allowed_token_ids=allowed), key=lambda o: order[o.index])
  return ([o.sequence[int(mask[order[o.index]].sum()):] for o in outs],
          [float(o.denoising_steps.mean()) for o in outs])


def timed(fn) -> tuple[Any, float]:
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def compare(model, ids, mask, seeds, pins, sampling, *, batch: int, chunk_steps: int | None, allowed=None,
            seed: int = 0, score=None, repeats: int = 3, longest: bool = True) -> dict[str, Any]:
  """Both loops over every example, `repeats` times in alternation (after one untimed pass over one batch's worth
  of examples, which compiles both); tokens/s is each loop's median. The fixed batches take the examples as
  given (the evaluation before it refilled rows). With `longest` (and pins) the stream takes them longest first,
  as the evaluation does (`longest_first`), and the fixed batches also run in that order (`fixed_sorted`)."""
  n = ids.shape[0]
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(n))
  order = longest_first(pins) if longest and pins is not None else None

  def run_fixed(k: int, by: np.ndarray | None = None):
    return fixed_batches(model, ids[:k], mask[:k], cut(seeds, k), cut(pins, k), keys[:k], sampling, batch, allowed,
                         by)

  def run_stream(k: int):
    return streamed(model, ids[:k], mask[:k], cut(seeds, k), cut(pins, k), keys[:k], sampling, batch, allowed,
                    chunk_steps, None if k < n else order)

  warm = min(batch, n)
  run_fixed(warm), run_stream(warm)
  times: dict[str, list[float]] = {"fixed": [], "stream": [], "fixed_sorted": []}
  reordered_same = True
  for _ in range(repeats):
    fixed, t = timed(lambda: run_fixed(n))
    times["fixed"].append(t)
    (stream, steps), t = timed(lambda: run_stream(n))
    times["stream"].append(t)
    if order is not None:
      fixed_sorted, t = timed(lambda: run_fixed(n, order))
      times["fixed_sorted"].append(t)
      reordered_same &= all(np.array_equal(a, b) for a, b in zip(fixed, fixed_sorted))
  same = reordered_same and len(fixed) == len(stream) and all(np.array_equal(a[:len(b)], b)
                                                              for a, b in zip(fixed, stream))
  tokens = sum(len(s) for s in stream)
  rate = {k: tokens / float(np.median(v)) if v else None for k, v in times.items()}
  return {"examples": n, "batch": batch, "chunk": chunk_steps, "order": "longest first" if order is not None else
          "as given", "refill": rate["stream"], "fixed": rate["fixed"], "fixed_sorted": rate["fixed_sorted"],
          "same": same, "steps": float(np.mean(steps)), "ideal": ideal_ratio(steps, batch),
          "score": None if score is None else score(stream), "repeats": repeats}


def ideal_ratio(steps: Any, batch: int) -> float:
  """The refilling loop's ratio with no tail and no cost per call: the fixed batches' steps (each of `batch`
  examples in input order, the last padded with the first examples, runs to its slowest row) over the rows' own
  mean steps `steps [n]`."""
  per_row = np.asarray(steps, float)
  n = per_row.size
  batches = per_row[np.resize(np.arange(n), -(-n // batch) * batch).reshape(-1, batch)].max(axis=1)
  return float(batches.mean() / per_row.mean())


def cut(x: np.ndarray | None, k: int) -> np.ndarray | None:
  return None if x is None else x[:k]


def table(rows: list[dict[str, Any]]) -> str:
  lines = ["| examples | batch | chunk steps | stream order | ours tok/s | fixed-batch tok/s | ratio | fixed batches "
           "in the stream's order: tok/s | ratio | steps/canvas | ideal ratio | solved | same completions |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    solved = "-" if r["score"] is None else f"{100 * r['score']:.1f}%"
    sorted_cols = ("- | -" if r["fixed_sorted"] is None else
                   f"{r['fixed_sorted']:,.1f} | {r['refill'] / r['fixed_sorted']:.2f}x")
    lines.append(f"| {r['examples']} | {r['batch']} | {r['chunk'] or '-'} | {r['order']} | {r['refill']:,.1f} | "
                 f"{r['fixed']:,.1f} | {r['refill'] / r['fixed']:.2f}x | {sorted_cols} | {r['steps']:.1f} | "
                 f"{r['ideal']:.2f}x | {solved} | {'yes' if r['same'] else 'NO'} |")
  return "\n".join(lines)


def smoke_case() -> tuple[Any, ...]:
  """A random micro model whose rows stop at varied steps (near-greedy, every position accepted); row `i` has its
  first `i % 3` canvas positions pinned (so the stream takes them longest first)."""
  from flax import nnx

  model = hd.DiffusionGemma(hd.get_preset("tiny"), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  ids = rng.integers(1, model.config.vocab_size, size=(12, 5)).astype(np.int32)
  canvas = model.config.canvas_length
  seeds = rng.integers(1, model.config.vocab_size, size=(12, canvas)).astype(np.int32)
  pins = np.arange(canvas)[None, :] < (np.arange(12) % 3)[:, None]
  sampling = hd.SamplingConfig(max_new_tokens=model.config.canvas_length, max_denoising_steps=8,
                               confidence_threshold=50.0, stability_threshold=1, t_min=0.01, t_max=0.02,
                               entropy_bound=float("inf"))
  return model, ids, np.ones(ids.shape, bool), seeds, pins, sampling, None, None, 4


def override_sampler(sampling: hd.SamplingConfig, cap: int = 0, t_max: float = 0.0, t_min: float = 0.0,
                     confidence_threshold: float = 0.0) -> hd.SamplingConfig:
  """`sampling` with the step cap, the temperature schedule's ends and the early-stopping threshold replaced
  (0: kept)."""
  if cap:
    sampling = sampling.replace(max_denoising_steps=cap)
  if t_max:
    sampling = sampling.replace(t_max=t_max)
  if t_min:
    sampling = sampling.replace(t_min=t_min)
  if confidence_threshold:
    sampling = sampling.replace(confidence_threshold=confidence_threshold)
  return sampling


def run_case(workdir: str, examples: int, cap: int = 0, t_max: float = 0.0, t_min: float = 0.0,
             confidence_threshold: float = 0.0) -> tuple[Any, ...]:
  """A trained run's evaluation examples, start canvases, allowed tokens and early-stopping sampler (its step cap
  `cap`, temperatures `t_max` -> `t_min` and `confidence_threshold`; 0: the run's own)."""
  from hackable_diffusion.evaluation import loop as eval_loop
  from hackable_diffusion.runs import run as run_lib

  run = run_lib.load_run(workdir)
  cfg, model, tok = run.config, run.model, run.tokenizer
  data = run_lib.load_eval_data(cfg, model.config, tok, run.paths)
  n = min(examples, len(data)) if examples else len(data)
  max_new = cfg.eval.max_new_tokens or cfg.data.max_canvases * model.config.canvas_length
  # the early-stopping run, at the prompts' width as the evaluation samples it (no bucket padding)
  sampling = eval_loop.one_width(eval_loop.eval_runs(cfg.eval, max_new)[-1].sampling)
  sampling = override_sampler(sampling, cap, t_max, t_min, confidence_threshold)
  task = run_lib.eval_task(cfg)
  seeded = task.seed_canvas(data.examples[:n], tok, -(-max_new // model.config.canvas_length)
                            * model.config.canvas_length)
  seeds, pins = (None, None) if seeded is None else (np.asarray(seeded[0]), np.asarray(seeded[1]))

  def score(tokens: list[np.ndarray]) -> float:
    metrics = task.metrics([tok.decode(t) for t in tokens], data.examples[:n])
    return float(metrics[task.primary_metric])

  return (model, data.records.prompt_ids[:n], data.records.prompt_mask[:n], seeds, pins, sampling,
          task.allowed_token_ids(tok), score, cfg.eval.batch_size)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default=None, help="a trained run (e.g. runs/sudoku)")
  parser.add_argument("--examples", type=int, default=0, help="evaluation examples (0: all)")
  parser.add_argument("--batch", type=int, default=0, help="rows per batch / slots (0: the run's eval.batch_size)")
  parser.add_argument("--chunk_steps", type=int, default=0,
                      help="at most this many steps per compiled call of the stream (0: no limit, the default)")
  parser.add_argument("--cap", type=int, default=0,
                      help="early-stopping step cap (0: the run's eval.early_stopping_steps)")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="constant sampling temperature: sets --t_max and --t_min (0: the run's own)")
  parser.add_argument("--t_max", type=float, default=0.0,
                      help="temperature of the first step (0: the run's eval.sampling.t_max)")
  parser.add_argument("--t_min", type=float, default=0.0,
                      help="temperature the linear schedule ends at (0: the run's eval.sampling.t_min)")
  parser.add_argument("--confidence_threshold", type=float, default=0.0,
                      help="early-stopping confidence threshold (0: the run's eval.sampling value)")
  parser.add_argument("--repeats", type=int, default=3, help="timed passes of each loop, alternating (median)")
  parser.add_argument("--order", choices=("longest_first", "as_given"), default="longest_first",
                      help="the stream's request order: most free cells first, as the evaluation (and fixed batches "
                           "in that order too), or as given")
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args(argv)
  if not (args.smoke or args.workdir):
    parser.error("pass --workdir=<a trained run> or --smoke")
  try:
    case = smoke_case() if args.smoke else run_case(args.workdir, args.examples, args.cap,
                                                    args.t_max or args.temperature, args.t_min or args.temperature,
                                                    args.confidence_threshold)
  except (HackableDiffusionError, OSError) as e:  # a missing run, a sampler value out of range: one line
    raise SystemExit(f"error: {e}") from None
  model, ids, mask, seeds, pins, sampling, allowed, score, default_batch = case
  batch = args.batch or default_batch
  row = compare(model, ids, mask, seeds, pins, sampling, batch=batch, chunk_steps=args.chunk_steps or None,
                allowed=allowed, score=score, repeats=args.repeats, longest=args.order == "longest_first")
  print(table([row]))
  return 0 if row["same"] else 1


if __name__ == "__main__":
  from hackable_diffusion import hugepages

  hugepages.reexec_with_malloc_hugepages()  # as the CLIs do (HD_MALLOC_HUGEPAGES=0: without)
  sys.exit(main())
