"""Throughput of `hackable_diffusion.generate` vs transformers' `DiffusionGemmaForBlockDiffusion.generate`.

Both run the same random weights (a transformers model saved with `save_pretrained` and loaded with
`hd.load_pretrained`) in one process, fp32, with identical settings and a forced step count (early stopping off:
ours with `early_stopping=False`, transformers with `stability_threshold > max_denoising_steps`, so its stability
history can never fill). Reports tokens/s (batch x canvas / wall time, compile excluded) and, for ours, the split
between decoder forward passes (a decoder-only loop timed separately), the prompt encode, and the sampler.
Every timing is the minimum over repeated runs; wall seconds give tokens/s, process CPU seconds (all threads) give
the split and a load-robust view (on a shared machine torch's OpenMP threads slow down far more than XLA's).

  python scripts/benchmark_sampler.py                       # both sizes, batch 1 and 8
  python scripts/benchmark_sampler.py --sizes=a --batches=1 --markdown=/tmp/table.md
  python scripts/benchmark_sampler.py --smoke                # a micro model in seconds (used by the tests)
  python scripts/benchmark_sampler.py --vocab=262144 --batches=1,2   # sampler share of a step, before vs after
  python scripts/benchmark_sampler.py --refill --workdir=runs/sudoku  # refilling stream vs fixed batches

`--refill` runs `scripts/benchmark_refill.py` with the other arguments: on a trained run, tokens/s of the refilling
loop (`hd.generate_stream`) against fixed batches (`hd.generate`) with early stopping, the same completions in both
(its docstring has the details and options; `--refill --smoke` runs it on a micro model).

`--vocab=V` runs no transformers: a small backbone (the Sudoku preset's widths, 4 layers) at vocabulary V, canvas 256,
and times, in one process, the compiled denoising loop of this checkout ("after") and that of the row-group sampler
of the previous release ("before": `sampling/denoise.py` of git revision `--before_revision`, by default
`LEGACY_REVISION`, read with `git show` and run with its sampler, kept in `tests/sampling/legacy_sampler.py`) against a
loop of the same decoder forwards (`decode_hidden` + `lm_logits` + one max over the logits); the sampler's share of
a step is `(loop - forwards) / loop`. Both loops run with the same key and weights; the script also reports how many
argmax-canvas positions the two loops end with differently.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hackable_diffusion.sampling import generate as gen_mod
from hackable_diffusion.sampling.config import SamplingConfig
from hf_reference import hf_config  # scripts/: this script's directory

SLIDE, FULL = "sliding_attention", "full_attention"
SIZES = {
    # (text config, canvas, prompt length, steps)
    "a": (dict(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=256, num_experts=4,
               top_k_experts=2, moe_intermediate_size=128, layer_types=[SLIDE, FULL, SLIDE, FULL]), 81, 81, 48),
    "b": (dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
               sliding_window=512, num_experts=8, top_k_experts=2, moe_intermediate_size=512,
               layer_types=[SLIDE, SLIDE, SLIDE, FULL, SLIDE, SLIDE, SLIDE, FULL]), 256, 64, 4),
}
SIZES["smoke"] = (dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=8, num_experts=4,
                       top_k_experts=2, moe_intermediate_size=16, layer_types=[SLIDE, FULL]), 8, 8, 2)
NAMES = {"a": "Sudoku-size", "b": "~100M", "smoke": "micro (smoke test)"}
REPEATS = 3


def build_pair(size: str, workdir: str):
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  from hackable_diffusion.interop.hf import load_pretrained

  text, canvas, _, _ = SIZES[size]
  torch.manual_seed(0)
  ref = DiffusionGemmaForBlockDiffusion(hf_config(dict(text, initializer_range=0.05), canvas)).eval()
  path = os.path.join(workdir, f"size_{size}")
  ref.save_pretrained(path)
  ours = load_pretrained(path)
  n_params = ours.config.num_parameters()
  return ref, ours, n_params


def transformers_runner(ref, ids, canvas, steps, t_min, t_max, bound):
  """A warmed-up zero-argument callable running transformers' generate once."""
  import torch
  from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

  def run(n):
    with torch.no_grad():
      return ref.generate(torch.tensor(ids), max_new_tokens=canvas, max_denoising_steps=n, t_min=t_min, t_max=t_max,
                          sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound), stability_threshold=n + 1,
                          pad_token_id=0, eos_token_id=None)

  run(1)  # warm-up
  return lambda: run(steps)


def ours_runner(ours, ids, canvas, steps, t_min, t_max, bound):
  """(zero-argument callable running our generate once, compile seconds of its shapes)."""
  cfg = SamplingConfig(max_new_tokens=canvas, max_denoising_steps=steps, t_min=t_min, t_max=t_max,
                       entropy_bound=bound, early_stopping=False, pad_token_id=0, eos_token_id=None)

  def run(n, seed=0):
    out = gen_mod.generate(ours, ids, cfg.replace(max_denoising_steps=n), rng=jax.random.key(seed))
    steps_taken = np.asarray(out.denoising_steps)
    assert (steps_taken == n).all(), steps_taken
    return out

  start = time.perf_counter()
  run(1)  # compiles (the step count is traced: no recompile below)
  first = time.perf_counter() - start
  one_step = _best_of(lambda: run(1, seed=1), repeats=2)
  return (lambda: run(steps, seed=2)), first - one_step


def forward_runners(ours, ids, canvas, steps, bucket):
  """Callables for N decoder forwards with self-conditioning fed back (what the loop spends in the model) and for
  the prompt encode, both warmed up."""
  graphdef, state = nnx.split(ours)
  batch, prompt = ids.shape
  vocab = ours.config.vocab_size

  @jax.jit
  def encode(state, ids):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(batch, bucket)
    padded = jnp.zeros((batch, bucket), jnp.int32).at[:, :prompt].set(ids)
    mask = jnp.arange(bucket)[None, :] < prompt
    _, cache = model.encode(padded, cache, jnp.broadcast_to(mask, (batch, bucket)))
    return cache.replace(length=jnp.full((batch,), prompt, jnp.int32))

  @jax.jit
  def forwards(state, cache, n):
    model = nnx.merge(graphdef, state)
    canvas_ids = jnp.ones((batch, canvas), jnp.int32)

    def body(i, sc):
      return model.decode(canvas_ids, cache, sc, jnp.broadcast_to(i > 0, (batch,))) / 0.6

    return jax.lax.fori_loop(0, n, body, jnp.zeros((batch, canvas, vocab), jnp.float32))

  ids = jnp.asarray(ids, jnp.int32)
  cache = jax.block_until_ready(encode(state, ids))
  jax.block_until_ready(forwards(state, cache, 1))
  return (lambda: jax.block_until_ready(forwards(state, cache, steps)),
          lambda: jax.block_until_ready(encode(state, ids)))


def minimum_times(fns: dict, rounds: int, budget_s: float, pause_s: float = 2.0) -> tuple[dict, dict]:
  """Runs each callable `rounds` times in a block (fewer once `budget_s` is spent on it) and keeps its minimum wall
  time and minimum process CPU time (all threads). The blocks are separated by a pause: interleaving torch and
  XLA calls makes each library's idle threads (which spin for a while before sleeping) slow the other one down
  badly on a 2-core machine."""
  wall = {k: float("inf") for k in fns}
  cpu = {k: float("inf") for k in fns}
  for name, fn in fns.items():
    time.sleep(pause_s)
    start = time.perf_counter()
    for _ in range(rounds):
      t, c = time.perf_counter(), time.process_time()
      fn()
      wall[name] = min(wall[name], time.perf_counter() - t)
      cpu[name] = min(cpu[name], time.process_time() - c)
      if time.perf_counter() - start > budget_s:
        break
  return wall, cpu


def _best_of(fn, repeats: int = REPEATS, budget_s: float = 40.0) -> float:
  """Minimum wall time of up to `repeats` calls (fewer once `budget_s` is spent; the machine may be shared and
  the minimum is the least disturbed run)."""
  best, spent = float("inf"), 0.0
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    best, spent = min(best, took), spent + took
    if spent > budget_s:
      break
  return best


# ---- --vocab: the sampler's share of a denoising step, before vs after ----------------------------------------
# The git revision whose `sampling/denoise.py` is the previous release's denoising loop: the row-group sampler of
# `tests/sampling/legacy_sampler.py` and a [B, C, V] self-conditioning carry (a checkout with full history has it).
LEGACY_REVISION = "6c3e697"


def _denoise_before(revision: str = LEGACY_REVISION):
  """`sampling/denoise.py` of git revision `revision` (via `git show`) wired to the legacy row-group sampler."""
  import subprocess
  import types

  from hackable_diffusion.sampling import entropy_bound

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "tests", "sampling"))
  import legacy_sampler  # noqa: E402 - the frozen copy of the legacy sample_argmax_entropy

  source = subprocess.run(["git", "show", f"{revision}:hackable_diffusion/sampling/denoise.py"], cwd=root,
                          check=True, capture_output=True, text=True).stdout
  module = types.ModuleType(f"denoise_{revision}")
  sys.modules[module.__name__] = module
  exec(compile(source, f"{revision}:denoise.py", "exec"), module.__dict__)  # noqa: S102 - this repository's code
  public = {k: getattr(entropy_bound, k) for k in dir(entropy_bound) if not k.startswith("_")}
  module.eb = types.SimpleNamespace(**public)
  module.eb.sample_argmax_entropy = legacy_sampler.sample_argmax_entropy
  return module


def sampler_share(vocab: int, batch: int, steps: int, canvas: int = 256, prompt: int = 64, rounds: int = 3,
                  budget_s: float = 60.0, before_revision: str = LEGACY_REVISION) -> dict:
  """Seconds per denoising step of the loop before / after and of the forwards alone (see the module doc)."""
  from hackable_diffusion.model.config import get_preset
  from hackable_diffusion.model.transformer import DiffusionGemma
  from hackable_diffusion.sampling import denoise as after
  from hackable_diffusion.sampling.rules import EntropyBound

  before = _denoise_before(before_revision)
  cfg = get_preset("sudoku", vocab_size=vocab, canvas_length=canvas, sliding_window=canvas)
  model = DiffusionGemma(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  bucket = SamplingConfig().bucket_prompt_length(prompt)
  ids = jnp.asarray(np.random.default_rng(batch).integers(3, vocab - 3, size=(batch, bucket)), jnp.int32)

  @jax.jit
  def encode(state, ids):
    m = nnx.merge(graphdef, state)
    cache = m.init_cache(batch, bucket + canvas)
    return m.encode(ids, cache)[1]

  cache = jax.block_until_ready(encode(state, ids))
  sampling = SamplingConfig(max_denoising_steps=steps, early_stopping=False)
  args = (jnp.zeros((batch, canvas), jnp.int32), jnp.asarray(False), jnp.zeros((batch, canvas), bool),
          jnp.ones((1, 1), bool), jnp.ones((1, 1, 1, 1), bool), jnp.zeros((batch,), bool))
  loops = {}
  for name, mod in (("before", before), ("after", after)):
    static = mod.DenoiseStatic(vocab_size=vocab, stability_threshold=1, has_pins=False, has_allowed=False,
                               has_structure=False, static_rule=None, has_callback=False, trajectory_steps=None)
    fn = jax.jit(mod.make_denoise(graphdef, static, on_trace=lambda: None, on_step=None))
    scalars = mod.DenoiseScalars.of(sampling, 0)
    loops[name] = functools.partial(fn, state, cache, jax.random.key(7), *args, scalars, EntropyBound(0.1),
                                    jnp.asarray(0, jnp.int32))

  @jax.jit
  def forwards(state, cache):
    m = nnx.merge(graphdef, state)
    canvas_ids = jnp.ones((batch, canvas), jnp.int32)
    soft = jnp.zeros((batch, canvas, cfg.hidden_size), m.dtype)

    def body(i, acc):
      logits = m.lm_logits(m.decode_hidden(canvas_ids + i, cache, soft, jnp.ones((batch,), bool)))
      return acc + jnp.max(logits, axis=-1).sum()

    return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))

  fns = {"forwards": lambda: jax.block_until_ready(forwards(state, cache))}
  outs = {}
  for name, run in loops.items():
    outs[name] = jax.block_until_ready(run())  # compile + first run
    fns[name] = lambda run=run: jax.block_until_ready(run())
  fns["forwards"]()
  wall, cpu = minimum_times(fns, rounds=rounds, budget_s=budget_s)
  differ = int((np.asarray(outs["before"][0]) != np.asarray(outs["after"][0])).sum())
  return dict(wall={k: v / steps for k, v in wall.items()}, cpu={k: v / steps for k, v in cpu.items()},
              differ=differ, positions=batch * canvas)


def main_vocab(args) -> int:
  header = ("| vocab | batch | steps | forwards s/step | before: step s | before: sampler share | after: step s "
            "| after: sampler share | argmax positions differing | load avg |")
  rows = []
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU threads, "
        f"load average {os.getloadavg()[0]:.1f}", flush=True)
  for batch in (int(b) for b in args.batches.split(",")):
    r = sampler_share(args.vocab, batch, args.steps_b, rounds=args.rounds or 3, budget_s=args.budget_s,
                      before_revision=args.before_revision)
    c = r["cpu"]  # process CPU seconds (robust to other load on a shared machine)
    share = {k: max(c[k] - c["forwards"], 0.0) / c[k] for k in ("before", "after")}
    row = (f"| {args.vocab} | {batch} | {args.steps_b} | {c['forwards']:.3f} | {c['before']:.3f} "
           f"| {100 * share['before']:.0f}% | {c['after']:.3f} | {100 * share['after']:.0f}% "
           f"| {r['differ']} / {r['positions']} | {os.getloadavg()[0]:.1f} |")
    print(row, flush=True)
    rows.append(row)
  table = "\n".join([header, "|" + "---|" * 10, *rows])
  print("\n" + table)
  if args.markdown:
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write(table + "\n")
  return 0


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--refill" in argv:
    import benchmark_refill  # scripts/, as hf_reference

    return benchmark_refill.main([a for a in argv if a != "--refill"])
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="a,b")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--steps_a", type=int, default=SIZES["a"][3])
  parser.add_argument("--steps_b", type=int, default=SIZES["b"][3])
  parser.add_argument("--t_min", type=float, default=0.4)
  parser.add_argument("--t_max", type=float, default=0.8)
  parser.add_argument("--entropy_bound", type=float, default=0.1)
  parser.add_argument("--rounds", type=int, default=0,
                      help="timed runs per implementation, the minimum is kept (0: 7 for size a, 3 for size b)")
  parser.add_argument("--budget_s", type=float, default=60.0, help="stop repeating a run after this many seconds")
  parser.add_argument("--markdown", default=None, help="also write the table to this file")
  parser.add_argument("--smoke", action="store_true", help="a micro model, 2 steps, batch 1 (checks the script runs)")
  parser.add_argument("--vocab", type=int, default=0,
                      help="instead: the sampler's share of a denoising step at this vocabulary, before vs after "
                      "(a small backbone, no transformers; --batches, --steps_b, --rounds apply)")
  parser.add_argument("--before_revision", default=LEGACY_REVISION,
                      help="with --vocab: the git revision whose sampling/denoise.py is timed as 'before' (default "
                      "%(default)s: the previous release's row-group sampler loop)")
  args = parser.parse_args(argv)
  if args.vocab:
    if args.batches == "1,8":
      args.batches = "1"
    return main_vocab(args)
  if args.smoke:
    args.sizes, args.batches, args.rounds = "smoke", "1", 1

  import torch

  torch.set_num_threads(os.cpu_count() or 1)
  rows = []
  header = ("| size | params | batch | steps | transformers s | ours s | transformers tok/s | ours tok/s | speed-up "
            "| transformers CPU s | ours CPU s | ours: forwards | encode | sampler | compile s | load avg |")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU threads, load average {os.getloadavg()[0]:.1f}", flush=True)
  with tempfile.TemporaryDirectory() as workdir:
    for size in args.sizes.split(","):
      ref, ours, n_params = build_pair(size, workdir)
      _, canvas, prompt, _ = SIZES[size]
      steps = {"a": args.steps_a, "b": args.steps_b}.get(size, SIZES[size][3])
      vocab = ours.config.vocab_size
      for batch in (int(b) for b in args.batches.split(",")):
        ids = np.random.default_rng(batch).integers(3, vocab - 3, size=(batch, prompt))
        settings = (canvas, steps, args.t_min, args.t_max, args.entropy_bound)
        ours_fn, compile_s = ours_runner(ours, ids, *settings)
        ref_fn = transformers_runner(ref, ids, *settings)
        fwd_fn, enc_fn = forward_runners(ours, ids, canvas, steps, SamplingConfig().bucket_prompt_length(prompt))
        rounds = args.rounds if args.rounds else (7 if size == "a" else 3)
        best, cpu = minimum_times({"ours": ours_fn, "fwd": fwd_fn, "enc": enc_fn, "ref": ref_fn},
                                  rounds=rounds, budget_s=args.budget_s, pause_s=0.0 if args.smoke else 2.0)
        t_ours, t_ref = best["ours"], best["ref"]
        tokens = batch * canvas
        # the split uses CPU seconds (robust to other load on a shared machine)
        t_fwd, t_enc, c_ours = cpu["fwd"], cpu["enc"], cpu["ours"]
        sampler = max(c_ours - t_fwd - t_enc, 0.0)
        row = (f"| {NAMES[size]} ({size}) | {n_params / 1e6:.1f}M | {batch} | {steps} | {t_ref:.2f} | {t_ours:.2f} "
               f"| {tokens / t_ref:.1f} | {tokens / t_ours:.1f} | {t_ref / t_ours:.1f}x "
               f"| {cpu['ref']:.2f} | {c_ours:.2f} "
               f"| {100 * t_fwd / c_ours:.0f}% | {100 * t_enc / c_ours:.0f}% | {100 * sampler / c_ours:.0f}% "
               f"| {compile_s:.1f} | {os.getloadavg()[0]:.1f} |")
        print(row, flush=True)
        rows.append(row)
      del ref, ours
  table = "\n".join([header, "|" + "---|" * 16, *rows])
  print(f"load average at the end: {os.getloadavg()[0]:.1f}")
  print("\n" + table)
  if args.markdown:
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write(table + "\n")
  return 0


if __name__ == "__main__":
  from hackable_diffusion import hugepages

  hugepages.reexec_with_malloc_hugepages()  # as the CLIs do (HD_MALLOC_HUGEPAGES=0: without)
  sys.exit(main())
